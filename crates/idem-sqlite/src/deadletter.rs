//! Dead letters of outbound calls on SQLite.
//!
//! One row per (tenant, operation, key): recording the same call again is
//! an upsert on that unique key. A redrive takes a row with one conditional
//! `UPDATE … RETURNING` (SQLite has one writer, so two redrives never both
//! match), and finishes it only with the token that `UPDATE` handed out.
//! Timestamps and holds are on the database's clock.

use std::fmt;
use std::sync::Arc;

use idem_core::{
    BoxFuture, DeadLetter, DeadLetterFilter, DeadLetterState, DeadLetterStore, Error, IdempotencyKey, NewDeadLetter,
    OutboundRequest, PendingMigration, RedriveHold, RedriveOutcome, Result, Scope, StoreErrorKind, TableName,
    clip_text,
};
use sqlx::sqlite::{SqliteConnection, SqlitePool, SqliteRow};
use sqlx::{AssertSqlSafe, Row};

use crate::store_error;

/// The default dead-letter table.
pub const DEFAULT_DEAD_LETTER_TABLE: &str = "idem_dead_letters";

/// The database's clock in milliseconds.
const NOW_MS: &str = "CAST((julianday('now') - 2440587.5) * 86400000.0 AS INTEGER)";

/// The columns every read selects, in [`decode`]'s order.
const COLUMNS: &str = "id, tenant, operation, idem_key, method, url, headers, body, attempts, last_error, state, \
                       redrives, created_at_ms, updated_at_ms, redrive_until_ms, response_status, response_body";

/// Attempts and redrives are `u32` in the API; sums stop there.
const MAX_COUNT: i64 = u32::MAX as i64;

struct Sql {
    record: String,
    get: String,
    find: String,
    begin: String,
    resolve: String,
    fail: String,
    purge: String,
}

/// Dead letters on SQLite.
///
/// ```no_run
/// # async fn demo(store: idem_sqlite::SqliteStore, letter: idem_core::NewDeadLetter) -> Result<(), idem_core::Error> {
/// use idem_core::DeadLetterStore;
/// use idem_sqlite::SqliteDeadLetters;
///
/// let letters = SqliteDeadLetters::new(store.pool().clone());
/// letters.migrate().await?;
/// // Alone:
/// letters.record(&letter).await?;
/// // Or with the business writes, in one transaction:
/// let mut tx = store.pool().begin().await.map_err(idem_sqlite::store_error)?;
/// letters.record_in(&mut tx, &letter).await?;
/// tx.commit().await.map_err(idem_sqlite::store_error)?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct SqliteDeadLetters {
    pool: SqlitePool,
    table: TableName,
    sql: Arc<Sql>,
}

impl fmt::Debug for SqliteDeadLetters {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqliteDeadLetters")
            .field("table", &self.table)
            .finish_non_exhaustive()
    }
}

impl SqliteDeadLetters {
    /// The dead letters in [`DEFAULT_DEAD_LETTER_TABLE`].
    pub fn new(pool: SqlitePool) -> Self {
        Self::with_table(
            pool,
            TableName::new(DEFAULT_DEAD_LETTER_TABLE).expect("a valid table name"),
        )
    }

    /// The dead letters in `table`.
    pub fn with_table(pool: SqlitePool, table: TableName) -> Self {
        let t = table.as_str();
        let taken = "state = 'redriving' AND redrives = ?2";
        let sql = Sql {
            // A resolved letter keeps everything: its call has been made.
            record: format!(
                "INSERT INTO {t} (tenant, operation, idem_key, method, url, headers, body, attempts, last_error, \
                 state, redrives, created_at_ms, updated_at_ms) \
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, 'dead', 0, {NOW_MS}, {NOW_MS}) \
                 ON CONFLICT (tenant, operation, idem_key) DO UPDATE SET \
                 attempts = CASE WHEN state = 'resolved' THEN attempts \
                     ELSE MIN(attempts + excluded.attempts, {MAX_COUNT}) END, \
                 last_error = CASE WHEN state = 'resolved' THEN last_error ELSE excluded.last_error END, \
                 redrive_until_ms = CASE WHEN state = 'resolved' THEN redrive_until_ms ELSE NULL END, \
                 updated_at_ms = CASE WHEN state = 'resolved' THEN updated_at_ms ELSE excluded.updated_at_ms END, \
                 state = CASE WHEN state = 'resolved' THEN state ELSE 'dead' END \
                 RETURNING id"
            ),
            get: format!("SELECT {COLUMNS} FROM {t} WHERE id = ?"),
            find: format!("SELECT {COLUMNS} FROM {t} WHERE tenant = ? AND operation = ? AND idem_key = ?"),
            begin: format!(
                "UPDATE {t} SET state = 'redriving', redrives = redrives + 1, \
                 redrive_until_ms = {NOW_MS} + ?2, updated_at_ms = {NOW_MS} \
                 WHERE id = ?1 AND redrives < {MAX_COUNT} \
                 AND (state = 'dead' OR (state = 'redriving' AND redrive_until_ms <= {NOW_MS})) \
                 RETURNING {COLUMNS}"
            ),
            resolve: format!(
                "UPDATE {t} SET state = 'resolved', response_status = ?3, response_body = ?4, \
                 redrive_until_ms = NULL, updated_at_ms = {NOW_MS} WHERE id = ?1 AND {taken}"
            ),
            fail: format!(
                "UPDATE {t} SET state = 'dead', attempts = MIN(attempts + ?3, {MAX_COUNT}), last_error = ?4, \
                 redrive_until_ms = NULL, updated_at_ms = {NOW_MS} WHERE id = ?1 AND {taken}"
            ),
            purge: format!(
                "DELETE FROM {t} WHERE id IN (SELECT id FROM {t} \
                 WHERE state = 'resolved' AND updated_at_ms < {NOW_MS} - ? ORDER BY id LIMIT ?)"
            ),
        };
        Self {
            pool,
            table,
            sql: Arc::new(sql),
        }
    }

    /// The table.
    pub fn table(&self) -> &TableName {
        &self.table
    }

    /// The pool.
    pub fn pool(&self) -> &SqlitePool {
        &self.pool
    }

    fn ddl(&self) -> Vec<String> {
        let t = self.table.as_str();
        vec![
            // Text compares byte for byte (SQLite's BINARY collation), so
            // keys that differ only in case or trailing spaces stay apart.
            format!(
                "CREATE TABLE IF NOT EXISTS {t} (
                    id INTEGER PRIMARY KEY AUTOINCREMENT,
                    tenant TEXT NOT NULL,
                    operation TEXT NOT NULL,
                    idem_key TEXT NOT NULL,
                    method TEXT NOT NULL,
                    url TEXT NOT NULL,
                    headers TEXT NOT NULL,
                    body BLOB NOT NULL,
                    attempts INTEGER NOT NULL,
                    last_error TEXT NOT NULL,
                    state TEXT NOT NULL CHECK (state IN ('dead', 'redriving', 'resolved')),
                    redrives INTEGER NOT NULL DEFAULT 0,
                    created_at_ms INTEGER NOT NULL,
                    updated_at_ms INTEGER NOT NULL,
                    redrive_until_ms INTEGER NULL,
                    response_status INTEGER NULL,
                    response_body BLOB NULL,
                    UNIQUE (tenant, operation, idem_key)
                )"
            ),
            // Listing by state, in id order; purging resolved letters.
            format!("CREATE INDEX IF NOT EXISTS {t}_state_idx ON {t} (state, id)"),
        ]
    }

    /// Creates the table and its index if they do not exist; safe to run
    /// again and from several processes.
    pub async fn migrate(&self) -> Result<()> {
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await.map_err(store_error)?;
        for ddl in self.ddl() {
            sqlx::query(AssertSqlSafe(ddl))
                .execute(&mut *tx)
                .await
                .map_err(store_error)?;
        }
        tx.commit().await.map_err(store_error)
    }

    /// What [`migrate`](Self::migrate) would run, without running it: the
    /// table's one schema version while the table does not exist, nothing
    /// once it does.
    pub async fn pending_migrations(&self) -> Result<Vec<PendingMigration>> {
        let exists: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM sqlite_master WHERE type = 'table' AND name = ?")
            .bind(self.table.as_str())
            .fetch_one(&self.pool)
            .await
            .map_err(store_error)?;
        if exists > 0 {
            return Ok(Vec::new());
        }
        Ok(vec![PendingMigration {
            version: 1,
            description: "dead letters table and state index".into(),
            statements: self.ddl(),
        }])
    }

    /// Records `letter` in the caller's open transaction (see
    /// [`DeadLetterStore::record`]): it is kept if and only if that
    /// transaction commits. Answers the letter's id.
    pub async fn record_in(&self, conn: &mut SqliteConnection, letter: &NewDeadLetter) -> Result<i64> {
        let headers = encode_headers(letter.request.headers())?;
        sqlx::query_scalar(AssertSqlSafe(self.sql.record.as_str()))
            .bind(letter.scope.tenant().as_str())
            .bind(letter.scope.operation().as_str())
            .bind(letter.key.as_str())
            .bind(letter.request.method())
            .bind(letter.request.url())
            .bind(headers)
            .bind(letter.request.body())
            .bind(i64::from(letter.attempts))
            .bind(clip_text(&letter.last_error))
            .fetch_one(conn)
            .await
            .map_err(store_error)
    }
}

impl DeadLetterStore for SqliteDeadLetters {
    fn record(&self, letter: &NewDeadLetter) -> BoxFuture<'_, Result<i64>> {
        let letter = letter.clone();
        Box::pin(async move {
            let mut conn = self.pool.acquire().await.map_err(store_error)?;
            self.record_in(&mut conn, &letter).await
        })
    }

    fn list(&self, filter: &DeadLetterFilter) -> BoxFuture<'_, Result<Vec<DeadLetter>>> {
        let filter = filter.clone();
        Box::pin(async move {
            filter.check()?;
            let mut sql = format!("SELECT {COLUMNS} FROM {} WHERE id > ?", self.table);
            for (set, clause) in [
                (filter.tenant.is_some(), " AND tenant = ?"),
                (filter.operation.is_some(), " AND operation = ?"),
                (filter.state.is_some(), " AND state = ?"),
            ] {
                if set {
                    sql.push_str(clause);
                }
            }
            sql.push_str(" ORDER BY id LIMIT ?");
            let mut query = sqlx::query(AssertSqlSafe(sql)).bind(filter.after_id.unwrap_or(i64::MIN));
            if let Some(tenant) = &filter.tenant {
                query = query.bind(tenant.as_str());
            }
            if let Some(operation) = &filter.operation {
                query = query.bind(operation.as_str());
            }
            if let Some(state) = filter.state {
                query = query.bind(state.as_str());
            }
            let rows = query
                .bind(i64::from(filter.limit))
                .fetch_all(&self.pool)
                .await
                .map_err(store_error)?;
            rows.iter().map(decode).collect()
        })
    }

    fn get(&self, id: i64) -> BoxFuture<'_, Result<Option<DeadLetter>>> {
        Box::pin(async move {
            let row = sqlx::query(AssertSqlSafe(self.sql.get.as_str()))
                .bind(id)
                .fetch_optional(&self.pool)
                .await
                .map_err(store_error)?;
            row.as_ref().map(decode).transpose()
        })
    }

    fn find(&self, scope: &Scope, key: &IdempotencyKey) -> BoxFuture<'_, Result<Option<DeadLetter>>> {
        let (scope, key) = (scope.clone(), key.clone());
        Box::pin(async move {
            let row = sqlx::query(AssertSqlSafe(self.sql.find.as_str()))
                .bind(scope.tenant().as_str())
                .bind(scope.operation().as_str())
                .bind(key.as_str())
                .fetch_optional(&self.pool)
                .await
                .map_err(store_error)?;
            row.as_ref().map(decode).transpose()
        })
    }

    fn begin_redrive(&self, id: i64, hold_ms: i64) -> BoxFuture<'_, Result<Option<RedriveHold>>> {
        Box::pin(async move {
            let hold_ms = idem_core::redrive_hold_ms(hold_ms)?;
            let row = sqlx::query(AssertSqlSafe(self.sql.begin.as_str()))
                .bind(id)
                .bind(hold_ms)
                .fetch_optional(&self.pool)
                .await
                .map_err(store_error)?;
            let Some(row) = row else { return Ok(None) };
            let dead_letter = decode(&row)?;
            Ok(Some(RedriveHold {
                token: dead_letter.redrives,
                dead_letter,
            }))
        })
    }

    fn finish_redrive(&self, id: i64, token: u32, outcome: &RedriveOutcome) -> BoxFuture<'_, Result<bool>> {
        let outcome = outcome.clone();
        Box::pin(async move {
            let query = match &outcome {
                RedriveOutcome::Resolved { status, body } => sqlx::query(AssertSqlSafe(self.sql.resolve.as_str()))
                    .bind(id)
                    .bind(i64::from(token))
                    .bind(i64::from(*status))
                    .bind(idem_core::clip_body(body)),
                RedriveOutcome::Failed { attempts, error } => sqlx::query(AssertSqlSafe(self.sql.fail.as_str()))
                    .bind(id)
                    .bind(i64::from(token))
                    .bind(i64::from(*attempts))
                    .bind(clip_text(error)),
            };
            let done = query.execute(&self.pool).await.map_err(store_error)?;
            Ok(done.rows_affected() == 1)
        })
    }

    fn purge_resolved(&self, older_than_ms: i64, limit: u32) -> BoxFuture<'_, Result<u64>> {
        Box::pin(async move {
            let done = sqlx::query(AssertSqlSafe(self.sql.purge.as_str()))
                .bind(older_than_ms.max(0))
                .bind(i64::from(limit))
                .execute(&self.pool)
                .await
                .map_err(store_error)?;
            Ok(done.rows_affected())
        })
    }
}

fn corrupt(what: String) -> Error {
    Error::store(StoreErrorKind::Other, format!("corrupt dead letter: {what}"))
}

fn encode_headers(headers: &[(String, String)]) -> Result<String> {
    serde_json::to_string(headers).map_err(|e| Error::InvalidRequest(format!("headers cannot be stored: {e}")))
}

fn decode(row: &SqliteRow) -> Result<DeadLetter> {
    let id: i64 = row.try_get("id").map_err(store_error)?;
    let text = |name: &str| -> Result<String> { row.try_get(name).map_err(store_error) };
    let count = |name: &str| -> Result<u32> {
        let n: i64 = row.try_get(name).map_err(store_error)?;
        u32::try_from(n).map_err(|_| corrupt(format!("{name} {n} of {id}")))
    };
    let headers: Vec<(String, String)> =
        serde_json::from_str(&text("headers")?).map_err(|e| corrupt(format!("headers of {id}: {e}")))?;
    let request = OutboundRequest::new(
        text("method")?,
        text("url")?,
        headers,
        row.try_get("body").map_err(store_error)?,
    )?;
    let status: Option<i64> = row.try_get("response_status").map_err(store_error)?;
    Ok(DeadLetter {
        id,
        scope: Scope::parse(&text("tenant")?, &text("operation")?)?,
        key: IdempotencyKey::new(text("idem_key")?)?,
        request,
        attempts: count("attempts")?,
        last_error: text("last_error")?,
        state: DeadLetterState::parse(&text("state")?)?,
        redrives: count("redrives")?,
        created_at_ms: row.try_get("created_at_ms").map_err(store_error)?,
        updated_at_ms: row.try_get("updated_at_ms").map_err(store_error)?,
        redrive_until_ms: row.try_get("redrive_until_ms").map_err(store_error)?,
        response_status: status
            .map(|s| u16::try_from(s).map_err(|_| corrupt(format!("response status {s} of {id}"))))
            .transpose()?,
        response_body: row.try_get("response_body").map_err(store_error)?,
    })
}
