//! The database's clock, so instances on one database share one time.

use idem_core::{BoxFuture, Result, TimeSource};

use crate::{PgDialect, PgStore};

impl TimeSource for PgStore {
    /// [`PgDialect`]'s [`NOW_MS`](idem_sql::Dialect::NOW_MS):
    /// `clock_timestamp()`, the server's current time, not the transaction's
    /// start.
    fn source_now_ms(&self) -> BoxFuture<'_, Result<i64>> {
        idem_sql::database_now_ms::<PgDialect>(self.pool())
    }
}
