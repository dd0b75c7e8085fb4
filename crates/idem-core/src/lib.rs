//! The core of **idem**: exactly-once effects for Rust services.
//!
//! The guide, with examples: `docs/http.md` in the repository.
//!
//! ```text
//! at-least-once delivery + idempotent handler = exactly-once effect
//! ```
//!
//! This crate holds the vocabulary — [`IdempotencyKey`], [`Scope`],
//! [`Fingerprint`], [`Policy`], [`Outcome`], [`Error`] — the store traits
//! ([`TxBackend`], [`LeaseStore`], [`Sweep`]) and the two engines that hold
//! every policy decision:
//!
//! - [`TxEngine`] (transactional mode): the key claim, the caller's own
//!   database writes and the recorded outcome commit as one transaction. The
//!   database's unique key is the lock.
//! - [`LeaseEngine`] (lease mode, check–claim–complete): for effects outside
//!   the database; the claim commits at once with a lease and a fencing token.
//!
//! It knows no SQL, HTTP or broker: stores live in `idem-postgres`,
//! `idem-mysql`, `idem-sqlite` and `idem-memory`, and users normally depend on
//! the `idem` facade.
//!
//! ```
//! use idem_core::{Call, Fingerprint, IdempotencyKey, Policy, Scope};
//! let scope = Scope::parse("tenant-42", "POST /v1/transfers")?;
//! let key = IdempotencyKey::new("5f0c3f8e-8d43-4b39-9b53-5b1e4f1c1d2a")?;
//! let fingerprint = Fingerprint::of_json(scope.operation(), br#"{"amount":100}"#)?;
//! let call = Call::new(scope, key, fingerprint).with_policy(Policy::default());
//! assert_eq!(call.policy().ttl_secs(), 86_400);
//! # Ok::<(), idem_core::Error>(())
//! ```

mod classify;
mod clock;
mod contention;
pub mod deadletter;
mod detached;
mod engine;
mod error;
mod fingerprint;
mod heartbeat;
mod key;
mod lease;
pub mod metrics;
pub mod multistep;
mod outbox;
mod policy;
mod record;
mod redact;
mod registry;
mod scope;
mod store;
mod sweep;
mod table;
mod tx;

pub use classify::{Classify, Never, Retryable, http_status_retryable};
pub use clock::{
    AnchorOptions, AnchoredClock, CLOCK_OFFSET, CLOCK_UNCERTAINTY, Clock, ManualClock, SharedClock, SystemClock,
    TimeSource, system_clock,
};
pub use contention::{Contention, ContentionRetries};
pub use deadletter::{
    CREDENTIAL_HEADERS, DeadLetter, DeadLetterFilter, DeadLetterRow, DeadLetterState, DeadLetterStore, DeadLetterTable,
    MAX_DEAD_LETTER_BODY, MAX_DEAD_LETTER_HEADER, MAX_DEAD_LETTER_HEADERS, MAX_DEAD_LETTER_PAGE,
    MAX_DEAD_LETTER_RESPONSE, MAX_DEAD_LETTER_TEXT, MAX_DEAD_LETTER_URL, NewDeadLetter, OutboundRequest,
    Reconciliation, RedriveHold, RedriveOutcome, RowAt, SentUnder, Settlement, Verdict, VerdictSource, clip_body,
    clip_response, clip_text, encode_headers, is_credential, redrive_hold_ms,
};
pub use detached::{Detached, Finish};
pub use error::{BoxError, Error, Result, StoreErrorKind};
pub use fingerprint::canonical;
pub use fingerprint::canonical::{CanonicalError, canonical_json};
pub use fingerprint::{Fingerprint, FingerprintBuilder, FingerprintVersion};
pub use heartbeat::{Heartbeat, HeldLease};
pub use key::{IdempotencyKey, MAX_KEY_LEN};
pub use lease::{Acquire, LeaseEngine, SETTLE_RETRY_WINDOW};
pub use outbox::{
    MAX_OUTBOX_PAYLOAD, MAX_SUBJECT_LEN, OutboxBatch, OutboxEvent, OutboxLag, OutboxMessage, OutboxStore, RetryBackoff,
};
pub use policy::{Consume, InFlight, Policy};
pub use record::{
    Call, ClaimRequest, Lease, Outcome, Record, RecordStatus, Resolution, RowState, STATUS_COMPLETED,
    STATUS_IN_PROGRESS, STATUS_REJECTED, STATUS_SENT, STATUS_UNKNOWN, StoredRow, Token, is_stale,
};
pub use redact::{cut_at_char_boundary, redact_credentials, redact_known, url_passwords};
pub use registry::{KeyRegistry, RegistryGuard, SharedKeyGuard, SharedKeyLock};
pub use scope::{MAX_NAME_LEN, Operation, Scope, Tenant};
pub use store::{BoxFuture, KeyAdmin, LeaseClaim, LeaseStore, ReadFirst, Sweep, SweepBatch, TxBackend, TxClaim};
pub use sweep::{
    DEFAULT_SWEEP_BUSY_PERCENT, KeyFilter, KeyInfo, KeyState, KeyStats, MAX_SWEEP_REST, PendingMigration, SweepOptions,
    SweepReport, sweep_expired,
};
pub use table::TableName;
pub use tx::{Begin, Claimed, REJECT_CLAIM_WAIT, Ticket, TxEngine};
