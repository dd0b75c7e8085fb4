//! The error type of idem's core and of every store.

use std::time::Duration;

/// A boxed error from a storage driver.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// A `Result` whose error defaults to [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What went wrong in storage, in portable terms the engines act on. Each
/// store maps its driver's native errors (unique violation, MySQL 1213/1205,
/// PostgreSQL 40001/55P03, `SQLITE_BUSY`) to one of these.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum StoreErrorKind {
    /// A deadlock was detected and this transaction was chosen as the victim.
    Deadlock,
    /// A lock could not be obtained in time (lock-wait timeout, busy database).
    LockTimeout,
    /// A serialisable transaction could not be serialised (retry it).
    Serialization,
    /// The database could not be reached or the connection broke.
    Unavailable,
    /// Anything else.
    Other,
}

impl StoreErrorKind {
    /// Whether retrying the whole transaction may succeed.
    pub fn is_contention(self) -> bool {
        matches!(self, Self::Deadlock | Self::LockTimeout | Self::Serialization)
    }
}

/// Every way an idempotent call can fail.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The key was used before with a different request (HTTP 422).
    #[error("idempotency key was already used with a different request")]
    Mismatch,
    /// A request with the same key is still being processed (HTTP 409).
    #[error("a request with this idempotency key is in flight; retry after {} ms", retry_after.as_millis())]
    InFlight {
        /// How long the caller should wait before retrying.
        retry_after: Duration,
    },
    /// An earlier attempt with this key may have taken effect and nobody
    /// knows whether it did (HTTP 409): the key is held, never run again,
    /// until an operator or a reconciliation resolves it.
    #[error("the outcome of an earlier request with this idempotency key is unknown; it is held until resolved")]
    OutcomeUnknown,
    /// A lease-mode holder's token is no longer current: its lease expired
    /// and another claimer took the key over, or it completed already.
    #[error("lease lost: the key was taken over by another claimer")]
    Fenced,
    /// The idempotency key is malformed.
    #[error("invalid idempotency key: {0}")]
    InvalidKey(String),
    /// The tenant or operation name is malformed.
    #[error("invalid scope: {0}")]
    InvalidScope(String),
    /// The request cannot be fingerprinted (for example, invalid JSON).
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// An outcome is too large to record under the policy.
    #[error("outcome of {size} bytes exceeds the record limit of {limit} bytes")]
    RecordTooLarge {
        /// The size of the outcome.
        size: usize,
        /// The policy's limit.
        limit: usize,
    },
    /// A recorded outcome could not be decoded.
    #[error("recorded outcome is corrupt: {0}")]
    Corrupt(String),
    /// An outcome could not be encoded for recording.
    #[error("outcome cannot be encoded: {0}")]
    Encode(String),
    /// The configuration is invalid.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// The store failed.
    #[error("store error ({kind:?}): {source}")]
    Store {
        /// The portable kind of failure.
        kind: StoreErrorKind,
        /// The driver's error.
        #[source]
        source: BoxError,
    },
}

impl Error {
    /// Wraps a driver error with its portable kind.
    pub fn store(kind: StoreErrorKind, source: impl Into<BoxError>) -> Self {
        Self::Store {
            kind,
            source: source.into(),
        }
    }

    /// The storage kind, if this is a storage error.
    pub fn store_kind(&self) -> Option<StoreErrorKind> {
        match self {
            Self::Store { kind, .. } => Some(*kind),
            _ => None,
        }
    }

    /// Whether this is contention: a deadlock, a serialisation failure or a
    /// lock wait that ran out. Nothing the failed transaction wrote has
    /// committed, and running it again from the start may succeed;
    /// [`TxEngine`](crate::TxEngine) does so a bounded number of times.
    pub fn is_contention(&self) -> bool {
        self.store_kind().is_some_and(StoreErrorKind::is_contention)
    }

    /// Whether the same call may succeed if retried later (in-flight twins,
    /// contention and unavailable storage). A retryable error never consumed
    /// the key.
    pub fn is_retryable(&self) -> bool {
        match self {
            Self::InFlight { .. } => true,
            Self::Store { kind, .. } => kind.is_contention() || *kind == StoreErrorKind::Unavailable,
            _ => false,
        }
    }
}
