//! Multi-step operations that complete exactly once: a request that spans
//! local writes and calls to other systems, resumed from its last recovery
//! point after a crash, a timeout or a lost answer.
//!
//! An [`Operation`] is a sequence of named steps run under one idempotency
//! key. A *local* step ([`Run::local`]) runs in a transaction of the
//! caller's database, and its writes commit together with its recorded
//! output. An *external* step ([`Run::external`]) calls another system: the
//! operation is marked sent, durably, before the call leaves the process,
//! and the call carries a key derived from the operation's key and the
//! step's name ([`step_key`](idem_core::multistep::step_key)), the same on
//! every attempt. Each step's output is recorded in the operation's journal
//! and replayed on every later run, never recomputed: a run after a crash
//! goes through the same code and finds the finished steps answered.
//!
//! A step's declared failure ([`StepError::Declared`]) starts the
//! operation's compensation ([`Operation::compensate`]), whose steps are
//! recorded the same way and run once. An external step whose outcome
//! cannot be established ([`StepError::Unknown`]) holds the operation for
//! an operator's verdict; nothing is sent again on a guess. A failure
//! declared before anything was committed (by the first step, a local one)
//! records nothing by default, so the key stays unused; an operation whose
//! [`Operation::CONSUME`] is [`Consume::SuccessOrFinalRejection`] records it
//! and replays it to every later call of the key.
//!
//! The operations live in a [`MultiStepStore`] beside the caller's own
//! tables: `MemoryMultiSteps`, `PgMultiSteps`, `MySqlMultiSteps` or
//! `SqliteMultiSteps`. Each run holds its operation by a token and a lease:
//! a run that stopped (a crash, a dropped request) is taken over by the next
//! call once its lease has run out, and the stopped run can no longer write.
//!
//! ```
//! use idem_core::{Call, Fingerprint, IdempotencyKey, Scope};
//! use idem_memory::{MemoryMultiSteps, MemoryStore};
//! use idem_steps::{Finished, Halt, Operation, Run, StepsEngine};
//!
//! struct Greet;
//!
//! impl Operation<MemoryStore> for Greet {
//!     type Input = String;
//!     type Output = String;
//!     const NAME: &'static str = "greet@1";
//!
//!     fn run<'r>(
//!         &'r self,
//!         run: &'r mut Run<'_, MemoryStore>,
//!         name: &'r String,
//!     ) -> idem_core::BoxFuture<'r, Result<String, Halt>> {
//!         Box::pin(async move {
//!             // A step's closure may run more than once (contention), so it
//!             // owns what it uses, as `TxEngine::execute`'s work does.
//!             let name = name.clone();
//!             let greeting: String = run
//!                 .local("compose", move |_tx| {
//!                     let name = name.clone();
//!                     Box::pin(async move { Ok(format!("hello, {name}")) })
//!                 })
//!                 .await?;
//!             Ok(greeting)
//!         })
//!     }
//! }
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> idem_core::Result<()> {
//! let engine = StepsEngine::new(MemoryStore::new(), MemoryMultiSteps::new());
//! let scope = Scope::parse("tenant", "greet")?;
//! let call = Call::new(scope.clone(), IdempotencyKey::new("k1")?, Fingerprint::of_bytes(scope.operation(), b"ada"));
//! let first = engine.execute(&Greet, &call, &"ada".to_owned()).await?;
//! let again = engine.execute(&Greet, &call, &"ada".to_owned()).await?;
//! assert!(matches!(first, Finished::Completed { replayed: false, .. }));
//! assert!(matches!(again, Finished::Completed { replayed: true, ref output } if output == "hello, ada"));
//! # Ok(()) }
//! ```

mod completer;
#[cfg(feature = "fault-injection")]
pub mod fault;
mod halt;
#[cfg(feature = "outbound")]
mod outbound;
mod run;

pub use completer::{Pass, Registry};
pub use halt::{Halt, Sending, StepError};
pub use idem_core::Consume;
#[cfg(feature = "outbound")]
pub use outbound::Answer;
pub use run::Run;

#[cfg(feature = "fault-injection")]
pub(crate) use fault::{Point, hit, skips_recovery_points};

/// The fault points of a run, which only the `fault-injection` build
/// stops at.
#[cfg(not(feature = "fault-injection"))]
#[derive(Clone, Copy)]
pub(crate) enum Point {
    BeforeStepCommit,
    AfterStepCommit,
    AfterSentMark,
    AfterAnswer,
}

#[cfg(not(feature = "fault-injection"))]
#[inline(always)]
pub(crate) fn hit(_point: Point, _step: &str) {}

#[cfg(not(feature = "fault-injection"))]
#[inline(always)]
pub(crate) fn skips_recovery_points() -> bool {
    false
}

use std::sync::Arc;

use idem_core::multistep::{HoldKind, MultiStep, MultiStepState, MultiStepStore, NewMultiStep};
use idem_core::{BoxFuture, Call, Clock, Error, Result, SystemClock, Token, TxBackend};
use serde::Serialize;
use serde::de::DeserializeOwned;

/// A multi-step operation's definition: its steps, in the order `run` calls
/// them, and its compensation. `run` is called again on every resume, from
/// the top, and must ask for the same steps in the same order for the same
/// input; a changed definition is a new `NAME`.
pub trait Operation<B: TxBackend>: Send + Sync {
    /// What starts it, kept with it (serialised) so any run can resume it.
    type Input: Serialize + DeserializeOwned + Send + Sync;
    /// What it answers when it completes, recorded and replayed.
    type Output: Serialize + DeserializeOwned + Send;
    /// Its name and version, kept with every operation it runs
    /// (`withdrawal@1`).
    const NAME: &'static str;

    /// Which refusals consume its key. [`Consume::Success`] (the default): a
    /// refusal `run` returns before anything of the operation was committed
    /// (its first local step's declared failure, or its own
    /// [`Halt::Failed`] before any step) records nothing, and the key stays
    /// unused ([`Finished::Rejected`]), so the same key may be tried again
    /// later. [`Consume::SuccessOrFinalRejection`]: such a refusal is
    /// recorded as the operation's outcome, in one transaction, and every
    /// later call of the key replays it ([`Finished::Compensated`], with
    /// nothing to compensate); a call whose refusal finds that a twin
    /// started the operation first answers as the twin's retry, and a
    /// failure too large to record (over 1 MiB encoded) is answered
    /// unrecorded. A refusal that `run` catches and goes on from is not a
    /// refusal of the operation. Faults, deferrals and unknown outcomes are
    /// never recorded this way.
    const CONSUME: Consume = Consume::Success;

    /// Runs its steps (see [`Run`]).
    fn run<'r>(
        &'r self,
        run: &'r mut Run<'_, B>,
        input: &'r Self::Input,
    ) -> BoxFuture<'r, std::result::Result<Self::Output, Halt>>;

    /// Undoes what its forward steps did, after a step declared `failure`;
    /// its steps are recorded and replayed as the forward ones are. The
    /// default undoes nothing.
    fn compensate<'r>(
        &'r self,
        run: &'r mut Run<'_, B>,
        input: &'r Self::Input,
        failure: &'r serde_json::Value,
    ) -> BoxFuture<'r, std::result::Result<(), Halt>> {
        let _ = (run, input, failure);
        Box::pin(async { Ok(()) })
    }
}

/// How a call of an operation ended.
#[derive(Debug, Clone, PartialEq)]
pub enum Finished<T> {
    /// It completed with `output`; `replayed` when an earlier call had.
    Completed {
        /// The recorded output.
        output: T,
        /// Whether this call only read it.
        replayed: bool,
    },
    /// A step declared `failure` and the compensation completed; for an
    /// operation whose [`CONSUME`](Operation::CONSUME) is
    /// [`Consume::SuccessOrFinalRejection`], also a refusal declared before
    /// anything was committed, recorded with nothing to compensate.
    Compensated {
        /// The declared failure.
        failure: serde_json::Value,
        /// Whether this call only read it.
        replayed: bool,
    },
    /// Its first step declared `failure` before anything was recorded: the
    /// key stays unused (an operation that does not consume final
    /// rejections, the default).
    Rejected(serde_json::Value),
    /// It is held (see the operation's row) until an operator acts.
    Held(HoldKind),
    /// Another run holds it, or it waits before it is run again: ask again
    /// later.
    InFlight,
}

/// The default lease of a run: 30 s.
pub const DEFAULT_LEASE_MS: i64 = 30_000;

/// The default time a final operation's outcome is kept: 24 h.
pub const DEFAULT_TTL_MS: i64 = 86_400_000;

/// The most runs an operation gets: one taken more often than this (each
/// run stopped by a crash, a lost lease or a step asking to wait) is held
/// as [`HoldKind::Exhausted`] for an operator.
pub const MAX_RUNS: u32 = 20;

/// Runs [`Operation`]s over the caller's backend `B` and a store of
/// operations `S`.
pub struct StepsEngine<B: TxBackend, S: MultiStepStore<B>> {
    backend: B,
    store: S,
    clock: Arc<dyn Clock>,
    lease_ms: i64,
    ttl_ms: i64,
}

impl<B: TxBackend, S: MultiStepStore<B>> std::fmt::Debug for StepsEngine<B, S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StepsEngine")
            .field("lease_ms", &self.lease_ms)
            .field("ttl_ms", &self.ttl_ms)
            .finish_non_exhaustive()
    }
}

impl<B: TxBackend, S: MultiStepStore<B>> StepsEngine<B, S> {
    /// An engine on the system clock, with a lease of
    /// [`DEFAULT_LEASE_MS`] and outcomes kept [`DEFAULT_TTL_MS`].
    pub fn new(backend: B, store: S) -> Self {
        Self {
            backend,
            store,
            clock: Arc::new(SystemClock),
            lease_ms: DEFAULT_LEASE_MS,
            ttl_ms: DEFAULT_TTL_MS,
        }
    }

    /// Reads time from `clock`.
    pub fn with_clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }

    /// How long a run holds its operation before another may take it over.
    pub fn with_lease_ms(mut self, lease_ms: i64) -> Self {
        self.lease_ms = lease_ms.max(1);
        self
    }

    /// How long a final operation's outcome is kept.
    pub fn with_ttl_ms(mut self, ttl_ms: i64) -> Self {
        self.ttl_ms = ttl_ms.max(1);
        self
    }

    /// The store of operations.
    pub fn store(&self) -> &S {
        &self.store
    }

    /// Runs `op` for `call` with `input`, or resumes it from its last
    /// recovery point, or answers its recorded outcome. A call whose
    /// fingerprint differs from the one that started the operation is
    /// [`Error::Mismatch`]; one of another definition (or version) than the
    /// operation under its key is [`Error::InvalidRequest`].
    pub async fn execute<O: Operation<B>>(&self, op: &O, call: &Call, input: &O::Input) -> Result<Finished<O::Output>> {
        let (done, fresh) = self.execute_once(op, call, input).await?;
        // A first step that refused a call nothing was recorded for may have
        // raced a twin that started the operation (and whose debit left too
        // little for this one): the twin's operation answers this call. So
        // does it for an operation that records such a refusal, whose insert
        // found the twin's row (and so answered in flight).
        let raced = match done {
            Finished::Rejected(_) => true,
            Finished::InFlight => O::CONSUME == Consume::SuccessOrFinalRejection,
            _ => false,
        };
        if fresh && raced && self.store.find(call.scope(), call.key()).await?.is_some() {
            return Ok(self.execute_once(op, call, input).await?.0);
        }
        Ok(done)
    }

    /// One pass of [`execute`](Self::execute); whether it started the
    /// operation afresh.
    async fn execute_once<O: Operation<B>>(
        &self,
        op: &O,
        call: &Call,
        input: &O::Input,
    ) -> Result<(Finished<O::Output>, bool)> {
        let now = self.clock.now_ms();
        let row = match self.store.find(call.scope(), call.key()).await? {
            None => {
                let bytes = serde_json::to_vec(input).map_err(|e| Error::Encode(e.to_string()))?;
                let new = NewMultiStep {
                    scope: call.scope().clone(),
                    key: call.key().clone(),
                    definition: O::NAME.to_owned(),
                    fingerprint: *call.fingerprint(),
                    input: bytes,
                    ttl_ms: self.ttl_ms,
                };
                let row = MultiStep::created(&new, Token::fresh(now).0, now, self.lease_ms)?;
                return Ok((self.drive(op, row).await?, true));
            }
            Some(row) => {
                if !call.accepts(&row.fingerprint) {
                    return Err(Error::Mismatch);
                }
                if row.definition != O::NAME {
                    return Err(Error::InvalidRequest(format!(
                        "the operation under this key runs {:?}, not {:?}",
                        row.definition,
                        O::NAME
                    )));
                }
                if let Some(done) = replay::<O::Output>(&row)? {
                    return Ok((done, false));
                }
                if row.state == MultiStepState::Held {
                    let kind = row.hold.as_ref().map_or(HoldKind::Operator, |h| h.kind);
                    return Ok((Finished::Held(kind), false));
                }
                match self.take(row, now).await? {
                    Some(taken) => taken,
                    None => return Ok((Finished::InFlight, false)),
                }
            }
        };
        Ok((self.drive(op, row).await?, false))
    }

    /// Takes `row` for a run at `now` (a new token, a lease, written over
    /// the version read); `None` when it is not due or another took it
    /// first.
    pub(crate) async fn take(&self, mut row: MultiStep, now: i64) -> Result<Option<MultiStep>> {
        if row.take(now, self.lease_ms).is_none() {
            return Ok(None);
        }
        match self.store.write(&row).await {
            Ok(()) => {
                row.version += 1;
                Ok(Some(row))
            }
            Err(Error::Fenced) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Runs `op` on `row`, which this engine holds (new, or taken), from
    /// its recovery point to its end or a halt.
    pub(crate) async fn drive<O: Operation<B>>(&self, op: &O, row: MultiStep) -> Result<Finished<O::Output>> {
        // Every run reads the input as it was kept, the first one too.
        let input: O::Input =
            serde_json::from_slice(&row.input).map_err(|e| Error::Corrupt(format!("operation input: {e}")))?;
        let token = row.token;
        let mut run = Run {
            backend: &self.backend,
            rows: &self.store,
            clock: self.clock.clone(),
            row,
            token,
            lease_ms: self.lease_ms,
            cursor: 0,
        };
        if run.row.id != 0 && run.row.runs > MAX_RUNS {
            let why = format!("taken {} times without finishing", run.row.runs);
            return Ok(match run.hold(HoldKind::Exhausted, &why).await {
                Halt::Held(kind) => Finished::Held(kind),
                Halt::Store(e) => return Err(e),
                _ => Finished::InFlight,
            });
        }
        if skips_recovery_points() && run.row.id != 0 {
            // Recovery points switched off (a harness proving its checker):
            // every run starts from the first step, sent marks forgotten.
            run.row.journal = idem_core::multistep::Journal::new();
            run.row.open = None;
            run.row.state = MultiStepState::Running;
            run.row.failure = None;
        }
        let forward = if run.compensating() {
            Err(Halt::Failed(run.row.failure.clone().unwrap_or_default()))
        } else {
            op.run(&mut run, &input).await
        };
        // The row says what happened, not the value the code returned: a
        // failure the operation itself returns starts its compensation, and
        // an output returned after a step's declared failure was caught
        // does not skip it.
        let forward = match forward {
            Ok(_) if run.compensating() => Err(Halt::Failed(run.row.failure.clone().unwrap_or_default())),
            Ok(_) if run.unasked() > 0 => Err(run.unasked_hold().await),
            Err(Halt::Failed(failure)) if run.row.id != 0 && !run.compensating() => {
                let declared = failure.clone();
                match run.change(|next, token, now| next.fail(token, declared, now)).await {
                    Ok(()) => Err(Halt::Failed(failure)),
                    Err(h) => Err(h),
                }
            }
            other => other,
        };
        let outcome = match forward {
            Ok(output) => {
                let response = serde_json::to_vec(&output).map_err(|e| Error::Encode(e.to_string()))?;
                finish(&mut run, response).await.map(|()| Finished::Completed {
                    output,
                    replayed: false,
                })
            }
            Err(Halt::Failed(failure)) if run.row.id == 0 => match O::CONSUME {
                Consume::Success => return Ok(Finished::Rejected(failure)),
                Consume::SuccessOrFinalRejection => match run.record_refusal(&failure).await {
                    Ok(true) => Ok(Finished::Compensated {
                        failure,
                        replayed: false,
                    }),
                    Ok(false) => return Ok(Finished::Rejected(failure)),
                    Err(h) => Err(h),
                },
            },
            Err(Halt::Failed(failure)) => {
                run.cursor = 0;
                match op.compensate(&mut run, &input, &failure).await {
                    Ok(()) if run.unasked() > 0 => Err(run.unasked_hold().await),
                    Ok(()) => {
                        let response = serde_json::to_vec(&failure).map_err(|e| Error::Encode(e.to_string()))?;
                        finish(&mut run, response).await.map(|()| Finished::Compensated {
                            failure,
                            replayed: false,
                        })
                    }
                    Err(h) => Err(h),
                }
            }
            Err(h) => Err(h),
        };
        match outcome {
            Ok(done) => Ok(done),
            Err(Halt::Held(kind)) => Ok(Finished::Held(kind)),
            Err(Halt::Deferred | Halt::Fenced) => Ok(Finished::InFlight),
            Err(Halt::Failed(_)) => Err(Error::Config("a compensation step declared a failure".into())),
            Err(Halt::Store(e)) => Err(e),
        }
    }
}

/// Records `response` and ends the operation.
/// Records `response` and ends the operation; a response the row refuses
/// (over its limit) holds it.
async fn finish<B: TxBackend>(run: &mut Run<'_, B>, response: Vec<u8>) -> std::result::Result<(), Halt> {
    run.change(|next, token, now| next.finish(token, response, now)).await
}

/// The recorded outcome of a final operation.
fn replay<T: DeserializeOwned>(row: &MultiStep) -> Result<Option<Finished<T>>> {
    fn decode<V: DeserializeOwned>(bytes: &[u8]) -> Result<V> {
        serde_json::from_slice(bytes).map_err(|e| Error::Corrupt(format!("operation response: {e}")))
    }
    let response = row.response.as_deref().unwrap_or_default();
    Ok(match row.state {
        MultiStepState::Completed => Some(Finished::Completed {
            output: decode(response)?,
            replayed: true,
        }),
        MultiStepState::Compensated => Some(Finished::Compensated {
            failure: decode(response)?,
            replayed: true,
        }),
        _ => None,
    })
}
