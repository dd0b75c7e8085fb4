//! The SQLite store of **idem**: exactly-once effects on an embedded
//! database file, in transactional and lease mode.
//!
//! The guide, with examples: `docs/http.md` in the repository.
//!
//! SQLite is idem's embedded default. [`SqliteStore`] implements
//! [`TxBackend`](idem_core::TxBackend) (the key claim, the caller's own
//! writes and the recorded outcome commit as one transaction),
//! [`LeaseStore`](idem_core::LeaseStore) (check–claim–complete with fencing
//! tokens, for effects outside the database) and [`Sweep`](idem_core::Sweep)
//! (bounded deletion of expired keys).
//!
//! ```
//! use idem_core::{Call, Fingerprint, IdempotencyKey, Scope, TxEngine};
//! use idem_sqlite::{SqliteStore, store_error};
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> idem_core::Result<()> {
//! # let path = std::env::temp_dir().join(format!("idem-sqlite-doc-{}.db", std::process::id()));
//! let store = SqliteStore::open(&path).await?; // creates the file if missing
//! store.migrate().await?;
//! let engine = TxEngine::new(store);
//!
//! let scope = Scope::parse("tenant-42", "POST /v1/top-ups")?;
//! let key = IdempotencyKey::generate();
//! let call = Call::new(scope.clone(), key, Fingerprint::of_json(scope.operation(), br#"{"amount":5}"#)?);
//! let first = engine
//!     .execute(&call, |tx| Box::pin(async move {
//!         // The caller's own writes go through the same transaction as the claim.
//!         sqlx::query("CREATE TABLE IF NOT EXISTS credits (amount INTEGER NOT NULL)")
//!             .execute(&mut **tx).await.map_err(store_error)?;
//!         sqlx::query("INSERT INTO credits (amount) VALUES (5)").execute(&mut **tx).await.map_err(store_error)?;
//!         Ok::<_, idem_core::Error>(5)
//!     }))
//!     .await?;
//! let again = engine.execute(&call, |_tx| Box::pin(async { Ok::<_, idem_core::Error>(0) })).await?;
//! assert!(!first.is_replayed());
//! assert_eq!(again.into_inner(), 5); // replayed: the second closure never ran
//! # drop(engine);
//! # for suffix in ["", "-wal", "-shm", "-idem.lock"] { let _ = std::fs::remove_file(format!("{}{suffix}", path.display())); }
//! # Ok(()) }
//! ```
//!
//! # How it works
//!
//! | Concern | What the store does |
//! |---|---|
//! | Journal | WAL, so readers never wait for the writer |
//! | Durability | `synchronous = FULL` by default (see [`SqliteOptions::synchronous`]) |
//! | Transactions | `BEGIN IMMEDIATE`: the write lock is taken at begin, never upgraded mid-transaction |
//! | Busy database | waits up to the busy timeout (5 s by default), then [`StoreErrorKind::LockTimeout`], which the engines retry |
//! | Transactional claim | one `SELECT` of the key's row; nothing written |
//! | Transactional record | one `INSERT` of the completed row (`… ON CONFLICT … DO UPDATE … WHERE token = <stale row's>` in place of a stale row) |
//! | Lease claim | one `INSERT … ON CONFLICT … DO UPDATE … WHERE <stale> RETURNING token`, committed at once |
//! | Twins in one process | serialised per key by a [`KeyRegistry`] shared by every store on the same file |
//! | Twins in other processes | serialised per key by a POSIX byte-range lock on the side file `<db>-idem.lock` |
//! | Time | always the engine's injected clock, never SQLite's |
//!
//! SQLite has a single writer for the whole database. Without a per-key
//! lock, a twin of a running transactional claim could only wait on that
//! global write lock, up to the busy timeout, and then fail with a lock
//! timeout. Instead, before its transaction begins, a transactional claim
//! takes its key: first in the process's registry, then, against other
//! processes on the same file, one byte of the side file `<db>-idem.lock`
//! (an `fcntl` lock at an offset derived from a hash of the scoped key,
//! among 2^40 slots; two keys that share a slot only wait for each other).
//! A twin with [`InFlight::Reject`](idem_core::InFlight::Reject) is then
//! told at once that the key is in flight, and one with
//! [`InFlight::Wait`](idem_core::InFlight::Wait) polls the lock with short
//! pauses up to its bound, never holding the database's write lock while it
//! waits. The key is held until the claim's transaction commits or rolls
//! back. The operating system drops the locks of a process that exits, even
//! by `SIGKILL`, so a crashed holder never strands a key.
//!
//! The side file must live next to the database on a local file system, and
//! every process must reach the database by the same directory (not through
//! differently named hard links): POSIX locks over NFS and similar network
//! file systems are unreliable, as is SQLite's own locking there. The side
//! file is created on the first claim and may be deleted only while no
//! process has the database open.
//!
//! Lease mode needs no such lock: its claim commits at once, so a twin in
//! any process finds the in-progress row and waits for, or is rejected by,
//! the lease.
//!
//! # One row per fresh call
//!
//! A fresh transactional call writes the rows of its work and one row more:
//! the completed record. The claim only reads the key's row, inside the
//! transaction's `BEGIN IMMEDIATE`:
//!
//! - a live row (a recorded outcome, an unknown one, a lease still
//!   running, or a claim marked sent, whatever its lease) answers the claim:
//!   a replay, a mismatch, a key in flight, or an unknown outcome;
//! - no row, or a stale one (expired, or a lease never marked sent that ran
//!   out), is claimed: the claim is noted on the [`SqliteTx`] with its
//!   token (for a takeover, the stale row's plus one, if that is larger
//!   than the fresh token), and writes nothing;
//! - the record writes the completed row in one statement: an `INSERT`, or
//!   in place of the stale row, an upsert that matches that row by its token
//!   and staleness.
//!
//! Claiming without a row is as safe as writing an in-progress row at the
//! claim, because of the lock `BEGIN IMMEDIATE` takes: the database's single
//! write lock, held from the transaction's start until it commits or rolls
//! back, against every connection of every process on the file. No other
//! writer (a twin in another process that holds no key lock, a lease-mode
//! claim, a sweep, an operator's purge) can write any row until then, and a
//! write transaction reads the newest committed state. So the row the claim
//! read is still the key's row when the record writes, and no twin can
//! commit a row of the key in between: it waits for the lock, then reads
//! the completed row and replays, or, if the first rolled back, finds the
//! key as it was and claims it. An in-progress row would have been seen by
//! no other connection anyway, since they read only committed rows. That is
//! why this is the store's only transactional path, not an option.
//!
//! The record fails with [`Error::Config`](idem_core::Error::Config), and
//! the transaction commits nothing, if the transaction holds no claim of its
//! key, or if the key's row changed after the claim (only the transaction's
//! own work can do that, writing to the keys table). A stale row taken over
//! costs one write too; its lease holder is fenced once the record commits,
//! because the token changed.
//!
//! A transactional claim holds the database's write lock until it commits,
//! so every other writer waits for the caller's work: keep that work short
//! (database writes), and run slow effects such as vendor calls in lease
//! mode, whose claim commits at once.
//!
//! # The keys table
//!
//! One row per key, primary key `(tenant, operation, idem_key)`, with an
//! index on `expires_at_ms` for the sweeper. `status` is one of
//!
//! | Code | Meaning |
//! |---|---|
//! | 0 | in progress: a lease-mode claim, until `lease_expires_at_ms` |
//! | 1 | completed, `payload` holds the recorded response |
//! | 2 | rejected, `payload` holds the recorded response |
//! | 3 | unknown outcome, held until resolved or expired |
//! | 4 | sent: a lease-mode claim whose holder marked that its request may have reached the other side; in flight while its lease lives, an unknown outcome once it ran out, never taken over |
//!
//! `sent_at_ms` holds the earliest time the claim was marked sent, and is
//! kept when its outcome is recorded or resolved; a claim that takes over an
//! expired row starts without it. Rows written in transactional mode are
//! never marked.
//!
//! The schema is versioned in a `{table}_schema` table and brought up to
//! date by [`SqliteStore::migrate`] (what it would run:
//! [`SqliteStore::pending_migrations`]). Version 1 created the table,
//! version 2 allowed status 3 and version 3 allowed status 4 and added
//! `sent_at_ms`; SQLite cannot change a check constraint in place, so
//! versions 2 and 3 rebuild the table, keeping its rows, under the
//! migration's write lock.
//!
//! # Files only
//!
//! The store works on database files. An in-memory database
//! (`sqlite::memory:`) belongs to one connection, and sharing it across a
//! pool's connections needs SQLite's shared cache, which has no WAL, reports
//! table-level conflicts at once instead of waiting, and drops the database
//! when the last connection closes. Tests use a file under
//! [`std::env::temp_dir`].
//!
//! This crate has no Cargo features.

mod backend;
mod clock;
pub mod deadletter;
mod dialect;
mod error;
mod keylock;
pub mod multistep;
pub mod outbox;
mod shared;
mod sql;
mod tx;

use std::fmt;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use idem_core::{IdempotencyKey, KeyRegistry, Result, Scope, StoreErrorKind, StoredRow, TableName};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};
use sqlx::{AssertSqlSafe, Row, SqlitePool};

pub use sqlx::sqlite::SqliteSynchronous;

pub use crate::deadletter::SqliteDeadLetters;
pub use crate::error::{is_contention, store_error};
pub use crate::multistep::SqliteMultiSteps;
pub use crate::outbox::SqliteOutbox;
use crate::sql::{MIGRATIONS, Statements};
pub use crate::tx::SqliteTx;
pub use dialect::SqliteDialect;
use idem_sql::SqlKeyRows;

/// The longest busy timeout SQLite takes, in ms (`i32::MAX`, about 24 days).
pub const MAX_BUSY_TIMEOUT_MS: u64 = i32::MAX as u64;

/// How [`SqliteStore::open_with`] configures its connections.
#[derive(Debug, Clone)]
pub struct SqliteOptions {
    busy_timeout: Duration,
    synchronous: SqliteSynchronous,
    max_connections: u32,
    create_if_missing: bool,
}

impl Default for SqliteOptions {
    fn default() -> Self {
        Self {
            busy_timeout: Duration::from_secs(5),
            synchronous: SqliteSynchronous::Full,
            max_connections: 10,
            create_if_missing: true,
        }
    }
}

impl SqliteOptions {
    /// The defaults: a 5 s busy timeout, `synchronous = FULL`, 10 connections.
    pub fn new() -> Self {
        Self::default()
    }

    /// How long a statement waits for another connection's lock before it
    /// fails with [`StoreErrorKind::LockTimeout`]; at most
    /// [`MAX_BUSY_TIMEOUT_MS`] (SQLite's own limit), or opening fails.
    pub fn busy_timeout_ms(mut self, busy_timeout_ms: u64) -> Self {
        self.busy_timeout = Duration::from_millis(busy_timeout_ms);
        self
    }

    /// The `synchronous` pragma. `FULL` (the default) makes every commit
    /// durable across a power loss; `NORMAL` in WAL mode may lose the last
    /// commits on power loss (never on a process crash) and is faster. Keep
    /// `FULL` when the effects move money.
    pub fn synchronous(mut self, synchronous: SqliteSynchronous) -> Self {
        self.synchronous = synchronous;
        self
    }

    /// The most connections the pool opens. Writers are serialised by
    /// SQLite whatever this is; more connections let more readers run.
    pub fn max_connections(mut self, max_connections: u32) -> Self {
        self.max_connections = max_connections.max(1);
        self
    }

    /// Whether opening a path where no database file is creates one (the
    /// default). Tools that only read or delete rows open with `false`, so
    /// that a mistyped path fails instead of becoming a new, empty database.
    pub fn create_if_missing(mut self, create_if_missing: bool) -> Self {
        self.create_if_missing = create_if_missing;
        self
    }
}

/// The SQLite store: transactional mode ([`TxBackend`](idem_core::TxBackend)),
/// lease mode ([`LeaseStore`](idem_core::LeaseStore)) and sweeping
/// ([`Sweep`](idem_core::Sweep)) on one keys table.
///
/// Clones are cheap and share the pool, the table and the key registry.
#[derive(Clone)]
pub struct SqliteStore {
    pool: SqlitePool,
    table: TableName,
    sql: Arc<Statements>,
    rows: SqlKeyRows<SqliteDialect>,
    registry: KeyRegistry,
}

impl fmt::Debug for SqliteStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqliteStore")
            .field("file", &self.pool.connect_options().get_filename())
            .field("table", &self.table)
            .field("registry", &self.registry)
            .finish_non_exhaustive()
    }
}

impl SqliteStore {
    /// Opens (creating it if missing) the database file at `path` with the
    /// default [`SqliteOptions`]: WAL journal, a 5 s busy timeout,
    /// `synchronous = FULL` and foreign keys on.
    pub async fn open(path: impl AsRef<Path>) -> Result<Self> {
        Self::open_with(path, SqliteOptions::default()).await
    }

    /// Opens the database file at `path` with `options` (creating it if
    /// missing, unless [`SqliteOptions::create_if_missing`] says not to).
    pub async fn open_with(path: impl AsRef<Path>, options: SqliteOptions) -> Result<Self> {
        let path = path.as_ref();
        if options.busy_timeout > Duration::from_millis(MAX_BUSY_TIMEOUT_MS) {
            return Err(idem_core::Error::Config(format!(
                "sqlite busy timeout: at most {MAX_BUSY_TIMEOUT_MS} ms, got {} ms",
                options.busy_timeout.as_millis()
            )));
        }
        let connect = SqliteConnectOptions::new()
            .filename(path)
            .create_if_missing(options.create_if_missing)
            .journal_mode(SqliteJournalMode::Wal)
            .busy_timeout(options.busy_timeout)
            .synchronous(options.synchronous)
            .foreign_keys(true);
        // Switching a new database to WAL needs an exclusive lock, and
        // SQLite reports a conflict over it at once instead of waiting in the
        // busy handler; so when several openers race on a brand-new file, the
        // losers retry here within the busy timeout. Once the file is in WAL
        // (a persistent setting), opening never needs that lock again.
        let deadline = Instant::now() + options.busy_timeout;
        let mut pause = Duration::from_millis(2);
        let pool = loop {
            let attempt = SqlitePoolOptions::new()
                .max_connections(options.max_connections)
                .connect_with(connect.clone())
                .await;
            match attempt {
                Ok(pool) => break pool,
                Err(e) if error::kind_of(&e) == StoreErrorKind::LockTimeout && Instant::now() < deadline => {
                    tracing::debug!(file = %path.display(), error = %e, "database locked while opening; retrying");
                    tokio::time::sleep(pause.min(deadline.saturating_duration_since(Instant::now()))).await;
                    pause = (pause * 2).min(Duration::from_millis(50));
                }
                Err(e) => return Err(store_error(e)),
            }
        };
        tracing::debug!(file = %path.display(), ?options, "opened sqlite store");
        Ok(Self::new(pool))
    }

    /// A store on a pool the caller built. The pool's options are used as
    /// they are: for the guarantees of [`open`](Self::open), set WAL, a busy
    /// timeout and `synchronous = FULL` on it, and point it at a file (see
    /// the crate docs on in-memory databases).
    ///
    /// The store joins the process-wide key registry of the pool's file, so
    /// every store on that file in this process serialises claims of a key
    /// together, and holds each key against other processes with a lock on
    /// the side file `<db>-idem.lock`.
    pub fn new(pool: SqlitePool) -> Self {
        let registry = shared::registry_for(pool.connect_options().get_filename());
        let table = TableName::default();
        let sql = Arc::new(Statements::new(&table));
        let rows = SqlKeyRows::new(pool.clone(), table.clone(), sql::sweep(&table));
        Self {
            pool,
            table,
            sql,
            rows,
            registry,
        }
    }

    /// Uses the keys table `table` (default `idem_keys`).
    pub fn with_table(mut self, table: TableName) -> Self {
        self.sql = Arc::new(Statements::new(&table));
        self.rows = SqlKeyRows::new(self.pool.clone(), table.clone(), sql::sweep(&table));
        self.table = table;
        self
    }

    /// Serialises this store's claims through `registry` instead of the
    /// process-wide registry of its file (which also holds each key against
    /// other processes through the side lock file).
    ///
    /// Claims stay correct without the file's registry (the database's
    /// write lock and primary key decide), but a twin then waits on SQLite's
    /// global write lock, bounded by the busy timeout, instead of on its own
    /// key. Tests use this to act as a second process that takes no key
    /// locks.
    pub fn with_registry(mut self, registry: KeyRegistry) -> Self {
        self.registry = registry;
        self
    }

    /// The connection pool (for the caller's own queries).
    pub fn pool(&self) -> &SqlitePool {
        &self.pool
    }

    /// The keys table.
    pub fn table(&self) -> &TableName {
        &self.table
    }

    /// The registry that serialises this store's claims of one key.
    pub fn registry(&self) -> &KeyRegistry {
        &self.registry
    }

    /// The schema versions the table has not had yet, with their SQL,
    /// without applying anything.
    pub async fn pending_migrations(&self) -> Result<Vec<idem_core::PendingMigration>> {
        let schema = format!("{}_schema", self.table);
        let exists: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM sqlite_master WHERE type = 'table' AND name = ?")
            .bind(&schema)
            .fetch_one(&self.pool)
            .await
            .map_err(store_error)?;
        let current: i64 = if exists > 0 {
            sqlx::query_scalar(AssertSqlSafe(self.sql.schema_version.clone()))
                .fetch_one(&self.pool)
                .await
                .map_err(store_error)?
        } else {
            0
        };
        idem_sql::KeyMigration::pending(MIGRATIONS, "idem-sqlite", self.table.as_str(), current)
    }

    /// Creates or upgrades the keys table to the newest schema version.
    ///
    /// Migrations are embedded and versioned in a `{table}_schema` table.
    /// They run in one `BEGIN IMMEDIATE` transaction, so concurrent calls
    /// (from this or other processes) apply each version once: later
    /// callers wait for the write lock and then find nothing to do. Fails
    /// with [`Error::Config`](idem_core::Error::Config) if the database was
    /// migrated by a newer version of this crate.
    pub async fn migrate(&self) -> Result<()> {
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await.map_err(store_error)?;
        sqlx::query(AssertSqlSafe(self.sql.create_schema_table.clone()))
            .execute(&mut *tx)
            .await
            .map_err(store_error)?;
        let current: i64 = sqlx::query(AssertSqlSafe(self.sql.schema_version.clone()))
            .fetch_one(&mut *tx)
            .await
            .and_then(|row| row.try_get(0))
            .map_err(store_error)?;
        for migration in idem_sql::KeyMigration::after(MIGRATIONS, "idem-sqlite", self.table.as_str(), current)? {
            for statement in (migration.statements)(self.table.as_str()) {
                sqlx::query(AssertSqlSafe(statement))
                    .execute(&mut *tx)
                    .await
                    .map_err(store_error)?;
            }
            sqlx::query(AssertSqlSafe(self.sql.insert_schema_version.clone()))
                .bind(migration.version)
                .bind(migration.description)
                .bind(idem_sql::applied_at_ms())
                .execute(&mut *tx)
                .await
                .map_err(store_error)?;
            tracing::debug!(table = %self.table, version = migration.version, "applied idem schema migration");
        }
        tx.commit().await.map_err(store_error)?;
        Ok(())
    }

    /// The stored row of a key, if any (expired rows included until swept),
    /// with its [`sent_at_ms`](StoredRow::sent_at_ms).
    pub async fn get(&self, scope: &Scope, key: &IdempotencyKey) -> Result<Option<StoredRow>> {
        self.rows.get(scope, key).await
    }
}

idem_sql::key_admin!(SqliteStore, SqliteDialect);

impl SqliteStore {
    /// Deletes at most `limit` keys matching `filter` at `now_ms`; answers how many.
    ///
    /// One statement, and the filter is checked again on each row it
    /// deletes: SQLite runs the statement under its single writer's lock,
    /// so no claim can change a row between its selection and its deletion,
    /// and the repeated filter says so in the text rather than in a
    /// property of the engine.
    pub async fn purge_keys(&self, filter: &idem_core::KeyFilter, now_ms: i64, limit: u32) -> Result<u64> {
        let (conds, args) = idem_sql::keys::key_filter::<SqliteDialect>(filter, now_ms, 1);
        let t = self.table.as_str();
        let sql = format!(
            r#"DELETE FROM "{t}" WHERE rowid IN (SELECT rowid FROM "{t}" WHERE {conds} LIMIT {limit}) AND {conds}"#
        );
        // The clause is written twice, and its placeholders are positional:
        // its values are bound twice.
        let q = args
            .iter()
            .chain(&args)
            .copied()
            .fold(sqlx::query(AssertSqlSafe(sql)), <sqlx::Sqlite as idem_sql::SqlDb>::bind);
        Ok(q.execute(&self.pool).await.map_err(store_error)?.rows_affected())
    }
}
