//! The ledger's transfer as a unit of work: exactly the ledger's SQL
//! (`LedgerTx::transfer`: two guarded balance updates in a fixed order, a
//! journal row and two entries), between random pairs of funded accounts.

use std::sync::Arc;

use idem_core::{BoxError, BoxFuture};
use ledger::db::{DbError, LedgerDb, LedgerTx, MAX_AMOUNT};

use crate::txpaths::Work;

/// The tenant of the library-level transfers.
pub const TENANT: &str = "idem-bench";

/// Each transfer moves one minor unit, so no funded account runs dry.
const AMOUNT: i64 = 1;

/// Creates `count` accounts of `tenant`, each funded with the largest
/// top-up, in one transaction; answers their ids.
pub async fn fund_accounts<D: LedgerDb>(db: &D, tenant: &str, count: usize) -> Result<Arc<Vec<String>>, BoxError> {
    let now_ms = now_ms();
    let mut tx = db.begin().await?;
    let mut ids = Vec::with_capacity(count);
    for i in 0..count {
        let id = uuid::Uuid::now_v7().to_string();
        tx.insert_account(tenant, &id, &format!("bench {i}"), now_ms).await?;
        let journal = uuid::Uuid::now_v7().to_string();
        tx.top_up(tenant, &journal, "top_up", &id, MAX_AMOUNT, now_ms).await?;
        ids.push(id);
    }
    db.commit(tx).await?;
    Ok(Arc::new(ids))
}

/// Milliseconds since the epoch.
pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// A pseudo-random pair of distinct accounts for the `n`th operation of
/// `worker` (SplitMix64: no shared generator between workers).
pub fn pair(accounts: &[String], worker: usize, n: u64) -> (&str, &str) {
    let mut z = (worker as u64)
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add(n.wrapping_mul(0xBF58_476D_1CE4_E5B9));
    let mut next = || {
        z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut x = z;
        x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        (x ^ (x >> 31)) as usize
    };
    let len = accounts.len();
    let from = next() % len;
    let to = (from + 1 + next() % (len - 1)) % len;
    (&accounts[from], &accounts[to])
}

/// One transfer between a random pair of `accounts` of [`TENANT`].
#[derive(Debug, Clone)]
pub struct Transfer {
    accounts: Arc<Vec<String>>,
}

impl Transfer {
    /// Transfers among `accounts` (at least two).
    pub fn new(accounts: Arc<Vec<String>>) -> Self {
        Self { accounts }
    }
}

impl<D: LedgerDb> Work<D> for Transfer {
    fn run<'c>(&self, tx: &'c mut D::Tx, worker: usize, n: u64) -> BoxFuture<'c, Result<(), DbError>> {
        let accounts = self.accounts.clone();
        Box::pin(async move {
            let (from, to) = pair(&accounts, worker, n);
            let journal = uuid::Uuid::now_v7().to_string();
            tx.transfer(TENANT, &journal, from, to, AMOUNT, now_ms()).await
        })
    }
}
