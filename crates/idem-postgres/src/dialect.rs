//! What PostgreSQL gives the SQL stores' shared machinery (`idem-sql`).

use idem_core::{BoxFuture, Result, TableName};
use idem_sql::{Dialect, Migrations, TextColumns};
use sqlx::postgres::PgQueryResult;
use sqlx::{PgPool, Postgres, Transaction};

use crate::error::sqlstate;
use crate::sql::fnv1a;
use crate::store_error;

/// PostgreSQL, as the shared machinery of `idem-sql` sees it.
#[derive(Debug, Clone, Copy)]
pub struct PgDialect;

/// The leading columns of a table with one row per scoped key (dead
/// letters, multi-step operations): an identity `id`, then the tenant,
/// operation and key in the "C" collation, as the keys table keeps them:
/// plain byte comparisons, so keys that differ only in case or trailing
/// spaces stay apart, whatever the operating system's locale data says.
pub(crate) const SCOPED_ROW: &str = "id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    tenant TEXT COLLATE \"C\" NOT NULL,
    operation TEXT COLLATE \"C\" NOT NULL,
    idem_key TEXT COLLATE \"C\" NOT NULL,";

impl Dialect for PgDialect {
    type Db = Postgres;
    const NAME: &'static str = "PostgreSQL";
    /// The wall clock at the statement's run, not the transaction's start.
    const NOW_MS: &'static str = "(EXTRACT(EPOCH FROM clock_timestamp()) * 1000)::bigint";
    const FOR_UPDATE: &'static str = " FOR UPDATE";
    const ZERO: &'static str = "0::bigint";
    const BIGINT: &'static str = "BIGINT";
    const LEAST: &'static str = "LEAST";
    const GREATEST: &'static str = "GREATEST";
    const COLUMNS_OF: &'static str = "SELECT attname::text AS name FROM pg_attribute \
         WHERE attrelid = to_regclass($1) AND attnum > 0 AND NOT attisdropped";
    const TEXT: TextColumns = TextColumns::FreeTextAsBytes;

    fn placeholder(n: usize) -> String {
        format!("${n}")
    }

    fn error(e: sqlx::Error) -> idem_core::Error {
        store_error(e)
    }

    /// `left(…, $n::int)`: the length's placeholder is typed.
    fn prefix(column: &str, len: &str) -> String {
        format!("left({column}, {len}::int)")
    }

    /// READ COMMITTED whatever the database's default: a statement that
    /// waited for a row re-reads it instead of failing to serialise.
    fn begin(pool: &PgPool) -> BoxFuture<'_, Result<Transaction<'static, Postgres>>> {
        Box::pin(async move {
            pool.begin_with("BEGIN ISOLATION LEVEL READ COMMITTED")
                .await
                .map_err(store_error)
        })
    }

    fn ignore_twin(unique: &str) -> Option<String> {
        Some(format!("ON CONFLICT ({unique}) DO NOTHING RETURNING id"))
    }

    fn is_duplicate(e: &sqlx::Error) -> bool {
        sqlstate(e).as_deref() == Some("23505")
    }

    fn inserted_id(_: &PgQueryResult) -> Option<i64> {
        None
    }

    fn rows_affected(done: &PgQueryResult) -> u64 {
        done.rows_affected()
    }

    /// An advisory lock on a hash of `idem-postgres {kind} migrate` and the
    /// table, in a READ COMMITTED transaction: the migration commits or
    /// rolls back whole, and the lock goes with it.
    fn under_migration_lock<'a>(
        pool: &'a PgPool,
        kind: &'a str,
        table: &'a TableName,
        work: Migrations<'a, Postgres>,
    ) -> BoxFuture<'a, Result<()>> {
        let name = format!("idem-postgres {kind} migrate");
        let lock_key = fnv1a(&[name.as_bytes(), table.as_str().as_bytes()]) as i64;
        let lock = sqlx::query("SELECT pg_advisory_xact_lock($1)").bind(lock_key);
        Box::pin(idem_sql::migrate_in_transaction::<Self>(pool, Some(lock), work))
    }
}
