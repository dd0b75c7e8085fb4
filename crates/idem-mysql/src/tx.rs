//! The transaction a [`MySqlStore`](crate::MySqlStore) hands out.
//!
//! It is sqlx's own transaction bookkeeping (`MySqlTransactionManager`, so
//! a nested `begin` on the connection is a savepoint, as on a
//! `sqlx::Transaction`) on a pooled connection, plus what a
//! [`ClaimStrategy::NamedLock`](crate::ClaimStrategy::NamedLock) claim
//! leaves on the transaction: the server's named locks it took and the keys
//! it claimed without writing a row. Named locks belong to the session, not
//! to the transaction, so they are released after `COMMIT` or `ROLLBACK`,
//! and a transaction dropped while it holds one closes its connection
//! rather than return it to the pool still holding the lock.

use std::ops::{Deref, DerefMut};

use idem_core::{ClaimRequest, Result};
use idem_sql::UnwrittenClaims;
use sqlx::mysql::{MySqlConnection, MySqlTransactionManager};
use sqlx::pool::PoolConnection;
use sqlx::{AssertSqlSafe, MySql, MySqlPool};
use sqlx_core::transaction::TransactionManager;

use crate::error::store_error;

/// The open transaction of a [`MySqlStore`](crate::MySqlStore): a pooled
/// connection inside `BEGIN`. The caller's queries run on it (`&mut **tx`
/// is a `&mut MySqlConnection`), so they commit or roll back with the
/// claim.
///
/// Dropping an open transaction rolls it back, as dropping a
/// `sqlx::Transaction` does (the `ROLLBACK` is sent before the connection is
/// used again). If it holds a named lock of a
/// [`NamedLock`](crate::ClaimStrategy::NamedLock) claim, its connection is
/// closed instead: ending the session rolls the transaction back and frees
/// the lock, so the key is free for the next caller.
///
/// Under the named-lock strategy, a claim that `begin_claim` answers with a
/// found row or a busy key comes in a transaction that never began (no
/// `BEGIN` was sent): it is there to be rolled back, which releases the
/// lock.
pub struct MySqlTx {
    conn: Option<PoolConnection<MySql>>,
    /// Whether the server may be inside the transaction on this connection.
    open: bool,
    /// The named locks this transaction's claims took, released when it ends.
    locks: Vec<String>,
    /// The keys claimed without a row, with the token the record inserts
    /// the completed row with.
    unwritten: UnwrittenClaims<i64>,
    /// Whether the transaction's claim found the key held (a replay, a key
    /// in progress) and nothing has used the connection since: it locked
    /// nothing a later claim of the key would wait for, so
    /// [`rollback`](Self::rollback) need not wait for its `ROLLBACK`.
    found: bool,
}

impl std::fmt::Debug for MySqlTx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MySqlTx")
            .field("open", &self.open)
            .field("named_locks", &self.locks.len())
            .finish_non_exhaustive()
    }
}

impl Deref for MySqlTx {
    type Target = MySqlConnection;
    fn deref(&self) -> &MySqlConnection {
        self.conn
            .as_ref()
            .expect("a MySqlTx holds its connection until it ends")
    }
}

impl DerefMut for MySqlTx {
    fn deref_mut(&mut self) -> &mut MySqlConnection {
        self.found = false;
        self.conn
            .as_mut()
            .expect("a MySqlTx holds its connection until it ends")
    }
}

impl Drop for MySqlTx {
    fn drop(&mut self) {
        if !self.locks.is_empty() || self.check_intact().is_err() {
            // The locks outlive any ROLLBACK, and a ROLLBACK inside a nested
            // level ends only that level: only the end of the session frees
            // them and rolls back whatever is open.
            self.close();
            return;
        }
        if let (true, Some(conn)) = (self.open, self.conn.as_mut()) {
            MySqlTransactionManager::start_rollback(conn);
        }
    }
}

impl MySqlTx {
    /// Opens a transaction on a connection of `pool`.
    pub(crate) async fn begin(pool: &MySqlPool) -> Result<Self> {
        Self::begin_on(pool.acquire().await.map_err(store_error)?).await
    }

    /// Opens a transaction on `conn`, a connection of the store's pool.
    pub(crate) async fn begin_on(mut conn: PoolConnection<MySql>) -> Result<Self> {
        MySqlTransactionManager::begin(&mut conn, None)
            .await
            .map_err(store_error)?;
        Ok(Self {
            conn: Some(conn),
            open: true,
            locks: Vec::new(),
            unwritten: UnwrittenClaims::default(),
            found: false,
        })
    }

    /// A transaction not begun yet on `conn`, whose session may hold the
    /// named lock `lock` (see
    /// [`ClaimStrategy::NamedLock`](crate::ClaimStrategy::NamedLock)): the
    /// lock is noted as held until [`forget_lock`](Self::forget_lock) says
    /// otherwise. [`start`](Self::start) begins it; rolling back one that
    /// never began only releases the lock.
    pub(crate) fn idle(conn: PoolConnection<MySql>, lock: String) -> Self {
        Self {
            conn: Some(conn),
            open: false,
            locks: vec![lock],
            unwritten: UnwrittenClaims::default(),
            found: false,
        }
    }

    /// Begins the transaction of one that is [`idle`](Self::idle).
    pub(crate) async fn start(&mut self) -> Result<()> {
        MySqlTransactionManager::begin(self, None).await.map_err(store_error)?;
        self.open = true;
        Ok(())
    }

    /// Commits the transaction, then releases the named locks its claims
    /// took.
    ///
    /// A nested transaction (a savepoint) begun on the connection and never
    /// ended fails the commit: `COMMIT` there would end only the nested
    /// level. Nothing is committed: the connection is closed, which rolls
    /// the whole transaction back on the server.
    pub async fn commit(mut self) -> Result<()> {
        if !self.open {
            self.release_locks().await;
            return Ok(());
        }
        if let Err(e) = self.check_intact() {
            self.close();
            return Err(e);
        }
        let done = MySqlTransactionManager::commit(&mut self).await;
        if done.is_ok() {
            self.open = false;
        }
        self.release_locks().await;
        done.map_err(store_error)
    }

    /// Rolls the transaction back, then releases the named locks its claims
    /// took.
    ///
    /// Right after a claim that found the key held (a replay, a key in
    /// progress) and holds no named lock, it does not wait: `ROLLBACK` is
    /// queued, and the server releases what the transaction read after
    /// this returns. Any other transaction may hold locks a claim that
    /// follows at once would wait for (its placeholder row, the caller's
    /// writes), so there it waits for the answer.
    pub async fn rollback(mut self) -> Result<()> {
        if !self.open {
            self.release_locks().await;
            return Ok(());
        }
        if self.check_intact().is_err() {
            // A `ROLLBACK` would end only the nested level, or nothing at
            // all; closing the session rolls back everything.
            self.close();
            return Ok(());
        }
        if self.found && self.locks.is_empty() {
            // As when a `sqlx::Transaction` is dropped: `ROLLBACK` is queued
            // on the connection and sent and answered before the connection
            // does anything else, which is the ping with which the pool takes
            // every connection back, before anyone can acquire it. A replay
            // answers without waiting for it (what it read is shared-locked
            // a moment longer); a `ROLLBACK` that cannot be sent
            // fails that ping, and the pool closes the connection, which ends
            // the transaction on the server.
            MySqlTransactionManager::start_rollback(&mut self);
            self.open = false;
            return Ok(());
        }
        let done = MySqlTransactionManager::rollback(&mut self).await;
        if done.is_ok() {
            self.open = false;
        }
        self.release_locks().await;
        done.map_err(store_error)
    }

    /// [`rollback`](Self::rollback) after a failed `step` (a claim), whose
    /// own error the caller answers: a rollback that fails too is only
    /// logged.
    pub(crate) async fn roll_back_after(self, step: &str) {
        if let Err(rollback) = self.rollback().await {
            tracing::debug!(error = %rollback, "rollback after a failed {step} failed");
        }
    }

    /// Releases the named locks, once the transaction has ended. A
    /// connection whose transaction did not end cleanly, or whose locks
    /// could not be released, is closed: closing frees them.
    async fn release_locks(&mut self) {
        // While the transaction may still be open, the locks stay noted:
        // Drop closes the connection.
        if self.locks.is_empty() || self.open {
            return;
        }
        let calls = vec!["RELEASE_LOCK(?)"; self.locks.len()].join(", ");
        let mut release = sqlx::query(AssertSqlSafe(format!("DO {calls}")));
        for name in &self.locks {
            release = release.bind(name.as_str());
        }
        match release.execute(&mut **self).await {
            Ok(_) => self.locks.clear(),
            Err(e) => tracing::debug!(error = %e, "releasing named locks failed; closing the connection"),
        }
    }

    /// Fails unless an open transaction is still the one its claim began,
    /// with nothing nested left open on it: a nested transaction (a
    /// savepoint) never ended would take the commit for itself, and a count
    /// of zero means sqlx has rolled the transaction back (as it does when a
    /// nested `begin` fails or is cancelled), so a write sent now would
    /// commit on its own.
    pub(crate) fn check_intact(&self) -> Result<()> {
        let depth = self
            .conn
            .as_ref()
            .map_or(0, |conn| MySqlTransactionManager::get_transaction_depth(conn));
        if self.open {
            idem_sql::check_claim_depth(depth)?;
        }
        Ok(())
    }

    /// Closes the connection instead of returning it to the pool: the end of
    /// the session rolls back whatever is open and frees its named locks.
    fn close(&mut self) {
        self.open = false;
        self.locks.clear();
        let Some(mut conn) = self.conn.take() else { return };
        match tokio::runtime::Handle::try_current() {
            Ok(_) => conn.close_on_drop(),
            Err(_) => drop(conn.detach()),
        }
    }

    /// Whether this transaction holds the named lock `name`.
    pub(crate) fn holds_lock(&self, name: &str) -> bool {
        self.locks.iter().any(|held| held == name)
    }

    /// Forgets the named lock `name`: the session does not hold it.
    pub(crate) fn forget_lock(&mut self, name: &str) {
        self.locks.retain(|held| held != name);
    }

    /// Notes the named lock `name`, taken on this transaction's session.
    pub(crate) fn note_lock(&mut self, name: String) {
        self.locks.push(name);
    }

    /// Notes that the transaction's claim found the key held, with nothing
    /// sent on the connection since (see [`rollback`](Self::rollback)).
    pub(crate) fn note_found(&mut self) {
        self.found = true;
    }

    /// Notes a claim of `req`'s key that wrote no row: the record inserts
    /// the completed row with `token`.
    pub(crate) fn note_unwritten(&mut self, req: &ClaimRequest<'_>, token: i64) {
        self.unwritten.hold(req, token);
    }

    /// Takes back the claim of `req`'s key that wrote no row, if this
    /// transaction holds one: the token the record inserts.
    pub(crate) fn take_unwritten(&mut self, req: &ClaimRequest<'_>) -> Option<i64> {
        self.unwritten.take(req)
    }
}
