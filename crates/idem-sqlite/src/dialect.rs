//! What SQLite gives the SQL stores' shared machinery (`idem-sql`).

use idem_core::{BoxFuture, Result, TableName};
use idem_sql::{Dialect, Migrations, TextColumns};
use sqlx::sqlite::{SqliteQueryResult, SqliteTransactionManager};
use sqlx::{Sqlite, SqlitePool, Transaction};
use sqlx_core::transaction::TransactionManager;

use crate::store_error;

/// SQLite's extended code for a UNIQUE constraint that failed.
const SQLITE_CONSTRAINT_UNIQUE: &str = "2067";

/// SQLite, as the shared machinery of `idem-sql` sees it.
#[derive(Debug, Clone, Copy)]
pub struct SqliteDialect;

/// The leading columns of a table with one row per scoped key (dead
/// letters, multi-step operations): an auto-increment `id`, then the
/// tenant, operation and key as text, which compares byte for byte
/// (SQLite's BINARY collation), so keys that differ only in case or
/// trailing spaces stay apart.
pub(crate) const SCOPED_ROW: &str = "id INTEGER PRIMARY KEY AUTOINCREMENT,
    tenant TEXT NOT NULL,
    operation TEXT NOT NULL,
    idem_key TEXT NOT NULL,";

impl Dialect for SqliteDialect {
    type Db = Sqlite;
    const NAME: &'static str = "SQLite";
    const NOW_MS: &'static str = "CAST((julianday('now') - 2440587.5) * 86400000.0 AS INTEGER)";
    /// Nothing: the transaction holds the database's write lock from its
    /// start (`BEGIN IMMEDIATE`).
    const FOR_UPDATE: &'static str = "";
    const ZERO: &'static str = "0";
    const BIGINT: &'static str = "INTEGER";
    const LEAST: &'static str = "MIN";
    const GREATEST: &'static str = "MAX";
    const COLUMNS_OF: &'static str = "SELECT name FROM pragma_table_info(?)";
    const TEXT: TextColumns = TextColumns::Text;

    fn error(e: sqlx::Error) -> idem_core::Error {
        store_error(e)
    }

    /// In double quotes, the standard's way.
    fn quoted(table: &TableName) -> String {
        format!("\"{table}\"")
    }

    fn prefix(column: &str, len: &str) -> String {
        format!("substr({column}, 1, {len})")
    }

    /// `BEGIN IMMEDIATE`: SQLite's single writer lock from the start, so
    /// two writers never both read a row free.
    fn begin(pool: &SqlitePool) -> BoxFuture<'_, Result<Transaction<'static, Sqlite>>> {
        Box::pin(async move { pool.begin_with("BEGIN IMMEDIATE").await.map_err(store_error) })
    }

    fn ignore_twin(unique: &str) -> Option<String> {
        Some(format!("ON CONFLICT ({unique}) DO NOTHING RETURNING id"))
    }

    fn is_duplicate(e: &sqlx::Error) -> bool {
        matches!(e, sqlx::Error::Database(db) if db.code().as_deref() == Some(SQLITE_CONSTRAINT_UNIQUE))
    }

    fn inserted_id(done: &SqliteQueryResult) -> Option<i64> {
        Some(done.last_insert_rowid())
    }

    fn rows_affected(done: &SqliteQueryResult) -> u64 {
        done.rows_affected()
    }

    /// Once the connection's worker has answered a ping: the count it keeps
    /// moves only as it runs the commands sent to it.
    fn check_claim_level(conn: &mut sqlx::SqliteConnection) -> BoxFuture<'_, Result<()>> {
        Box::pin(async move {
            sqlx::Connection::ping(&mut *conn).await.map_err(store_error)?;
            idem_sql::check_claim_depth(SqliteTransactionManager::get_transaction_depth(conn))
        })
    }

    /// The database's write lock, in one `BEGIN IMMEDIATE` transaction: the
    /// migration commits or rolls back whole.
    fn under_migration_lock<'a>(
        pool: &'a SqlitePool,
        _: &'a str,
        _: &'a TableName,
        work: Migrations<'a, Sqlite>,
    ) -> BoxFuture<'a, Result<()>> {
        Box::pin(idem_sql::migrate_in_transaction::<Self>(pool, None, work))
    }
}
