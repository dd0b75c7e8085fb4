//! Mapping of sqlx and SQLite errors to idem's portable store error kinds.

use idem_core::{Error, StoreErrorKind};

/// `SQLITE_BUSY`: another connection holds a lock the statement needs.
const SQLITE_BUSY: i32 = 5;
/// `SQLITE_LOCKED`: a conflict inside one connection or shared cache.
const SQLITE_LOCKED: i32 = 6;
/// `SQLITE_IOERR`: the operating system reported an I/O error.
const SQLITE_IOERR: i32 = 10;
/// `SQLITE_FULL`: the disk is full.
const SQLITE_FULL: i32 = 13;
/// `SQLITE_CANTOPEN`: the database file cannot be opened.
const SQLITE_CANTOPEN: i32 = 14;

/// The portable kind of a sqlx error.
///
/// SQLite reports extended result codes (for example `SQLITE_BUSY_SNAPSHOT`
/// = 517); their low byte is the primary code, so every busy or locked
/// variant is classified as lock contention, which the engines retry.
pub(crate) fn kind_of(e: &sqlx::Error) -> StoreErrorKind {
    match e {
        sqlx::Error::Database(db) => {
            let primary = db.code().and_then(|c| c.parse::<i32>().ok()).map(|c| c & 0xff);
            match primary {
                Some(SQLITE_BUSY | SQLITE_LOCKED) => StoreErrorKind::LockTimeout,
                Some(SQLITE_IOERR | SQLITE_FULL | SQLITE_CANTOPEN) => StoreErrorKind::Unavailable,
                _ => StoreErrorKind::Other,
            }
        }
        _ => idem_sql::transport_kind(e),
    }
}

/// Maps a sqlx error to idem's [`Error::Store`] with its portable kind:
/// `SQLITE_BUSY` and `SQLITE_LOCKED` (with their extended codes) become
/// [`StoreErrorKind::LockTimeout`], I/O errors, a full disk, a file that
/// cannot be opened and pool timeouts become
/// [`StoreErrorKind::Unavailable`], anything else
/// [`StoreErrorKind::Other`].
///
/// The store maps every error of its own this way, so no raw sqlx error
/// crosses its API; the caller's work can use it for its own queries so
/// that their failures classify the same way.
pub fn store_error(e: sqlx::Error) -> Error {
    let kind = kind_of(&e);
    tracing::debug!(error = %e, ?kind, "sqlite store error");
    Error::store(kind, e)
}

/// Whether a sqlx error is contention: `SQLITE_BUSY` or `SQLITE_LOCKED`
/// (with their extended codes). Running the transaction again from the
/// start may succeed.
///
/// Use it to implement [`idem_core::Contention`] for the error type of work
/// run by [`TxEngine::execute`](idem_core::TxEngine::execute) (or map the
/// error with [`store_error`], whose result answers the same).
///
/// ```
/// assert!(!idem_sqlite::is_contention(&sqlx::Error::RowNotFound));
/// ```
pub fn is_contention(e: &sqlx::Error) -> bool {
    kind_of(e).is_contention()
}
