//! Payouts whose vendor call did not end in a payment: held as unknown for
//! an operator, and settled later from their dead letters (a redrive, an
//! operator's verdict).

use idem_core::{DeadLetterState, DeadLetterStore, IdempotencyKey, LeaseStore, NewDeadLetter, Scope, VerdictSource};

use super::{PAYOUT_OPERATION, PayoutWorker, Settled, check_answer, vendor::vendor_payout_id};
use crate::db::{DbError, LedgerDb, PayoutChange, PayoutState, PayoutTask};

impl<D: LedgerDb + LeaseStore> PayoutWorker<D> {
    /// Moves a requested payout to `unknown` with its dead letter held as
    /// unknown, in `tx`.
    pub(super) async fn hold_unknown(
        &self,
        tx: &mut D::Tx,
        task: &PayoutTask,
        letter: &NewDeadLetter,
        attempts: u32,
        reason: &str,
        now_ms: i64,
    ) -> Result<Option<Settled>, DbError> {
        let change = PayoutChange {
            from: PayoutState::Requested,
            to: PayoutState::Unknown,
            vendor_payout_id: None,
            attempts: i64::from(attempts),
            last_error: Some(idem_core::clip_text(reason)),
            now_ms,
        };
        let extra = serde_json::json!({ "error": reason });
        let moved = self
            .move_payout(tx, task, &change, Some(letter), "payout.outcome_unknown", extra)
            .await?;
        if moved {
            metrics::counter!("ledger_payouts_unknown_total").increment(1);
            tracing::error!(payout = %task.id, reason, "payout outcome unknown: held for an operator (idem dlq resolve)");
        }
        Ok(moved.then_some(Settled::Unknown))
    }

    /// Settles the dead-lettered and unknown payouts whose dead letter was
    /// settled elsewhere (up to a batch, oldest first): resolved → paid
    /// (when the answer holds what the vendor promises; otherwise unknown);
    /// held as unknown → unknown; found not applied by an operator (dead
    /// again) → dead-lettered. Answers how many became paid.
    pub async fn reconcile(&self) -> Result<u64, DbError> {
        let dead = self.db.payouts_redriven(PAYOUT_OPERATION, 100).await?;
        let letters = self.db.dead_letters();
        let mut reconciled = 0;
        for task in dead {
            let scope = Scope::parse(&task.tenant, PAYOUT_OPERATION)?;
            let key = IdempotencyKey::new(&task.id)?;
            let Some(letter) = letters.find(&scope, &key).await? else {
                continue;
            };
            let Some(payout) = self.db.payout(&task.tenant, &task.id).await? else {
                continue;
            };
            let now_ms = self.clock.now_ms();
            let (to, vendor_id, last_error, kind) = match letter.state {
                DeadLetterState::Resolved => {
                    let body = letter.response_body.as_deref().unwrap_or_default();
                    let by_operator = letter
                        .reconciliation
                        .as_ref()
                        .is_some_and(|r| r.by == VerdictSource::Operator);
                    match check_answer(&task, body) {
                        Ok(id) => (PayoutState::Paid, id, None, "payout.paid"),
                        // An operator's word stands, with whatever id it gave.
                        Err(_) if by_operator => (PayoutState::Paid, vendor_payout_id(body), None, "payout.paid"),
                        Err(why) => (
                            PayoutState::Unknown,
                            None,
                            Some(format!(
                                "the vendor's answer to a redrive does not match its contract: {why}"
                            )),
                            "payout.outcome_unknown",
                        ),
                    }
                }
                DeadLetterState::Unknown => (
                    PayoutState::Unknown,
                    None,
                    Some(letter.last_error.clone()),
                    "payout.outcome_unknown",
                ),
                DeadLetterState::Dead => (
                    PayoutState::DeadLettered,
                    None,
                    Some(letter.last_error.clone()),
                    "payout.dead_lettered",
                ),
                _ => continue,
            };
            if to == payout.status {
                continue;
            }
            let change = PayoutChange {
                from: payout.status,
                to,
                vendor_payout_id: vendor_id.as_deref(),
                attempts: 0,
                last_error: last_error.as_deref().map(idem_core::clip_text),
                now_ms,
            };
            let extra = match &last_error {
                None => serde_json::json!({ "vendor_payout_id": vendor_id }),
                Some(e) => serde_json::json!({ "error": e }),
            };
            let mut tx = self.db.begin().await?;
            if self.move_payout(&mut tx, &task, &change, None, kind, extra).await? {
                reconciled += u64::from(to == PayoutState::Paid);
            }
            self.db.commit(tx).await?;
        }
        Ok(reconciled)
    }
}
