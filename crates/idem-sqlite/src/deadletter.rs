//! Dead letters of outbound calls on SQLite.
//!
//! One row per (tenant, operation, key). Every write reads the row with the
//! database's clock inside a `BEGIN IMMEDIATE` transaction (SQLite's single
//! writer lock, so two redrives never both take one letter), applies one of
//! the core's transitions ([`DeadLetter`](idem_core::DeadLetter)'s methods: the same decisions on
//! every engine), and writes the row back. A first record is an
//! `INSERT … ON CONFLICT DO NOTHING`, so two writers of one call make one
//! row. Timestamps and holds are on the database's clock.

use std::fmt;
use std::sync::Arc;

use idem_core::{
    BoxFuture, DeadLetterFilter, DeadLetterRow, DeadLetterTable, NewDeadLetter, PendingMigration, Result, RowAt,
    TableName,
};
use sqlx::sqlite::{SqliteConnection, SqlitePool, SqliteRow};
use sqlx::{AssertSqlSafe, Row, Sqlite, Transaction};

use crate::store_error;

/// The default dead-letter table.
pub const DEFAULT_DEAD_LETTER_TABLE: &str = "idem_dead_letters";

/// The database's clock in milliseconds.
const NOW_MS: &str = "CAST((julianday('now') - 2440587.5) * 86400000.0 AS INTEGER)";

/// The columns every read selects, in [`DeadLetterRow`]'s names.
const COLUMNS: &str = "id, tenant, operation, idem_key, method, url, headers, body, attempts, last_error, state, \
                       redrives, created_at_ms, updated_at_ms, redrive_until_ms, response_status, response_body, \
                       first_reached_at_ms, verdict, verdict_by, verdict_at_ms, verdict_note, key_horizon_ms, \
                       horizon_margin_ms, settle_ms";

/// The columns of the first schema version, which an upgrade copies.
const V1_COLUMNS: &str = "id, tenant, operation, idem_key, method, url, headers, body, attempts, last_error, state, \
                          redrives, created_at_ms, updated_at_ms, redrive_until_ms, response_status, response_body";

struct Sql {
    now: String,
    insert: String,
    get: String,
    find: String,
    update: String,
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
        let sql = Sql {
            now: format!("SELECT {NOW_MS}"),
            insert: format!(
                "INSERT INTO {t} (tenant, operation, idem_key, method, url, headers, body, attempts, last_error, \
                 state, redrives, created_at_ms, updated_at_ms, redrive_until_ms, response_status, response_body, \
                 first_reached_at_ms, verdict, verdict_by, verdict_at_ms, verdict_note, key_horizon_ms, \
                 horizon_margin_ms, settle_ms) \
                 VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) \
                 ON CONFLICT (tenant, operation, idem_key) DO NOTHING RETURNING id"
            ),
            get: format!("SELECT {COLUMNS}, {NOW_MS} AS now_ms FROM {t} WHERE id = ?"),
            find: format!(
                "SELECT {COLUMNS}, {NOW_MS} AS now_ms FROM {t} WHERE tenant = ? AND operation = ? AND idem_key = ?"
            ),
            update: format!(
                "UPDATE {t} SET url = ?, attempts = ?, last_error = ?, state = ?, redrives = ?, updated_at_ms = ?, \
                 redrive_until_ms = ?, response_status = ?, response_body = ?, first_reached_at_ms = ?, \
                 verdict = ?, verdict_by = ?, verdict_at_ms = ?, verdict_note = ?, key_horizon_ms = ?, \
                 horizon_margin_ms = ?, settle_ms = ? WHERE id = ?"
            ),
            purge: format!(
                "DELETE FROM {t} WHERE id IN (SELECT id FROM {t} \
                 WHERE state IN ('resolved', 'cancelled') AND updated_at_ms < {NOW_MS} - ? ORDER BY id LIMIT ?)"
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

    fn create(&self, t: &str) -> String {
        // Text compares byte for byte (SQLite's BINARY collation), so keys
        // that differ only in case or trailing spaces stay apart.
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
                state TEXT NOT NULL CHECK (state IN ('dead', 'redriving', 'resolved', 'unknown', 'cancelled')),
                redrives INTEGER NOT NULL DEFAULT 0,
                created_at_ms INTEGER NOT NULL,
                updated_at_ms INTEGER NOT NULL,
                redrive_until_ms INTEGER NULL,
                response_status INTEGER NULL,
                response_body BLOB NULL,
                first_reached_at_ms INTEGER NULL,
                verdict TEXT NULL,
                verdict_by TEXT NULL,
                verdict_at_ms INTEGER NULL,
                verdict_note TEXT NULL,
                key_horizon_ms INTEGER NULL,
                horizon_margin_ms INTEGER NULL,
                settle_ms INTEGER NULL,
                UNIQUE (tenant, operation, idem_key)
            )"
        )
    }

    fn index(&self) -> String {
        let t = self.table.as_str();
        // Listing by state, in id order; purging final letters.
        format!("CREATE INDEX IF NOT EXISTS {t}_state_idx ON {t} (state, id)")
    }

    /// The latest version from version 1: SQLite cannot change a CHECK
    /// constraint (the new states), so the table is rebuilt under the same
    /// name, rows, ids and id sequence kept.
    fn upgrade(&self) -> Vec<String> {
        let t = self.table.as_str();
        let new = format!("{t}_v2");
        vec![
            format!("DROP TABLE IF EXISTS {new}"),
            self.create(&new),
            format!("INSERT INTO {new} ({V1_COLUMNS}) SELECT {V1_COLUMNS} FROM {t}"),
            format!("DROP TABLE {t}"),
            format!("ALTER TABLE {new} RENAME TO {t}"),
            self.index(),
        ]
    }

    /// The schema version of the table: 0 when it does not exist.
    async fn version(&self, conn: &mut SqliteConnection) -> Result<u32> {
        let columns: Vec<String> = sqlx::query_scalar("SELECT name FROM pragma_table_info(?)")
            .bind(self.table.as_str())
            .fetch_all(&mut *conn)
            .await
            .map_err(store_error)?;
        Ok(match () {
            _ if columns.is_empty() => 0,
            _ if columns.iter().any(|c| c == "settle_ms") => 3,
            _ if columns.iter().any(|c| c == "first_reached_at_ms") => 2,
            _ => 1,
        })
    }

    fn pending_for(&self, version: u32) -> Vec<PendingMigration> {
        match version {
            0 => vec![PendingMigration {
                version: 3,
                description: "dead letters table (states, first reach, verdicts, send terms) and state index".into(),
                statements: vec![self.create(self.table.as_str()), self.index()],
            }],
            // The rebuild makes the latest table at once.
            1 => vec![PendingMigration {
                version: 3,
                description: "dead letters: unknown and cancelled states, first reach, verdicts, send terms".into(),
                statements: self.upgrade(),
            }],
            2 => vec![PendingMigration {
                version: 3,
                description: "dead letters: the terms the sends were made under (key horizon, settle time)".into(),
                statements: ["key_horizon_ms", "horizon_margin_ms", "settle_ms"]
                    .iter()
                    .map(|c| format!("ALTER TABLE {} ADD COLUMN {c} INTEGER NULL", self.table))
                    .collect(),
            }],
            _ => Vec::new(),
        }
    }

    /// Creates the table and its index, or upgrades an older table; safe to
    /// run again and from several processes (they take turns on the
    /// database's write lock).
    pub async fn migrate(&self) -> Result<()> {
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await.map_err(store_error)?;
        let version = self.version(&mut tx).await?;
        for migration in self.pending_for(version) {
            for statement in migration.statements {
                sqlx::query(AssertSqlSafe(statement))
                    .execute(&mut *tx)
                    .await
                    .map_err(store_error)?;
            }
        }
        tx.commit().await.map_err(store_error)
    }

    /// What [`migrate`](Self::migrate) would run, without running it.
    pub async fn pending_migrations(&self) -> Result<Vec<PendingMigration>> {
        let mut conn = self.pool.acquire().await.map_err(store_error)?;
        let version = self.version(&mut conn).await?;
        Ok(self.pending_for(version))
    }

    /// Records `letter` in the caller's open transaction (see
    /// [`DeadLetterStore::record`](idem_core::DeadLetterStore::record)): it is
    /// kept if and only if that transaction commits. Answers the letter's id.
    pub async fn record_in(&self, conn: &mut SqliteConnection, letter: &NewDeadLetter) -> Result<i64> {
        idem_core::deadletter::record_in(self, conn, letter).await
    }

    /// Cancels letter `id` in the caller's open transaction, if it is known
    /// not to have been applied (see
    /// [`DeadLetterStore::cancel`](idem_core::DeadLetterStore::cancel)).
    pub async fn cancel_in(&self, conn: &mut SqliteConnection, id: i64) -> Result<bool> {
        idem_core::deadletter::cancel_in(self, conn, id).await
    }
}

impl DeadLetterTable for SqliteDeadLetters {
    type Conn = SqliteConnection;
    type Tx = Transaction<'static, Sqlite>;

    fn begin(&self) -> BoxFuture<'_, Result<Self::Tx>> {
        Box::pin(async move { self.pool.begin_with("BEGIN IMMEDIATE").await.map_err(store_error) })
    }

    fn commit(tx: Self::Tx) -> BoxFuture<'static, Result<()>> {
        Box::pin(async move { tx.commit().await.map_err(store_error) })
    }

    fn rollback(tx: Self::Tx) -> BoxFuture<'static, Result<()>> {
        Box::pin(async move { tx.rollback().await.map_err(store_error) })
    }

    fn now<'a>(&'a self, conn: &'a mut Self::Conn) -> BoxFuture<'a, Result<i64>> {
        Box::pin(async move {
            sqlx::query_scalar(AssertSqlSafe(self.sql.now.as_str()))
                .fetch_one(conn)
                .await
                .map_err(store_error)
        })
    }

    fn insert<'a>(&'a self, conn: &'a mut Self::Conn, row: &'a DeadLetterRow) -> BoxFuture<'a, Result<Option<i64>>> {
        Box::pin(async move {
            sqlx::query_scalar::<_, i64>(AssertSqlSafe(self.sql.insert.as_str()))
                .bind(&row.tenant)
                .bind(&row.operation)
                .bind(&row.idem_key)
                .bind(&row.method)
                .bind(&row.url)
                .bind(&row.headers)
                .bind(&row.body)
                .bind(row.attempts)
                .bind(&row.last_error)
                .bind(&row.state)
                .bind(row.redrives)
                .bind(row.created_at_ms)
                .bind(row.updated_at_ms)
                .bind(row.redrive_until_ms)
                .bind(row.response_status)
                .bind(&row.response_body)
                .bind(row.first_reached_at_ms)
                .bind(&row.verdict)
                .bind(&row.verdict_by)
                .bind(row.verdict_at_ms)
                .bind(&row.verdict_note)
                .bind(row.key_horizon_ms)
                .bind(row.horizon_margin_ms)
                .bind(row.settle_ms)
                .fetch_optional(conn)
                .await
                .map_err(store_error)
        })
    }

    fn lock<'a>(
        &'a self,
        conn: &'a mut Self::Conn,
        at: RowAt<'a>,
    ) -> BoxFuture<'a, Result<Option<(DeadLetterRow, i64)>>> {
        Box::pin(async move {
            let row = self
                .query(at, &self.sql.get, &self.sql.find)
                .fetch_optional(conn)
                .await
                .map_err(store_error)?;
            row.as_ref().map(read).transpose()
        })
    }

    fn update<'a>(&'a self, conn: &'a mut Self::Conn, row: &'a DeadLetterRow) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            sqlx::query(AssertSqlSafe(self.sql.update.as_str()))
                .bind(&row.url)
                .bind(row.attempts)
                .bind(&row.last_error)
                .bind(&row.state)
                .bind(row.redrives)
                .bind(row.updated_at_ms)
                .bind(row.redrive_until_ms)
                .bind(row.response_status)
                .bind(&row.response_body)
                .bind(row.first_reached_at_ms)
                .bind(&row.verdict)
                .bind(&row.verdict_by)
                .bind(row.verdict_at_ms)
                .bind(&row.verdict_note)
                .bind(row.key_horizon_ms)
                .bind(row.horizon_margin_ms)
                .bind(row.settle_ms)
                .bind(row.id)
                .execute(conn)
                .await
                .map_err(store_error)?;
            Ok(())
        })
    }

    fn read<'a>(&'a self, at: RowAt<'a>) -> BoxFuture<'a, Result<Option<DeadLetterRow>>> {
        Box::pin(async move {
            let row = self
                .query(at, &self.sql.get, &self.sql.find)
                .fetch_optional(&self.pool)
                .await
                .map_err(store_error)?;
            Ok(row.as_ref().map(read).transpose()?.map(|(row, _)| row))
        })
    }

    fn select<'a>(&'a self, filter: &'a DeadLetterFilter) -> BoxFuture<'a, Result<Vec<DeadLetterRow>>> {
        Box::pin(async move {
            let mut sql = format!("SELECT {COLUMNS}, 0 AS now_ms FROM {} WHERE id > ?", self.table);
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
            rows.iter().map(|r| read(r).map(|(row, _)| row)).collect()
        })
    }

    fn purge_final(&self, older_than_ms: i64, limit: u32) -> BoxFuture<'_, Result<u64>> {
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

impl SqliteDeadLetters {
    /// The statement reading the row `at` names: `by_id` or `by_call`.
    fn query<'q>(
        &self,
        at: RowAt<'q>,
        by_id: &'q str,
        by_call: &'q str,
    ) -> sqlx::query::Query<'q, Sqlite, <Sqlite as sqlx::Database>::Arguments> {
        match at {
            RowAt::Id(id) => sqlx::query(AssertSqlSafe(by_id)).bind(id),
            RowAt::Call(scope, key) => sqlx::query(AssertSqlSafe(by_call))
                .bind(scope.tenant().as_str())
                .bind(scope.operation().as_str())
                .bind(key.as_str()),
        }
    }
}

/// A row and the database's clock read with it.
fn read(row: &SqliteRow) -> Result<(DeadLetterRow, i64)> {
    let get = |name: &str| -> Result<i64> { row.try_get(name).map_err(store_error) };
    let text = |name: &str| -> Result<String> { row.try_get(name).map_err(store_error) };
    let opt = |name: &str| -> Result<Option<i64>> { row.try_get(name).map_err(store_error) };
    let letter = DeadLetterRow {
        id: get("id")?,
        tenant: text("tenant")?,
        operation: text("operation")?,
        idem_key: text("idem_key")?,
        method: text("method")?,
        url: text("url")?,
        headers: text("headers")?,
        body: row.try_get("body").map_err(store_error)?,
        attempts: get("attempts")?,
        last_error: text("last_error")?,
        state: text("state")?,
        redrives: get("redrives")?,
        created_at_ms: get("created_at_ms")?,
        updated_at_ms: get("updated_at_ms")?,
        redrive_until_ms: opt("redrive_until_ms")?,
        response_status: opt("response_status")?,
        response_body: row.try_get("response_body").map_err(store_error)?,
        first_reached_at_ms: opt("first_reached_at_ms")?,
        verdict: row.try_get("verdict").map_err(store_error)?,
        verdict_by: row.try_get("verdict_by").map_err(store_error)?,
        verdict_at_ms: opt("verdict_at_ms")?,
        verdict_note: row.try_get("verdict_note").map_err(store_error)?,
        key_horizon_ms: opt("key_horizon_ms")?,
        horizon_margin_ms: opt("horizon_margin_ms")?,
        settle_ms: opt("settle_ms")?,
    };
    Ok((letter, get("now_ms")?))
}
