//! Reconcile: asking the vendor what became of a call before sending it
//! again.

use std::time::Duration;

use idem_core::{BoxFuture, IdempotencyKey, OutboundRequest};

/// What the vendor says of a call, asked without sending it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reconciled {
    /// It applied it: here is its answer (kept as the call's result; nothing
    /// is sent).
    Applied {
        /// The status to record (a success).
        status: u16,
        /// The vendor's record of it.
        body: Vec<u8>,
    },
    /// It has no record of it: sending it is safe.
    NotApplied,
    /// It is still processing a request of this call: ask again later, and
    /// never send meanwhile.
    InFlight,
    /// It cannot say (several records, a record that does not match): hold
    /// the call for an operator.
    Unknown(String),
}

/// Asks the vendor what became of a call: typically a lookup by the client
/// reference the request carries (`GET /v1/payouts?reference=…`). An `Err`
/// means the vendor could not be asked (it is asked again later, within
/// the call's deadline); it is never taken for "not applied".
///
/// Answer [`Reconciled::NotApplied`] only when the vendor is sure: a lookup
/// that may lag behind the vendor's writes must say `InFlight` or
/// `Unknown` for a request it may not see yet.
pub trait Reconcile: Send + Sync + 'static {
    /// What the vendor says of `request`, sent with `key`, within
    /// `timeout`.
    fn reconcile<'a>(
        &'a self,
        key: &'a IdempotencyKey,
        request: &'a OutboundRequest,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<Reconciled, String>>;
}

/// How long a vendor remembers idempotency keys, and the margin kept from
/// it.
///
/// A re-send is sent blindly only while the first send that may have
/// reached the vendor is younger than `horizon - margin`; past that, or
/// always when the horizon is zero (a vendor without idempotency), the
/// vendor is asked first.
///
/// ```
/// use std::time::Duration;
/// use idem_outbound::KeyHorizon;
/// let stripe = KeyHorizon::new(Duration::from_secs(24 * 3600), Duration::from_secs(3600));
/// assert!(stripe.remembers(0, 22 * 3_600_000));
/// assert!(!stripe.remembers(0, 23 * 3_600_000));
/// assert!(!KeyHorizon::NONE.remembers(0, 0));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyHorizon {
    /// How long the vendor remembers a key (zero: it has no keys).
    pub horizon: Duration,
    /// Kept from the horizon: clocks differ, and a vendor may prune early.
    pub margin: Duration,
}

impl KeyHorizon {
    /// A vendor without idempotency: every re-send is reconciled first.
    pub const NONE: Self = Self {
        horizon: Duration::ZERO,
        margin: Duration::ZERO,
    };

    /// A vendor remembering keys for `horizon`, trusted up to `horizon -
    /// margin`.
    pub fn new(horizon: Duration, margin: Duration) -> Self {
        Self { horizon, margin }
    }

    /// Whether a key first sent at `first_ms` is still remembered at
    /// `now_ms` (both on one clock).
    pub fn remembers(&self, first_ms: i64, now_ms: i64) -> bool {
        let trusted = self.horizon.saturating_sub(self.margin);
        if trusted.is_zero() {
            return false;
        }
        let age = now_ms.saturating_sub(first_ms);
        // A send from the future (a clock stepped back) is not trusted.
        age >= 0 && u128::from(age.unsigned_abs()) < trusted.as_millis()
    }
}
