//! The MySQL and MariaDB store for **idem**: exactly-once effects whose key
//! claim, business writes and recorded outcome commit in one InnoDB
//! transaction.
//!
//! The guide, with examples: `docs/http.md` in the repository.
//!
//! [`MySqlStore`] implements all three store traits of `idem-core`:
//!
//! | mode | trait | how the key is held |
//! | --- | --- | --- |
//! | transactional | [`TxBackend`] | an uncommitted placeholder row: a twin's duplicate `INSERT` blocks on it, then collides on the primary key; or, under [`ClaimStrategy::NamedLock`], the server's named lock on a hash of the key, with no row until the record inserts the completed one |
//! | lease (check–claim–complete) | [`LeaseStore`] | a committed in-progress row with a lease and a fencing token; marked sent before the holder's request leaves, it is never taken over |
//! | retention | [`Sweep`](idem_core::Sweep) | `DELETE … ORDER BY expires_at_ms LIMIT n` in short batches |
//!
//! Every time it stores or compares comes from the engine's clock (never the
//! server's `NOW()`), so expiry and leases behave the same under a test clock.
//!
//! ## The keys table
//!
//! One row per key, its primary key `(tenant, operation, idem_key)` in
//! binary columns; [`MySqlStore::migrate`] creates the table and brings it
//! to the latest schema version, recorded in `{table}_schema`.
//!
//! | `status` | the row holds | taken over by a claim |
//! | --- | --- | --- |
//! | 0 | a claim in progress (`lease_expires_at_ms` set in lease mode) | once its lease has run out, or the key expired |
//! | 1, 2 | a completed or rejected outcome (`payload`) | once the key expired |
//! | 3 | an unknown outcome, held for an operator or a reconciliation | once the key expired |
//! | 4 | a lease-mode claim marked sent ([`LeaseStore::mark_sent`]): in flight while its lease lives, an unknown outcome once it has run out | once the key expired, never at its lease's end |
//!
//! `sent_at_ms` is the earliest time the claim was marked sent; recording
//! the outcome keeps it, a takeover clears it. Schema versions: 1, the keys
//! table; 2, the `sent_at_ms` column (added in place, rows kept).
//!
//! ## Statements and round trips of a transactional request
//!
//! | request | statements, one round trip each |
//! | --- | --- |
//! | fresh key | `BEGIN`; the placeholder `INSERT`; the caller's own; the record `UPDATE`; `COMMIT` |
//! | recorded key (replay, or 422) | `BEGIN`; the placeholder `INSERT` (duplicate key); the row read `LOCK IN SHARE MODE`; `ROLLBACK`, queued (below) |
//! | key held by a twin (busy) | `BEGIN`; the placeholder `INSERT` (waits, then 1205); `ROLLBACK`, queued |
//! | stale key (expired, or a lease run out) | as a recorded key, then the takeover `UPDATE`, the caller's own, the record `UPDATE`, `COMMIT` |
//!
//! Under [`ClaimStrategy::NamedLock`]:
//!
//! | request | statements, one round trip per line |
//! | --- | --- |
//! | fresh key | `SET @… = GET_LOCK(…); SELECT` the key's row (one text); `BEGIN`; the caller's own; the `INSERT` of the completed row; `COMMIT`; `DO RELEASE_LOCK(…)` |
//! | recorded key (replay, or 422) | the lock and the read, which releases the lock once it has read a live row (one text) |
//! | key held by a twin (busy) | the lock and the read (`GET_LOCK` waits, then answers 0) |
//! | stale key (expired, or a lease run out) | the lock and the read; `BEGIN`; the takeover `UPDATE`, the caller's own, the record `UPDATE`, `COMMIT`, `DO RELEASE_LOCK(…)` |
//!
//! The `ROLLBACK` after a claim that found the key held (a replay, a key in
//! progress) and holds no named lock is queued on the connection, as sqlx
//! queues the `ROLLBACK` of a dropped transaction: the caller has its answer
//! without waiting for it, and the ping with which the pool takes the
//! connection back sends it and reads its answer before anyone can acquire
//! the connection. It is still a round trip in the counts below. Every other
//! rollback waits for its answer.
//!
//! sqlx counts the claim's transaction as begun on its connection, so a
//! `begin()` in the caller's code on `&mut **tx` is a savepoint. One begun
//! and never ended (its `sqlx::Transaction` leaked), or one whose failed or
//! cancelled `begin` made sqlx roll the claim's transaction back, fails the
//! record and the commit, and nothing of the claim commits: the connection
//! is closed, which rolls the whole transaction back; a rollback or a drop
//! closes it too, so a connection never goes back to the pool inside a
//! transaction.
//!
//! So a fresh call writes one row of its own instead of two, and a replay
//! writes and locks nothing and is answered in one round trip. Counted by
//! the cost meter on MariaDB 10.11 (`claims --engine mysql`, 300 calls per
//! path, one business insert; the counts include the pool's ping on acquire
//! and on release; redo bytes are the server's, shared with whatever else
//! runs on it):
//!
//! | path | round trips | rows written | redo bytes |
//! | --- | --- | --- | --- |
//! | bare `BEGIN; INSERT; COMMIT` | 5 | 1 | 203–343 |
//! | fresh, placeholder | 7 | 3 | 875–903 |
//! | fresh, named lock | 8 | 2 | 487–489 |
//! | replay, placeholder | 6 | 1 (the refused insert) | 0 |
//! | replay, named lock | 3 | 0 | 0 |
//!
//! (`docs/benchmarks.md`, "MariaDB claim strategies" and "MariaDB's named
//! lock", has the transfer workload, the CPU figures and the timings.)
//!
//! The claim and record statements are prepared once per connection and
//! take their values as parameters. They are not batched with `BEGIN` and
//! `COMMIT` as multi-statement text: on
//! MariaDB such a batch needs its values spelled out and parsed on every
//! request, which costs the server more CPU than the round trips it saves
//! when the server is local and CPU-bound; the `TxBackend::begin_claim` and
//! `TxBackend::record_commit` defaults are kept.
//! A twin that waits on an uncommitted claim past its attempt's bound
//! (1205) is answered [`TxClaim::Busy`], so the engine polls until the
//! policy's deadline; a deadlock (1213) becomes [`StoreErrorKind::Deadlock`]
//! and the engine retries the whole claim. Every other driver error is mapped
//! to a portable kind by [`store_error`]. Placeholder claims use locking
//! reads, so they are correct under both REPEATABLE READ (the default) and
//! READ COMMITTED; named-lock claims read after the lock is granted, in a
//! snapshot of their own, and run the placeholder claim under SERIALIZABLE.
//!
//! Transactions are the store's own [`MySqlTx`]: sqlx's transaction
//! bookkeeping on a pooled connection (a nested `begin` on `&mut **tx` is a
//! savepoint, as on a `sqlx::Transaction`), which also releases the named
//! locks of its claims when it ends, and closes its connection if it is
//! dropped holding one.
//! The crate has no optional features.
//!
//! ```no_run
//! use idem_core::{Call, Fingerprint, IdempotencyKey, Scope, TxEngine};
//! use idem_mysql::{ClaimStrategy, MySqlStore};
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let pool = sqlx::mysql::MySqlPoolOptions::new()
//!     .max_connections(8)
//!     .connect("mysql://root@127.0.0.1:3306/test")
//!     .await?;
//! // The placeholder strategy is the default; the named lock writes one row
//! // per fresh call.
//! let store = MySqlStore::new(pool).with_claim_strategy(ClaimStrategy::NamedLock);
//! store.migrate().await?;
//! let engine = TxEngine::new(store);
//!
//! let scope = Scope::parse("tenant-42", "POST /v1/payouts")?;
//! let key = IdempotencyKey::new("5f0c3f8e-8d43-4b39-9b53-5b1e4f1c1d2a")?;
//! let fingerprint = Fingerprint::of_json(scope.operation(), br#"{"amount":100}"#)?;
//! let call = Call::new(scope, key, fingerprint);
//!
//! // The debit and the recorded outcome commit together; a retry with the
//! // same key replays "paid" without debiting again.
//! let outcome = engine
//!     .execute(&call, |tx| {
//!         Box::pin(async move {
//!             sqlx::query("UPDATE accounts SET balance = balance - 100 WHERE id = 1")
//!                 .execute(&mut **tx)
//!                 .await
//!                 .map_err(idem_mysql::store_error)?;
//!             Ok::<_, idem_core::Error>("paid".to_owned())
//!         })
//!     })
//!     .await?;
//! println!("{} (replayed: {})", outcome.value(), outcome.is_replayed());
//! # Ok(()) }
//! ```

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
mod statements;
mod tx;

use std::fmt;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use idem_core::{
    BoxFuture, ClaimRequest, Error, IdempotencyKey, LeaseClaim, LeaseStore, Record, Result, STATUS_IN_PROGRESS, Scope,
    StoreErrorKind, StoredRow, TableName, Token, TxBackend, TxClaim,
};
use sha2::{Digest, Sha256};
use sqlx::mysql::MySqlRow;
use sqlx::{AssertSqlSafe, MySqlConnection, MySqlPool, Row, SqlSafeStr, SqlStr};

use crate::claim::*;
pub use crate::deadletter::MySqlDeadLetters;
pub use crate::dialect::MySqlDialect;
use crate::error::{ER_DUP_ENTRY, ER_LOCK_WAIT_TIMEOUT, error_number};
pub use crate::error::{is_contention, store_error};
pub use crate::multistep::MySqlMultiSteps;
pub use crate::outbox::MySqlOutbox;
use crate::statements::*;
pub use crate::tx::MySqlTx;
use idem_sql::{Arg, SqlKeyRows};

/// How a transactional claim excludes a concurrent twin.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ClaimStrategy {
    /// The key's primary key is the lock: the claim inserts an uncommitted
    /// in-progress row, a twin's duplicate `INSERT` blocks on it and then
    /// collides, and the record updates the row. A fresh call writes the
    /// key's row twice.
    #[default]
    Placeholder,
    /// One row written per fresh call: the claim takes the server's named
    /// lock (`GET_LOCK`) on a hash of the table, tenant, operation and key
    /// before any read of the transaction, then reads the key's row with a
    /// plain consistent read (no shared lock, no gap lock) and writes
    /// nothing; the record inserts the completed row with one plain
    /// `INSERT`. A twin queues on the named lock (bounded by the policy's
    /// wait, then answered busy as under
    /// [`Placeholder`](Self::Placeholder)), and once it has the lock its
    /// read takes a snapshot that shows what the first committed.
    ///
    /// Named locks belong to the session, not to the transaction: the
    /// store's [`MySqlTx`] releases them after `COMMIT` or `ROLLBACK`, and
    /// closes its connection if it is dropped still holding one. The row is
    /// read by its full key, so two keys whose hashes collide only take
    /// turns. The primary key still refuses a second row: a record that
    /// meets one (a lease-mode claim of the key, or a claim under the
    /// other strategy, committed meanwhile) fails as a serialisation
    /// failure before anything commits, and the engine runs the call again
    /// and finds that row. Every process that claims keys of a table should
    /// use the same strategy: mixing them stays correct, but a twin of the
    /// other strategy may then wait for a whole lock wait.
    ///
    /// A stale row (expired, or a lease run out) is taken over in place as
    /// under [`Placeholder`](Self::Placeholder), and recorded with an
    /// update. Under SERIALIZABLE, where InnoDB turns every plain read of a
    /// transaction into a locking one (with gap locks on an absent key), the
    /// claim takes no named lock and runs the placeholder claim. Lease-mode
    /// claims never take the lock. On a Galera cluster a named lock holds on
    /// its node only: twins on different nodes both run their work and
    /// certification refuses the second commit (safe, but the lock then
    /// saves nothing); use [`Placeholder`](Self::Placeholder) there.
    ///
    /// It trades a row write for statements: a fresh call sends two the
    /// placeholder's does not, the lock and its release after `COMMIT`; a
    /// replay is one round trip instead of four. On a local, CPU-bound
    /// MariaDB, whose cost goes by statements, its fresh calls ran at 0.7×
    /// the placeholder's (`docs/benchmarks.md`); it pays where the redo
    /// volume is what runs out, or where replays dominate.
    NamedLock,
}

/// The idem store on MySQL 8 or MariaDB 10.3+ (InnoDB).
///
/// Cheap to clone: clones share the pool. Call [`migrate`](Self::migrate)
/// once (at start-up, or from the `idem` CLI) before using it.
#[derive(Clone)]
pub struct MySqlStore {
    pool: MySqlPool,
    table: TableName,
    strategy: ClaimStrategy,
    sql: Arc<Statements>,
    rows: SqlKeyRows<MySqlDialect>,
    flavor: Arc<OnceLock<Flavor>>,
}

impl fmt::Debug for MySqlStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MySqlStore")
            .field("table", &self.table)
            .field("strategy", &self.strategy)
            .field("flavor", &self.flavor.get())
            .finish_non_exhaustive()
    }
}

impl MySqlStore {
    /// A store on `pool` using the default table, `idem_keys`.
    pub fn new(pool: MySqlPool) -> Self {
        let table = TableName::default();
        Self {
            sql: Arc::new(Statements::new(&table)),
            rows: SqlKeyRows::new(pool.clone(), table.clone(), sweep(&table)),
            pool,
            table,
            strategy: ClaimStrategy::default(),
            flavor: Arc::new(OnceLock::new()),
        }
    }

    /// Chooses how transactional claims exclude concurrent twins (see
    /// [`ClaimStrategy`]).
    pub fn with_claim_strategy(mut self, strategy: ClaimStrategy) -> Self {
        self.strategy = strategy;
        self
    }

    /// The claim strategy.
    pub fn claim_strategy(&self) -> ClaimStrategy {
        self.strategy
    }

    /// Uses `table` for the keys (and `{table}_schema` for its schema
    /// version), so several key spaces can share one database.
    pub fn with_table(mut self, table: TableName) -> Self {
        self.sql = Arc::new(Statements::new(&table));
        self.rows = SqlKeyRows::new(self.pool.clone(), table.clone(), sweep(&table));
        self.table = table;
        self
    }

    /// The keys table.
    pub fn table(&self) -> &TableName {
        &self.table
    }

    /// The connection pool.
    pub fn pool(&self) -> &MySqlPool {
        &self.pool
    }

    /// The schema versions the table has not had yet, with their SQL,
    /// without applying anything.
    pub async fn pending_migrations(&self) -> Result<Vec<idem_core::PendingMigration>> {
        migrate::pending(&self.pool, &self.table).await
    }

    /// Creates or upgrades the keys table and its `{table}_schema` version
    /// table, applying every embedded migration not applied yet.
    ///
    /// Safe to call from many processes at once: the migration holds the
    /// server's named lock `idem-migrate:{database}.{table}` (`GET_LOCK`), so
    /// one process migrates while the others wait and then find nothing to do.
    pub async fn migrate(&self) -> Result<()> {
        migrate::run(&self.pool, &self.table).await
    }

    /// The stored row of a key, if any (expired rows not swept yet included),
    /// with the time it was marked sent, read without locking.
    pub async fn get(&self, scope: &Scope, key: &IdempotencyKey) -> Result<Option<StoredRow>> {
        self.rows.get(scope, key).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use idem_core::{Call, Fingerprint, RowState};

    /// Named-lock names fit MariaDB's 64 characters and differ by table, tenant, operation and key, however long those are.
    #[tokio::test]
    async fn lock_names_are_short_and_distinct() {
        let pool = sqlx::mysql::MySqlPoolOptions::new()
            .connect_lazy("mysql://root@127.0.0.1:3306/test")
            .unwrap();
        let store = MySqlStore::new(pool);
        let other_table = store.clone().with_table(TableName::new("other_keys").unwrap());
        let long = "k".repeat(255);
        let scope = Scope::parse("tenant", "POST /op").unwrap();
        let key = IdempotencyKey::new(&long).unwrap();
        let name = store.lock_name(&scope, &key);
        assert!(name.len() <= 64, "{name}");
        assert!(name.starts_with("idem:") && name[5..].bytes().all(|b| b.is_ascii_hexdigit()));
        assert_eq!(name, store.lock_name(&scope, &key), "the same key, the same lock");
        let others = [
            other_table.lock_name(&scope, &key),
            store.lock_name(&Scope::parse("tenant2", "POST /op").unwrap(), &key),
            store.lock_name(&Scope::parse("tenant", "POST /op2").unwrap(), &key),
            store.lock_name(&scope, &IdempotencyKey::new("k").unwrap()),
            // The parts are length-prefixed: moving a character between
            // them names another lock.
            store.lock_name(&Scope::parse("tenan", "tPOST /op").unwrap(), &key),
        ];
        for other in others {
            assert_ne!(name, other);
        }
    }

    /// Whole seconds of the wait, never more than the cap; under a second is no wait.
    #[test]
    fn lock_wait_is_whole_seconds_within_the_wait() {
        assert_eq!(lock_wait_secs(Duration::ZERO), 0);
        assert_eq!(lock_wait_secs(Duration::from_millis(999)), 0);
        assert_eq!(lock_wait_secs(Duration::from_millis(2_500)), 2);
        assert_eq!(lock_wait_secs(Duration::from_secs(120)), MAX_LOCK_WAIT_SECS);
    }

    async fn session_lock_wait(tx: &mut MySqlTx) -> i64 {
        sqlx::query_scalar("SELECT CAST(@@SESSION.innodb_lock_wait_timeout AS SIGNED)")
            .fetch_one(&mut **tx)
            .await
            .unwrap()
    }

    async fn set_session_lock_wait(tx: &mut MySqlTx, secs: i64) {
        sqlx::raw_sql(AssertSqlSafe(format!("SET SESSION innodb_lock_wait_timeout = {secs}")))
            .execute(&mut **tx)
            .await
            .unwrap();
    }

    /// The MySQL path (session lock wait set and restored) claims, answers busy and finds rows, always restoring the session's own lock wait. It runs against whatever server the tests use, with the flavour forced.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn mysql_session_lock_wait_is_restored() {
        let url = idem_conformance::env::mysql_url();
        let pool = sqlx::mysql::MySqlPoolOptions::new().max_connections(4).connect(&url).await.unwrap_or_else(|e| {
            panic!("cannot reach the MySQL/MariaDB test server at {url} ({e}); start it, or point IDEM_TEST_MYSQL_URL at one")
        });
        let table = TableName::new(format!("idem_iso_{}", uuid::Uuid::new_v4().simple())).unwrap();
        let store = MySqlStore::new(pool).with_table(table);
        store.migrate().await.unwrap();
        store.flavor.set(Flavor::MySql).unwrap();

        let scope = Scope::parse("tenant", "op").unwrap();
        let call = Call::new(
            scope.clone(),
            IdempotencyKey::generate(),
            Fingerprint::of_bytes(scope.operation(), b"x"),
        );
        let now = 1_000_000;
        let req = ClaimRequest {
            scope: call.scope(),
            key: call.key(),
            fingerprint: call.fingerprint(),
            now_ms: now,
            expires_at_ms: now + 60_000,
            fresh_token: Token::fresh(now),
            lease_expires_at_ms: None,
        };

        let mut first = store.begin().await.unwrap();
        set_session_lock_wait(&mut first, 37).await;
        assert_eq!(
            store.claim(&mut first, &req, Duration::ZERO).await.unwrap(),
            TxClaim::Claimed
        );
        assert_eq!(session_lock_wait(&mut first).await, 37, "restored after a claim");

        let mut twin = store.begin().await.unwrap();
        set_session_lock_wait(&mut twin, 41).await;
        let started = std::time::Instant::now();
        assert_eq!(
            store.claim(&mut twin, &req, Duration::ZERO).await.unwrap(),
            TxClaim::Busy
        );
        assert!(
            started.elapsed() < Duration::from_secs(3),
            "MySQL's one-second minimum wait, not the session's 41 s"
        );
        assert_eq!(
            session_lock_wait(&mut twin).await,
            41,
            "restored after a lock-wait timeout"
        );
        store.rollback(twin).await.unwrap();

        let record = Record::completed(b"r".to_vec());
        store.record(&mut first, &req, &record).await.unwrap();
        store.commit(first).await.unwrap();

        let mut again = store.begin().await.unwrap();
        set_session_lock_wait(&mut again, 43).await;
        match store.claim(&mut again, &req, Duration::ZERO).await.unwrap() {
            TxClaim::Found(row) => assert_eq!(row.state, RowState::Done(record)),
            other => panic!("expected the recorded row, got {other:?}"),
        }
        assert_eq!(
            session_lock_wait(&mut again).await,
            43,
            "restored after finding the row"
        );
        store.rollback(again).await.unwrap();
    }
}
