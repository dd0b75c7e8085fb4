//! Dead letters of outbound calls on PostgreSQL.
//!
//! One row per (tenant, operation, key): recording the same call again is
//! an `INSERT … ON CONFLICT DO UPDATE` on that unique key. A redrive takes a
//! row with one conditional `UPDATE … RETURNING` in a READ COMMITTED
//! transaction: a concurrent redrive waits for the row's lock, re-reads it
//! and no longer matches, so it answers `None` rather than a serialisation
//! failure, whatever the database's default isolation level. A redrive
//! finishes the row only with the token that `UPDATE` handed out.
//! Timestamps and holds are on the database's clock.

use std::fmt;
use std::sync::Arc;

use idem_core::{
    BoxFuture, DeadLetter, DeadLetterFilter, DeadLetterState, DeadLetterStore, Error, IdempotencyKey, NewDeadLetter,
    OutboundRequest, PendingMigration, RedriveHold, RedriveOutcome, Result, Scope, StoreErrorKind, TableName,
    clip_text,
};
use sqlx::postgres::{PgConnection, PgPool, PgRow};
use sqlx::{AssertSqlSafe, Postgres, Row, Transaction};

use crate::sql::{derived_name, fnv1a};
use crate::store_error;

/// The default dead-letter table.
pub const DEFAULT_DEAD_LETTER_TABLE: &str = "idem_dead_letters";

/// The database's clock in milliseconds, read when the statement runs.
const NOW_MS: &str = "(EXTRACT(EPOCH FROM clock_timestamp()) * 1000)::bigint";

/// The columns every read selects.
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

/// Dead letters on PostgreSQL.
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool, letter: idem_core::NewDeadLetter) -> Result<(), idem_core::Error> {
/// use idem_core::DeadLetterStore;
/// use idem_postgres::PgDeadLetters;
///
/// let letters = PgDeadLetters::new(pool.clone());
/// letters.migrate().await?;
/// // Alone:
/// letters.record(&letter).await?;
/// // Or with the business writes, in one transaction:
/// let mut tx = pool.begin().await.map_err(idem_postgres::store_error)?;
/// letters.record_in(&mut tx, &letter).await?;
/// tx.commit().await.map_err(idem_postgres::store_error)?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct PgDeadLetters {
    pool: PgPool,
    table: TableName,
    sql: Arc<Sql>,
}

impl fmt::Debug for PgDeadLetters {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgDeadLetters")
            .field("table", &self.table)
            .finish_non_exhaustive()
    }
}

impl PgDeadLetters {
    /// The dead letters in [`DEFAULT_DEAD_LETTER_TABLE`].
    pub fn new(pool: PgPool) -> Self {
        Self::with_table(
            pool,
            TableName::new(DEFAULT_DEAD_LETTER_TABLE).expect("a valid table name"),
        )
    }

    /// The dead letters in `table`.
    pub fn with_table(pool: PgPool, table: TableName) -> Self {
        let t = table.as_str();
        let taken = "state = 'redriving' AND redrives = $2";
        let resolved = format!("{t}.state = 'resolved'");
        let sql = Sql {
            // A resolved letter keeps everything: its call has been made.
            record: format!(
                "INSERT INTO {t} (tenant, operation, idem_key, method, url, headers, body, attempts, last_error, \
                 state, redrives, created_at_ms, updated_at_ms) \
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, 'dead', 0, {NOW_MS}, {NOW_MS}) \
                 ON CONFLICT (tenant, operation, idem_key) DO UPDATE SET \
                 attempts = CASE WHEN {resolved} THEN {t}.attempts \
                     ELSE LEAST({t}.attempts + EXCLUDED.attempts, {MAX_COUNT}) END, \
                 last_error = CASE WHEN {resolved} THEN {t}.last_error ELSE EXCLUDED.last_error END, \
                 redrive_until_ms = CASE WHEN {resolved} THEN {t}.redrive_until_ms ELSE NULL END, \
                 updated_at_ms = CASE WHEN {resolved} THEN {t}.updated_at_ms ELSE EXCLUDED.updated_at_ms END, \
                 state = CASE WHEN {resolved} THEN {t}.state ELSE 'dead' END \
                 RETURNING id"
            ),
            get: format!("SELECT {COLUMNS} FROM {t} WHERE id = $1"),
            find: format!("SELECT {COLUMNS} FROM {t} WHERE tenant = $1 AND operation = $2 AND idem_key = $3"),
            begin: format!(
                "UPDATE {t} SET state = 'redriving', redrives = redrives + 1, \
                 redrive_until_ms = {NOW_MS} + $2, updated_at_ms = {NOW_MS} \
                 WHERE id = $1 AND redrives < {MAX_COUNT} \
                 AND (state = 'dead' OR (state = 'redriving' AND redrive_until_ms <= {NOW_MS})) \
                 RETURNING {COLUMNS}"
            ),
            resolve: format!(
                "UPDATE {t} SET state = 'resolved', response_status = $3, response_body = $4, \
                 redrive_until_ms = NULL, updated_at_ms = {NOW_MS} WHERE id = $1 AND {taken}"
            ),
            fail: format!(
                "UPDATE {t} SET state = 'dead', attempts = LEAST(attempts + $3, {MAX_COUNT}), last_error = $4, \
                 redrive_until_ms = NULL, updated_at_ms = {NOW_MS} WHERE id = $1 AND {taken}"
            ),
            purge: format!(
                "DELETE FROM {t} WHERE id IN (SELECT id FROM {t} \
                 WHERE state = 'resolved' AND updated_at_ms < {NOW_MS} - $1 ORDER BY id LIMIT $2)"
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
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    fn ddl(&self) -> Vec<String> {
        let t = self.table.as_str();
        let unique = derived_name(&self.table, "scope_key");
        let state = derived_name(&self.table, "state_idx");
        vec![
            // The scope and key use the "C" collation, as the keys table
            // does: plain byte comparisons, so keys that differ only in case
            // or trailing spaces stay apart. The error is kept as bytes
            // (UTF-8): an error text may hold a NUL, which `text` refuses.
            format!(
                "CREATE TABLE IF NOT EXISTS {t} (
                    id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
                    tenant TEXT COLLATE \"C\" NOT NULL,
                    operation TEXT COLLATE \"C\" NOT NULL,
                    idem_key TEXT COLLATE \"C\" NOT NULL,
                    method TEXT NOT NULL,
                    url TEXT NOT NULL,
                    headers TEXT NOT NULL,
                    body BYTEA NOT NULL,
                    attempts BIGINT NOT NULL,
                    last_error BYTEA NOT NULL,
                    state TEXT COLLATE \"C\" NOT NULL CHECK (state IN ('dead', 'redriving', 'resolved')),
                    redrives BIGINT NOT NULL DEFAULT 0,
                    created_at_ms BIGINT NOT NULL,
                    updated_at_ms BIGINT NOT NULL,
                    redrive_until_ms BIGINT NULL,
                    response_status INTEGER NULL,
                    response_body BYTEA NULL,
                    CONSTRAINT {unique} UNIQUE (tenant, operation, idem_key)
                )"
            ),
            // Listing by state, in id order; purging resolved letters.
            format!("CREATE INDEX IF NOT EXISTS {state} ON {t} (state, id)"),
        ]
    }

    /// Creates the table and its index if they do not exist. Safe to run
    /// again and from several processes at once (they take turns on an
    /// advisory lock in a READ COMMITTED transaction).
    pub async fn migrate(&self) -> Result<()> {
        let mut tx = self.read_committed().await?;
        let lock_key = fnv1a(&[b"idem-postgres dead letters migrate", self.table.as_str().as_bytes()]) as i64;
        sqlx::query("SELECT pg_advisory_xact_lock($1)")
            .bind(lock_key)
            .execute(&mut *tx)
            .await
            .map_err(store_error)?;
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
        let exists: bool = sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
            .bind(self.table.as_str())
            .fetch_one(&self.pool)
            .await
            .map_err(store_error)?;
        if exists {
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
    pub async fn record_in(&self, conn: &mut PgConnection, letter: &NewDeadLetter) -> Result<i64> {
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
            .bind(clip_text(&letter.last_error).as_bytes())
            .fetch_one(conn)
            .await
            .map_err(store_error)
    }

    /// A READ COMMITTED transaction whatever the database's default: a
    /// statement that waited for a row re-reads it instead of failing to
    /// serialise.
    async fn read_committed(&self) -> Result<Transaction<'static, Postgres>> {
        self.pool
            .begin_with("BEGIN ISOLATION LEVEL READ COMMITTED")
            .await
            .map_err(store_error)
    }
}

impl DeadLetterStore for PgDeadLetters {
    fn record(&self, letter: &NewDeadLetter) -> BoxFuture<'_, Result<i64>> {
        let letter = letter.clone();
        Box::pin(async move {
            let mut tx = self.read_committed().await?;
            let id = self.record_in(&mut tx, &letter).await?;
            tx.commit().await.map_err(store_error)?;
            Ok(id)
        })
    }

    fn list(&self, filter: &DeadLetterFilter) -> BoxFuture<'_, Result<Vec<DeadLetter>>> {
        let filter = filter.clone();
        Box::pin(async move {
            filter.check()?;
            let mut sql = format!("SELECT {COLUMNS} FROM {} WHERE id > $1", self.table);
            let mut n = 1;
            for (set, column) in [
                (filter.tenant.is_some(), "tenant"),
                (filter.operation.is_some(), "operation"),
                (filter.state.is_some(), "state"),
            ] {
                if set {
                    n += 1;
                    sql.push_str(&format!(" AND {column} = ${n}"));
                }
            }
            sql.push_str(&format!(" ORDER BY id LIMIT ${}", n + 1));
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
            let mut tx = self.read_committed().await?;
            let row = sqlx::query(AssertSqlSafe(self.sql.begin.as_str()))
                .bind(id)
                .bind(hold_ms)
                .fetch_optional(&mut *tx)
                .await
                .map_err(store_error)?;
            tx.commit().await.map_err(store_error)?;
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
                    .bind(i32::from(*status))
                    .bind(idem_core::clip_body(body)),
                RedriveOutcome::Failed { attempts, error } => sqlx::query(AssertSqlSafe(self.sql.fail.as_str()))
                    .bind(id)
                    .bind(i64::from(token))
                    .bind(i64::from(*attempts))
                    .bind(clip_text(error).as_bytes()),
            };
            let mut tx = self.read_committed().await?;
            let done = query.execute(&mut *tx).await.map_err(store_error)?;
            tx.commit().await.map_err(store_error)?;
            Ok(done.rows_affected() == 1)
        })
    }

    fn purge_resolved(&self, older_than_ms: i64, limit: u32) -> BoxFuture<'_, Result<u64>> {
        Box::pin(async move {
            let mut tx = self.read_committed().await?;
            let done = sqlx::query(AssertSqlSafe(self.sql.purge.as_str()))
                .bind(older_than_ms.max(0))
                .bind(i64::from(limit))
                .execute(&mut *tx)
                .await
                .map_err(store_error)?;
            tx.commit().await.map_err(store_error)?;
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

fn decode(row: &PgRow) -> Result<DeadLetter> {
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
    let last_error: Vec<u8> = row.try_get("last_error").map_err(store_error)?;
    let status: Option<i32> = row.try_get("response_status").map_err(store_error)?;
    Ok(DeadLetter {
        id,
        scope: Scope::parse(&text("tenant")?, &text("operation")?)?,
        key: IdempotencyKey::new(text("idem_key")?)?,
        request,
        attempts: count("attempts")?,
        last_error: String::from_utf8(last_error).map_err(|_| corrupt(format!("last error of {id} is not UTF-8")))?,
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
