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
//! - [`Sweep`]: deletes expired keys in short, bounded batches that skip rows
//!   a claim holds.
//!
//! ## Round trips
//!
//! A fresh transactional call costs what the caller's own transaction costs
//! and no round trip more: `BEGIN` travels with the claim, and the record with
//! `COMMIT`, each pair as one text query on the store's own transaction type
//! [`PgTx`] (sqlx's `Transaction` would spend a round trip on `BEGIN` alone).
//!
//! | step | statements | round trips |
//! | --- | --- | --- |
//! | open and claim | `BEGIN; EXECUTE idem_claim_…(…)` | 1 |
//! | the caller's work | the caller's | the caller's |
//! | record and commit | `EXECUTE idem_record_…(…); COMMIT` | 1 |
//! | replay | `BEGIN; EXECUTE idem_claim_…(…)`, then `ROLLBACK` | 2 |
//!
//! Under [`ClaimStrategy::OneWrite`] the first text is
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
//! - The claim reads the key's row first: a live row (a recorded outcome, or
//!   a lease still running) is answered without inserting, so a replay writes
//!   nothing and locks no row, at every isolation level (and takes no
//!   advisory lock but under SERIALIZABLE): under SERIALIZABLE the claim inserts first with `ON CONFLICT DO
//!   NOTHING` and reads the row only if the key is held, so fresh claims take
//!   no predicate lock on the key's index page and a replay no row lock.
//! - The record fails unless it updated exactly the claimed row, and then the
//!   `COMMIT` sent with it does not run: the caller's writes never commit
//!   without their outcome.
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
    BoxFuture, ClaimRequest, Error, IdempotencyKey, Lease, LeaseClaim, LeaseStore, Record, Result, Scope,
    StoreErrorKind, StoredRow, Sweep, TableName, Token, TxBackend, TxClaim,
};
use sqlx::postgres::{PgPool, PgRow};
use sqlx::{AssertSqlSafe, Postgres, Row};

use sql::{CLAIM_COLUMNS, ONE_WRITE_COLUMNS};

mod clock;
pub mod deadletter;
mod error;
mod migrate;
pub mod outbox;
mod sql;
mod tx;

pub use deadletter::PgDeadLetters;
pub use error::{is_contention, store_error};
pub use outbox::PgOutbox;
pub use tx::PgTx;

use error::{LOCK_NOT_AVAILABLE, sqlstate};
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
        Self {
            pool,
            table,
            strategy,
            expiry_index: ExpiryIndex::default(),
            sql,
        }
    }

    /// Uses another keys table (one per service, or per kind of key).
    pub fn with_table(mut self, table: TableName) -> Self {
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
        let row = sqlx::query(AssertSqlSafe(self.sql.lookup.clone()))
            .bind(scope.tenant().as_str())
            .bind(scope.operation().as_str())
            .bind(key.as_str())
            .fetch_optional(&self.pool)
            .await
            .map_err(store_error)?;
        let Some(row) = row else { return Ok(None) };
        let sent_at_ms: Option<i64> = row.try_get(ROW_COLUMN_COUNT).map_err(store_error)?;
        Ok(Some(decode_row(&row, 0)?.with_sent_at_ms(sent_at_ms)))
    }

    /// The claim upsert with its parameters bound.
    fn claim_query(
        &self,
        sql: &Arc<str>,
        req: &ClaimRequest<'_>,
        lock_timeout: Duration,
        advisory: bool,
    ) -> sqlx::query::Query<'static, Postgres, <Postgres as sqlx::Database>::Arguments> {
        let query = sqlx::query(AssertSqlSafe(sql.clone()))
            .bind(req.scope.tenant().as_str())
            .bind(req.scope.operation().as_str())
            .bind(req.key.as_str())
            .bind(&req.fingerprint.as_bytes()[..])
            .bind(req.fresh_token.0)
            .bind(req.now_ms)
            .bind(req.expires_at_ms)
            .bind(req.lease_expires_at_ms)
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

/// `lock_timeout` in milliseconds, as the text `set_config` takes: at least
/// 1 ms (0 would mean "wait forever"), rounded up, and at most PostgreSQL's
/// largest value.
fn lock_timeout_setting(wait: Duration) -> String {
    let ms = wait.as_micros().div_ceil(1000).clamp(1, i32::MAX as u128);
    ms.to_string()
}

/// How many columns [`decode_row`] reads.
const ROW_COLUMN_COUNT: usize = 6;

/// Decodes the row columns every row-reading statement selects, starting at
/// column `first`.
fn decode_row(row: &PgRow, first: usize) -> Result<StoredRow> {
    // Rows of a text query arrive in the text format, which decodes to owned
    // bytes only.
    let fingerprint: Vec<u8> = row.try_get(first).map_err(store_error)?;
    let status: i16 = row.try_get(first + 1).map_err(store_error)?;
    let token: i64 = row.try_get(first + 2).map_err(store_error)?;
    let payload: Option<Vec<u8>> = row.try_get(first + 3).map_err(store_error)?;
    let lease_expires_at_ms: Option<i64> = row.try_get(first + 4).map_err(store_error)?;
    let expires_at_ms: i64 = row.try_get(first + 5).map_err(store_error)?;
    StoredRow::from_columns(&fingerprint, status, token, payload, lease_expires_at_ms, expires_at_ms)
}

/// Reads the transactional claim's answer (see [`sql::CLAIM_COLUMNS`]):
/// `Claimed`, `Found` with the live row it saw, or `None` when a live row
/// was committed after its snapshot and must be read again.
fn decide_claim(row: &PgRow) -> Result<Option<TxClaim>> {
    if row.len() < CLAIM_COLUMNS {
        return Err(Error::store(
            StoreErrorKind::Other,
            format!("the claim answered {} columns, fewer than {CLAIM_COLUMNS}", row.len()),
        ));
    }
    let token: Option<i64> = row.try_get(0).map_err(store_error)?;
    if token.is_some() {
        return Ok(Some(TxClaim::Claimed));
    }
    let live: bool = row.try_get(1).map_err(store_error)?;
    if live {
        return Ok(Some(TxClaim::Found(decode_row(row, 2)?)));
    }
    Ok(None)
}

/// The lock statement's state when it took the lock at once.
const LOCK_TAKEN: i32 = 0;

/// The lock statement's state when it took the lock after a twin released it.
const LOCK_AFTER_WAIT: i32 = 1;

fn vanished() -> Error {
    Error::store(
        StoreErrorKind::Serialization,
        "the key's row was deleted repeatedly while it was being claimed",
    )
}

impl PgStore {
    /// After a claim that neither claimed the key nor saw a live row: reads
    /// the row committed since in a new snapshot, or, if it vanished (a
    /// release or a sweep), claims again, in `tx`.
    async fn reread(&self, tx: &mut PgTx, req: &ClaimRequest<'_>) -> Result<Option<TxClaim>> {
        let found = sqlx::query(AssertSqlSafe(self.sql.select_row.clone()))
            .bind(req.scope.tenant().as_str())
            .bind(req.scope.operation().as_str())
            .bind(req.key.as_str())
            .fetch_optional(&mut **tx)
            .await
            .map_err(store_error)?;
        match found {
            Some(row) => {
                tracing::debug!(table = self.table.as_str(), "key found committed");
                Ok(Some(TxClaim::Found(decode_row(&row, 0)?)))
            }
            None => {
                tracing::debug!(table = self.table.as_str(), "conflicting row vanished; claiming again");
                Ok(None)
            }
        }
    }

    /// Reads the answers of the one-write lock and claim (see
    /// [`ClaimStrategy::OneWrite`]); on the one-write path a claim is noted
    /// on `tx`, with the token the record will insert.
    fn decide_one_write(
        &self,
        tx: &mut PgTx,
        req: &ClaimRequest<'_>,
        lock: &PgRow,
        row: &PgRow,
    ) -> Result<Option<TxClaim>> {
        if row.len() != ONE_WRITE_COLUMNS || lock.len() != 2 {
            return Err(Error::store(
                StoreErrorKind::Other,
                format!(
                    "the one-write claim answered {} and {} columns, not 2 and {ONE_WRITE_COLUMNS}",
                    lock.len(),
                    row.len()
                ),
            ));
        }
        let one_write: bool = row.try_get(CLAIM_COLUMNS).map_err(store_error)?;
        if !one_write {
            // SERIALIZABLE: the insert-first claim ran.
            return decide_claim(row);
        }
        let live: bool = row.try_get(1).map_err(store_error)?;
        if live {
            return Ok(Some(TxClaim::Found(decode_row(row, 2)?)));
        }
        let state: i32 = lock.try_get(0).map_err(store_error)?;
        let snapshot_held: bool = lock.try_get(1).map_err(store_error)?;
        match state {
            LOCK_TAKEN => {}
            LOCK_AFTER_WAIT if !snapshot_held => {}
            LOCK_AFTER_WAIT => {
                // The snapshot was taken before the twin we waited for
                // committed: a new transaction reads what it wrote.
                return Err(Error::store(
                    StoreErrorKind::Serialization,
                    "the key's twin ended while this claim waited, after its snapshot was taken",
                ));
            }
            _ => {
                // A live row seen by the lock statement was gone for the
                // claim (purged between the two): the lock is not held.
                return Err(Error::store(
                    StoreErrorKind::Serialization,
                    "the key's row was deleted while it was being claimed",
                ));
            }
        }
        let gone: Option<i64> = row.try_get(CLAIM_COLUMNS + 1).map_err(store_error)?;
        let fresh = req.fresh_token.0;
        let token = gone.map_or(fresh, |old| fresh.max(old.saturating_add(1)));
        tx.hold_one_write(req, token);
        Ok(Some(TxClaim::Claimed))
    }

    /// The one-write claim on a transaction opened with `begin`: the lock
    /// and the claim as bound statements.
    async fn claim_one_write(
        &self,
        tx: &mut PgTx,
        one_write: &sql::OneWriteStatements,
        req: &ClaimRequest<'_>,
        wait: Duration,
    ) -> Result<TxClaim> {
        let lock = sqlx::query(AssertSqlSafe(one_write.lock.clone()))
            .bind(req.scope.tenant().as_str())
            .bind(req.scope.operation().as_str())
            .bind(req.key.as_str())
            .bind(req.now_ms)
            .bind(lock_timeout_setting(wait))
            .bind(self.advisory_key(req.scope, req.key))
            .fetch_one(&mut **tx)
            .await;
        let lock = match lock {
            Ok(lock) => lock,
            Err(e) if sqlstate(&e).as_deref() == Some(LOCK_NOT_AVAILABLE) => return Ok(self.busy(wait)),
            Err(e) => return Err(store_error(e)),
        };
        let row = match self
            .claim_query(&self.sql.claim_tx, req, wait, false)
            .fetch_one(&mut **tx)
            .await
        {
            Ok(row) => row,
            Err(e) if sqlstate(&e).as_deref() == Some(LOCK_NOT_AVAILABLE) => return Ok(self.busy(wait)),
            Err(e) => return Err(store_error(e)),
        };
        if let Some(answer) = self.decide_one_write(tx, req, &lock, &row)? {
            return Ok(answer);
        }
        self.reread(tx, req).await?.ok_or_else(vanished)
    }

    fn busy(&self, wait: Duration) -> TxClaim {
        tracing::debug!(
            table = self.table.as_str(),
            wait_ms = wait.as_millis() as u64,
            "key busy"
        );
        TxClaim::Busy
    }
}

impl TxBackend for PgStore {
    type Tx = PgTx;

    fn begin(&self) -> BoxFuture<'_, Result<PgTx>> {
        Box::pin(PgTx::begin(&self.pool))
    }

    fn claim<'a>(
        &'a self,
        tx: &'a mut PgTx,
        req: &'a ClaimRequest<'a>,
        wait: Duration,
    ) -> BoxFuture<'a, Result<TxClaim>> {
        Box::pin(async move {
            if let Some(one_write) = &self.sql.one_write {
                return self.claim_one_write(tx, one_write, req, wait).await;
            }
            let advisory = self.strategy == ClaimStrategy::AdvisoryLock;
            for _ in 0..VANISHED_ROW_ATTEMPTS {
                let answered = self
                    .claim_query(&self.sql.claim_tx, req, wait, advisory)
                    .fetch_one(&mut **tx)
                    .await;
                let row = match answered {
                    Ok(row) => row,
                    // The twin that holds the key did not finish within `wait`.
                    // The failed statement aborted this transaction; the engine
                    // rolls it back and decides whether to try again.
                    Err(e) if sqlstate(&e).as_deref() == Some(LOCK_NOT_AVAILABLE) => return Ok(self.busy(wait)),
                    Err(e) => return Err(store_error(e)),
                };
                if let Some(answer) = decide_claim(&row)? {
                    return Ok(answer);
                }
                if let Some(answer) = self.reread(tx, req).await? {
                    return Ok(answer);
                }
            }
            Err(vanished())
        })
    }

    /// `BEGIN` and the claim in one round trip (see [`PgTx`]); a claim that
    /// must read a row committed after its snapshot takes one more.
    fn begin_claim<'a>(&'a self, req: &'a ClaimRequest<'a>, wait: Duration) -> BoxFuture<'a, Result<(PgTx, TxClaim)>> {
        Box::pin(async move {
            let conn = self.pool.acquire().await.map_err(store_error)?;
            let advisory =
                (self.strategy == ClaimStrategy::AdvisoryLock).then(|| self.advisory_key(req.scope, req.key));
            let lock_timeout = lock_timeout_setting(wait);
            let mut execute = tx::execute_claim(&self.sql.claim_tx_name, req, &lock_timeout, advisory);
            let mut prepared = vec![
                (&*self.sql.record_tx_name, &*self.sql.prepare_record_tx),
                (&*self.sql.claim_tx_name, &*self.sql.prepare_claim_tx),
            ];
            if let Some(one_write) = &self.sql.one_write {
                let lock = tx::execute_lock(
                    &one_write.lock_name,
                    req,
                    &lock_timeout,
                    self.advisory_key(req.scope, req.key),
                );
                execute = format!("{lock}; {execute}");
                prepared.push((&one_write.lock_name, &one_write.prepare_lock));
                prepared.push((&one_write.insert_name, &one_write.prepare_insert));
            }
            let (mut tx, row) = match tx::begin_claim(conn, &prepared, execute).await {
                Ok(claimed) => claimed,
                Err((tx, e)) if sqlstate(&e).as_deref() == Some(LOCK_NOT_AVAILABLE) => {
                    return Ok((tx, self.busy(wait)));
                }
                Err((tx, e)) => {
                    if let Err(rollback) = tx.rollback().await {
                        tracing::debug!(error = %rollback, "rollback after a failed claim failed");
                    }
                    return Err(store_error(e));
                }
            };
            let decided = match &row {
                tx::ClaimRows::Claim(row) => decide_claim(row),
                tx::ClaimRows::LockThenClaim(lock, row) => self.decide_one_write(&mut tx, req, lock, row),
            };
            let answer = match decided {
                Ok(Some(answer)) => Ok(answer),
                Ok(None) => match self.reread(&mut tx, req).await {
                    Ok(Some(answer)) => Ok(answer),
                    Ok(None) => self.claim(&mut tx, req, wait).await,
                    Err(e) => Err(e),
                },
                Err(e) => Err(e),
            };
            match answer {
                Ok(answer) => {
                    if answer == TxClaim::Claimed {
                        tracing::debug!(table = self.table.as_str(), "claimed key in transaction");
                    }
                    Ok((tx, answer))
                }
                Err(e) => {
                    if let Err(rollback) = tx.rollback().await {
                        tracing::debug!(error = %rollback, "rollback after a failed claim failed");
                    }
                    Err(e)
                }
            }
        })
    }

    fn record<'a>(
        &'a self,
        tx: &'a mut PgTx,
        req: &'a ClaimRequest<'a>,
        record: &'a Record,
    ) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            if let (Some(one_write), Some(token)) = (&self.sql.one_write, tx.one_write_token(req)) {
                sqlx::query(AssertSqlSafe(one_write.insert.clone()))
                    .bind(req.scope.tenant().as_str())
                    .bind(req.scope.operation().as_str())
                    .bind(req.key.as_str())
                    .bind(&req.fingerprint.as_bytes()[..])
                    .bind(record.status.code())
                    .bind(token)
                    .bind(&record.payload[..])
                    .bind(req.now_ms)
                    .bind(req.expires_at_ms)
                    .execute(&mut **tx)
                    .await
                    .map_err(tx::record_error)?;
                return Ok(());
            }
            let done = sqlx::query(AssertSqlSafe(self.sql.record.clone()))
                .bind(req.scope.tenant().as_str())
                .bind(req.scope.operation().as_str())
                .bind(req.key.as_str())
                .bind(record.status.code())
                .bind(&record.payload[..])
                .execute(&mut **tx)
                .await
                .map_err(store_error)?;
            if done.rows_affected() != 1 {
                return Err(Error::Config(
                    "record called on a transaction that holds no claim of this key".into(),
                ));
            }
            Ok(())
        })
    }

    /// The record and `COMMIT` in one round trip (see [`PgTx`]).
    fn record_commit<'a>(
        &'a self,
        tx: PgTx,
        req: &'a ClaimRequest<'a>,
        record: &'a Record,
    ) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            if !tx.has_prepared_record() {
                // A transaction opened with `begin` and claimed with `claim`:
                // its connection may not have the prepared record.
                let mut tx = tx;
                if let Err(e) = self.record(&mut tx, req, record).await {
                    if let Err(rollback) = tx.rollback().await {
                        tracing::debug!(error = %rollback, "rollback after a failed record failed");
                    }
                    return Err(e);
                }
                return tx.commit().await;
            }
            if let (Some(one_write), Some(token)) = (&self.sql.one_write, tx.one_write_token(req)) {
                return tx::record_commit(
                    tx,
                    &one_write.prepare_insert,
                    tx::execute_insert(&one_write.insert_name, req, record, token),
                )
                .await;
            }
            tx::record_commit(
                tx,
                &self.sql.prepare_record_tx,
                tx::execute_record(&self.sql.record_tx_name, req, record),
            )
            .await
        })
    }

    fn commit(&self, tx: PgTx) -> BoxFuture<'_, Result<()>> {
        Box::pin(tx.commit())
    }

    fn rollback(&self, tx: PgTx) -> BoxFuture<'_, Result<()>> {
        Box::pin(tx.rollback())
    }
}

impl LeaseStore for PgStore {
    fn try_claim<'a>(&'a self, req: &'a ClaimRequest<'a>) -> BoxFuture<'a, Result<LeaseClaim>> {
        Box::pin(async move {
            for _ in 0..VANISHED_ROW_ATTEMPTS {
                // Autocommit: the claim is durable when this statement returns.
                let inserted = self
                    .claim_query(&self.sql.claim_lease, req, LEASE_CLAIM_LOCK_TIMEOUT, false)
                    .fetch_optional(&self.pool)
                    .await
                    .map_err(store_error)?;
                if let Some(row) = inserted {
                    let token = Token(row.try_get(0).map_err(store_error)?);
                    tracing::debug!(table = self.table.as_str(), token = token.0, "acquired lease");
                    return Ok(LeaseClaim::Acquired(token));
                }
                let found = self.get(req.scope, req.key).await?;
                if let Some(row) = found {
                    return Ok(LeaseClaim::Found(row));
                }
                // Released or swept between the two statements: the key is free again.
                tracing::debug!(table = self.table.as_str(), "conflicting row vanished; claiming again");
            }
            Err(vanished())
        })
    }

    fn mark_sent<'a>(&'a self, lease: &'a Lease, now_ms: i64) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            // Autocommit: the mark is durable before anything is sent.
            let done = sqlx::query(AssertSqlSafe(self.sql.mark_sent.clone()))
                .bind(lease.scope.tenant().as_str())
                .bind(lease.scope.operation().as_str())
                .bind(lease.key.as_str())
                .bind(lease.token.0)
                .bind(now_ms)
                .execute(&self.pool)
                .await
                .map_err(store_error)?;
            self.fenced_unless_one(done.rows_affected(), lease, "mark sent")
        })
    }

    fn lookup<'a>(&'a self, scope: &'a Scope, key: &'a IdempotencyKey) -> BoxFuture<'a, Result<Option<StoredRow>>> {
        Box::pin(self.get(scope, key))
    }

    fn complete<'a>(&'a self, lease: &'a Lease, record: &'a Record) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            let done = sqlx::query(AssertSqlSafe(self.sql.complete.clone()))
                .bind(lease.scope.tenant().as_str())
                .bind(lease.scope.operation().as_str())
                .bind(lease.key.as_str())
                .bind(lease.token.0)
                .bind(record.status.code())
                .bind(&record.payload[..])
                .execute(&self.pool)
                .await
                .map_err(store_error)?;
            self.fenced_unless_one(done.rows_affected(), lease, "complete")
        })
    }

    fn release<'a>(&'a self, lease: &'a Lease) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            let done = sqlx::query(AssertSqlSafe(self.sql.release.clone()))
                .bind(lease.scope.tenant().as_str())
                .bind(lease.scope.operation().as_str())
                .bind(lease.key.as_str())
                .bind(lease.token.0)
                .execute(&self.pool)
                .await
                .map_err(store_error)?;
            self.fenced_unless_one(done.rows_affected(), lease, "release")
        })
    }

    fn extend<'a>(&'a self, lease: &'a Lease, lease_expires_at_ms: i64) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            let done = sqlx::query(AssertSqlSafe(self.sql.extend.clone()))
                .bind(lease.scope.tenant().as_str())
                .bind(lease.scope.operation().as_str())
                .bind(lease.key.as_str())
                .bind(lease.token.0)
                .bind(lease_expires_at_ms)
                .execute(&self.pool)
                .await
                .map_err(store_error)?;
            self.fenced_unless_one(done.rows_affected(), lease, "extend")
        })
    }

    fn resolve_unknown<'a>(
        &'a self,
        scope: &'a Scope,
        key: &'a IdempotencyKey,
        now_ms: i64,
        resolution: Option<&'a Record>,
    ) -> BoxFuture<'a, Result<bool>> {
        Box::pin(async move {
            let sql = match resolution {
                Some(_) => self.sql.resolve_record.clone(),
                None => self.sql.resolve_release.clone(),
            };
            let mut query = sqlx::query(AssertSqlSafe(sql))
                .bind(scope.tenant().as_str())
                .bind(scope.operation().as_str())
                .bind(key.as_str())
                .bind(now_ms);
            if let Some(record) = resolution {
                query = query.bind(record.status.code()).bind(record.payload.clone());
            }
            let done = query.execute(&self.pool).await.map_err(store_error)?;
            Ok(done.rows_affected() == 1)
        })
    }
}

impl PgStore {
    /// A lease statement changed its row only if the lease is still current.
    fn fenced_unless_one(&self, rows: u64, lease: &Lease, action: &'static str) -> Result<()> {
        if rows == 1 {
            return Ok(());
        }
        tracing::debug!(
            table = self.table.as_str(),
            token = lease.token.0,
            action,
            "lease fenced"
        );
        Err(Error::Fenced)
    }
}

impl Sweep for PgStore {
    fn sweep_expired(&self, now_ms: i64, limit: u32) -> BoxFuture<'_, Result<u64>> {
        Box::pin(async move {
            let done = sqlx::query(AssertSqlSafe(self.sql.sweep.clone()))
                .bind(now_ms)
                .bind(i64::from(limit))
                .execute(&self.pool)
                .await
                .map_err(store_error)?;
            tracing::debug!(
                table = self.table.as_str(),
                deleted = done.rows_affected(),
                limit,
                "swept expired keys"
            );
            Ok(done.rows_affected())
        })
    }
}

impl PgStore {
    /// How many keys the table holds, by state, at `now_ms`.
    pub async fn stats(&self, now_ms: i64) -> Result<idem_core::KeyStats> {
        let t = self.table.as_str();
        let (in_progress, completed, rejected, unknown, sent, expired): (i64, i64, i64, i64, i64, i64) =
            sqlx::query_as(AssertSqlSafe(format!(
                "SELECT COUNT(*) FILTER (WHERE status = 0 AND expires_at_ms > $1), \
                    COUNT(*) FILTER (WHERE status = 1 AND expires_at_ms > $1), \
                    COUNT(*) FILTER (WHERE status = 2 AND expires_at_ms > $1), \
                    COUNT(*) FILTER (WHERE status = 3 AND expires_at_ms > $1), \
                    COUNT(*) FILTER (WHERE status = 4 AND expires_at_ms > $1), \
                    COUNT(*) FILTER (WHERE expires_at_ms <= $1) FROM {t}"
            )))
            .bind(now_ms)
            .fetch_one(&self.pool)
            .await
            .map_err(store_error)?;
        Ok(idem_core::KeyStats {
            in_progress: in_progress as u64,
            completed: completed as u64,
            rejected: rejected as u64,
            unknown: unknown as u64,
            sent: sent as u64,
            expired: expired as u64,
        })
    }

    /// Whether `table` exists where this store's connections look for it
    /// (their `search_path`), so the operator's commands can name a missing
    /// table as such.
    pub async fn table_exists(&self, table: &TableName) -> Result<bool> {
        sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
            .bind(table.as_str())
            .fetch_one(&self.pool)
            .await
            .map_err(store_error)
    }
}

/// The WHERE clause of a [`KeyFilter`] and its binds, numbered from `$2`
/// (`$1` is the time).
fn key_filter_sql(filter: &idem_core::KeyFilter) -> (String, Vec<KeyBind>) {
    let mut conds = Vec::new();
    let mut binds = Vec::new();
    let mut n = 1;
    let mut next = |b: KeyBind, binds: &mut Vec<KeyBind>| {
        n += 1;
        binds.push(b);
        format!("${n}")
    };
    if let Some(t) = &filter.tenant {
        conds.push(format!("tenant = {}", next(KeyBind::Text(t.clone()), &mut binds)));
    }
    if let Some(o) = &filter.operation {
        conds.push(format!("operation = {}", next(KeyBind::Text(o.clone()), &mut binds)));
    }
    if let Some(p) = &filter.key_prefix {
        let len = next(KeyBind::Int(p.len() as i64), &mut binds);
        let value = next(KeyBind::Text(p.clone()), &mut binds);
        conds.push(format!("left(idem_key, {len}::int) = {value}"));
    }
    if let Some(age) = filter.older_than_ms {
        conds.push(format!("created_at_ms <= $1 - {}", next(KeyBind::Int(age), &mut binds)));
    }
    match filter.state {
        Some(idem_core::KeyState::InProgress) => conds.push("status = 0 AND expires_at_ms > $1".into()),
        Some(idem_core::KeyState::Completed) => conds.push("status = 1 AND expires_at_ms > $1".into()),
        Some(idem_core::KeyState::Rejected) => conds.push("status = 2 AND expires_at_ms > $1".into()),
        Some(idem_core::KeyState::Unknown) => conds.push("status = 3 AND expires_at_ms > $1".into()),
        Some(idem_core::KeyState::Sent) => conds.push("status = 4 AND expires_at_ms > $1".into()),
        Some(idem_core::KeyState::Expired) => conds.push("expires_at_ms <= $1".into()),
        None => conds.push("$1 = $1".into()),
    }
    (conds.join(" AND "), binds)
}

enum KeyBind {
    Text(String),
    Int(i64),
}

/// The columns an operator sees, in the order of [`KeyRow`].
const KEY_COLUMNS: &str = "tenant, operation, idem_key, status, created_at_ms, expires_at_ms, payload";

/// A row of [`KEY_COLUMNS`].
type KeyRow = (String, String, String, i16, i64, i64, Option<Vec<u8>>);

fn key_info(
    (tenant, operation, key, status, created_at_ms, expires_at_ms, payload): KeyRow,
    now_ms: i64,
) -> idem_core::KeyInfo {
    idem_core::KeyInfo {
        tenant,
        operation,
        key,
        state: idem_core::KeyState::of(status, expires_at_ms, now_ms),
        created_at_ms,
        expires_at_ms,
        payload: payload.unwrap_or_default(),
    }
}

impl PgStore {
    /// Keys matching `filter` at `now_ms`, oldest first, at most `limit`.
    pub async fn list_keys(
        &self,
        filter: &idem_core::KeyFilter,
        now_ms: i64,
        limit: u32,
    ) -> Result<Vec<idem_core::KeyInfo>> {
        let (conds, binds) = key_filter_sql(filter);
        let sql = format!(
            "SELECT {KEY_COLUMNS} FROM {} WHERE {conds} ORDER BY created_at_ms LIMIT {limit}",
            self.table.as_str()
        );
        let mut q = sqlx::query_as::<_, KeyRow>(AssertSqlSafe(sql)).bind(now_ms);
        for b in binds {
            q = match b {
                KeyBind::Text(t) => q.bind(t),
                KeyBind::Int(i) => q.bind(i),
            };
        }
        let rows = q.fetch_all(&self.pool).await.map_err(store_error)?;
        Ok(rows.into_iter().map(|row| key_info(row, now_ms)).collect())
    }

    /// The key `key` of `scope`, by its exact value, as it is at `now_ms`.
    pub async fn find_key(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        now_ms: i64,
    ) -> Result<Option<idem_core::KeyInfo>> {
        let sql = format!(
            "SELECT {KEY_COLUMNS} FROM {} WHERE tenant = $1 AND operation = $2 AND idem_key = $3",
            self.table.as_str()
        );
        let row = sqlx::query_as::<_, KeyRow>(AssertSqlSafe(sql))
            .bind(scope.tenant().as_str())
            .bind(scope.operation().as_str())
            .bind(key.as_str())
            .fetch_optional(&self.pool)
            .await
            .map_err(store_error)?;
        Ok(row.map(|row| key_info(row, now_ms)))
    }

    /// Deletes at most `limit` keys matching `filter` at `now_ms`; answers how many.
    ///
    /// Like the sweep, the batch is taken `FOR UPDATE SKIP LOCKED`: a row a
    /// claim is taking over right now (locked, uncommitted) is skipped, not
    /// waited for, and a row whose takeover committed meanwhile is checked
    /// again on its newest version when it is locked (no longer expired: not
    /// taken). The batch is a CTE, which PostgreSQL runs once (a locking
    /// subquery under `IN` may run again for each row and lock more than
    /// the limit), and the delete repeats the filter, so no row that
    /// stopped matching is deleted whatever the plan.
    pub async fn purge_keys(&self, filter: &idem_core::KeyFilter, now_ms: i64, limit: u32) -> Result<u64> {
        let (conds, binds) = key_filter_sql(filter);
        let t = self.table.as_str();
        let sql = format!(
            "WITH batch (b_tenant, b_operation, b_key) AS (\
             SELECT tenant, operation, idem_key FROM {t} WHERE {conds} LIMIT {limit} FOR UPDATE SKIP LOCKED) \
             DELETE FROM {t} USING batch \
             WHERE tenant = b_tenant AND operation = b_operation AND idem_key = b_key AND {conds}"
        );
        let mut q = sqlx::query(AssertSqlSafe(sql)).bind(now_ms);
        for b in binds {
            q = match b {
                KeyBind::Text(t) => q.bind(t),
                KeyBind::Int(i) => q.bind(i),
            };
        }
        Ok(q.execute(&self.pool).await.map_err(store_error)?.rows_affected())
    }
}

/// The operator's commands go through the inherent methods above (the same
/// names: inherent methods are found first, so these never call themselves).
impl idem_core::KeyAdmin for PgStore {
    fn stats(&self, now_ms: i64) -> idem_core::BoxFuture<'_, Result<idem_core::KeyStats>> {
        Box::pin(PgStore::stats(self, now_ms))
    }

    fn list_keys<'a>(
        &'a self,
        filter: &'a idem_core::KeyFilter,
        now_ms: i64,
        limit: u32,
    ) -> idem_core::BoxFuture<'a, Result<Vec<idem_core::KeyInfo>>> {
        Box::pin(PgStore::list_keys(self, filter, now_ms, limit))
    }

    fn find_key<'a>(
        &'a self,
        scope: &'a Scope,
        key: &'a IdempotencyKey,
        now_ms: i64,
    ) -> idem_core::BoxFuture<'a, Result<Option<idem_core::KeyInfo>>> {
        Box::pin(PgStore::find_key(self, scope, key, now_ms))
    }

    fn purge_keys<'a>(
        &'a self,
        filter: &'a idem_core::KeyFilter,
        now_ms: i64,
        limit: u32,
    ) -> idem_core::BoxFuture<'a, Result<u64>> {
        Box::pin(PgStore::purge_keys(self, filter, now_ms, limit))
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
