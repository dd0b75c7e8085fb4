//! The steps of `withdrawal@1`, and of its compensation.

use std::sync::Arc;

use idem_core::{BoxFuture, OutboundRequest, SharedClock};
use idem_steps::{Answer, Halt, Operation, Run, StepError};
use serde::{Deserialize, Serialize};
use serde_json::json;

use super::fx::{self, Quote};
use super::{Vendors, WithdrawalInput, WithdrawalsConfig, Withdrawn};
use crate::db::{DbError, LedgerDb, LedgerTx, NewWithdrawal, WithdrawalPaid, WithdrawalState};
use crate::events::{EventOutbox, Namespace};

/// The `debit` step's output: the withdrawal, made inside the step.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Debited {
    /// The withdrawal id (a UUIDv7), also the debit's journal id and the
    /// reference both vendors see.
    pub(crate) id: String,
    /// The account's balance right after the debit.
    pub(crate) balance: i64,
}

/// The `payout` step's output.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct PaidOut {
    /// The payout vendor's id of the payment, if storable.
    pub(super) vendor_payout_id: Option<String>,
}

/// The multi-step operation `withdrawal@1` (see [the module](super)).
pub struct Withdraw<D: LedgerDb> {
    inner: Arc<Inner<D>>,
}

impl<D: LedgerDb> Clone for Withdraw<D> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
        }
    }
}

impl<D: LedgerDb> std::fmt::Debug for Withdraw<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Withdraw")
            .field("fx", &self.inner.vendors.fx_url)
            .field("payout", &self.inner.vendors.payout_url)
            .finish_non_exhaustive()
    }
}

pub(super) struct Inner<D: LedgerDb> {
    pub(super) vendors: Vendors,
    events: EventOutbox<D>,
    clock: SharedClock,
}

impl<D: LedgerDb> Withdraw<D> {
    /// Withdrawals on `db`'s tables and outbox, through the vendors of
    /// `config`, reading `clock`; their events named in `namespace`.
    pub fn new(
        db: &D,
        clock: SharedClock,
        config: &WithdrawalsConfig,
        namespace: Namespace,
    ) -> Result<Self, crate::StartError> {
        Ok(Self {
            inner: Arc::new(Inner {
                vendors: Vendors::new(config, &clock)?,
                events: EventOutbox::new(db, namespace),
                clock,
            }),
        })
    }
}

/// A database error of a step, as the step's failure: a refusal of the
/// ledger's rules is declared (the first step's leaves nothing behind), any
/// other error is tried again later.
fn db_failure(e: DbError) -> StepError {
    use idem_core::Contention as _;
    match e {
        DbError::InsufficientFunds { .. } => {
            StepError::Declared(json!({ "code": "insufficient-funds", "detail": e.to_string() }))
        }
        DbError::AccountNotFound(id) => {
            StepError::Declared(json!({ "code": "account-not-found", "detail": format!("no account {id}") }))
        }
        DbError::BalanceLimit => StepError::Declared(json!({ "code": "balance-limit", "detail": e.to_string() })),
        e if e.is_contention() => StepError::Retry {
            why: e.to_string(),
            after_ms: 50,
        },
        e => StepError::Retry {
            why: e.to_string(),
            after_ms: 1_000,
        },
    }
}

/// A vendor's final refusal of `step`, declared: the compensation runs.
fn declined(step: &str, status: u16, body: &[u8]) -> StepError {
    StepError::Declared(json!({
        "code": "withdrawal-declined",
        "step": step,
        "vendor_status": status,
        "reason": fx::refusal_type(body),
    }))
}

/// The payout of `amount_out` to `destination`: `POST {vendor}/v1/payouts`
/// with the withdrawal id as its reference.
pub(super) fn payout_request(
    payout_url: &str,
    reference: &str,
    amount_out: i64,
    destination: &str,
) -> Result<OutboundRequest, idem_core::Error> {
    let body = json!({ "amount": amount_out, "reference": reference, "destination": destination });
    OutboundRequest::new(
        "POST",
        format!("{payout_url}/v1/payouts"),
        vec![("content-type".to_owned(), "application/json".to_owned())],
        serde_json::to_vec(&body).map_err(|e| idem_core::Error::Encode(e.to_string()))?,
    )
}

impl<D: LedgerDb> Inner<D> {
    /// The `debit` step: the account debited, the withdrawal pending, its
    /// event enqueued.
    pub(super) async fn debit(&self, tx: &mut D::Tx, input: &WithdrawalInput) -> Result<Debited, StepError> {
        let id = uuid::Uuid::now_v7().to_string();
        let now_ms = self.clock.now_ms();
        let new = NewWithdrawal {
            tenant: &input.tenant,
            id: &id,
            account_id: &input.account,
            amount: input.amount,
            currency: &input.currency,
            payout_currency: &input.payout_currency,
            destination: &input.destination,
        };
        let balance = tx.request_withdrawal(&new, now_ms).await.map_err(db_failure)?;
        let data = json!({ "withdrawal_id": id, "account_id": input.account, "amount": input.amount });
        self.events
            .enqueue(tx, "withdrawal.requested", &input.tenant, now_ms, data)
            .await
            .map_err(db_failure)?;
        Ok(Debited { id, balance })
    }

    /// The `settle` step: the withdrawal paid, its event enqueued.
    pub(super) async fn settle(
        &self,
        tx: &mut D::Tx,
        input: &WithdrawalInput,
        id: &str,
        quote: &Quote,
        paid: &PaidOut,
    ) -> Result<bool, StepError> {
        let now_ms = self.clock.now_ms();
        let settled = WithdrawalPaid {
            quote_id: &quote.quote_id,
            rate: &quote.rate,
            amount_out: quote.amount_out,
            vendor_payout_id: paid.vendor_payout_id.as_deref(),
        };
        if !tx
            .settle_withdrawal(&input.tenant, id, &settled, now_ms)
            .await
            .map_err(db_failure)?
        {
            return Err(StepError::Fatal(format!("withdrawal {id} is no longer pending")));
        }
        let data = json!({
            "withdrawal_id": id,
            "account_id": input.account,
            "amount": input.amount,
            "vendor_payout_id": paid.vendor_payout_id,
        });
        self.events
            .enqueue(tx, "withdrawal.paid", &input.tenant, now_ms, data)
            .await
            .map_err(db_failure)?;
        Ok(true)
    }

    /// The `credit-back` step: the withdrawal declined for `reason` and its
    /// debit credited back, its event enqueued; false when it was no longer
    /// pending (nothing written).
    async fn credit_back(
        &self,
        tx: &mut D::Tx,
        input: &WithdrawalInput,
        id: &str,
        reason: &str,
    ) -> Result<bool, StepError> {
        let now_ms = self.clock.now_ms();
        let Some((account_id, amount)) = tx
            .decline_withdrawal(&input.tenant, id, reason, now_ms)
            .await
            .map_err(db_failure)?
        else {
            return Ok(false);
        };
        let data = json!({ "withdrawal_id": id, "account_id": account_id, "amount": amount, "reason": reason });
        self.events
            .enqueue(tx, "withdrawal.declined", &input.tenant, now_ms, data)
            .await
            .map_err(db_failure)?;
        Ok(true)
    }
}

impl<D: LedgerDb> Operation<D> for Withdraw<D> {
    type Input = WithdrawalInput;
    type Output = Withdrawn;
    const NAME: &'static str = "withdrawal@1";

    fn run<'r>(
        &'r self,
        run: &'r mut Run<'_, D>,
        input: &'r WithdrawalInput,
    ) -> BoxFuture<'r, Result<Withdrawn, Halt>> {
        Box::pin(async move {
            let v = &self.inner.vendors;

            let debited: Debited = run
                .local("debit", |tx| {
                    let (inner, input) = (self.inner.clone(), input.clone());
                    Box::pin(async move { inner.debit(tx, &input).await })
                })
                .await?;

            let request = fx::quote_request(
                &v.fx_url,
                &debited.id,
                &input.currency,
                &input.payout_currency,
                input.amount,
            )
            .map_err(Halt::Store)?;
            let quote: Quote = run
                .outbound("fx-quote", &v.fx, &request, |answer| match answer {
                    Answer::Applied { body, .. } => {
                        fx::check_quote(&debited.id, &input.currency, &input.payout_currency, input.amount, body)
                            .map_err(|why| {
                                StepError::Unknown(format!("the FX vendor's answer breaks its contract: {why}"))
                            })
                    }
                    Answer::Rejected { status, body } => Err(declined("fx-quote", status, body)),
                })
                .await?;

            let request = payout_request(&v.payout_url, &debited.id, quote.amount_out, &input.destination)
                .map_err(Halt::Store)?;
            let paid: PaidOut = run
                .outbound("payout", &v.payout, &request, |answer| match answer {
                    Answer::Applied { body, .. } => crate::payouts::check_promise(quote.amount_out, &debited.id, body)
                        .map(|vendor_payout_id| PaidOut { vendor_payout_id })
                        .map_err(|why| {
                            StepError::Unknown(format!("the payout vendor's answer breaks its contract: {why}"))
                        }),
                    Answer::Rejected { status, body } => Err(declined("payout", status, body)),
                })
                .await?;

            let _: bool = run
                .local("settle", |tx| {
                    let (inner, input, id) = (self.inner.clone(), input.clone(), debited.id.clone());
                    let (quote, paid) = (quote.clone(), paid.clone());
                    Box::pin(async move { inner.settle(tx, &input, &id, &quote, &paid).await })
                })
                .await?;

            Ok(Withdrawn {
                id: debited.id,
                status: WithdrawalState::Paid,
                account: input.account.clone(),
                amount: input.amount,
                currency: input.currency.clone(),
                payout_currency: input.payout_currency.clone(),
                destination: input.destination.clone(),
                quote_id: quote.quote_id,
                rate: quote.rate,
                amount_out: quote.amount_out,
                vendor_payout_id: paid.vendor_payout_id,
            })
        })
    }

    fn compensate<'r>(
        &'r self,
        run: &'r mut Run<'_, D>,
        input: &'r WithdrawalInput,
        failure: &'r serde_json::Value,
    ) -> BoxFuture<'r, Result<(), Halt>> {
        Box::pin(async move {
            let v = &self.inner.vendors;
            // Only what the forward steps did is undone: a quote is released
            // only if one was booked, the debit credited back only if made.
            if let Some(quote) = run.forward::<Quote>("fx-quote") {
                let request = fx::release_request(&v.fx_url, &quote.quote_id).map_err(Halt::Store)?;
                let _: bool = run
                    .outbound("release-quote", &v.release, &request, |answer| match answer {
                        Answer::Applied { .. } => Ok(true),
                        Answer::Rejected { status, body } => Err(StepError::Fatal(format!(
                            "the FX vendor refused to release quote {}: HTTP {status} ({})",
                            quote.quote_id,
                            fx::refusal_type(body)
                        ))),
                    })
                    .await?;
            }
            if let Some(debited) = run.forward::<Debited>("debit") {
                let reason = reason_of(failure);
                let _: bool = run
                    .local("credit-back", |tx| {
                        let (inner, input) = (self.inner.clone(), input.clone());
                        let (id, reason) = (debited.id.clone(), reason.clone());
                        Box::pin(async move { inner.credit_back(tx, &input, &id, &reason).await })
                    })
                    .await?;
            }
            Ok(())
        })
    }
}

/// Why a withdrawal was declined, in a few words, from its failure.
pub(crate) fn reason_of(failure: &serde_json::Value) -> String {
    if let Some(cancelled) = failure.get("cancelled") {
        return format!("cancelled by an operator: {}", cancelled.as_str().unwrap_or_default());
    }
    match (failure["step"].as_str(), failure["reason"].as_str()) {
        (Some(step), Some(reason)) => format!(
            "{step} declined by the vendor: {reason} (HTTP {})",
            failure["vendor_status"]
        ),
        _ => failure.to_string(),
    }
}
