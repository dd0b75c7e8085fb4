//! Payouts: debited at their request, then paid at the vendor by the
//! payout worker, dead-lettered, held as unknown, or cancelled with the
//! debit reversed.

use super::dialect::sql_statements;

use super::accounts::Columns;
use super::{DEAD_LETTERS_TABLE, DbError, Dialect};

/// Where a payout stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum PayoutState {
    /// Debited; the vendor has not confirmed it yet.
    Requested,
    /// The vendor paid it.
    Paid,
    /// The vendor call used up its retries or was refused; kept as a dead
    /// letter until it is redriven. The debit stands.
    DeadLettered,
    /// Whether the vendor paid it cannot be established (its dead letter is
    /// held as unknown): never sent again on a guess, settled by an
    /// operator (`idem dlq resolve`). The debit stands.
    Unknown,
    /// Cancelled after the vendor was found not to have paid it: the debit
    /// was reversed.
    Cancelled,
}

impl PayoutState {
    /// As stored.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Requested => "requested",
            Self::Paid => "paid",
            Self::DeadLettered => "dead_lettered",
            Self::Unknown => "unknown",
            Self::Cancelled => "cancelled",
        }
    }

    fn parse(s: &str) -> Result<Self, DbError> {
        match s {
            "requested" => Ok(Self::Requested),
            "paid" => Ok(Self::Paid),
            "dead_lettered" => Ok(Self::DeadLettered),
            "unknown" => Ok(Self::Unknown),
            "cancelled" => Ok(Self::Cancelled),
            other => Err(DbError::Corrupt(format!("unknown payout state {other:?}"))),
        }
    }
}

/// A payout as the API shows it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, utoipa::ToSchema)]
pub struct Payout {
    /// Its id (a UUIDv7), also the idempotency key the vendor sees.
    pub id: String,
    /// The account debited.
    pub account_id: String,
    /// Minor units.
    pub amount: i64,
    /// Where it stands.
    pub status: PayoutState,
    /// The vendor's id of the payment, once paid.
    pub vendor_payout_id: Option<String>,
    /// Vendor calls tried.
    pub attempts: i64,
    /// Why the last vendor call failed.
    pub last_error: Option<String>,
    /// When it was requested (ms since the epoch).
    pub created_at_ms: i64,
    /// When it last changed.
    pub updated_at_ms: i64,
    /// When the first vendor call that may have reached the vendor started
    /// (a worker that takes the payout over judges the vendor's memory by
    /// it).
    pub first_sent_at_ms: Option<i64>,
    /// Not sent again before this time (the vendor asked to wait).
    pub not_before_ms: Option<i64>,
}

impl Payout {
    /// Decodes a row of `Sql::select_payout`.
    pub(super) fn from_row(row: &impl Columns) -> Result<Self, DbError> {
        Ok(Self {
            id: row.text("id")?,
            account_id: row.text("account_id")?,
            amount: row.int("amount")?,
            status: PayoutState::parse(&row.text("state")?)?,
            vendor_payout_id: row.text_or_null("vendor_payout_id")?,
            attempts: row.int("attempts")?,
            last_error: row.text_or_null("last_error")?,
            created_at_ms: row.int("created_at_ms")?,
            updated_at_ms: row.int("updated_at_ms")?,
            first_sent_at_ms: row.int_or_null("first_sent_at_ms")?,
            not_before_ms: row.int_or_null("not_before_ms")?,
        })
    }
}

/// A payout for the worker: whose, which, how much.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PayoutTask {
    /// The tenant.
    pub tenant: String,
    /// The payout id.
    pub id: String,
    /// The account debited.
    pub account_id: String,
    /// Minor units.
    pub amount: i64,
}

/// Rows of the statements that list payouts for the worker: tenant, id,
/// account, amount.
pub(super) type TaskRow = (String, String, String, i64);

impl PayoutTask {
    /// Decodes the rows of a listing.
    pub(super) fn from_rows(rows: Vec<TaskRow>) -> Vec<Self> {
        rows.into_iter()
            .map(|(tenant, id, account_id, amount)| Self {
                tenant,
                id,
                account_id,
                amount,
            })
            .collect()
    }
}

/// A payout to debit and record as requested.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewPayout<'a> {
    /// The tenant.
    pub tenant: &'a str,
    /// Its id: also the journal id of the debit.
    pub id: &'a str,
    /// The account debited.
    pub account_id: &'a str,
    /// Minor units.
    pub amount: i64,
}

/// Why and until when a requested payout is left alone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PayoutDeferral<'a> {
    /// Not sent again before this time (ms since the epoch).
    pub not_before_ms: i64,
    /// Vendor calls to add.
    pub attempts: i64,
    /// The vendor's answer (replaces the stored error).
    pub last_error: &'a str,
}

/// A payout's move from one state to another.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PayoutChange<'a> {
    /// The state it must be in (otherwise nothing changes).
    pub from: PayoutState,
    /// The state it moves to.
    pub to: PayoutState,
    /// The vendor's id, when paid.
    pub vendor_payout_id: Option<&'a str>,
    /// Vendor calls to add.
    pub attempts: i64,
    /// The last error (replaces the stored one; `None` clears it).
    pub last_error: Option<&'a str>,
    /// Now, ms since the epoch.
    pub now_ms: i64,
}

sql_statements! {
    /// The statements of payouts.
    |dialect, p| {
        insert_payout: p(
            "INSERT INTO ledger_payouts (tenant, id, account_id, amount, state, attempts, created_at_ms, updated_at_ms) \
             VALUES (?, ?, ?, ?, 'requested', 0, ?, ?)",
        ),
        select_payout: p(
            "SELECT id, account_id, amount, state, vendor_payout_id, attempts, last_error, created_at_ms, updated_at_ms, \
             first_sent_at_ms, not_before_ms FROM ledger_payouts WHERE tenant = ? AND id = ?",
        ),
        payouts_due: p(
            "SELECT tenant, id, account_id, amount FROM ledger_payouts WHERE state = 'requested' \
             AND (not_before_ms IS NULL OR not_before_ms <= ?) ORDER BY created_at_ms LIMIT ?",
        ),
        mark_sent: p(
            "UPDATE ledger_payouts SET first_sent_at_ms = COALESCE(first_sent_at_ms, ?) \
             WHERE tenant = ? AND id = ? AND state = 'requested'",
        ),
        defer_payout: p(
            "UPDATE ledger_payouts SET not_before_ms = ?, attempts = attempts + ?, last_error = ?, updated_at_ms = ? \
             WHERE tenant = ? AND id = ? AND state = 'requested'",
        ),
        select_payout_for_cancel: p(&format!(
            "SELECT account_id, amount, state FROM ledger_payouts WHERE tenant = ? AND id = ?{}",
            match dialect {
                Dialect::Sqlite => "",
                Dialect::Postgres | Dialect::MySql => " FOR UPDATE",
            }
        )),
        cancel_payout: p("UPDATE ledger_payouts SET state = 'cancelled', updated_at_ms = ? \
             WHERE tenant = ? AND id = ? AND state IN ('dead_lettered', 'unknown')"),
        payouts_in: p(
            "SELECT tenant, id, account_id, amount FROM ledger_payouts WHERE state = ? ORDER BY created_at_ms LIMIT ?",
        ),
        // Dead-lettered or unknown payouts whose dead letter was settled
        // elsewhere (a redrive resolved it, an operator settled it, a
        // redrive held it as unknown), however many older ones are still
        // waiting. The keys compare as bytes, as the dead letters store
        // them.
        payouts_redriven: p(&format!(
            "SELECT p.tenant, p.id, p.account_id, p.amount FROM ledger_payouts p \
             WHERE p.state IN ('dead_lettered', 'unknown') AND EXISTS (SELECT 1 FROM {DEAD_LETTERS_TABLE} d \
             WHERE d.tenant = p.tenant{bytes} AND d.operation = ? AND d.idem_key = p.id{bytes} \
             AND (d.state = 'resolved' OR (p.state = 'unknown' AND d.state = 'dead') \
             OR (p.state = 'dead_lettered' AND d.state = 'unknown'))) ORDER BY p.created_at_ms LIMIT ?",
            bytes = match dialect {
                Dialect::Postgres => " COLLATE \"C\"",
                Dialect::MySql | Dialect::Sqlite => "",
            }
        )),
        change_payout: p(
            "UPDATE ledger_payouts SET state = ?, vendor_payout_id = COALESCE(?, vendor_payout_id), \
             attempts = attempts + ?, last_error = ?, updated_at_ms = ? WHERE tenant = ? AND id = ? AND state = ?",
        ),
    }
}

/// The [`LedgerDb`](super::LedgerDb) methods of payouts, for `$store`.
macro_rules! payout_methods {
    ($store:ty) => {
        fn payout<'a>(&'a self, tenant: &'a str, id: &'a str) -> BoxFuture<'a, Result<Option<Payout>, DbError>> {
            let select = &queries().payouts.select_payout;
            Box::pin(decoded_by_id(self.pool(), select, tenant, id, Payout::from_row))
        }

        fn payouts_in(&self, state: PayoutState, limit: u32) -> BoxFuture<'_, Result<Vec<PayoutTask>, DbError>> {
            Box::pin(payout_tasks(
                self.pool(),
                &queries().payouts.payouts_in,
                state.as_str(),
                limit,
            ))
        }

        fn payouts_redriven<'a>(
            &'a self,
            operation: &'a str,
            limit: u32,
        ) -> BoxFuture<'a, Result<Vec<PayoutTask>, DbError>> {
            Box::pin(payout_tasks(
                self.pool(),
                &queries().payouts.payouts_redriven,
                operation,
                limit,
            ))
        }

        fn payouts_due(&self, now_ms: i64, limit: u32) -> BoxFuture<'_, Result<Vec<PayoutTask>, DbError>> {
            Box::pin(payout_tasks(
                self.pool(),
                &queries().payouts.payouts_due,
                now_ms,
                limit,
            ))
        }

        fn mark_payout_sent<'a>(
            &'a self,
            tenant: &'a str,
            id: &'a str,
            now_ms: i64,
        ) -> BoxFuture<'a, Result<(), DbError>> {
            Box::pin(async move {
                sqlx::query(queries().payouts.mark_sent.clone())
                    .bind(now_ms)
                    .bind(tenant)
                    .bind(id)
                    .execute(self.pool())
                    .await?;
                Ok(())
            })
        }
    };
}
pub(super) use payout_methods;

/// The [`LedgerTx`](super::LedgerTx) methods of payouts, for a transaction
/// of the engine whose `queries` and money functions are in scope.
macro_rules! payout_tx_methods {
    () => {
        fn request_payout<'c>(&'c mut self, p: &'c NewPayout<'c>, now_ms: i64) -> BoxFuture<'c, Result<i64, DbError>> {
            Box::pin(async move {
                let q = queries();
                let debit = crate::db::accounts::Movement::debit(p.id, "payout", p.account_id, p.amount);
                move_money(&mut **self, q, p.tenant, &debit, now_ms).await?;
                sqlx::query(q.payouts.insert_payout.clone())
                    .bind(p.tenant)
                    .bind(p.id)
                    .bind(p.account_id)
                    .bind(p.amount)
                    .bind(now_ms)
                    .bind(now_ms)
                    .execute(&mut **self)
                    .await?;
                balance(&mut **self, q, p.tenant, p.account_id).await
            })
        }

        fn defer_payout<'c>(
            &'c mut self,
            tenant: &'c str,
            id: &'c str,
            deferral: &'c PayoutDeferral<'c>,
            now_ms: i64,
        ) -> BoxFuture<'c, Result<bool, DbError>> {
            let update = sqlx::query(queries().payouts.defer_payout.clone())
                .bind(deferral.not_before_ms)
                .bind(deferral.attempts)
                .bind(deferral.last_error)
                .bind(now_ms)
                .bind(tenant)
                .bind(id);
            Box::pin(changed_one(&mut **self, update))
        }

        fn change_payout<'c>(
            &'c mut self,
            tenant: &'c str,
            id: &'c str,
            change: &'c PayoutChange<'c>,
        ) -> BoxFuture<'c, Result<bool, DbError>> {
            let update = sqlx::query(queries().payouts.change_payout.clone())
                .bind(change.to.as_str())
                .bind(change.vendor_payout_id)
                .bind(change.attempts)
                .bind(change.last_error)
                .bind(change.now_ms)
                .bind(tenant)
                .bind(id)
                .bind(change.from.as_str());
            Box::pin(changed_one(&mut **self, update))
        }

        fn cancel_payout<'c>(
            &'c mut self,
            tenant: &'c str,
            id: &'c str,
            now_ms: i64,
        ) -> BoxFuture<'c, Result<bool, DbError>> {
            Box::pin(async move {
                let q = queries();
                let reversal = crate::db::accounts::Reversal {
                    select: &q.payouts.select_payout_for_cancel,
                    from: &["dead_lettered", "unknown"],
                    kind: "payout_reversal",
                };
                let update = sqlx::query(q.payouts.cancel_payout.clone())
                    .bind(now_ms)
                    .bind(tenant)
                    .bind(id);
                let credited = credit_back(&mut **self, q, tenant, id, &reversal, update, now_ms).await?;
                Ok(credited.is_some())
            })
        }
    };
}
pub(super) use payout_tx_methods;
