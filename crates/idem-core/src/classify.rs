//! Classification of failures, kept apart from the policy that acts on it.

/// Whether a failure may succeed if tried again.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Retryable {
    /// May succeed later (timeouts, deadlocks, 5xx, 429): never recorded
    /// under a key.
    Transient,
    /// Will fail the same way again (validation errors, a declined payment):
    /// may be recorded under a key if the policy asks for it.
    Fatal,
}

/// Decides whether a failure is transient or final.
pub trait Classify {
    /// The classification of `self`.
    fn retryable(&self) -> Retryable;
}

/// The default decision for an HTTP status code: 408, 425, 429 and every 5xx
/// are transient; every other status is final.
///
/// ```
/// use idem_core::{http_status_retryable, Retryable};
/// assert_eq!(http_status_retryable(503), Retryable::Transient);
/// assert_eq!(http_status_retryable(429), Retryable::Transient);
/// assert_eq!(http_status_retryable(422), Retryable::Fatal);
/// ```
pub fn http_status_retryable(status: u16) -> Retryable {
    match status {
        408 | 425 | 429 | 500..=599 => Retryable::Transient,
        _ => Retryable::Fatal,
    }
}

/// A rejection type for work that never rejects: it has no values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Never {}

impl Classify for Never {
    fn retryable(&self) -> Retryable {
        match *self {}
    }
}

impl std::fmt::Display for Never {
    fn fmt(&self, _: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {}
    }
}
