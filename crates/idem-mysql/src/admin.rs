//! The operator's view of the keys table: stats, listing, lookups (the
//! shared `idem_sql::keys`) and purges.

use idem_sql::SqlDb;
use idem_sql::keys::key_filter;
use sqlx::MySql;

use super::*;
use crate::dialect::MySqlDialect;

idem_sql::key_admin!(MySqlStore, MySqlDialect);

impl MySqlStore {
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
