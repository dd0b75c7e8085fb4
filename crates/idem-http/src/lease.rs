//! [`HeldLease`]: the extractor that hands a lease-mode handler its lease.

use std::ops::Deref;

use axum_core::extract::{FromRequestParts, OptionalFromRequestParts};
use axum_core::response::{IntoResponse, Response};
use http::StatusCode;
use http::request::Parts;

use crate::problem::{DEFAULT_PROBLEM_BASE, Problem};

/// The lease a lease-mode [`IdempotencyLayer`](crate::IdempotencyLayer) holds
/// for this request: its key, scope and fencing token.
///
/// While the handler runs, the layer extends the lease in the background, so
/// a twin request waits or gets `409` however slow the handler is. Pass
/// [`token`](idem_core::HeldLease::token) to whatever performs the effect (a
/// vendor, a row you write) so that it can refuse a stale holder: one whose
/// lease was taken over after a pause longer than the lease.
///
/// ```
/// use idem_http::HeldLease;
///
/// async fn pay(lease: HeldLease) -> String {
///     format!("fencing token {}", lease.token().0)
/// }
/// # let _ = pay;
/// ```
///
/// Requests without a key (optional-key routes, safe methods) hold no lease:
/// take `Option<HeldLease>` there.
#[derive(Debug, Clone)]
pub struct HeldLease(pub idem_core::HeldLease);

impl Deref for HeldLease {
    type Target = idem_core::HeldLease;
    fn deref(&self) -> &idem_core::HeldLease {
        &self.0
    }
}

/// The rejection of [`HeldLease`] when the request holds no lease.
#[derive(Debug)]
pub struct HeldLeaseRejection;

impl IntoResponse for HeldLeaseRejection {
    fn into_response(self) -> Response {
        Problem::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "idempotency-lease-missing",
            "No idempotency lease",
        )
        .with_detail("no lease-mode IdempotencyLayer holds a lease for this request")
        .into_response(DEFAULT_PROBLEM_BASE)
    }
}

impl<S: Send + Sync> FromRequestParts<S> for HeldLease {
    type Rejection = HeldLeaseRejection;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        parts.extensions.get::<HeldLease>().cloned().ok_or(HeldLeaseRejection)
    }
}

impl<S: Send + Sync> OptionalFromRequestParts<S> for HeldLease {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Option<Self>, Self::Rejection> {
        Ok(parts.extensions.get::<HeldLease>().cloned())
    }
}

/// Put in a response's extensions by a lease-mode handler (or a proxy) whose
/// work may have taken effect although it failed: the upstream got the whole
/// request, then answered 5xx, timed out or dropped the connection. The
/// layer then marks the key's outcome unknown instead of releasing it: every
/// retry gets a 409 `idempotency-outcome-unknown` problem, never a second
/// run, until an operator (or a reconciliation) resolves the key
/// ([`LeaseEngine::resolve_unknown`](idem_core::LeaseEngine::resolve_unknown)).
/// The note says what was seen, for the operator; it is kept, never replayed.
///
/// Only a response the layer would not record (a 5xx, or a 4xx the policy
/// does not record) is marked; a response that is recorded is recorded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutcomeUnknown {
    /// What was seen, for the operator.
    pub note: String,
    /// Whether the other side answered (a 5xx): nothing of the request is
    /// still in flight there, so a reconcile lookup's "not applied" is
    /// trusted at once. Without an answer (a timeout, a dropped
    /// connection) it is trusted only once the send has settled
    /// ([`Reconcile::settle_after`](crate::Reconcile::settle_after)).
    pub answered: bool,
}

/// How the note of an unknown outcome whose send was answered starts, as
/// stored: a reconciliation trusts "not applied" for it at once.
pub(crate) const ANSWERED: &str = "answered: ";

impl OutcomeUnknown {
    /// The note as stored: prefixed with [`ANSWERED`] when the other side
    /// answered, and never mistaken for such a note when it did not.
    pub(crate) fn stored_note(&self) -> Vec<u8> {
        match (self.answered, self.note.starts_with(ANSWERED)) {
            (true, _) => format!("{ANSWERED}{}", self.note).into_bytes(),
            (false, true) => format!(" {}", self.note).into_bytes(),
            (false, false) => self.note.clone().into_bytes(),
        }
    }
}

/// Whether a stored unknown outcome's send was answered (see
/// [`OutcomeUnknown::answered`]).
pub(crate) fn was_answered(record: &idem_core::Record) -> bool {
    record.status == idem_core::RecordStatus::Unknown && record.payload.starts_with(ANSWERED.as_bytes())
}
