//! Accounts and the money that moves between them: top-ups, transfers and
//! the double-entry rows every movement writes (payouts and their
//! reversals, withdrawals and their credit-backs write theirs here too),
//! and the audit that proves
//! conservation from those rows.

use super::dialect::sql_statements;

use super::{DbError, Dialect, WORLD};

/// An account as the API shows it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, utoipa::ToSchema)]
pub struct Account {
    /// Its id (a UUIDv7).
    pub id: String,
    /// Its name.
    pub name: String,
    /// Its balance in minor units.
    pub balance: i64,
}

/// Conservation figures of one tenant, all computed from stored rows.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, utoipa::ToSchema)]
pub struct Audit {
    /// Sum of the entries of the tenant's accounts.
    pub balances_total: i64,
    /// Sum of top-ups (API and webhook).
    pub top_ups_total: i64,
    /// Sum of payouts, less those cancelled.
    pub payouts_total: i64,
    /// Whether every figure below agrees: balances_total == top_ups_total −
    /// payouts_total − withdrawals_total, the entries balance, nothing is
    /// negative and every stored balance matches its entries.
    pub conserved: bool,
    /// Accounts whose balance is negative.
    pub negative_balances: i64,
    /// Whether all entries (including `@world`) sum to zero.
    pub entries_balanced: bool,
    /// Accounts whose stored balance differs from the sum of their entries.
    pub balance_mismatches: i64,
    /// How many journal rows the tenant has.
    pub journal_rows: i64,
    /// Sum of withdrawals, less those declined (credited back).
    pub withdrawals_total: i64,
}

impl Audit {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn new(
        balances_total: i64,
        world_total: i64,
        top_ups_total: i64,
        payouts_total: i64,
        withdrawals_total: i64,
        negative_balances: i64,
        balance_mismatches: i64,
        journal_rows: i64,
    ) -> Self {
        let entries_balanced = balances_total.checked_add(world_total) == Some(0);
        let conserved = top_ups_total
            .checked_sub(payouts_total)
            .and_then(|t| t.checked_sub(withdrawals_total))
            == Some(balances_total)
            && entries_balanced
            && negative_balances == 0
            && balance_mismatches == 0;
        Self {
            balances_total,
            top_ups_total,
            payouts_total,
            conserved,
            negative_balances,
            entries_balanced,
            balance_mismatches,
            journal_rows,
            withdrawals_total,
        }
    }
}

/// Which way a guarded balance update goes.
#[derive(Debug, Clone, Copy)]
pub(super) enum Change {
    Credit,
    Debit,
}

sql_statements! {
    /// The statements of accounts, their money and the audit.
    |dialect, p| {
        insert_account: p(
            "INSERT INTO ledger_accounts (tenant, id, name, balance, created_at_ms) VALUES (?, ?, ?, 0, ?)",
        ),
        select_account: p("SELECT id, name, balance FROM ledger_accounts WHERE tenant = ? AND id = ?"),
        balance: p("SELECT balance FROM ledger_accounts WHERE tenant = ? AND id = ?"),
        credit: p("UPDATE ledger_accounts SET balance = balance + ? WHERE tenant = ? AND id = ? AND balance <= ?"),
        debit: p("UPDATE ledger_accounts SET balance = balance - ? WHERE tenant = ? AND id = ? AND balance >= ?"),
        insert_journal: p(
            "INSERT INTO ledger_journal (tenant, id, kind, amount, from_account, to_account, created_at_ms) \
             VALUES (?, ?, ?, ?, ?, ?, ?)",
        ),
        insert_entry: p(
            "INSERT INTO ledger_entries (tenant, journal_id, account_id, delta) VALUES (?, ?, ?, ?), (?, ?, ?, ?)",
        ),
        audit_balances: p(&format!(
            "SELECT {} FROM ledger_entries WHERE tenant = ? AND account_id <> '{WORLD}'",
            dialect.sum("delta")
        )),
        audit_world: p(&format!(
            "SELECT {} FROM ledger_entries WHERE tenant = ? AND account_id = '{WORLD}'",
            dialect.sum("delta")
        )),
        audit_kind: p(&format!(
            "SELECT {} FROM ledger_journal WHERE tenant = ? AND kind = ?",
            dialect.sum("amount")
        )),
        audit_negative: p(
            "SELECT COUNT(*) FROM (SELECT account_id FROM ledger_entries WHERE tenant = ? AND account_id <> '@world' \
             GROUP BY account_id HAVING SUM(delta) < 0) neg",
        ),
        audit_mismatch: p(
            "SELECT COUNT(*) FROM ledger_accounts a WHERE a.tenant = ? AND (a.balance < 0 OR a.balance <> \
             (SELECT COALESCE(SUM(e.delta), 0) FROM ledger_entries e WHERE e.tenant = a.tenant AND e.account_id = a.id))",
        ),
        audit_journal: p("SELECT COUNT(*) FROM ledger_journal WHERE tenant = ?"),
    }
}

/// The [`LedgerDb`](super::LedgerDb) methods of accounts, top-ups,
/// transfers and the audit, for `$store`.
macro_rules! account_methods {
    ($store:ty) => {
        fn account<'a>(&'a self, tenant: &'a str, id: &'a str) -> BoxFuture<'a, Result<Option<Account>, DbError>> {
            Box::pin(async move {
                let row: Option<(String, String, i64)> =
                    row_by_id(self.pool(), &queries().accounts.select_account, tenant, id).await?;
                Ok(row.map(|(id, name, balance)| Account { id, name, balance }))
            })
        }

        fn audit<'a>(&'a self, tenant: &'a str) -> BoxFuture<'a, Result<Audit, DbError>> {
            Box::pin(async move {
                let (q, dialect) = (&queries().accounts, queries().dialect);
                let mut tx = self.pool().begin_with(dialect.snapshot()).await?;
                let one = |sql: &sqlx::SqlStr| sqlx::query_as::<_, (i64,)>(sql.clone()).bind(tenant);
                let (balances_total,) = one(&q.audit_balances).fetch_one(&mut *tx).await?;
                let (world_total,) = one(&q.audit_world).fetch_one(&mut *tx).await?;
                let mut kind_total = async |kind: &str| -> Result<i64, DbError> {
                    Ok(one(&q.audit_kind).bind(kind).fetch_one(&mut *tx).await?.0)
                };
                let top_ups_total = kind_total("top_up")
                    .await?
                    .saturating_add(kind_total("webhook_top_up").await?);
                // A cancelled payout's reversal gives its amount back.
                let payouts_total = kind_total("payout")
                    .await?
                    .saturating_sub(kind_total("payout_reversal").await?);
                // A declined withdrawal's credit-back gives its amount back.
                let withdrawals_total = kind_total("withdrawal")
                    .await?
                    .saturating_sub(kind_total("withdrawal_reversal").await?);
                let (negative_balances,) = one(&q.audit_negative).fetch_one(&mut *tx).await?;
                let (balance_mismatches,) = one(&q.audit_mismatch).fetch_one(&mut *tx).await?;
                let (journal_rows,) = one(&q.audit_journal).fetch_one(&mut *tx).await?;
                tx.rollback().await?;
                Ok(Audit::new(
                    balances_total,
                    world_total,
                    top_ups_total,
                    payouts_total,
                    withdrawals_total,
                    negative_balances,
                    balance_mismatches,
                    journal_rows,
                ))
            })
        }
    };
}
pub(super) use account_methods;

/// The [`LedgerTx`](super::LedgerTx) methods of accounts, for a transaction
/// of the engine whose `queries` and money functions are in scope.
macro_rules! account_tx_methods {
    () => {
        fn insert_account<'c>(
            &'c mut self,
            tenant: &'c str,
            id: &'c str,
            name: &'c str,
            now_ms: i64,
        ) -> BoxFuture<'c, Result<(), DbError>> {
            Box::pin(async move {
                sqlx::query(queries().accounts.insert_account.clone())
                    .bind(tenant)
                    .bind(id)
                    .bind(name)
                    .bind(now_ms)
                    .execute(&mut **self)
                    .await?;
                Ok(())
            })
        }

        fn top_up<'c>(
            &'c mut self,
            tenant: &'c str,
            journal_id: &'c str,
            kind: &'static str,
            account_id: &'c str,
            amount: i64,
            now_ms: i64,
        ) -> BoxFuture<'c, Result<i64, DbError>> {
            Box::pin(async move {
                let q = queries();
                let credit = crate::db::accounts::Movement::credit(journal_id, kind, account_id, amount);
                move_money(&mut **self, q, tenant, &credit, now_ms).await?;
                balance(&mut **self, q, tenant, account_id).await
            })
        }

        fn transfer<'c>(
            &'c mut self,
            tenant: &'c str,
            journal_id: &'c str,
            from: &'c str,
            to: &'c str,
            amount: i64,
            now_ms: i64,
        ) -> BoxFuture<'c, Result<(), DbError>> {
            Box::pin(async move {
                let movement = crate::db::accounts::Movement {
                    journal_id,
                    kind: "transfer",
                    amount,
                    from: Some(from),
                    to: Some(to),
                };
                move_money(&mut **self, queries(), tenant, &movement, now_ms).await
            })
        }
    };
}
pub(super) use account_tx_methods;

/// One movement of money as the journal records it: `amount` from `from`
/// to `to`, `None` standing for `@world` (money entering or leaving the
/// ledger).
pub(super) struct Movement<'a> {
    pub(super) journal_id: &'a str,
    pub(super) kind: &'a str,
    pub(super) amount: i64,
    pub(super) from: Option<&'a str>,
    pub(super) to: Option<&'a str>,
}

impl<'a> Movement<'a> {
    /// `amount` leaving the ledger: from `account_id` to `@world`.
    pub(super) fn debit(journal_id: &'a str, kind: &'a str, account_id: &'a str, amount: i64) -> Self {
        Self {
            journal_id,
            kind,
            amount,
            from: Some(account_id),
            to: None,
        }
    }

    /// `amount` entering the ledger: from `@world` to `account_id`.
    pub(super) fn credit(journal_id: &'a str, kind: &'a str, account_id: &'a str, amount: i64) -> Self {
        Self {
            journal_id,
            kind,
            amount,
            from: None,
            to: Some(account_id),
        }
    }
}

/// How a debited row (a payout, a withdrawal) is reversed: see
/// `credit_back` in [`money_rows`].
pub(super) struct Reversal<'a> {
    /// Reads the row's account, amount and state by tenant and id, locked
    /// until the transaction ends.
    pub(super) select: &'a sqlx::SqlStr,
    /// The states it may be reversed from.
    pub(super) from: &'a [&'a str],
    /// The journal kind of its credit-back.
    pub(super) kind: &'a str,
}

/// A row of one of the ledger's engines, its columns read by name as the
/// plain types the ledger stores (a column of another type is a database
/// error).
pub(super) trait Columns {
    /// Text column `name`.
    fn text(&self, name: &str) -> Result<String, DbError>;
    /// Nullable text column `name`.
    fn text_or_null(&self, name: &str) -> Result<Option<String>, DbError>;
    /// Integer column `name`.
    fn int(&self, name: &str) -> Result<i64, DbError>;
    /// Nullable integer column `name`.
    fn int_or_null(&self, name: &str) -> Result<Option<i64>, DbError>;
}

impl<R> Columns for R
where
    R: sqlx::Row,
    for<'n> &'n str: sqlx::ColumnIndex<R>,
    String: for<'r> sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    i64: for<'r> sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
{
    fn text(&self, name: &str) -> Result<String, DbError> {
        Ok(self.try_get(name)?)
    }

    fn text_or_null(&self, name: &str) -> Result<Option<String>, DbError> {
        Ok(self.try_get(name)?)
    }

    fn int(&self, name: &str) -> Result<i64, DbError> {
        Ok(self.try_get(name)?)
    }

    fn int_or_null(&self, name: &str) -> Result<Option<i64>, DbError> {
        Ok(self.try_get(name)?)
    }
}

/// The functions on a connection of `$db` that move money, read rows and
/// run guarded updates, shared by the methods of every kind of row.
macro_rules! money_rows {
    ($db:ty) => {
        /// A statement bound to its values, not yet run.
        type Bound = sqlx::query::Query<'static, $db, <$db as sqlx::Database>::Arguments>;

        /// The row `select` reads by tenant and id, if any, through
        /// `executor` (the pool, or the open transaction's connection), as
        /// `decode` reads it.
        async fn decoded_by_id<'e, T, E>(
            executor: E,
            select: &sqlx::SqlStr,
            tenant: &str,
            id: &str,
            decode: impl FnOnce(&<$db as sqlx::Database>::Row) -> Result<T, DbError>,
        ) -> Result<Option<T>, DbError>
        where
            E: 'e + sqlx::Executor<'e, Database = $db>,
        {
            let row = sqlx::query(select.clone())
                .bind(tenant)
                .bind(id)
                .fetch_optional(executor)
                .await?;
            row.as_ref().map(decode).transpose()
        }

        /// The row `select` reads by tenant and id, if any, as a tuple of
        /// its columns in order.
        async fn row_by_id<'e, R, E>(
            executor: E,
            select: &sqlx::SqlStr,
            tenant: &str,
            id: &str,
        ) -> Result<Option<R>, DbError>
        where
            R: for<'r> sqlx::FromRow<'r, <$db as sqlx::Database>::Row>,
            E: 'e + sqlx::Executor<'e, Database = $db>,
        {
            decoded_by_id(executor, select, tenant, id, |row| Ok(R::from_row(row)?)).await
        }

        /// Runs `update`, whose `WHERE` guards the row's state: whether it
        /// changed the one row (false: the guard did not hold, nothing
        /// written).
        async fn changed_one(conn: &mut <$db as sqlx::Database>::Connection, update: Bound) -> Result<bool, DbError> {
            Ok(update.execute(&mut *conn).await?.rows_affected() == 1)
        }

        /// Reverses a debited row: reads it under a lock
        /// (`reversal.select`), and unless it is in one of the states
        /// `reversal.from` names, writes nothing; otherwise moves it out
        /// with `update` (guarded by the same states) and credits its debit
        /// back from `@world` to its account (`reversal.kind`), in the open
        /// transaction. The account and amount credited, or `None` when
        /// nothing was written.
        async fn credit_back(
            conn: &mut <$db as sqlx::Database>::Connection,
            q: &Queries,
            tenant: &str,
            id: &str,
            reversal: &crate::db::accounts::Reversal<'_>,
            update: Bound,
            now_ms: i64,
        ) -> Result<Option<(String, i64)>, DbError> {
            let row: Option<(String, i64, String)> = row_by_id(&mut *conn, reversal.select, tenant, id).await?;
            let Some((account_id, amount, state)) = row else {
                return Ok(None);
            };
            if !reversal.from.contains(&state.as_str()) || !changed_one(conn, update).await? {
                return Ok(None);
            }
            // The money comes back from `@world`, under a journal id of its
            // own.
            let journal_id = format!("{id}:reversal");
            let credit = crate::db::accounts::Movement::credit(&journal_id, reversal.kind, &account_id, amount);
            move_money(conn, q, tenant, &credit, now_ms).await?;
            Ok(Some((account_id, amount)))
        }

        /// Applies `m`: the guarded balance updates, then its journal row and
        /// its two entries, whose deltas sum to zero.
        async fn move_money(
            conn: &mut <$db as sqlx::Database>::Connection,
            q: &Queries,
            tenant: &str,
            m: &crate::db::accounts::Movement<'_>,
            now_ms: i64,
        ) -> Result<(), DbError> {
            use crate::db::accounts::Change;
            match (m.from, m.to) {
                // Lock the two rows in a fixed order, so two opposite
                // transfers cannot deadlock each other.
                (Some(from), Some(to)) if from < to => {
                    adjust(conn, q, Change::Debit, tenant, from, m.amount).await?;
                    adjust(conn, q, Change::Credit, tenant, to, m.amount).await?;
                }
                (Some(from), Some(to)) => {
                    adjust(conn, q, Change::Credit, tenant, to, m.amount).await?;
                    adjust(conn, q, Change::Debit, tenant, from, m.amount).await?;
                }
                (Some(from), None) => adjust(conn, q, Change::Debit, tenant, from, m.amount).await?,
                (None, Some(to)) => adjust(conn, q, Change::Credit, tenant, to, m.amount).await?,
                (None, None) => {}
            }
            let sql = &q.accounts;
            sqlx::query(sql.insert_journal.clone())
                .bind(tenant)
                .bind(m.journal_id)
                .bind(m.kind)
                .bind(m.amount)
                .bind(m.from)
                .bind(m.to)
                .bind(now_ms)
                .execute(&mut *conn)
                .await?;
            sqlx::query(sql.insert_entry.clone())
                .bind(tenant)
                .bind(m.journal_id)
                .bind(m.from.unwrap_or(WORLD))
                .bind(-m.amount)
                .bind(tenant)
                .bind(m.journal_id)
                .bind(m.to.unwrap_or(WORLD))
                .bind(m.amount)
                .execute(&mut *conn)
                .await?;
            Ok(())
        }

        /// One guarded balance update: the guard is part of the UPDATE, so a
        /// refused change writes nothing; the account is then read to say why.
        async fn adjust(
            conn: &mut <$db as sqlx::Database>::Connection,
            q: &Queries,
            change: crate::db::accounts::Change,
            tenant: &str,
            id: &str,
            amount: i64,
        ) -> Result<(), DbError> {
            use crate::db::accounts::Change;
            let (statement, guard) = match change {
                Change::Credit => (q.accounts.credit.clone(), MAX_BALANCE - amount),
                Change::Debit => (q.accounts.debit.clone(), amount),
            };
            let update = sqlx::query(statement)
                .bind(amount)
                .bind(tenant)
                .bind(id)
                .bind(guard);
            if changed_one(conn, update).await? {
                return Ok(());
            }
            let exists: Option<(i64,)> = row_by_id(&mut *conn, &q.accounts.balance, tenant, id).await?;
            Err(match (exists, change) {
                (None, _) => DbError::AccountNotFound(id.to_owned()),
                (Some(_), Change::Credit) => DbError::BalanceLimit,
                (Some((balance,)), Change::Debit) => DbError::InsufficientFunds {
                    balance,
                    requested: amount,
                },
            })
        }

        /// An account's balance, as the open transaction sees it.
        async fn balance(
            conn: &mut <$db as sqlx::Database>::Connection,
            q: &Queries,
            tenant: &str,
            id: &str,
        ) -> Result<i64, DbError> {
            let (balance,): (i64,) = sqlx::query_as(q.accounts.balance.clone())
                .bind(tenant)
                .bind(id)
                .fetch_one(&mut *conn)
                .await?;
            Ok(balance)
        }

        /// The payout tasks `sql` selects by `arg`, at most `limit`.
        async fn payout_tasks<'q, T: 'q + Send + sqlx::Encode<'q, $db> + sqlx::Type<$db>>(
            pool: &sqlx::Pool<$db>,
            sql: &sqlx::SqlStr,
            arg: T,
            limit: u32,
        ) -> Result<Vec<PayoutTask>, DbError> {
            let rows: Vec<crate::db::payouts::TaskRow> = sqlx::query_as(sql.clone())
                .bind(arg)
                .bind(i64::from(limit))
                .fetch_all(pool)
                .await?;
            Ok(PayoutTask::from_rows(rows))
        }
    };
}
pub(super) use money_rows;
