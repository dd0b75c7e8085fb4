//! Embedded, versioned schema migrations.
//!
//! Each migration is a list of DDL statements. MySQL commits DDL implicitly,
//! so a migration cannot be rolled back as a whole; every statement is
//! therefore safe to run again (`IF NOT EXISTS`; an `ADD COLUMN` whose
//! column is already there counts as done, because MySQL, unlike MariaDB,
//! has no `ADD COLUMN IF NOT EXISTS`), and a migration is recorded in the
//! version table only after all of its statements succeeded. A process that
//! dies half-way through simply runs the unfinished migration again next
//! time.

use idem_core::{Error, Result, StoreErrorKind, TableName};
use idem_sql::KeyMigration;
use sqlx::pool::PoolConnection;
use sqlx::{AssertSqlSafe, MySql, MySqlPool};

use crate::error::{ER_DUP_FIELDNAME, error_number, store_error};

/// How long `migrate` waits for another process's migration to finish.
const LOCK_TIMEOUT_SECS: i64 = 60;

/// MySQL's longest identifier, in characters.
const MAX_IDENTIFIER_LEN: usize = 64;

/// Every migration, in version order. Released migrations never change;
/// a schema change is a new entry.
const MIGRATIONS: &[KeyMigration] = &[
    KeyMigration {
        version: 1,
        description: "create the keys table",
        statements: v1_keys_table,
    },
    KeyMigration {
        version: 2,
        description: "sent claims: the sent_at_ms column",
        statements: v2_sent_at_ms,
    },
];

/// The schema version `migrate` brings a keys table to.
pub(crate) const LATEST_VERSION: i64 = 2;

// The newest migration is the latest version: a new entry bumps both.
const _: () = assert!(MIGRATIONS[MIGRATIONS.len() - 1].version == LATEST_VERSION);

/// The keys table. Tenant, operation and key are binary strings so that keys
/// compare byte for byte: a case-insensitive collation would merge distinct
/// keys such as `Abc` and `abc`. The primary key is the lock a claim takes;
/// the index on `expires_at_ms` serves the sweeper's ordered, bounded deletes.
fn v1_keys_table(table: &str) -> Vec<String> {
    vec![format!(
        "CREATE TABLE IF NOT EXISTS `{table}` (
            tenant VARBINARY(255) NOT NULL,
            operation VARBINARY(255) NOT NULL,
            idem_key VARBINARY(255) NOT NULL,
            fingerprint BINARY(32) NOT NULL,
            status SMALLINT NOT NULL,
            token BIGINT NOT NULL,
            payload LONGBLOB NULL,
            created_at_ms BIGINT NOT NULL,
            expires_at_ms BIGINT NOT NULL,
            lease_expires_at_ms BIGINT NULL,
            PRIMARY KEY (tenant, operation, idem_key),
            KEY expires_at_ms_idx (expires_at_ms)
        ) ENGINE=InnoDB"
    )]
}

/// Sent claims (status 4): the earliest time a holder marked its request as
/// possibly sent, kept when the outcome is recorded. `status` has no CHECK
/// constraint, so status 4 needs no other change. Nullable, added last: on
/// MariaDB 10.3+ and MySQL 8.0.12+ this is an instant change that rewrites
/// no rows.
fn v2_sent_at_ms(table: &str) -> Vec<String> {
    vec![format!("ALTER TABLE `{table}` ADD COLUMN sent_at_ms BIGINT NULL")]
}

/// The name of the version table that belongs to `table`.
pub(crate) fn schema_table(table: &TableName) -> Result<String> {
    let name = format!("{table}_schema");
    if name.len() > MAX_IDENTIFIER_LEN {
        return Err(Error::Config(format!(
            "table name {table:?} is too long for MySQL: its version table {name:?} would exceed \
             {MAX_IDENTIFIER_LEN} characters"
        )));
    }
    Ok(name)
}

/// Runs every migration `table` has not had yet, serialised across processes
/// by a named server lock.
pub(crate) async fn run(pool: &MySqlPool, table: &TableName) -> Result<()> {
    let schema = schema_table(table)?;
    let mut conn = pool.acquire().await.map_err(store_error)?;
    // A named lock belongs to the session. If this future is dropped while
    // the lock is held, closing the connection (instead of returning it to
    // the pool with the lock still held) is what releases it.
    conn.close_on_drop();
    let acquired: Option<i64> =
        sqlx::query_scalar("SELECT GET_LOCK(LEFT(CONCAT('idem-migrate:', COALESCE(DATABASE(), ''), '.', ?), 64), ?)")
            .bind(table.as_str())
            .bind(LOCK_TIMEOUT_SECS)
            .fetch_one(&mut *conn)
            .await
            .map_err(store_error)?;
    match acquired {
        Some(1) => {}
        Some(_) => {
            return Err(Error::store(
                StoreErrorKind::LockTimeout,
                format!("another process held the migration lock of {table} for over {LOCK_TIMEOUT_SECS} s"),
            ));
        }
        None => {
            return Err(Error::store(
                StoreErrorKind::Other,
                "GET_LOCK failed for the migration lock",
            ));
        }
    }
    let result = apply(&mut conn, table, &schema).await;
    let released =
        sqlx::query("SELECT RELEASE_LOCK(LEFT(CONCAT('idem-migrate:', COALESCE(DATABASE(), ''), '.', ?), 64))")
            .bind(table.as_str())
            .execute(&mut *conn)
            .await
            .map_err(store_error);
    result?;
    released?;
    Ok(())
}

async fn apply(conn: &mut PoolConnection<MySql>, table: &TableName, schema: &str) -> Result<()> {
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE TABLE IF NOT EXISTS `{schema}` (
            version BIGINT NOT NULL PRIMARY KEY,
            description VARCHAR(255) NOT NULL,
            applied_at_ms BIGINT NOT NULL
        ) ENGINE=InnoDB"
    )))
    .execute(&mut **conn)
    .await
    .map_err(store_error)?;
    let current: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT CAST(COALESCE(MAX(version), 0) AS SIGNED) FROM `{schema}`"
    )))
    .fetch_one(&mut **conn)
    .await
    .map_err(store_error)?;
    for migration in KeyMigration::after(MIGRATIONS, "idem-mysql", table.as_str(), current)? {
        for statement in (migration.statements)(table.as_str()) {
            match sqlx::raw_sql(AssertSqlSafe(statement)).execute(&mut **conn).await {
                Ok(_) => {}
                // The column was added by a run of this migration that died
                // before recording it.
                Err(e) if error_number(&e) == Some(ER_DUP_FIELDNAME) => {
                    tracing::debug!(
                        table = table.as_str(),
                        version = migration.version,
                        "the migration's column is already there"
                    );
                }
                Err(e) => return Err(store_error(e)),
            }
        }
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO `{schema}` (version, description, applied_at_ms) VALUES (?, ?, ?)"
        )))
        .bind(migration.version)
        .bind(migration.description)
        .bind(idem_sql::applied_at_ms())
        .execute(&mut **conn)
        .await
        .map_err(store_error)?;
        tracing::debug!(
            table = table.as_str(),
            version = migration.version,
            "applied idem migration"
        );
    }
    Ok(())
}

/// The migrations `table` has not had yet, without applying them.
pub(crate) async fn pending(pool: &MySqlPool, table: &TableName) -> Result<Vec<idem_core::PendingMigration>> {
    let schema = schema_table(table)?;
    let exists: i64 = sqlx::query_scalar(
        "SELECT COUNT(*) FROM information_schema.tables WHERE table_schema = DATABASE() AND table_name = ?",
    )
    .bind(&schema)
    .fetch_one(pool)
    .await
    .map_err(store_error)?;
    let current: i64 = if exists > 0 {
        sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT CAST(COALESCE(MAX(version), 0) AS SIGNED) FROM `{schema}`"
        )))
        .fetch_one(pool)
        .await
        .map_err(store_error)?
    } else {
        0
    };
    KeyMigration::pending(MIGRATIONS, "idem-mysql", table.as_str(), current)
}
