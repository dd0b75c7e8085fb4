//! The database's clock, so instances on one database share one time.

use idem_core::{BoxFuture, Result, TimeSource};

use crate::{MySqlDialect, MySqlStore};

impl TimeSource for MySqlStore {
    /// [`MySqlDialect`]'s [`NOW_MS`](idem_sql::Dialect::NOW_MS):
    /// `UTC_TIMESTAMP(6)`, independent of the session's time zone.
    fn source_now_ms(&self) -> BoxFuture<'_, Result<i64>> {
        idem_sql::database_now_ms::<MySqlDialect>(self.pool())
    }
}
