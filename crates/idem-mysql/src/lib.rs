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
//! | retention | [`Sweep`] | `DELETE … ORDER BY expires_at_ms LIMIT n` in short batches |
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
//! | recorded key (replay, or 422) | `BEGIN`; the placeholder `INSERT` (duplicate key); the row read `LOCK IN SHARE MODE`; `ROLLBACK` |
//! | key held by a twin (busy) | `BEGIN`; the placeholder `INSERT` (waits, then 1205); `ROLLBACK` |
//! | stale key (expired, or a lease run out) | as a recorded key, then the takeover `UPDATE`, the caller's own, the record `UPDATE`, `COMMIT` |
//!
//! Under [`ClaimStrategy::NamedLock`]:
//!
//! | request | statements, one round trip per line |
//! | --- | --- |
//! | fresh key | `SET @… = GET_LOCK(…); SELECT` the key's row (one text); `BEGIN`; the caller's own; the `INSERT` of the completed row; `COMMIT`; `DO RELEASE_LOCK(…)` |
//! | recorded key (replay, or 422) | the lock and the read (one text); `DO RELEASE_LOCK(…)` |
//! | key held by a twin (busy) | the lock and the read (`GET_LOCK` waits, then answers 0) |
//! | stale key (expired, or a lease run out) | the lock and the read; `BEGIN`; the takeover `UPDATE`, the caller's own, the record `UPDATE`, `COMMIT`, `DO RELEASE_LOCK(…)` |
//!
//! So a fresh call writes one row of its own instead of two, and a replay
//! writes and locks nothing. Counted by the cost meter on MariaDB 10.11
//! (`claims --engine mysql`, 300 calls per path, one business insert; redo
//! bytes are the server's, shared with whatever else runs on it):
//!
//! | path | round trips | rows written | redo bytes |
//! | --- | --- | --- | --- |
//! | bare `BEGIN; INSERT; COMMIT` | 5 | 1 | 318–360 |
//! | fresh, placeholder | 7 | 3 | 971–1 030 |
//! | fresh, named lock | 8 | 2 | 583–706 |
//! | replay, placeholder | 6 | 1 (the refused insert) | 0 |
//! | replay, named lock | 4 | 0 | 0–53 |
//!
//! (`docs/benchmarks.md`, "MariaDB claim strategies", has the transfer
//! workload and the CPU figures.)
//!
//! The pool's own connection check on acquire (sqlx pings by default) comes
//! on top, as for any transaction. The claim and record statements are
//! prepared once per connection and take their values as parameters. They
//! are not batched with `BEGIN` and `COMMIT` as multi-statement text: on
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

mod clock;
pub mod deadletter;
mod error;
mod migrate;
pub mod outbox;
mod tx;

use std::fmt;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use idem_core::{
    BoxFuture, ClaimRequest, Error, IdempotencyKey, Lease, LeaseClaim, LeaseStore, Record, Result, STATUS_IN_PROGRESS,
    STATUS_SENT, STATUS_UNKNOWN, Scope, StoreErrorKind, StoredRow, Sweep, TableName, Token, TxBackend, TxClaim,
};
use sha2::{Digest, Sha256};
use sqlx::mysql::MySqlRow;
use sqlx::{AssertSqlSafe, MySqlConnection, MySqlPool, Row, SqlSafeStr, SqlStr};

pub use crate::deadletter::MySqlDeadLetters;
use crate::error::{ER_DUP_ENTRY, ER_LOCK_WAIT_TIMEOUT, error_number};
pub use crate::error::{is_contention, store_error};
pub use crate::outbox::MySqlOutbox;
pub use crate::tx::MySqlTx;

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
    /// claims never take the lock, and Galera clusters do not support it.
    ///
    /// It trades a row write for a round trip: a fresh call sends
    /// `RELEASE_LOCK` after `COMMIT` (a replay costs two round trips instead
    /// of four). On a local, CPU-bound MariaDB its fresh calls ran slower
    /// than the placeholder's (`docs/benchmarks.md`); it pays where the redo
    /// volume is what runs out.
    NamedLock,
}

/// What the named-lock statement answers when the transaction is
/// SERIALIZABLE (and it took no lock).
const NAMED_LOCK_SERIALIZABLE: i64 = -1;

/// The longest a single claim attempt blocks on a twin's uncommitted row, in
/// seconds.
///
/// A twin's duplicate `INSERT` blocks on the first claimer's row lock and
/// wakes the moment it commits or rolls back, so blocking (rather than
/// polling) replays a twin's outcome with no added latency. InnoDB only
/// counts lock waits in whole seconds, so an attempt blocks for the whole
/// seconds left of the engine's wait (never more, so the engine's deadline is
/// kept) and answers [`TxClaim::Busy`] on 1205; the engine then polls with
/// its backoff for the fraction that is left. A wait under one second is
/// `0`, which MariaDB (10.3 and later) treats as "do not wait": measured on
/// MariaDB 10.11, a conflicting insert then fails with 1205 in under 10 ms
/// instead of blocking. The cap keeps the number of distinct statement texts
/// small (the wait is spliced into the SQL, and each text is a prepared
/// statement cached per connection) and makes a long-waiting twin start a
/// fresh transaction every few seconds rather than hold one for minutes.
const MAX_LOCK_WAIT_SECS: u64 = 5;

/// The longest a lease-mode claim blocks on another claimer's uncommitted
/// row, in seconds. Lease claims commit at once, so such a wait is normally
/// a few milliseconds; only a transactional claim of the same key (mixing
/// modes on one table) could hold it longer, and that is reported as
/// [`StoreErrorKind::LockTimeout`] rather than waited out.
const LEASE_CLAIM_LOCK_WAIT_SECS: u64 = 1;

/// Which server the pool talks to: they bound a statement's lock wait
/// differently.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Flavor {
    /// MariaDB: `SET STATEMENT innodb_lock_wait_timeout = n FOR …` bounds
    /// one statement and leaves the session untouched, so a claim whose
    /// future is dropped mid-wait cannot leave a short lock wait behind on a
    /// pooled connection for the next user's own writes.
    MariaDb,
    /// MySQL has no per-statement form: the session variable is set for the
    /// claim and restored after it. A claim future dropped between the two
    /// leaves the claim's lock wait on that pooled connection, and MySQL's
    /// shortest lock wait is one second, so sub-second waits overshoot.
    MySql,
}

/// The SQL texts of one keys table, built once.
struct Statements {
    insert: String,
    named_lock_mariadb: SqlStr,
    named_lock_mysql: SqlStr,
    insert_completed: SqlStr,
    select_locked: String,
    takeover: String,
    select: SqlStr,
    lookup: SqlStr,
    record: SqlStr,
    mark_sent: SqlStr,
    complete: SqlStr,
    release: SqlStr,
    extend: SqlStr,
    resolve_record: SqlStr,
    resolve_release: SqlStr,
    sweep: SqlStr,
}

const COLUMNS: &str = "fingerprint, status, token, payload, lease_expires_at_ms, expires_at_ms";
const WHERE_KEY: &str = "tenant = ? AND operation = ? AND idem_key = ?";

impl Statements {
    fn new(table: &TableName) -> Self {
        let fixed = |sql: String| AssertSqlSafe(sql).into_sql_str();
        // A lease-mode row its holder still holds: in progress, or sent
        // (lease run out or not: only the token says who holds it).
        let held = format!("status IN ({STATUS_IN_PROGRESS}, {STATUS_SENT})");
        // A row holding an unknown outcome at the time bound to its `?`:
        // recorded as unknown, or sent with its lease run out.
        let unknown_at =
            format!("(status = {STATUS_UNKNOWN} OR (status = {STATUS_SENT} AND lease_expires_at_ms <= ?))");
        Self {
            insert: format!(
                "INSERT INTO `{table}` (tenant, operation, idem_key, fingerprint, status, token, payload, \
                 created_at_ms, expires_at_ms, lease_expires_at_ms) \
                 VALUES (?, ?, ?, ?, {STATUS_IN_PROGRESS}, ?, NULL, ?, ?, ?)"
            ),
            named_lock_mariadb: fixed(named_lock("@@tx_isolation")),
            named_lock_mysql: fixed(named_lock("@@transaction_isolation")),
            insert_completed: fixed(format!(
                "INSERT INTO `{table}` (tenant, operation, idem_key, fingerprint, status, token, payload, \
                 created_at_ms, expires_at_ms, lease_expires_at_ms) \
                 VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, NULL)"
            )),
            select_locked: format!("SELECT {COLUMNS} FROM `{table}` WHERE {WHERE_KEY} LOCK IN SHARE MODE"),
            takeover: format!(
                "UPDATE `{table}` SET fingerprint = ?, status = {STATUS_IN_PROGRESS}, token = ?, payload = NULL, \
                 created_at_ms = ?, expires_at_ms = ?, lease_expires_at_ms = ?, sent_at_ms = NULL \
                 WHERE {WHERE_KEY} AND token = ? \
                 AND (expires_at_ms <= ? OR (status = {STATUS_IN_PROGRESS} AND lease_expires_at_ms <= ?))"
            ),
            select: fixed(format!("SELECT {COLUMNS} FROM `{table}` WHERE {WHERE_KEY}")),
            lookup: fixed(format!("SELECT {COLUMNS}, sent_at_ms FROM `{table}` WHERE {WHERE_KEY}")),
            record: fixed(format!(
                "UPDATE `{table}` SET status = ?, payload = ?, lease_expires_at_ms = NULL \
                 WHERE {WHERE_KEY} AND status = {STATUS_IN_PROGRESS}"
            )),
            // The earliest mark is kept: `LEAST` of the stored time and
            // this one, the stored one being absent the first time.
            mark_sent: fixed(format!(
                "UPDATE `{table}` SET status = {STATUS_SENT}, sent_at_ms = LEAST(COALESCE(sent_at_ms, ?), ?) \
                 WHERE {WHERE_KEY} AND token = ? AND {held}"
            )),
            // `sent_at_ms` is left as it is: the outcome keeps the mark's time.
            complete: fixed(format!(
                "UPDATE `{table}` SET status = ?, payload = ?, lease_expires_at_ms = NULL \
                 WHERE {WHERE_KEY} AND token = ? AND {held}"
            )),
            release: fixed(format!(
                "DELETE FROM `{table}` WHERE {WHERE_KEY} AND token = ? AND {held}"
            )),
            extend: fixed(format!(
                "UPDATE `{table}` SET lease_expires_at_ms = ?, expires_at_ms = GREATEST(expires_at_ms, ?) \
                 WHERE {WHERE_KEY} AND token = ? AND {held}"
            )),
            resolve_record: fixed(format!(
                "UPDATE `{table}` SET status = ?, payload = ?, lease_expires_at_ms = NULL \
                 WHERE {WHERE_KEY} AND expires_at_ms > ? AND {unknown_at}"
            )),
            resolve_release: fixed(format!(
                "DELETE FROM `{table}` WHERE {WHERE_KEY} AND expires_at_ms > ? AND {unknown_at}"
            )),
            sweep: fixed(format!(
                "DELETE FROM `{table}` WHERE expires_at_ms <= ? ORDER BY expires_at_ms LIMIT ?"
            )),
        }
    }
}

/// The session variable the named lock's answer is kept in between the two
/// statements of [`MySqlStore::begin_named`].
const LOCK_VARIABLE: &str = "idem_named_lock";

/// The named-lock statement: `-1` under SERIALIZABLE (the isolation level
/// is the server variable `isolation`, whose name differs between MariaDB
/// and MySQL), otherwise `GET_LOCK(name, seconds)`: `1` taken, `0` timed out.
fn named_lock(isolation: &str) -> String {
    format!("SELECT IF({isolation} = 'SERIALIZABLE', {NAMED_LOCK_SERIALIZABLE}, GET_LOCK(?, ?))")
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

/// What one claim attempt found.
enum Claim {
    Claimed(Token),
    Found(StoredRow),
    Busy,
}

/// A stored row with the raw columns a takeover needs.
struct RawRow {
    fingerprint: Vec<u8>,
    status: i16,
    token: i64,
    payload: Option<Vec<u8>>,
    lease_expires_at_ms: Option<i64>,
    expires_at_ms: i64,
}

impl RawRow {
    fn decode(row: &MySqlRow) -> Result<Self> {
        Ok(Self {
            fingerprint: row.try_get(0).map_err(store_error)?,
            status: row.try_get(1).map_err(store_error)?,
            token: row.try_get(2).map_err(store_error)?,
            payload: row.try_get(3).map_err(store_error)?,
            lease_expires_at_ms: row.try_get(4).map_err(store_error)?,
            expires_at_ms: row.try_get(5).map_err(store_error)?,
        })
    }

    /// The staleness rule of the store traits: an expired key, or an
    /// in-progress lease whose holder's lease ran out. A sent claim
    /// (status 4) is not stale until the key expires, however long ago its
    /// lease ran out: it is found, and the engine answers it as an unknown
    /// outcome. The takeover statement repeats this rule in SQL.
    fn is_stale(&self, now_ms: i64) -> bool {
        self.expires_at_ms <= now_ms
            || (self.status == STATUS_IN_PROGRESS && self.lease_expires_at_ms.is_some_and(|l| l <= now_ms))
    }

    /// Decodes the key's row from the columns after the first of the
    /// named-lock read (`None`: no row, the join found nothing).
    fn decode_joined(row: &MySqlRow) -> Result<Option<Self>> {
        let fingerprint: Option<Vec<u8>> = row.try_get(1).map_err(store_error)?;
        let Some(fingerprint) = fingerprint else {
            return Ok(None);
        };
        Ok(Some(Self {
            fingerprint,
            status: row.try_get(2).map_err(store_error)?,
            token: row.try_get(3).map_err(store_error)?,
            payload: row.try_get(4).map_err(store_error)?,
            lease_expires_at_ms: row.try_get(5).map_err(store_error)?,
            expires_at_ms: row.try_get(6).map_err(store_error)?,
        }))
    }

    fn into_stored(self) -> Result<StoredRow> {
        StoredRow::from_columns(
            &self.fingerprint,
            self.status,
            self.token,
            self.payload,
            self.lease_expires_at_ms,
            self.expires_at_ms,
        )
    }
}

impl MySqlStore {
    /// A store on `pool` using the default table, `idem_keys`.
    pub fn new(pool: MySqlPool) -> Self {
        let table = TableName::default();
        Self {
            sql: Arc::new(Statements::new(&table)),
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
        let row = sqlx::query(self.sql.lookup.clone())
            .bind(scope.tenant().as_str().as_bytes())
            .bind(scope.operation().as_str().as_bytes())
            .bind(key.as_str().as_bytes())
            .fetch_optional(&self.pool)
            .await
            .map_err(store_error)?;
        row.map(|r| {
            let sent_at_ms: Option<i64> = r.try_get(6).map_err(store_error)?;
            Ok(RawRow::decode(&r)?.into_stored()?.with_sent_at_ms(sent_at_ms))
        })
        .transpose()
    }

    async fn flavor(&self, conn: &mut MySqlConnection) -> Result<Flavor> {
        if let Some(flavor) = self.flavor.get() {
            return Ok(*flavor);
        }
        let version: String = sqlx::query_scalar("SELECT VERSION()")
            .fetch_one(&mut *conn)
            .await
            .map_err(store_error)?;
        let flavor = if version.to_ascii_lowercase().contains("mariadb") {
            Flavor::MariaDb
        } else {
            Flavor::MySql
        };
        tracing::debug!(%version, ?flavor, "detected the server flavour");
        Ok(*self.flavor.get_or_init(|| flavor))
    }

    /// Claims the key on `conn`, inside the caller's open transaction,
    /// waiting at most `lock_wait_secs` on a concurrent uncommitted claim.
    async fn claim_on(&self, conn: &mut MySqlConnection, req: &ClaimRequest<'_>, lock_wait_secs: u64) -> Result<Claim> {
        match self.flavor(conn).await? {
            Flavor::MariaDb => {
                let prefix = format!("SET STATEMENT innodb_lock_wait_timeout = {lock_wait_secs} FOR ");
                self.claim_steps(conn, req, &prefix).await
            }
            Flavor::MySql => self.claim_with_session_wait(conn, req, lock_wait_secs).await,
        }
    }

    /// MySQL has no per-statement form of the lock wait, so the session's
    /// value is saved, set for the claim's statements and restored, whether
    /// the claim succeeded or not. MySQL's smallest lock wait is one second.
    async fn claim_with_session_wait(
        &self,
        conn: &mut MySqlConnection,
        req: &ClaimRequest<'_>,
        lock_wait_secs: u64,
    ) -> Result<Claim> {
        let secs = lock_wait_secs.max(1);
        sqlx::raw_sql(AssertSqlSafe(format!(
            "SET @idem_saved_lock_wait = @@SESSION.innodb_lock_wait_timeout, SESSION innodb_lock_wait_timeout = {secs}"
        )))
        .execute(&mut *conn)
        .await
        .map_err(store_error)?;
        let claim = self.claim_steps(conn, req, "").await;
        let restored = sqlx::raw_sql("SET SESSION innodb_lock_wait_timeout = @idem_saved_lock_wait")
            .execute(&mut *conn)
            .await
            .map_err(store_error);
        let claim = claim?;
        restored?;
        Ok(claim)
    }

    /// The claim itself: insert the placeholder; on a duplicate, read the
    /// committed row under a shared lock and either answer it or take it
    /// over if it is stale. `prefix` bounds each statement's lock wait.
    async fn claim_steps(&self, conn: &mut MySqlConnection, req: &ClaimRequest<'_>, prefix: &str) -> Result<Claim> {
        let tenant = req.scope.tenant().as_str().as_bytes();
        let operation = req.scope.operation().as_str().as_bytes();
        let key = req.key.as_str().as_bytes();
        let inserted = sqlx::query(AssertSqlSafe(format!("{prefix}{}", self.sql.insert)))
            .bind(tenant)
            .bind(operation)
            .bind(key)
            .bind(&req.fingerprint.as_bytes()[..])
            .bind(req.fresh_token.0)
            .bind(req.now_ms)
            .bind(req.expires_at_ms)
            .bind(req.lease_expires_at_ms)
            .execute(&mut *conn)
            .await;
        match inserted {
            Ok(_) => return Ok(Claim::Claimed(req.fresh_token)),
            Err(e) if error_number(&e) == Some(ER_DUP_ENTRY) => {}
            Err(e) => return busy_or_error(e),
        }
        // The duplicate-key check left this transaction holding a shared lock
        // on the committed row. Under REPEATABLE READ a plain SELECT could
        // still answer from an older snapshot (taken before the twin
        // committed), so the row is read with a locking read, which always
        // sees the latest committed version.
        let row = match sqlx::query(AssertSqlSafe(format!("{prefix}{}", self.sql.select_locked)))
            .bind(tenant)
            .bind(operation)
            .bind(key)
            .fetch_optional(&mut *conn)
            .await
        {
            Ok(row) => row,
            Err(e) => return busy_or_error(e),
        };
        let Some(row) = row else {
            // The shared lock from the duplicate-key check keeps the row from
            // being deleted, so this is a concurrency anomaly (for example a
            // non-default isolation level); the engine retries the claim.
            return Err(Error::store(
                StoreErrorKind::Serialization,
                "the key's row vanished between the duplicate-key error and its locking read",
            ));
        };
        let row = RawRow::decode(&row)?;
        if !row.is_stale(req.now_ms) {
            return Ok(Claim::Found(row.into_stored()?));
        }
        self.take_over(conn, req, &row, prefix).await
    }

    /// Takes over a stale row (expired, or a lease whose holder's lease ran
    /// out) in place, as an in-progress row the record updates, never
    /// marked sent (an expired key's old mark goes with it). The token
    /// only grows, so a fenced holder's old token can never match again; the
    /// `token = ?` guard and the repeated staleness test (on the row's
    /// newest version) make the update a no-op if the row changed since it
    /// was read.
    async fn take_over(
        &self,
        conn: &mut MySqlConnection,
        req: &ClaimRequest<'_>,
        row: &RawRow,
        prefix: &str,
    ) -> Result<Claim> {
        let tenant = req.scope.tenant().as_str().as_bytes();
        let operation = req.scope.operation().as_str().as_bytes();
        let key = req.key.as_str().as_bytes();
        let token = req.fresh_token.0.max(row.token.saturating_add(1));
        let updated = sqlx::query(AssertSqlSafe(format!("{prefix}{}", self.sql.takeover)))
            .bind(&req.fingerprint.as_bytes()[..])
            .bind(token)
            .bind(req.now_ms)
            .bind(req.expires_at_ms)
            .bind(req.lease_expires_at_ms)
            .bind(tenant)
            .bind(operation)
            .bind(key)
            .bind(row.token)
            .bind(req.now_ms)
            .bind(req.now_ms)
            .execute(&mut *conn)
            .await;
        match updated {
            Ok(done) if done.rows_affected() == 1 => {
                tracing::debug!(old_token = row.token, token, "took over a stale idempotency key");
                Ok(Claim::Claimed(Token(token)))
            }
            Ok(_) => Err(Error::store(
                StoreErrorKind::Serialization,
                "the stale row changed while it was being taken over",
            )),
            Err(e) => busy_or_error(e),
        }
    }

    /// The server-wide name of the key's named lock: a hash of the table,
    /// tenant, operation and key (names are limited to 64 characters).
    fn lock_name(&self, scope: &Scope, key: &IdempotencyKey) -> String {
        let mut hash = Sha256::new();
        for part in [
            self.table.as_str(),
            scope.tenant().as_str(),
            scope.operation().as_str(),
            key.as_str(),
        ] {
            hash.update((part.len() as u64).to_be_bytes());
            hash.update(part.as_bytes());
        }
        let digest = hash.finalize();
        let mut name = String::with_capacity(5 + 48);
        name.push_str("idem:");
        for b in &digest[..24] {
            name.push_str(&format!("{b:02x}"));
        }
        name
    }

    /// The claim of [`ClaimStrategy::NamedLock`] on `tx`: the key's named
    /// lock first (unless this transaction holds it), then a plain read of
    /// the row. An absent key is noted on `tx` as claimed with no row; the
    /// record inserts it.
    async fn claim_named(&self, tx: &mut MySqlTx, req: &ClaimRequest<'_>, wait: Duration) -> Result<Claim> {
        let flavor = self.flavor(tx).await?;
        let name = self.lock_name(req.scope, req.key);
        if !tx.holds_lock(&name) {
            let statement = match flavor {
                Flavor::MariaDb => &self.sql.named_lock_mariadb,
                Flavor::MySql => &self.sql.named_lock_mysql,
            };
            // GET_LOCK takes fractions of a second; the cap keeps a long
            // wait in steps, as the placeholder claim's row-lock wait is.
            let secs = wait.min(Duration::from_secs(MAX_LOCK_WAIT_SECS)).as_secs_f64();
            // Noted before it is asked for: a caller that goes away while
            // the server waits drops the transaction, whose session may be
            // granted the lock later, so it must be closed, not pooled.
            tx.note_lock(name.clone());
            let answer: Option<i64> = sqlx::query_scalar(statement.clone())
                .bind(name.as_str())
                .bind(secs)
                .fetch_one(&mut **tx)
                .await
                .map_err(store_error)?;
            if answer != Some(1) {
                tx.forget_lock(&name);
                return self.not_locked(tx, req, wait, answer).await;
            }
        }
        // The lock was taken before this transaction read anything, so at
        // REPEATABLE READ the snapshot begins here, after the twin that held
        // the lock committed and released it.
        let row = sqlx::query(self.sql.select.clone())
            .bind(req.scope.tenant().as_str().as_bytes())
            .bind(req.scope.operation().as_str().as_bytes())
            .bind(req.key.as_str().as_bytes())
            .fetch_optional(&mut **tx)
            .await
            .map_err(store_error)?;
        let row = row.map(|row| RawRow::decode(&row)).transpose()?;
        self.decide_named(tx, req, wait, flavor, row).await
    }

    /// The answer of a named-lock statement that did not take the lock:
    /// busy when its wait ran out, the placeholder claim under
    /// SERIALIZABLE.
    async fn not_locked(
        &self,
        tx: &mut MySqlTx,
        req: &ClaimRequest<'_>,
        wait: Duration,
        answer: Option<i64>,
    ) -> Result<Claim> {
        match answer {
            Some(0) => {
                tracing::debug!("a concurrent claim still holds the key's named lock; answering busy");
                Ok(Claim::Busy)
            }
            Some(NAMED_LOCK_SERIALIZABLE) => self.claim_on(tx, req, lock_wait_secs(wait)).await,
            other => Err(Error::store(
                StoreErrorKind::Other,
                format!("GET_LOCK of the key's named lock answered {other:?}"),
            )),
        }
    }

    /// Decides a named-lock claim from the key's row read under the lock:
    /// an absent key is claimed with no row written (noted on `tx`), a live
    /// row is found, a stale one taken over.
    async fn decide_named(
        &self,
        tx: &mut MySqlTx,
        req: &ClaimRequest<'_>,
        wait: Duration,
        flavor: Flavor,
        row: Option<RawRow>,
    ) -> Result<Claim> {
        let Some(row) = row else {
            tx.note_unwritten(req, req.fresh_token.0);
            return Ok(Claim::Claimed(req.fresh_token));
        };
        if !row.is_stale(req.now_ms) {
            return Ok(Claim::Found(row.into_stored()?));
        }
        // A lease-mode claim commits at once, so the takeover's row lock is
        // normally free; on MariaDB its wait is bounded as the placeholder
        // claim's, on MySQL it is the session's own.
        let prefix = match flavor {
            Flavor::MariaDb => format!("SET STATEMENT innodb_lock_wait_timeout = {} FOR ", lock_wait_secs(wait)),
            Flavor::MySql => String::new(),
        };
        self.take_over(tx, req, &row, &prefix).await
    }

    /// The named-lock claim as the engine opens it, in one round trip
    /// before `BEGIN`: a text of two statements takes the lock
    /// (`SET @idem_named_lock = GET_LOCK(…)`) and then reads the key's row
    /// with the lock's answer. Outside a transaction the read is a
    /// consistent read in a snapshot of its own, taken after the lock was
    /// granted, and it locks nothing at any isolation level. Values are
    /// written as literals whose meaning no setting changes: the lock name in
    /// hexadecimal digits, the wait in decimal, the key's columns (binary)
    /// as `X'…'`.
    ///
    /// `BEGIN` follows only when the claim writes (a fresh key, a takeover,
    /// the placeholder claim under SERIALIZABLE). A found row or a busy key
    /// answers a transaction that never began: rolling it back only releases
    /// the lock, so a replay costs two round trips.
    async fn begin_named(&self, req: &ClaimRequest<'_>, wait: Duration) -> Result<(MySqlTx, Claim)> {
        let mut conn = self.pool.acquire().await.map_err(store_error)?;
        let flavor = self.flavor(&mut conn).await?;
        let isolation = match flavor {
            Flavor::MariaDb => "@@tx_isolation",
            Flavor::MySql => "@@transaction_isolation",
        };
        let name = self.lock_name(req.scope, req.key);
        let secs = wait.min(Duration::from_secs(MAX_LOCK_WAIT_SECS)).as_secs_f64();
        let mut text = format!(
            "SET @{LOCK_VARIABLE} = IF({isolation} = 'SERIALIZABLE', {NAMED_LOCK_SERIALIZABLE}, \
             GET_LOCK('{name}', {secs:.3})); \
             SELECT CAST(@{LOCK_VARIABLE} AS SIGNED), k.fingerprint, k.status, k.token, k.payload, \
             k.lease_expires_at_ms, k.expires_at_ms FROM (SELECT 1) AS one LEFT JOIN `{}` AS k ON ",
            self.table.as_str()
        );
        for (column, value) in [
            ("tenant", req.scope.tenant().as_str()),
            ("operation", req.scope.operation().as_str()),
            ("idem_key", req.key.as_str()),
        ] {
            if column != "tenant" {
                text.push_str(" AND ");
            }
            text.push_str(&format!("k.{column} = X'"));
            for b in value.as_bytes() {
                text.push_str(&format!("{b:02X}"));
            }
            text.push('\'');
        }
        // Until its answer is read, the lock counts as held: ending the
        // transaction releases it, or closes the connection if the text
        // failed or the caller went away while the server waits (releasing
        // a lock not held does nothing).
        let mut tx = MySqlTx::idle(conn, name.clone());
        let rows = sqlx::raw_sql(AssertSqlSafe(text)).fetch_all(&mut *tx).await;
        let claim = async {
            let rows = rows.map_err(store_error)?;
            let [row] = &rows[..] else {
                return Err(Error::store(
                    StoreErrorKind::Other,
                    format!("the named-lock read answered {} rows, not 1", rows.len()),
                ));
            };
            let answer: Option<i64> = row.try_get(0).map_err(store_error)?;
            if answer != Some(1) {
                tx.forget_lock(&name);
                if answer == Some(NAMED_LOCK_SERIALIZABLE) {
                    tx.start().await?;
                }
                return self.not_locked(&mut tx, req, wait, answer).await;
            }
            match RawRow::decode_joined(row)? {
                Some(found) if !found.is_stale(req.now_ms) => Ok(Claim::Found(found.into_stored()?)),
                found => {
                    tx.start().await?;
                    self.decide_named(&mut tx, req, wait, flavor, found).await
                }
            }
        }
        .await;
        match claim {
            Ok(claim) => Ok((tx, claim)),
            Err(e) => {
                if let Err(rollback) = tx.rollback().await {
                    tracing::debug!(error = %rollback, "rollback after a failed claim failed");
                }
                Err(e)
            }
        }
    }

    /// The named-lock record: one `INSERT` of the completed row. A
    /// duplicate key means another claim's row committed after this claim
    /// read the key: a serialisation failure, so the engine rolls back and
    /// runs the call again.
    async fn insert_completed(
        &self,
        tx: &mut MySqlTx,
        req: &ClaimRequest<'_>,
        record: &Record,
        token: i64,
    ) -> Result<()> {
        let inserted = sqlx::query(self.sql.insert_completed.clone())
            .bind(req.scope.tenant().as_str().as_bytes())
            .bind(req.scope.operation().as_str().as_bytes())
            .bind(req.key.as_str().as_bytes())
            .bind(&req.fingerprint.as_bytes()[..])
            .bind(record.status.code())
            .bind(token)
            .bind(&record.payload[..])
            .bind(req.now_ms)
            .bind(req.expires_at_ms)
            .execute(&mut **tx)
            .await;
        match inserted {
            Ok(_) => Ok(()),
            Err(e) if error_number(&e) == Some(ER_DUP_ENTRY) => Err(Error::store(
                StoreErrorKind::Serialization,
                format!("the key's row was written by another claim before this record: {e}"),
            )),
            Err(e) => Err(store_error(e)),
        }
    }
}

/// Judges an UPDATE or DELETE guarded by a lease's token: no matching row
/// means the lease was taken over or already finished.
fn fenced(affected: u64, lease: &Lease) -> Result<()> {
    if affected == 1 {
        Ok(())
    } else {
        tracing::debug!(token = lease.token.0, "lease is no longer current");
        Err(Error::Fenced)
    }
}

/// A lock-wait timeout while claiming means a twin still holds the key:
/// the engine polls again until its deadline. Everything else is mapped.
fn busy_or_error(e: sqlx::Error) -> Result<Claim> {
    if error_number(&e) == Some(ER_LOCK_WAIT_TIMEOUT) {
        tracing::debug!("a concurrent claim still holds the key; answering busy");
        Ok(Claim::Busy)
    } else {
        let e = store_error(e);
        if e.store_kind() == Some(StoreErrorKind::Deadlock) {
            tracing::debug!("claim chosen as a deadlock victim; the engine retries it");
        }
        Err(e)
    }
}

/// The whole seconds of `wait` an attempt may block, capped.
fn lock_wait_secs(wait: Duration) -> u64 {
    wait.as_secs().min(MAX_LOCK_WAIT_SECS)
}

impl TxBackend for MySqlStore {
    type Tx = MySqlTx;

    fn begin(&self) -> BoxFuture<'_, Result<MySqlTx>> {
        Box::pin(MySqlTx::begin(&self.pool))
    }

    fn claim<'a>(
        &'a self,
        tx: &'a mut MySqlTx,
        req: &'a ClaimRequest<'a>,
        wait: Duration,
    ) -> BoxFuture<'a, Result<TxClaim>> {
        Box::pin(async move {
            let claim = match self.strategy {
                ClaimStrategy::Placeholder => self.claim_on(tx, req, lock_wait_secs(wait)).await?,
                ClaimStrategy::NamedLock => self.claim_named(tx, req, wait).await?,
            };
            Ok(match claim {
                Claim::Claimed(_) => TxClaim::Claimed,
                Claim::Found(row) => TxClaim::Found(row),
                Claim::Busy => TxClaim::Busy,
            })
        })
    }

    /// Under [`ClaimStrategy::NamedLock`], the lock and the read of the key
    /// in one round trip, before `BEGIN` (which follows only if the claim
    /// writes); otherwise `begin` then `claim`.
    fn begin_claim<'a>(
        &'a self,
        req: &'a ClaimRequest<'a>,
        wait: Duration,
    ) -> BoxFuture<'a, Result<(MySqlTx, TxClaim)>> {
        Box::pin(async move {
            let (tx, claim) = match self.strategy {
                ClaimStrategy::NamedLock => self.begin_named(req, wait).await?,
                ClaimStrategy::Placeholder => {
                    let mut tx = self.begin().await?;
                    match self.claim_on(&mut tx, req, lock_wait_secs(wait)).await {
                        Ok(claim) => (tx, claim),
                        Err(e) => {
                            if let Err(rollback) = tx.rollback().await {
                                tracing::debug!(error = %rollback, "rollback after a failed claim failed");
                            }
                            return Err(e);
                        }
                    }
                }
            };
            Ok((
                tx,
                match claim {
                    Claim::Claimed(_) => TxClaim::Claimed,
                    Claim::Found(row) => TxClaim::Found(row),
                    Claim::Busy => TxClaim::Busy,
                },
            ))
        })
    }

    fn record<'a>(
        &'a self,
        tx: &'a mut MySqlTx,
        req: &'a ClaimRequest<'a>,
        record: &'a Record,
    ) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            if let Some(token) = tx.take_unwritten(req) {
                return self.insert_completed(tx, req, record, token).await;
            }
            let done = sqlx::query(self.sql.record.clone())
                .bind(record.status.code())
                .bind(&record.payload[..])
                .bind(req.scope.tenant().as_str().as_bytes())
                .bind(req.scope.operation().as_str().as_bytes())
                .bind(req.key.as_str().as_bytes())
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

    fn commit(&self, tx: MySqlTx) -> BoxFuture<'_, Result<()>> {
        Box::pin(tx.commit())
    }

    fn rollback(&self, tx: MySqlTx) -> BoxFuture<'_, Result<()>> {
        Box::pin(tx.rollback())
    }
}

impl LeaseStore for MySqlStore {
    fn try_claim<'a>(&'a self, req: &'a ClaimRequest<'a>) -> BoxFuture<'a, Result<LeaseClaim>> {
        Box::pin(async move {
            let mut tx = self.pool.begin().await.map_err(store_error)?;
            let claim = self.claim_on(&mut tx, req, LEASE_CLAIM_LOCK_WAIT_SECS).await;
            match claim {
                Ok(Claim::Claimed(token)) => {
                    tx.commit().await.map_err(store_error)?;
                    Ok(LeaseClaim::Acquired(token))
                }
                Ok(Claim::Found(row)) => {
                    rollback_quietly(tx).await;
                    Ok(LeaseClaim::Found(row))
                }
                Ok(Claim::Busy) => {
                    rollback_quietly(tx).await;
                    Err(Error::store(
                        StoreErrorKind::LockTimeout,
                        "another transaction held the key's row for the whole lease-claim lock wait",
                    ))
                }
                Err(e) => {
                    rollback_quietly(tx).await;
                    Err(e)
                }
            }
        })
    }

    /// One `UPDATE` guarded by the token: a row still held (in progress or
    /// already sent) becomes sent, keeping the earliest mark's time.
    fn mark_sent<'a>(&'a self, lease: &'a Lease, now_ms: i64) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            // Marking a row already sent at an earlier time changes nothing,
            // but CLIENT_FOUND_ROWS counts it as matched (see `extend`).
            let done = sqlx::query(self.sql.mark_sent.clone())
                .bind(now_ms)
                .bind(now_ms)
                .bind(lease.scope.tenant().as_str().as_bytes())
                .bind(lease.scope.operation().as_str().as_bytes())
                .bind(lease.key.as_str().as_bytes())
                .bind(lease.token.0)
                .execute(&self.pool)
                .await
                .map_err(store_error)?;
            fenced(done.rows_affected(), lease)
        })
    }

    fn lookup<'a>(&'a self, scope: &'a Scope, key: &'a IdempotencyKey) -> BoxFuture<'a, Result<Option<StoredRow>>> {
        Box::pin(self.get(scope, key))
    }

    fn complete<'a>(&'a self, lease: &'a Lease, record: &'a Record) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            let done = sqlx::query(self.sql.complete.clone())
                .bind(record.status.code())
                .bind(&record.payload[..])
                .bind(lease.scope.tenant().as_str().as_bytes())
                .bind(lease.scope.operation().as_str().as_bytes())
                .bind(lease.key.as_str().as_bytes())
                .bind(lease.token.0)
                .execute(&self.pool)
                .await
                .map_err(store_error)?;
            fenced(done.rows_affected(), lease)
        })
    }

    fn release<'a>(&'a self, lease: &'a Lease) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            let done = sqlx::query(self.sql.release.clone())
                .bind(lease.scope.tenant().as_str().as_bytes())
                .bind(lease.scope.operation().as_str().as_bytes())
                .bind(lease.key.as_str().as_bytes())
                .bind(lease.token.0)
                .execute(&self.pool)
                .await
                .map_err(store_error)?;
            fenced(done.rows_affected(), lease)
        })
    }

    fn extend<'a>(&'a self, lease: &'a Lease, lease_expires_at_ms: i64) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            // sqlx connects with CLIENT_FOUND_ROWS, so the affected-row count
            // is the number of rows matched, not changed: extending a lease to
            // the expiry it already has still counts one row and is not
            // mistaken for a fenced lease.
            let done = sqlx::query(self.sql.extend.clone())
                .bind(lease_expires_at_ms)
                .bind(lease_expires_at_ms)
                .bind(lease.scope.tenant().as_str().as_bytes())
                .bind(lease.scope.operation().as_str().as_bytes())
                .bind(lease.key.as_str().as_bytes())
                .bind(lease.token.0)
                .execute(&self.pool)
                .await
                .map_err(store_error)?;
            fenced(done.rows_affected(), lease)
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
            let mut query = match resolution {
                Some(record) => sqlx::query(self.sql.resolve_record.clone())
                    .bind(record.status.code())
                    .bind(record.payload.clone()),
                None => sqlx::query(self.sql.resolve_release.clone()),
            };
            // The key's expiry, then the end of a sent claim's lease.
            query = query
                .bind(scope.tenant().as_str().as_bytes())
                .bind(scope.operation().as_str().as_bytes())
                .bind(key.as_str().as_bytes())
                .bind(now_ms)
                .bind(now_ms);
            let done = query.execute(&self.pool).await.map_err(store_error)?;
            Ok(done.rows_affected() == 1)
        })
    }
}

impl Sweep for MySqlStore {
    fn sweep_expired(&self, now_ms: i64, limit: u32) -> BoxFuture<'_, Result<u64>> {
        Box::pin(async move {
            let done = sqlx::query(self.sql.sweep.clone())
                .bind(now_ms)
                .bind(limit)
                .execute(&self.pool)
                .await
                .map_err(store_error)?;
            tracing::debug!(
                table = self.table.as_str(),
                deleted = done.rows_affected(),
                "swept expired keys"
            );
            Ok(done.rows_affected())
        })
    }
}

async fn rollback_quietly(tx: sqlx::Transaction<'static, sqlx::MySql>) {
    if let Err(e) = tx.rollback().await {
        tracing::debug!(error = %e, "rollback failed; the connection will be discarded");
    }
}

impl MySqlStore {
    /// How many keys the table holds, by state, at `now_ms`.
    pub async fn stats(&self, now_ms: i64) -> Result<idem_core::KeyStats> {
        let t = self.table.as_str();
        let (in_progress, completed, rejected, unknown, sent, expired): (i64, i64, i64, i64, i64, i64) = sqlx::query_as(AssertSqlSafe(format!(
            "SELECT CAST(COALESCE(SUM(CASE WHEN status = 0 AND expires_at_ms > ? THEN 1 ELSE 0 END), 0) AS SIGNED), \
                    CAST(COALESCE(SUM(CASE WHEN status = 1 AND expires_at_ms > ? THEN 1 ELSE 0 END), 0) AS SIGNED), \
                    CAST(COALESCE(SUM(CASE WHEN status = 2 AND expires_at_ms > ? THEN 1 ELSE 0 END), 0) AS SIGNED), \
                    CAST(COALESCE(SUM(CASE WHEN status = 3 AND expires_at_ms > ? THEN 1 ELSE 0 END), 0) AS SIGNED), \
                    CAST(COALESCE(SUM(CASE WHEN status = 4 AND expires_at_ms > ? THEN 1 ELSE 0 END), 0) AS SIGNED), \
                    CAST(COALESCE(SUM(CASE WHEN expires_at_ms <= ? THEN 1 ELSE 0 END), 0) AS SIGNED) FROM `{t}`"
        )))
        .bind(now_ms)
        .bind(now_ms)
        .bind(now_ms)
        .bind(now_ms)
        .bind(now_ms)
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

    /// Whether `table` exists in the connection's database, so the
    /// operator's commands can name a missing table as such.
    pub async fn table_exists(&self, table: &TableName) -> Result<bool> {
        let n: i64 = sqlx::query_scalar(
            "SELECT COUNT(*) FROM information_schema.tables WHERE table_schema = DATABASE() AND table_name = ?",
        )
        .bind(table.as_str())
        .fetch_one(&self.pool)
        .await
        .map_err(store_error)?;
        Ok(n > 0)
    }
}

/// The WHERE clause of a [`KeyFilter`] and its binds, in order after the
/// time (bound once per use: `?` placeholders are positional).
fn key_filter_sql(filter: &idem_core::KeyFilter, now_ms: i64) -> (String, Vec<KeyBind>) {
    let mut conds = Vec::new();
    let mut binds = Vec::new();
    let next = |b: KeyBind, binds: &mut Vec<KeyBind>| {
        binds.push(b);
        "?".to_owned()
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
        conds.push(format!("LEFT(idem_key, {len}) = {value}"));
    }
    if let Some(age) = filter.older_than_ms {
        conds.push(format!(
            "created_at_ms <= {now_ms} - {}",
            next(KeyBind::Int(age), &mut binds)
        ));
    }
    match filter.state {
        Some(idem_core::KeyState::InProgress) => conds.push(format!("status = 0 AND expires_at_ms > {now_ms}")),
        Some(idem_core::KeyState::Completed) => conds.push(format!("status = 1 AND expires_at_ms > {now_ms}")),
        Some(idem_core::KeyState::Rejected) => conds.push(format!("status = 2 AND expires_at_ms > {now_ms}")),
        Some(idem_core::KeyState::Unknown) => conds.push(format!("status = 3 AND expires_at_ms > {now_ms}")),
        Some(idem_core::KeyState::Sent) => conds.push(format!("status = 4 AND expires_at_ms > {now_ms}")),
        Some(idem_core::KeyState::Expired) => conds.push(format!("expires_at_ms <= {now_ms}")),
        None => conds.push("1 = 1".into()),
    }
    (conds.join(" AND "), binds)
}

enum KeyBind {
    Text(String),
    Int(i64),
}

/// The columns an operator sees, in the order of [`KeyRow`].
const KEY_COLUMNS: &str = "tenant, operation, idem_key, status, created_at_ms, expires_at_ms, payload";

/// A row of [`KEY_COLUMNS`] (binary key columns).
type KeyRow = (Vec<u8>, Vec<u8>, Vec<u8>, i16, i64, i64, Option<Vec<u8>>);

fn key_info(
    (tenant, operation, key, status, created_at_ms, expires_at_ms, payload): KeyRow,
    now_ms: i64,
) -> idem_core::KeyInfo {
    idem_core::KeyInfo {
        tenant: String::from_utf8_lossy(&tenant).into_owned(),
        operation: String::from_utf8_lossy(&operation).into_owned(),
        key: String::from_utf8_lossy(&key).into_owned(),
        state: idem_core::KeyState::of(status, expires_at_ms, now_ms),
        created_at_ms,
        expires_at_ms,
        payload: payload.unwrap_or_default(),
    }
}

impl MySqlStore {
    /// Keys matching `filter` at `now_ms`, oldest first, at most `limit`.
    pub async fn list_keys(
        &self,
        filter: &idem_core::KeyFilter,
        now_ms: i64,
        limit: u32,
    ) -> Result<Vec<idem_core::KeyInfo>> {
        let (conds, binds) = key_filter_sql(filter, now_ms);
        let sql = format!(
            "SELECT {KEY_COLUMNS} FROM `{}` WHERE {conds} ORDER BY created_at_ms LIMIT {limit}",
            self.table.as_str()
        );
        let mut q = sqlx::query_as::<_, KeyRow>(AssertSqlSafe(sql));
        for b in binds {
            q = match b {
                KeyBind::Text(t) => q.bind(t),
                KeyBind::Int(i) => q.bind(i),
            };
        }
        let rows = q.fetch_all(&self.pool).await.map_err(store_error)?;
        Ok(rows.into_iter().map(|row| key_info(row, now_ms)).collect())
    }

    /// The key `key` of `scope`, by its exact value (byte for byte), as it
    /// is at `now_ms`.
    pub async fn find_key(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        now_ms: i64,
    ) -> Result<Option<idem_core::KeyInfo>> {
        let sql = format!(
            "SELECT {KEY_COLUMNS} FROM `{}` WHERE tenant = ? AND operation = ? AND idem_key = ?",
            self.table.as_str()
        );
        let row = sqlx::query_as::<_, KeyRow>(AssertSqlSafe(sql))
            .bind(scope.tenant().as_str().as_bytes())
            .bind(scope.operation().as_str().as_bytes())
            .bind(key.as_str().as_bytes())
            .fetch_optional(&self.pool)
            .await
            .map_err(store_error)?;
        Ok(row.map(|row| key_info(row, now_ms)))
    }

    /// Deletes at most `limit` keys matching `filter` at `now_ms`; answers how many.
    ///
    /// One `DELETE … WHERE <filter>`: InnoDB evaluates the filter on each
    /// row's newest committed version under the row's lock (a locking read),
    /// waiting for a claim that holds the row, so a row claimed again since
    /// no longer matches and stays.
    ///
    /// A purge running while keys are claimed again can be chosen as the
    /// victim of a deadlock (error 1213): it deleted nothing then, and is run
    /// again, a bounded number of times with a short growing pause.
    pub async fn purge_keys(&self, filter: &idem_core::KeyFilter, now_ms: i64, limit: u32) -> Result<u64> {
        const RUNS: u32 = 10;
        let (conds, binds) = key_filter_sql(filter, now_ms);
        let t = self.table.as_str();
        let sql = format!("DELETE FROM `{t}` WHERE {conds} ORDER BY created_at_ms LIMIT {limit}");
        let mut run = 1;
        loop {
            let mut q = sqlx::query(AssertSqlSafe(sql.clone()));
            for b in &binds {
                q = match b {
                    KeyBind::Text(t) => q.bind(t.as_str()),
                    KeyBind::Int(i) => q.bind(*i),
                };
            }
            match q.execute(&self.pool).await.map_err(store_error) {
                Ok(done) => return Ok(done.rows_affected()),
                Err(e) if e.is_contention() && run < RUNS => {
                    tracing::debug!(run, error = %e, "a purge batch met contention; running it again");
                    tokio::time::sleep(std::time::Duration::from_millis(5 * u64::from(run))).await;
                    run += 1;
                }
                Err(e) => return Err(e),
            }
        }
    }
}

/// The operator's commands go through the inherent methods above (the same
/// names: inherent methods are found first, so these never call themselves).
impl idem_core::KeyAdmin for MySqlStore {
    fn stats(&self, now_ms: i64) -> idem_core::BoxFuture<'_, Result<idem_core::KeyStats>> {
        Box::pin(MySqlStore::stats(self, now_ms))
    }

    fn list_keys<'a>(
        &'a self,
        filter: &'a idem_core::KeyFilter,
        now_ms: i64,
        limit: u32,
    ) -> idem_core::BoxFuture<'a, Result<Vec<idem_core::KeyInfo>>> {
        Box::pin(MySqlStore::list_keys(self, filter, now_ms, limit))
    }

    fn find_key<'a>(
        &'a self,
        scope: &'a Scope,
        key: &'a IdempotencyKey,
        now_ms: i64,
    ) -> idem_core::BoxFuture<'a, Result<Option<idem_core::KeyInfo>>> {
        Box::pin(MySqlStore::find_key(self, scope, key, now_ms))
    }

    fn purge_keys<'a>(
        &'a self,
        filter: &'a idem_core::KeyFilter,
        now_ms: i64,
        limit: u32,
    ) -> idem_core::BoxFuture<'a, Result<u64>> {
        Box::pin(MySqlStore::purge_keys(self, filter, now_ms, limit))
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
        let url = std::env::var("IDEM_TEST_MYSQL_URL").unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into());
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
