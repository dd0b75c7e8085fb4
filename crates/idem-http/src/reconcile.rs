//! Asking the downstream what became of a request whose outcome is unknown.
//!
//! In lease mode a key is held as an *unknown outcome* when its handler may
//! have taken effect although it failed (see [`OutcomeUnknown`](crate::OutcomeUnknown)).
//! Without a way to ask, every retry then gets 409 until an operator
//! resolves the key. With a [`Reconcile`] given to
//! [`IdempotencyLayer::reconcile`](crate::IdempotencyLayer::reconcile), a
//! retry that meets such a key asks first:
//!
//! - [`Reconciled::Applied`]: its answer is recorded as the key's outcome
//!   and replayed to this caller and every later one; the handler does not
//!   run.
//! - [`Reconciled::NotApplied`]: the key is released and this retry claims it
//!   and runs the handler, once, as a first request would — but only once
//!   the held request has settled: [`Reconcile::settle_after`] after it was
//!   marked sent. A server may still be working on a request whose caller
//!   gave up, and its lookup answers "not found" until it commits; asked
//!   earlier, a "not applied" keeps the key held (409 with `Retry-After`
//!   until the settle time).
//! - [`Reconciled::Unknown`]: the key stays held (409, as without asking).
//!
//! One retry per key asks at a time, whatever the number of instances on
//! the store: the asker holds a lease on the key in a scope of its own
//! (the operation's name followed by ` (reconcile)`), with a heartbeat,
//! and looks at the key again once it holds it. So an answer is only ever
//! acted on for the held outcome it was asked about: a twin that waited
//! while another retry released the key and sent the request again (which
//! may have failed again, and be held again) asks afresh after that send.

use bytes::Bytes;
use http::request::Parts;
use idem_core::{BoxFuture, Call};

/// What the downstream said about a request whose outcome is unknown.
#[derive(Debug)]
#[non_exhaustive]
pub enum Reconciled {
    /// It was applied: this answer is recorded as the key's outcome
    /// (private headers left out, as for a first answer) and replayed.
    Applied(http::Response<Bytes>),
    /// It was not applied: the key is released and the retry runs.
    NotApplied,
    /// Nobody knows: the key stays held.
    Unknown,
}

/// Asks the downstream whether a request held as an unknown outcome was
/// applied. Called with the head of the *retry* that met the held key (so
/// with that caller's own credentials, never another's) and its call (scope
/// and key).
pub trait Reconcile: Send + Sync + 'static {
    /// Whether there is a way to ask about requests like this one; when
    /// there is none the key stays held and nothing is asked.
    fn can_ask(&self, parts: &Parts, call: &Call) -> bool;

    /// Asks. Errors, timeouts and answers that say nothing are
    /// [`Reconciled::Unknown`].
    fn ask<'a>(&'a self, parts: &'a Parts, call: &'a Call) -> BoxFuture<'a, Reconciled>;

    /// How long after the held request was sent a "not applied" answer is
    /// trusted: the longest the other side may still be working on it (its
    /// timeout, plus a margin). A lookup must satisfy this rule: once this
    /// long has passed since a request was sent, "not found" means it was
    /// not applied and never will be. [`DEFAULT_SETTLE`] unless overridden.
    fn settle_after(&self, parts: &Parts, call: &Call) -> std::time::Duration {
        let _ = (parts, call);
        DEFAULT_SETTLE
    }
}

/// How long after a send a "not applied" answer is trusted by default.
pub const DEFAULT_SETTLE: std::time::Duration = std::time::Duration::from_secs(30);
