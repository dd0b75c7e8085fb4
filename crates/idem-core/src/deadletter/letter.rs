//! A dead letter and its transitions: pure functions of the row and the
//! store's clock, the same decisions on every engine.

use std::time::Duration;

use super::*;

/// What is known of whether the vendor applied a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Verdict {
    /// The vendor applied it (its answer is kept with the letter).
    Applied,
    /// The vendor did not apply it, as of the verdict's time.
    NotApplied,
    /// It cannot be established (the vendor cannot say, or there is no way
    /// to ask it).
    Unknown,
}

impl Verdict {
    /// `applied`, `not_applied` or `unknown`, as stored.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Applied => "applied",
            Self::NotApplied => "not_applied",
            Self::Unknown => "unknown",
        }
    }

    /// Parses [`as_str`](Self::as_str)'s form.
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "applied" => Ok(Self::Applied),
            "not_applied" => Ok(Self::NotApplied),
            "unknown" => Ok(Self::Unknown),
            other => Err(Error::InvalidRequest(format!(
                "unknown verdict {other:?} (applied, not_applied, unknown)"
            ))),
        }
    }
}

/// Who gave a verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum VerdictSource {
    /// The vendor, asked through a reconcile hook.
    Vendor,
    /// An operator (`idem dlq resolve`), from what the vendor says elsewhere.
    Operator,
    /// The sender itself: no reconcile hook, or an answer it cannot trust.
    Sender,
}

impl VerdictSource {
    /// `vendor`, `operator` or `sender`, as stored.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Vendor => "vendor",
            Self::Operator => "operator",
            Self::Sender => "sender",
        }
    }

    /// Parses [`as_str`](Self::as_str)'s form.
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "vendor" => Ok(Self::Vendor),
            "operator" => Ok(Self::Operator),
            "sender" => Ok(Self::Sender),
            other => Err(Error::InvalidRequest(format!(
                "unknown verdict source {other:?} (vendor, operator, sender)"
            ))),
        }
    }
}

/// The last verdict on a dead letter's call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reconciliation {
    /// What was said.
    pub verdict: Verdict,
    /// By whom.
    pub by: VerdictSource,
    /// When (ms since the epoch).
    pub at_ms: i64,
    /// Why, or what the operator noted (clipped to
    /// [`MAX_DEAD_LETTER_TEXT`]).
    pub note: String,
}

/// A logical call to keep as a dead letter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewDeadLetter {
    /// Who made the call and what it was (tenant, operation).
    pub scope: Scope,
    /// The idempotency key every send of this call carries.
    pub key: IdempotencyKey,
    /// The request.
    pub request: OutboundRequest,
    /// Sends tried so far.
    pub attempts: u32,
    /// Why the last one failed (clipped to [`MAX_DEAD_LETTER_TEXT`] when
    /// stored).
    pub last_error: String,
    /// When the first send that may have reached the vendor started (ms,
    /// the sender's clock); `None` when none can have (every attempt was
    /// refused before it was sent).
    pub first_reached_at_ms: Option<i64>,
    /// Whether its outcome is unknown and it must be held for an operator
    /// (state [`Unknown`](DeadLetterState::Unknown)) rather than be
    /// redriven.
    pub unknown: bool,
    /// The terms its sends were made under (the vendor's key horizon and
    /// the settle time), kept so a redrive judges them by the same facts;
    /// `None` when the sender did not say.
    pub sent_under: Option<SentUnder>,
}

/// The terms a call's sends were made under, kept with its dead letter: a
/// redrive run by another process (an operator's `idem dlq redrive`, with
/// its own defaults) judges the earlier sends by the facts they were sent
/// under, never by a guess.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SentUnder {
    /// How long the vendor remembers an idempotency key; zero when it has
    /// none (a send after one that may have reached it is never blind).
    pub key_horizon: Duration,
    /// Kept from the horizon: a send is blind only while the first one
    /// that may have reached the vendor is younger than the horizon minus
    /// this margin.
    pub horizon_margin: Duration,
    /// How long after a send started the vendor's "not applied" is
    /// trusted (its attempt timeout plus the time a request can take to
    /// arrive).
    pub settle: Duration,
}

impl SentUnder {
    /// The terms that are safe under both `self` and `other`: the shorter
    /// horizon, the longer margin, the longer settle time.
    pub fn strictest(self, other: Self) -> Self {
        Self {
            key_horizon: self.key_horizon.min(other.key_horizon),
            horizon_margin: self.horizon_margin.max(other.horizon_margin),
            settle: self.settle.max(other.settle),
        }
    }

    pub(crate) fn millis(d: Duration) -> i64 {
        i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
    }
}

impl NewDeadLetter {
    /// A dead letter of a call that gave up, no send of which reached the
    /// vendor (see [`reached_at`](Self::reached_at)).
    pub fn new(
        scope: Scope,
        key: IdempotencyKey,
        request: OutboundRequest,
        attempts: u32,
        last_error: impl Into<String>,
    ) -> Self {
        Self {
            scope,
            key,
            request,
            attempts,
            last_error: last_error.into(),
            first_reached_at_ms: None,
            unknown: false,
            sent_under: None,
        }
    }

    /// Its sends were made under `terms` (see [`SentUnder`]).
    pub fn sent_under(mut self, terms: SentUnder) -> Self {
        self.sent_under = Some(terms);
        self
    }

    /// The first send that may have reached the vendor started at
    /// `first_reached_at_ms`.
    pub fn reached_at(mut self, first_reached_at_ms: Option<i64>) -> Self {
        self.first_reached_at_ms = first_reached_at_ms;
        self
    }

    /// Its outcome is unknown: hold it for an operator.
    pub fn outcome_unknown(mut self) -> Self {
        self.unknown = true;
        self
    }
}

/// Where a dead letter stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DeadLetterState {
    /// Waiting for an operator (or a policy) to redrive it.
    Dead,
    /// Being sent again; the redriver holds it until its lease runs out.
    Redriving,
    /// The vendor applied it: a redrive got a success answer, the vendor
    /// said so when asked, or an operator recorded it. The answer is kept.
    Resolved,
    /// Whether the vendor applied it cannot be established: held for an
    /// operator, never sent again on a guess (a redrive only asks the
    /// vendor, when it can).
    Unknown,
    /// Given up for good after the vendor was found not to have applied it
    /// (the business side reversed it); never sent again.
    Cancelled,
}

impl DeadLetterState {
    /// `dead`, `redriving`, `resolved`, `unknown` or `cancelled`, as stored.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Dead => "dead",
            Self::Redriving => "redriving",
            Self::Resolved => "resolved",
            Self::Unknown => "unknown",
            Self::Cancelled => "cancelled",
        }
    }

    /// Parses [`as_str`](Self::as_str)'s form.
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "dead" => Ok(Self::Dead),
            "redriving" => Ok(Self::Redriving),
            "resolved" => Ok(Self::Resolved),
            "unknown" => Ok(Self::Unknown),
            "cancelled" => Ok(Self::Cancelled),
            other => Err(Error::InvalidRequest(format!(
                "unknown dead-letter state {other:?} (dead, redriving, resolved, unknown, cancelled)"
            ))),
        }
    }

    /// Whether nothing will change it any more (resolved or cancelled).
    pub fn is_final(self) -> bool {
        matches!(self, Self::Resolved | Self::Cancelled)
    }
}

/// A stored dead letter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeadLetter {
    /// The row's id.
    pub id: i64,
    /// The call's scope.
    pub scope: Scope,
    /// The call's idempotency key.
    pub key: IdempotencyKey,
    /// The request.
    pub request: OutboundRequest,
    /// Sends tried, redrives included.
    pub attempts: u32,
    /// Why the last send failed.
    pub last_error: String,
    /// Where it stands.
    pub state: DeadLetterState,
    /// Redrives started.
    pub redrives: u32,
    /// When it was first recorded (ms since the epoch, the store's clock).
    pub created_at_ms: i64,
    /// When it last changed.
    pub updated_at_ms: i64,
    /// Until when a redrive holds it (state `redriving`).
    pub redrive_until_ms: Option<i64>,
    /// The success status the vendor answered (state `resolved`).
    pub response_status: Option<u16>,
    /// The success body the vendor answered, up to
    /// [`MAX_DEAD_LETTER_RESPONSE`] bytes.
    pub response_body: Option<Vec<u8>>,
    /// When the first send that may have reached the vendor started, since
    /// the vendor was last found not to have applied it (`None`: no send
    /// can have reached it since).
    pub first_reached_at_ms: Option<i64>,
    /// The last verdict on the call, if any.
    pub reconciliation: Option<Reconciliation>,
    /// The terms its sends were made under (`None`: a letter written
    /// before they were kept, or by a sender that did not say).
    pub sent_under: Option<SentUnder>,
}

/// How a redrive ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RedriveOutcome {
    /// The vendor applied it: a send got a success answer, or (with
    /// `reconciled`) the vendor said so when asked, and nothing was sent.
    /// The letter is resolved and keeps the answer.
    Resolved {
        /// The status.
        status: u16,
        /// The body (clipped to [`MAX_DEAD_LETTER_RESPONSE`] when stored).
        body: Vec<u8>,
        /// Whether the answer came from asking the vendor (no send).
        reconciled: bool,
    },
    /// It failed again: the letter is dead again, with the attempts added
    /// and the new error.
    Failed {
        /// Sends this redrive tried.
        attempts: u32,
        /// Why the last one failed.
        error: String,
        /// When the first send that may have reached the vendor started,
        /// as the redrive leaves it: it replaces the letter's.
        first_reached_at_ms: Option<i64>,
        /// When the vendor said it had not applied the call, if this
        /// redrive asked and no send reached it after.
        not_applied_at_ms: Option<i64>,
    },
    /// Whether the vendor applied it cannot be established: the letter is
    /// held in state `unknown` for an operator.
    Unknown {
        /// Sends this redrive tried.
        attempts: u32,
        /// Why it cannot be established.
        reason: String,
        /// As in [`Failed`](Self::Failed).
        first_reached_at_ms: Option<i64>,
    },
}

/// What an operator (or the vendor, asked without a send) says about a
/// letter's call: [`DeadLetterStore::settle`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settlement {
    /// Applied (the letter is resolved with `status` and `body`), not
    /// applied (it is dead, and may be redriven or cancelled), or unknown
    /// (it is held).
    pub verdict: Verdict,
    /// Who says so.
    pub by: VerdictSource,
    /// The vendor's success status, with `Applied` (200 if none).
    pub status: Option<u16>,
    /// The vendor's answer, with `Applied` (empty if none).
    pub body: Vec<u8>,
    /// Why, or where it was checked.
    pub note: String,
}

impl DeadLetter {
    /// The row a first record of `new` creates (its `id` is the store's to
    /// set).
    pub fn created(new: &NewDeadLetter, now_ms: i64) -> Self {
        let mut letter = Self {
            id: 0,
            scope: new.scope.clone(),
            key: new.key.clone(),
            request: new.request.clone(),
            attempts: new.attempts,
            last_error: clip_text(&new.last_error).to_owned(),
            state: DeadLetterState::Dead,
            redrives: 0,
            created_at_ms: now_ms,
            updated_at_ms: now_ms,
            redrive_until_ms: None,
            response_status: None,
            response_body: None,
            first_reached_at_ms: new.first_reached_at_ms,
            reconciliation: None,
            sent_under: new.sent_under,
        };
        if new.unknown {
            letter.hold_unknown(now_ms);
        }
        letter
    }

    /// Recording the same call again: attempts added, the error replaced,
    /// the earliest send that may have reached kept. A final letter
    /// (resolved, cancelled) is left as it is: its call is settled. A letter
    /// being redriven keeps its state and its hold (the redrive decides
    /// how it ends). A dead letter recorded as unknown becomes unknown; an
    /// unknown one stays unknown. Answers whether it changed.
    pub fn on_record(&mut self, new: &NewDeadLetter, now_ms: i64) -> bool {
        if self.state.is_final() {
            return false;
        }
        self.attempts = self.attempts.saturating_add(new.attempts);
        self.last_error = clip_text(&new.last_error).to_owned();
        self.first_reached_at_ms = earliest(self.first_reached_at_ms, new.first_reached_at_ms);
        // Sends under other terms (a changed setting): the letter keeps
        // the terms that are safe for all of them.
        self.sent_under = match (self.sent_under, new.sent_under) {
            (Some(a), Some(b)) => Some(a.strictest(b)),
            (a, b) => a.or(b),
        };
        if new.unknown && self.state == DeadLetterState::Dead {
            self.hold_unknown(now_ms);
        }
        self.updated_at_ms = now_ms;
        true
    }

    /// Takes the letter for a redrive until `now_ms + hold_ms`: a dead or
    /// unknown letter, or one whose earlier hold ran out. Answers the
    /// hold's token (the redrive count), or `None` when it cannot be taken.
    ///
    /// From the moment it is taken a send of this redrive may reach the
    /// vendor, so the take is also the durable "sent" mark: `now_ms`
    /// becomes the first send that may have reached the vendor unless an
    /// earlier one is known. A redrive killed after its send, before it
    /// stored the answer, leaves that mark behind: the next redrive judges
    /// its send by the vendor's key horizon (and asks past it), and the
    /// letter is never known "not applied" on the strength of an older
    /// verdict.
    pub fn take(&mut self, now_ms: i64, hold_ms: i64) -> Result<Option<u32>> {
        let hold_ms = redrive_hold_ms(hold_ms)?;
        let free = match self.state {
            DeadLetterState::Dead | DeadLetterState::Unknown => true,
            DeadLetterState::Redriving => self.redrive_until_ms.is_none_or(|until| until <= now_ms),
            DeadLetterState::Resolved | DeadLetterState::Cancelled => false,
        };
        let Some(token) = self.redrives.checked_add(1).filter(|_| free) else {
            return Ok(None);
        };
        self.redrives = token;
        self.state = DeadLetterState::Redriving;
        self.first_reached_at_ms = earliest(self.first_reached_at_ms, Some(now_ms));
        self.redrive_until_ms = Some(now_ms.saturating_add(hold_ms));
        self.updated_at_ms = now_ms;
        Ok(Some(token))
    }

    /// [`take`](Self::take), answering the hold: the letter as taken, the
    /// token, and until when an earlier redrive held it.
    pub fn take_hold(&mut self, now_ms: i64, hold_ms: i64) -> Result<Option<RedriveHold>> {
        let earlier_hold_until_ms = match self.state {
            DeadLetterState::Redriving => self.redrive_until_ms,
            _ => None,
        };
        Ok(self.take(now_ms, hold_ms)?.map(|token| RedriveHold {
            dead_letter: self.clone(),
            token,
            earlier_hold_until_ms,
        }))
    }

    /// Whether the redrive with `token` holds it.
    pub fn held_by(&self, token: u32) -> bool {
        self.state == DeadLetterState::Redriving && self.redrives == token
    }

    /// Ends the redrive with `token`. Answers false (and changes nothing)
    /// when that redrive no longer holds it.
    pub fn finish(&mut self, token: u32, outcome: &RedriveOutcome, now_ms: i64) -> bool {
        if !self.held_by(token) {
            return false;
        }
        match outcome {
            RedriveOutcome::Resolved {
                status,
                body,
                reconciled,
            } => {
                self.resolve(*status, body);
                if *reconciled {
                    self.reconciliation = Some(Reconciliation {
                        verdict: Verdict::Applied,
                        by: VerdictSource::Vendor,
                        at_ms: now_ms,
                        note: "the vendor's record was found; nothing was sent".into(),
                    });
                }
            }
            RedriveOutcome::Failed {
                attempts,
                error,
                first_reached_at_ms,
                not_applied_at_ms,
            } => {
                self.state = DeadLetterState::Dead;
                self.attempts = self.attempts.saturating_add(*attempts);
                self.last_error = clip_text(error).to_owned();
                // The earliest reach only moves earlier, unless the vendor,
                // asked during this redrive, said it had not applied the call
                // (and no send reached it after): then the redrive's own view
                // stands.
                self.first_reached_at_ms = match not_applied_at_ms {
                    Some(_) => *first_reached_at_ms,
                    None => earliest(self.first_reached_at_ms, *first_reached_at_ms),
                };
                if let Some(at_ms) = not_applied_at_ms {
                    self.reconciliation = Some(Reconciliation {
                        verdict: Verdict::NotApplied,
                        by: VerdictSource::Vendor,
                        at_ms: *at_ms,
                        note: "the vendor has no record of it".into(),
                    });
                }
            }
            RedriveOutcome::Unknown {
                attempts,
                reason,
                first_reached_at_ms,
            } => {
                self.attempts = self.attempts.saturating_add(*attempts);
                self.last_error = clip_text(reason).to_owned();
                self.first_reached_at_ms = earliest(self.first_reached_at_ms, *first_reached_at_ms);
                self.hold_unknown(now_ms);
            }
        }
        self.redrive_until_ms = None;
        self.updated_at_ms = now_ms;
        true
    }

    /// Records what an operator (or the vendor, asked without a send) says
    /// of a dead or unknown letter: applied → resolved with the answer; not
    /// applied → dead, with no send that may have reached since (so a
    /// redrive sends it, and the business side may cancel it); unknown →
    /// held. Answers false (and changes nothing) for a letter being redriven
    /// or final.
    pub fn settle(&mut self, settlement: &Settlement, now_ms: i64) -> bool {
        if !matches!(self.state, DeadLetterState::Dead | DeadLetterState::Unknown) {
            return false;
        }
        match settlement.verdict {
            Verdict::Applied => self.resolve(settlement.status.unwrap_or(200), &settlement.body),
            Verdict::NotApplied => {
                self.state = DeadLetterState::Dead;
                self.first_reached_at_ms = None;
            }
            Verdict::Unknown => self.state = DeadLetterState::Unknown,
        }
        self.reconciliation = Some(Reconciliation {
            verdict: settlement.verdict,
            by: settlement.by,
            at_ms: now_ms,
            note: clip_text(&settlement.note).to_owned(),
        });
        self.updated_at_ms = now_ms;
        true
    }

    /// Resolved with the vendor's success answer (the body clipped to
    /// [`MAX_DEAD_LETTER_RESPONSE`]).
    fn resolve(&mut self, status: u16, body: &[u8]) {
        self.state = DeadLetterState::Resolved;
        self.response_status = Some(status);
        self.response_body = Some(clip_response(body).to_vec());
    }

    /// Held as unknown on the sender's own word: whether the vendor applied
    /// the call cannot be established, for the reason in `last_error`.
    fn hold_unknown(&mut self, now_ms: i64) {
        self.state = DeadLetterState::Unknown;
        self.reconciliation = Some(Reconciliation {
            verdict: Verdict::Unknown,
            by: VerdictSource::Sender,
            at_ms: now_ms,
            note: self.last_error.clone(),
        });
    }

    /// Whether the vendor is known not to have applied the call: its last
    /// verdict says so and no send that may have reached it came after.
    pub fn known_not_applied(&self) -> bool {
        self.first_reached_at_ms.is_none()
            && self
                .reconciliation
                .as_ref()
                .is_some_and(|r| r.verdict == Verdict::NotApplied)
    }

    /// Cancels a dead letter known not to have been applied (see
    /// [`known_not_applied`](Self::known_not_applied)); it is never sent
    /// again. Answers false (and changes nothing) otherwise.
    pub fn cancel(&mut self, now_ms: i64) -> bool {
        if self.state != DeadLetterState::Dead || !self.known_not_applied() {
            return false;
        }
        self.state = DeadLetterState::Cancelled;
        self.updated_at_ms = now_ms;
        true
    }

    /// Points the held letter at `url` (a redrive's target override), so
    /// what is stored is what was sent. False when `token` does not hold it.
    pub fn retarget(&mut self, token: u32, url: &str, now_ms: i64) -> Result<bool> {
        if !self.held_by(token) {
            return Ok(false);
        }
        self.request = self.request.with_url(url)?;
        self.updated_at_ms = now_ms;
        Ok(true)
    }
}

/// The earlier of two optional times.
fn earliest(a: Option<i64>, b: Option<i64>) -> Option<i64> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}
