//! An operation's row and its transitions: pure functions of the row and
//! the store's clock.

use crate::deadletter::{Reconciliation, SentUnder, Settlement, Verdict};
use crate::error::{Error, Result};
use crate::fingerprint::Fingerprint;
use crate::key::IdempotencyKey;
use crate::scope::Scope;

use super::{
    HoldKind, Journal, JournalEntry, MAX_OPERATION_INPUT, MAX_RESPONSE_BYTES, MultiStepState, StepOutcome,
    check_step_name,
};

/// An operation to start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewMultiStep {
    /// Who asked and what (tenant, operation).
    pub scope: Scope,
    /// The idempotency key of the request that started it.
    pub key: IdempotencyKey,
    /// The definition that runs it, with its version (`withdrawal@1`): a
    /// runner that resumes it runs that definition.
    pub definition: String,
    /// The request's fingerprint: a retry with another request is refused.
    pub fingerprint: Fingerprint,
    /// The operation's input (serialised), from which any runner rebuilds it.
    pub input: Vec<u8>,
    /// How long its recorded response is kept once it is final, in ms.
    pub ttl_ms: i64,
}

/// An external step whose send may have reached the other side and whose
/// answer is not recorded yet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpenSend {
    /// The step.
    pub step: String,
    /// When its first send that may have reached the vendor started.
    pub first_sent_at_ms: i64,
    /// When its latest send started.
    pub last_sent_at_ms: i64,
    /// Sends started so far.
    pub sends: u32,
    /// The strictest terms its sends were made under, if the sender said.
    pub sent_under: Option<SentUnder>,
}

/// Why and since when an operation is held.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hold {
    /// Why.
    pub kind: HoldKind,
    /// What the runner or the operator noted.
    pub note: String,
    /// Since when.
    pub at_ms: i64,
}

/// The last verdict on an open send, with the vendor's answer when it was
/// applied: the runner that resumes the operation decides the step's output
/// from that answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SendVerdict {
    /// What was said, by whom, when.
    pub reconciliation: Reconciliation,
    /// The vendor's status, when applied.
    pub status: Option<u16>,
    /// The vendor's answer, when applied.
    pub body: Vec<u8>,
}

/// The longest note kept with a hold or verdict.
const MAX_NOTE: usize = 1024;

fn clip(note: &str) -> String {
    crate::redact::cut_at_char_boundary(note, MAX_NOTE).to_owned()
}

/// An operation's row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MultiStep {
    /// The store's id.
    pub id: i64,
    /// The row's version: every write is made only over the version its
    /// writer read, and the store then counts it up, so two writers never
    /// both succeed from one read.
    pub version: i64,
    /// Who asked and what.
    pub scope: Scope,
    /// The key of the request that started it.
    pub key: IdempotencyKey,
    /// The definition and version that run it.
    pub definition: String,
    /// The starting request's fingerprint.
    pub fingerprint: Fingerprint,
    /// The input.
    pub input: Vec<u8>,
    /// Where it stands.
    pub state: MultiStepState,
    /// The steps finished, in order.
    pub journal: Journal,
    /// The external step whose send may have reached the vendor, unanswered.
    pub open: Option<OpenSend>,
    /// Why it is held, while [`Held`](MultiStepState::Held).
    pub hold: Option<Hold>,
    /// The verdict on the open send, once given.
    pub verdict: Option<SendVerdict>,
    /// The declared failure (or cancellation) its compensation answers.
    pub failure: Option<serde_json::Value>,
    /// The token of the runner (or operator) that last took it.
    pub token: i64,
    /// Until when its runner holds it; `None` when no runner does.
    pub lease_until_ms: Option<i64>,
    /// Not to be taken before this time (a step asked to wait).
    pub not_before_ms: Option<i64>,
    /// How many times a runner took it.
    pub runs: u32,
    /// The recorded response, once final.
    pub response: Option<Vec<u8>>,
    /// How long the response is kept once final, in ms.
    pub ttl_ms: i64,
    /// When it started.
    pub created_at_ms: i64,
    /// When it last changed.
    pub updated_at_ms: i64,
    /// When a final operation may be purged; `None` until it is final.
    pub expires_at_ms: Option<i64>,
}

impl MultiStep {
    /// The row a first run creates, taken by `token` until
    /// `now + lease_ms`. Refuses an input over [`MAX_OPERATION_INPUT`], an
    /// empty definition and a TTL that is not positive.
    pub fn created(new: &NewMultiStep, token: i64, now_ms: i64, lease_ms: i64) -> Result<Self> {
        if new.input.len() > MAX_OPERATION_INPUT {
            return Err(Error::RecordTooLarge {
                size: new.input.len(),
                limit: MAX_OPERATION_INPUT,
            });
        }
        check_step_name(&new.definition)?;
        if new.ttl_ms <= 0 || lease_ms <= 0 {
            return Err(Error::Config("an operation's TTL and lease are positive".into()));
        }
        Ok(Self {
            id: 0,
            version: 0,
            scope: new.scope.clone(),
            key: new.key.clone(),
            definition: new.definition.clone(),
            fingerprint: new.fingerprint,
            input: new.input.clone(),
            state: MultiStepState::Running,
            journal: Journal::new(),
            open: None,
            hold: None,
            verdict: None,
            failure: None,
            token,
            lease_until_ms: Some(now_ms.saturating_add(lease_ms)),
            not_before_ms: None,
            runs: 1,
            response: None,
            ttl_ms: new.ttl_ms,
            created_at_ms: now_ms,
            updated_at_ms: now_ms,
            expires_at_ms: None,
        })
    }

    /// Whether a runner holds it at `now_ms` (its lease has not run out).
    pub fn is_leased(&self, now_ms: i64) -> bool {
        self.lease_until_ms.is_some_and(|l| l > now_ms)
    }

    /// Whether a runner may take it at `now_ms`: running or compensating,
    /// no live lease, and not asked to wait.
    pub fn is_due(&self, now_ms: i64) -> bool {
        self.state.is_runnable() && !self.is_leased(now_ms) && self.not_before_ms.is_none_or(|t| t <= now_ms)
    }

    /// Takes it for a run until `now + lease_ms` when [due](Self::is_due):
    /// answers the new token, which fences every earlier one. `None` (and
    /// nothing changed) otherwise.
    pub fn take(&mut self, now_ms: i64, lease_ms: i64) -> Option<i64> {
        if !self.is_due(now_ms) {
            return None;
        }
        self.token = self.token.saturating_add(1);
        self.lease_until_ms = Some(now_ms.saturating_add(lease_ms));
        self.not_before_ms = None;
        self.runs = self.runs.saturating_add(1);
        self.updated_at_ms = now_ms;
        Some(self.token)
    }

    /// Whether `token` holds it: the latest token, and a runner may work on
    /// it. (Whether the lease is still live is the runner's to check before
    /// it sends; a write needs only the token, which no one else has.)
    pub fn held_by(&self, token: i64) -> bool {
        self.token == token && self.state.is_runnable()
    }

    fn fenced_unless(&self, token: i64) -> Result<()> {
        if self.held_by(token) {
            Ok(())
        } else {
            Err(Error::Fenced)
        }
    }

    /// Extends its runner's lease to `now + lease_ms`.
    pub fn extend(&mut self, token: i64, now_ms: i64, lease_ms: i64) -> Result<()> {
        self.fenced_unless(token)?;
        self.lease_until_ms = Some(now_ms.saturating_add(lease_ms));
        self.updated_at_ms = now_ms;
        Ok(())
    }

    /// Marks external step `step` as sent, before its request leaves the
    /// process: the first mark keeps its time (a resend keeps the earliest
    /// and counts), and the terms are the strictest of every send's. Refuses
    /// a step already recorded and a second step while another's send is
    /// open.
    pub fn mark_sent(&mut self, token: i64, step: &str, now_ms: i64, terms: Option<SentUnder>) -> Result<()> {
        self.fenced_unless(token)?;
        check_step_name(step)?;
        let undo = self.state == MultiStepState::Compensating;
        if self.journal.find(step, undo).is_some() {
            return Err(Error::InvalidRequest(format!("step {step:?} is already recorded")));
        }
        match &mut self.open {
            Some(open) if open.step == step => {
                open.last_sent_at_ms = now_ms;
                open.sends = open.sends.saturating_add(1);
                open.sent_under = match (open.sent_under, terms) {
                    (Some(a), Some(b)) => Some(a.strictest(b)),
                    (a, b) => a.or(b),
                };
            }
            Some(open) => {
                return Err(Error::InvalidRequest(format!(
                    "step {:?}'s send is open; it is answered before {step:?} sends",
                    open.step
                )));
            }
            None => {
                self.open = Some(OpenSend {
                    step: step.to_owned(),
                    first_sent_at_ms: now_ms,
                    last_sent_at_ms: now_ms,
                    sends: 1,
                    sent_under: terms,
                });
            }
        }
        self.updated_at_ms = now_ms;
        Ok(())
    }

    /// Records a finished step: it joins the journal, and an open send of
    /// the same step is closed with it. A forward step's declared failure
    /// starts the compensation (the failure is kept for it). Refuses a step
    /// of the other direction, a failure declared by a compensation step,
    /// and a step other than the one whose send is open.
    pub fn record(&mut self, token: i64, entry: JournalEntry, now_ms: i64) -> Result<()> {
        self.fenced_unless(token)?;
        let compensating = self.state == MultiStepState::Compensating;
        if entry.undo != compensating {
            return Err(Error::InvalidRequest(format!(
                "step {:?} is a {} step of an operation that is {}",
                entry.name,
                if entry.undo { "compensation" } else { "forward" },
                self.state.as_str()
            )));
        }
        if let Some(open) = &self.open
            && open.step != entry.name
        {
            return Err(Error::InvalidRequest(format!(
                "step {:?}'s send is open; it is answered before {:?} is recorded",
                open.step, entry.name
            )));
        }
        let failure = match &entry.outcome {
            StepOutcome::Failed(_) if entry.undo => {
                return Err(Error::InvalidRequest(
                    "a compensation step cannot declare a failure: it holds the operation instead".into(),
                ));
            }
            StepOutcome::Failed(f) => Some(f.clone()),
            StepOutcome::Output(_) => None,
        };
        let entry = JournalEntry { at_ms: now_ms, ..entry };
        self.journal.push(entry)?;
        self.open = None;
        self.verdict = None;
        if let Some(failure) = failure {
            self.state = MultiStepState::Compensating;
            self.failure = Some(failure);
        }
        self.updated_at_ms = now_ms;
        Ok(())
    }

    /// Starts the compensation of a running operation for `failure`,
    /// declared by the operation itself rather than by a step. Refused while
    /// a send is open, and once it compensates.
    pub fn fail(&mut self, token: i64, failure: serde_json::Value, now_ms: i64) -> Result<()> {
        self.fenced_unless(token)?;
        if self.state != MultiStepState::Running {
            return Err(Error::InvalidRequest(format!(
                "only a running operation starts its compensation; this one is {}",
                self.state.as_str()
            )));
        }
        if let Some(open) = &self.open {
            return Err(Error::InvalidRequest(format!(
                "step {:?}'s send is open; it is answered before the operation fails",
                open.step
            )));
        }
        self.state = MultiStepState::Compensating;
        self.failure = Some(failure);
        self.updated_at_ms = now_ms;
        Ok(())
    }

    /// Holds it at its current step for `kind` (its runner gives it up).
    pub fn hold(&mut self, token: i64, kind: HoldKind, note: &str, now_ms: i64) -> Result<()> {
        self.fenced_unless(token)?;
        self.state = MultiStepState::Held;
        self.hold = Some(Hold {
            kind,
            note: clip(note),
            at_ms: now_ms,
        });
        self.lease_until_ms = None;
        self.updated_at_ms = now_ms;
        Ok(())
    }

    /// Gives it up until `not_before_ms` (a step asked to wait, or failed
    /// in a way worth retrying later); any runner may take it then.
    pub fn defer(&mut self, token: i64, not_before_ms: i64, now_ms: i64) -> Result<()> {
        self.fenced_unless(token)?;
        self.lease_until_ms = None;
        self.not_before_ms = Some(not_before_ms);
        self.updated_at_ms = now_ms;
        Ok(())
    }

    /// Ends it with its recorded `response`: completed after its forward
    /// steps, compensated after its compensation. Refuses while a send is
    /// open.
    pub fn finish(&mut self, token: i64, response: Vec<u8>, now_ms: i64) -> Result<()> {
        self.fenced_unless(token)?;
        if response.len() > MAX_RESPONSE_BYTES {
            return Err(Error::RecordTooLarge {
                size: response.len(),
                limit: MAX_RESPONSE_BYTES,
            });
        }
        if let Some(open) = &self.open {
            return Err(Error::InvalidRequest(format!(
                "step {:?}'s send is open; an operation ends only with every send answered",
                open.step
            )));
        }
        self.state = match self.state {
            MultiStepState::Compensating => MultiStepState::Compensated,
            _ => MultiStepState::Completed,
        };
        self.response = Some(response);
        self.lease_until_ms = None;
        self.not_before_ms = None;
        self.expires_at_ms = Some(now_ms.saturating_add(self.ttl_ms));
        self.updated_at_ms = now_ms;
        Ok(())
    }

    /// The state a held operation goes back to: compensating once a
    /// failure was declared, running otherwise.
    fn resumed_state(&self) -> MultiStepState {
        if self.failure.is_some() {
            MultiStepState::Compensating
        } else {
            MultiStepState::Running
        }
    }

    /// Lets a held operation go on from where it stopped (an operator's
    /// `resume`): any runner may take it at once, and its former runner is
    /// fenced. Refuses an operation that is not held, and one held on an
    /// unknown outcome, which only a verdict ([`settle`](Self::settle))
    /// lets go.
    pub fn resume(&mut self, now_ms: i64) -> Result<()> {
        match &self.hold {
            // An unknown outcome waits for a verdict on its open send; with
            // no send open there is nothing to settle.
            Some(hold)
                if self.state == MultiStepState::Held && (hold.kind != HoldKind::Unknown || self.open.is_none()) => {}
            Some(_) if self.state == MultiStepState::Held => {
                return Err(Error::InvalidRequest(
                    "held on an unknown outcome: give a verdict on its send first".into(),
                ));
            }
            _ => {
                return Err(Error::InvalidRequest(format!(
                    "only a held operation resumes; this one is {}",
                    self.state.as_str()
                )));
            }
        }
        self.let_go(now_ms);
        Ok(())
    }

    fn let_go(&mut self, now_ms: i64) {
        self.state = self.resumed_state();
        self.hold = None;
        self.token = self.token.saturating_add(1);
        self.lease_until_ms = None;
        self.not_before_ms = None;
        self.updated_at_ms = now_ms;
    }

    /// Records a verdict on the open send of an operation held on an
    /// unknown outcome. Applied: it goes on, and the runner that takes it
    /// decides the step's output from the answer kept here. Not applied
    /// (trusted only once its latest send has settled, `settle` after it
    /// started): the send is forgotten and the step will send afresh.
    /// Unknown: it stays held, with the note. Refuses an operation not held
    /// on an unknown outcome, and a "not applied" given too early.
    pub fn settle(&mut self, settlement: &Settlement, now_ms: i64) -> Result<()> {
        let held_unknown =
            self.state == MultiStepState::Held && self.hold.as_ref().is_some_and(|h| h.kind == HoldKind::Unknown);
        let Some(open) = self.open.as_ref().filter(|_| held_unknown) else {
            return Err(Error::InvalidRequest(
                "only an operation held on an unknown outcome takes a verdict".into(),
            ));
        };
        if settlement.verdict == Verdict::NotApplied {
            let settle_ms = open.sent_under.map_or(0, |t| SentUnder::millis(t.settle));
            let settled_at = open.last_sent_at_ms.saturating_add(settle_ms);
            if now_ms < settled_at {
                return Err(Error::InvalidRequest(format!(
                    "its latest send may still arrive until {settled_at} (ms since the epoch): \
                     \"not applied\" is trusted only after that"
                )));
            }
        }
        let reconciliation = Reconciliation {
            verdict: settlement.verdict,
            by: settlement.by,
            at_ms: now_ms,
            note: clip(&settlement.note),
        };
        match settlement.verdict {
            Verdict::Unknown => {
                if let Some(hold) = &mut self.hold {
                    hold.note = reconciliation.note.clone();
                }
                self.updated_at_ms = now_ms;
            }
            Verdict::NotApplied => {
                self.open = None;
                self.let_go(now_ms);
            }
            Verdict::Applied => self.let_go(now_ms),
        }
        self.verdict = Some(SendVerdict {
            reconciliation,
            status: (settlement.verdict == Verdict::Applied).then(|| settlement.status.unwrap_or(200)),
            body: if settlement.verdict == Verdict::Applied {
                settlement.body.clone()
            } else {
                Vec::new()
            },
        });
        Ok(())
    }

    /// Cancels it (an operator's `cancel`): its compensation runs, with
    /// `{"cancelled": reason}` as its failure, and its runner is fenced.
    /// Refused while a runner holds it, once it compensates or is final,
    /// and while a send may have been applied (an open send: a verdict of
    /// "not applied" closes it first) — what may have been paid is never
    /// cancelled.
    pub fn cancel(&mut self, reason: &str, now_ms: i64) -> Result<()> {
        if !matches!(self.state, MultiStepState::Running | MultiStepState::Held) || self.failure.is_some() {
            return Err(Error::InvalidRequest(format!(
                "only a running or held operation that declared no failure is cancelled; this one is {}",
                self.state.as_str()
            )));
        }
        if self.is_leased(now_ms) {
            return Err(Error::InvalidRequest(
                "a runner holds it: cancel it once its lease has run out".into(),
            ));
        }
        if let Some(open) = &self.open {
            return Err(Error::InvalidRequest(format!(
                "step {:?}'s send may have been applied: it is not cancelled unless known not applied",
                open.step
            )));
        }
        self.failure = Some(serde_json::json!({ "cancelled": clip(reason) }));
        self.let_go(now_ms);
        Ok(())
    }

    /// Holds it for an operator (an operator's `hold`), fencing its runner.
    /// Refused while a runner holds it and once it is held or final.
    pub fn hold_for_operator(&mut self, note: &str, now_ms: i64) -> Result<()> {
        if !self.state.is_runnable() || self.is_leased(now_ms) {
            return Err(Error::InvalidRequest(
                "only a running or compensating operation no runner holds is held".into(),
            ));
        }
        self.token = self.token.saturating_add(1);
        self.state = MultiStepState::Held;
        self.hold = Some(Hold {
            kind: HoldKind::Operator,
            note: clip(note),
            at_ms: now_ms,
        });
        self.updated_at_ms = now_ms;
        Ok(())
    }
}
