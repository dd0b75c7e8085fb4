//! The operator's view of a keys table, on any SQL engine: stats, listing,
//! lookups and the filter a purge deletes by. How a purge deletes under
//! concurrent claims differs by engine, and stays in each engine crate.

use idem_core::{IdempotencyKey, KeyFilter, KeyInfo, KeyState, KeyStats, Result, Scope, TableName};
use sqlx::{AssertSqlSafe, Database, Pool};

use crate::{Arg, Dialect, SqlDb, bound};

/// The columns an operator sees.
const KEY_COLUMNS: &str = "tenant, operation, idem_key, status, created_at_ms, expires_at_ms, payload";

/// The `WHERE` clause of `filter` at `now_ms`, its placeholders numbered
/// from `first`, and what it binds, in order (the time once per use, as
/// positional placeholders need).
pub fn key_filter<'f, D: Dialect>(filter: &'f KeyFilter, now_ms: i64, first: usize) -> (String, Vec<Arg<'f>>) {
    let mut conds = Vec::new();
    let mut args = Vec::new();
    let next = |arg: Arg<'f>, args: &mut Vec<Arg<'f>>| {
        args.push(arg);
        D::placeholder(first + args.len() - 1)
    };
    if let Some(t) = &filter.tenant {
        conds.push(format!("tenant = {}", next(Arg::Text(t), &mut args)));
    }
    if let Some(o) = &filter.operation {
        conds.push(format!("operation = {}", next(Arg::Text(o), &mut args)));
    }
    if let Some(p) = &filter.key_prefix {
        let len = next(Arg::Int(p.len() as i64), &mut args);
        let value = next(Arg::Text(p), &mut args);
        conds.push(format!("{} = {value}", D::prefix("idem_key", &len)));
    }
    if let Some(age) = filter.older_than_ms {
        let now = next(Arg::Int(now_ms), &mut args);
        conds.push(format!("created_at_ms <= {now} - {}", next(Arg::Int(age), &mut args)));
    }
    let live = |status: u8, args: &mut Vec<Arg<'f>>| {
        let now = next(Arg::Int(now_ms), args);
        format!("status = {status} AND expires_at_ms > {now}")
    };
    match filter.state {
        Some(KeyState::InProgress) => conds.push(live(0, &mut args)),
        Some(KeyState::Completed) => conds.push(live(1, &mut args)),
        Some(KeyState::Rejected) => conds.push(live(2, &mut args)),
        Some(KeyState::Unknown) => conds.push(live(3, &mut args)),
        Some(KeyState::Sent) => conds.push(live(4, &mut args)),
        Some(KeyState::Expired) => {
            let now = next(Arg::Int(now_ms), &mut args);
            conds.push(format!("expires_at_ms <= {now}"));
        }
        None => {}
    }
    if conds.is_empty() {
        conds.push("1 = 1".into());
    }
    (conds.join(" AND "), args)
}

/// How many keys `table` holds, by state, at `now_ms`.
pub async fn stats<D: Dialect>(pool: &Pool<D::Db>, table: &TableName, now_ms: i64) -> Result<KeyStats> {
    let states = [
        ("in_progress", "status = 0 AND expires_at_ms >"),
        ("completed", "status = 1 AND expires_at_ms >"),
        ("rejected", "status = 2 AND expires_at_ms >"),
        ("unknown", "status = 3 AND expires_at_ms >"),
        ("sent", "status = 4 AND expires_at_ms >"),
        ("expired", "expires_at_ms <="),
    ];
    let counts = states
        .iter()
        .enumerate()
        .map(|(i, (name, cond))| {
            format!(
                "CAST(COALESCE(SUM(CASE WHEN {cond} {} THEN 1 ELSE 0 END), 0) AS {}) AS {name}",
                D::placeholder(i + 1),
                D::BIGINT
            )
        })
        .collect::<Vec<_>>()
        .join(", ");
    let sql = format!("SELECT {counts} FROM {}", D::quoted(table));
    let statement = bound::<D>(AssertSqlSafe(sql), states.iter().map(|_| Arg::Int(now_ms)));
    let row = D::Db::fetch_optional_pooled(statement, pool)
        .await
        .map_err(D::error)?
        .ok_or_else(|| idem_core::Error::store(idem_core::StoreErrorKind::Other, "the counts read no row"))?;
    let count = |name: &str| -> Result<u64> { Ok(D::Db::int(&row, name).map_err(D::error)?.max(0) as u64) };
    Ok(KeyStats {
        in_progress: count("in_progress")?,
        completed: count("completed")?,
        rejected: count("rejected")?,
        unknown: count("unknown")?,
        sent: count("sent")?,
        expired: count("expired")?,
    })
}

/// Keys of `table` matching `filter` at `now_ms`, oldest first, at most
/// `limit`.
pub async fn list_keys<D: Dialect>(
    pool: &Pool<D::Db>,
    table: &TableName,
    filter: &KeyFilter,
    now_ms: i64,
    limit: u32,
) -> Result<Vec<KeyInfo>> {
    let (conds, args) = key_filter::<D>(filter, now_ms, 1);
    let sql = format!(
        "SELECT {KEY_COLUMNS} FROM {} WHERE {conds} ORDER BY created_at_ms LIMIT {limit}",
        D::quoted(table)
    );
    let statement = bound::<D>(AssertSqlSafe(sql), args);
    let rows = D::Db::fetch_all_pooled(statement, pool).await.map_err(D::error)?;
    rows.iter().map(|row| key_info::<D>(row, now_ms)).collect()
}

/// The key `key` of `scope` in `table`, by its exact value, as it is at
/// `now_ms`.
pub async fn find_key<D: Dialect>(
    pool: &Pool<D::Db>,
    table: &TableName,
    scope: &Scope,
    key: &IdempotencyKey,
    now_ms: i64,
) -> Result<Option<KeyInfo>> {
    let sql = format!(
        "SELECT {KEY_COLUMNS} FROM {} WHERE {}",
        D::quoted(table),
        crate::scoped_key::<D>(1)
    );
    let statement = bound::<D>(AssertSqlSafe(sql), crate::scoped_args(scope, key));
    let row = D::Db::fetch_optional_pooled(statement, pool).await.map_err(D::error)?;
    row.map(|row| key_info::<D>(&row, now_ms)).transpose()
}

/// Whether `table` exists where the pool's connections look for it, so
/// the operator's commands can name a missing table as such.
pub async fn table_exists<D: Dialect>(pool: &Pool<D::Db>, table: &TableName) -> Result<bool> {
    let mut conn = pool.acquire().await.map_err(D::error)?;
    Ok(!crate::migrate::columns::<D>(&mut conn, table).await?.is_empty())
}

fn key_info<D: Dialect>(row: &<D::Db as Database>::Row, now_ms: i64) -> Result<KeyInfo> {
    // Keys, scopes and operations are validated ASCII.
    let text = |name: &str| crate::shown_text::<D>(row, name);
    let int = |name: &str| D::Db::int(row, name).map_err(D::error);
    let expires_at_ms = int("expires_at_ms")?;
    Ok(KeyInfo {
        tenant: text("tenant")?,
        operation: text("operation")?,
        key: text("idem_key")?,
        state: KeyState::of(D::Db::int16(row, "status").map_err(D::error)?, expires_at_ms, now_ms),
        created_at_ms: int("created_at_ms")?,
        expires_at_ms,
        payload: D::Db::opt_bytes(row, "payload").map_err(D::error)?.unwrap_or_default(),
    })
}

/// The operator's view of a SQL keys store: its inherent `stats`,
/// `table_exists`, `list_keys` and `find_key` (from this module, over the
/// store's `pool` and `table` fields and the engine's dialect) and its
/// [`KeyAdmin`](idem_core::KeyAdmin), whose `purge_keys` is the store's own
/// inherent one (how a purge deletes under concurrent claims is the
/// engine's).
///
/// ```text
/// idem_sql::key_admin!(PgStore, PgDialect);
/// ```
#[macro_export]
macro_rules! key_admin {
    ($store:ty, $dialect:ty) => {
        impl $store {
            /// How many keys the table holds, by state, at `now_ms`.
            pub async fn stats(&self, now_ms: i64) -> ::idem_core::Result<::idem_core::KeyStats> {
                $crate::keys::stats::<$dialect>(&self.pool, &self.table, now_ms).await
            }

            /// Whether `table` exists where this store's connections look for
            /// it, so the operator's commands can name a missing table as such.
            pub async fn table_exists(&self, table: &::idem_core::TableName) -> ::idem_core::Result<bool> {
                $crate::keys::table_exists::<$dialect>(&self.pool, table).await
            }

            /// Keys matching `filter` at `now_ms`, oldest first, at most `limit`.
            pub async fn list_keys(
                &self,
                filter: &::idem_core::KeyFilter,
                now_ms: i64,
                limit: u32,
            ) -> ::idem_core::Result<Vec<::idem_core::KeyInfo>> {
                $crate::keys::list_keys::<$dialect>(&self.pool, &self.table, filter, now_ms, limit).await
            }

            /// The key `key` of `scope`, by its exact value (byte for byte), as
            /// it is at `now_ms`.
            pub async fn find_key(
                &self,
                scope: &::idem_core::Scope,
                key: &::idem_core::IdempotencyKey,
                now_ms: i64,
            ) -> ::idem_core::Result<Option<::idem_core::KeyInfo>> {
                $crate::keys::find_key::<$dialect>(&self.pool, &self.table, scope, key, now_ms).await
            }
        }

        /// The operator's commands go through the inherent methods (the
        /// same names: inherent methods are found first, so these never call
        /// themselves).
        impl ::idem_core::KeyAdmin for $store {
            fn stats(&self, now_ms: i64) -> ::idem_core::BoxFuture<'_, ::idem_core::Result<::idem_core::KeyStats>> {
                Box::pin(<$store>::stats(self, now_ms))
            }

            fn list_keys<'a>(
                &'a self,
                filter: &'a ::idem_core::KeyFilter,
                now_ms: i64,
                limit: u32,
            ) -> ::idem_core::BoxFuture<'a, ::idem_core::Result<Vec<::idem_core::KeyInfo>>> {
                Box::pin(<$store>::list_keys(self, filter, now_ms, limit))
            }

            fn find_key<'a>(
                &'a self,
                scope: &'a ::idem_core::Scope,
                key: &'a ::idem_core::IdempotencyKey,
                now_ms: i64,
            ) -> ::idem_core::BoxFuture<'a, ::idem_core::Result<Option<::idem_core::KeyInfo>>> {
                Box::pin(<$store>::find_key(self, scope, key, now_ms))
            }

            fn purge_keys<'a>(
                &'a self,
                filter: &'a ::idem_core::KeyFilter,
                now_ms: i64,
                limit: u32,
            ) -> ::idem_core::BoxFuture<'a, ::idem_core::Result<u64>> {
                Box::pin(<$store>::purge_keys(self, filter, now_ms, limit))
            }
        }
    };
}
