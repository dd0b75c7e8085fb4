//! The database's clock, so instances on one database share one time.

use idem_core::{BoxFuture, Result, TimeSource};

use crate::{PgStore, store_error};

impl TimeSource for PgStore {
    /// `clock_timestamp()`: the server's current time, not the transaction's start.
    fn source_now_ms(&self) -> BoxFuture<'_, Result<i64>> {
        Box::pin(async move {
            sqlx::query_scalar::<_, i64>("SELECT (EXTRACT(EPOCH FROM clock_timestamp()) * 1000)::bigint")
                .fetch_one(self.pool())
                .await
                .map_err(store_error)
        })
    }
}
