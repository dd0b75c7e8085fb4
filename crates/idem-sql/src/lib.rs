//! The machinery idem's SQL stores share, written once.
//!
//! As sqlx keeps what every driver shares in `sqlx-core` and only the wire
//! protocol per driver, the PostgreSQL, MySQL/MariaDB and SQLite stores keep
//! here what they share around the core's row transitions: which columns a
//! kind of table has, the order its statements bind them in, how a row is
//! read back, the paging of a listing, and the read–transition–write of a
//! row under its lock. An engine crate gives a [`Dialect`]: its SQL text
//! where it differs (the clock, the lock clause, placeholders, how a twin
//! insert is ignored), how its columns are typed, how it begins a
//! transaction that locks what it reads, its error mapping, and its
//! migrations.
//!
//! No driver is compiled here: the code is generic over sqlx's
//! [`Database`], and [`SqlDb`] names, once, the values it binds and reads
//! (every engine sqlx drives has them).
//!
//! | kind of table | shared here | the engine's part |
//! | --- | --- | --- |
//! | dead letters | [`SqlDeadLetters`]: statements, binds, row reading, listing, purging | [`Dialect`], [`DeadLetterSchema`] (its `CREATE TABLE` and upgrades) |
//! | keys (the operator's view) | [`keys`]: stats, listing, lookups, the filter purges delete by | [`Dialect`] (and each engine's purge) |
//! | keys (a row outside its claim) | [`SqlKeyRows`]: the lookup, the lease holder's writes, resolving an unknown outcome, the sweep's bookkeeping | the claim, and the sweep's statement |
//! | outbox | [`SqlOutbox`]: enqueue, a relay's take and finish (held or leased), lag, purging | [`Dialect`], [`OutboxSchema`] (its `CREATE TABLE`, how relays hold rows, how it names a set of rows) |

use std::sync::Arc;

use idem_core::{BoxFuture, IdempotencyKey, Result, Scope, TableName};
use sqlx::{AssertSqlSafe, Database, Decode, Encode, Executor, IntoArguments, Pool, Row, Transaction, Type};
use sqlx_core::transaction::TransactionManager;

mod deadletter;

pub use deadletter::{DEFAULT_DEAD_LETTER_TABLE, DeadLetterSchema, SqlDeadLetters};

pub mod keys;
mod migrate;
mod multistep;
pub mod outbox;
mod rows;
mod unwritten;

pub use migrate::{KeyMigration, applied_at_ms, migrate, migrate_in_transaction, pending};
pub use multistep::{DEFAULT_MULTISTEP_TABLE, MultiStepSchema, SqlMultiSteps};
pub use outbox::{DEFAULT_OUTBOX_TABLE, OutboxSchema, Relay, SqlOutbox, SqlOutboxBatch};
pub use rows::{
    ROW_COLUMNS, SqlKeyRows, bound, check_claim_depth, claim_args, completed_args, decode_row, key_args,
    record_claimed, unclaimed_record,
};
pub use unwritten::UnwrittenClaims;

/// A statement and its arguments on engine `DB`.
pub type Statement<'q, DB> = sqlx::query::Query<'q, DB, <DB as Database>::Arguments>;

/// Work run on a connection that holds an engine's migration lock (see
/// [`Dialect::under_migration_lock`]).
pub type Migrations<'a, DB> =
    Box<dyn for<'c> FnOnce(&'c mut <DB as Database>::Connection) -> BoxFuture<'c, Result<()>> + Send + 'a>;

/// A value the shared code binds, in the Rust type every engine takes.
#[derive(Debug, Clone, Copy)]
pub enum Arg<'a> {
    /// A `BIGINT`.
    Int(i64),
    /// A `SMALLINT`.
    Int16(i16),
    /// A `BIGINT` or NULL.
    OptInt(Option<i64>),
    /// An `INTEGER` or NULL.
    OptInt32(Option<i32>),
    /// Text.
    Text(&'a str),
    /// Text or NULL.
    OptText(Option<&'a str>),
    /// Bytes.
    Bytes(&'a [u8]),
    /// Bytes or NULL.
    OptBytes(Option<&'a [u8]>),
}

/// An engine sqlx drives, seen through the values the shared code binds and
/// reads. Every such engine is one: the bounds are written here, once.
pub trait SqlDb: Database {
    /// `statement` with `arg` bound next.
    fn bind<'q>(statement: Statement<'q, Self>, arg: Arg<'_>) -> Statement<'q, Self>;
    /// A `BIGINT` column.
    fn int(row: &Self::Row, column: &str) -> sqlx::Result<i64>;
    /// A `BIGINT` column by its position (from 0), for a column the
    /// statement does not name.
    fn int_at(row: &Self::Row, index: usize) -> sqlx::Result<i64>;
    /// A `BIGINT` column that may be NULL.
    fn opt_int(row: &Self::Row, column: &str) -> sqlx::Result<Option<i64>>;
    /// A `SMALLINT` column.
    fn int16(row: &Self::Row, column: &str) -> sqlx::Result<i16>;
    /// An `INTEGER` column.
    fn int32(row: &Self::Row, column: &str) -> sqlx::Result<i32>;
    /// An `INTEGER` column that may be NULL.
    fn opt_int32(row: &Self::Row, column: &str) -> sqlx::Result<Option<i32>>;
    /// A text column.
    fn text(row: &Self::Row, column: &str) -> sqlx::Result<String>;
    /// A text column that may be NULL.
    fn opt_text(row: &Self::Row, column: &str) -> sqlx::Result<Option<String>>;
    /// A bytes column.
    fn bytes(row: &Self::Row, column: &str) -> sqlx::Result<Vec<u8>>;
    /// A bytes column that may be NULL.
    fn opt_bytes(row: &Self::Row, column: &str) -> sqlx::Result<Option<Vec<u8>>>;
    /// Runs `statement` on `conn`: its first row, if any.
    fn fetch_optional<'c>(
        statement: Statement<'c, Self>,
        conn: &'c mut Self::Connection,
    ) -> BoxFuture<'c, sqlx::Result<Option<Self::Row>>>;
    /// Runs `statement` on `conn`: all its rows.
    fn fetch_all<'c>(
        statement: Statement<'c, Self>,
        conn: &'c mut Self::Connection,
    ) -> BoxFuture<'c, sqlx::Result<Vec<Self::Row>>>;
    /// Runs `statement` on a connection of `pool`: its first row, if any.
    fn fetch_optional_pooled<'c>(
        statement: Statement<'c, Self>,
        pool: &'c Pool<Self>,
    ) -> BoxFuture<'c, sqlx::Result<Option<Self::Row>>>;
    /// Runs `statement` on a connection of `pool`: all its rows.
    fn fetch_all_pooled<'c>(
        statement: Statement<'c, Self>,
        pool: &'c Pool<Self>,
    ) -> BoxFuture<'c, sqlx::Result<Vec<Self::Row>>>;
    /// Runs `statement` on `conn`.
    fn execute<'c>(
        statement: Statement<'c, Self>,
        conn: &'c mut Self::Connection,
    ) -> BoxFuture<'c, sqlx::Result<Self::QueryResult>>;
}

impl<DB> SqlDb for DB
where
    DB: Database,
    <DB as Database>::Arguments: IntoArguments<DB>,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    for<'r> i64: Decode<'r, DB> + Encode<'r, DB> + Type<DB>,
    for<'r> i32: Decode<'r, DB> + Encode<'r, DB> + Type<DB>,
    for<'r> i16: Decode<'r, DB> + Encode<'r, DB> + Type<DB>,
    for<'r> String: Decode<'r, DB> + Type<DB>,
    for<'r> &'r str: Encode<'r, DB> + Type<DB>,
    for<'r> Vec<u8>: Decode<'r, DB> + Type<DB>,
    for<'r> &'r [u8]: Encode<'r, DB> + Type<DB>,
    for<'r> Option<i64>: Encode<'r, DB>,
    for<'r> Option<i32>: Encode<'r, DB>,
    for<'r> Option<&'r str>: Encode<'r, DB>,
    for<'r> Option<&'r [u8]>: Encode<'r, DB>,
    for<'r> &'r str: sqlx::ColumnIndex<DB::Row>,
    usize: sqlx::ColumnIndex<DB::Row>,
{
    fn bind<'q>(statement: Statement<'q, Self>, arg: Arg<'_>) -> Statement<'q, Self> {
        match arg {
            Arg::Int(v) => statement.bind(v),
            Arg::Int16(v) => statement.bind(v),
            Arg::OptInt(v) => statement.bind(v),
            Arg::OptInt32(v) => statement.bind(v),
            Arg::Text(v) => statement.bind(v),
            Arg::OptText(v) => statement.bind(v),
            Arg::Bytes(v) => statement.bind(v),
            Arg::OptBytes(v) => statement.bind(v),
        }
    }

    fn int(row: &Self::Row, column: &str) -> sqlx::Result<i64> {
        row.try_get(column)
    }

    fn int_at(row: &Self::Row, index: usize) -> sqlx::Result<i64> {
        row.try_get(index)
    }

    fn opt_int(row: &Self::Row, column: &str) -> sqlx::Result<Option<i64>> {
        row.try_get(column)
    }

    fn int16(row: &Self::Row, column: &str) -> sqlx::Result<i16> {
        row.try_get(column)
    }

    fn int32(row: &Self::Row, column: &str) -> sqlx::Result<i32> {
        row.try_get(column)
    }

    fn opt_int32(row: &Self::Row, column: &str) -> sqlx::Result<Option<i32>> {
        row.try_get(column)
    }

    fn text(row: &Self::Row, column: &str) -> sqlx::Result<String> {
        row.try_get(column)
    }

    fn opt_text(row: &Self::Row, column: &str) -> sqlx::Result<Option<String>> {
        row.try_get(column)
    }

    fn bytes(row: &Self::Row, column: &str) -> sqlx::Result<Vec<u8>> {
        row.try_get(column)
    }

    fn opt_bytes(row: &Self::Row, column: &str) -> sqlx::Result<Option<Vec<u8>>> {
        row.try_get(column)
    }

    fn fetch_optional<'c>(
        statement: Statement<'c, Self>,
        conn: &'c mut Self::Connection,
    ) -> BoxFuture<'c, sqlx::Result<Option<Self::Row>>> {
        Box::pin(statement.fetch_optional(conn))
    }

    fn fetch_all<'c>(
        statement: Statement<'c, Self>,
        conn: &'c mut Self::Connection,
    ) -> BoxFuture<'c, sqlx::Result<Vec<Self::Row>>> {
        Box::pin(statement.fetch_all(conn))
    }

    fn fetch_optional_pooled<'c>(
        statement: Statement<'c, Self>,
        pool: &'c Pool<Self>,
    ) -> BoxFuture<'c, sqlx::Result<Option<Self::Row>>> {
        Box::pin(statement.fetch_optional(pool))
    }

    fn fetch_all_pooled<'c>(
        statement: Statement<'c, Self>,
        pool: &'c Pool<Self>,
    ) -> BoxFuture<'c, sqlx::Result<Vec<Self::Row>>> {
        Box::pin(statement.fetch_all(pool))
    }

    fn execute<'c>(
        statement: Statement<'c, Self>,
        conn: &'c mut Self::Connection,
    ) -> BoxFuture<'c, sqlx::Result<Self::QueryResult>> {
        Box::pin(statement.execute(conn))
    }
}

/// How an engine's columns are typed where engines differ.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TextColumns {
    /// Text columns hold text (SQLite).
    Text,
    /// Text columns hold text, but free text (errors, notes), which may hold
    /// a NUL, is kept as bytes (PostgreSQL's `text` refuses NUL).
    FreeTextAsBytes,
    /// Every text column is binary, compared byte for byte (MySQL and
    /// MariaDB `VARBINARY`/`BLOB`): read as bytes, checked to be UTF-8.
    Binary,
}

/// What an engine gives the shared code: the SQL text where it differs,
/// how its columns are typed, how it begins a transaction that locks what
/// it reads, and its error mapping.
pub trait Dialect: Send + Sync + 'static {
    /// The engine.
    type Db: SqlDb;
    /// The engine's name, in `Debug` output.
    const NAME: &'static str;
    /// The database's clock in milliseconds, as an SQL expression.
    const NOW_MS: &'static str;
    /// What a read that locks its row ends with (`" FOR UPDATE"`, or empty
    /// where the transaction already holds the database's write lock).
    const FOR_UPDATE: &'static str;
    /// A `BIGINT` zero, as an SQL expression.
    const ZERO: &'static str;
    /// The type a `CAST` to a 64-bit integer names (`BIGINT`, MySQL's
    /// `SIGNED`).
    const BIGINT: &'static str;
    /// The function that answers the least of its arguments (`LEAST`,
    /// SQLite's `MIN`).
    const LEAST: &'static str;
    /// The function that answers the greatest of its arguments
    /// (`GREATEST`, SQLite's `MAX`).
    const GREATEST: &'static str;
    /// How text columns are typed.
    const TEXT: TextColumns;

    /// The `n`th placeholder of a statement (from 1). (By default `?`, the
    /// positional placeholder.)
    fn placeholder(_n: usize) -> String {
        "?".into()
    }

    /// `table` as a statement names it: quoted where the engine's reserved
    /// words could clash with it. (By default as it is: a [`TableName`] is
    /// a plain identifier.)
    fn quoted(table: &TableName) -> String {
        table.as_str().to_owned()
    }

    /// An expression: the first `len` characters of `column`.
    fn prefix(column: &str, len: &str) -> String {
        format!("LEFT({column}, {len})")
    }

    /// The engine's error, as the core's.
    fn error(e: sqlx::Error) -> idem_core::Error;

    /// A transaction at READ COMMITTED whatever the database's default (a
    /// statement that waited for a row re-reads it), or one that holds the
    /// database's write lock from its start.
    fn begin(pool: &Pool<Self::Db>) -> BoxFuture<'_, Result<Transaction<'static, Self::Db>>>;

    /// What an `INSERT` ends with so that a row already there under
    /// `unique` makes no row and no error, and the new row's id is
    /// returned (`ON CONFLICT (…) DO NOTHING RETURNING id`); `None` where
    /// the engine has no such clause: the duplicate fails
    /// ([`is_duplicate`](Self::is_duplicate)) and the id is read with
    /// [`inserted_id`](Self::inserted_id).
    fn ignore_twin(unique: &str) -> Option<String>;

    /// Whether `e` is a duplicate-key error (only asked where
    /// [`ignore_twin`](Self::ignore_twin) is `None`).
    fn is_duplicate(e: &sqlx::Error) -> bool;

    /// The id an `INSERT` made (only asked where
    /// [`ignore_twin`](Self::ignore_twin) is `None`).
    fn inserted_id(done: &<Self::Db as Database>::QueryResult) -> Option<i64>;

    /// How many rows a statement changed.
    fn rows_affected(done: &<Self::Db as Database>::QueryResult) -> u64;

    /// A query of the names (as `name`) of the columns of the table its
    /// one argument names: no row when there is no such table.
    const COLUMNS_OF: &'static str;

    /// Runs `work` on a connection that holds the engine's lock on
    /// migrating this `kind` of table named `table`: processes that migrate
    /// at once take turns, and each reads the table's version under the
    /// lock.
    fn under_migration_lock<'a>(
        pool: &'a Pool<Self::Db>,
        kind: &'a str,
        table: &'a TableName,
        work: Migrations<'a, Self::Db>,
    ) -> BoxFuture<'a, Result<()>>;

    /// Checks, before the store writes its own rows in a transaction the
    /// caller's code has used (a multi-step operation's local step), that
    /// sqlx counts exactly that transaction's level on `conn` (see
    /// [`check_claim_depth`]). An engine whose count moves off the caller's
    /// task (SQLite's connection worker) has it settle first.
    fn check_claim_level(conn: &mut <Self::Db as Database>::Connection) -> BoxFuture<'_, Result<()>> {
        let depth = <<Self::Db as Database>::TransactionManager as TransactionManager>::get_transaction_depth(conn);
        Box::pin(std::future::ready(check_claim_depth(depth)))
    }

    /// A statement deleting the first `limit` rows of `table` by `order`
    /// that match `filter`; `key` is the table's primary key.
    fn delete_first(table: &str, key: &str, filter: &str, order: &str, limit: &str) -> String {
        format!(
            "DELETE FROM {table} WHERE {key} IN (SELECT {key} FROM {table} WHERE {filter} ORDER BY {order} LIMIT {limit})"
        )
    }
}

/// A table of one kind on the engine `D` speaks to: its pool, its name, and
/// its statements `S`, built once for the name. The stores of each kind of
/// table (dead letters, outbox, multi-step operations) hold one.
pub(crate) struct SqlTable<D: Dialect, S> {
    pub(crate) pool: Pool<D::Db>,
    pub(crate) name: TableName,
    pub(crate) sql: Arc<S>,
    dialect: std::marker::PhantomData<fn() -> D>,
}

impl<D: Dialect, S> Clone for SqlTable<D, S> {
    fn clone(&self) -> Self {
        Self {
            pool: self.pool.clone(),
            name: self.name.clone(),
            sql: self.sql.clone(),
            dialect: std::marker::PhantomData,
        }
    }
}

impl<D: Dialect, S> SqlTable<D, S> {
    /// The table `name` on `pool`, its statements built by `sql`.
    pub(crate) fn new(pool: Pool<D::Db>, name: TableName, sql: impl FnOnce(&str) -> S) -> Self {
        let sql = Arc::new(sql(name.as_str()));
        Self {
            pool,
            name,
            sql,
            dialect: std::marker::PhantomData,
        }
    }

    /// Deletes one bounded batch: `purge` (a [`Dialect::delete_first`]
    /// statement) bound with `before` and `limit`, in a transaction of the
    /// engine's kind ([`Dialect::begin`]). At MySQL's default REPEATABLE READ
    /// the delete would lock the gap where new rows are inserted, and their
    /// writers would wait; at READ COMMITTED, or under SQLite's write lock
    /// from the start, they do not. Answers how many rows it deleted.
    pub(crate) async fn purge_batch(&self, purge: &Arc<str>, before: i64, limit: u32) -> Result<u64> {
        let mut tx = D::begin(&self.pool).await?;
        let statement = bound::<D>(
            AssertSqlSafe(purge.clone()),
            [Arg::Int(before), Arg::Int(i64::from(limit))],
        );
        let done = D::Db::execute(statement, &mut tx).await.map_err(D::error)?;
        tx.commit().await.map_err(D::error)?;
        Ok(D::rows_affected(&done))
    }
}

/// Declares `$name<D: $schema>`, the store of one kind of table on the
/// engine `D` speaks to: a [`SqlTable`] of the module's statements `Sql`,
/// with `Clone`, `Debug`, `new` (on the table `$default`), `with_table`,
/// `table`, `pool`, and `migrate` and `pending_migrations` by the module's
/// `plan` (a `$kind` of table).
macro_rules! table_store {
    ($(#[$doc:meta])* $name:ident<D: $schema:ident>, $default:ident, $what:literal, $kind:literal) => {
        $(#[$doc])*
        pub struct $name<D: $schema> {
            t: $crate::SqlTable<D, Sql>,
        }

        impl<D: $schema> Clone for $name<D> {
            fn clone(&self) -> Self {
                Self { t: self.t.clone() }
            }
        }

        impl<D: $schema> std::fmt::Debug for $name<D> {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.debug_struct(stringify!($name))
                    .field("engine", &D::NAME)
                    .field("table", &self.t.name)
                    .finish_non_exhaustive()
            }
        }

        impl<D: $schema> $name<D> {
            #[doc = concat!("The ", $what, " in [`", stringify!($default), "`].")]
            pub fn new(pool: sqlx::Pool<D::Db>) -> Self {
                Self::with_table(pool, $crate::default_table($default))
            }

            #[doc = concat!("The ", $what, " in `table`.")]
            pub fn with_table(pool: sqlx::Pool<D::Db>, table: idem_core::TableName) -> Self {
                Self {
                    t: $crate::SqlTable::new(pool, table, Sql::new::<D>),
                }
            }

            /// The table.
            pub fn table(&self) -> &idem_core::TableName {
                &self.t.name
            }

            /// The pool.
            pub fn pool(&self) -> &sqlx::Pool<D::Db> {
                &self.t.pool
            }

            /// Creates the table and its indexes, or upgrades an older one.
            /// Safe to run again and from several processes at once (they
            /// take turns on the engine's migration lock).
            pub async fn migrate(&self) -> idem_core::Result<()> {
                $crate::migrate::<D>(&self.t.pool, $kind, &self.t.name, plan::<D>).await
            }

            /// What [`migrate`](Self::migrate) would run, without running it.
            pub async fn pending_migrations(&self) -> idem_core::Result<Vec<idem_core::PendingMigration>> {
                $crate::pending::<D>(&self.t.pool, &self.t.name, plan::<D>).await
            }
        }
    };
}
pub(crate) use table_store;

/// Runs `statement`, an insert that ignores a twin's row (its text ends in
/// the engine's [`Dialect::ignore_twin`] clause, which returns the id, when
/// `returns_id`) or fails on one: the new row's id, or `None` when a twin of
/// the same unique key was made first. Only the statement fails on a twin,
/// never the transaction.
pub(crate) async fn insert_unless_twin<D: Dialect>(
    statement: Statement<'_, D::Db>,
    returns_id: bool,
    conn: &mut <D::Db as Database>::Connection,
) -> Result<Option<i64>> {
    if returns_id {
        let made = D::Db::fetch_optional(statement, conn).await.map_err(D::error)?;
        return made.map(|r| D::Db::int(&r, "id").map_err(D::error)).transpose();
    }
    match D::Db::execute(statement, conn).await {
        Ok(done) => Ok(D::inserted_id(&done).filter(|id| *id > 0)),
        Err(e) if D::is_duplicate(&e) => Ok(None),
        Err(e) => Err(D::error(e)),
    }
}

/// The insert of a row per scoped key into a table, built once: run by
/// [`insert_unless_twin`], it makes one row of a tenant, operation and key
/// however many writers insert it.
pub(crate) struct ScopedInsert {
    sql: Arc<str>,
    /// Whether the insert ignores a twin's row and returns the new id.
    returns_id: bool,
}

impl ScopedInsert {
    /// The insert into `table` of `columns`, each bound in order, then the
    /// engine's clause that ignores a twin's row of the same tenant,
    /// operation and key where it has one ([`Dialect::ignore_twin`]).
    pub(crate) fn new<D: Dialect>(table: &str, columns: &[&str]) -> Self {
        let twin = D::ignore_twin("tenant, operation, idem_key");
        let returns_id = twin.is_some();
        let sql = format!(
            "INSERT INTO {table} ({}) VALUES ({}){}",
            columns.join(", "),
            placeholders::<D>(1, columns.len()),
            twin.map_or(String::new(), |clause| format!(" {clause}"))
        );
        Self {
            sql: sql.into(),
            returns_id,
        }
    }

    /// Inserts the row `args` binds on `conn`: the new row's id, or `None`
    /// when a twin was made first.
    pub(crate) async fn run<'a, D: Dialect>(
        &self,
        args: impl IntoIterator<Item = Arg<'a>>,
        conn: &mut <D::Db as Database>::Connection,
    ) -> Result<Option<i64>> {
        let statement = bound::<D>(AssertSqlSafe(self.sql.clone()), args);
        insert_unless_twin::<D>(statement, self.returns_id, conn).await
    }
}

/// `tenant = … AND operation = … AND idem_key = …`: the condition on a
/// scoped key, its placeholders numbered from `from`.
pub(crate) fn scoped_key<D: Dialect>(from: usize) -> String {
    format!(
        "tenant = {} AND operation = {} AND idem_key = {}",
        D::placeholder(from),
        D::placeholder(from + 1),
        D::placeholder(from + 2)
    )
}

/// What [`scoped_key`] binds, as text, in its order.
pub(crate) fn scoped_args<'a>(scope: &'a Scope, key: &'a IdempotencyKey) -> [Arg<'a>; 3] {
    [
        Arg::Text(scope.tenant().as_str()),
        Arg::Text(scope.operation().as_str()),
        Arg::Text(key.as_str()),
    ]
}

/// The database's clock in milliseconds ([`Dialect::NOW_MS`]), read on a
/// connection of `pool`: what an engine's store answers as its
/// [`TimeSource`](idem_core::TimeSource), so that every instance on one
/// database decides on the clock its statements use.
pub fn database_now_ms<D: Dialect>(pool: &Pool<D::Db>) -> BoxFuture<'_, Result<i64>> {
    Box::pin(async move {
        let statement = sqlx::query(AssertSqlSafe(format!("SELECT {}", D::NOW_MS)));
        let row = D::Db::fetch_optional_pooled(statement, pool)
            .await
            .and_then(|row| row.ok_or(sqlx::Error::RowNotFound))
            .map_err(D::error)?;
        D::Db::int_at(&row, 0).map_err(D::error)
    })
}

/// The table named `name`, one of this crate's valid default names.
pub(crate) fn default_table(name: &str) -> TableName {
    TableName::new(name).expect("a valid default table name")
}

/// The placeholders from `from` to `to` (both included), comma-separated.
fn placeholders<D: Dialect + ?Sized>(from: usize, to: usize) -> String {
    (from..=to).map(D::placeholder).collect::<Vec<_>>().join(", ")
}

/// `column = <placeholder>, …` for `columns`, numbered from `from`.
fn assignments<D: Dialect>(columns: &[&str], from: usize) -> String {
    columns
        .iter()
        .enumerate()
        .map(|(i, c)| format!("{c} = {}", D::placeholder(from + i)))
        .collect::<Vec<_>>()
        .join(", ")
}

/// A text column of a row written from validated ASCII, as the engine keeps
/// it: binary columns are shown as they are (lossy), never refused.
pub(crate) fn shown_text<D: Dialect>(row: &<D::Db as Database>::Row, name: &str) -> Result<String> {
    match D::TEXT {
        TextColumns::Binary => Ok(String::from_utf8_lossy(&D::Db::bytes(row, name).map_err(D::error)?).into_owned()),
        TextColumns::Text | TextColumns::FreeTextAsBytes => D::Db::text(row, name).map_err(D::error),
    }
}

/// The kind of a sqlx error that did not come from the database's own
/// answer: a connection that failed (I/O, TLS), a pool that timed out or
/// closed, a driver worker that crashed are
/// [`Unavailable`](idem_core::StoreErrorKind::Unavailable); anything else is
/// [`Other`](idem_core::StoreErrorKind::Other). Each engine classifies its
/// database errors by its own codes and the rest by this.
pub fn transport_kind(e: &sqlx::Error) -> idem_core::StoreErrorKind {
    match e {
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed => idem_core::StoreErrorKind::Unavailable,
        _ => idem_core::StoreErrorKind::Other,
    }
}
