//! Embedded, versioned schema migrations.

use idem_core::{Result, TableName};
use sqlx::postgres::PgPool;
use sqlx::{AssertSqlSafe, Row};

use crate::ExpiryIndex;
use crate::error::store_error;
use crate::sql::{derived_name, fnv1a};

/// One schema version: statements run in order, in one transaction.
struct Migration {
    version: i32,
    description: &'static str,
    /// Statements with `{table}` and `{expires_index}` placeholders.
    statements: &'static [&'static str],
}

/// Drops every check constraint of the table on `status`, whatever its
/// name: the version-1 check's name is the one PostgreSQL chose, and a
/// renamed table keeps its old constraint names.
const DROP_STATUS_CHECKS: &str = "DO $idem$ DECLARE c text; BEGIN
                FOR c IN SELECT conname FROM pg_constraint
                    WHERE conrelid = '{table}'::regclass AND contype = 'c'
                      AND pg_get_constraintdef(oid) LIKE '%status%'
                LOOP
                    EXECUTE format('ALTER TABLE {table} DROP CONSTRAINT %I', c);
                END LOOP;
            END $idem$";

/// Every migration, oldest first. Applied versions are never edited; a
/// schema change is a new entry.
const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        description: "keys table and expiry index",
        statements: &[
            // The key columns use the "C" collation: byte order never changes
            // with an operating system's locale data, so the primary key index
            // that makes claims exclusive cannot be corrupted by a libc upgrade,
            // and comparisons are plain byte comparisons. The fill factor leaves
            // room on each page so that recording an outcome, which updates the
            // row its claim inserted moments before, stays a heap-only update.
            "CREATE TABLE IF NOT EXISTS {table} (
            tenant TEXT COLLATE \"C\" NOT NULL,
            operation TEXT COLLATE \"C\" NOT NULL,
            idem_key TEXT COLLATE \"C\" NOT NULL,
            fingerprint BYTEA NOT NULL CHECK (octet_length(fingerprint) = 32),
            status SMALLINT NOT NULL CHECK (status IN (0, 1, 2)),
            token BIGINT NOT NULL,
            payload BYTEA NULL,
            created_at_ms BIGINT NOT NULL,
            expires_at_ms BIGINT NOT NULL,
            lease_expires_at_ms BIGINT NULL,
            PRIMARY KEY (tenant, operation, idem_key)
        ) WITH (fillfactor = 80)",
            // The sweeper finds expired rows through this index.
            "CREATE INDEX IF NOT EXISTS {expires_index} ON {table} (expires_at_ms)",
        ],
    },
    Migration {
        version: 2,
        description: "status 3: unknown outcomes",
        statements: &[
            // The version-1 check's name is the one PostgreSQL chose; it is
            // found by what it checks.
            DROP_STATUS_CHECKS,
            "ALTER TABLE {table} ADD CONSTRAINT {status_check} CHECK (status IN (0, 1, 2, 3))",
        ],
    },
    Migration {
        version: 3,
        description: "status 4 and sent_at_ms: sent claims",
        statements: &[
            // A nullable column without a default is a catalog change only:
            // existing rows are not rewritten.
            "ALTER TABLE {table} ADD COLUMN sent_at_ms BIGINT NULL",
            // Dropped by what it checks, as in version 2, so a table whose
            // check was named otherwise (a renamed table keeps its old
            // constraint names) is upgraded too.
            DROP_STATUS_CHECKS,
            "ALTER TABLE {table} ADD CONSTRAINT {status_check} CHECK (status IN (0, 1, 2, 3, 4))",
        ],
    },
];

/// The newest schema version this crate knows.
pub(crate) const LATEST_VERSION: i32 = 3;

/// Applies every migration newer than the recorded version, in one READ
/// COMMITTED transaction serialised by an advisory lock on the table's name,
/// whatever the default isolation level of the database or session.
/// Refuses a table whose schema is newer than this crate knows.
fn refuse_newer(table: &TableName, current: i32) -> Result<()> {
    idem_core::PendingMigration::refuse_newer(
        "idem-postgres",
        table.as_str(),
        i64::from(current),
        i64::from(LATEST_VERSION),
    )
}

pub(crate) async fn run(pool: &PgPool, table: &TableName, expiry: ExpiryIndex) -> Result<()> {
    let version_table = derived_name(table, "schema");
    let expires_index = derived_name(table, "expires_at_ms_idx");
    let status_check = derived_name(table, "status_check");
    let mut tx = pool.begin().await.map_err(store_error)?;
    // At REPEATABLE READ or SERIALIZABLE (a database or session default many
    // teams set), the statement that waits for the lock below would fix the
    // transaction's snapshot before the wait: a migrator that got the lock
    // after another one finished would not see the version that one
    // recorded, apply it again and fail on a duplicate (23505) or a
    // serialisation failure (40001). At READ COMMITTED every statement after
    // the wait sees everything committed before it.
    sqlx::query("SET TRANSACTION ISOLATION LEVEL READ COMMITTED")
        .execute(&mut *tx)
        .await
        .map_err(store_error)?;
    // Two processes running `CREATE TABLE IF NOT EXISTS` at once can both see
    // no table and one then fails on a duplicate catalog entry; the lock makes
    // every migrator of this table take its turn.
    let lock_key = fnv1a(&[b"idem-postgres migrate", table.as_str().as_bytes()]) as i64;
    sqlx::query("SELECT pg_advisory_xact_lock($1)")
        .bind(lock_key)
        .execute(&mut *tx)
        .await
        .map_err(store_error)?;
    sqlx::query(AssertSqlSafe(format!(
        "CREATE TABLE IF NOT EXISTS {version_table} (
            version INTEGER PRIMARY KEY,
            description TEXT NOT NULL,
            applied_at_ms BIGINT NOT NULL
        )"
    )))
    .execute(&mut *tx)
    .await
    .map_err(store_error)?;
    let current: i32 = sqlx::query(AssertSqlSafe(format!(
        "SELECT COALESCE(MAX(version), 0) FROM {version_table}"
    )))
    .fetch_one(&mut *tx)
    .await
    .and_then(|row| row.try_get(0))
    .map_err(store_error)?;
    refuse_newer(table, current)?;
    for migration in MIGRATIONS.iter().filter(|m| m.version > current) {
        for statement in migration.statements {
            let sql = statement
                .replace("{table}", table.as_str())
                .replace("{expires_index}", &expires_index)
                .replace("{status_check}", &status_check);
            sqlx::query(AssertSqlSafe(sql))
                .execute(&mut *tx)
                .await
                .map_err(store_error)?;
        }
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {version_table} (version, description, applied_at_ms) VALUES ($1, $2, $3)"
        )))
        .bind(migration.version)
        .bind(migration.description)
        .bind(idem_sql::applied_at_ms())
        .execute(&mut *tx)
        .await
        .map_err(store_error)?;
        tracing::debug!(
            table = table.as_str(),
            version = migration.version,
            description = migration.description,
            "applied idem schema migration"
        );
    }
    apply_expiry_index(&mut tx, table, &expires_index, expiry).await?;
    tx.commit().await.map_err(store_error)?;
    Ok(())
}

/// Makes the table's expiry index the one `expiry` names: creates it if
/// missing and drops the other kind, touching nothing when they already
/// match (a catalog read, no DDL and no table lock).
async fn apply_expiry_index(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    table: &TableName,
    btree: &str,
    expiry: ExpiryIndex,
) -> Result<()> {
    let brin = derived_name(table, "expires_at_ms_brin");
    let present: Vec<String> = sqlx::query_scalar(
        "SELECT c.relname::text FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid \
         WHERE i.indrelid = to_regclass($1) AND c.relname::text = ANY($2)",
    )
    .bind(table.as_str())
    .bind(vec![btree.to_owned(), brin.clone()])
    .fetch_all(&mut **tx)
    .await
    .map_err(store_error)?;
    let t = table.as_str();
    for (name, wanted, create) in [
        (
            btree,
            expiry == ExpiryIndex::BTree,
            format!("CREATE INDEX {btree} ON {t} (expires_at_ms)"),
        ),
        (
            brin.as_str(),
            expiry == ExpiryIndex::Brin,
            format!("CREATE INDEX {brin} ON {t} USING brin (expires_at_ms)"),
        ),
    ] {
        let has = present.iter().any(|p| p == name);
        let ddl = match (wanted, has) {
            (true, false) => create,
            (false, true) => format!("DROP INDEX {name}"),
            _ => continue,
        };
        sqlx::query(AssertSqlSafe(ddl))
            .execute(&mut **tx)
            .await
            .map_err(store_error)?;
        tracing::info!(table = t, index = name, created = wanted, "changed the expiry index");
    }
    Ok(())
}

/// The migrations `table` has not had yet, without applying them.
pub(crate) async fn pending(pool: &PgPool, table: &TableName) -> Result<Vec<idem_core::PendingMigration>> {
    let version_table = derived_name(table, "schema");
    let expires_index = derived_name(table, "expires_at_ms_idx");
    let status_check = derived_name(table, "status_check");
    let exists: bool = sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
        .bind(&version_table)
        .fetch_one(pool)
        .await
        .map_err(store_error)?;
    let current: i32 = if exists {
        sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT COALESCE(MAX(version), 0) FROM {version_table}"
        )))
        .fetch_one(pool)
        .await
        .map_err(store_error)?
    } else {
        0
    };
    refuse_newer(table, current)?;
    Ok(MIGRATIONS
        .iter()
        .filter(|m| m.version > current)
        .map(|m| idem_core::PendingMigration {
            version: i64::from(m.version),
            description: m.description.to_owned(),
            statements: m
                .statements
                .iter()
                .map(|s| {
                    s.replace("{table}", table.as_str())
                        .replace("{expires_index}", &expires_index)
                        .replace("{status_check}", &status_check)
                })
                .collect(),
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_are_increasing_and_end_at_latest() {
        assert!(MIGRATIONS.windows(2).all(|w| w[0].version < w[1].version));
        assert_eq!(MIGRATIONS.last().map(|m| m.version), Some(LATEST_VERSION));
    }
}
