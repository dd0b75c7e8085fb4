//! Why one attempt did not end a call with a success, and what each reason
//! means: retried or final, whether the request may have reached the
//! vendor, the wait it asks for, and the outcome it counts as.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use idem_core::{Retryable as Transience, http_status_retryable};

use crate::breaker::BreakerState;
use crate::error::snippet;

/// Why one attempt did not end the call with a success.
#[derive(Debug)]
pub(crate) enum Failure {
    /// An answer that is not a success; retried or final by its status.
    Status {
        status: u16,
        body: Vec<u8>,
        /// What `Retry-After` asked for (429, 503, and 409: see
        /// [`Failure::transient`]).
        retry_after: Option<Duration>,
        /// A 409 whose body says the key is still being processed.
        in_flight: bool,
    },
    /// No complete answer within the attempt's time.
    Timeout(Option<Duration>),
    /// No connection (refused, DNS): the request was not sent.
    Connect(String),
    /// Reset, closed, the body cut off: the request may have arrived.
    Network(String),
    /// Not sent: the host's breaker refused it.
    CircuitOpen {
        host: Arc<str>,
        state: BreakerState,
        retry_in: Duration,
    },
    /// Not sent: the vendor, asked, is still processing this call.
    VendorBusy,
    /// Not sent: the vendor could not be asked.
    ReconcileFailed(String),
    /// Not sent, and not to be sent on a guess: the outcome is unknown.
    Held(String),
    /// Not sent: the caller's guard said it may no longer send.
    Stopped(String),
    /// Cannot be sent at all.
    Invalid(String),
}

impl Failure {
    pub(super) fn transient(&self) -> bool {
        match self {
            // A 409 with `Retry-After` is the Idempotency-Key draft's "a
            // request with this key is still being processed", and one whose
            // body says so (Stripe's `idempotency_key_in_use`) means the
            // same: the same key is sent again after the wait, never
            // dead-lettered for it.
            Failure::Status {
                status: 409,
                retry_after: Some(_),
                ..
            }
            | Failure::Status { in_flight: true, .. } => true,
            Failure::Status { status, .. } => http_status_retryable(*status) == Transience::Transient,
            Failure::Invalid(_) | Failure::Held(_) | Failure::Stopped(_) => false,
            Failure::Timeout(_)
            | Failure::Connect(_)
            | Failure::Network(_)
            | Failure::CircuitOpen { .. }
            | Failure::VendorBusy
            | Failure::ReconcileFailed(_) => true,
        }
    }

    /// Whether the request may have reached the vendor (and been applied):
    /// any answer, a timeout, a connection lost after sending. A refused
    /// connection, a breaker's refusal or a reconcile sent nothing.
    pub(super) fn may_have_reached(&self) -> bool {
        matches!(self, Failure::Status { .. } | Failure::Timeout(_) | Failure::Network(_))
    }

    /// A wait the answer asked for, in place of a shorter scheduled one.
    pub(super) fn wait_hint(&self) -> Option<Duration> {
        match self {
            Failure::Status { retry_after, .. } => *retry_after,
            Failure::CircuitOpen { retry_in, .. } => Some(*retry_in),
            _ => None,
        }
    }

    /// The outcome label, and whether it says the host works.
    pub(super) fn outcome(&self) -> (&'static str, bool) {
        match self {
            Failure::Status { status: 408, .. } => ("http_408", false),
            Failure::Status { status: 425, .. } => ("http_425", false),
            // The vendor's flow control: neutral for the breaker (see `attempt`).
            Failure::Status { status: 429, .. } => ("http_429", true),
            Failure::Status {
                status: 409,
                retry_after: Some(_),
                ..
            }
            | Failure::Status { in_flight: true, .. } => ("in_flight", true),
            Failure::Status { status: 500.., .. } => ("http_5xx", false),
            Failure::Status { .. } => ("rejected", true),
            Failure::Timeout(_) => ("timeout", false),
            Failure::Connect(_) => ("connect", false),
            Failure::Network(_) => ("network", false),
            Failure::CircuitOpen { .. } => ("circuit_open", false),
            Failure::VendorBusy | Failure::ReconcileFailed(_) | Failure::Held(_) => ("reconcile", true),
            Failure::Stopped(_) => ("stopped", true),
            Failure::Invalid(_) => ("invalid", true),
        }
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Failure::Status {
                status,
                body,
                retry_after,
                in_flight,
            } => {
                write!(f, "HTTP {status}: {}", snippet(body))?;
                if let Some(wait) = retry_after {
                    write!(f, " (Retry-After {}s)", wait.as_secs_f64())?;
                }
                if *in_flight {
                    write!(f, " (the key is still being processed)")?;
                }
                Ok(())
            }
            Failure::Timeout(Some(t)) => write!(f, "no complete answer within {} ms", t.as_millis()),
            Failure::Timeout(None) => write!(f, "the HTTP client timed out"),
            Failure::Connect(e) => write!(f, "not sent, no connection: {e}"),
            Failure::Network(e) => write!(f, "network error: {e}"),
            Failure::CircuitOpen {
                host,
                state: BreakerState::HalfOpen,
                ..
            } => write!(
                f,
                "not sent: the circuit breaker of {host} is half-open and its probe is in flight"
            ),
            Failure::CircuitOpen { host, retry_in, .. } => write!(
                f,
                "not sent: the circuit breaker of {host} is open for {} ms more",
                retry_in.as_millis()
            ),
            Failure::VendorBusy => write!(f, "not sent: the vendor is still processing an earlier send"),
            Failure::ReconcileFailed(e) => write!(f, "not sent: the vendor could not be asked: {e}"),
            Failure::Held(e) | Failure::Invalid(e) => write!(f, "{e}"),
            Failure::Stopped(e) => write!(f, "not sent: {e}"),
        }
    }
}
