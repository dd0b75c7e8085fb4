//! The database's clock. SQLite is embedded: its clock is this host's, which
//! every process sharing the file (on one host) shares too.

use idem_core::{BoxFuture, Result, TimeSource};

use crate::{SqliteDialect, SqliteStore};

impl TimeSource for SqliteStore {
    /// [`SqliteDialect`]'s [`NOW_MS`](idem_sql::Dialect::NOW_MS).
    fn source_now_ms(&self) -> BoxFuture<'_, Result<i64>> {
        idem_sql::database_now_ms::<SqliteDialect>(self.pool())
    }
}
