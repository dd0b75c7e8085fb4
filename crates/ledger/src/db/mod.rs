//! The ledger's storage on each engine.
//!
//! Double-entry: every business transaction is one `ledger_journal` row and
//! two `ledger_entries` rows whose deltas sum to zero (money comes from and
//! goes to the pseudo-account `@world`). Account balances are kept on
//! `ledger_accounts` for cheap checks, and the audit recomputes them from
//! the entries.
//!
//! [`LedgerDb`] is implemented once, by the `ledger_db!` macro, for the
//! PostgreSQL, MySQL/MariaDB and SQLite stores: the engines differ only in
//! their sqlx types, a few words of SQL ([`Dialect`]) and the lock that
//! serialises migrations. Each kind of row has its module, with its types,
//! its statements and its part of the implementation:
//!
//! - `accounts`: accounts, the money moving between them, the audit;
//! - `statements`: the statement projection and the balance snapshots;
//! - `payouts`: payouts, from their request to paid, dead-lettered,
//!   unknown or cancelled;
//! - `withdrawals`: withdrawals, debited, then paid or declined (the debit
//!   credited back) by the multi-step operation `withdrawal@1`;
//! - `schema`: the tables and their migration; `dialect`: the statements
//!   of one engine.

mod accounts;
mod dialect;
mod payouts;
mod schema;
mod statements;
mod withdrawals;

use idem_core::multistep::MultiStepStore;
use idem_core::{BoxFuture, DeadLetterStore, NewDeadLetter, OutboxEvent, OutboxStore, TableName, TxBackend};

pub use accounts::{Account, Audit};
pub use dialect::{Dialect, Queries};
pub use payouts::{NewPayout, Payout, PayoutChange, PayoutDeferral, PayoutState, PayoutTask};
pub use statements::{Statement, StatementChange};
pub use withdrawals::{MAX_DECLINE_REASON, NewWithdrawal, Withdrawal, WithdrawalPaid, WithdrawalState};

/// The outbox of the ledger's events.
pub const OUTBOX_TABLE: &str = "ledger_outbox";
/// The inbox of provider webhooks (apart from request keys).
pub const WEBHOOK_INBOX_TABLE: &str = "ledger_webhook_inbox";
/// The inbox of the statement projection.
pub const PROJECTION_INBOX_TABLE: &str = "ledger_projection_inbox";
/// The run ids of scheduled jobs.
pub const JOB_RUNS_TABLE: &str = "ledger_job_runs";
/// The leases of payouts being paid at the vendor.
pub const PAYOUT_LEASES_TABLE: &str = "ledger_payout_leases";
/// The dead letters of vendor calls (the stores' default table, so
/// `idem dlq` finds them).
pub const DEAD_LETTERS_TABLE: &str = "idem_dead_letters";

/// The multi-step operations (the stores' default table, so `idem` finds
/// them).
pub const OPERATIONS_TABLE: &str = "idem_operations";

/// The pseudo-account money comes from (top-ups) and goes to (payouts).
pub const WORLD: &str = "@world";

/// The largest amount of one operation, in minor units.
pub const MAX_AMOUNT: i64 = 1_000_000_000_000;
/// The largest balance an account may hold, in minor units.
pub const MAX_BALANCE: i64 = 1_000_000_000_000_000;

/// What a ledger operation can fail with.
#[derive(Debug, thiserror::Error)]
pub enum DbError {
    /// No such account for this tenant.
    #[error("account {0} not found")]
    AccountNotFound(String),
    /// The source account holds less than asked.
    #[error("insufficient funds: balance {balance}, requested {requested}")]
    InsufficientFunds {
        /// What the account holds.
        balance: i64,
        /// What was asked.
        requested: i64,
    },
    /// The target balance would exceed [`MAX_BALANCE`].
    #[error("the balance would exceed {MAX_BALANCE}")]
    BalanceLimit,
    /// The database failed.
    #[error("database error: {0}")]
    Sql(#[from] sqlx::Error),
    /// A stored value the ledger cannot read.
    #[error("corrupt row: {0}")]
    Corrupt(String),
    /// The idempotency store failed.
    #[error("{0}")]
    Idem(#[from] idem_core::Error),
}

impl idem_core::Contention for DbError {
    /// A deadlock, a serialisation failure or a lock wait that ran out, on
    /// whichever engine the ledger runs: the transaction may run again.
    fn is_contention(&self) -> bool {
        match self {
            DbError::Sql(e) => {
                idem_postgres::is_contention(e) || idem_mysql::is_contention(e) || idem_sqlite::is_contention(e)
            }
            DbError::Idem(e) => e.is_contention(),
            _ => false,
        }
    }
}

/// What the ledger needs of a store: the idempotency backend plus the
/// ledger's own statements. Implemented for the PostgreSQL, MySQL/MariaDB and
/// SQLite stores.
pub trait LedgerDb: TxBackend<Tx: LedgerTx> + Clone {
    /// Creates the ledger's tables (the idempotency tables too).
    fn migrate(&self) -> BoxFuture<'_, Result<(), DbError>>;
    /// Whether the database answers.
    fn ping(&self) -> BoxFuture<'_, Result<(), DbError>>;
    /// Reads an account of `tenant`.
    fn account<'a>(&'a self, tenant: &'a str, id: &'a str) -> BoxFuture<'a, Result<Option<Account>, DbError>>;
    /// The tenant's conservation figures, read from one consistent snapshot.
    fn audit<'a>(&'a self, tenant: &'a str) -> BoxFuture<'a, Result<Audit, DbError>>;
    /// The outbox of this engine.
    type Outbox: OutboxStore + std::fmt::Debug;
    /// The ledger's outbox (table [`OUTBOX_TABLE`]).
    fn outbox(&self) -> Self::Outbox;
    /// Enqueues an event in the open transaction.
    fn enqueue<'c>(
        outbox: &'c Self::Outbox,
        tx: &'c mut Self::Tx,
        event: &'c OutboxEvent,
    ) -> BoxFuture<'c, Result<(), DbError>>;
    /// The same database with idempotency keys in `table`.
    fn keyed(&self, table: TableName) -> Self;
    /// An account's statement, if the projection has seen it.
    fn statement<'a>(
        &'a self,
        tenant: &'a str,
        account_id: &'a str,
    ) -> BoxFuture<'a, Result<Option<Statement>, DbError>>;
    /// A payout of `tenant`.
    fn payout<'a>(&'a self, tenant: &'a str, id: &'a str) -> BoxFuture<'a, Result<Option<Payout>, DbError>>;
    /// Up to `limit` payouts in `state`, oldest first, of every tenant.
    fn payouts_in(&self, state: PayoutState, limit: u32) -> BoxFuture<'_, Result<Vec<PayoutTask>, DbError>>;
    /// Up to `limit` dead-lettered payouts whose dead letter (of
    /// `operation`) is resolved, oldest first, of every tenant.
    fn payouts_redriven<'a>(
        &'a self,
        operation: &'a str,
        limit: u32,
    ) -> BoxFuture<'a, Result<Vec<PayoutTask>, DbError>>;
    /// The dead-letter store of this engine.
    type DeadLetters: DeadLetterStore + std::fmt::Debug;
    /// The dead letters of vendor calls (the default table,
    /// `idem_dead_letters`, so `idem dlq` finds them).
    fn dead_letters(&self) -> Self::DeadLetters;
    /// Records a dead letter in the open transaction.
    fn record_dead_letter<'c>(
        letters: &'c Self::DeadLetters,
        tx: &'c mut Self::Tx,
        letter: &'c NewDeadLetter,
    ) -> BoxFuture<'c, Result<i64, DbError>>;
    /// Up to `limit` requested payouts due at `now_ms` (not deferred past
    /// it), oldest first, of every tenant.
    fn payouts_due(&self, now_ms: i64, limit: u32) -> BoxFuture<'_, Result<Vec<PayoutTask>, DbError>>;
    /// Records that a vendor call of a requested payout starts now, if none
    /// started before (committed before the call, so a worker that takes
    /// the payout over knows a call may have reached the vendor).
    fn mark_payout_sent<'a>(&'a self, tenant: &'a str, id: &'a str, now_ms: i64) -> BoxFuture<'a, Result<(), DbError>>;
    /// Cancels the dead letter `id` in the open transaction, if it is known
    /// not to have been applied.
    fn cancel_dead_letter<'c>(
        letters: &'c Self::DeadLetters,
        tx: &'c mut Self::Tx,
        id: i64,
    ) -> BoxFuture<'c, Result<bool, DbError>>;
    /// A withdrawal of `tenant`.
    fn withdrawal<'a>(&'a self, tenant: &'a str, id: &'a str) -> BoxFuture<'a, Result<Option<Withdrawal>, DbError>>;
    /// The store of multi-step operations of this engine.
    type MultiSteps: MultiStepStore<Self> + std::fmt::Debug;
    /// The multi-step operations (table [`OPERATIONS_TABLE`]), whose writes
    /// join this store's transactions.
    fn multi_steps(&self) -> Self::MultiSteps;
}

/// What the ledger writes in an open transaction of its store
/// ([`LedgerDb::Tx`](idem_core::TxBackend::Tx)): its statements run on the
/// transaction's connection, and commit or roll back with it. Implemented
/// for the PostgreSQL, MySQL/MariaDB and SQLite transactions; a store
/// wrapped by another (the fault-injecting one) keeps its transactions and
/// so these methods.
pub trait LedgerTx: Send {
    /// Writes one balance snapshot row per account under `run_id`; answers how many.
    fn snapshot_balances<'c>(&'c mut self, run_id: &'c str, now_ms: i64) -> BoxFuture<'c, Result<u64, DbError>>;
    /// Inserts an account.
    fn insert_account<'c>(
        &'c mut self,
        tenant: &'c str,
        id: &'c str,
        name: &'c str,
        now_ms: i64,
    ) -> BoxFuture<'c, Result<(), DbError>>;
    /// Credits `amount` from `@world` to an account (kind `top_up`, or
    /// `webhook_top_up`); answers the new balance.
    fn top_up<'c>(
        &'c mut self,
        tenant: &'c str,
        journal_id: &'c str,
        kind: &'static str,
        account_id: &'c str,
        amount: i64,
        now_ms: i64,
    ) -> BoxFuture<'c, Result<i64, DbError>>;
    /// Moves `amount` between two accounts of `tenant`.
    fn transfer<'c>(
        &'c mut self,
        tenant: &'c str,
        journal_id: &'c str,
        from: &'c str,
        to: &'c str,
        amount: i64,
        now_ms: i64,
    ) -> BoxFuture<'c, Result<(), DbError>>;
    /// Applies one event to the statement projection and logs the application.
    fn apply_statement<'c>(
        &'c mut self,
        tenant: &'c str,
        event_id: &'c str,
        changes: &'c [StatementChange],
        occurred_at_ms: i64,
        now_ms: i64,
    ) -> BoxFuture<'c, Result<(), DbError>>;
    /// Debits a payout's amount from its account to `@world` (kind
    /// `payout`, journal id the payout's) and records it as requested;
    /// answers the new balance.
    fn request_payout<'c>(&'c mut self, p: &'c NewPayout<'c>, now_ms: i64) -> BoxFuture<'c, Result<i64, DbError>>;
    /// Leaves a requested payout alone until `deferral.not_before_ms` (the
    /// vendor asked to wait); false when it is no longer requested.
    fn defer_payout<'c>(
        &'c mut self,
        tenant: &'c str,
        id: &'c str,
        deferral: &'c PayoutDeferral<'c>,
        now_ms: i64,
    ) -> BoxFuture<'c, Result<bool, DbError>>;
    /// Cancels a dead-lettered or unknown payout: its state moves to
    /// `cancelled` and the debit is reversed (kind `payout_reversal`, from
    /// `@world` back to the account), in the open transaction; false
    /// (nothing written) when it is in another state.
    fn cancel_payout<'c>(
        &'c mut self,
        tenant: &'c str,
        id: &'c str,
        now_ms: i64,
    ) -> BoxFuture<'c, Result<bool, DbError>>;
    /// Moves a payout from `change.from` to `change.to`; false (nothing
    /// written) when it was not in `change.from`.
    fn change_payout<'c>(
        &'c mut self,
        tenant: &'c str,
        id: &'c str,
        change: &'c PayoutChange<'c>,
    ) -> BoxFuture<'c, Result<bool, DbError>>;
    /// Debits a withdrawal's amount from its account to `@world` (kind
    /// `withdrawal`, journal id the withdrawal's) and records it as
    /// pending; answers the new balance.
    fn request_withdrawal<'c>(
        &'c mut self,
        w: &'c NewWithdrawal<'c>,
        now_ms: i64,
    ) -> BoxFuture<'c, Result<i64, DbError>>;
    /// Marks a pending withdrawal paid with the vendors' answers; false
    /// (nothing written) when it is not pending.
    fn settle_withdrawal<'c>(
        &'c mut self,
        tenant: &'c str,
        id: &'c str,
        paid: &'c WithdrawalPaid<'c>,
        now_ms: i64,
    ) -> BoxFuture<'c, Result<bool, DbError>>;
    /// Declines a pending withdrawal for `reason` (cut at
    /// [`MAX_DECLINE_REASON`] bytes) and credits its debit back (kind
    /// `withdrawal_reversal`, from `@world` to the account), in the open
    /// transaction: the account and amount credited, or `None` (nothing
    /// written) when it is not pending.
    fn decline_withdrawal<'c>(
        &'c mut self,
        tenant: &'c str,
        id: &'c str,
        reason: &'c str,
        now_ms: i64,
    ) -> BoxFuture<'c, Result<Option<(String, i64)>, DbError>>;
}

/// Implements [`LedgerDb`] for one engine's store: the idem tables the
/// ledger borrows (outbox, dead letters, keys in other tables) here, each
/// kind of the ledger's own rows from its module, and the statements of
/// `$dialect`, prepared once.
macro_rules! ledger_db {
    ($store:ty, $tx:ty, $db:ty, $outbox:ty, $letters:ty, $steps:ty, $dialect:expr, $lock:expr, $unlock:expr) => {
        impl LedgerDb for $store {
            crate::db::schema::migrate_method!($dialect, $lock, $unlock);

            fn ping(&self) -> BoxFuture<'_, Result<(), DbError>> {
                Box::pin(async move {
                    sqlx::query("SELECT 1").execute(self.pool()).await?;
                    Ok(())
                })
            }

            fn keyed(&self, table: TableName) -> Self {
                self.clone().with_table(table)
            }

            type Outbox = $outbox;

            fn outbox(&self) -> $outbox {
                <$outbox>::with_table(
                    self.pool().clone(),
                    TableName::new(OUTBOX_TABLE).expect("a valid table name"),
                )
            }

            fn enqueue<'c>(
                outbox: &'c $outbox,
                tx: &'c mut <$store as idem_core::TxBackend>::Tx,
                event: &'c OutboxEvent,
            ) -> BoxFuture<'c, Result<(), DbError>> {
                Box::pin(async move { Ok(outbox.enqueue(&mut **tx, event).await?) })
            }

            type DeadLetters = $letters;

            fn dead_letters(&self) -> $letters {
                <$letters>::with_table(
                    self.pool().clone(),
                    TableName::new(DEAD_LETTERS_TABLE).expect("a valid table name"),
                )
            }

            fn record_dead_letter<'c>(
                letters: &'c $letters,
                tx: &'c mut <$store as idem_core::TxBackend>::Tx,
                letter: &'c NewDeadLetter,
            ) -> BoxFuture<'c, Result<i64, DbError>> {
                Box::pin(async move { Ok(letters.record_in(&mut **tx, letter).await?) })
            }

            fn cancel_dead_letter<'c>(
                letters: &'c $letters,
                tx: &'c mut <$store as idem_core::TxBackend>::Tx,
                id: i64,
            ) -> BoxFuture<'c, Result<bool, DbError>> {
                Box::pin(async move { Ok(letters.cancel_in(&mut **tx, id).await?) })
            }

            type MultiSteps = $steps;

            fn multi_steps(&self) -> $steps {
                <$steps>::with_table(
                    self.pool().clone(),
                    TableName::new(OPERATIONS_TABLE).expect("a valid table name"),
                )
            }

            crate::db::accounts::account_methods!($store);
            crate::db::statements::statement_methods!($store);
            crate::db::payouts::payout_methods!($store);
            crate::db::withdrawals::withdrawal_methods!($store);
        }

        impl LedgerTx for $tx {
            crate::db::accounts::account_tx_methods!();
            crate::db::statements::statement_tx_methods!();
            crate::db::payouts::payout_tx_methods!();
            crate::db::withdrawals::withdrawal_tx_methods!();
        }

        fn queries() -> &'static Queries {
            static Q: std::sync::OnceLock<Queries> = std::sync::OnceLock::new();
            Q.get_or_init(|| Queries::new($dialect))
        }

        crate::db::accounts::money_rows!($db);
    };
}

mod postgres {
    use super::*;
    ledger_db!(
        idem_postgres::PgStore,
        idem_postgres::PgTx,
        sqlx::Postgres,
        idem_postgres::PgOutbox,
        idem_postgres::PgDeadLetters,
        idem_postgres::PgMultiSteps,
        Dialect::Postgres,
        Some("SELECT pg_advisory_lock(7262687201)"),
        Some("SELECT pg_advisory_unlock(7262687201)")
    );
}

mod mysql {
    use super::*;
    ledger_db!(
        idem_mysql::MySqlStore,
        idem_mysql::MySqlTx,
        sqlx::MySql,
        idem_mysql::MySqlOutbox,
        idem_mysql::MySqlDeadLetters,
        idem_mysql::MySqlMultiSteps,
        Dialect::MySql,
        Some("SELECT GET_LOCK('ledger_migrate', 60)"),
        Some("SELECT RELEASE_LOCK('ledger_migrate')")
    );
}

mod sqlite {
    use super::*;
    ledger_db!(
        idem_sqlite::SqliteStore,
        idem_sqlite::SqliteTx,
        sqlx::Sqlite,
        idem_sqlite::SqliteOutbox,
        idem_sqlite::SqliteDeadLetters,
        idem_sqlite::SqliteMultiSteps,
        Dialect::Sqlite,
        None::<&'static str>,
        None::<&'static str>
    );
}
