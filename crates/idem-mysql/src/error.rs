//! Mapping MySQL and MariaDB errors to idem's portable kinds.

use idem_core::{Error, StoreErrorKind};
use sqlx::mysql::MySqlDatabaseError;

/// `ER_DUP_ENTRY`: a duplicate key (the twin's row already exists).
pub(crate) const ER_DUP_ENTRY: u16 = 1062;
/// `ER_DUP_FIELDNAME`: an `ADD COLUMN` whose column the table already has
/// (a migration run again after it died before recording itself).
pub(crate) const ER_DUP_FIELDNAME: u16 = 1060;
/// `ER_LOCK_WAIT_TIMEOUT`: InnoDB gave up waiting for a row lock. Only the
/// statement is rolled back (unless the server runs with
/// `innodb_rollback_on_timeout`).
pub(crate) const ER_LOCK_WAIT_TIMEOUT: u16 = 1205;
/// `ER_LOCK_DEADLOCK`: this transaction was chosen as a deadlock victim. The
/// server has already rolled the whole transaction back.
pub(crate) const ER_LOCK_DEADLOCK: u16 = 1213;
/// `ER_USER_LOCK_DEADLOCK` (MySQL): waiting for a named lock (`GET_LOCK`)
/// would deadlock with another session's named locks. MariaDB answers 1213.
pub(crate) const ER_USER_LOCK_DEADLOCK: u16 = 3058;

/// `ER_CHECKREAD` (MariaDB with `innodb_snapshot_isolation`): a row changed
/// after this REPEATABLE READ transaction's snapshot; the transaction must
/// start again.
pub(crate) const ER_CHECKREAD: u16 = 1020;

/// Server-side error numbers that mean the connection or the server went
/// away: the call may succeed later on another connection.
const UNAVAILABLE: &[u16] = &[
    1040, // ER_CON_COUNT_ERROR: too many connections
    1047, // ER_UNKNOWN_COM_ERROR: a Galera node not synced or cut off ("WSREP has not yet prepared node…")
    1053, // ER_SERVER_SHUTDOWN: the server is shutting down
    1152, // ER_ABORTING_CONNECTION
    1158, // ER_NET_READ_ERROR
    1159, // ER_NET_READ_INTERRUPTED
    1160, // ER_NET_ERROR_ON_WRITE
    1161, // ER_NET_WRITE_INTERRUPTED
    1927, // ER_CONNECTION_KILLED (MariaDB)
    2002, // CR_CONNECTION_ERROR
    2003, // CR_CONN_HOST_ERROR
    2006, // CR_SERVER_GONE_ERROR
    2013, // CR_SERVER_LOST
    4031, // ER_CLIENT_INTERACTION_TIMEOUT (MySQL 8)
];

/// The MySQL error number of a database error, if it is one.
pub(crate) fn error_number(e: &sqlx::Error) -> Option<u16> {
    match e {
        sqlx::Error::Database(db) => db
            .try_downcast_ref::<MySqlDatabaseError>()
            .map(MySqlDatabaseError::number),
        _ => None,
    }
}

/// The portable kind of a driver error.
pub(crate) fn kind_of(e: &sqlx::Error) -> StoreErrorKind {
    match e {
        sqlx::Error::Database(_) => match error_number(e) {
            Some(ER_LOCK_DEADLOCK | ER_USER_LOCK_DEADLOCK) => StoreErrorKind::Deadlock,
            Some(ER_LOCK_WAIT_TIMEOUT) => StoreErrorKind::LockTimeout,
            Some(ER_CHECKREAD) => StoreErrorKind::Serialization,
            Some(n) if UNAVAILABLE.contains(&n) => StoreErrorKind::Unavailable,
            _ => StoreErrorKind::Other,
        },
        _ => idem_sql::transport_kind(e),
    }
}

/// Whether a driver error is contention: a deadlock (1213), a lock wait that
/// ran out (1205) or a snapshot conflict (1020). Running the transaction
/// again from the start may succeed.
///
/// Use it to implement [`idem_core::Contention`] for the error type of work
/// run by [`TxEngine::execute`](idem_core::TxEngine::execute), so that the
/// engine re-runs work whose own statements lost a race (or map the error
/// with [`store_error`], whose result answers the same).
///
/// ```
/// assert!(!idem_mysql::is_contention(&sqlx::Error::RowNotFound));
/// ```
pub fn is_contention(e: &sqlx::Error) -> bool {
    kind_of(e).is_contention()
}

/// Wraps a driver error in idem's [`Error`] with its portable kind, so the
/// engines can tell a deadlock (retry the claim) from a lost connection
/// (report unavailable) from anything else.
///
/// Every error this crate returns went through this function. It is public so
/// that the caller's own writes inside a claimed transaction can be classified
/// the same way:
///
/// ```
/// use idem_core::StoreErrorKind;
/// let e = idem_mysql::store_error(sqlx::Error::PoolTimedOut);
/// assert_eq!(e.store_kind(), Some(StoreErrorKind::Unavailable));
/// assert!(e.is_retryable());
/// ```
pub fn store_error(e: sqlx::Error) -> Error {
    let kind = kind_of(&e);
    Error::store(kind, e)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Transport and pool failures are `Unavailable`; driver misuse is `Other`.
    #[test]
    fn non_database_errors_have_kinds() {
        let io = sqlx::Error::Io(std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset"));
        assert_eq!(kind_of(&io), StoreErrorKind::Unavailable);
        assert_eq!(kind_of(&sqlx::Error::PoolTimedOut), StoreErrorKind::Unavailable);
        assert_eq!(kind_of(&sqlx::Error::PoolClosed), StoreErrorKind::Unavailable);
        assert_eq!(kind_of(&sqlx::Error::RowNotFound), StoreErrorKind::Other);
        assert_eq!(error_number(&sqlx::Error::RowNotFound), None);
        let wrapped = store_error(sqlx::Error::WorkerCrashed);
        assert_eq!(wrapped.store_kind(), Some(StoreErrorKind::Unavailable));
    }
}
