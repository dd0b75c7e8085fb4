//! One run of an operation: its steps, replayed from the journal where
//! recorded, run and recorded where not.

use std::future::Future;

use idem_core::multistep::{
    HoldKind, JournalEntry, MultiStep, MultiStepStore, OpenSend, SendVerdict, StepKind, StepOutcome, step_key,
};
use idem_core::{BoxFuture, Clock, Error, IdempotencyKey, TxBackend};
use serde::Serialize;
use serde::de::DeserializeOwned;

/// How a step failed.
#[derive(Debug, Clone, PartialEq)]
pub enum StepError {
    /// A failure the operation declares (a declined payment, a refused
    /// quote): it is recorded, and the operation's compensation runs.
    Declared(serde_json::Value),
    /// It may have had its effect and whether it did cannot be established:
    /// the operation is held for an operator's verdict.
    Unknown(String),
    /// Worth trying again later (the vendor is down, it asked to wait, the
    /// database refused a commit): nothing is recorded, and the operation
    /// waits `after_ms` before any runner takes it again.
    Retry {
        /// Why.
        why: String,
        /// How long to wait.
        after_ms: i64,
    },
    /// No retry fixes it (a broken contract): the operation is held.
    Fatal(String),
}

impl From<Error> for StepError {
    fn from(e: Error) -> Self {
        StepError::Retry {
            why: e.to_string(),
            after_ms: 1_000,
        }
    }
}

/// Why a run stopped before its operation ended. Steps return it with `?`.
#[derive(Debug)]
pub enum Halt {
    /// A step declared this failure: the compensation runs.
    Failed(serde_json::Value),
    /// The operation is held.
    Held(HoldKind),
    /// The operation waits before it is run again.
    Deferred,
    /// Another runner took the operation over: this one stops, having
    /// written nothing more.
    Fenced,
    /// The store failed.
    Store(Error),
}

impl From<Error> for Halt {
    fn from(e: Error) -> Self {
        match e {
            Error::Fenced => Halt::Fenced,
            e => Halt::Store(e),
        }
    }
}

/// What an external step's send is told.
#[derive(Debug, Clone)]
pub struct Sending {
    /// The key every send of this step carries.
    pub key: IdempotencyKey,
    /// An earlier send of this step that may have reached the other side
    /// (by this runner or one before it): a send past the vendor's memory
    /// of keys asks it first.
    pub earlier: Option<OpenSend>,
    /// An operator's verdict on that earlier send: when it was applied,
    /// the vendor's answer is here, to decide the step's output from.
    pub verdict: Option<SendVerdict>,
}

/// The store a run writes to, whatever its type.
pub(crate) trait Rows<B: TxBackend>: Send + Sync {
    fn insert_in<'a>(&'a self, tx: &'a mut B::Tx, row: &'a MultiStep) -> BoxFuture<'a, idem_core::Result<Option<i64>>>;
    fn write_in<'a>(&'a self, tx: &'a mut B::Tx, row: &'a MultiStep) -> BoxFuture<'a, idem_core::Result<()>>;
    fn write<'a>(&'a self, row: &'a MultiStep) -> BoxFuture<'a, idem_core::Result<()>>;
}

impl<B: TxBackend, S: MultiStepStore<B>> Rows<B> for S {
    fn insert_in<'a>(&'a self, tx: &'a mut B::Tx, row: &'a MultiStep) -> BoxFuture<'a, idem_core::Result<Option<i64>>> {
        MultiStepStore::insert_in(self, tx, row)
    }
    fn write_in<'a>(&'a self, tx: &'a mut B::Tx, row: &'a MultiStep) -> BoxFuture<'a, idem_core::Result<()>> {
        MultiStepStore::write_in(self, tx, row)
    }
    fn write<'a>(&'a self, row: &'a MultiStep) -> BoxFuture<'a, idem_core::Result<()>> {
        MultiStepStore::write(self, row)
    }
}

/// The most times a local step runs again after its commit met contention.
const CONTENTION_RUNS: u32 = 10;

/// One run of an operation, holding it by its token. Its steps are called
/// in order, the same way on every run: a step the journal recorded
/// answers its recorded output without running.
pub struct Run<'e, B: TxBackend> {
    pub(crate) backend: &'e B,
    pub(crate) rows: &'e dyn Rows<B>,
    pub(crate) clock: &'e dyn Clock,
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

impl<'e, B: TxBackend> Run<'e, B> {
    fn compensating(&self) -> bool {
        self.row.state == idem_core::multistep::MultiStepState::Compensating
    }

    /// The recorded output of the step at the cursor, if any; a step of
    /// another name there means the definition changed under the
    /// operation, which is held.
    async fn recorded<T: DeserializeOwned>(&mut self, name: &str) -> Result<Option<T>, Halt> {
        let undo = self.compensating();
        let entry = self
            .row
            .journal
            .entries()
            .iter()
            .filter(|e| e.undo == undo)
            .nth(self.cursor);
        let Some(entry) = entry else { return Ok(None) };
        let value = match (&entry.outcome, entry.name == name) {
            (StepOutcome::Output(v), true) => serde_json::from_value::<T>(v.clone()).ok(),
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
                self.backend.commit(tx).await?;
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
    /// output, or not at all. Recorded already: its output, and `work` does
    /// not run. Contention runs `work` again, a bounded number of times.
    pub async fn local<T, F>(&mut self, name: &str, mut work: F) -> Result<T, Halt>
    where
        T: Serialize + DeserializeOwned + Send,
        F: for<'c> FnMut(&'c mut B::Tx) -> BoxFuture<'c, Result<T, StepError>> + Send,
    {
        if let Some(v) = self.recorded::<T>(name).await? {
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
            let value = serde_json::to_value(&output).map_err(|e| Halt::Store(Error::Encode(e.to_string())))?;
            let mut next = self.row.clone();
            next.record(
                self.token,
                self.entry(name, StepKind::Local, StepOutcome::Output(value)),
                self.clock.now_ms(),
            )?;
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
                    return Ok(output);
                }
                Err(Halt::Store(e)) if e.is_contention() && runs < CONTENTION_RUNS => continue,
                Err(h) => return Err(h),
            }
        }
    }

    /// Runs the external step `name`: the operation is marked sent (and
    /// that mark committed) before `send` runs, and `send` gets the key
    /// every send of this step carries, with any earlier send that may have
    /// reached the other side. Recorded already: its output, and nothing is
    /// sent.
    pub async fn external<T, F, Fut>(&mut self, name: &str, send: F) -> Result<T, Halt>
    where
        T: Serialize + DeserializeOwned + Send,
        F: FnOnce(Sending) -> Fut,
        Fut: Future<Output = Result<T, StepError>>,
    {
        if let Some(v) = self.recorded::<T>(name).await? {
            return Ok(v);
        }
        let now = self.clock.now_ms();
        let earlier = self.row.open.clone().filter(|o| o.step == name);
        let verdict = self.row.verdict.clone();
        let mut next = self.row.clone();
        next.extend(self.token, now, self.lease_ms)?;
        next.mark_sent(self.token, name, now, None)?;
        self.commit_alone(next).await?;
        let key_name = if self.compensating() {
            format!("undo:{name}")
        } else {
            name.to_owned()
        };
        let key = step_key(&self.row.scope, &self.row.key, &key_name);
        match send(Sending { key, earlier, verdict }).await {
            Ok(output) => {
                let value = serde_json::to_value(&output).map_err(|e| Halt::Store(Error::Encode(e.to_string())))?;
                let mut next = self.row.clone();
                let entry = self.entry(name, StepKind::External, StepOutcome::Output(value));
                next.record(self.token, entry, self.clock.now_ms())?;
                self.commit_alone(next).await?;
                self.cursor += 1;
                Ok(output)
            }
            Err(e) => Err(self.failed(name, StepKind::External, e).await),
        }
    }

    /// What a failed step does to the operation.
    async fn failed(&mut self, name: &str, kind: StepKind, e: StepError) -> Halt {
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
                let mut next = self.row.clone();
                let entry = self.entry(name, kind, StepOutcome::Failed(failure.clone()));
                if let Err(e) = next.record(self.token, entry, self.clock.now_ms()) {
                    return e.into();
                }
                match self.commit_alone(next).await {
                    Ok(()) => {
                        self.cursor = 0;
                        Halt::Failed(failure)
                    }
                    Err(h) => h,
                }
            }
            StepError::Declared(failure) => {
                self.hold(
                    HoldKind::Failed,
                    &format!("compensation step {name:?} failed: {failure}"),
                )
                .await
            }
            StepError::Unknown(why) => self.hold(HoldKind::Unknown, &why).await,
            StepError::Fatal(why) => self.hold(HoldKind::Failed, &why).await,
            StepError::Retry { why, after_ms } => {
                tracing::info!(step = name, error = %why, after_ms, "step deferred");
                let now = self.clock.now_ms();
                let mut next = self.row.clone();
                if let Err(e) = next.defer(self.token, now.saturating_add(after_ms.max(0)), now) {
                    return e.into();
                }
                match self.commit_alone(next).await {
                    Ok(()) => Halt::Deferred,
                    Err(h) => h,
                }
            }
        }
    }
}
