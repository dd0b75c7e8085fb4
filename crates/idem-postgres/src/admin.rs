//! The operator's view of the keys table: stats, listing, lookups (the
//! shared `idem_sql::keys`) and purges.

use idem_sql::SqlDb;
use idem_sql::keys::{self, key_filter};
use sqlx::Postgres;

use super::*;
use crate::dialect::PgDialect;

impl PgStore {
    /// How many keys the table holds, by state, at `now_ms`.
    pub async fn stats(&self, now_ms: i64) -> Result<idem_core::KeyStats> {
        keys::stats::<PgDialect>(&self.pool, &self.table, now_ms).await
    }

    /// Whether `table` exists where this store's connections look for it
    /// (their `search_path`), so the operator's commands can name a missing
    /// table as such.
    pub async fn table_exists(&self, table: &TableName) -> Result<bool> {
        keys::table_exists::<PgDialect>(&self.pool, table).await
    }

    /// Keys matching `filter` at `now_ms`, oldest first, at most `limit`.
    pub async fn list_keys(
        &self,
        filter: &idem_core::KeyFilter,
        now_ms: i64,
        limit: u32,
    ) -> Result<Vec<idem_core::KeyInfo>> {
        keys::list_keys::<PgDialect>(&self.pool, &self.table, filter, now_ms, limit).await
    }

    /// The key `key` of `scope`, by its exact value, as it is at `now_ms`.
    pub async fn find_key(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        now_ms: i64,
    ) -> Result<Option<idem_core::KeyInfo>> {
        keys::find_key::<PgDialect>(&self.pool, &self.table, scope, key, now_ms).await
    }

    /// Deletes at most `limit` keys matching `filter` at `now_ms`; answers how many.
    ///
    /// Like the sweep, the batch is taken `FOR UPDATE SKIP LOCKED`: a row a
    /// claim is taking over right now (locked, uncommitted) is skipped, not
    /// waited for, and a row whose takeover committed meanwhile is checked
    /// again on its newest version when it is locked (no longer expired: not
    /// taken). The batch is a CTE, which PostgreSQL runs once (a locking
    /// subquery under `IN` may run again for each row and lock more than
    /// the limit), and the delete repeats the filter, so no row that
    /// stopped matching is deleted whatever the plan.
    pub async fn purge_keys(&self, filter: &idem_core::KeyFilter, now_ms: i64, limit: u32) -> Result<u64> {
        let (conds, args) = key_filter::<PgDialect>(filter, now_ms, 1);
        let t = self.table.as_str();
        let sql = format!(
            "WITH batch (b_tenant, b_operation, b_key) AS (\
             SELECT tenant, operation, idem_key FROM {t} WHERE {conds} LIMIT {limit} FOR UPDATE SKIP LOCKED) \
             DELETE FROM {t} USING batch \
             WHERE tenant = b_tenant AND operation = b_operation AND idem_key = b_key AND {conds}"
        );
        // The clause is written twice; its numbered placeholders bind once.
        let q = args.into_iter().fold(sqlx::query(AssertSqlSafe(sql)), Postgres::bind);
        Ok(q.execute(&self.pool).await.map_err(store_error)?.rows_affected())
    }
}

/// The operator's commands go through the inherent methods above (the same
/// names: inherent methods are found first, so these never call themselves).
impl idem_core::KeyAdmin for PgStore {
    fn stats(&self, now_ms: i64) -> idem_core::BoxFuture<'_, Result<idem_core::KeyStats>> {
        Box::pin(PgStore::stats(self, now_ms))
    }

    fn list_keys<'a>(
        &'a self,
        filter: &'a idem_core::KeyFilter,
        now_ms: i64,
        limit: u32,
    ) -> idem_core::BoxFuture<'a, Result<Vec<idem_core::KeyInfo>>> {
        Box::pin(PgStore::list_keys(self, filter, now_ms, limit))
    }

    fn find_key<'a>(
        &'a self,
        scope: &'a Scope,
        key: &'a IdempotencyKey,
        now_ms: i64,
    ) -> idem_core::BoxFuture<'a, Result<Option<idem_core::KeyInfo>>> {
        Box::pin(PgStore::find_key(self, scope, key, now_ms))
    }

    fn purge_keys<'a>(
        &'a self,
        filter: &'a idem_core::KeyFilter,
        now_ms: i64,
        limit: u32,
    ) -> idem_core::BoxFuture<'a, Result<u64>> {
        Box::pin(PgStore::purge_keys(self, filter, now_ms, limit))
    }
}
