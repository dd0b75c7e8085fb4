//! The operator's view of the keys table: stats, listing, lookups (the
//! shared `idem_sql::keys`) and purges.

use idem_sql::SqlDb;
use idem_sql::keys::{self, key_filter};
use sqlx::MySql;

use super::*;
use crate::dialect::MySqlDialect;

impl MySqlStore {
    /// How many keys the table holds, by state, at `now_ms`.
    pub async fn stats(&self, now_ms: i64) -> Result<idem_core::KeyStats> {
        keys::stats::<MySqlDialect>(&self.pool, &self.table, now_ms).await
    }

    /// Whether `table` exists in the connection's database, so the
    /// operator's commands can name a missing table as such.
    pub async fn table_exists(&self, table: &TableName) -> Result<bool> {
        keys::table_exists::<MySqlDialect>(&self.pool, table).await
    }

    /// Keys matching `filter` at `now_ms`, oldest first, at most `limit`.
    pub async fn list_keys(
        &self,
        filter: &idem_core::KeyFilter,
        now_ms: i64,
        limit: u32,
    ) -> Result<Vec<idem_core::KeyInfo>> {
        keys::list_keys::<MySqlDialect>(&self.pool, &self.table, filter, now_ms, limit).await
    }

    /// The key `key` of `scope`, by its exact value (byte for byte), as it
    /// is at `now_ms`.
    pub async fn find_key(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        now_ms: i64,
    ) -> Result<Option<idem_core::KeyInfo>> {
        keys::find_key::<MySqlDialect>(&self.pool, &self.table, scope, key, now_ms).await
    }

    /// Deletes at most `limit` keys matching `filter` at `now_ms`; answers how many.
    ///
    /// One `DELETE … WHERE <filter>`: InnoDB evaluates the filter on each
    /// row's newest committed version under the row's lock (a locking read),
    /// waiting for a claim that holds the row, so a row claimed again since
    /// no longer matches and stays.
    ///
    /// A purge running while keys are claimed again can be chosen as the
    /// victim of a deadlock (error 1213): it deleted nothing then, and is run
    /// again, a bounded number of times with a short growing pause.
    pub async fn purge_keys(&self, filter: &idem_core::KeyFilter, now_ms: i64, limit: u32) -> Result<u64> {
        const RUNS: u32 = 10;
        let (conds, args) = key_filter::<MySqlDialect>(filter, now_ms, 1);
        let t = self.table.as_str();
        let sql = format!("DELETE FROM `{t}` WHERE {conds} ORDER BY created_at_ms LIMIT {limit}");
        let mut run = 1;
        loop {
            let q = args
                .iter()
                .copied()
                .fold(sqlx::query(AssertSqlSafe(sql.clone())), MySql::bind);
            match q.execute(&self.pool).await.map_err(store_error) {
                Ok(done) => return Ok(done.rows_affected()),
                Err(e) if e.is_contention() && run < RUNS => {
                    tracing::debug!(run, error = %e, "a purge batch met contention; running it again");
                    tokio::time::sleep(std::time::Duration::from_millis(5 * u64::from(run))).await;
                    run += 1;
                }
                Err(e) => return Err(e),
            }
        }
    }
}

/// The operator's commands go through the inherent methods above (the same
/// names: inherent methods are found first, so these never call themselves).
impl idem_core::KeyAdmin for MySqlStore {
    fn stats(&self, now_ms: i64) -> idem_core::BoxFuture<'_, Result<idem_core::KeyStats>> {
        Box::pin(MySqlStore::stats(self, now_ms))
    }

    fn list_keys<'a>(
        &'a self,
        filter: &'a idem_core::KeyFilter,
        now_ms: i64,
        limit: u32,
    ) -> idem_core::BoxFuture<'a, Result<Vec<idem_core::KeyInfo>>> {
        Box::pin(MySqlStore::list_keys(self, filter, now_ms, limit))
    }

    fn find_key<'a>(
        &'a self,
        scope: &'a Scope,
        key: &'a IdempotencyKey,
        now_ms: i64,
    ) -> idem_core::BoxFuture<'a, Result<Option<idem_core::KeyInfo>>> {
        Box::pin(MySqlStore::find_key(self, scope, key, now_ms))
    }

    fn purge_keys<'a>(
        &'a self,
        filter: &'a idem_core::KeyFilter,
        now_ms: i64,
        limit: u32,
    ) -> idem_core::BoxFuture<'a, Result<u64>> {
        Box::pin(MySqlStore::purge_keys(self, filter, now_ms, limit))
    }
}
