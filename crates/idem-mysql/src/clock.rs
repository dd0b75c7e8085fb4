//! The database's clock, so instances on one database share one time.

use idem_core::{BoxFuture, Result, TimeSource};

use crate::{MySqlStore, store_error};

impl TimeSource for MySqlStore {
    /// `UTC_TIMESTAMP(6)`: independent of the session's time zone.
    fn source_now_ms(&self) -> BoxFuture<'_, Result<i64>> {
        Box::pin(async move {
            sqlx::query_scalar::<_, i64>(
                "SELECT CAST(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) DIV 1000 AS SIGNED)",
            )
            .fetch_one(self.pool())
            .await
            .map_err(store_error)
        })
    }
}
