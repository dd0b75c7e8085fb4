//! The operator's view of the keys table: stats, listing, lookups and
//! purges.

use super::*;

impl PgStore {
    /// How many keys the table holds, by state, at `now_ms`.
    pub async fn stats(&self, now_ms: i64) -> Result<idem_core::KeyStats> {
        let t = self.table.as_str();
        let (in_progress, completed, rejected, unknown, sent, expired): (i64, i64, i64, i64, i64, i64) =
            sqlx::query_as(AssertSqlSafe(format!(
                "SELECT COUNT(*) FILTER (WHERE status = 0 AND expires_at_ms > $1), \
                    COUNT(*) FILTER (WHERE status = 1 AND expires_at_ms > $1), \
                    COUNT(*) FILTER (WHERE status = 2 AND expires_at_ms > $1), \
                    COUNT(*) FILTER (WHERE status = 3 AND expires_at_ms > $1), \
                    COUNT(*) FILTER (WHERE status = 4 AND expires_at_ms > $1), \
                    COUNT(*) FILTER (WHERE expires_at_ms <= $1) FROM {t}"
            )))
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

    /// Whether `table` exists where this store's connections look for it
    /// (their `search_path`), so the operator's commands can name a missing
    /// table as such.
    pub async fn table_exists(&self, table: &TableName) -> Result<bool> {
        sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
            .bind(table.as_str())
            .fetch_one(&self.pool)
            .await
            .map_err(store_error)
    }
}

/// The WHERE clause of a [`KeyFilter`] and its binds, numbered from `$2`
/// (`$1` is the time).
pub(crate) fn key_filter_sql(filter: &idem_core::KeyFilter) -> (String, Vec<KeyBind>) {
    let mut conds = Vec::new();
    let mut binds = Vec::new();
    let mut n = 1;
    let mut next = |b: KeyBind, binds: &mut Vec<KeyBind>| {
        n += 1;
        binds.push(b);
        format!("${n}")
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
        conds.push(format!("left(idem_key, {len}::int) = {value}"));
    }
    if let Some(age) = filter.older_than_ms {
        conds.push(format!("created_at_ms <= $1 - {}", next(KeyBind::Int(age), &mut binds)));
    }
    match filter.state {
        Some(idem_core::KeyState::InProgress) => conds.push("status = 0 AND expires_at_ms > $1".into()),
        Some(idem_core::KeyState::Completed) => conds.push("status = 1 AND expires_at_ms > $1".into()),
        Some(idem_core::KeyState::Rejected) => conds.push("status = 2 AND expires_at_ms > $1".into()),
        Some(idem_core::KeyState::Unknown) => conds.push("status = 3 AND expires_at_ms > $1".into()),
        Some(idem_core::KeyState::Sent) => conds.push("status = 4 AND expires_at_ms > $1".into()),
        Some(idem_core::KeyState::Expired) => conds.push("expires_at_ms <= $1".into()),
        None => conds.push("$1 = $1".into()),
    }
    (conds.join(" AND "), binds)
}

pub(crate) enum KeyBind {
    Text(String),
    Int(i64),
}

/// The columns an operator sees, in the order of [`KeyRow`].
pub(crate) const KEY_COLUMNS: &str = "tenant, operation, idem_key, status, created_at_ms, expires_at_ms, payload";

/// A row of [`KEY_COLUMNS`].
type KeyRow = (String, String, String, i16, i64, i64, Option<Vec<u8>>);

pub(crate) fn key_info(
    (tenant, operation, key, status, created_at_ms, expires_at_ms, payload): KeyRow,
    now_ms: i64,
) -> idem_core::KeyInfo {
    idem_core::KeyInfo {
        tenant,
        operation,
        key,
        state: idem_core::KeyState::of(status, expires_at_ms, now_ms),
        created_at_ms,
        expires_at_ms,
        payload: payload.unwrap_or_default(),
    }
}

impl PgStore {
    /// Keys matching `filter` at `now_ms`, oldest first, at most `limit`.
    pub async fn list_keys(
        &self,
        filter: &idem_core::KeyFilter,
        now_ms: i64,
        limit: u32,
    ) -> Result<Vec<idem_core::KeyInfo>> {
        let (conds, binds) = key_filter_sql(filter);
        let sql = format!(
            "SELECT {KEY_COLUMNS} FROM {} WHERE {conds} ORDER BY created_at_ms LIMIT {limit}",
            self.table.as_str()
        );
        let mut q = sqlx::query_as::<_, KeyRow>(AssertSqlSafe(sql)).bind(now_ms);
        for b in binds {
            q = match b {
                KeyBind::Text(t) => q.bind(t),
                KeyBind::Int(i) => q.bind(i),
            };
        }
        let rows = q.fetch_all(&self.pool).await.map_err(store_error)?;
        Ok(rows.into_iter().map(|row| key_info(row, now_ms)).collect())
    }

    /// The key `key` of `scope`, by its exact value, as it is at `now_ms`.
    pub async fn find_key(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        now_ms: i64,
    ) -> Result<Option<idem_core::KeyInfo>> {
        let sql = format!(
            "SELECT {KEY_COLUMNS} FROM {} WHERE tenant = $1 AND operation = $2 AND idem_key = $3",
            self.table.as_str()
        );
        let row = sqlx::query_as::<_, KeyRow>(AssertSqlSafe(sql))
            .bind(scope.tenant().as_str())
            .bind(scope.operation().as_str())
            .bind(key.as_str())
            .fetch_optional(&self.pool)
            .await
            .map_err(store_error)?;
        Ok(row.map(|row| key_info(row, now_ms)))
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
        let (conds, binds) = key_filter_sql(filter);
        let t = self.table.as_str();
        let sql = format!(
            "WITH batch (b_tenant, b_operation, b_key) AS (\
             SELECT tenant, operation, idem_key FROM {t} WHERE {conds} LIMIT {limit} FOR UPDATE SKIP LOCKED) \
             DELETE FROM {t} USING batch \
             WHERE tenant = b_tenant AND operation = b_operation AND idem_key = b_key AND {conds}"
        );
        let mut q = sqlx::query(AssertSqlSafe(sql)).bind(now_ms);
        for b in binds {
            q = match b {
                KeyBind::Text(t) => q.bind(t),
                KeyBind::Int(i) => q.bind(i),
            };
        }
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
