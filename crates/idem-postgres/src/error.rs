//! Mapping PostgreSQL and driver errors to idem's portable kinds.

use idem_core::{Error, StoreErrorKind};

/// SQLSTATE `55P03` (lock_not_available): `lock_timeout` ran out.
pub(crate) const LOCK_NOT_AVAILABLE: &str = "55P03";

/// Maps a driver error to an [`idem_core::Error::Store`] with the portable
/// kind the engines act on.
///
/// | SQLSTATE or driver error | kind |
/// | --- | --- |
/// | `40P01` deadlock detected | [`Deadlock`](StoreErrorKind::Deadlock) |
/// | `40001` serialization failure | [`Serialization`](StoreErrorKind::Serialization) |
/// | `55P03` lock not available (`lock_timeout`) | [`LockTimeout`](StoreErrorKind::LockTimeout) |
/// | class `08` (connection), `57P01`–`57P03` (shutdown, restart), `53300` (too many connections), I/O, TLS, pool timeouts and closed pools | [`Unavailable`](StoreErrorKind::Unavailable) |
/// | anything else | [`Other`](StoreErrorKind::Other) |
///
/// Business code running inside an idem transaction can use it too, so that
/// its own deadlocks and serialisation failures are retried like idem's.
///
/// ```
/// use idem_core::StoreErrorKind;
/// let err = idem_postgres::store_error(sqlx::Error::PoolTimedOut);
/// assert_eq!(err.store_kind(), Some(StoreErrorKind::Unavailable));
/// ```
pub fn store_error(error: sqlx::Error) -> Error {
    let kind = kind_of(&error);
    Error::store(kind, error)
}

/// Whether a driver error is contention: a deadlock (`40P01`), a
/// serialisation failure (`40001`) or a lock wait that ran out (`55P03`).
/// Nothing the failed transaction wrote commits, and running it again from
/// the start may succeed.
///
/// Use it to implement [`idem_core::Contention`] for the error type of work
/// run by [`TxEngine::execute`](idem_core::TxEngine::execute), so that the
/// engine re-runs work whose own statements lost a race (or map the error
/// with [`store_error`], whose result answers the same).
///
/// ```
/// assert!(!idem_postgres::is_contention(&sqlx::Error::RowNotFound));
/// ```
pub fn is_contention(error: &sqlx::Error) -> bool {
    kind_of(error).is_contention()
}

/// The SQLSTATE of a database error, if `error` is one.
pub(crate) fn sqlstate(error: &sqlx::Error) -> Option<String> {
    match error {
        sqlx::Error::Database(db) => db.code().map(|code| code.into_owned()),
        _ => None,
    }
}

fn kind_of(error: &sqlx::Error) -> StoreErrorKind {
    match error {
        sqlx::Error::Database(_) => match sqlstate(error).as_deref() {
            Some("40P01") => StoreErrorKind::Deadlock,
            Some("40001") => StoreErrorKind::Serialization,
            Some(LOCK_NOT_AVAILABLE) => StoreErrorKind::LockTimeout,
            Some("57P01" | "57P02" | "57P03" | "53300") => StoreErrorKind::Unavailable,
            Some(code) if code.starts_with("08") => StoreErrorKind::Unavailable,
            _ => StoreErrorKind::Other,
        },
        _ => idem_sql::transport_kind(error),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn driver_errors_map_to_portable_kinds() {
        let io = sqlx::Error::Io(std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset"));
        assert_eq!(store_error(io).store_kind(), Some(StoreErrorKind::Unavailable));
        assert_eq!(
            store_error(sqlx::Error::PoolClosed).store_kind(),
            Some(StoreErrorKind::Unavailable)
        );
        assert_eq!(
            store_error(sqlx::Error::RowNotFound).store_kind(),
            Some(StoreErrorKind::Other)
        );
    }
}
