//! The statements of the keys table, made once per store, and how the
//! named lock is taken.

use super::*;

/// What the named-lock statement answers when the transaction is
/// SERIALIZABLE (and it took no lock).
pub(crate) const NAMED_LOCK_SERIALIZABLE: i64 = -1;

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
pub(crate) const MAX_LOCK_WAIT_SECS: u64 = 5;

/// The longest a lease-mode claim blocks on another claimer's uncommitted
/// row, in seconds. Lease claims commit at once, so such a wait is normally
/// a few milliseconds; only a transactional claim of the same key (mixing
/// modes on one table) could hold it longer, and that is reported as
/// [`StoreErrorKind::LockTimeout`] rather than waited out.
pub(crate) const LEASE_CLAIM_LOCK_WAIT_SECS: u64 = 1;

/// Which server the pool talks to: they bound a statement's lock wait
/// differently.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Flavor {
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
pub(crate) struct Statements {
    pub(crate) insert: String,
    pub(crate) named_lock_mariadb: SqlStr,
    pub(crate) named_lock_mysql: SqlStr,
    pub(crate) insert_completed: SqlStr,
    pub(crate) select_locked: String,
    pub(crate) takeover: String,
    pub(crate) select: SqlStr,
    pub(crate) record: SqlStr,
}

pub(crate) const COLUMNS: &str = "fingerprint, status, token, payload, lease_expires_at_ms, expires_at_ms";
pub(crate) const WHERE_KEY: &str = "tenant = ? AND operation = ? AND idem_key = ?";

impl Statements {
    pub(crate) fn new(table: &TableName) -> Self {
        let fixed = |sql: String| AssertSqlSafe(sql).into_sql_str();
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
            record: fixed(format!(
                "UPDATE `{table}` SET status = ?, payload = ?, lease_expires_at_ms = NULL \
                 WHERE {WHERE_KEY} AND status = {STATUS_IN_PROGRESS}"
            )),
        }
    }
}

/// Deletes at most `?` (the second) rows expired at `?` (the first), oldest
/// first.
pub(crate) fn sweep(table: &TableName) -> String {
    format!("DELETE FROM `{table}` WHERE expires_at_ms <= ? ORDER BY expires_at_ms LIMIT ?")
}

/// The session variable the named lock's answer is kept in between the two
/// statements of [`MySqlStore::begin_named`].
pub(crate) const LOCK_VARIABLE: &str = "idem_named_lock";

/// The named-lock statement: `-1` under SERIALIZABLE (the isolation level
/// is the server variable `isolation`, whose name differs between MariaDB
/// and MySQL), otherwise `GET_LOCK(name, seconds)`: `1` taken, `0` timed out.
pub(crate) fn named_lock(isolation: &str) -> String {
    format!("SELECT IF({isolation} = 'SERIALIZABLE', {NAMED_LOCK_SERIALIZABLE}, GET_LOCK(?, ?))")
}
