//! The transactional outbox's vocabulary and the trait its stores implement.
//!
//! An event is enqueued inside the business transaction (each store crate
//! has an `Outbox` with an `enqueue` that takes the open transaction), so it
//! exists if and only if that transaction committed. A relay (the
//! `idem-outbox` crate) takes unsent rows through [`OutboxStore`], publishes
//! them and marks them sent. Stores never track a high-water mark: every
//! unsent row is eligible on every pass, so a row whose transaction commits
//! after later rows is still published.

use crate::error::{Error, Result};
use crate::key::IdempotencyKey;
use crate::store::BoxFuture;

/// The largest payload an outbox event may carry: NATS's default
/// `max_payload` (1 MiB) less 8 KiB for the headers the relay and a
/// dead-letter copy add.
pub const MAX_OUTBOX_PAYLOAD: usize = 1024 * 1024 - 8 * 1024;

/// The longest subject accepted, in bytes.
pub const MAX_SUBJECT_LEN: usize = 255;

/// An event to publish once its transaction commits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboxEvent {
    id: IdempotencyKey,
    subject: String,
    payload: Vec<u8>,
}

impl OutboxEvent {
    /// An event with a fresh UUIDv7 id.
    ///
    /// ```
    /// use idem_core::OutboxEvent;
    /// let e = OutboxEvent::new("ledger.events.top_up", br#"{"amount":5}"#.to_vec())?;
    /// assert_eq!(e.subject(), "ledger.events.top_up");
    /// assert!(OutboxEvent::new("bad subject", vec![]).is_err());
    /// assert!(OutboxEvent::new("ledger.*", vec![]).is_err());
    /// # Ok::<(), idem_core::Error>(())
    /// ```
    pub fn new(subject: impl Into<String>, payload: Vec<u8>) -> Result<Self> {
        Self::with_id(IdempotencyKey::generate(), subject, payload)
    }

    /// An event with the caller's id. The id is the broker's deduplication
    /// id (`Nats-Msg-Id`) and the consumers' inbox key: one id, one event.
    pub fn with_id(id: IdempotencyKey, subject: impl Into<String>, payload: Vec<u8>) -> Result<Self> {
        // Header values lose surrounding spaces in transit: " a" and "a"
        // would be one inbox key on the consumer's side.
        if id.as_str().trim() != id.as_str() {
            return Err(Error::InvalidKey(format!(
                "event id {:?} has leading or trailing spaces",
                id.as_str()
            )));
        }
        let subject = subject.into();
        validate_subject(&subject)?;
        if payload.len() > MAX_OUTBOX_PAYLOAD {
            return Err(Error::InvalidRequest(format!(
                "outbox payload of {} bytes exceeds {MAX_OUTBOX_PAYLOAD}",
                payload.len()
            )));
        }
        Ok(Self { id, subject, payload })
    }

    /// The event id.
    pub fn id(&self) -> &str {
        self.id.as_str()
    }

    /// The subject it is published to.
    pub fn subject(&self) -> &str {
        &self.subject
    }

    /// The payload's bytes.
    pub fn payload(&self) -> &[u8] {
        &self.payload
    }
}

/// A NATS subject to publish to: dot-separated tokens of printable ASCII
/// without spaces or wildcards.
fn validate_subject(subject: &str) -> Result<()> {
    let bad = |why: &str| Err(Error::InvalidRequest(format!("invalid subject {subject:?}: {why}")));
    if subject.is_empty() || subject.len() > MAX_SUBJECT_LEN {
        return bad(&format!("must be 1 to {MAX_SUBJECT_LEN} bytes"));
    }
    for token in subject.split('.') {
        if token.is_empty() {
            return bad("empty token");
        }
        if token == "*" || token == ">" {
            return bad("wildcards cannot be published to");
        }
        if token.chars().any(|c| !('!'..='~').contains(&c)) {
            return bad("only printable ASCII without spaces");
        }
    }
    Ok(())
}

/// One unsent row, as a relay sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboxMessage {
    /// The row's position (assigned at insert; not the commit order).
    pub seq: i64,
    /// The event id.
    pub id: String,
    /// The subject.
    pub subject: String,
    /// The payload.
    pub payload: Vec<u8>,
    /// When it was enqueued, on the database's clock (ms since the epoch).
    pub created_at_ms: i64,
    /// Publishes attempted before that the broker did not confirm.
    pub attempts: i32,
}

/// When a row the broker did not confirm is tried again: after
/// `min(max_ms, min_ms × 2^attempts)`, so a row that keeps failing (a
/// subject no stream captures) never holds up the rows behind it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryBackoff {
    /// The first pause, in ms.
    pub min_ms: i64,
    /// The longest pause, in ms.
    pub max_ms: i64,
}

impl Default for RetryBackoff {
    fn default() -> Self {
        Self {
            min_ms: 100,
            max_ms: 60_000,
        }
    }
}

/// How far the relays are behind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct OutboxLag {
    /// Rows committed and not yet marked sent.
    pub unsent: u64,
    /// The age of the oldest of them, on the database's clock.
    pub oldest_unsent_age_ms: Option<i64>,
}

/// A store of outbox rows, seen from a relay.
pub trait OutboxStore: Clone + Send + Sync + 'static {
    /// Rows taken by one relay.
    type Batch: OutboxBatch;

    /// Takes up to `limit` committed unsent rows, oldest first, that no
    /// other relay holds and whose retry time has come. The batch holds them until it is finished or
    /// dropped (or, on stores that lease rows, until the lease runs out).
    fn take(&self, limit: usize) -> BoxFuture<'_, Result<Self::Batch>>;

    /// The number and age of unsent rows.
    fn lag(&self) -> BoxFuture<'_, Result<OutboxLag>>;

    /// Deletes at most `limit` rows sent more than `older_than_ms` ago;
    /// answers how many.
    fn purge_sent(&self, older_than_ms: i64, limit: u32) -> BoxFuture<'_, Result<u64>>;
}

/// Rows one relay holds.
pub trait OutboxBatch: Send + 'static {
    /// The rows, oldest first.
    fn messages(&self) -> &[OutboxMessage];

    /// Marks the rows whose `seq` is in `sent` as sent; the rest of the
    /// batch counts one more failed attempt each and is taken again after
    /// its `backoff`.
    fn finish(self, sent: Vec<i64>, backoff: RetryBackoff) -> BoxFuture<'static, Result<()>>;
}
