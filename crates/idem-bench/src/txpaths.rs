//! The paths one unit of database work can take, whatever the work:
//!
//! - `bare`: `TxBackend::begin`, the work, `TxBackend::commit` — no idem;
//! - `fresh`: `TxEngine::execute` with a new key (claim, work and record
//!   commit together);
//! - `replay`: `TxEngine::execute` with a key already used (the work never runs);
//! - `fresh+read`, `replay+read`: the same on an engine that reads the key's
//!   row before it claims (`TxEngine::with_read_first`);
//! - `three-commit`: the pattern of AWS Powertools and Rocket Rides, which is
//!   idem's lease mode: `LeaseEngine::acquire` commits the claim, the work
//!   commits in its own transaction, `LeaseEngine::complete` commits the
//!   outcome.
//!
//! A bare or three-commit work transaction that loses a race (deadlock,
//! serialisation failure) runs again, as `TxEngine::execute` does, so every
//! path does the same work per operation.

use idem_core::{
    Acquire, BoxError, BoxFuture, Call, Contention, ContentionRetries, Fingerprint, IdempotencyKey, InFlight,
    LeaseEngine, Outcome, Policy, Record, Scope, TxBackend, TxEngine,
};
use ledger::db::DbError;

use crate::engines::BenchDb;
use crate::measure::Paths;

/// One unit of business work inside a transaction.
pub trait Work<D: TxBackend>: Clone + Send + Sync + 'static {
    /// Runs the `n`th operation of `worker` in `tx`.
    fn run<'c>(&self, tx: &'c mut D::Tx, worker: usize, n: u64) -> BoxFuture<'c, Result<(), DbError>>;
}

/// A work measured along the four paths, on one store.
pub struct TxPaths<D: BenchDb, W> {
    db: D,
    engine: TxEngine<D>,
    read_first: TxEngine<D>,
    lease: LeaseEngine<D>,
    scope: Scope,
    work: W,
}

impl<D: BenchDb, W: Work<D>> TxPaths<D, W> {
    /// `work` on `db`, its keys under `operation`.
    pub fn new(db: &D, operation: &str, work: W) -> Result<Self, BoxError> {
        Ok(Self {
            db: db.clone(),
            engine: TxEngine::new(db.clone()),
            read_first: TxEngine::new(db.clone()).with_read_first(true),
            lease: LeaseEngine::new(db.clone()),
            scope: Scope::parse("idem-bench", operation)?,
            work,
        })
    }
}

fn call(scope: &Scope, key: IdempotencyKey) -> Call {
    let fingerprint = Fingerprint::of_bytes(scope.operation(), b"bench");
    Call::new(scope.clone(), key, fingerprint)
        .with_policy(Policy::default().with_in_flight(InFlight::Wait { max_ms: 30_000 }))
}

/// The work in a transaction of its own, run again on contention.
async fn plain<D: BenchDb, W: Work<D>>(db: &D, work: &W, worker: usize, n: u64) -> Result<(), BoxError> {
    let mut retries = ContentionRetries::new();
    loop {
        let mut tx = db.begin().await?;
        let result = match work.run(&mut tx, worker, n).await {
            Ok(()) => db.commit(tx).await.map_err(DbError::from),
            Err(e) => {
                let _ = db.rollback(tx).await;
                Err(e)
            }
        };
        match result {
            Err(e) if e.is_contention() && retries.again("bench", idem_core::metrics::Stage::Work).await => continue,
            other => return Ok(other?),
        }
    }
}

impl<D: BenchDb, W: Work<D>> TxPaths<D, W> {
    /// A call with a new key on `engine`: its key.
    async fn fresh(&self, engine: &TxEngine<D>, worker: usize, n: u64) -> Result<IdempotencyKey, BoxError> {
        let key = IdempotencyKey::generate();
        let out = engine
            .execute(&call(&self.scope, key.clone()), |tx| self.work.run(tx, worker, n))
            .await?;
        match out {
            Outcome::Executed(()) => Ok(key),
            Outcome::Replayed(()) => Err("a fresh key replayed".into()),
        }
    }

    /// A call with one of the `used` keys on `engine`, which must replay.
    async fn replay(
        &self,
        engine: &TxEngine<D>,
        worker: usize,
        n: u64,
        used: &[IdempotencyKey],
    ) -> Result<(), BoxError> {
        let key = used
            .get((worker * 7919 + n as usize) % used.len().max(1))
            .ok_or("no keys to replay")?;
        let out = engine
            .execute(&call(&self.scope, key.clone()), |_tx| {
                Box::pin(async { Err::<(), _>(DbError::Corrupt("a used key executed".into())) })
            })
            .await?;
        match out {
            Outcome::Replayed(()) => Ok(()),
            Outcome::Executed(()) => Err("a used key executed".into()),
        }
    }
}

impl<D: BenchDb, W: Work<D>> Paths for TxPaths<D, W> {
    type Key = IdempotencyKey;

    async fn one(
        &self,
        path: &'static str,
        worker: usize,
        n: u64,
        used: &[IdempotencyKey],
    ) -> Result<Option<IdempotencyKey>, BoxError> {
        match path {
            "bare" => plain(&self.db, &self.work, worker, n).await.map(|()| None),
            "fresh" => self.fresh(&self.engine, worker, n).await.map(Some),
            "fresh+read" => self.fresh(&self.read_first, worker, n).await.map(Some),
            "replay" => self.replay(&self.engine, worker, n, used).await.map(|()| None),
            "replay+read" => self.replay(&self.read_first, worker, n, used).await.map(|()| None),
            "three-commit" => {
                let call = call(&self.scope, IdempotencyKey::generate());
                let Acquire::Claimed(lease) = self.lease.acquire(&call).await? else {
                    return Err("a fresh key replayed".into());
                };
                if let Err(e) = plain(&self.db, &self.work, worker, n).await {
                    let _ = self.lease.release(&lease).await;
                    return Err(e);
                }
                self.lease.complete(&lease, Record::completed(b"null".to_vec())).await?;
                Ok(None)
            }
            other => Err(format!("unknown path {other:?}").into()),
        }
    }
}
