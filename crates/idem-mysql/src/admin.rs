//! The operator's view of the keys table: stats, listing, lookups and
//! purges.

use super::*;

impl MySqlStore {
    /// How many keys the table holds, by state, at `now_ms`.
    pub async fn stats(&self, now_ms: i64) -> Result<idem_core::KeyStats> {
        let t = self.table.as_str();
        let (in_progress, completed, rejected, unknown, sent, expired): (i64, i64, i64, i64, i64, i64) = sqlx::query_as(AssertSqlSafe(format!(
            "SELECT CAST(COALESCE(SUM(CASE WHEN status = 0 AND expires_at_ms > ? THEN 1 ELSE 0 END), 0) AS SIGNED), \
                    CAST(COALESCE(SUM(CASE WHEN status = 1 AND expires_at_ms > ? THEN 1 ELSE 0 END), 0) AS SIGNED), \
                    CAST(COALESCE(SUM(CASE WHEN status = 2 AND expires_at_ms > ? THEN 1 ELSE 0 END), 0) AS SIGNED), \
                    CAST(COALESCE(SUM(CASE WHEN status = 3 AND expires_at_ms > ? THEN 1 ELSE 0 END), 0) AS SIGNED), \
                    CAST(COALESCE(SUM(CASE WHEN status = 4 AND expires_at_ms > ? THEN 1 ELSE 0 END), 0) AS SIGNED), \
                    CAST(COALESCE(SUM(CASE WHEN expires_at_ms <= ? THEN 1 ELSE 0 END), 0) AS SIGNED) FROM `{t}`"
        )))
        .bind(now_ms)
        .bind(now_ms)
        .bind(now_ms)
        .bind(now_ms)
        .bind(now_ms)
        .bind(now_ms)
        .fetch_one(&self.pool)
        .await
        .map_err(store_error)?;
        Ok(idem_core::KeyStats {
            in_progress: in_progress as u64,
            completed: completed as u64,
            rejected: rejected as u64,
            unknown: unknown as u64,
            sent: sent as u64,
            expired: expired as u64,
        })
    }

    /// Whether `table` exists in the connection's database, so the
    /// operator's commands can name a missing table as such.
    pub async fn table_exists(&self, table: &TableName) -> Result<bool> {
        let n: i64 = sqlx::query_scalar(
            "SELECT COUNT(*) FROM information_schema.tables WHERE table_schema = DATABASE() AND table_name = ?",
        )
        .bind(table.as_str())
        .fetch_one(&self.pool)
        .await
        .map_err(store_error)?;
        Ok(n > 0)
    }
}

/// The WHERE clause of a [`KeyFilter`] and its binds, in order after the
/// time (bound once per use: `?` placeholders are positional).
fn key_filter_sql(filter: &idem_core::KeyFilter, now_ms: i64) -> (String, Vec<KeyBind>) {
    let mut conds = Vec::new();
    let mut binds = Vec::new();
    let next = |b: KeyBind, binds: &mut Vec<KeyBind>| {
        binds.push(b);
        "?".to_owned()
    };
    if let Some(t) = &filter.tenant {
        conds.push(format!("tenant = {}", next(KeyBind::Text(t.clone()), &mut binds)));
    }
    if let Some(o) = &filter.operation {
        conds.push(format!("operation = {}", next(KeyBind::Text(o.clone()), &mut binds)));
    }
    if let Some(p) = &filter.key_prefix {
        let len = next(KeyBind::Int(p.len() as i64), &mut binds);
        let value = next(KeyBind::Text(p.clone()), &mut binds);
        conds.push(format!("LEFT(idem_key, {len}) = {value}"));
    }
    if let Some(age) = filter.older_than_ms {
        conds.push(format!(
            "created_at_ms <= {now_ms} - {}",
            next(KeyBind::Int(age), &mut binds)
        ));
    }
    match filter.state {
        Some(idem_core::KeyState::InProgress) => conds.push(format!("status = 0 AND expires_at_ms > {now_ms}")),
        Some(idem_core::KeyState::Completed) => conds.push(format!("status = 1 AND expires_at_ms > {now_ms}")),
        Some(idem_core::KeyState::Rejected) => conds.push(format!("status = 2 AND expires_at_ms > {now_ms}")),
        Some(idem_core::KeyState::Unknown) => conds.push(format!("status = 3 AND expires_at_ms > {now_ms}")),
        Some(idem_core::KeyState::Sent) => conds.push(format!("status = 4 AND expires_at_ms > {now_ms}")),
        Some(idem_core::KeyState::Expired) => conds.push(format!("expires_at_ms <= {now_ms}")),
        None => conds.push("1 = 1".into()),
    }
    (conds.join(" AND "), binds)
}

enum KeyBind {
    Text(String),
    Int(i64),
}

/// The columns an operator sees, in the order of [`KeyRow`].
const KEY_COLUMNS: &str = "tenant, operation, idem_key, status, created_at_ms, expires_at_ms, payload";

/// A row of [`KEY_COLUMNS`] (binary key columns).
type KeyRow = (Vec<u8>, Vec<u8>, Vec<u8>, i16, i64, i64, Option<Vec<u8>>);

fn key_info(
    (tenant, operation, key, status, created_at_ms, expires_at_ms, payload): KeyRow,
    now_ms: i64,
) -> idem_core::KeyInfo {
    idem_core::KeyInfo {
        tenant: String::from_utf8_lossy(&tenant).into_owned(),
        operation: String::from_utf8_lossy(&operation).into_owned(),
        key: String::from_utf8_lossy(&key).into_owned(),
        state: idem_core::KeyState::of(status, expires_at_ms, now_ms),
        created_at_ms,
        expires_at_ms,
        payload: payload.unwrap_or_default(),
    }
}

impl MySqlStore {
    /// Keys matching `filter` at `now_ms`, oldest first, at most `limit`.
    pub async fn list_keys(
        &self,
        filter: &idem_core::KeyFilter,
        now_ms: i64,
        limit: u32,
    ) -> Result<Vec<idem_core::KeyInfo>> {
        let (conds, binds) = key_filter_sql(filter, now_ms);
        let sql = format!(
            "SELECT {KEY_COLUMNS} FROM `{}` WHERE {conds} ORDER BY created_at_ms LIMIT {limit}",
            self.table.as_str()
        );
        let mut q = sqlx::query_as::<_, KeyRow>(AssertSqlSafe(sql));
        for b in binds {
            q = match b {
                KeyBind::Text(t) => q.bind(t),
                KeyBind::Int(i) => q.bind(i),
            };
        }
        let rows = q.fetch_all(&self.pool).await.map_err(store_error)?;
        Ok(rows.into_iter().map(|row| key_info(row, now_ms)).collect())
    }

    /// The key `key` of `scope`, by its exact value (byte for byte), as it
    /// is at `now_ms`.
    pub async fn find_key(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        now_ms: i64,
    ) -> Result<Option<idem_core::KeyInfo>> {
        let sql = format!(
            "SELECT {KEY_COLUMNS} FROM `{}` WHERE tenant = ? AND operation = ? AND idem_key = ?",
            self.table.as_str()
        );
        let row = sqlx::query_as::<_, KeyRow>(AssertSqlSafe(sql))
            .bind(scope.tenant().as_str().as_bytes())
            .bind(scope.operation().as_str().as_bytes())
            .bind(key.as_str().as_bytes())
            .fetch_optional(&self.pool)
            .await
            .map_err(store_error)?;
        Ok(row.map(|row| key_info(row, now_ms)))
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
        let (conds, binds) = key_filter_sql(filter, now_ms);
        let t = self.table.as_str();
        let sql = format!("DELETE FROM `{t}` WHERE {conds} ORDER BY created_at_ms LIMIT {limit}");
        let mut run = 1;
        loop {
            let mut q = sqlx::query(AssertSqlSafe(sql.clone()));
            for b in &binds {
                q = match b {
                    KeyBind::Text(t) => q.bind(t.as_str()),
                    KeyBind::Int(i) => q.bind(*i),
                };
            }
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
