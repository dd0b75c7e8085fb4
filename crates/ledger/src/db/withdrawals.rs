//! Withdrawals: the account debited (a `withdrawal` journal row), then paid
//! out through an FX quote and a payout vendor by the multi-step operation
//! `withdrawal@1`, and either settled as paid or declined with the debit
//! credited back (a `withdrawal_reversal` journal row).

use super::dialect::sql_statements;

use super::accounts::Columns;
use super::{DbError, Dialect};

/// Where a withdrawal stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum WithdrawalState {
    /// Debited; its quote and payout are under way (or held for an
    /// operator).
    Pending,
    /// Quoted and paid out at the vendors.
    Paid,
    /// A vendor declined it: any quote was released and the debit credited
    /// back.
    Declined,
}

impl WithdrawalState {
    /// As stored.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::Paid => "paid",
            Self::Declined => "declined",
        }
    }

    fn parse(s: &str) -> Result<Self, DbError> {
        match s {
            "pending" => Ok(Self::Pending),
            "paid" => Ok(Self::Paid),
            "declined" => Ok(Self::Declined),
            other => Err(DbError::Corrupt(format!("unknown withdrawal state {other:?}"))),
        }
    }
}

/// A withdrawal as the API shows it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, utoipa::ToSchema)]
pub struct Withdrawal {
    /// Its id (a UUIDv7): the reference both vendors see.
    pub id: String,
    /// The account debited.
    pub account_id: String,
    /// Minor units of `currency`, debited.
    pub amount: i64,
    /// The account's currency.
    pub currency: String,
    /// The currency paid out.
    pub payout_currency: String,
    /// Where the money goes, at the payout vendor.
    pub destination: String,
    /// Where it stands.
    pub status: WithdrawalState,
    /// The FX vendor's quote, once settled.
    pub quote_id: Option<String>,
    /// The quote's rate (an exact decimal), once settled.
    pub rate: Option<String>,
    /// Minor units of `payout_currency` paid out, once settled.
    pub amount_out: Option<i64>,
    /// The payout vendor's id of the payment, once settled.
    pub vendor_payout_id: Option<String>,
    /// Why it was declined.
    pub reason: Option<String>,
    /// When it was debited (ms since the epoch).
    pub created_at_ms: i64,
    /// When it last changed.
    pub updated_at_ms: i64,
}

impl Withdrawal {
    /// Decodes a row of `Sql::select_withdrawal`.
    pub(super) fn from_row(row: &impl Columns) -> Result<Self, DbError> {
        Ok(Self {
            id: row.text("id")?,
            account_id: row.text("account_id")?,
            amount: row.int("amount")?,
            currency: row.text("currency")?,
            payout_currency: row.text("payout_currency")?,
            destination: row.text("destination")?,
            status: WithdrawalState::parse(&row.text("state")?)?,
            quote_id: row.text_or_null("quote_id")?,
            rate: row.text_or_null("rate")?,
            amount_out: row.int_or_null("amount_out")?,
            vendor_payout_id: row.text_or_null("vendor_payout_id")?,
            reason: row.text_or_null("reason")?,
            created_at_ms: row.int("created_at_ms")?,
            updated_at_ms: row.int("updated_at_ms")?,
        })
    }
}

/// A withdrawal to debit and record as pending.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewWithdrawal<'a> {
    /// The tenant.
    pub tenant: &'a str,
    /// Its id: also the journal id of the debit.
    pub id: &'a str,
    /// The account debited.
    pub account_id: &'a str,
    /// Minor units.
    pub amount: i64,
    /// The account's currency.
    pub currency: &'a str,
    /// The currency paid out.
    pub payout_currency: &'a str,
    /// Where the money goes.
    pub destination: &'a str,
}

/// What a paid withdrawal records of the vendors' answers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WithdrawalPaid<'a> {
    /// The FX vendor's quote.
    pub quote_id: &'a str,
    /// The quote's rate.
    pub rate: &'a str,
    /// Minor units paid out.
    pub amount_out: i64,
    /// The payout vendor's id, if it gave one every engine can store.
    pub vendor_payout_id: Option<&'a str>,
}

sql_statements! {
    /// The statements of withdrawals.
    |dialect, p| {
        insert_withdrawal: p(
            "INSERT INTO ledger_withdrawals (tenant, id, account_id, amount, currency, payout_currency, destination, \
             state, created_at_ms, updated_at_ms) VALUES (?, ?, ?, ?, ?, ?, ?, 'pending', ?, ?)",
        ),
        select_withdrawal: p(
            "SELECT id, account_id, amount, currency, payout_currency, destination, state, quote_id, rate, amount_out, \
             vendor_payout_id, reason, created_at_ms, updated_at_ms FROM ledger_withdrawals WHERE tenant = ? AND id = ?",
        ),
        settle_withdrawal: p(
            "UPDATE ledger_withdrawals SET state = 'paid', quote_id = ?, rate = ?, amount_out = ?, vendor_payout_id = ?, \
             updated_at_ms = ? WHERE tenant = ? AND id = ? AND state = 'pending'",
        ),
        select_withdrawal_for_decline: p(&format!(
            "SELECT account_id, amount, state FROM ledger_withdrawals WHERE tenant = ? AND id = ?{}",
            match dialect {
                Dialect::Sqlite => "",
                Dialect::Postgres | Dialect::MySql => " FOR UPDATE",
            }
        )),
        decline_withdrawal: p(
            "UPDATE ledger_withdrawals SET state = 'declined', reason = ?, updated_at_ms = ? \
             WHERE tenant = ? AND id = ? AND state = 'pending'",
        ),
    }
}

/// The longest reason kept with a declined withdrawal, in bytes.
pub const MAX_DECLINE_REASON: usize = 1000;

/// The [`LedgerDb`](super::LedgerDb) methods of withdrawals, for `$store`.
macro_rules! withdrawal_methods {
    ($store:ty) => {
        fn withdrawal<'a>(
            &'a self,
            tenant: &'a str,
            id: &'a str,
        ) -> BoxFuture<'a, Result<Option<Withdrawal>, DbError>> {
            let select = &queries().withdrawals.select_withdrawal;
            Box::pin(decoded_by_id(
                self.pool(),
                select,
                tenant,
                id,
                Withdrawal::from_row,
            ))
        }
    };
}
pub(super) use withdrawal_methods;

/// The [`LedgerTx`](super::LedgerTx) methods of withdrawals, for a
/// transaction of the engine whose `queries` and money functions are in
/// scope.
macro_rules! withdrawal_tx_methods {
    () => {
        fn request_withdrawal<'c>(
            &'c mut self,
            w: &'c NewWithdrawal<'c>,
            now_ms: i64,
        ) -> BoxFuture<'c, Result<i64, DbError>> {
            Box::pin(async move {
                let q = queries();
                let debit = crate::db::accounts::Movement::debit(w.id, "withdrawal", w.account_id, w.amount);
                move_money(&mut **self, q, w.tenant, &debit, now_ms).await?;
                sqlx::query(q.withdrawals.insert_withdrawal.clone())
                    .bind(w.tenant)
                    .bind(w.id)
                    .bind(w.account_id)
                    .bind(w.amount)
                    .bind(w.currency)
                    .bind(w.payout_currency)
                    .bind(w.destination)
                    .bind(now_ms)
                    .bind(now_ms)
                    .execute(&mut **self)
                    .await?;
                balance(&mut **self, q, w.tenant, w.account_id).await
            })
        }

        fn settle_withdrawal<'c>(
            &'c mut self,
            tenant: &'c str,
            id: &'c str,
            paid: &'c WithdrawalPaid<'c>,
            now_ms: i64,
        ) -> BoxFuture<'c, Result<bool, DbError>> {
            let update = sqlx::query(queries().withdrawals.settle_withdrawal.clone())
                .bind(paid.quote_id)
                .bind(paid.rate)
                .bind(paid.amount_out)
                .bind(paid.vendor_payout_id)
                .bind(now_ms)
                .bind(tenant)
                .bind(id);
            Box::pin(changed_one(&mut **self, update))
        }

        fn decline_withdrawal<'c>(
            &'c mut self,
            tenant: &'c str,
            id: &'c str,
            reason: &'c str,
            now_ms: i64,
        ) -> BoxFuture<'c, Result<Option<(String, i64)>, DbError>> {
            Box::pin(async move {
                let q = queries();
                let reversal = crate::db::accounts::Reversal {
                    select: &q.withdrawals.select_withdrawal_for_decline,
                    from: &["pending"],
                    kind: "withdrawal_reversal",
                };
                let reason = idem_core::cut_at_char_boundary(reason, crate::db::withdrawals::MAX_DECLINE_REASON);
                let update = sqlx::query(q.withdrawals.decline_withdrawal.clone())
                    .bind(reason)
                    .bind(now_ms)
                    .bind(tenant)
                    .bind(id);
                credit_back(&mut **self, q, tenant, id, &reversal, update, now_ms).await
            })
        }
    };
}
pub(super) use withdrawal_tx_methods;
