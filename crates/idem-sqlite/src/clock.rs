//! The database's clock. SQLite is embedded: its clock is this host's, which
//! every process sharing the file (on one host) shares too.

use idem_core::{BoxFuture, Result, TimeSource};

use crate::{SqliteStore, store_error};

impl TimeSource for SqliteStore {
    fn source_now_ms(&self) -> BoxFuture<'_, Result<i64>> {
        Box::pin(async move {
            sqlx::query_scalar::<_, i64>("SELECT CAST((julianday('now') - 2440587.5) * 86400000.0 AS INTEGER)")
                .fetch_one(self.pool())
                .await
                .map_err(store_error)
        })
    }
}
