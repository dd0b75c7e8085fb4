//! What MySQL and MariaDB give the SQL stores' shared machinery (`idem-sql`).

use idem_core::{BoxFuture, Result, StoreErrorKind, TableName};
use idem_sql::{Dialect, Migrations, TextColumns};
use sqlx::mysql::MySqlQueryResult;
use sqlx::{AssertSqlSafe, MySql, MySqlPool, Transaction};

use crate::error::{ER_DUP_ENTRY, error_number};
use crate::store_error;

/// MySQL and MariaDB, as the shared machinery of `idem-sql` sees them.
#[derive(Debug, Clone, Copy)]
pub struct MySqlDialect;

/// The leading columns of a table with one row per scoped key (dead
/// letters, multi-step operations): an auto-increment `id`, then the
/// tenant, operation and key as binary strings, as the keys table keeps
/// them: they compare byte for byte whatever the server's collation, and a
/// unique key over the three 255-byte columns stays within InnoDB's
/// 3072-byte index limit.
pub(crate) const SCOPED_ROW: &str = "id BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY,
    tenant VARBINARY(255) NOT NULL,
    operation VARBINARY(255) NOT NULL,
    idem_key VARBINARY(255) NOT NULL,";

impl Dialect for MySqlDialect {
    type Db = MySql;
    const NAME: &'static str = "MySQL";
    const NOW_MS: &'static str =
        "CAST(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) DIV 1000 AS SIGNED)";
    const FOR_UPDATE: &'static str = " FOR UPDATE";
    const ZERO: &'static str = "0";
    const BIGINT: &'static str = "SIGNED";
    const LEAST: &'static str = "LEAST";
    const GREATEST: &'static str = "GREATEST";
    const COLUMNS_OF: &'static str = "SELECT CAST(column_name AS CHAR) AS name FROM information_schema.columns \
         WHERE table_schema = DATABASE() AND table_name = ?";
    const TEXT: TextColumns = TextColumns::Binary;

    fn error(e: sqlx::Error) -> idem_core::Error {
        store_error(e)
    }

    /// In backquotes: `KEYS`, `ORDER` and the like are reserved words.
    fn quoted(table: &TableName) -> String {
        format!("`{table}`")
    }

    /// READ COMMITTED whatever the server's default: REPEATABLE READ would
    /// lock gaps in the indexes, and writers of new rows would wait for it.
    fn begin(pool: &MySqlPool) -> BoxFuture<'_, Result<Transaction<'static, MySql>>> {
        Box::pin(async move {
            let mut conn = pool.acquire().await.map_err(store_error)?;
            sqlx::query("SET TRANSACTION ISOLATION LEVEL READ COMMITTED")
                .execute(&mut *conn)
                .await
                .map_err(store_error)?;
            Transaction::begin(conn, None).await.map_err(store_error)
        })
    }

    /// None: MySQL has no `RETURNING`. A duplicate fails instead (only the
    /// statement, not the transaction), and the new id is the session's
    /// last insert id.
    fn ignore_twin(_: &str) -> Option<String> {
        None
    }

    fn is_duplicate(e: &sqlx::Error) -> bool {
        error_number(e) == Some(ER_DUP_ENTRY)
    }

    fn inserted_id(done: &MySqlQueryResult) -> Option<i64> {
        i64::try_from(done.last_insert_id()).ok()
    }

    fn rows_affected(done: &MySqlQueryResult) -> u64 {
        done.rows_affected()
    }

    /// MySQL takes no `LIMIT` in an `IN` subquery, but deletes in order.
    fn delete_first(table: &str, _: &str, filter: &str, order: &str, limit: &str) -> String {
        format!("DELETE FROM {table} WHERE {filter} ORDER BY {order} LIMIT {limit}")
    }

    /// A named lock (`GET_LOCK`, at most 60 s) on `idem-{kind}-migrate:`,
    /// the database and the table. MySQL commits each DDL statement on its
    /// own, so the lock, not a transaction, is what makes processes take
    /// turns.
    fn under_migration_lock<'a>(
        pool: &'a MySqlPool,
        kind: &'a str,
        table: &'a TableName,
        work: Migrations<'a, MySql>,
    ) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            let t = table.as_str();
            let mut conn = pool.acquire().await.map_err(store_error)?;
            // The named lock belongs to the session: closing the connection
            // if this future is dropped is what releases it.
            conn.close_on_drop();
            let prefix = format!("idem-{}-migrate:", kind.replace(' ', "-"));
            let lock = "LEFT(CONCAT(?, COALESCE(DATABASE(), ''), '.', ?), 64)";
            let acquired: Option<i64> = sqlx::query_scalar(AssertSqlSafe(format!("SELECT GET_LOCK({lock}, 60)")))
                .bind(&prefix)
                .bind(t)
                .fetch_one(&mut *conn)
                .await
                .map_err(store_error)?;
            if acquired != Some(1) {
                return Err(idem_core::Error::store(
                    StoreErrorKind::LockTimeout,
                    format!("the {kind} migration lock of {t} was not granted within 60 s"),
                ));
            }
            let result = work(&mut conn).await;
            sqlx::query(AssertSqlSafe(format!("SELECT RELEASE_LOCK({lock})")))
                .bind(&prefix)
                .bind(t)
                .execute(&mut *conn)
                .await
                .map_err(store_error)?;
            result
        })
    }
}
