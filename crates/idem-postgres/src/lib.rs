//! The PostgreSQL store of **idem**: exactly-once effects whose key claim, business
//! writes and recorded outcome commit in one PostgreSQL transaction.
//!
//! The guide, with examples: `docs/http.md` in the repository.
//!
//! [`PgStore`] implements the three store traits of `idem-core`:
//!
//! - [`TxBackend`] (transactional mode, used by [`idem_core::TxEngine`]): the
//!   claim is an `INSERT … ON CONFLICT` on the key's primary key inside the
//!   caller's transaction. A concurrent twin blocks inside its own insert until
//!   the first transaction commits (then replays its outcome) or rolls back
//!   (then claims the key itself); that wait is bounded by the policy through
//!   `lock_timeout`. This path needs no advisory lock, a feature that
//!   Postgres-compatible distributed engines (CockroachDB, YugabyteDB) lack;
//!   this crate's own tests run on PostgreSQL. [`ClaimStrategy::AdvisoryLock`]
//!   additionally takes a transaction-scoped advisory lock on the key first.
//!   [`ClaimStrategy::OneWrite`] takes that lock instead of writing a claim
//!   row: the claim only reads the key, and the record inserts the completed
//!   row, so a fresh call writes one row (below SERIALIZABLE).
//! - [`LeaseStore`] (lease mode, used by [`idem_core::LeaseEngine`]): the same
//!   upsert in autocommit, with a lease and a fencing token; mark sent,
//!   complete, release and extend succeed only with the current token. A
//!   lease marked sent (status 4) is never taken over before the key
//!   expires: once its lease has run out it is an unknown outcome.
//! - [`Sweep`](idem_core::Sweep): deletes expired keys in short, bounded batches that skip rows
//!   a claim holds.
//!
//! ## Round trips
//!
//! A fresh transactional call costs what the caller's own transaction costs
//! and one round trip more: `BEGIN` travels with the claim, and the record
//! with `COMMIT`, each pair as one text query on the store's own transaction
//! type [`PgTx`]; then, before the caller's work runs, an empty query has
//! sqlx count the transaction as begun, so that a `begin()` in the caller's
//! code on `&mut **tx` is a savepoint of the claim's transaction, not a
//! second `BEGIN` whose `COMMIT` or `ROLLBACK` would end it half-way.
//!
//! | step | statements | round trips |
//! | --- | --- | --- |
//! | open and claim | `BEGIN; EXECUTE idem_first_…(…); EXECUTE idem_look_…(…)` | 1 |
//! | hand over (a claim that claimed) | an empty query | 1 |
//! | the caller's work | the caller's | the caller's |
//! | record and commit | `EXECUTE idem_record_…(…); COMMIT; BEGIN` | 1 |
//! | replay | the same first text; `ROLLBACK` is sent, not waited for | 1 |
//!
//! The `BEGIN` after `COMMIT` opens an empty transaction that sqlx's own
//! `ROLLBACK` ends: it is queued, and the ping with which the pool takes the
//! connection back sends it, so sqlx counts no transaction on a pooled
//! connection and the server sees no `ROLLBACK` outside one.
//!
//! Under the default [`ClaimStrategy::InsertOnConflict`] the claim is two
//! plain statements: `idem_first` inserts the key with `ON CONFLICT DO
//! NOTHING` (a fresh key is claimed by that one insert), and `idem_look`
//! reads the key's row after it, if the insert wrote nothing (a replay is
//! answered by it). A stale row to take over (an expired key used again, a
//! lease whose holder died) costs one round trip more (or two, if a twin's
//! row is committed meanwhile), for the general claim, sent with bound
//! parameters, which reads the row first, takes a stale row over and serves
//! every isolation level in one statement. Under [`ClaimStrategy::AdvisoryLock`] the first text is
//! `BEGIN; EXECUTE idem_claim_…(…)`. Under [`ClaimStrategy::OneWrite`] it is
//! `BEGIN; EXECUTE idem_lock_…(…); EXECUTE idem_claim_…(…)` (the lock statement
//! on its own, so at READ COMMITTED the claim reads in a snapshot taken after the
//! lock was granted) and the second `EXECUTE idem_insert_…(…); COMMIT`: still one
//! round trip each.
//!
//! - The claim and the record are prepared once per connection with SQL
//!   `PREPARE` (a connection that lost them, say after `DEALLOCATE ALL`,
//!   prepares them again), so neither is planned per request. Text queries
//!   take no bound parameters: values are written as literals whose meaning
//!   no server setting changes (escape strings `E'…'`, `decode('…', 'hex')`
//!   for bytes, decimal integers).
//! - A replay writes nothing and locks no row, at every isolation level: the
//!   first insert's `ON CONFLICT DO NOTHING` locks no row, and the general
//!   claim reads the key's row first and answers a live row (a recorded
//!   outcome, or a lease still running) without inserting (taking no
//!   advisory lock but under SERIALIZABLE). Under SERIALIZABLE the row is
//!   read only if the key is held (the general claim inserts first there
//!   too), so fresh claims take no predicate lock on the key's index page.
//! - Each claim bounds its own wait for a twin's uncommitted row through
//!   `lock_timeout`, and puts the caller's `lock_timeout` back before the
//!   caller's own writes run.
//! - The record fails unless it updated exactly the claimed row, and then the
//!   `COMMIT` sent with it does not run: the caller's writes never commit
//!   without their outcome.
//! - A nested transaction begun on the claim's connection and never ended
//!   (a savepoint whose `sqlx::Transaction` was leaked), or one whose failed
//!   or cancelled `begin` made sqlx roll the claim's transaction back, fails
//!   the record and the commit, and nothing of the claim commits: the
//!   connection is closed, which rolls the whole transaction back. A
//!   rollback or a drop closes it too, so a connection never goes back to
//!   the pool inside a transaction.
//! - A `ROLLBACK` right after a claim that found the key held (a replay, a
//!   key in progress) is written to the connection and its answer left to
//!   the ping with which the pool takes the connection back, before anyone
//!   can acquire it: a replay has its answer after one round trip. Every
//!   other rollback waits for its answer: after a claim that claimed, a
//!   claim that follows at once must find the key free, and after the
//!   caller's queries one of them may still owe its own answer.
//! - Dropping an open [`PgTx`] rolls it back before its connection returns to
//!   the pool.
//!
//! Both need a session of their own per connection, as sqlx's own prepared
//! statements do: behind PgBouncer use session pooling.
//!
//! Every time stored or compared comes from the engine's clock as a bound
//! parameter, never from the database's `now()`, so tests drive expiry and
//! leases with a manual clock.
//!
//! ```no_run
//! use idem_core::{Call, Fingerprint, IdempotencyKey, Scope, TxEngine};
//! use idem_postgres::{ClaimStrategy, PgStore};
//! use sqlx::postgres::PgPoolOptions;
//!
//! async fn top_up() -> Result<(), idem_core::Error> {
//!     let pool = PgPoolOptions::new()
//!         .max_connections(16)
//!         .connect("postgres://postgres@127.0.0.1:5432/test")
//!         .await
//!         .map_err(idem_postgres::store_error)?;
//!     let store = PgStore::new(pool).with_claim_strategy(ClaimStrategy::InsertOnConflict);
//!     store.migrate().await?;
//!     let engine = TxEngine::new(store);
//!
//!     let scope = Scope::parse("tenant-42", "POST /v1/top-ups")?;
//!     let body = br#"{"account_id":7,"amount":100}"#;
//!     let fingerprint = Fingerprint::of_json(scope.operation(), body)?;
//!     let call = Call::new(scope, IdempotencyKey::new("5f0c3f8e-8d43-4b39")?, fingerprint);
//!
//!     // The first call with this key inserts the top-up and records 100; a retry
//!     // replays 100 without running the closure. Both commit or neither does.
//!     let outcome = engine
//!         .execute(&call, |tx| {
//!             Box::pin(async move {
//!                 sqlx::query("INSERT INTO top_ups (account_id, amount) VALUES ($1, $2)")
//!                     .bind(7_i64)
//!                     .bind(100_i64)
//!                     .execute(&mut **tx)
//!                     .await
//!                     .map_err(idem_postgres::store_error)?;
//!                 Ok::<i64, idem_core::Error>(100)
//!             })
//!         })
//!         .await?;
//!     println!("top-up of {} (replayed: {})", outcome.value(), outcome.is_replayed());
//!     Ok(())
//! }
//! ```
//!
//! ## Schema
//!
//! [`PgStore::migrate`] creates (and later upgrades) the keys table, by
//! default `idem_keys`, and a `{table}_schema` table recording the applied
//! versions:
//!
//! | column | type | meaning |
//! | --- | --- | --- |
//! | `tenant`, `operation`, `idem_key` | `TEXT` | the primary key: a key only means something in its scope |
//! | `fingerprint` | `BYTEA` (32 bytes) | SHA-256 of the request that claimed the key |
//! | `status` | `SMALLINT` | 0 in progress, 1 completed, 2 rejected, 3 unknown outcome, 4 sent (a lease-mode claim whose request may have reached the other side) |
//! | `token` | `BIGINT` | the fencing token of the current claim |
//! | `payload` | `BYTEA NULL` | the recorded outcome, replayed byte for byte |
//! | `created_at_ms`, `expires_at_ms` | `BIGINT` | claim time and expiry (ms since the epoch; indexed for the sweeper) |
//! | `lease_expires_at_ms` | `BIGINT NULL` | when a lease-mode claim may be taken over (status 0), or becomes an unknown outcome (status 4) |
//! | `sent_at_ms` | `BIGINT NULL` | the earliest time the claim was marked sent; kept when its outcome is recorded (schema version 3) |
//!
//! ## Features
//!
//! This crate has no cargo features. It uses sqlx's `postgres` driver only
//! (runtime queries, no compile-time macros) on the tokio runtime; TLS is
//! whatever the caller enables on its own `sqlx` dependency.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use idem_core::{
    BoxFuture, ClaimRequest, Error, IdempotencyKey, LeaseClaim, LeaseStore, Record, Result, Scope, StoreErrorKind,
    StoredRow, TableName, Token, TxBackend, TxClaim,
};
use sqlx::postgres::{PgPool, PgRow};
use sqlx::{AssertSqlSafe, Postgres, Row};

use sql::{CLAIM_COLUMNS, ONE_WRITE_COLUMNS};

mod admin;
mod backend;
mod claim;
mod clock;
pub mod deadletter;
mod dialect;
mod error;
mod migrate;
pub mod multistep;
pub mod outbox;
mod sql;
mod tx;

use crate::claim::*;

pub use deadletter::PgDeadLetters;
pub use dialect::PgDialect;
pub use error::{is_contention, store_error};
pub use multistep::PgMultiSteps;
pub use outbox::PgOutbox;
pub use tx::PgTx;

use error::{LOCK_NOT_AVAILABLE, sqlstate};
use idem_sql::{Arg, SqlKeyRows};
use sql::Statements;

/// How many times a claim is attempted when the conflicting row disappears
/// between the insert and the read of it (a concurrent release or sweep).
const VANISHED_ROW_ATTEMPTS: u32 = 3;

/// How long a lease-mode claim may wait for a row lock. Lease claims commit
/// at once, so the only waits are on other single-statement claims of the
/// same key, or on a transactional claim of the key in an open transaction;
/// past this bound the claim fails with a retryable
/// [`StoreErrorKind::LockTimeout`] instead of hanging.
const LEASE_CLAIM_LOCK_TIMEOUT: Duration = Duration::from_secs(2);

/// How a transactional claim excludes a concurrent twin.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ClaimStrategy {
    /// The key's primary key is the lock: the claim is an
    /// `INSERT … ON CONFLICT DO UPDATE … WHERE <stale>`, and a twin blocks
    /// inside its own insert until the first transaction ends. Works on
    /// engines without advisory locks (CockroachDB, YugabyteDB).
    #[default]
    InsertOnConflict,
    /// Takes `pg_advisory_xact_lock` on a hash of the table, tenant, operation
    /// and key before the same insert, so twins queue on the advisory lock.
    /// PostgreSQL only. Lease-mode claims, which commit at once, never take it.
    AdvisoryLock,
    /// One row written per fresh call: the claim takes
    /// `pg_advisory_xact_lock` on a 64-bit hash of the table, tenant,
    /// operation and key and reads the key's row, writing nothing; the
    /// record inserts the completed row with one plain `INSERT` sent with
    /// `COMMIT`. A twin queues on the advisory lock (bounded by the
    /// policy's wait) and then reads the committed row and replays, or
    /// claims if the first rolled back. The row is always read by its full
    /// key, so two keys whose hashes collide only take turns, never answer
    /// for each other; the primary key still refuses a second completed
    /// row, and a record that meets one (a lease-mode claim of the same key
    /// committed meanwhile) fails as a serialisation failure, so the engine
    /// runs the call again and finds that row.
    ///
    /// An expired row is deleted by the claim. A replay reads the row and
    /// takes no lock. At REPEATABLE READ a twin that had to wait for the lock
    /// reads in a snapshot taken before the first committed, so its claim
    /// fails as a serialisation failure and the engine begins again (then it
    /// replays). Under SERIALIZABLE a read of an absent key would take a
    /// predicate lock that fails unrelated claims' commits, so there the
    /// claim inserts its placeholder first as [`AdvisoryLock`](Self::AdvisoryLock)
    /// does and writes the row twice. PostgreSQL only; lease-mode claims never
    /// take the lock.
    OneWrite,
}

/// The index the sweeper finds expired rows by, which
/// [`PgStore::migrate`] makes the table's (creating it, and dropping the
/// other kind).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ExpiryIndex {
    /// A B-tree on `expires_at_ms` (`{table}_expires_at_ms_idx`): each
    /// insert adds an entry (a WAL record), and the sweep reads the oldest
    /// expired rows directly.
    #[default]
    BTree,
    /// A BRIN index on `expires_at_ms` (`{table}_expires_at_ms_brin`): an
    /// insert adds no entry (ranges are summarised later, by vacuum), and
    /// the sweep reads whole block ranges whose expiries may have passed.
    /// Rows are written in the order they expire when one TTL is used, so
    /// the ranges stay narrow; but a range keeps its summary after its rows
    /// are deleted, so each sweep batch reads again the dead rows earlier
    /// batches left until vacuum runs (a slower sweep: docs/benchmarks.md).
    Brin,
    /// No expiry index: nothing per insert, and each sweep batch scans the
    /// table in its physical order up to the expired rows, so its cost
    /// grows with the table.
    None,
}

/// The PostgreSQL store: a connection pool, a keys table and a claim strategy.
///
/// Cloning is cheap: clones share the pool and the prepared SQL text.
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> idem_core::Result<()> {
/// use idem_core::TableName;
/// use idem_postgres::{ClaimStrategy, PgStore};
/// let store = PgStore::new(pool)
///     .with_table(TableName::new("payment_keys")?)
///     .with_claim_strategy(ClaimStrategy::AdvisoryLock);
/// store.migrate().await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct PgStore {
    pool: PgPool,
    table: TableName,
    strategy: ClaimStrategy,
    expiry_index: ExpiryIndex,
    sql: Arc<Statements>,
    rows: SqlKeyRows<PgDialect>,
}

impl fmt::Debug for PgStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgStore")
            .field("table", &self.table)
            .field("strategy", &self.strategy)
            .field("expiry_index", &self.expiry_index)
            .field("pool", &self.pool)
            .finish_non_exhaustive()
    }
}

impl PgStore {
    /// A store on `pool` with the default table (`idem_keys`) and the
    /// [`InsertOnConflict`](ClaimStrategy::InsertOnConflict) strategy.
    pub fn new(pool: PgPool) -> Self {
        let table = TableName::default();
        let strategy = ClaimStrategy::default();
        let sql = Arc::new(Statements::new(&table, strategy));
        let rows = SqlKeyRows::new(pool.clone(), table.clone(), sql::sweep(&table));
        Self {
            pool,
            table,
            strategy,
            expiry_index: ExpiryIndex::default(),
            sql,
            rows,
        }
    }

    /// Uses another keys table (one per service, or per kind of key).
    pub fn with_table(mut self, table: TableName) -> Self {
        self.rows = SqlKeyRows::new(self.pool.clone(), table.clone(), sql::sweep(&table));
        self.table = table;
        self.sql = Arc::new(Statements::new(&self.table, self.strategy));
        self
    }

    /// Chooses how transactional claims exclude concurrent twins.
    pub fn with_claim_strategy(mut self, strategy: ClaimStrategy) -> Self {
        self.strategy = strategy;
        self.sql = Arc::new(Statements::new(&self.table, self.strategy));
        self
    }

    /// Chooses the expiry index [`migrate`](Self::migrate) gives the table
    /// (see [`ExpiryIndex`]). Every process that migrates a table must
    /// choose the same one.
    pub fn with_expiry_index(mut self, index: ExpiryIndex) -> Self {
        self.expiry_index = index;
        self
    }

    /// The expiry index [`migrate`](Self::migrate) gives the table.
    pub fn expiry_index(&self) -> ExpiryIndex {
        self.expiry_index
    }

    /// The connection pool.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The keys table.
    pub fn table(&self) -> &TableName {
        &self.table
    }

    /// The claim strategy.
    pub fn claim_strategy(&self) -> ClaimStrategy {
        self.strategy
    }

    /// Creates or upgrades the keys table to the newest schema version.
    ///
    /// The migrations are embedded and versioned; the applied versions are
    /// recorded in `{table}_schema`. Safe to call from many processes at
    /// once, at any default isolation level (they take turns on
    /// PostgreSQL's `pg_advisory_xact_lock` in a READ COMMITTED
    /// transaction), and cheap when the schema is current. It also makes
    /// the table's expiry index the store's [`ExpiryIndex`] (not a schema
    /// version: changing the choice and migrating again switches it).
    pub async fn migrate(&self) -> Result<()> {
        migrate::run(&self.pool, &self.table, self.expiry_index).await
    }

    /// The schema versions the table has not had yet, with their SQL,
    /// without applying anything.
    pub async fn pending_migrations(&self) -> Result<Vec<idem_core::PendingMigration>> {
        migrate::pending(&self.pool, &self.table).await
    }

    /// The stored row of a key, if any (expired rows not yet swept
    /// included), with its [`sent_at_ms`](StoredRow::sent_at_ms).
    pub async fn get(&self, scope: &Scope, key: &IdempotencyKey) -> Result<Option<StoredRow>> {
        self.rows.get(scope, key).await
    }

    /// The claim upsert with its parameters bound.
    fn claim_query(
        &self,
        sql: &Arc<str>,
        req: &ClaimRequest<'_>,
        lock_timeout: Duration,
        advisory: bool,
    ) -> sqlx::query::Query<'static, Postgres, <Postgres as sqlx::Database>::Arguments> {
        let query = idem_sql::bound::<PgDialect>(
            AssertSqlSafe(sql.clone()),
            idem_sql::claim_args::<PgDialect>(req, req.fresh_token.0),
        )
        .bind(lock_timeout_setting(lock_timeout));
        if advisory {
            query.bind(self.advisory_key(req.scope, req.key))
        } else {
            query
        }
    }

    /// The advisory lock key of a (scope, key) in this table.
    fn advisory_key(&self, scope: &Scope, key: &IdempotencyKey) -> i64 {
        sql::fnv1a(&[
            b"idem-postgres claim",
            self.table.as_str().as_bytes(),
            scope.tenant().as_str().as_bytes(),
            scope.operation().as_str().as_bytes(),
            key.as_str().as_bytes(),
        ]) as i64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lock_timeout_is_never_zero_and_rounds_up() {
        assert_eq!(lock_timeout_setting(Duration::ZERO), "1");
        assert_eq!(lock_timeout_setting(Duration::from_micros(1_500)), "2");
        assert_eq!(lock_timeout_setting(Duration::from_secs(120)), "120000");
        assert_eq!(
            lock_timeout_setting(Duration::from_secs(u64::MAX)),
            i32::MAX.to_string()
        );
    }
}
