//! What the transactional and lease engines share: the decision on a found
//! row, contention retries and bounded waiting.

use std::time::Duration;

use tokio::time::Instant;

use crate::classify::Classify;
use crate::error::{Error, Result};
use crate::metrics;
use crate::record::{Call, Record, RecordStatus, RowState, StoredRow, in_flight};

/// How many times a claim is retried after deadlocks or serialisation
/// failures past the policy's deadline before the error is returned.
pub(crate) const MAX_CONTENTION_RETRIES: u32 = 8;

pub(crate) enum Found {
    Replay(Record),
    Wait,
}

/// Decides what a committed row means for `call` at `now_ms`.
pub(crate) fn decide(call: &Call, row: StoredRow, now_ms: i64) -> Result<Found> {
    let op = call.scope().operation();
    if !call.accepts(&row.fingerprint) {
        metrics::count(metrics::MISMATCHES, op);
        return Err(Error::Mismatch);
    }
    if row.is_unknown_at(now_ms) {
        // Recorded as unknown, or sent by a holder whose lease ran out: the
        // request may have reached the other side, so it is never sent again
        // blindly.
        metrics::count(metrics::UNKNOWN_HELD, op);
        return Err(Error::OutcomeUnknown);
    }
    match row.state {
        RowState::Done(record) => Ok(Found::Replay(record)),
        RowState::InProgress { .. } | RowState::Sent { .. } => Ok(Found::Wait),
    }
}

/// Exponential backoff between polls of a busy key: 2 ms doubling to 64 ms,
/// never past the deadline.
pub(crate) struct Backoff {
    next: Duration,
}

impl Backoff {
    pub(crate) fn new() -> Self {
        Self {
            next: Duration::from_millis(2),
        }
    }

    pub(crate) async fn sleep(&mut self, deadline: Option<Instant>) {
        let mut wait = self.next;
        if let Some(deadline) = deadline {
            wait = wait.min(deadline.saturating_duration_since(Instant::now()));
        }
        tokio::time::sleep(wait).await;
        self.next = (self.next * 2).min(Duration::from_millis(64));
    }
}

/// What to do after an attempt that did not settle the call.
pub(crate) enum Retry {
    /// The key is busy: wait if the policy allows, else report in flight.
    Busy,
    /// Contention unrelated to the key's holder: retry a bounded number of times.
    Contention(Error),
}

pub(crate) struct Attempts<'a> {
    call: &'a Call,
    pub(crate) started: Instant,
    pub(crate) deadline: Instant,
    backoff: Backoff,
    contention: u32,
}

impl<'a> Attempts<'a> {
    pub(crate) fn new(call: &'a Call) -> Self {
        let started = Instant::now();
        Self {
            call,
            started,
            deadline: started + call.policy().max_wait(),
            backoff: Backoff::new(),
            contention: 0,
        }
    }

    pub(crate) fn remaining(&self) -> Duration {
        self.deadline.saturating_duration_since(Instant::now())
    }

    /// Sleeps before the next attempt, or fails the call.
    pub(crate) async fn next(&mut self, why: Retry) -> Result<()> {
        match why {
            Retry::Contention(e) => {
                // Deadlocks among twins are expected when a first claimer rolls
                // back (each blocked twin races to insert); they are retried
                // freely until the policy's deadline and a bounded number of
                // times after it.
                if Instant::now() >= self.deadline {
                    self.contention += 1;
                }
                if self.contention > MAX_CONTENTION_RETRIES {
                    return Err(e);
                }
                tracing::debug!(error = %e, attempt = self.contention, "contention while claiming; retrying");
                self.backoff.sleep(None).await;
            }
            Retry::Busy => {
                if Instant::now() >= self.deadline {
                    metrics::count(metrics::IN_FLIGHT, self.call.scope().operation());
                    return Err(in_flight(self.call.policy()));
                }
                self.backoff.sleep(Some(self.deadline)).await;
            }
        }
        Ok(())
    }
}

pub(crate) fn is_contention(e: &Error) -> bool {
    e.store_kind().is_some_and(|k| k.is_contention())
}

/// Encodes a value as a record payload (JSON).
pub(crate) fn encode<T: serde::Serialize>(value: &T, limit: usize) -> Result<Vec<u8>> {
    let bytes = serde_json::to_vec(value).map_err(|e| Error::Encode(e.to_string()))?;
    if bytes.len() > limit {
        return Err(Error::RecordTooLarge {
            size: bytes.len(),
            limit,
        });
    }
    Ok(bytes)
}

/// Decodes a replayed record into the typed outcome.
pub(crate) fn decode<T, R>(record: &Record) -> Result<Result<T, R>>
where
    T: serde::de::DeserializeOwned,
    R: serde::de::DeserializeOwned,
{
    let corrupt = |e: serde_json::Error| Error::Corrupt(e.to_string());
    Ok(match record.status {
        RecordStatus::Completed => Ok(serde_json::from_slice(&record.payload).map_err(corrupt)?),
        RecordStatus::Rejected => Err(serde_json::from_slice(&record.payload).map_err(corrupt)?),
        // Never replayed: a lookup of an unknown outcome fails first.
        RecordStatus::Unknown => return Err(Error::OutcomeUnknown),
    })
}

/// Whether a rejection should be recorded under the policy.
pub(crate) fn records_rejection<R: Classify>(call: &Call, rejection: &R) -> bool {
    call.policy().consume() == crate::policy::Consume::SuccessOrFinalRejection
        && rejection.retryable() == crate::classify::Retryable::Fatal
}
