//! Dead letters of outbound calls on MySQL and MariaDB.
//!
//! One row per (tenant, operation, key): recording the same call again is
//! an `INSERT … ON DUPLICATE KEY UPDATE` on that unique key, whose binary
//! columns compare byte for byte. A redrive takes a row with one
//! conditional `UPDATE` by primary key in a READ COMMITTED transaction (no
//! gap locks: a redrive of a missing id never holds up new letters), checks
//! that it changed the row, and reads it back under that row's lock; a
//! concurrent redrive waits for the lock, re-reads the row and no longer
//! matches. A redrive finishes the row only with the token that `UPDATE`
//! handed out. Timestamps and holds are on the database's clock.

use std::fmt;
use std::sync::Arc;

use idem_core::{
    BoxFuture, DeadLetter, DeadLetterFilter, DeadLetterState, DeadLetterStore, Error, IdempotencyKey, NewDeadLetter,
    OutboundRequest, PendingMigration, RedriveHold, RedriveOutcome, Result, Scope, StoreErrorKind, TableName,
    clip_text,
};
use sqlx::mysql::{MySqlConnection, MySqlPool, MySqlRow};
use sqlx::{AssertSqlSafe, MySql, Row, Transaction};

use crate::store_error;

/// The default dead-letter table.
pub const DEFAULT_DEAD_LETTER_TABLE: &str = "idem_dead_letters";

/// The database's clock in milliseconds, read when the statement runs.
const NOW_MS: &str = "CAST(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) DIV 1000 AS SIGNED)";

/// The columns every read selects.
const COLUMNS: &str = "id, tenant, operation, idem_key, method, url, headers, body, attempts, last_error, state, \
                       redrives, created_at_ms, updated_at_ms, redrive_until_ms, response_status, response_body";

/// Attempts and redrives are `u32` in the API; sums stop there.
const MAX_COUNT: i64 = u32::MAX as i64;

struct Sql {
    record: String,
    get: String,
    get_for_update: String,
    find: String,
    find_id: String,
    begin: String,
    resolve: String,
    fail: String,
    purge: String,
}

/// Dead letters on MySQL or MariaDB.
///
/// ```no_run
/// # async fn demo(pool: sqlx::MySqlPool, letter: idem_core::NewDeadLetter) -> Result<(), idem_core::Error> {
/// use idem_core::DeadLetterStore;
/// use idem_mysql::MySqlDeadLetters;
///
/// let letters = MySqlDeadLetters::new(pool.clone());
/// letters.migrate().await?;
/// // Alone:
/// letters.record(&letter).await?;
/// // Or with the business writes, in one transaction:
/// let mut tx = pool.begin().await.map_err(idem_mysql::store_error)?;
/// letters.record_in(&mut tx, &letter).await?;
/// tx.commit().await.map_err(idem_mysql::store_error)?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct MySqlDeadLetters {
    pool: MySqlPool,
    table: TableName,
    sql: Arc<Sql>,
}

impl fmt::Debug for MySqlDeadLetters {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MySqlDeadLetters")
            .field("table", &self.table)
            .finish_non_exhaustive()
    }
}

impl MySqlDeadLetters {
    /// The dead letters in [`DEFAULT_DEAD_LETTER_TABLE`].
    pub fn new(pool: MySqlPool) -> Self {
        Self::with_table(
            pool,
            TableName::new(DEFAULT_DEAD_LETTER_TABLE).expect("a valid table name"),
        )
    }

    /// The dead letters in `table`.
    pub fn with_table(pool: MySqlPool, table: TableName) -> Self {
        let t = table.as_str();
        let taken = "state = 'redriving' AND redrives = ?";
        let sql = Sql {
            // MySQL applies the assignments left to right, each seeing the
            // ones before it: `state` is tested by every other assignment,
            // so it is assigned last. `id = LAST_INSERT_ID(id)` makes the
            // statement report the existing row's id. A resolved letter
            // keeps everything: its call has been made.
            record: format!(
                "INSERT INTO {t} (tenant, operation, idem_key, method, url, headers, body, attempts, last_error, \
                 state, redrives, created_at_ms, updated_at_ms) \
                 VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, 'dead', 0, {NOW_MS}, {NOW_MS}) \
                 ON DUPLICATE KEY UPDATE id = LAST_INSERT_ID(id), \
                 attempts = IF(state = 'resolved', attempts, LEAST(attempts + VALUES(attempts), {MAX_COUNT})), \
                 last_error = IF(state = 'resolved', last_error, VALUES(last_error)), \
                 redrive_until_ms = IF(state = 'resolved', redrive_until_ms, NULL), \
                 updated_at_ms = IF(state = 'resolved', updated_at_ms, VALUES(updated_at_ms)), \
                 state = IF(state = 'resolved', state, 'dead')"
            ),
            get: format!("SELECT {COLUMNS} FROM {t} WHERE id = ?"),
            get_for_update: format!("SELECT {COLUMNS} FROM {t} WHERE id = ? FOR UPDATE"),
            find: format!("SELECT {COLUMNS} FROM {t} WHERE tenant = ? AND operation = ? AND idem_key = ?"),
            find_id: format!("SELECT id FROM {t} WHERE tenant = ? AND operation = ? AND idem_key = ?"),
            begin: format!(
                "UPDATE {t} SET state = 'redriving', redrives = redrives + 1, \
                 redrive_until_ms = {NOW_MS} + ?, updated_at_ms = {NOW_MS} \
                 WHERE id = ? AND redrives < {MAX_COUNT} \
                 AND (state = 'dead' OR (state = 'redriving' AND redrive_until_ms <= {NOW_MS}))"
            ),
            resolve: format!(
                "UPDATE {t} SET state = 'resolved', response_status = ?, response_body = ?, \
                 redrive_until_ms = NULL, updated_at_ms = {NOW_MS} WHERE id = ? AND {taken}"
            ),
            fail: format!(
                "UPDATE {t} SET state = 'dead', attempts = LEAST(attempts + ?, {MAX_COUNT}), last_error = ?, \
                 redrive_until_ms = NULL, updated_at_ms = {NOW_MS} WHERE id = ? AND {taken}"
            ),
            purge: format!(
                "DELETE FROM {t} WHERE state = 'resolved' AND updated_at_ms < {NOW_MS} - ? ORDER BY id LIMIT ?"
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
    pub fn pool(&self) -> &MySqlPool {
        &self.pool
    }

    fn ddl(&self) -> String {
        let t = self.table.as_str();
        // Binary columns compare byte for byte (keys that differ only in
        // case or trailing spaces stay apart, whatever the server's
        // collation), and the unique key of three 255-byte columns stays
        // within InnoDB's 3072-byte index limit, where utf8mb4 text columns
        // would need 3060 bytes for their characters alone.
        format!(
            "CREATE TABLE IF NOT EXISTS {t} (
                id BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY,
                tenant VARBINARY(255) NOT NULL,
                operation VARBINARY(255) NOT NULL,
                idem_key VARBINARY(255) NOT NULL,
                method VARBINARY(32) NOT NULL,
                url VARBINARY(2048) NOT NULL,
                headers MEDIUMBLOB NOT NULL,
                body MEDIUMBLOB NOT NULL,
                attempts BIGINT NOT NULL,
                last_error BLOB NOT NULL,
                state VARBINARY(16) NOT NULL,
                redrives BIGINT NOT NULL DEFAULT 0,
                created_at_ms BIGINT NOT NULL,
                updated_at_ms BIGINT NOT NULL,
                redrive_until_ms BIGINT NULL,
                response_status INT NULL,
                response_body BLOB NULL,
                UNIQUE KEY scope_key (tenant, operation, idem_key),
                KEY state_idx (state, id)
            ) ENGINE=InnoDB"
        )
    }

    /// Creates the table and its indexes if they do not exist. Safe to run
    /// again and from several processes at once (they take turns on a named
    /// lock).
    pub async fn migrate(&self) -> Result<()> {
        let t = self.table.as_str();
        let mut conn = self.pool.acquire().await.map_err(store_error)?;
        // The named lock belongs to the session: closing the connection if
        // this future is dropped is what releases it.
        conn.close_on_drop();
        let lock = "LEFT(CONCAT('idem-dead-letters-migrate:', COALESCE(DATABASE(), ''), '.', ?), 64)";
        let acquired: Option<i64> = sqlx::query_scalar(AssertSqlSafe(format!("SELECT GET_LOCK({lock}, 60)")))
            .bind(t)
            .fetch_one(&mut *conn)
            .await
            .map_err(store_error)?;
        if acquired != Some(1) {
            return Err(Error::store(
                StoreErrorKind::LockTimeout,
                format!("the dead-letter migration lock of {t} was not granted within 60 s"),
            ));
        }
        let result = sqlx::query(AssertSqlSafe(self.ddl()))
            .execute(&mut *conn)
            .await
            .map_err(store_error);
        sqlx::query(AssertSqlSafe(format!("SELECT RELEASE_LOCK({lock})")))
            .bind(t)
            .execute(&mut *conn)
            .await
            .map_err(store_error)?;
        result.map(|_| ())
    }

    /// What [`migrate`](Self::migrate) would run, without running it: the
    /// table's one schema version while the table does not exist, nothing
    /// once it does.
    pub async fn pending_migrations(&self) -> Result<Vec<PendingMigration>> {
        let exists: i64 = sqlx::query_scalar(
            "SELECT CAST(COUNT(*) AS SIGNED) FROM information_schema.tables \
             WHERE table_schema = DATABASE() AND table_name = ?",
        )
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
            statements: vec![self.ddl()],
        }])
    }

    /// Records `letter` in the caller's open transaction (see
    /// [`DeadLetterStore::record`]): it is kept if and only if that
    /// transaction commits. Answers the letter's id.
    pub async fn record_in(&self, conn: &mut MySqlConnection, letter: &NewDeadLetter) -> Result<i64> {
        let headers = encode_headers(letter.request.headers())?;
        let done = sqlx::query(AssertSqlSafe(self.sql.record.as_str()))
            .bind(letter.scope.tenant().as_str())
            .bind(letter.scope.operation().as_str())
            .bind(letter.key.as_str())
            .bind(letter.request.method())
            .bind(letter.request.url())
            .bind(headers)
            .bind(letter.request.body())
            .bind(i64::from(letter.attempts))
            .bind(clip_text(&letter.last_error))
            .execute(&mut *conn)
            .await
            .map_err(store_error)?;
        if let Ok(id @ 1..) = i64::try_from(done.last_insert_id()) {
            return Ok(id);
        }
        // A server that did not report the id: the row is there, under this
        // transaction's lock.
        sqlx::query_scalar(AssertSqlSafe(self.sql.find_id.as_str()))
            .bind(letter.scope.tenant().as_str())
            .bind(letter.scope.operation().as_str())
            .bind(letter.key.as_str())
            .fetch_one(conn)
            .await
            .map_err(store_error)
    }

    /// A READ COMMITTED transaction whatever the server's default:
    /// REPEATABLE READ would lock gaps in the indexes, and writers of new
    /// letters would wait for it.
    async fn read_committed(&self) -> Result<Transaction<'static, MySql>> {
        let mut conn = self.pool.acquire().await.map_err(store_error)?;
        sqlx::query("SET TRANSACTION ISOLATION LEVEL READ COMMITTED")
            .execute(&mut *conn)
            .await
            .map_err(store_error)?;
        Transaction::begin(conn, None).await.map_err(store_error)
    }
}

impl DeadLetterStore for MySqlDeadLetters {
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
                .bind(u64::from(filter.limit))
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
            let taken = sqlx::query(AssertSqlSafe(self.sql.begin.as_str()))
                .bind(hold_ms)
                .bind(id)
                .execute(&mut *tx)
                .await
                .map_err(store_error)?;
            if taken.rows_affected() != 1 {
                tx.rollback().await.map_err(store_error)?;
                return Ok(None);
            }
            // The update holds the row's lock until commit: this reads the
            // row exactly as it was taken.
            let row = sqlx::query(AssertSqlSafe(self.sql.get_for_update.as_str()))
                .bind(id)
                .fetch_one(&mut *tx)
                .await
                .map_err(store_error)?;
            tx.commit().await.map_err(store_error)?;
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
                    .bind(i32::from(*status))
                    .bind(idem_core::clip_body(body)),
                RedriveOutcome::Failed { attempts, error } => sqlx::query(AssertSqlSafe(self.sql.fail.as_str()))
                    .bind(i64::from(*attempts))
                    .bind(clip_text(error)),
            };
            let mut tx = self.read_committed().await?;
            let done = query
                .bind(id)
                .bind(i64::from(token))
                .execute(&mut *tx)
                .await
                .map_err(store_error)?;
            tx.commit().await.map_err(store_error)?;
            Ok(done.rows_affected() == 1)
        })
    }

    fn purge_resolved(&self, older_than_ms: i64, limit: u32) -> BoxFuture<'_, Result<u64>> {
        Box::pin(async move {
            let mut tx = self.read_committed().await?;
            let done = sqlx::query(AssertSqlSafe(self.sql.purge.as_str()))
                .bind(older_than_ms.max(0))
                .bind(u64::from(limit))
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

fn decode(row: &MySqlRow) -> Result<DeadLetter> {
    let id: i64 = row.try_get("id").map_err(store_error)?;
    // Every text column is binary: the bytes written, UTF-8.
    let text = |name: &str| -> Result<String> {
        let bytes: Vec<u8> = row.try_get(name).map_err(store_error)?;
        String::from_utf8(bytes).map_err(|_| corrupt(format!("{name} of {id} is not UTF-8")))
    };
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
    let status: Option<i32> = row.try_get("response_status").map_err(store_error)?;
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
