//! The crate's error type.

use crate::{Key, Response, TransportError};

/// A `Result` whose error is [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What can go wrong building, sending or persisting an operation.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A key breaks the contract's rules (1–255 characters of printable ASCII).
    #[error("invalid idempotency key: {0}")]
    InvalidKey(String),
    /// An operation cannot be sent as built (a bad URL, header or method, or
    /// a size over a bound). Nothing was saved or sent.
    #[error("invalid operation: {0}")]
    InvalidOperation(String),
    /// The server gave a final answer that is not a success (a 4xx other
    /// than the in-flight 409, 408 and 429). Retrying with the same key would
    /// get the same answer, so the operation is no longer pending. The
    /// response carries its `application/problem+json` body parsed, when
    /// there is one ([`Response::problem`]).
    #[error("rejected with {}{}", .0.status(), .0.problem().map(|p| format!(": {}", p.summary())).unwrap_or_default())]
    Rejected(Box<Response>),
    /// The server gave a final answer whose body is over the client's
    /// response limit; the operation is no longer pending.
    #[error("the response to key {key} ({status}) is longer than the limit of {max_bytes} bytes")]
    ResponseTooLarge {
        /// The operation's key.
        key: Key,
        /// The answer's status.
        status: u16,
        /// The limit.
        max_bytes: usize,
    },
    /// No final answer before the deadline or the last allowed attempt. The
    /// operation may or may not have been applied; it stays pending, and
    /// sending it again (or [`Client::resume`](crate::Client::resume)) uses
    /// the same key, so it is applied at most once.
    #[error("no final answer for key {key} after {attempts} attempts: {last}")]
    GaveUp {
        /// The operation's key.
        key: Key,
        /// Attempts made.
        attempts: u32,
        /// What the last attempt got.
        last: LastFailure,
    },
    /// The HTTP client refused to build the request, so nothing was sent
    /// (not a network failure; retrying would not help). The operation is no
    /// longer pending.
    #[error("the HTTP client refused the request: {0}")]
    Http(String),
    /// The pending store failed. On a save, nothing was sent.
    #[error("pending store: {0}")]
    Store(String),
    /// The pending store is full (see its `max_pending`); nothing was sent.
    #[error("pending store is full: {max_pending} operations are pending")]
    StoreFull {
        /// The store's bound.
        max_pending: usize,
    },
    /// The key is already pending with a different operation; nothing was sent.
    #[error("key {0} is already pending with a different operation")]
    KeyInUse(Key),
    /// A response body is not what the caller expected (see
    /// [`Response::json`]).
    #[error("response body: {0}")]
    Decode(String),
    /// A stored operation cannot be read back.
    #[error("pending store holds a corrupt operation: {0}")]
    Corrupt(String),
}

impl Error {
    /// The final answer, when the error is a rejection.
    pub fn response(&self) -> Option<&Response> {
        match self {
            Error::Rejected(r) => Some(r),
            Error::GaveUp { last, .. } => match last {
                LastFailure::Response(r) => Some(r.as_ref()),
                LastFailure::Transport(_) => None,
            },
            _ => None,
        }
    }

    /// Whether the operation's outcome is unknown: it may have been applied,
    /// and it is still pending (send it again, or resume, with the same key).
    pub fn is_outcome_unknown(&self) -> bool {
        matches!(self, Error::GaveUp { .. })
    }
}

#[cfg(feature = "sqlite")]
impl From<sqlx::Error> for Error {
    fn from(e: sqlx::Error) -> Self {
        Error::Store(e.to_string())
    }
}

/// What the last attempt of an operation that gave up got.
#[derive(Debug)]
#[non_exhaustive]
pub enum LastFailure {
    /// A retryable answer (5xx, 408, 429 or the in-flight 409).
    Response(Box<Response>),
    /// No answer: the connection failed, timed out or was cut off.
    Transport(TransportError),
}

impl std::fmt::Display for LastFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LastFailure::Response(r) => match r.problem() {
                Some(p) => write!(f, "{}: {}", r.status(), p.summary()),
                None => write!(f, "{}", r.status()),
            },
            LastFailure::Transport(e) => write!(f, "{e}"),
        }
    }
}
