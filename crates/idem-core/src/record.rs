//! What stores keep under a key, and the handles of claims.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use crate::error::{Error, Result};
use crate::fingerprint::Fingerprint;
use crate::key::IdempotencyKey;
use crate::policy::Policy;
use crate::scope::Scope;

/// The status code stored for a claim that is still running.
pub const STATUS_IN_PROGRESS: i16 = 0;
/// The status code stored for a recorded success.
pub const STATUS_COMPLETED: i16 = 1;
/// The status code stored for a recorded final rejection.
pub const STATUS_REJECTED: i16 = 2;
/// The status code stored for an unknown outcome: the work may have taken
/// effect (the upstream got the whole request, then failed or went silent),
/// and nobody knows whether it did. Held until an operator (or a
/// reconciliation) resolves it, or until the key expires.
pub const STATUS_UNKNOWN: i16 = 3;
/// The status code stored for a lease-mode claim whose holder said, before
/// anything left its process, that from now on its request may reach the
/// other side ([`LeaseStore::mark_sent`](crate::LeaseStore::mark_sent)).
/// While its lease lives it is in progress like [`STATUS_IN_PROGRESS`]; once
/// the lease has run out it is an unknown outcome, never taken over: only
/// the holder's own completion, an operator or a reconciliation settles it.
pub const STATUS_SENT: i16 = 4;

/// How a recorded call ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RecordStatus {
    /// The work succeeded and committed.
    Completed,
    /// The work was rejected with a final (non-retryable) error that the
    /// policy chose to record.
    Rejected,
    /// The work may or may not have taken effect: the key is held (a lookup
    /// answers [`Error::OutcomeUnknown`]) until it is resolved or expires.
    /// Its payload is a note for the operator, never replayed.
    Unknown,
}

impl RecordStatus {
    /// The code stored in the `status` column.
    pub fn code(self) -> i16 {
        match self {
            Self::Completed => STATUS_COMPLETED,
            Self::Rejected => STATUS_REJECTED,
            Self::Unknown => STATUS_UNKNOWN,
        }
    }
}

/// A recorded outcome: replayed byte for byte to every retry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// How the call ended.
    pub status: RecordStatus,
    /// The encoded outcome (opaque to stores).
    pub payload: Vec<u8>,
}

impl Record {
    /// A recorded success.
    pub fn completed(payload: Vec<u8>) -> Self {
        Self {
            status: RecordStatus::Completed,
            payload,
        }
    }

    /// A recorded final rejection.
    pub fn rejected(payload: Vec<u8>) -> Self {
        Self {
            status: RecordStatus::Rejected,
            payload,
        }
    }

    /// An unknown outcome, with a note for the operator (what was seen).
    pub fn unknown(note: impl Into<Vec<u8>>) -> Self {
        Self {
            status: RecordStatus::Unknown,
            payload: note.into(),
        }
    }
}

/// A fencing token: each claim of a key gets a larger one than the claim it
/// took over, and complete/release succeed only with the current token.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Token(pub i64);

impl Token {
    /// A candidate token for a fresh claim at `now_ms`: the time in the high
    /// bits and 20 low bits that differ between processes (a random start)
    /// and between calls in one process (a counter), so a key that was
    /// released or swept and claimed again never hands out a token an old
    /// holder still has. On a takeover, stores use the larger of this and the
    /// previous token plus one.
    pub fn fresh(now_ms: i64) -> Self {
        // One draw of randomness per process, not one system call per claim;
        // the counter keeps tokens of one millisecond apart (2^20 of them).
        static START: OnceLock<u64> = OnceLock::new();
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let start = *START.get_or_init(|| uuid::Uuid::now_v7().as_u128() as u64);
        let low = (start.wrapping_add(NEXT.fetch_add(1, Ordering::Relaxed)) & 0xF_FFFF) as i64;
        Self(((now_ms.max(0) & ((1 << 42) - 1)) << 20) | low)
    }
}

/// The state of a stored key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RowState {
    /// A lease-mode claim that has not finished.
    InProgress {
        /// The holder's fencing token.
        token: Token,
        /// When the lease runs out (ms since the epoch).
        lease_expires_at_ms: i64,
    },
    /// A lease-mode claim whose request may have reached the other side
    /// ([`STATUS_SENT`]): in flight while its lease lives, an unknown
    /// outcome once it has run out. Never taken over.
    Sent {
        /// The holder's fencing token.
        token: Token,
        /// When the lease runs out (ms since the epoch).
        lease_expires_at_ms: i64,
    },
    /// A recorded outcome (or an unknown one, [`RecordStatus::Unknown`]:
    /// settled like an outcome, never taken over by a lease's end).
    Done(Record),
}

/// A stored key as a store reads it back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredRow {
    /// The fingerprint of the request that claimed the key.
    pub fingerprint: Fingerprint,
    /// Whether it is running or done.
    pub state: RowState,
    /// When the key expires (ms since the epoch).
    pub expires_at_ms: i64,
    /// The earliest time a holder marked that its request may have reached
    /// the other side ([`LeaseStore::mark_sent`](crate::LeaseStore::mark_sent)),
    /// kept when the outcome is recorded. Read by
    /// [`LeaseStore::lookup`](crate::LeaseStore::lookup); `None` where a
    /// store's claim statement does not read it, and for rows never sent.
    pub sent_at_ms: Option<i64>,
}

impl StoredRow {
    /// The row with its sent mark's time (see [`sent_at_ms`](Self::sent_at_ms)).
    pub fn with_sent_at_ms(mut self, sent_at_ms: Option<i64>) -> Self {
        self.sent_at_ms = sent_at_ms;
        self
    }

    /// Whether this row holds a recorded outcome (an unknown one included)
    /// that has not expired at `now_ms`: what a read before the claim may
    /// answer by itself (see
    /// [`TxEngine::with_read_first`](crate::TxEngine::with_read_first)).
    pub fn is_recorded_at(&self, now_ms: i64) -> bool {
        matches!(self.state, RowState::Done(_)) && self.expires_at_ms > now_ms
    }

    /// Whether this row holds an unknown outcome at `now_ms`: one recorded
    /// as unknown, or a sent claim whose lease has run out.
    pub fn is_unknown_at(&self, now_ms: i64) -> bool {
        match &self.state {
            RowState::Done(record) => record.status == RecordStatus::Unknown,
            RowState::Sent {
                lease_expires_at_ms, ..
            } => *lease_expires_at_ms <= now_ms,
            RowState::InProgress { .. } => false,
        }
    }

    /// Decodes a row from the columns every SQL store keeps.
    pub fn from_columns(
        fingerprint: &[u8],
        status: i16,
        token: i64,
        payload: Option<Vec<u8>>,
        lease_expires_at_ms: Option<i64>,
        expires_at_ms: i64,
    ) -> Result<Self> {
        let fingerprint = Fingerprint::try_from_slice(fingerprint)?;
        let state = match status {
            STATUS_IN_PROGRESS => RowState::InProgress {
                token: Token(token),
                lease_expires_at_ms: lease_expires_at_ms.unwrap_or(i64::MAX),
            },
            STATUS_SENT => RowState::Sent {
                token: Token(token),
                lease_expires_at_ms: lease_expires_at_ms.unwrap_or(i64::MAX),
            },
            STATUS_COMPLETED | STATUS_REJECTED | STATUS_UNKNOWN => RowState::Done(Record {
                status: match status {
                    STATUS_COMPLETED => RecordStatus::Completed,
                    STATUS_REJECTED => RecordStatus::Rejected,
                    _ => RecordStatus::Unknown,
                },
                payload: payload.unwrap_or_default(),
            }),
            other => return Err(Error::Corrupt(format!("unknown status code {other}"))),
        };
        Ok(Self {
            fingerprint,
            state,
            expires_at_ms,
            sent_at_ms: None,
        })
    }
}

/// One idempotent call: which key, in which scope, for which request, under
/// which policy.
#[derive(Debug, Clone)]
pub struct Call {
    scope: Scope,
    key: IdempotencyKey,
    fingerprint: Fingerprint,
    previous: Option<Previous>,
    policy: Policy,
}

type PreviousFn = dyn Fn() -> Option<Fingerprint> + Send + Sync;

/// The request's fingerprint in the previous format, computed at most once
/// and only when a stored fingerprint differs from the current one.
#[derive(Clone)]
struct Previous {
    compute: Arc<PreviousFn>,
    value: Arc<OnceLock<Option<Fingerprint>>>,
}

impl Previous {
    fn get(&self) -> Option<Fingerprint> {
        *self.value.get_or_init(|| (self.compute)())
    }
}

impl fmt::Debug for Previous {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.value.get() {
            Some(v) => f.debug_tuple("Previous").field(v).finish(),
            None => f.write_str("Previous(<not computed>)"),
        }
    }
}

impl Call {
    /// A call with the default [`Policy`].
    pub fn new(scope: Scope, key: IdempotencyKey, fingerprint: Fingerprint) -> Self {
        Self {
            scope,
            key,
            fingerprint,
            previous: None,
            policy: Policy::default(),
        }
    }

    /// Also accepts a stored fingerprint equal to `previous`, this request's
    /// fingerprint in the previous format ([`FingerprintVersion::V1`](crate::FingerprintVersion::V1)),
    /// so a retry whose first attempt was recorded before an upgrade is still
    /// the same request.
    pub fn with_previous_fingerprint(self, previous: Fingerprint) -> Self {
        self.with_previous_fingerprint_from(move || Some(previous))
    }

    /// Like [`with_previous_fingerprint`](Self::with_previous_fingerprint),
    /// but computes the previous fingerprint only if a stored fingerprint
    /// differs from the current one, at most once per call. `None` means the
    /// request has no fingerprint in the previous format.
    pub fn with_previous_fingerprint_from(
        mut self,
        previous: impl Fn() -> Option<Fingerprint> + Send + Sync + 'static,
    ) -> Self {
        self.previous = Some(Previous {
            compute: Arc::new(previous),
            value: Arc::new(OnceLock::new()),
        });
        self
    }

    /// Whether a stored fingerprint is this request's: equal to its current
    /// fingerprint or, if one was given, to its previous-format one.
    pub fn accepts(&self, stored: &Fingerprint) -> bool {
        *stored == self.fingerprint
            || self
                .previous
                .as_ref()
                .and_then(Previous::get)
                .is_some_and(|p| p == *stored)
    }

    /// Sets the policy.
    pub fn with_policy(mut self, policy: Policy) -> Self {
        self.policy = policy;
        self
    }

    /// The scope.
    pub fn scope(&self) -> &Scope {
        &self.scope
    }

    /// The key.
    pub fn key(&self) -> &IdempotencyKey {
        &self.key
    }

    /// The request's fingerprint.
    pub fn fingerprint(&self) -> &Fingerprint {
        &self.fingerprint
    }

    /// The policy.
    pub fn policy(&self) -> &Policy {
        &self.policy
    }
}

/// What a store is asked to claim.
#[derive(Debug, Clone, Copy)]
pub struct ClaimRequest<'a> {
    /// The scope of the key.
    pub scope: &'a Scope,
    /// The key.
    pub key: &'a IdempotencyKey,
    /// The request's fingerprint.
    pub fingerprint: &'a Fingerprint,
    /// The current time (ms since the epoch), from the engine's clock.
    pub now_ms: i64,
    /// When a new claim expires (ms since the epoch).
    pub expires_at_ms: i64,
    /// The token a fresh claim gets; a takeover uses the larger of this and
    /// the previous token plus one.
    pub fresh_token: Token,
    /// When a lease-mode claim's lease runs out; `None` in transactional mode.
    pub lease_expires_at_ms: Option<i64>,
}

impl ClaimRequest<'_> {
    /// The token this claim holds the key under: its fresh token on a free
    /// key; over a stale row whose token was `previous`, the larger of the
    /// fresh token and `previous + 1`, so the previous holder is fenced
    /// however the clocks that made the tokens stood.
    pub fn token_over(&self, previous: Option<i64>) -> i64 {
        let fresh = self.fresh_token.0;
        previous.map_or(fresh, |old| fresh.max(old.saturating_add(1)))
    }
}

/// What a store is asked to settle: the unknown outcome of `key` in `scope`
/// ([`LeaseStore::resolve_unknown`](crate::LeaseStore::resolve_unknown)).
#[derive(Debug, Clone, Copy)]
pub struct Resolution<'a> {
    /// The scope of the key.
    pub scope: &'a Scope,
    /// The key.
    pub key: &'a IdempotencyKey,
    /// The current time (ms since the epoch), from the engine's clock.
    pub now_ms: i64,
    /// The outcome the work had (it took effect), or `None` (it did not:
    /// the key is freed).
    pub record: Option<&'a Record>,
}

/// Whether a key's row may be taken over at `now_ms` (the rule every store
/// applies; the SQL stores write it in their claim statements): the key
/// has expired, or a lease still in progress ran out. A sent claim
/// ([`STATUS_SENT`]) is never stale before its key expires: its lease's end
/// makes it an unknown outcome, not a key to claim again.
pub fn is_stale(status: i16, lease_expires_at_ms: Option<i64>, expires_at_ms: i64, now_ms: i64) -> bool {
    expires_at_ms <= now_ms || (status == STATUS_IN_PROGRESS && lease_expires_at_ms.is_some_and(|l| l <= now_ms))
}

/// A held lease-mode claim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    /// The scope of the key.
    pub scope: Scope,
    /// The key.
    pub key: IdempotencyKey,
    /// The fencing token of this claim.
    pub token: Token,
    /// When the lease runs out (ms since the epoch).
    pub lease_expires_at_ms: i64,
}

impl Lease {
    /// Judges a statement guarded by this lease's token that changed `rows`
    /// rows (a SQL store's update or delete of its row): none means the key
    /// was taken over, finished or released, and the lease is no longer
    /// current ([`Error::Fenced`]). `action` names the statement in the log.
    pub fn fenced_unless_one(&self, rows: u64, action: &'static str) -> Result<()> {
        if rows == 1 {
            return Ok(());
        }
        tracing::debug!(action, token = self.token.0, "lease fenced: no longer current");
        Err(Error::Fenced)
    }
}

/// Whether the caller's work ran now or its recorded outcome was replayed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome<T> {
    /// The work ran in this call.
    Executed(T),
    /// A previous call's recorded outcome was replayed; the work did not run.
    Replayed(T),
}

impl<T> Outcome<T> {
    /// The value, however it was obtained.
    pub fn into_inner(self) -> T {
        match self {
            Self::Executed(t) | Self::Replayed(t) => t,
        }
    }

    /// A reference to the value.
    pub fn value(&self) -> &T {
        match self {
            Self::Executed(t) | Self::Replayed(t) => t,
        }
    }

    /// Whether this was a replay.
    pub fn is_replayed(&self) -> bool {
        matches!(self, Self::Replayed(_))
    }

    /// Maps the value, keeping how it was obtained.
    pub fn map<U>(self, f: impl FnOnce(T) -> U) -> Outcome<U> {
        match self {
            Self::Executed(t) => Outcome::Executed(f(t)),
            Self::Replayed(t) => Outcome::Replayed(f(t)),
        }
    }
}

pub(crate) fn in_flight(policy: &Policy) -> Error {
    Error::InFlight {
        retry_after: Duration::from_millis(policy.retry_after_ms()),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    // Claims at one instant in one process never get the same fresh token.
    #[test]
    fn fresh_tokens_of_one_instant_differ() {
        let mut seen = std::collections::HashSet::new();
        for _ in 0..100_000 {
            assert!(seen.insert(Token::fresh(1_700_000_000_000)), "a fresh token repeated");
        }
    }
    use crate::fingerprint::{FingerprintBuilder, FingerprintVersion};

    // A call accepts its own fingerprint and, once computed on demand, its previous-format one.
    #[test]
    fn accepts_current_and_previous_format() {
        let scope = Scope::parse("t", "POST /x").unwrap();
        let v2 = Fingerprint::of_json(scope.operation(), b"[1]").unwrap();
        let v1 = FingerprintBuilder::with_version(scope.operation(), FingerprintVersion::V1)
            .json(b"[1]")
            .unwrap()
            .finish();
        let other = Fingerprint::of_json(scope.operation(), b"[2]").unwrap();
        let computed = Arc::new(AtomicUsize::new(0));
        let call = {
            let computed = computed.clone();
            Call::new(scope.clone(), IdempotencyKey::new("k").unwrap(), v2).with_previous_fingerprint_from(move || {
                computed.fetch_add(1, Ordering::SeqCst);
                Some(v1)
            })
        };
        assert!(call.accepts(&v2));
        assert_eq!(computed.load(Ordering::SeqCst), 0, "computed although not needed");
        assert!(call.accepts(&v1));
        assert!(!call.accepts(&other));
        assert_eq!(computed.load(Ordering::SeqCst), 1, "computed more than once");
        let strict = Call::new(scope, IdempotencyKey::new("k").unwrap(), v2);
        assert!(strict.accepts(&v2) && !strict.accepts(&v1));
    }

    // A takeover's token is above the previous holder's, whichever clock made either.
    #[test]
    fn a_takeover_fences_the_previous_holder() {
        let scope = Scope::parse("t", "POST /x").unwrap();
        let key = IdempotencyKey::new("k").unwrap();
        let fingerprint = Fingerprint::of_json(scope.operation(), b"{}").unwrap();
        let req = ClaimRequest {
            scope: &scope,
            key: &key,
            fingerprint: &fingerprint,
            now_ms: 10,
            expires_at_ms: 100,
            fresh_token: Token(50),
            lease_expires_at_ms: Some(20),
        };
        assert_eq!(req.token_over(None), 50);
        assert_eq!(req.token_over(Some(7)), 50);
        assert_eq!(req.token_over(Some(50)), 51);
        assert_eq!(req.token_over(Some(900)), 901);
        assert_eq!(req.token_over(Some(i64::MAX)), i64::MAX);
    }

    // Expired keys and run-out leases in progress are stale; a sent claim only once its key expires.
    #[test]
    fn staleness_of_each_status() {
        for status in [
            STATUS_IN_PROGRESS,
            STATUS_SENT,
            STATUS_COMPLETED,
            STATUS_REJECTED,
            STATUS_UNKNOWN,
        ] {
            assert!(is_stale(status, None, 10, 10), "{status} expired");
            assert!(!is_stale(status, None, 11, 10), "{status} live");
        }
        assert!(is_stale(STATUS_IN_PROGRESS, Some(10), 100, 10));
        assert!(!is_stale(STATUS_IN_PROGRESS, Some(11), 100, 10));
        assert!(
            !is_stale(STATUS_SENT, Some(5), 100, 10),
            "a sent claim is an unknown outcome, never stale"
        );
        assert!(!is_stale(STATUS_COMPLETED, Some(5), 100, 10));
    }

    /// Only an outcome recorded and not expired is answered by a read before
    /// the claim; a lease in progress or sent, or an expired outcome, is the
    /// claim's.
    #[test]
    fn recorded_at_is_a_live_outcome() {
        let fingerprint = Fingerprint::of_bytes(&crate::Operation::new("op").unwrap(), b"{}");
        let row = |status: i16, lease: Option<i64>| {
            StoredRow::from_columns(fingerprint.as_bytes(), status, 7, Some(b"x".to_vec()), lease, 100).unwrap()
        };
        for status in [STATUS_COMPLETED, STATUS_REJECTED, STATUS_UNKNOWN] {
            assert!(row(status, None).is_recorded_at(99), "{status} live");
            assert!(!row(status, None).is_recorded_at(100), "{status} expired");
        }
        assert!(!row(STATUS_IN_PROGRESS, Some(1_000)).is_recorded_at(10));
        assert!(!row(STATUS_SENT, Some(1_000)).is_recorded_at(10));
    }
}
