//! How an outbound call fails.

use idem_core::{IdempotencyKey, NewDeadLetter, OutboundRequest, Scope, SentUnder};

/// The result of this crate's operations.
pub type Result<T, E = OutboundError> = std::result::Result<T, E>;

/// Why a logical call (or a redrive) did not succeed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OutboundError {
    /// The vendor answered with a final status (a 3xx, or a 4xx other than
    /// 408, 425, 429 and an in-flight 409): sending it again would get the
    /// same answer, so it was not retried.
    #[error("rejected with HTTP {status} after {attempts} attempt(s): {}", snippet(.body))]
    Rejected {
        /// The status.
        status: u16,
        /// The body, at most the configured `max_response_body` bytes.
        body: Vec<u8>,
        /// Attempts made (the last one answered).
        attempts: u32,
        /// When the first send that may have reached the vendor started.
        first_reached_at_ms: Option<i64>,
    },
    /// The retries or the deadline were used up without a final answer; the
    /// caller keeps the call as a dead letter (see
    /// [`dead_letter`](Self::dead_letter)).
    #[error("gave up after {attempts} attempt(s): {last_error}")]
    Exhausted {
        /// Attempts made, including those the circuit breaker refused.
        attempts: u32,
        /// What the last one got, and why no further one was made.
        last_error: String,
        /// When the first send that may have reached the vendor started
        /// (`None`: none can have; a redrive may send it blindly).
        first_reached_at_ms: Option<i64>,
        /// When the vendor said it had not applied the call, if it was
        /// asked and no send reached it after.
        not_applied_at_ms: Option<i64>,
        /// The terms its sends were made under (kept with its dead letter).
        sent_under: Option<SentUnder>,
    },
    /// The call is for later than the deadline allows: the vendor asked
    /// (`Retry-After` on a 429 or 503: nothing was applied by that answer),
    /// or the host's circuit breaker refused it (nothing sent): call again
    /// at `after` from now (a worker defers the call, rather than
    /// dead-letter it).
    #[error("to be called again in {} s, past the deadline, after {attempts} attempt(s): {last_error}", .after.as_secs())]
    RetryLater {
        /// How long the vendor asked to wait.
        after: std::time::Duration,
        /// Attempts made.
        attempts: u32,
        /// What the last one got.
        last_error: String,
        /// As in [`Exhausted`](Self::Exhausted).
        first_reached_at_ms: Option<i64>,
        /// As in [`Exhausted`](Self::Exhausted).
        sent_under: Option<SentUnder>,
    },
    /// Whether the vendor applied the call cannot be established, and it is
    /// not sent on a guess: a send that may have reached the vendor is past
    /// its key horizon (or the vendor has no keys) and there is no reconcile
    /// hook, or the vendor could not say. Keep it as an unknown outcome for
    /// an operator.
    #[error("outcome unknown after {attempts} attempt(s), not sent again: {reason}")]
    Unknown {
        /// Attempts made.
        attempts: u32,
        /// Why it cannot be established.
        reason: String,
        /// When the first send that may have reached the vendor started.
        first_reached_at_ms: Option<i64>,
        /// As in [`Exhausted`](Self::Exhausted).
        sent_under: Option<SentUnder>,
    },
    /// The caller's guard stopped the call before a send (the caller no
    /// longer holds the right to send: a lease lost or run out). Nothing was
    /// sent after the guard said no; whoever holds the call now carries on.
    /// Not a dead letter.
    #[error("stopped before a send after {attempts} attempt(s): {reason}")]
    Stopped {
        /// Attempts made before the guard said no.
        attempts: u32,
        /// What the guard said.
        reason: String,
        /// When the first send that may have reached the vendor started.
        first_reached_at_ms: Option<i64>,
    },
    /// The request cannot be sent as given (nothing was sent).
    #[error("invalid outbound request: {0}")]
    Invalid(String),
    /// The client's configuration is refused.
    #[error("invalid outbound configuration: {0}")]
    InvalidConfig(String),
    /// The dead-letter store failed (redrives).
    #[error("dead-letter store: {0}")]
    Store(#[from] idem_core::Error),
}

impl OutboundError {
    /// The attempts the call made (0 when nothing was tried).
    pub fn attempts(&self) -> u32 {
        match self {
            Self::Rejected { attempts, .. }
            | Self::Exhausted { attempts, .. }
            | Self::RetryLater { attempts, .. }
            | Self::Unknown { attempts, .. }
            | Self::Stopped { attempts, .. } => *attempts,
            Self::Invalid(_) | Self::InvalidConfig(_) | Self::Store(_) => 0,
        }
    }

    /// When the first send that may have reached the vendor started, as the
    /// call leaves it.
    pub fn first_reached_at_ms(&self) -> Option<i64> {
        match self {
            Self::Rejected {
                first_reached_at_ms, ..
            }
            | Self::Exhausted {
                first_reached_at_ms, ..
            }
            | Self::RetryLater {
                first_reached_at_ms, ..
            }
            | Self::Unknown {
                first_reached_at_ms, ..
            }
            | Self::Stopped {
                first_reached_at_ms, ..
            } => *first_reached_at_ms,
            Self::Invalid(_) | Self::InvalidConfig(_) | Self::Store(_) => None,
        }
    }

    /// The terms the call's sends were made under (the target's key
    /// horizon and settle time, made strict by any a redrive's letter
    /// carried), for the errors that keep a dead letter.
    pub fn sent_under(&self) -> Option<SentUnder> {
        match self {
            Self::Exhausted { sent_under, .. }
            | Self::RetryLater { sent_under, .. }
            | Self::Unknown { sent_under, .. } => *sent_under,
            _ => None,
        }
    }

    /// The same error, saying the call was sent under `terms`.
    pub(crate) fn sent_under_terms(mut self, terms: SentUnder) -> Self {
        if let Self::Exhausted { sent_under, .. }
        | Self::RetryLater { sent_under, .. }
        | Self::Unknown { sent_under, .. } = &mut self
        {
            *sent_under = Some(terms);
        }
        self
    }

    /// The dead letter to keep for a call that gave up
    /// ([`Exhausted`](Self::Exhausted), [`RetryLater`](Self::RetryLater)) or
    /// whose outcome is unknown (kept in state `unknown`), to be redriven or
    /// settled later with the same key, under the terms its sends were made
    /// under ([`sent_under`](Self::sent_under)); `None` for any other error
    /// (a rejection will not change by sending it again).
    pub fn dead_letter(&self, scope: &Scope, key: &IdempotencyKey, request: &OutboundRequest) -> Option<NewDeadLetter> {
        let letter = |error: &str| {
            let letter = NewDeadLetter::new(scope.clone(), key.clone(), request.clone(), self.attempts(), error)
                .reached_at(self.first_reached_at_ms());
            match self.sent_under() {
                Some(terms) => letter.sent_under(terms),
                None => letter,
            }
        };
        match self {
            Self::Exhausted { last_error, .. } => Some(letter(idem_core::clip_text(last_error))),
            Self::RetryLater { .. } => Some(letter(idem_core::clip_text(&self.to_string()))),
            Self::Unknown { reason, .. } => Some(letter(idem_core::clip_text(reason)).outcome_unknown()),
            _ => None,
        }
    }
}

/// The start of a body as text, for messages.
pub(crate) fn snippet(body: &[u8]) -> String {
    const MAX: usize = 256;
    let text = String::from_utf8_lossy(&body[..body.len().min(MAX)]);
    let text: String = text.chars().map(|c| if c.is_control() { ' ' } else { c }).collect();
    if body.len() > MAX {
        format!("{}…", text.trim_end())
    } else if text.trim().is_empty() {
        "(empty body)".into()
    } else {
        text.trim_end().to_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_say_what_happened() {
        let e = OutboundError::Rejected {
            status: 422,
            body: br#"{"error":"reused"}"#.to_vec(),
            attempts: 1,
            first_reached_at_ms: Some(1),
        };
        assert_eq!(
            e.to_string(),
            r#"rejected with HTTP 422 after 1 attempt(s): {"error":"reused"}"#
        );
        assert_eq!(e.attempts(), 1);
        let e = OutboundError::Exhausted {
            attempts: 5,
            last_error: "HTTP 503".into(),
            first_reached_at_ms: None,
            not_applied_at_ms: None,
            sent_under: None,
        };
        assert_eq!(e.to_string(), "gave up after 5 attempt(s): HTTP 503");
        assert_eq!(e.attempts(), 5);
        assert_eq!(OutboundError::Invalid("x".into()).attempts(), 0);
        assert_eq!(snippet(&[b'a'; 300]).chars().count(), 257);
        assert_eq!(snippet(b""), "(empty body)");
        assert_eq!(snippet(b"a\nb"), "a b");
    }

    #[test]
    fn only_exhausted_calls_become_dead_letters() {
        let scope = Scope::parse("acme", "payout").unwrap();
        let key = IdempotencyKey::new("k").unwrap();
        let request = OutboundRequest::new("POST", "http://v/", vec![], vec![]).unwrap();
        let terms = idem_core::SentUnder {
            key_horizon: std::time::Duration::ZERO,
            horizon_margin: std::time::Duration::ZERO,
            settle: std::time::Duration::from_secs(35),
        };
        let exhausted = OutboundError::Exhausted {
            attempts: 5,
            last_error: "x".repeat(10_000),
            first_reached_at_ms: Some(77),
            not_applied_at_ms: None,
            sent_under: None,
        }
        .sent_under_terms(terms);
        let letter = exhausted.dead_letter(&scope, &key, &request).unwrap();
        assert_eq!(letter.sent_under, Some(terms), "the terms travel with the letter");
        assert_eq!(letter.attempts, 5);
        assert_eq!(letter.last_error.len(), idem_core::MAX_DEAD_LETTER_TEXT);
        assert_eq!(letter.first_reached_at_ms, Some(77));
        assert!(!letter.unknown);
        let unknown = OutboundError::Unknown {
            attempts: 1,
            reason: "no reconcile hook".into(),
            first_reached_at_ms: Some(5),
            sent_under: Some(terms),
        };
        assert!(unknown.dead_letter(&scope, &key, &request).unwrap().unknown);
        let rejected = OutboundError::Rejected {
            status: 400,
            body: vec![],
            attempts: 1,
            first_reached_at_ms: None,
        };
        assert!(rejected.dead_letter(&scope, &key, &request).is_none());
    }
}
