//! Dead letters of outbound calls on PostgreSQL.
//!
//! One row per (tenant, operation, key). Every write reads the row with the
//! database's clock by `SELECT … FOR UPDATE` in a READ COMMITTED
//! transaction (a concurrent redrive waits for the row's lock, re-reads it
//! and no longer finds it free: `None`, never a serialisation failure,
//! whatever the database's default level), applies one of the core's
//! transitions ([`DeadLetter`](idem_core::DeadLetter)'s methods: the same decisions on every
//! engine), and writes the row back. A first record is an
//! `INSERT … ON CONFLICT DO NOTHING`, so two writers of one call make one
//! row. Timestamps and holds are on the database's clock.

use std::fmt;
use std::sync::Arc;

use idem_core::{
    BoxFuture, DeadLetterFilter, DeadLetterRow, DeadLetterTable, NewDeadLetter, PendingMigration, Result, RowAt,
    TableName,
};
use sqlx::postgres::{PgConnection, PgPool, PgRow};
use sqlx::{AssertSqlSafe, Postgres, Row, Transaction};

use crate::sql::{derived_name, fnv1a};
use crate::store_error;

/// The default dead-letter table.
pub const DEFAULT_DEAD_LETTER_TABLE: &str = "idem_dead_letters";

/// The database's clock in milliseconds.
const NOW_MS: &str = "(EXTRACT(EPOCH FROM clock_timestamp()) * 1000)::bigint";

/// The columns every read selects, in [`DeadLetterRow`]'s names.
const COLUMNS: &str = "id, tenant, operation, idem_key, method, url, headers, body, attempts, last_error, state, \
                       redrives, created_at_ms, updated_at_ms, redrive_until_ms, response_status, response_body, \
                       first_reached_at_ms, verdict, verdict_by, verdict_at_ms, verdict_note, key_horizon_ms, \
                       horizon_margin_ms, settle_ms";

struct Sql {
    now: String,
    insert: String,
    get: String,
    get_for_update: String,
    find: String,
    find_for_update: String,
    update: String,
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
        let sql = Sql {
            now: format!("SELECT {NOW_MS}"),
            insert: format!(
                "INSERT INTO {t} (tenant, operation, idem_key, method, url, headers, body, attempts, last_error, \
                 state, redrives, created_at_ms, updated_at_ms, redrive_until_ms, response_status, response_body, \
                 first_reached_at_ms, verdict, verdict_by, verdict_at_ms, verdict_note, key_horizon_ms, \
                 horizon_margin_ms, settle_ms) \
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, $18, $19, $20, $21, \
                 $22, $23, $24) \
                 ON CONFLICT (tenant, operation, idem_key) DO NOTHING RETURNING id"
            ),
            get: format!("SELECT {COLUMNS}, {NOW_MS} AS now_ms FROM {t} WHERE id = $1"),
            get_for_update: format!("SELECT {COLUMNS}, {NOW_MS} AS now_ms FROM {t} WHERE id = $1 FOR UPDATE"),
            find: format!(
                "SELECT {COLUMNS}, {NOW_MS} AS now_ms FROM {t} WHERE tenant = $1 AND operation = $2 AND idem_key = $3"
            ),
            find_for_update: format!(
                "SELECT {COLUMNS}, {NOW_MS} AS now_ms FROM {t} \
                 WHERE tenant = $1 AND operation = $2 AND idem_key = $3 FOR UPDATE"
            ),
            update: format!(
                "UPDATE {t} SET url = $1, attempts = $2, last_error = $3, state = $4, redrives = $5, updated_at_ms = $6, \
                 redrive_until_ms = $7, response_status = $8, response_body = $9, first_reached_at_ms = $10, \
                 verdict = $11, verdict_by = $12, verdict_at_ms = $13, verdict_note = $14, key_horizon_ms = $15, \
                 horizon_margin_ms = $16, settle_ms = $17 WHERE id = $18"
            ),
            purge: format!(
                "DELETE FROM {t} WHERE id IN (SELECT id FROM {t} \
                 WHERE state IN ('resolved', 'cancelled') AND updated_at_ms < {NOW_MS} - $1 ORDER BY id LIMIT $2)"
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

    fn create(&self) -> String {
        let t = self.table.as_str();
        let unique = derived_name(&self.table, "scope_key");
        let check = derived_name(&self.table, "state_check");
        // The scope and key use the "C" collation, as the keys table does:
        // plain byte comparisons, so keys that differ only in case or
        // trailing spaces stay apart. Errors and notes are kept as bytes
        // (UTF-8): they may hold a NUL, which `text` refuses.
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
                state TEXT COLLATE \"C\" NOT NULL,
                redrives BIGINT NOT NULL DEFAULT 0,
                created_at_ms BIGINT NOT NULL,
                updated_at_ms BIGINT NOT NULL,
                redrive_until_ms BIGINT NULL,
                response_status INTEGER NULL,
                response_body BYTEA NULL,
                first_reached_at_ms BIGINT NULL,
                verdict TEXT NULL,
                verdict_by TEXT NULL,
                verdict_at_ms BIGINT NULL,
                verdict_note BYTEA NULL,
                key_horizon_ms BIGINT NULL,
                horizon_margin_ms BIGINT NULL,
                settle_ms BIGINT NULL,
                CONSTRAINT {unique} UNIQUE (tenant, operation, idem_key),
                CONSTRAINT {check} CHECK (state IN ('dead', 'redriving', 'resolved', 'unknown', 'cancelled'))
            )"
        )
    }

    fn index(&self) -> String {
        let t = self.table.as_str();
        let state = derived_name(&self.table, "state_idx");
        // Listing by state, in id order; purging final letters.
        format!("CREATE INDEX IF NOT EXISTS {state} ON {t} (state, id)")
    }

    /// Version 2 from version 1: the new columns, and the state check (an
    /// unnamed one in version 1, whatever PostgreSQL called it) replaced by
    /// one that admits the new states.
    fn upgrade(&self) -> Vec<String> {
        let t = self.table.as_str();
        let check = derived_name(&self.table, "state_check");
        vec![
            format!(
                "ALTER TABLE {t} ADD COLUMN IF NOT EXISTS first_reached_at_ms BIGINT NULL, \
                 ADD COLUMN IF NOT EXISTS verdict TEXT NULL, ADD COLUMN IF NOT EXISTS verdict_by TEXT NULL, \
                 ADD COLUMN IF NOT EXISTS verdict_at_ms BIGINT NULL, ADD COLUMN IF NOT EXISTS verdict_note BYTEA NULL"
            ),
            format!(
                "DO $$ DECLARE c text; BEGIN FOR c IN SELECT conname FROM pg_constraint \
                 WHERE conrelid = '{t}'::regclass AND contype = 'c' LOOP \
                 EXECUTE format('ALTER TABLE {t} DROP CONSTRAINT %I', c); END LOOP; END $$"
            ),
            format!(
                "ALTER TABLE {t} ADD CONSTRAINT {check} \
                 CHECK (state IN ('dead', 'redriving', 'resolved', 'unknown', 'cancelled'))"
            ),
        ]
    }

    /// Version 3 from version 2: the terms the sends were made under.
    fn upgrade_terms(&self) -> String {
        let t = self.table.as_str();
        format!(
            "ALTER TABLE {t} ADD COLUMN IF NOT EXISTS key_horizon_ms BIGINT NULL, \
             ADD COLUMN IF NOT EXISTS horizon_margin_ms BIGINT NULL, ADD COLUMN IF NOT EXISTS settle_ms BIGINT NULL"
        )
    }

    /// The schema version of the table: 0 when it does not exist.
    async fn version(&self, conn: &mut PgConnection) -> Result<u32> {
        let columns: Vec<String> = sqlx::query_scalar(
            "SELECT attname::text FROM pg_attribute WHERE attrelid = to_regclass($1) AND attnum > 0 AND NOT attisdropped",
        )
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
                statements: vec![self.create(), self.index()],
            }],
            1 => vec![
                PendingMigration {
                    version: 2,
                    description: "dead letters: unknown and cancelled states, first reach, verdicts".into(),
                    statements: self.upgrade(),
                },
                self.terms_migration(),
            ],
            2 => vec![self.terms_migration()],
            _ => Vec::new(),
        }
    }

    fn terms_migration(&self) -> PendingMigration {
        PendingMigration {
            version: 3,
            description: "dead letters: the terms the sends were made under (key horizon, settle time)".into(),
            statements: vec![self.upgrade_terms()],
        }
    }

    /// Creates the table and its index, or upgrades an older table. Safe to
    /// run again and from several processes at once (they take turns on an
    /// advisory lock in a READ COMMITTED transaction).
    pub async fn migrate(&self) -> Result<()> {
        let mut tx = self.read_committed().await?;
        let lock_key = fnv1a(&[b"idem-postgres dead letters migrate", self.table.as_str().as_bytes()]) as i64;
        sqlx::query("SELECT pg_advisory_xact_lock($1)")
            .bind(lock_key)
            .execute(&mut *tx)
            .await
            .map_err(store_error)?;
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
    pub async fn record_in(&self, conn: &mut PgConnection, letter: &NewDeadLetter) -> Result<i64> {
        idem_core::deadletter::record_in(self, conn, letter).await
    }

    /// Cancels letter `id` in the caller's open transaction, if it is known
    /// not to have been applied (see
    /// [`DeadLetterStore::cancel`](idem_core::DeadLetterStore::cancel)).
    pub async fn cancel_in(&self, conn: &mut PgConnection, id: i64) -> Result<bool> {
        idem_core::deadletter::cancel_in(self, conn, id).await
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

impl DeadLetterTable for PgDeadLetters {
    type Conn = PgConnection;
    type Tx = Transaction<'static, Postgres>;

    fn begin(&self) -> BoxFuture<'_, Result<Self::Tx>> {
        Box::pin(self.read_committed())
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
                .bind(row.last_error.as_bytes())
                .bind(&row.state)
                .bind(row.redrives)
                .bind(row.created_at_ms)
                .bind(row.updated_at_ms)
                .bind(row.redrive_until_ms)
                .bind(row.response_status.map(|s| s as i32))
                .bind(&row.response_body)
                .bind(row.first_reached_at_ms)
                .bind(&row.verdict)
                .bind(&row.verdict_by)
                .bind(row.verdict_at_ms)
                .bind(row.verdict_note.as_deref().map(str::as_bytes))
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
                .query(at, &self.sql.get_for_update, &self.sql.find_for_update)
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
                .bind(row.last_error.as_bytes())
                .bind(&row.state)
                .bind(row.redrives)
                .bind(row.updated_at_ms)
                .bind(row.redrive_until_ms)
                .bind(row.response_status.map(|s| s as i32))
                .bind(&row.response_body)
                .bind(row.first_reached_at_ms)
                .bind(&row.verdict)
                .bind(&row.verdict_by)
                .bind(row.verdict_at_ms)
                .bind(row.verdict_note.as_deref().map(str::as_bytes))
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
            let mut sql = format!(
                "SELECT {COLUMNS}, 0::bigint AS now_ms FROM {} WHERE id > $1",
                self.table
            );
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
            rows.iter().map(|r| read(r).map(|(row, _)| row)).collect()
        })
    }

    fn purge_final(&self, older_than_ms: i64, limit: u32) -> BoxFuture<'_, Result<u64>> {
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

impl PgDeadLetters {
    /// The statement reading the row `at` names: `by_id` or `by_call`.
    fn query<'q>(
        &self,
        at: RowAt<'q>,
        by_id: &'q str,
        by_call: &'q str,
    ) -> sqlx::query::Query<'q, Postgres, <Postgres as sqlx::Database>::Arguments> {
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
fn read(row: &PgRow) -> Result<(DeadLetterRow, i64)> {
    let get = |name: &str| -> Result<i64> { row.try_get(name).map_err(store_error) };
    let text = |name: &str| -> Result<String> { row.try_get(name).map_err(store_error) };
    let opt = |name: &str| -> Result<Option<i64>> { row.try_get(name).map_err(store_error) };
    // Errors and notes are stored as bytes; invalid UTF-8 is shown, not refused.
    let utf8 = |bytes: Vec<u8>| String::from_utf8_lossy(&bytes).into_owned();
    let last_error: Vec<u8> = row.try_get("last_error").map_err(store_error)?;
    let note: Option<Vec<u8>> = row.try_get("verdict_note").map_err(store_error)?;
    let status: Option<i32> = row.try_get("response_status").map_err(store_error)?;
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
        last_error: utf8(last_error),
        state: text("state")?,
        redrives: get("redrives")?,
        created_at_ms: get("created_at_ms")?,
        updated_at_ms: get("updated_at_ms")?,
        redrive_until_ms: opt("redrive_until_ms")?,
        response_status: status.map(i64::from),
        response_body: row.try_get("response_body").map_err(store_error)?,
        first_reached_at_ms: opt("first_reached_at_ms")?,
        verdict: row.try_get("verdict").map_err(store_error)?,
        verdict_by: row.try_get("verdict_by").map_err(store_error)?,
        verdict_at_ms: opt("verdict_at_ms")?,
        verdict_note: note.map(utf8),
        key_horizon_ms: opt("key_horizon_ms")?,
        horizon_margin_ms: opt("horizon_margin_ms")?,
        settle_ms: opt("settle_ms")?,
    };
    Ok((letter, get("now_ms")?))
}
