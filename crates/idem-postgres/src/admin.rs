//! The operator's view of the keys table: stats, listing, lookups (the
//! shared `idem_sql::keys`) and purges.

use idem_sql::SqlDb;
use idem_sql::keys::key_filter;
use sqlx::Postgres;

use super::*;
use crate::dialect::PgDialect;

idem_sql::key_admin!(PgStore, PgDialect);

impl PgStore {
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
