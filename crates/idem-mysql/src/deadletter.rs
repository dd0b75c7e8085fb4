//! Dead letters of outbound calls on MySQL and MariaDB.
//!
//! One row per (tenant, operation, key), whose binary columns compare byte
//! for byte. Every write reads the row with the database's clock by
//! `SELECT … FOR UPDATE` in a READ COMMITTED transaction (no gap locks: a
//! redrive of a missing id never holds up new letters; a concurrent redrive
//! waits for the row's lock, re-reads it and no longer finds it free),
//! applies one of the core's transitions ([`DeadLetter`](idem_core::DeadLetter)'s methods: the
//! same decisions on every engine), and writes the row back. A first record
//! is a plain `INSERT`; a duplicate key (another writer of the same call got
//! there first) turns it into an update of that row. Timestamps and holds
//! are on the database's clock.

use std::fmt;
use std::sync::Arc;

use idem_core::{
    BoxFuture, DeadLetterFilter, DeadLetterRow, DeadLetterTable, NewDeadLetter, PendingMigration, Result, RowAt,
    TableName,
};
use sqlx::mysql::{MySqlConnection, MySqlPool, MySqlRow};
use sqlx::{AssertSqlSafe, MySql, Row, Transaction};

use crate::error::{ER_DUP_ENTRY, error_number};
use crate::store_error;

/// The default dead-letter table.
pub const DEFAULT_DEAD_LETTER_TABLE: &str = "idem_dead_letters";

/// The database's clock in milliseconds.
const NOW_MS: &str = "CAST(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) DIV 1000 AS SIGNED)";

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
        let sql = Sql {
            now: format!("SELECT {NOW_MS}"),
            insert: format!(
                "INSERT INTO {t} (tenant, operation, idem_key, method, url, headers, body, attempts, last_error, \
                 state, redrives, created_at_ms, updated_at_ms, redrive_until_ms, response_status, response_body, \
                 first_reached_at_ms, verdict, verdict_by, verdict_at_ms, verdict_note, key_horizon_ms, \
                 horizon_margin_ms, settle_ms) \
                 VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
            ),
            get: format!("SELECT {COLUMNS}, {NOW_MS} AS now_ms FROM {t} WHERE id = ?"),
            get_for_update: format!("SELECT {COLUMNS}, {NOW_MS} AS now_ms FROM {t} WHERE id = ? FOR UPDATE"),
            find: format!(
                "SELECT {COLUMNS}, {NOW_MS} AS now_ms FROM {t} WHERE tenant = ? AND operation = ? AND idem_key = ?"
            ),
            find_for_update: format!(
                "SELECT {COLUMNS}, {NOW_MS} AS now_ms FROM {t} \
                 WHERE tenant = ? AND operation = ? AND idem_key = ? FOR UPDATE"
            ),
            update: format!(
                "UPDATE {t} SET url = ?, attempts = ?, last_error = ?, state = ?, redrives = ?, updated_at_ms = ?, \
                 redrive_until_ms = ?, response_status = ?, response_body = ?, first_reached_at_ms = ?, \
                 verdict = ?, verdict_by = ?, verdict_at_ms = ?, verdict_note = ?, key_horizon_ms = ?, \
                 horizon_margin_ms = ?, settle_ms = ? WHERE id = ?"
            ),
            purge: format!(
                "DELETE FROM {t} WHERE state IN ('resolved', 'cancelled') AND updated_at_ms < {NOW_MS} - ? \
                 ORDER BY id LIMIT ?"
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

    fn create(&self) -> String {
        let t = self.table.as_str();
        // Binary columns compare byte for byte (keys that differ only in
        // case or trailing spaces stay apart, whatever the server's
        // collation), and the unique key of three 255-byte columns stays
        // within InnoDB's 3072-byte index limit. A vendor's answer is kept
        // up to 64 KiB, one byte more than a BLOB holds: MEDIUMBLOB.
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
                response_body MEDIUMBLOB NULL,
                first_reached_at_ms BIGINT NULL,
                verdict VARBINARY(16) NULL,
                verdict_by VARBINARY(16) NULL,
                verdict_at_ms BIGINT NULL,
                verdict_note BLOB NULL,
                key_horizon_ms BIGINT NULL,
                horizon_margin_ms BIGINT NULL,
                settle_ms BIGINT NULL,
                UNIQUE KEY scope_key (tenant, operation, idem_key),
                KEY state_idx (state, id)
            ) ENGINE=InnoDB"
        )
    }

    /// Version 2 from version 1: the new columns, and room for a whole
    /// vendor answer. (MySQL does not check the states: nothing to change
    /// there.)
    fn upgrade(&self) -> Vec<String> {
        let t = self.table.as_str();
        vec![format!(
            "ALTER TABLE {t} ADD COLUMN first_reached_at_ms BIGINT NULL, ADD COLUMN verdict VARBINARY(16) NULL, \
             ADD COLUMN verdict_by VARBINARY(16) NULL, ADD COLUMN verdict_at_ms BIGINT NULL, \
             ADD COLUMN verdict_note BLOB NULL, MODIFY COLUMN response_body MEDIUMBLOB NULL"
        )]
    }

    /// Version 3 from version 2: the terms the sends were made under.
    fn terms_migration(&self) -> PendingMigration {
        let t = self.table.as_str();
        PendingMigration {
            version: 3,
            description: "dead letters: the terms the sends were made under (key horizon, settle time)".into(),
            statements: vec![format!(
                "ALTER TABLE {t} ADD COLUMN key_horizon_ms BIGINT NULL, ADD COLUMN horizon_margin_ms BIGINT NULL, \
                 ADD COLUMN settle_ms BIGINT NULL"
            )],
        }
    }

    /// The schema version of the table: 0 when it does not exist.
    async fn version(&self, conn: &mut MySqlConnection) -> Result<u32> {
        let columns: Vec<String> = sqlx::query_scalar(
            "SELECT CAST(column_name AS CHAR) FROM information_schema.columns \
             WHERE table_schema = DATABASE() AND table_name = ?",
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
                statements: vec![self.create()],
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

    /// Creates the table and its indexes, or upgrades an older table. Safe
    /// to run again and from several processes at once (they take turns on
    /// a named lock, and each reads the table's version under it).
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
            return Err(idem_core::Error::store(
                idem_core::StoreErrorKind::LockTimeout,
                format!("the dead-letter migration lock of {t} was not granted within 60 s"),
            ));
        }
        let result = async {
            let version = self.version(&mut conn).await?;
            for migration in self.pending_for(version) {
                for statement in migration.statements {
                    sqlx::query(AssertSqlSafe(statement))
                        .execute(&mut *conn)
                        .await
                        .map_err(store_error)?;
                }
            }
            Ok::<_, idem_core::Error>(())
        }
        .await;
        sqlx::query(AssertSqlSafe(format!("SELECT RELEASE_LOCK({lock})")))
            .bind(t)
            .execute(&mut *conn)
            .await
            .map_err(store_error)?;
        result
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
    pub async fn record_in(&self, conn: &mut MySqlConnection, letter: &NewDeadLetter) -> Result<i64> {
        idem_core::deadletter::record_in(self, conn, letter).await
    }

    /// Cancels letter `id` in the caller's open transaction, if it is known
    /// not to have been applied (see
    /// [`DeadLetterStore::cancel`](idem_core::DeadLetterStore::cancel)).
    pub async fn cancel_in(&self, conn: &mut MySqlConnection, id: i64) -> Result<bool> {
        idem_core::deadletter::cancel_in(self, conn, id).await
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

impl DeadLetterTable for MySqlDeadLetters {
    type Conn = MySqlConnection;
    type Tx = Transaction<'static, MySql>;

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
            let inserted = sqlx::query(AssertSqlSafe(self.sql.insert.as_str()))
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
                .execute(conn)
                .await;
            match inserted {
                Ok(done) => Ok(i64::try_from(done.last_insert_id()).ok().filter(|id| *id > 0)),
                // Another writer of the same call made the row first: this
                // record updates it. Only the statement failed, not the
                // transaction.
                Err(e) if error_number(&e) == Some(ER_DUP_ENTRY) => Ok(None),
                Err(e) => Err(store_error(e)),
            }
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
                .bind(u64::from(filter.limit))
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
                .bind(u64::from(limit))
                .execute(&mut *tx)
                .await
                .map_err(store_error)?;
            tx.commit().await.map_err(store_error)?;
            Ok(done.rows_affected())
        })
    }
}

impl MySqlDeadLetters {
    /// The statement reading the row `at` names: `by_id` or `by_call`.
    fn query<'q>(
        &self,
        at: RowAt<'q>,
        by_id: &'q str,
        by_call: &'q str,
    ) -> sqlx::query::Query<'q, MySql, <MySql as sqlx::Database>::Arguments> {
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
fn read(row: &MySqlRow) -> Result<(DeadLetterRow, i64)> {
    let get = |name: &str| -> Result<i64> { row.try_get(name).map_err(store_error) };
    let opt = |name: &str| -> Result<Option<i64>> { row.try_get(name).map_err(store_error) };
    // Every text column is binary: the bytes written, UTF-8.
    let bytes = |name: &str| -> Result<Vec<u8>> { row.try_get(name).map_err(store_error) };
    let opt_bytes = |name: &str| -> Result<Option<Vec<u8>>> { row.try_get(name).map_err(store_error) };
    let text = |name: &str| -> Result<String> {
        String::from_utf8(bytes(name)?).map_err(|_| {
            idem_core::Error::store(
                idem_core::StoreErrorKind::Other,
                format!("corrupt dead letter: {name} is not UTF-8"),
            )
        })
    };
    let lossy = |b: Vec<u8>| String::from_utf8_lossy(&b).into_owned();
    let status: Option<i32> = row.try_get("response_status").map_err(store_error)?;
    let letter = DeadLetterRow {
        id: get("id")?,
        tenant: text("tenant")?,
        operation: text("operation")?,
        idem_key: text("idem_key")?,
        method: text("method")?,
        url: text("url")?,
        headers: text("headers")?,
        body: bytes("body")?,
        attempts: get("attempts")?,
        last_error: lossy(bytes("last_error")?),
        state: text("state")?,
        redrives: get("redrives")?,
        created_at_ms: get("created_at_ms")?,
        updated_at_ms: get("updated_at_ms")?,
        redrive_until_ms: opt("redrive_until_ms")?,
        response_status: status.map(i64::from),
        response_body: opt_bytes("response_body")?,
        first_reached_at_ms: opt("first_reached_at_ms")?,
        verdict: opt_bytes("verdict")?.map(lossy),
        verdict_by: opt_bytes("verdict_by")?.map(lossy),
        verdict_at_ms: opt("verdict_at_ms")?,
        verdict_note: opt_bytes("verdict_note")?.map(lossy),
        key_horizon_ms: opt("key_horizon_ms")?,
        horizon_margin_ms: opt("horizon_margin_ms")?,
        settle_ms: opt("settle_ms")?,
    };
    Ok((letter, get("now_ms")?))
}
