//! Redrive: dead letters sent again with their own key, capped and paced.

use std::fmt;
use std::time::Duration;

use idem_core::{DeadLetterFilter, DeadLetterStore, MAX_DEAD_LETTER_PAGE, OutboundRequest, RedriveOutcome, Verdict};
use tokio::time::{Interval, MissedTickBehavior};

use crate::client::{Earlier, OutboundClient};
use crate::error::{OutboundError, Result};

/// The most sends per second a redrive may be configured for.
pub const MAX_REDRIVES_PER_SECOND: u32 = 1000;

/// Caps of one [`Redriver::redrive`] run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RedriveOptions {
    /// The most dead letters considered (listed), skipped ones included
    /// (default 100).
    pub max: u32,
    /// The most sends started per second (default 10; 1 to
    /// [`MAX_REDRIVES_PER_SECOND`]). Each send is one logical call, which
    /// may itself retry by the client's schedule.
    pub per_second: u32,
}

impl Default for RedriveOptions {
    fn default() -> Self {
        Self {
            max: 100,
            per_second: 10,
        }
    }
}

/// How the redrive of one dead letter ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RedriveResult {
    /// The vendor answered with success; the dead letter is resolved and
    /// keeps the answer.
    Resolved {
        /// The status.
        status: u16,
        /// Attempts this redrive made.
        attempts: u32,
    },
    /// It failed again (rejected, or retries used up); the dead letter is
    /// dead again with the attempts added and this error.
    Failed {
        /// Attempts this redrive made.
        attempts: u32,
        /// Why.
        error: String,
    },
    /// Whether the vendor applied it cannot be established (past its key
    /// horizon with no way to ask, or the vendor could not say): nothing was
    /// sent, and the letter is held in state `unknown` for an operator.
    Unknown {
        /// Why.
        reason: String,
    },
    /// Not sent: it is resolved, cancelled, or another redrive holds it.
    Skipped,
    /// Not sent, not taken: the letter does not say the terms its sends
    /// were made under (a letter written before they were kept) and the
    /// redriver was told not to guess them (see
    /// [`Redriver::with_terms_required`]).
    Refused {
        /// Why.
        reason: String,
    },
    /// This redrive's hold ran out (another redrive may hold the letter
    /// now): either it was sent and its outcome could not be stored, or it
    /// was stopped before a send. The other redrive's outcome stands.
    HoldLost,
    /// The store failed for this dead letter.
    StoreError(String),
}

/// One dead letter's redrive.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedriveItem {
    /// The dead letter's id.
    pub id: i64,
    /// How it ended.
    pub result: RedriveResult,
}

/// What a [`Redriver::redrive`] run did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RedriveReport {
    /// Dead letters now resolved.
    pub resolved: u32,
    /// Dead letters that failed again.
    pub failed: u32,
    /// Dead letters held as unknown outcomes for an operator.
    pub unknown: u32,
    /// Dead letters not sent (resolved, gone, or held by another redrive).
    pub skipped: u32,
    /// Dead letters not sent because their send terms are not known.
    pub refused: u32,
    /// Store failures and holds lost.
    pub errors: u32,
    /// Each dead letter considered, in id order.
    pub items: Vec<RedriveItem>,
}

impl RedriveReport {
    /// Counts `result` and keeps it as dead letter `id`'s item.
    pub fn add(&mut self, id: i64, result: RedriveResult) {
        match result {
            RedriveResult::Resolved { .. } => self.resolved += 1,
            RedriveResult::Failed { .. } => self.failed += 1,
            RedriveResult::Unknown { .. } => self.unknown += 1,
            RedriveResult::Skipped => self.skipped += 1,
            RedriveResult::Refused { .. } => self.refused += 1,
            RedriveResult::HoldLost | RedriveResult::StoreError(_) => self.errors += 1,
        }
        self.items.push(RedriveItem { id, result });
    }
}

/// Starts at most `per_second` sends per second: consecutive sends are at
/// least `1 s / per_second` apart, however long each takes.
#[derive(Debug)]
pub(crate) struct Pacer {
    interval: Interval,
}

impl Pacer {
    pub(crate) fn new(per_second: u32) -> Result<Self> {
        if !(1..=MAX_REDRIVES_PER_SECOND).contains(&per_second) {
            return Err(OutboundError::InvalidConfig(format!(
                "per_second must be between 1 and {MAX_REDRIVES_PER_SECOND}"
            )));
        }
        let mut interval = tokio::time::interval(Duration::from_secs(1) / per_second);
        // After a slow send, the next one starts at once and the spacing
        // starts over from it: never a burst to catch up.
        interval.set_missed_tick_behavior(MissedTickBehavior::Delay);
        Ok(Self { interval })
    }

    /// Waits for the next send's turn.
    pub(crate) async fn ready(&mut self) {
        self.interval.tick().await;
    }
}

/// Sends dead letters again through an [`OutboundClient`], with the key
/// each was first sent with, and records the outcome in the store.
///
/// Each redrive is a re-send of a call whose earlier sends may have reached
/// the vendor: it goes through [`OutboundClient::resend`] with the letter's
/// first reach, so past the vendor's key horizon (or for a letter held as
/// unknown) the vendor is asked first, and without a reconcile hook the
/// letter is held as unknown rather than sent on a guess.
#[derive(Clone)]
pub struct Redriver<S> {
    client: OutboundClient,
    store: S,
    hold: Duration,
    target: Option<String>,
    past_horizon_override: bool,
    answer_check: Option<AnswerCheck>,
    terms_required: bool,
}

/// What a vendor's 2xx answer to a redrive must hold to count as the call
/// applied (its contract: an id, the amount sent back…): `Err(why)` holds
/// the letter as unknown, for an operator, rather than resolving it with an
/// answer that is not the call's (a default backend's `200 {"error": …}`).
pub type AnswerCheck = std::sync::Arc<dyn Fn(&OutboundRequest, &[u8]) -> std::result::Result<(), String> + Send + Sync>;

impl<S: fmt::Debug> fmt::Debug for Redriver<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Redriver")
            .field("client", &self.client)
            .field("store", &self.store)
            .field("hold", &self.hold)
            .field("target", &self.target)
            .field("past_horizon_override", &self.past_horizon_override)
            .field("answer_check", &self.answer_check.is_some())
            .field("terms_required", &self.terms_required)
            .finish()
    }
}

impl<S: DeadLetterStore> Redriver<S> {
    /// A redriver; each dead letter is held for the client's deadline plus
    /// 30 s while it is sent, so no other redrive takes it meanwhile.
    pub fn new(client: OutboundClient, store: S) -> Self {
        let hold = client.config().deadline.saturating_add(Duration::from_secs(30));
        Self {
            client,
            store,
            hold,
            target: None,
            past_horizon_override: false,
            answer_check: None,
            terms_required: false,
        }
    }

    /// With `required`, a letter that does not say the terms its sends
    /// were made under (its vendor's key horizon and settle time: a letter
    /// written before they were kept) is refused, neither taken nor sent
    /// ([`RedriveResult::Refused`]), instead of judged by this client's
    /// configuration. A process whose configuration is not the sender's
    /// (an operator's `idem dlq redrive` with its defaults) sets it.
    /// Letters that say their terms are always judged by the strictest of
    /// theirs and this client's.
    pub fn with_terms_required(mut self, required: bool) -> Self {
        self.terms_required = required;
        self
    }

    /// Checks every 2xx answer (and every record a reconcile found) with
    /// `check` before a letter is resolved with it; one that fails is held
    /// as unknown (see [`AnswerCheck`]).
    pub fn with_answer_check(mut self, check: AnswerCheck) -> Self {
        self.answer_check = Some(check);
        self
    }

    /// Sends every letter to `url` instead of its stored URL (a target
    /// fixed after the letters were written: a wrong vendor URL), and
    /// stores it in each letter it sends. Refused unless the client would
    /// send to it (see [`OutboundClient::check_target`]).
    pub fn with_target(mut self, url: &str) -> Result<Self> {
        self.client.check_target(url)?;
        self.target = Some(url.to_owned());
        Ok(self)
    }

    /// The operator's override: send letters past the vendor's key horizon
    /// without asking it first (the operator has checked the vendor). A
    /// letter held as unknown is still only sent after the vendor, or an
    /// operator's settlement, says it was not applied.
    pub fn with_past_horizon_override(mut self, past_horizon: bool) -> Self {
        self.past_horizon_override = past_horizon;
        self
    }

    /// Holds each dead letter this long while it is sent (keep it above the
    /// client's deadline).
    pub fn with_hold(mut self, hold: Duration) -> Self {
        self.hold = hold;
        self
    }

    /// The store.
    pub fn store(&self) -> &S {
        &self.store
    }

    /// Redrives the dead letters `filter` lists, oldest first: at most
    /// `options.max` considered, sends paced at `options.per_second`, one at
    /// a time. Fails only when listing fails (nothing after it is tried);
    /// a store failure on one dead letter is in the report.
    pub async fn redrive(&self, filter: &DeadLetterFilter, options: RedriveOptions) -> Result<RedriveReport> {
        let mut pacer = Pacer::new(options.per_second)?;
        let mut report = RedriveReport::default();
        let mut page = filter.clone();
        let page_size = filter.limit.clamp(1, MAX_DEAD_LETTER_PAGE);
        let mut considered = 0u32;
        while considered < options.max {
            page.limit = page_size.min(options.max - considered);
            let letters = self.store.list(&page).await?;
            let Some(last) = letters.last() else { break };
            page.after_id = Some(last.id);
            let full = letters.len() as u32 == page.limit;
            for letter in letters {
                considered += 1;
                let result = match self.redrive_paced(letter.id, Some(&mut pacer)).await {
                    Ok(result) => result,
                    Err(e) => RedriveResult::StoreError(e.to_string()),
                };
                report.add(letter.id, result);
            }
            if !full {
                break;
            }
        }
        tracing::info!(
            resolved = report.resolved,
            failed = report.failed,
            skipped = report.skipped,
            errors = report.errors,
            "redrive finished"
        );
        Ok(report)
    }

    /// Redrives one dead letter now.
    pub async fn redrive_one(&self, id: i64) -> Result<RedriveResult> {
        self.redrive_paced(id, None).await
    }

    async fn redrive_paced(&self, id: i64, pacer: Option<&mut Pacer>) -> Result<RedriveResult> {
        let labels = self.client.labels();
        let hold_ms = i64::try_from(self.hold.as_millis()).unwrap_or(i64::MAX);
        if self.terms_required
            && let Some(letter) = self.store.get(id).await?
            && letter.sent_under.is_none()
            && !letter.state.is_final()
        {
            labels.redrive("refused");
            return Ok(RedriveResult::Refused {
                reason: format!(
                    "dead letter {id} does not say the vendor's key horizon or settle time its sends were made \
                     under (it was written before they were kept): give them (--key-horizon-secs, \
                     --settle-secs) rather than have them guessed"
                ),
            });
        }
        // Taken before the hold is asked for: the hold lasts at least until
        // then plus its length.
        let taken_at_ms = self.client.clock().now_ms();
        let Some(hold) = self.store.begin_redrive(id, hold_ms).await? else {
            labels.redrive("skipped");
            return Ok(RedriveResult::Skipped);
        };
        if let Some(pacer) = pacer {
            pacer.ready().await;
        }
        let letter = &hold.dead_letter;
        let mut request = letter.request.clone();
        if let Some(url) = &self.target {
            request = request.with_url(url.as_str())?;
            if !self.store.retarget(id, hold.token, url).await? {
                labels.redrive("error");
                return Ok(RedriveResult::HoldLost);
            }
        }
        let held_unknown = letter
            .reconciliation
            .as_ref()
            .is_some_and(|r| r.verdict == Verdict::Unknown);
        let earlier = Earlier {
            first_reached_at_ms: letter.first_reached_at_ms,
            must_reconcile: held_unknown,
            // An outcome held as unknown is never sent on the operator's
            // horizon override: only a verdict releases it.
            past_horizon_override: self.past_horizon_override && !held_unknown,
            // A redrive whose hold ran out may have sent until its hold's end.
            last_sent_at_ms: hold.earlier_hold_until_ms,
            sent_under: letter.sent_under,
        };
        let span = tracing::info_span!("redrive", id, key = %letter.key, scope = %letter.scope);
        // Right before each send the hold must still be this redrive's for
        // a while: a redrive stopped past its hold (a paused process) whose
        // letter another redrive has since taken, asked about and sent must
        // not send it again when it wakes up.
        let held_until_ms = taken_at_ms.saturating_add(hold_ms);
        let margin_ms = (hold_ms / 3).min(10_000);
        let clock = self.client.clock().clone();
        let may_send = move || {
            let now = clock.now_ms();
            if now.saturating_add(margin_ms) < held_until_ms {
                Ok(())
            } else {
                Err(format!(
                    "the redrive's hold on dead letter {id} ran out ({} ms ago or less than {margin_ms} ms left)",
                    now.saturating_sub(held_until_ms).max(0)
                ))
            }
        };
        let sent = tracing::Instrument::instrument(
            self.client.resend_while(&letter.key, &request, earlier, &may_send),
            span,
        )
        .await;
        let checked = match (&sent, &self.answer_check) {
            (Ok(response), Some(check)) => check(&request, &response.body)
                .err()
                .map(|why| (response.attempts, why)),
            _ => None,
        };
        let (result, outcome) = match sent {
            Ok(_) if let Some((attempts, why)) = checked => {
                let reason = format!("the vendor's answer does not hold what its contract promises: {why}");
                (
                    RedriveResult::Unknown { reason: reason.clone() },
                    RedriveOutcome::Unknown {
                        attempts,
                        reason,
                        // It answered: the send reached it.
                        first_reached_at_ms: Some(letter.first_reached_at_ms.unwrap_or(taken_at_ms).min(taken_at_ms)),
                    },
                )
            }
            Ok(response) => (
                RedriveResult::Resolved {
                    status: response.status,
                    attempts: response.attempts,
                },
                RedriveOutcome::Resolved {
                    status: response.status,
                    body: response.body,
                    reconciled: response.reconciled,
                },
            ),
            Err(OutboundError::Stopped { reason, .. }) => {
                // The letter is another redrive's now: leave its row alone.
                labels.redrive("error");
                tracing::warn!(id, reason, "the redrive's hold ran out before a send; nothing sent");
                return Ok(RedriveResult::HoldLost);
            }
            Err(OutboundError::Unknown {
                attempts,
                reason,
                first_reached_at_ms,
                ..
            }) => (
                RedriveResult::Unknown { reason: reason.clone() },
                RedriveOutcome::Unknown {
                    attempts,
                    reason,
                    first_reached_at_ms,
                },
            ),
            Err(e) => {
                let attempts = e.attempts();
                let first_reached_at_ms = e.first_reached_at_ms();
                let (error, not_applied_at_ms) = match e {
                    OutboundError::Exhausted {
                        last_error,
                        not_applied_at_ms,
                        ..
                    } => (last_error, not_applied_at_ms),
                    other => (other.to_string(), None),
                };
                (
                    RedriveResult::Failed {
                        attempts,
                        error: error.clone(),
                    },
                    RedriveOutcome::Failed {
                        attempts,
                        error,
                        first_reached_at_ms,
                        not_applied_at_ms,
                    },
                )
            }
        };
        if !self.store.finish_redrive(id, hold.token, &outcome).await? {
            labels.redrive("error");
            tracing::warn!(id, "the redrive's hold was lost before its outcome was stored");
            return Ok(RedriveResult::HoldLost);
        }
        labels.redrive(match result {
            RedriveResult::Resolved { .. } => "resolved",
            RedriveResult::Unknown { .. } => "unknown",
            _ => "failed",
        });
        Ok(result)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::time::Instant;

    /// No window of one second holds more than `per_second` sends.
    #[tokio::test(start_paused = true)]
    async fn the_pacer_keeps_to_its_rate() {
        let mut pacer = Pacer::new(5).unwrap();
        let start = Instant::now();
        let mut at = Vec::new();
        for i in 0..20 {
            pacer.ready().await;
            at.push(Instant::now() - start);
            // A slow send now and then must not let a burst through after.
            if i % 7 == 3 {
                tokio::time::sleep(Duration::from_millis(900)).await;
            }
        }
        assert_eq!(at[0], Duration::ZERO);
        for pair in at.windows(2) {
            assert!(pair[1] - pair[0] >= Duration::from_millis(200), "{at:?}");
        }
        for w in at.windows(6) {
            assert!(w[5] - w[0] >= Duration::from_secs(1), "{at:?}");
        }
        assert!(Pacer::new(0).is_err());
        assert!(Pacer::new(MAX_REDRIVES_PER_SECOND + 1).is_err());
    }
}
