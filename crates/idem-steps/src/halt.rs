//! How steps fail, how runs stop, and what an external step's send is told.

use std::sync::Arc;

use idem_core::multistep::{HoldKind, MultiStep, MultiStepStore, OpenSend, SendVerdict};
use idem_core::{BoxFuture, Clock, Error, IdempotencyKey, TxBackend};

/// How a step failed.
#[derive(Debug, Clone, PartialEq)]
pub enum StepError {
    /// A failure the operation declares (a declined payment, a refused
    /// quote): it is recorded, and the operation's compensation runs.
    Declared(serde_json::Value),
    /// An external step may have had its effect and whether it did cannot
    /// be established: the operation is held for an operator's verdict. (A
    /// local step's transaction rolled back: nothing of it was applied, and
    /// it is held as failed.)
    Unknown(String),
    /// Worth trying again later (the vendor is down, it asked to wait, the
    /// database refused a commit): nothing is recorded, and the operation
    /// waits `after_ms` (at most a day) before any runner takes it again.
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

/// Why a run stopped before its operation ended. Steps return it with `?`;
/// an operation's own code may return [`Halt::Failed`] to start its
/// compensation.
#[derive(Debug)]
pub enum Halt {
    /// A step (or the operation) declared this failure: the compensation
    /// runs.
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
#[derive(Clone)]
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
    /// Until when this run holds the operation: no send may start after
    /// it, as another run may take the operation over then.
    pub lease_until_ms: i64,
    pub(crate) clock: Arc<dyn Clock>,
}

impl std::fmt::Debug for Sending {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sending")
            .field("key", &self.key)
            .field("earlier", &self.earlier)
            .field("verdict", &self.verdict)
            .field("lease_until_ms", &self.lease_until_ms)
            .finish_non_exhaustive()
    }
}

impl Sending {
    /// Whether a send may start now: only while this run's lease lasts. A
    /// send retried within the step asks before each attempt.
    pub fn may_send(&self) -> Result<(), String> {
        if self.clock.now_ms() < self.lease_until_ms {
            Ok(())
        } else {
            Err("the run's lease on the operation ran out".into())
        }
    }
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
