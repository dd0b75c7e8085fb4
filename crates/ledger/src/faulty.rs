//! The ledger on a store that fails on purpose (feature `fault-injection`):
//! with `LEDGER_STORE_FAULTS=<rate>`, every idempotency claim, commit,
//! payout lease write and dead-letter write of the API and of the payout
//! worker is refused, timed out, or applied and reported as failed, each at
//! `rate` per call ([`idem_faults::FaultPlan::each_at`], seeded by
//! `LEDGER_FAULT_SEED` mixed with the process id); so are the reads and
//! writes of the withdrawals' multi-step operations and their steps'
//! commits. Each injected fault is printed on stderr as
//! `IDEM_STORE_FAULT call=<call> fault=<fault>` as it happens, so the
//! reliability harness counts them even in a process it kills.

use std::io::Write;
use std::sync::OnceLock;

use idem_core::{BoxFuture, NewDeadLetter, OutboxEvent, TableName};
use idem_faults::{FaultPlan, Faulty};

use crate::db::{Account, Audit, DbError, LedgerDb, Payout, PayoutState, PayoutTask, Statement, Withdrawal};

/// The process's faults, if `LEDGER_STORE_FAULTS` asks for any: a holder
/// whose [`Faulty::beside`] wraps each store with the one shared plan.
pub fn store_faults() -> Option<&'static Faulty<()>> {
    static FAULTS: OnceLock<Option<Faulty<()>>> = OnceLock::new();
    FAULTS
        .get_or_init(|| {
            let rate: f64 = std::env::var("LEDGER_STORE_FAULTS").ok()?.trim().parse().ok()?;
            if !(rate > 0.0 && rate <= 1.0 / 3.0) {
                tracing::error!(rate, "LEDGER_STORE_FAULTS must be in (0, 1/3]; no store faults");
                return None;
            }
            let seed = std::env::var("LEDGER_FAULT_SEED")
                .ok()
                .and_then(|s| s.parse::<u64>().ok())
                .unwrap_or(0)
                ^ u64::from(std::process::id()).rotate_left(17);
            let holder = Faulty::new((), FaultPlan::each_at(rate, seed));
            holder.faults().on_fault(|op, fault| {
                let mut err = std::io::stderr().lock();
                let _ = writeln!(err, "IDEM_STORE_FAULT call={} fault={}", op.name(), fault.name());
                let _ = err.flush();
            });
            tracing::warn!(rate, "store faults armed");
            Some(holder)
        })
        .as_ref()
}

impl<S: LedgerDb> LedgerDb for Faulty<S>
where
    S::DeadLetters: Send + Sync + 'static,
{
    fn migrate(&self) -> BoxFuture<'_, Result<(), DbError>> {
        self.inner().migrate()
    }
    fn ping(&self) -> BoxFuture<'_, Result<(), DbError>> {
        self.inner().ping()
    }
    fn account<'a>(&'a self, tenant: &'a str, id: &'a str) -> BoxFuture<'a, Result<Option<Account>, DbError>> {
        self.inner().account(tenant, id)
    }
    fn audit<'a>(&'a self, tenant: &'a str) -> BoxFuture<'a, Result<Audit, DbError>> {
        self.inner().audit(tenant)
    }
    type Outbox = S::Outbox;
    fn outbox(&self) -> Self::Outbox {
        self.inner().outbox()
    }
    fn enqueue<'c>(
        outbox: &'c Self::Outbox,
        tx: &'c mut Self::Tx,
        event: &'c OutboxEvent,
    ) -> BoxFuture<'c, Result<(), DbError>> {
        S::enqueue(outbox, tx, event)
    }
    fn keyed(&self, table: TableName) -> Self {
        self.beside(self.inner().keyed(table))
    }
    fn statement<'a>(
        &'a self,
        tenant: &'a str,
        account_id: &'a str,
    ) -> BoxFuture<'a, Result<Option<Statement>, DbError>> {
        self.inner().statement(tenant, account_id)
    }
    fn payout<'a>(&'a self, tenant: &'a str, id: &'a str) -> BoxFuture<'a, Result<Option<Payout>, DbError>> {
        self.inner().payout(tenant, id)
    }
    fn payouts_in(&self, state: PayoutState, limit: u32) -> BoxFuture<'_, Result<Vec<PayoutTask>, DbError>> {
        self.inner().payouts_in(state, limit)
    }
    fn payouts_redriven<'a>(
        &'a self,
        operation: &'a str,
        limit: u32,
    ) -> BoxFuture<'a, Result<Vec<PayoutTask>, DbError>> {
        self.inner().payouts_redriven(operation, limit)
    }
    type DeadLetters = Faulty<S::DeadLetters>;
    fn dead_letters(&self) -> Self::DeadLetters {
        self.beside(self.inner().dead_letters())
    }
    fn record_dead_letter<'c>(
        letters: &'c Self::DeadLetters,
        tx: &'c mut Self::Tx,
        letter: &'c NewDeadLetter,
    ) -> BoxFuture<'c, Result<i64, DbError>> {
        // Written in the caller's transaction: its commit carries the faults.
        S::record_dead_letter(letters.inner(), tx, letter)
    }
    fn payouts_due(&self, now_ms: i64, limit: u32) -> BoxFuture<'_, Result<Vec<PayoutTask>, DbError>> {
        self.inner().payouts_due(now_ms, limit)
    }
    fn mark_payout_sent<'a>(&'a self, tenant: &'a str, id: &'a str, now_ms: i64) -> BoxFuture<'a, Result<(), DbError>> {
        // The payout's own sent mark, committed before each vendor call:
        // failing as a lease's mark would.
        Box::pin(self.faulty(
            idem_faults::Op::MarkSent,
            self.inner().mark_payout_sent(tenant, id, now_ms),
        ))
    }
    fn cancel_dead_letter<'c>(
        letters: &'c Self::DeadLetters,
        tx: &'c mut Self::Tx,
        id: i64,
    ) -> BoxFuture<'c, Result<bool, DbError>> {
        S::cancel_dead_letter(letters.inner(), tx, id)
    }
    fn withdrawal<'a>(&'a self, tenant: &'a str, id: &'a str) -> BoxFuture<'a, Result<Option<Withdrawal>, DbError>> {
        self.inner().withdrawal(tenant, id)
    }
    /// The operations' store beside the wrapped one, under the one plan:
    /// it joins the transactions of the wrapped store.
    type MultiSteps = Faulty<S::MultiSteps>;
    fn multi_steps(&self) -> Self::MultiSteps {
        self.beside(self.inner().multi_steps())
    }
}
