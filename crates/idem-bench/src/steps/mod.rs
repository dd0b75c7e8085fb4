//! The multi-step workload: a withdrawal's `debit` (one business row written
//! in the database) and its `payout` (a call to a vendor), done two ways on
//! one store:
//!
//! - `two-step`: one `idem-steps` operation, `debit` a local step
//!   ([`Run::local`]: the insert and the operation's row commit together)
//!   and `payout` an external step ([`Run::external`]: the operation marked
//!   sent, the call, its answer recorded), then the operation finished;
//! - `two-calls`: two single-step calls, as without multi-step operations:
//!   the debit through `TxEngine::execute` (claim, insert and record commit
//!   together), then the payout in lease mode under the same key:
//!   `LeaseEngine::acquire`, `mark_sent`, the call, `complete`.
//!
//! The vendor is a function in this process ([`Vendor`]): it answers at
//! once and counts what it is sent, so every figure is the stores' and the
//! engines' alone.

pub mod report;

use std::collections::HashSet;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use idem_core::{
    Acquire, BoxError, BoxFuture, Call, Fingerprint, IdempotencyKey, InFlight, LeaseEngine, Outcome, Policy, Record,
    Scope, TxEngine,
};
use idem_steps::{Finished, Halt, Operation, Run, StepError, StepsEngine};

use crate::engines::BenchDb;
use crate::measure::Paths;

/// The workload's paths, baseline first.
pub const PATHS: [&str; 2] = ["two-calls", "two-step"];

/// The tenant of the workload's keys.
const TENANT: &str = "idem-bench";

/// What every withdrawal moves.
const AMOUNT: i64 = 1;

/// A vendor with keys, in this process and without latency: a send with a
/// key it has seen answers the same payout and pays nothing more.
#[derive(Debug, Default)]
pub struct Vendor {
    sends: AtomicU64,
    paid: Mutex<HashSet<String>>,
}

impl Vendor {
    /// A vendor that has been sent nothing.
    pub fn new() -> Self {
        Self::default()
    }

    /// Pays under `key` (once per key) and answers the payout's id.
    pub fn pay(&self, key: &IdempotencyKey) -> String {
        self.sends.fetch_add(1, Ordering::Relaxed);
        self.paid
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .insert(key.as_str().to_owned());
        format!("po_{}", key.as_str())
    }

    /// Sends received.
    pub fn sends(&self) -> u64 {
        self.sends.load(Ordering::Relaxed)
    }

    /// Payouts made: the distinct keys sent.
    pub fn payouts(&self) -> u64 {
        self.paid.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).len() as u64
    }
}

/// The two-step operation: `debit` (a local step inserting one business
/// row), then `payout` (an external step to the [`Vendor`]); its output is
/// the payout's id.
pub struct Withdrawal<D> {
    vendor: Arc<Vendor>,
    db: PhantomData<fn() -> D>,
}

impl<D> Withdrawal<D> {
    /// Withdrawals paid out through `vendor`.
    pub fn new(vendor: Arc<Vendor>) -> Self {
        Self {
            vendor,
            db: PhantomData,
        }
    }
}

impl<D: BenchDb> Operation<D> for Withdrawal<D> {
    type Input = i64;
    type Output = String;
    const NAME: &'static str = "bench-withdrawal@1";

    fn run<'r>(&'r self, run: &'r mut Run<'_, D>, _amount: &'r i64) -> BoxFuture<'r, Result<String, Halt>> {
        Box::pin(async move {
            let _debit: String = run
                .local("debit", |tx| {
                    let id = uuid::Uuid::now_v7().to_string();
                    Box::pin(async move {
                        D::insert(tx, id.clone())
                            .await
                            .map_err(|e| StepError::Fatal(format!("debit: {e}")))?;
                        Ok(id)
                    })
                })
                .await?;
            let vendor = self.vendor.clone();
            run.external("payout", move |sending| async move {
                // Nothing was sent: the next run sends.
                sending
                    .may_send()
                    .map_err(|why| StepError::Retry { why, after_ms: 0 })?;
                Ok(vendor.pay(&sending.key))
            })
            .await
        })
    }
}

/// The workload's paths on one store.
pub struct StepsPaths<D: BenchDb> {
    steps: StepsEngine<D, D::Operations>,
    engine: TxEngine<D>,
    lease: LeaseEngine<D>,
    withdrawal: Withdrawal<D>,
    vendor: Arc<Vendor>,
    operation: Scope,
    debit: Scope,
    payout: Scope,
}

impl<D: BenchDb> StepsPaths<D> {
    /// The paths on `db` (its operations in [`BenchDb::operations`]), paying
    /// through `vendor`.
    pub fn new(db: &D, vendor: Arc<Vendor>) -> Result<Self, BoxError> {
        Ok(Self {
            steps: StepsEngine::new(db.clone(), db.operations()),
            engine: TxEngine::new(db.clone()),
            lease: LeaseEngine::new(db.clone()),
            withdrawal: Withdrawal::new(vendor.clone()),
            vendor,
            operation: Scope::parse(TENANT, "POST /bench/withdrawals")?,
            debit: Scope::parse(TENANT, "POST /bench/debits")?,
            payout: Scope::parse(TENANT, "POST /bench/payouts")?,
        })
    }

    /// The vendor the payouts go to.
    pub fn vendor(&self) -> &Arc<Vendor> {
        &self.vendor
    }

    /// One withdrawal as one operation of two steps.
    async fn two_step(&self) -> Result<(), BoxError> {
        let call = call(&self.operation, IdempotencyKey::generate());
        match self.steps.execute(&self.withdrawal, &call, &AMOUNT).await? {
            Finished::Completed { replayed: false, .. } => Ok(()),
            other => Err(format!("a new withdrawal ended {other:?}").into()),
        }
    }

    /// One withdrawal as two single-step calls under one key.
    async fn two_calls(&self) -> Result<(), BoxError> {
        let key = IdempotencyKey::generate();
        let id = uuid::Uuid::now_v7().to_string();
        let debited = self
            .engine
            .execute(&call(&self.debit, key.clone()), move |tx| D::insert(tx, id.clone()))
            .await?;
        if !matches!(debited, Outcome::Executed(())) {
            return Err("a new debit replayed".into());
        }
        let Acquire::Claimed(lease) = self.lease.acquire(&call(&self.payout, key.clone())).await? else {
            return Err("a new payout replayed".into());
        };
        self.lease.mark_sent(&lease).await?;
        let payout = self.vendor.pay(&key);
        self.lease
            .complete(&lease, Record::completed(serde_json::to_vec(&payout)?))
            .await?;
        Ok(())
    }
}

fn call(scope: &Scope, key: IdempotencyKey) -> Call {
    let fingerprint = Fingerprint::of_bytes(scope.operation(), b"bench");
    Call::new(scope.clone(), key, fingerprint)
        .with_policy(Policy::default().with_in_flight(InFlight::Wait { max_ms: 30_000 }))
}

impl<D: BenchDb> Paths for StepsPaths<D> {
    type Key = ();

    async fn one(&self, path: &'static str, _worker: usize, _n: u64, _used: &[()]) -> Result<Option<()>, BoxError> {
        match path {
            "two-step" => self.two_step().await.map(|()| None),
            "two-calls" => self.two_calls().await.map(|()| None),
            other => Err(format!("unknown path {other:?} (two-step, two-calls)").into()),
        }
    }
}
