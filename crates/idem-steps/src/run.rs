//! One run of an operation: its steps, replayed from the journal where
//! recorded, run and recorded where not.

use std::future::Future;
use std::sync::Arc;

use idem_core::multistep::{HoldKind, JournalEntry, MultiStep, MultiStepState, StepKind, StepOutcome, step_key};
use idem_core::{BoxFuture, Clock, Error, SentUnder, TxBackend};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::halt::Rows;
use crate::{Halt, Point, Sending, StepError, hit};

/// The most times a local step runs again after its commit met contention.
const CONTENTION_RUNS: u32 = 10;

/// The longest a step may ask to wait before it is run again: a day.
const MAX_RETRY_AFTER_MS: i64 = 86_400_000;

/// One run of an operation, holding it by its token. Its steps are called
/// in order, the same way on every run: a step the journal recorded
/// answers its recorded output without running.
pub struct Run<'e, B: TxBackend> {
    pub(crate) backend: &'e B,
    pub(crate) rows: &'e dyn Rows<B>,
    pub(crate) clock: Arc<dyn Clock>,
    pub(crate) row: MultiStep,
    pub(crate) token: i64,
    pub(crate) lease_ms: i64,
    /// How many steps of the current direction this run has passed.
    pub(crate) cursor: usize,
}

impl<B: TxBackend> std::fmt::Debug for Run<'_, B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Run")
            .field("operation", &self.row.id)
            .field("token", &self.token)
            .field("cursor", &self.cursor)
            .finish_non_exhaustive()
    }
}

fn encode<T: Serialize>(output: &T) -> Result<serde_json::Value, Halt> {
    serde_json::to_value(output).map_err(|e| Halt::Store(Error::Encode(e.to_string())))
}

impl<B: TxBackend> Run<'_, B> {
    pub(crate) fn compensating(&self) -> bool {
        self.row.state == MultiStepState::Compensating
    }

    /// The output a forward step recorded, if it finished: what a
    /// compensation reads to decide what to undo.
    pub fn forward<T: DeserializeOwned>(&self, name: &str) -> Option<T> {
        match &self.row.journal.find(name, false)?.outcome {
            StepOutcome::Output(v) => serde_json::from_value(v.clone()).ok(),
            StepOutcome::Failed(_) => None,
        }
    }

    /// The recorded output of the step at the cursor, if any; a step of
    /// another name or kind there, or an output that no longer decodes,
    /// means the definition changed under the operation, which is held.
    async fn recorded<T: DeserializeOwned>(&mut self, name: &str, kind: StepKind) -> Result<Option<T>, Halt> {
        let undo = self.compensating();
        let entry = self
            .row
            .journal
            .entries()
            .iter()
            .filter(|e| e.undo == undo)
            .nth(self.cursor);
        let Some(entry) = entry else { return Ok(None) };
        let value = match &entry.outcome {
            StepOutcome::Output(v) if entry.name == name && entry.kind == kind => {
                serde_json::from_value::<T>(v.clone()).ok()
            }
            _ => None,
        };
        match value {
            Some(v) => {
                self.cursor += 1;
                Ok(Some(v))
            }
            None => {
                let why = format!("step {name:?} asked where the journal holds {:?}", entry.name);
                Err(self.hold(HoldKind::Nondeterministic, &why).await)
            }
        }
    }

    /// How many steps of the current direction the journal recorded that
    /// this run has not asked for.
    pub(crate) fn unasked(&self) -> usize {
        let undo = self.compensating();
        let recorded = self.row.journal.entries().iter().filter(|e| e.undo == undo).count();
        recorded.saturating_sub(self.cursor)
    }

    /// Holds an operation whose run ended without asking for every step
    /// the journal recorded: its definition changed under it.
    pub(crate) async fn unasked_hold(&mut self) -> Halt {
        let why = format!(
            "the run ended with {} recorded step(s) it did not ask for",
            self.unasked()
        );
        self.hold(HoldKind::Nondeterministic, &why).await
    }

    /// What a transition's refusal does: a fenced write stops the run; a
    /// step the row cannot take (an output over the limit, a name used
    /// twice or not allowed, a definition that changed under an open send)
    /// holds the operation, as running it again would meet the same
    /// refusal.
    async fn refused(&mut self, e: Error) -> Halt {
        match e {
            Error::Fenced => Halt::Fenced,
            e @ (Error::InvalidRequest(_) | Error::RecordTooLarge { .. }) => {
                self.hold(HoldKind::Failed, &e.to_string()).await
            }
            e => Halt::Store(e),
        }
    }

    /// Holds the operation and answers the halt that says so.
    pub(crate) async fn hold(&mut self, kind: HoldKind, why: &str) -> Halt {
        let mut next = self.row.clone();
        if let Err(e) = next.hold(self.token, kind, why, self.clock.now_ms()) {
            return e.into();
        }
        match self.commit_alone(next).await {
            Ok(()) => Halt::Held(kind),
            Err(e) => e,
        }
    }

    /// Records `failure` as the outcome of an operation nothing of which was
    /// committed (`run` returned a refusal of its first local step, or its
    /// own, before any step committed), for an operation that consumes final
    /// rejections: the row is inserted already ended, compensated with
    /// nothing to undo, in one transaction, so a retry of the key replays
    /// the refusal and no crash can leave a compensation to run for steps
    /// that never ran. Answers whether it was recorded: a failure over
    /// [`MAX_RESPONSE_BYTES`] records nothing and is answered unrecorded, as
    /// under the default. A write the store refuses records nothing and
    /// fails the call.
    ///
    /// [`MAX_RESPONSE_BYTES`]: idem_core::multistep::MAX_RESPONSE_BYTES
    pub(crate) async fn record_refusal(&mut self, failure: &serde_json::Value) -> Result<bool, Halt> {
        let response = serde_json::to_vec(failure).map_err(|e| Halt::Store(Error::Encode(e.to_string())))?;
        let mut next = self.row.clone();
        let now = self.clock.now_ms();
        let ended = next
            .fail(self.token, failure.clone(), now)
            .and_then(|()| next.finish(self.token, response, now));
        match ended {
            Ok(()) => self.commit_alone(next).await.map(|()| true),
            Err(e @ Error::RecordTooLarge { .. }) => {
                tracing::warn!(
                    definition = %self.row.definition,
                    error = %e,
                    "a refusal of an operation that consumes final rejections is answered unrecorded"
                );
                Ok(false)
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Applies `change` to a copy of the row and writes it in a transaction
    /// of its own (see [`commit_alone`](Self::commit_alone)); a refused
    /// change is [`refused`](Self::refused).
    pub(crate) async fn change(
        &mut self,
        change: impl FnOnce(&mut MultiStep, i64, i64) -> idem_core::Result<()>,
    ) -> Result<(), Halt> {
        let mut next = self.row.clone();
        if let Err(e) = change(&mut next, self.token, self.clock.now_ms()) {
            return Err(self.refused(e).await);
        }
        self.commit_alone(next).await
    }

    /// Writes `next` in a transaction of its own (inserting the operation
    /// first if no step has committed it yet), and keeps it.
    pub(crate) async fn commit_alone(&mut self, mut next: MultiStep) -> Result<(), Halt> {
        if self.row.id == 0 {
            let mut tx = self.backend.begin().await?;
            let inserted = self.rows.insert_in(&mut tx, &next).await;
            self.finish_insert(tx, inserted, &mut next).await?;
        } else {
            self.rows.write(&next).await?;
            next.version += 1;
        }
        self.row = next;
        Ok(())
    }

    async fn finish_insert(
        &self,
        tx: B::Tx,
        inserted: idem_core::Result<Option<i64>>,
        next: &mut MultiStep,
    ) -> Result<(), Halt> {
        match inserted {
            Ok(Some(id)) => {
                match self.backend.commit(tx).await {
                    Ok(()) => {}
                    // A twin's insert committed first (a store that finds
                    // out only at commit).
                    Err(e) if e.is_contention() => return Err(Halt::Fenced),
                    Err(e) => return Err(e.into()),
                }
                next.id = id;
                next.version = 0;
                Ok(())
            }
            // A twin started the same operation first.
            Ok(None) => {
                self.backend.rollback(tx).await?;
                Err(Halt::Fenced)
            }
            Err(e) => {
                let _ = self.backend.rollback(tx).await;
                Err(e.into())
            }
        }
    }

    fn entry(&self, name: &str, kind: StepKind, outcome: StepOutcome) -> JournalEntry {
        JournalEntry {
            name: name.to_owned(),
            kind,
            undo: self.compensating(),
            outcome,
            at_ms: 0,
        }
    }

    /// Runs the local step `name`: `work` gets a transaction of the
    /// backend, and its writes commit together with the step's recorded
    /// output (and a renewed lease), or not at all. Recorded already: its
    /// output, and `work` does not run. Contention runs `work` again, a
    /// bounded number of times.
    pub async fn local<T, F>(&mut self, name: &str, mut work: F) -> Result<T, Halt>
    where
        T: Serialize + DeserializeOwned + Send,
        F: for<'c> FnMut(&'c mut B::Tx) -> BoxFuture<'c, Result<T, StepError>> + Send,
    {
        if let Some(v) = self.recorded::<T>(name, StepKind::Local).await? {
            return Ok(v);
        }
        let mut runs = 0;
        loop {
            runs += 1;
            let mut tx = self.backend.begin().await?;
            let output = match work(&mut tx).await {
                Ok(v) => v,
                Err(e) => {
                    let _ = self.backend.rollback(tx).await;
                    return Err(self.failed(name, StepKind::Local, e).await);
                }
            };
            let mut next = self.row.clone();
            let now = self.clock.now_ms();
            let entry = self.entry(name, StepKind::Local, StepOutcome::Output(encode(&output)?));
            let recorded = next
                .extend(self.token, now, self.lease_ms)
                .and_then(|()| next.record(self.token, entry, now));
            if let Err(e) = recorded {
                let _ = self.backend.rollback(tx).await;
                return Err(self.refused(e).await);
            }
            hit(Point::BeforeStepCommit, name);
            let committed = if self.row.id == 0 {
                let inserted = self.rows.insert_in(&mut tx, &next).await;
                self.finish_insert(tx, inserted, &mut next).await
            } else {
                match self.rows.write_in(&mut tx, &next).await {
                    Ok(()) => self.backend.commit(tx).await.map_err(Halt::from),
                    Err(e) => {
                        let _ = self.backend.rollback(tx).await;
                        Err(e.into())
                    }
                }
                .map(|()| next.version += 1)
            };
            match committed {
                Ok(()) => {
                    self.row = next;
                    self.cursor += 1;
                    hit(Point::AfterStepCommit, name);
                    return Ok(output);
                }
                Err(Halt::Store(e)) if e.is_contention() && runs < CONTENTION_RUNS => continue,
                Err(h) => return Err(h),
            }
        }
    }

    /// Runs the external step `name`: the operation is marked sent (and
    /// that mark committed, with the run's lease renewed) before `send`
    /// runs, and `send` gets the key every send of this step carries, any
    /// earlier send that may have reached the other side, and the end of
    /// the run's lease, after which it must not start a send
    /// ([`Sending::may_send`]). Recorded already: its output, and nothing
    /// is sent.
    pub async fn external<T, F, Fut>(&mut self, name: &str, send: F) -> Result<T, Halt>
    where
        T: Serialize + DeserializeOwned + Send,
        F: FnOnce(Sending) -> Fut,
        Fut: Future<Output = Result<T, StepError>>,
    {
        self.external_under(name, None, false, send).await
    }

    /// [`external`](Self::external), its sends made under `terms` (the
    /// vendor's key horizon and the settle time), kept with the mark. With
    /// `asks`, a resend that must ask the other side first waits until the
    /// earlier send has settled (see `unsettled`).
    pub(crate) async fn external_under<T, F, Fut>(
        &mut self,
        name: &str,
        terms: Option<SentUnder>,
        asks: bool,
        send: F,
    ) -> Result<T, Halt>
    where
        T: Serialize + DeserializeOwned + Send,
        F: FnOnce(Sending) -> Fut,
        Fut: Future<Output = Result<T, StepError>>,
    {
        if let Some(v) = self.recorded::<T>(name, StepKind::External).await? {
            return Ok(v);
        }
        let earlier = self.row.open.clone().filter(|o| o.step == name);
        let verdict = self.row.verdict.clone();
        if let Some(wait_ms) = self.unsettled(earlier.as_ref(), verdict.is_some()).filter(|_| asks) {
            // An earlier send may still be on its way, and the other side
            // must be asked before anything is sent again: nothing could be
            // sent before it settles, and a mark now would move its end.
            let why = format!("step {name:?}: an earlier send settles in {wait_ms} ms");
            return Err(self
                .failed(name, StepKind::External, StepError::Retry { why, after_ms: wait_ms })
                .await);
        }
        let lease_ms = self.lease_ms;
        self.change(|next, token, now| {
            next.extend(token, now, lease_ms)?;
            next.mark_sent(token, name, now, terms)?;
            // No send of this run starts after its lease: a run taking the
            // operation over counts from then when it judges a "not
            // applied".
            let lease_until = next.lease_until_ms.unwrap_or(now);
            if let Some(open) = next.open.as_mut() {
                open.last_sent_at_ms = open.last_sent_at_ms.max(lease_until);
            }
            Ok(())
        })
        .await?;
        hit(Point::AfterSentMark, name);
        let key_name = if self.compensating() {
            format!("undo:{name}")
        } else {
            name.to_owned()
        };
        let sending = Sending {
            key: step_key(&self.row.scope, &self.row.key, &key_name),
            earlier,
            verdict,
            lease_until_ms: self.row.lease_until_ms.unwrap_or_default(),
            clock: self.clock.clone(),
        };
        match send(sending).await {
            Ok(output) => {
                hit(Point::AfterAnswer, name);
                let entry = self.entry(name, StepKind::External, StepOutcome::Output(encode(&output)?));
                self.change(|next, token, now| next.record(token, entry, now)).await?;
                self.cursor += 1;
                hit(Point::AfterStepCommit, name);
                Ok(output)
            }
            Err(e) => Err(self.failed(name, StepKind::External, e).await),
        }
    }

    /// How long until `earlier` (the open send of the step about to run
    /// again) has settled, when its vendor cannot be sent to blindly (no
    /// keys, or past their horizon) and no verdict settles it: `None` when
    /// the step may go on now.
    fn unsettled(&self, earlier: Option<&idem_core::multistep::OpenSend>, verdict: bool) -> Option<i64> {
        let open = earlier.filter(|_| !verdict)?;
        let terms = open.sent_under?;
        let now = self.clock.now_ms();
        let millis = |d: std::time::Duration| i64::try_from(d.as_millis()).unwrap_or(i64::MAX);
        let remembered_until = open
            .first_sent_at_ms
            .saturating_add(millis(terms.key_horizon))
            .saturating_sub(millis(terms.horizon_margin));
        let blind = !terms.key_horizon.is_zero() && now < remembered_until;
        let settled_at = open.last_sent_at_ms.saturating_add(millis(terms.settle));
        (!blind && now < settled_at).then(|| settled_at - now)
    }

    /// What a failed step does to the operation.
    async fn failed(&mut self, name: &str, kind: StepKind, e: StepError) -> Halt {
        // A local step's transaction rolled back: nothing of it can have
        // been applied, so its outcome is known, whatever it said.
        let e = match (kind, e) {
            (StepKind::Local, StepError::Unknown(why)) => StepError::Fatal(why),
            (_, e) => e,
        };
        if self.row.id == 0 {
            // Nothing of the operation was ever committed (its first step, a
            // local one, failed): nothing is recorded, and its key stays
            // unused.
            return match e {
                StepError::Declared(failure) => Halt::Failed(failure),
                StepError::Retry { .. } => Halt::Deferred,
                StepError::Unknown(why) | StepError::Fatal(why) => Halt::Store(Error::store(
                    idem_core::StoreErrorKind::Other,
                    format!("step {name:?} failed before anything was recorded: {why}"),
                )),
            };
        }
        match e {
            StepError::Declared(failure) if !self.compensating() => {
                let entry = self.entry(name, kind, StepOutcome::Failed(failure.clone()));
                match self.change(|next, token, now| next.record(token, entry, now)).await {
                    Ok(()) => {
                        self.cursor = 0;
                        Halt::Failed(failure)
                    }
                    Err(h) => h,
                }
            }
            StepError::Declared(failure) => {
                let why = format!("compensation step {name:?} failed: {failure}");
                self.hold(HoldKind::Failed, &why).await
            }
            StepError::Unknown(why) => self.hold(HoldKind::Unknown, &why).await,
            StepError::Fatal(why) => self.hold(HoldKind::Failed, &why).await,
            StepError::Retry { why, after_ms } => {
                let after_ms = after_ms.clamp(0, MAX_RETRY_AFTER_MS);
                tracing::info!(step = name, error = %why, after_ms, "step deferred");
                match self
                    .change(|next, token, now| next.defer(token, now.saturating_add(after_ms), now))
                    .await
                {
                    Ok(()) => Halt::Deferred,
                    Err(h) => h,
                }
            }
        }
    }
}
