//! A store that fails on purpose.
//!
//! [`Faulty`] wraps any idem store and, at a set rate per call or on
//! demand, makes a call fail the way real stores fail:
//!
//! - [`Fault::Refused`]: the store refuses the call and writes nothing
//!   (a full Redis at `maxmemory`, a write-locked SQLite file, a lost
//!   connection before the statement ran);
//! - [`Fault::TimedOut`]: the call hangs for a while, then fails, having
//!   written nothing;
//! - [`Fault::AppliedThenRefused`]: the call is applied, and then reported
//!   as failed (a connection cut after the commit, before its answer).
//!
//! Every recovery path of idem must hold against all three: a refused
//! completion is tried again, a write applied but reported as failed is
//! recognised on the next try, a claim whose mark was refused sends
//! nothing. The conformance suite and the chaos harness run their stores
//! through it.
//!
//! ```
//! use idem_faults::{Fault, FaultPlan, Faulty, Op};
//! use idem_memory::MemoryStore;
//!
//! let store = Faulty::new(MemoryStore::new(), FaultPlan::none());
//! // The next completion is applied and then reported as failed.
//! store.faults().fail_next(Op::Complete, Fault::AppliedThenRefused);
//! ```

use std::collections::VecDeque;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

mod deadletter;
mod multistep;
mod tx;

use idem_core::{
    BoxFuture, ClaimRequest, Error, IdempotencyKey, KeyAdmin, KeyFilter, KeyInfo, KeyStats, Lease, LeaseClaim,
    LeaseStore, Record, Resolution, Result, Scope, StoreErrorKind, StoredRow, Sweep, SweepBatch, TimeSource,
};

/// How many kinds of call there are.
const OPS: usize = 15;

/// A way for one store call to fail.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Fault {
    /// Refused: nothing written, an error answered at once.
    Refused,
    /// Hung for the plan's delay, then failed; nothing written.
    TimedOut,
    /// Applied, then reported as failed.
    AppliedThenRefused,
}

impl Fault {
    /// Its name in reports.
    pub fn name(self) -> &'static str {
        match self {
            Fault::Refused => "refused",
            Fault::TimedOut => "timed_out",
            Fault::AppliedThenRefused => "applied_then_refused",
        }
    }
}

/// The store calls a fault can hit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Op {
    /// [`LeaseStore::try_claim`], and a transactional claim
    /// ([`TxBackend::claim`](idem_core::TxBackend::claim), `begin_claim`).
    Claim,
    /// [`LeaseStore::mark_sent`].
    MarkSent,
    /// [`LeaseStore::complete`] (outcomes, unknown ones included).
    Complete,
    /// [`LeaseStore::release`].
    Release,
    /// [`LeaseStore::extend`].
    Extend,
    /// [`LeaseStore::resolve_unknown`].
    Resolve,
    /// [`LeaseStore::lookup`], and a transactional engine's read before its
    /// claim ([`TxBackend::read_committed`](idem_core::TxBackend::read_committed)).
    Lookup,
    /// A transaction's commit ([`TxBackend::commit`](idem_core::TxBackend::commit),
    /// `record_commit`): the claim, the caller's writes and the outcome.
    Commit,
    /// [`DeadLetterStore::record`](idem_core::DeadLetterStore::record).
    LetterRecord,
    /// [`DeadLetterStore::begin_redrive`](idem_core::DeadLetterStore::begin_redrive).
    LetterTake,
    /// [`DeadLetterStore::finish_redrive`](idem_core::DeadLetterStore::finish_redrive).
    LetterFinish,
    /// [`DeadLetterStore::settle`](idem_core::DeadLetterStore::settle) and
    /// [`cancel`](idem_core::DeadLetterStore::cancel).
    LetterSettle,
    /// [`MultiStepStore::insert_in`](idem_core::multistep::MultiStepStore::insert_in):
    /// an operation's first write, in its first step's transaction.
    StepInsert,
    /// [`MultiStepStore::write_in`](idem_core::multistep::MultiStepStore::write_in)
    /// (a recovery point, in its step's transaction) and
    /// [`write`](idem_core::multistep::MultiStepStore::write) (a take, a
    /// sent mark, an answer, a hold, the end, in a transaction of its own).
    StepWrite,
    /// [`MultiStepStore::find`](idem_core::multistep::MultiStepStore::find),
    /// [`get`](idem_core::multistep::MultiStepStore::get) and
    /// [`due`](idem_core::multistep::MultiStepStore::due).
    StepRead,
}

impl Op {
    const ALL: [Op; OPS] = [
        Op::Claim,
        Op::MarkSent,
        Op::Complete,
        Op::Release,
        Op::Extend,
        Op::Resolve,
        Op::Lookup,
        Op::Commit,
        Op::LetterRecord,
        Op::LetterTake,
        Op::LetterFinish,
        Op::LetterSettle,
        Op::StepInsert,
        Op::StepWrite,
        Op::StepRead,
    ];

    /// Its name in reports.
    pub fn name(self) -> &'static str {
        match self {
            Op::Claim => "claim",
            Op::MarkSent => "mark_sent",
            Op::Complete => "complete",
            Op::Release => "release",
            Op::Extend => "extend",
            Op::Resolve => "resolve",
            Op::Lookup => "lookup",
            Op::Commit => "commit",
            Op::LetterRecord => "letter_record",
            Op::LetterTake => "letter_take",
            Op::LetterFinish => "letter_finish",
            Op::LetterSettle => "letter_settle",
            Op::StepInsert => "step_insert",
            Op::StepWrite => "step_write",
            Op::StepRead => "step_read",
        }
    }

    fn index(self) -> usize {
        Op::ALL.iter().position(|o| *o == self).unwrap_or(0)
    }

    /// Whether the call only reads: a read has nothing to apply, so
    /// [`Fault::AppliedThenRefused`] is a plain refusal there.
    fn reads(self) -> bool {
        matches!(self, Op::Lookup | Op::StepRead)
    }
}

/// How often each fault is drawn, per call, and how long a timeout hangs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FaultPlan {
    /// Odds (0 to 1) that a call is refused.
    pub refused: f64,
    /// Odds that a call times out.
    pub timed_out: f64,
    /// Odds that a call is applied and then reported as failed.
    pub applied_then_refused: f64,
    /// How long a timed-out call hangs before it fails.
    pub timeout: Duration,
    /// The seed of the draws: one seed, one sequence of faults for one
    /// sequence of calls.
    pub seed: u64,
}

impl FaultPlan {
    /// No drawn faults (faults asked for with [`Faults::fail_next`] still
    /// happen).
    pub fn none() -> Self {
        Self {
            refused: 0.0,
            timed_out: 0.0,
            applied_then_refused: 0.0,
            timeout: Duration::from_millis(200),
            seed: 0,
        }
    }

    /// Each fault at `rate` (0 to 1) per call, with this seed.
    pub fn each_at(rate: f64, seed: u64) -> Self {
        let rate = if rate.is_finite() {
            rate.clamp(0.0, 1.0 / 3.0)
        } else {
            0.0
        };
        Self {
            refused: rate,
            timed_out: rate,
            applied_then_refused: rate,
            seed,
            ..Self::none()
        }
    }
}

/// The faults of one [`Faulty`] store (its clones share them): the plan,
/// the faults asked for next, and counts of what was injected.
pub struct Faults {
    plan: Mutex<FaultPlan>,
    state: Mutex<u64>,
    queued: Mutex<VecDeque<(Op, u64, Fault)>>,
    counts: [[AtomicU64; 3]; OPS],
    calls: [AtomicU64; OPS],
    on_fault: Mutex<Option<FaultHook>>,
}

/// What [`Faults::on_fault`] calls with each injected fault.
type FaultHook = Arc<dyn Fn(Op, Fault) + Send + Sync>;

impl fmt::Debug for Faults {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Faults")
            .field("plan", &*self.plan.lock().unwrap_or_else(PoisonError::into_inner))
            .field("injected", &self.injected())
            .finish()
    }
}

impl Faults {
    fn new(plan: FaultPlan) -> Self {
        Self {
            state: Mutex::new(plan.seed ^ 0x9E37_79B9_7F4A_7C15),
            plan: Mutex::new(plan),
            queued: Mutex::new(VecDeque::new()),
            counts: Default::default(),
            calls: Default::default(),
            on_fault: Mutex::new(None),
        }
    }

    /// Calls `hook` with every fault injected from now on, as it is
    /// injected (before the call fails): a process that may be killed at
    /// any moment can report each fault as it happens.
    pub fn on_fault(&self, hook: impl Fn(Op, Fault) + Send + Sync + 'static) {
        *self.on_fault.lock().unwrap_or_else(PoisonError::into_inner) = Some(Arc::new(hook));
    }

    /// Replaces the plan (the draws go on from where they were).
    pub fn set_plan(&self, plan: FaultPlan) {
        *self.plan.lock().unwrap_or_else(PoisonError::into_inner) = plan;
    }

    /// Makes the next call of `op` fail with `fault`, whatever the plan
    /// says. Several queued faults of one call kind happen in order.
    pub fn fail_next(&self, op: Op, fault: Fault) {
        self.fail_nth(op, 0, fault);
    }

    /// Lets `n` calls of `op` pass (as the plan says) and makes the one
    /// after them fail with `fault`: walking `n` up from 0 hits each call
    /// of one kind a run makes, one run at a time. Queued after other
    /// faults of the same kind, it counts its calls once they are done.
    pub fn fail_nth(&self, op: Op, n: u64, fault: Fault) {
        self.queued
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push_back((op, n, fault));
    }

    /// How many faults of each kind were injected into calls of each kind,
    /// as `(call, fault, count)`, leaving out zeros.
    pub fn injected(&self) -> Vec<(&'static str, &'static str, u64)> {
        let faults = [Fault::Refused, Fault::TimedOut, Fault::AppliedThenRefused];
        let mut out = Vec::new();
        for op in Op::ALL {
            for (i, fault) in faults.iter().enumerate() {
                let n = self.counts[op.index()][i].load(Ordering::Relaxed);
                if n > 0 {
                    out.push((op.name(), fault.name(), n));
                }
            }
        }
        out
    }

    /// How many faults were injected in all.
    pub fn total(&self) -> u64 {
        self.counts.iter().flatten().map(|c| c.load(Ordering::Relaxed)).sum()
    }

    /// How many calls of `op` the store received.
    pub fn calls(&self, op: Op) -> u64 {
        self.calls[op.index()].load(Ordering::Relaxed)
    }

    /// The fault for this call of `op`, if any.
    fn draw(&self, op: Op) -> Option<Fault> {
        self.calls[op.index()].fetch_add(1, Ordering::Relaxed);
        let fault = {
            let mut queued = self.queued.lock().unwrap_or_else(PoisonError::into_inner);
            match queued.iter().position(|(o, _, _)| *o == op) {
                Some(i) if queued[i].1 > 0 => {
                    queued[i].1 -= 1;
                    None
                }
                Some(i) => queued.remove(i).map(|(_, _, f)| f),
                None => None,
            }
        }
        .or_else(|| {
            let plan = *self.plan.lock().unwrap_or_else(PoisonError::into_inner);
            let roll = self.next_unit();
            if roll < plan.refused {
                Some(Fault::Refused)
            } else if roll < plan.refused + plan.timed_out {
                Some(Fault::TimedOut)
            } else if roll < plan.refused + plan.timed_out + plan.applied_then_refused {
                Some(Fault::AppliedThenRefused)
            } else {
                None
            }
        })?;
        let fault = if op.reads() && fault == Fault::AppliedThenRefused {
            Fault::Refused
        } else {
            fault
        };
        let i = match fault {
            Fault::Refused => 0,
            Fault::TimedOut => 1,
            Fault::AppliedThenRefused => 2,
        };
        self.counts[op.index()][i].fetch_add(1, Ordering::Relaxed);
        tracing::debug!(call = op.name(), fault = fault.name(), "injected a store fault");
        let hook = self.on_fault.lock().unwrap_or_else(PoisonError::into_inner).clone();
        if let Some(hook) = hook {
            hook(op, fault);
        }
        Some(fault)
    }

    /// A uniform draw in [0, 1) (splitmix64).
    fn next_unit(&self) -> f64 {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = *state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64
    }

    fn timeout(&self) -> Duration {
        self.plan.lock().unwrap_or_else(PoisonError::into_inner).timeout
    }
}

/// The error a faulty call answers: an unavailable store, as a driver
/// reports a refused or broken connection.
fn injected(fault: Fault, op: Op) -> Error {
    Error::store(
        StoreErrorKind::Unavailable,
        format!("injected fault: {} on {}", fault.name(), op.name()),
    )
}

/// A store wrapped so that its calls fail on purpose (see the crate's
/// documentation). Clones share the store and the [`Faults`].
pub struct Faulty<S> {
    inner: Arc<S>,
    faults: Arc<Faults>,
}

impl<S> Clone for Faulty<S> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            faults: self.faults.clone(),
        }
    }
}

impl<S: fmt::Debug> fmt::Debug for Faulty<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Faulty")
            .field("inner", &self.inner)
            .field("faults", &self.faults)
            .finish()
    }
}

impl<S> Faulty<S> {
    /// `inner`, failing as `plan` says.
    pub fn new(inner: S, plan: FaultPlan) -> Self {
        Self {
            inner: Arc::new(inner),
            faults: Arc::new(Faults::new(plan)),
        }
    }

    /// The faults: the plan, faults asked for next, and counts.
    pub fn faults(&self) -> &Arc<Faults> {
        &self.faults
    }

    /// The wrapped store.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    /// `other` wrapped with these very faults: one plan, one sequence of
    /// draws and one set of counts for every store of a process (its keys,
    /// its dead letters, its other tables).
    pub fn beside<T>(&self, other: T) -> Faulty<T> {
        Faulty {
            inner: Arc::new(other),
            faults: self.faults.clone(),
        }
    }

    /// Runs `call` under this call's fault, if any: the wrapped store's own
    /// calls, and a caller's writes beside them (an application's own
    /// statement on the same database, failing as a store call of kind
    /// `op` would).
    pub async fn faulty<T, E: From<Error>>(
        &self,
        op: Op,
        call: impl std::future::Future<Output = std::result::Result<T, E>>,
    ) -> std::result::Result<T, E> {
        match self.faults.draw(op) {
            None => call.await,
            Some(Fault::Refused) => Err(injected(Fault::Refused, op).into()),
            Some(Fault::TimedOut) => {
                tokio::time::sleep(self.faults.timeout()).await;
                Err(injected(Fault::TimedOut, op).into())
            }
            Some(Fault::AppliedThenRefused) => {
                // Whatever the store answered, the caller hears a failure.
                let _ = call.await;
                Err(injected(Fault::AppliedThenRefused, op).into())
            }
        }
    }
}

impl<S: LeaseStore> LeaseStore for Faulty<S> {
    fn try_claim<'a>(&'a self, req: &'a ClaimRequest<'a>) -> BoxFuture<'a, Result<LeaseClaim>> {
        Box::pin(self.faulty(Op::Claim, self.inner.try_claim(req)))
    }

    fn mark_sent<'a>(&'a self, lease: &'a Lease, now_ms: i64) -> BoxFuture<'a, Result<()>> {
        Box::pin(self.faulty(Op::MarkSent, self.inner.mark_sent(lease, now_ms)))
    }

    fn lookup<'a>(&'a self, scope: &'a Scope, key: &'a IdempotencyKey) -> BoxFuture<'a, Result<Option<StoredRow>>> {
        Box::pin(self.faulty(Op::Lookup, self.inner.lookup(scope, key)))
    }

    fn complete<'a>(&'a self, lease: &'a Lease, record: &'a Record) -> BoxFuture<'a, Result<()>> {
        Box::pin(self.faulty(Op::Complete, self.inner.complete(lease, record)))
    }

    fn release<'a>(&'a self, lease: &'a Lease) -> BoxFuture<'a, Result<()>> {
        Box::pin(self.faulty(Op::Release, self.inner.release(lease)))
    }

    fn extend<'a>(&'a self, lease: &'a Lease, lease_expires_at_ms: i64) -> BoxFuture<'a, Result<()>> {
        Box::pin(self.faulty(Op::Extend, self.inner.extend(lease, lease_expires_at_ms)))
    }

    fn resolve_unknown<'a>(&'a self, req: &'a Resolution<'a>) -> BoxFuture<'a, Result<bool>> {
        Box::pin(self.faulty(Op::Resolve, self.inner.resolve_unknown(req)))
    }
}

/// Sweeps, clocks and the operator's view pass through unharmed: the
/// faults aim at the paths that carry outcomes.
impl<S: Sweep> Sweep for Faulty<S> {
    fn sweep_expired(&self, now_ms: i64, limit: u32) -> BoxFuture<'_, Result<u64>> {
        self.inner.sweep_expired(now_ms, limit)
    }

    fn sweep_batch(&self, now_ms: i64, limit: u32) -> BoxFuture<'_, Result<SweepBatch>> {
        self.inner.sweep_batch(now_ms, limit)
    }
}

impl<S: TimeSource> TimeSource for Faulty<S> {
    fn source_now_ms(&self) -> BoxFuture<'_, Result<i64>> {
        self.inner.source_now_ms()
    }
}

impl<S: KeyAdmin> KeyAdmin for Faulty<S> {
    fn stats(&self, now_ms: i64) -> BoxFuture<'_, Result<KeyStats>> {
        self.inner.stats(now_ms)
    }

    fn list_keys<'a>(&'a self, filter: &'a KeyFilter, now_ms: i64, limit: u32) -> BoxFuture<'a, Result<Vec<KeyInfo>>> {
        self.inner.list_keys(filter, now_ms, limit)
    }

    fn find_key<'a>(
        &'a self,
        scope: &'a Scope,
        key: &'a IdempotencyKey,
        now_ms: i64,
    ) -> BoxFuture<'a, Result<Option<KeyInfo>>> {
        self.inner.find_key(scope, key, now_ms)
    }

    fn purge_keys<'a>(&'a self, filter: &'a KeyFilter, now_ms: i64, limit: u32) -> BoxFuture<'a, Result<u64>> {
        self.inner.purge_keys(filter, now_ms, limit)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One seed gives one sequence of faults, and the rates are honoured.
    #[test]
    fn draws_follow_the_seed_and_the_rates() {
        let a = Faults::new(FaultPlan::each_at(0.1, 7));
        let b = Faults::new(FaultPlan::each_at(0.1, 7));
        let seq_a: Vec<_> = (0..1_000).map(|_| a.draw(Op::Complete)).collect();
        let seq_b: Vec<_> = (0..1_000).map(|_| b.draw(Op::Complete)).collect();
        assert_eq!(seq_a, seq_b);
        let faults = seq_a.iter().flatten().count();
        assert!((200..400).contains(&faults), "30% of 1,000 calls, got {faults}");
        assert_eq!(a.total(), faults as u64);
        assert_eq!(a.calls(Op::Complete), 1_000);
    }

    /// A fault asked for hits the next call of its kind only.
    #[test]
    fn queued_faults_hit_their_own_call() {
        let f = Faults::new(FaultPlan::none());
        f.fail_next(Op::Complete, Fault::Refused);
        assert_eq!(f.draw(Op::Extend), None);
        assert_eq!(f.draw(Op::Complete), Some(Fault::Refused));
        assert_eq!(f.draw(Op::Complete), None);
        assert_eq!(f.injected(), vec![("complete", "refused", 1)]);
    }

    /// A fault asked for after `n` calls lets them pass and hits the next.
    #[test]
    fn nth_fault_waits_for_its_call() {
        let f = Faults::new(FaultPlan::none());
        f.fail_nth(Op::StepWrite, 2, Fault::AppliedThenRefused);
        f.fail_next(Op::StepRead, Fault::AppliedThenRefused);
        assert_eq!(f.draw(Op::StepWrite), None);
        assert_eq!(
            f.draw(Op::StepRead),
            Some(Fault::Refused),
            "a read has nothing to apply"
        );
        assert_eq!(f.draw(Op::StepWrite), None);
        assert_eq!(f.draw(Op::StepWrite), Some(Fault::AppliedThenRefused));
        assert_eq!(f.draw(Op::StepWrite), None);
        assert_eq!(f.calls(Op::StepWrite), 4);
    }

    /// Stores wrapped beside one another share one plan and one count, and
    /// the hook hears every injected fault as it happens.
    #[test]
    fn stores_beside_share_their_faults_and_the_hook_hears_each() {
        let first = Faulty::new((), FaultPlan::each_at(0.2, 7));
        let second = first.beside("letters");
        let heard = Arc::new(Mutex::new(Vec::new()));
        {
            let heard = heard.clone();
            first
                .faults()
                .on_fault(move |op, fault| heard.lock().unwrap().push((op, fault)));
        }
        for _ in 0..500 {
            first.faults().draw(Op::Claim);
            second.faults().draw(Op::LetterTake);
        }
        assert_eq!(second.faults().calls(Op::Claim), 500);
        assert_eq!(first.faults().calls(Op::LetterTake), 500);
        let heard = heard.lock().unwrap();
        assert_eq!(heard.len() as u64, first.faults().total());
        assert!(heard.iter().any(|(op, _)| *op == Op::Claim));
        assert!(heard.iter().any(|(op, _)| *op == Op::LetterTake));
        assert_eq!(*second.inner(), "letters");
    }

    /// A write applied and reported as failed is really applied; a refused
    /// one is not.
    #[tokio::test]
    async fn applied_then_refused_writes_and_refused_does_not() {
        use idem_core::{Acquire, Call, Fingerprint, LeaseEngine, Policy};
        let store = Faulty::new(idem_memory::MemoryStore::new(), FaultPlan::none());
        let engine = LeaseEngine::new(store.clone());
        let scope = Scope::parse("t", "op").unwrap();
        let call = |k: &str| {
            Call::new(
                scope.clone(),
                IdempotencyKey::new(k).unwrap(),
                Fingerprint::of_bytes(scope.operation(), b""),
            )
            .with_policy(Policy::default())
        };
        for (key, fault, written) in [("a", Fault::Refused, false), ("b", Fault::AppliedThenRefused, true)] {
            let Acquire::Claimed(lease) = engine.acquire(&call(key)).await.unwrap() else {
                panic!()
            };
            store.faults().fail_next(Op::Complete, fault);
            let record = Record::completed(b"1".to_vec());
            assert!(store.complete(&lease, &record).await.is_err());
            let row = store
                .inner()
                .lookup(&scope, &IdempotencyKey::new(key).unwrap())
                .await
                .unwrap()
                .unwrap();
            assert_eq!(matches!(row.state, idem_core::RowState::Done(_)), written, "{fault:?}");
        }
    }
}
