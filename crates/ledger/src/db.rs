//! The ledger's storage on each engine.
//!
//! Double-entry: every business transaction is one `ledger_journal` row and
//! two `ledger_entries` rows whose deltas sum to zero (money comes from and
//! goes to the pseudo-account `@world`). Account balances are kept on
//! `ledger_accounts` for cheap checks, and the audit recomputes them from
//! the entries.

use idem_core::{BoxFuture, DeadLetterStore, NewDeadLetter, OutboxEvent, OutboxStore, TableName, TxBackend};
use sqlx::{AssertSqlSafe, SqlSafeStr, SqlStr};

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

/// One account's change in the statement projection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StatementChange {
    /// The account.
    pub account_id: String,
    /// Added to its credits.
    pub credit: i64,
    /// Added to its debits.
    pub debit: i64,
}

/// An account's statement, as the projection holds it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, utoipa::ToSchema)]
pub struct Statement {
    /// The account.
    pub account_id: String,
    /// The sum of money in.
    pub credits: i64,
    /// The sum of money out.
    pub debits: i64,
    /// credits − debits.
    pub balance: i64,
    /// Events applied to this account.
    pub events: i64,
}

/// The pseudo-account money comes from (top-ups) and goes to (payouts).
pub const WORLD: &str = "@world";

/// The largest amount of one operation, in minor units.
pub const MAX_AMOUNT: i64 = 1_000_000_000_000;
/// The largest balance an account may hold, in minor units.
pub const MAX_BALANCE: i64 = 1_000_000_000_000_000;

/// Which way a guarded balance update goes.
#[derive(Debug, Clone, Copy)]
enum Change {
    Credit,
    Debit,
}

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
    /// Sum of payouts.
    pub payouts_total: i64,
    /// Whether every figure below agrees.
    pub conserved: bool,
    /// Accounts whose balance is negative.
    pub negative_balances: i64,
    /// Whether all entries (including `@world`) sum to zero.
    pub entries_balanced: bool,
    /// Accounts whose stored balance differs from the sum of their entries.
    pub balance_mismatches: i64,
    /// How many journal rows the tenant has.
    pub journal_rows: i64,
}

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

/// SQL dialects, for the few places where they differ.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dialect {
    /// PostgreSQL: `$n` placeholders.
    Postgres,
    /// MySQL/MariaDB.
    MySql,
    /// SQLite.
    Sqlite,
}

impl Dialect {
    /// Rewrites `?` placeholders for this dialect.
    fn prepare(self, sql: &str) -> SqlStr {
        let sql = match self {
            Dialect::Postgres => {
                let mut out = String::with_capacity(sql.len() + 8);
                let mut n = 0;
                for c in sql.chars() {
                    if c == '?' {
                        n += 1;
                        out.push('$');
                        out.push_str(&n.to_string());
                    } else {
                        out.push(c);
                    }
                }
                out
            }
            Dialect::MySql | Dialect::Sqlite => sql.to_owned(),
        };
        // Every statement is a constant of this module with bind parameters;
        // nothing user-supplied is spliced in.
        AssertSqlSafe(sql).into_sql_str()
    }

    fn sum(self, expr: &str) -> String {
        match self {
            Dialect::Postgres => format!("CAST(COALESCE(SUM({expr}), 0) AS BIGINT)"),
            Dialect::MySql => format!("CAST(COALESCE(SUM({expr}), 0) AS SIGNED)"),
            Dialect::Sqlite => format!("COALESCE(SUM({expr}), 0)"),
        }
    }

    fn snapshot(self) -> &'static str {
        match self {
            Dialect::Postgres => "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY",
            Dialect::MySql => "START TRANSACTION WITH CONSISTENT SNAPSHOT, READ ONLY",
            Dialect::Sqlite => "BEGIN DEFERRED",
        }
    }

    fn upsert_statement(self) -> &'static str {
        match self {
            Dialect::MySql => {
                "INSERT INTO ledger_statements (tenant, account_id, credits, debits, events) VALUES (?, ?, ?, ?, 1) \
                 ON DUPLICATE KEY UPDATE credits = credits + VALUES(credits), debits = debits + VALUES(debits), \
                 events = events + 1"
            }
            _ => {
                "INSERT INTO ledger_statements (tenant, account_id, credits, debits, events) VALUES (?, ?, ?, ?, 1) \
                 ON CONFLICT (tenant, account_id) DO UPDATE SET credits = ledger_statements.credits + excluded.credits, \
                 debits = ledger_statements.debits + excluded.debits, events = ledger_statements.events + 1"
            }
        }
    }

    fn ddl(self) -> Vec<String> {
        let mut ddl: Vec<String> = [
            "CREATE TABLE IF NOT EXISTS ledger_accounts (tenant VARCHAR(80) NOT NULL, id VARCHAR(80) NOT NULL, \
             name VARCHAR(400) NOT NULL, balance BIGINT NOT NULL, created_at_ms BIGINT NOT NULL, \
             PRIMARY KEY (tenant, id))",
            "CREATE TABLE IF NOT EXISTS ledger_journal (tenant VARCHAR(80) NOT NULL, id VARCHAR(80) NOT NULL, \
             kind VARCHAR(20) NOT NULL, amount BIGINT NOT NULL, from_account VARCHAR(80) NULL, \
             to_account VARCHAR(80) NULL, created_at_ms BIGINT NOT NULL, PRIMARY KEY (tenant, id))",
            "CREATE TABLE IF NOT EXISTS ledger_entries (tenant VARCHAR(80) NOT NULL, journal_id VARCHAR(80) NOT NULL, \
             account_id VARCHAR(80) NOT NULL, delta BIGINT NOT NULL, PRIMARY KEY (tenant, journal_id, account_id))",

            // The statement projection, fed by the ledger's own events.
            "CREATE TABLE IF NOT EXISTS ledger_statements (tenant VARCHAR(80) NOT NULL, account_id VARCHAR(80) NOT NULL, \
             credits BIGINT NOT NULL, debits BIGINT NOT NULL, events BIGINT NOT NULL, PRIMARY KEY (tenant, account_id))",
            // One row per application of an event to the projection (no
            // unique key on purpose: the harness counts them).
            "CREATE TABLE IF NOT EXISTS ledger_projection_log (tenant VARCHAR(80) NOT NULL, event_id VARCHAR(80) NOT NULL, \
             occurred_at_ms BIGINT NOT NULL, applied_at_ms BIGINT NOT NULL)",
            // The balance snapshots job: one row per account per run.
            "CREATE TABLE IF NOT EXISTS ledger_balance_snapshots (run_id VARCHAR(100) NOT NULL, tenant VARCHAR(80) NOT NULL, \
             account_id VARCHAR(80) NOT NULL, balance BIGINT NOT NULL, taken_at_ms BIGINT NOT NULL)",
            // Payouts: debited at once (a `payout` journal row), then paid at
            // the vendor by the payout worker with the payout id as its key.
            "CREATE TABLE IF NOT EXISTS ledger_payouts (tenant VARCHAR(80) NOT NULL, id VARCHAR(80) NOT NULL, \
             account_id VARCHAR(80) NOT NULL, amount BIGINT NOT NULL, state VARCHAR(20) NOT NULL, \
             vendor_payout_id VARCHAR(200) NULL, attempts BIGINT NOT NULL, last_error TEXT NULL, \
             created_at_ms BIGINT NOT NULL, updated_at_ms BIGINT NOT NULL, first_sent_at_ms BIGINT NULL, \
             not_before_ms BIGINT NULL, PRIMARY KEY (tenant, id))",
        ]
        .into_iter()
        .map(String::from)
        .collect();
        for index in [
            "ledger_entries_account ON ledger_entries (tenant, account_id)",
            "ledger_projection_log_event ON ledger_projection_log (event_id)",
            "ledger_balance_snapshots_run ON ledger_balance_snapshots (run_id)",
            "ledger_payouts_state ON ledger_payouts (state, created_at_ms)",
        ] {
            ddl.push(match self {
                Dialect::MySql => format!("CREATE INDEX {index}"),
                _ => format!("CREATE INDEX IF NOT EXISTS {index}"),
            });
        }
        ddl
    }
}

/// The prepared statements of one dialect.
pub struct Queries {
    dialect: Dialect,
    insert_account: SqlStr,
    select_account: SqlStr,
    account_exists: SqlStr,
    credit: SqlStr,
    debit: SqlStr,
    balance: SqlStr,
    insert_journal: SqlStr,
    insert_entry: SqlStr,
    audit_balances: SqlStr,
    audit_world: SqlStr,
    audit_kind: SqlStr,
    audit_negative: SqlStr,
    audit_mismatch: SqlStr,
    audit_journal: SqlStr,
    upsert_statement: SqlStr,
    insert_projection_log: SqlStr,
    select_statement: SqlStr,
    snapshot_balances: SqlStr,
    insert_payout: SqlStr,
    select_payout: SqlStr,
    payouts_in: SqlStr,
    payouts_redriven: SqlStr,
    change_payout: SqlStr,
    payouts_due: SqlStr,
    mark_sent: SqlStr,
    defer_payout: SqlStr,
    payout_columns: SqlStr,
    select_payout_for_cancel: SqlStr,
    cancel_payout: SqlStr,
}

impl Queries {
    /// Prepares every statement for `dialect`.
    pub fn new(dialect: Dialect) -> Self {
        let p = |s: &str| dialect.prepare(s);
        Self {
            dialect,
            insert_account: p(
                "INSERT INTO ledger_accounts (tenant, id, name, balance, created_at_ms) VALUES (?, ?, ?, 0, ?)",
            ),
            select_account: p("SELECT id, name, balance FROM ledger_accounts WHERE tenant = ? AND id = ?"),
            account_exists: p("SELECT balance FROM ledger_accounts WHERE tenant = ? AND id = ?"),
            credit: p("UPDATE ledger_accounts SET balance = balance + ? WHERE tenant = ? AND id = ? AND balance <= ?"),
            debit: p("UPDATE ledger_accounts SET balance = balance - ? WHERE tenant = ? AND id = ? AND balance >= ?"),
            balance: p("SELECT balance FROM ledger_accounts WHERE tenant = ? AND id = ?"),
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
            upsert_statement: p(dialect.upsert_statement()),
            insert_projection_log: p(
                "INSERT INTO ledger_projection_log (tenant, event_id, occurred_at_ms, applied_at_ms) VALUES (?, ?, ?, ?)",
            ),
            select_statement: p(
                "SELECT credits, debits, events FROM ledger_statements WHERE tenant = ? AND account_id = ?",
            ),
            snapshot_balances: p(
                "INSERT INTO ledger_balance_snapshots (run_id, tenant, account_id, balance, taken_at_ms) \
                 SELECT ?, tenant, id, balance, ? FROM ledger_accounts",
            ),
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
            payout_columns: p(match dialect {
                Dialect::Sqlite => "SELECT name FROM pragma_table_info('ledger_payouts')",
                Dialect::Postgres => {
                    "SELECT column_name::text FROM information_schema.columns \
                     WHERE table_schema = current_schema() AND table_name = 'ledger_payouts'"
                }
                Dialect::MySql => {
                    "SELECT CAST(column_name AS CHAR) FROM information_schema.columns \
                     WHERE table_schema = DATABASE() AND table_name = 'ledger_payouts'"
                }
            }),
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
}

/// What the ledger needs of a store: the idempotency backend plus the
/// ledger's own statements. Implemented for the PostgreSQL, MySQL/MariaDB and
/// SQLite stores.
pub trait LedgerDb: TxBackend + Clone {
    /// Creates the ledger's tables (the idempotency tables too).
    fn migrate(&self) -> BoxFuture<'_, Result<(), DbError>>;
    /// Whether the database answers.
    fn ping(&self) -> BoxFuture<'_, Result<(), DbError>>;
    /// Inserts an account.
    fn insert_account<'c>(
        tx: &'c mut Self::Tx,
        tenant: &'c str,
        id: &'c str,
        name: &'c str,
        now_ms: i64,
    ) -> BoxFuture<'c, Result<(), DbError>>;
    /// Reads an account of `tenant`.
    fn account<'a>(&'a self, tenant: &'a str, id: &'a str) -> BoxFuture<'a, Result<Option<Account>, DbError>>;
    /// Credits `amount` from `@world` to an account (kind `top_up`, or
    /// `webhook_top_up`); answers the new balance.
    #[allow(clippy::too_many_arguments)]
    fn top_up<'c>(
        tx: &'c mut Self::Tx,
        tenant: &'c str,
        journal_id: &'c str,
        kind: &'static str,
        account_id: &'c str,
        amount: i64,
        now_ms: i64,
    ) -> BoxFuture<'c, Result<i64, DbError>>;
    /// Moves `amount` between two accounts of `tenant`.
    #[allow(clippy::too_many_arguments)]
    fn transfer<'c>(
        tx: &'c mut Self::Tx,
        tenant: &'c str,
        journal_id: &'c str,
        from: &'c str,
        to: &'c str,
        amount: i64,
        now_ms: i64,
    ) -> BoxFuture<'c, Result<(), DbError>>;
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
    /// Applies one event to the statement projection and logs the application.
    fn apply_statement<'c>(
        tx: &'c mut Self::Tx,
        tenant: &'c str,
        event_id: &'c str,
        changes: &'c [StatementChange],
        occurred_at_ms: i64,
        now_ms: i64,
    ) -> BoxFuture<'c, Result<(), DbError>>;
    /// An account's statement, if the projection has seen it.
    fn statement<'a>(
        &'a self,
        tenant: &'a str,
        account_id: &'a str,
    ) -> BoxFuture<'a, Result<Option<Statement>, DbError>>;
    /// Writes one balance snapshot row per account under `run_id`; answers how many.
    fn snapshot_balances<'c>(tx: &'c mut Self::Tx, run_id: &'c str, now_ms: i64)
    -> BoxFuture<'c, Result<u64, DbError>>;
    /// Debits `amount` from an account to `@world` (kind `payout`) and
    /// records the payout as requested; answers the new balance.
    fn request_payout<'c>(
        tx: &'c mut Self::Tx,
        tenant: &'c str,
        id: &'c str,
        account_id: &'c str,
        amount: i64,
        now_ms: i64,
    ) -> BoxFuture<'c, Result<i64, DbError>>;
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
    /// Leaves a requested payout alone until `not_before_ms` (the vendor
    /// asked to wait); false when it is no longer requested.
    #[allow(clippy::too_many_arguments)]
    fn defer_payout<'c>(
        tx: &'c mut Self::Tx,
        tenant: &'c str,
        id: &'c str,
        not_before_ms: i64,
        attempts: i64,
        last_error: &'c str,
        now_ms: i64,
    ) -> BoxFuture<'c, Result<bool, DbError>>;
    /// Cancels a dead-lettered or unknown payout: its state moves to
    /// `cancelled` and the debit is reversed (kind `payout_reversal`, from
    /// `@world` back to the account), in the open transaction; false
    /// (nothing written) when it is in another state.
    fn cancel_payout<'c>(
        tx: &'c mut Self::Tx,
        tenant: &'c str,
        id: &'c str,
        now_ms: i64,
    ) -> BoxFuture<'c, Result<bool, DbError>>;
    /// Cancels the dead letter `id` in the open transaction, if it is known
    /// not to have been applied.
    fn cancel_dead_letter<'c>(
        letters: &'c Self::DeadLetters,
        tx: &'c mut Self::Tx,
        id: i64,
    ) -> BoxFuture<'c, Result<bool, DbError>>;
    /// Moves a payout from `change.from` to `change.to`; false (nothing
    /// written) when it was not in `change.from`.
    fn change_payout<'c>(
        tx: &'c mut Self::Tx,
        tenant: &'c str,
        id: &'c str,
        change: &'c PayoutChange<'c>,
    ) -> BoxFuture<'c, Result<bool, DbError>>;
}

macro_rules! ledger_db {
    ($store:ty, $db:ty, $outbox:ty, $letters:ty, $dialect:expr, $lock:expr, $unlock:expr) => {
        impl LedgerDb for $store {
            fn migrate(&self) -> BoxFuture<'_, Result<(), DbError>> {
                Box::pin(async move {
                    self.migrate().await?;
                    let mut conn = self.pool().acquire().await?;
                    // Serialise concurrent migrators: CREATE ... IF NOT EXISTS races on some engines.
                    if let Some(lock) = $lock {
                        sqlx::query(lock).execute(&mut *conn).await?;
                    }
                    let mut result: Result<(), DbError> = Ok(());
                    for stmt in $dialect.ddl() {
                        if let Err(e) = sqlx::query(AssertSqlSafe(stmt.clone())).execute(&mut *conn).await {
                            // MySQL has no CREATE INDEX IF NOT EXISTS: a duplicate key name (1061) means done.
                            let duplicate_index = e
                                .as_database_error()
                                .and_then(|d| d.code())
                                .is_some_and(|c| c == "42000" || c == "1061");
                            if !(duplicate_index && stmt.starts_with("CREATE INDEX ledger_")) {
                                result = Err(e.into());
                                break;
                            }
                        }
                    }
                    if let Some(unlock) = $unlock {
                        sqlx::query(unlock).execute(&mut *conn).await?;
                    }
                    result?;
                    // Older databases: the payout columns added since.
                    let columns: Vec<String> = sqlx::query_scalar(queries().payout_columns.clone())
                        .fetch_all(self.pool())
                        .await?;
                    for (column, ty) in [
                        ("first_sent_at_ms", "BIGINT NULL"),
                        ("not_before_ms", "BIGINT NULL"),
                    ] {
                        if !columns.iter().any(|c| c == column) {
                            let added = sqlx::query(AssertSqlSafe(format!(
                                "ALTER TABLE ledger_payouts ADD COLUMN {column} {ty}"
                            )))
                            .execute(self.pool())
                            .await;
                            // Another process may have added it meanwhile.
                            if let Err(e) = added
                                && !e.to_string().to_ascii_lowercase().contains("duplicate")
                                && !e.to_string().to_ascii_lowercase().contains("already exists")
                            {
                                return Err(e.into());
                            }
                        }
                    }
                    for table in [
                        WEBHOOK_INBOX_TABLE,
                        PROJECTION_INBOX_TABLE,
                        JOB_RUNS_TABLE,
                        PAYOUT_LEASES_TABLE,
                    ] {
                        self.keyed(TableName::new(table)?).migrate().await?;
                    }
                    self.outbox().migrate().await?;
                    self.dead_letters().migrate().await?;
                    Ok(())
                })
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

            fn cancel_dead_letter<'c>(
                letters: &'c $letters,
                tx: &'c mut <$store as idem_core::TxBackend>::Tx,
                id: i64,
            ) -> BoxFuture<'c, Result<bool, DbError>> {
                Box::pin(async move { Ok(letters.cancel_in(&mut **tx, id).await?) })
            }

            fn payouts_due(&self, now_ms: i64, limit: u32) -> BoxFuture<'_, Result<Vec<PayoutTask>, DbError>> {
                Box::pin(async move {
                    let rows: Vec<(String, String, String, i64)> = sqlx::query_as(queries().payouts_due.clone())
                        .bind(now_ms)
                        .bind(i64::from(limit))
                        .fetch_all(self.pool())
                        .await?;
                    Ok(rows
                        .into_iter()
                        .map(|(tenant, id, account_id, amount)| PayoutTask {
                            tenant,
                            id,
                            account_id,
                            amount,
                        })
                        .collect())
                })
            }

            fn mark_payout_sent<'a>(
                &'a self,
                tenant: &'a str,
                id: &'a str,
                now_ms: i64,
            ) -> BoxFuture<'a, Result<(), DbError>> {
                Box::pin(async move {
                    sqlx::query(queries().mark_sent.clone())
                        .bind(now_ms)
                        .bind(tenant)
                        .bind(id)
                        .execute(self.pool())
                        .await?;
                    Ok(())
                })
            }

            fn defer_payout<'c>(
                tx: &'c mut <$store as idem_core::TxBackend>::Tx,
                tenant: &'c str,
                id: &'c str,
                not_before_ms: i64,
                attempts: i64,
                last_error: &'c str,
                now_ms: i64,
            ) -> BoxFuture<'c, Result<bool, DbError>> {
                Box::pin(async move {
                    let done = sqlx::query(queries().defer_payout.clone())
                        .bind(not_before_ms)
                        .bind(attempts)
                        .bind(last_error)
                        .bind(now_ms)
                        .bind(tenant)
                        .bind(id)
                        .execute(&mut **tx)
                        .await?;
                    Ok(done.rows_affected() == 1)
                })
            }

            fn cancel_payout<'c>(
                tx: &'c mut <$store as idem_core::TxBackend>::Tx,
                tenant: &'c str,
                id: &'c str,
                now_ms: i64,
            ) -> BoxFuture<'c, Result<bool, DbError>> {
                Box::pin(async move {
                    let q = queries();
                    let row: Option<(String, i64, String)> = sqlx::query_as(q.select_payout_for_cancel.clone())
                        .bind(tenant)
                        .bind(id)
                        .fetch_optional(&mut **tx)
                        .await?;
                    let Some((account_id, amount, state)) = row else {
                        return Ok(false);
                    };
                    if !(state == "dead_lettered" || state == "unknown") {
                        return Ok(false);
                    }
                    let moved = sqlx::query(q.cancel_payout.clone())
                        .bind(now_ms)
                        .bind(tenant)
                        .bind(id)
                        .execute(&mut **tx)
                        .await?;
                    if moved.rows_affected() != 1 {
                        return Ok(false);
                    }
                    // The reversal: the money comes back from `@world`, under
                    // a journal id of its own.
                    let journal_id = format!("{id}:reversal");
                    credit(&mut **tx, q, tenant, &account_id, amount).await?;
                    journal(
                        &mut **tx,
                        q,
                        tenant,
                        &journal_id,
                        "payout_reversal",
                        amount,
                        None,
                        Some(&account_id),
                        now_ms,
                    )
                    .await?;
                    entries(
                        &mut **tx,
                        q,
                        tenant,
                        &journal_id,
                        (WORLD, -amount),
                        (&account_id, amount),
                    )
                    .await?;
                    Ok(true)
                })
            }

            fn record_dead_letter<'c>(
                letters: &'c $letters,
                tx: &'c mut <$store as idem_core::TxBackend>::Tx,
                letter: &'c NewDeadLetter,
            ) -> BoxFuture<'c, Result<i64, DbError>> {
                Box::pin(async move { Ok(letters.record_in(&mut **tx, letter).await?) })
            }

            fn keyed(&self, table: TableName) -> Self {
                self.clone().with_table(table)
            }

            fn apply_statement<'c>(
                tx: &'c mut <$store as idem_core::TxBackend>::Tx,
                tenant: &'c str,
                event_id: &'c str,
                changes: &'c [StatementChange],
                occurred_at_ms: i64,
                now_ms: i64,
            ) -> BoxFuture<'c, Result<(), DbError>> {
                Box::pin(async move {
                    let q = queries();
                    // A fixed order of rows, so two projections of opposite
                    // transfers cannot deadlock each other.
                    let mut changes: Vec<&StatementChange> = changes.iter().collect();
                    changes.sort_by(|a, b| a.account_id.cmp(&b.account_id));
                    for c in changes {
                        sqlx::query(q.upsert_statement.clone())
                            .bind(tenant)
                            .bind(&c.account_id)
                            .bind(c.credit)
                            .bind(c.debit)
                            .execute(&mut **tx)
                            .await?;
                    }
                    sqlx::query(q.insert_projection_log.clone())
                        .bind(tenant)
                        .bind(event_id)
                        .bind(occurred_at_ms)
                        .bind(now_ms)
                        .execute(&mut **tx)
                        .await?;
                    Ok(())
                })
            }

            fn statement<'a>(
                &'a self,
                tenant: &'a str,
                account_id: &'a str,
            ) -> BoxFuture<'a, Result<Option<Statement>, DbError>> {
                Box::pin(async move {
                    let row: Option<(i64, i64, i64)> = sqlx::query_as(queries().select_statement.clone())
                        .bind(tenant)
                        .bind(account_id)
                        .fetch_optional(self.pool())
                        .await?;
                    Ok(row.map(|(credits, debits, events)| Statement {
                        account_id: account_id.to_owned(),
                        credits,
                        debits,
                        balance: credits - debits,
                        events,
                    }))
                })
            }

            fn snapshot_balances<'c>(
                tx: &'c mut <$store as idem_core::TxBackend>::Tx,
                run_id: &'c str,
                now_ms: i64,
            ) -> BoxFuture<'c, Result<u64, DbError>> {
                Box::pin(async move {
                    let done = sqlx::query(queries().snapshot_balances.clone())
                        .bind(run_id)
                        .bind(now_ms)
                        .execute(&mut **tx)
                        .await?;
                    Ok(done.rows_affected())
                })
            }

            fn request_payout<'c>(
                tx: &'c mut <$store as idem_core::TxBackend>::Tx,
                tenant: &'c str,
                id: &'c str,
                account_id: &'c str,
                amount: i64,
                now_ms: i64,
            ) -> BoxFuture<'c, Result<i64, DbError>> {
                Box::pin(async move {
                    let q = queries();
                    debit(&mut **tx, q, tenant, account_id, amount).await?;
                    journal(
                        &mut **tx,
                        q,
                        tenant,
                        id,
                        "payout",
                        amount,
                        Some(account_id),
                        None,
                        now_ms,
                    )
                    .await?;
                    entries(&mut **tx, q, tenant, id, (account_id, -amount), (WORLD, amount)).await?;
                    sqlx::query(q.insert_payout.clone())
                        .bind(tenant)
                        .bind(id)
                        .bind(account_id)
                        .bind(amount)
                        .bind(now_ms)
                        .bind(now_ms)
                        .execute(&mut **tx)
                        .await?;
                    let (balance,): (i64,) = sqlx::query_as(q.balance.clone())
                        .bind(tenant)
                        .bind(account_id)
                        .fetch_one(&mut **tx)
                        .await?;
                    Ok(balance)
                })
            }

            fn payout<'a>(&'a self, tenant: &'a str, id: &'a str) -> BoxFuture<'a, Result<Option<Payout>, DbError>> {
                Box::pin(async move {
                    type Row = (
                        String,
                        String,
                        i64,
                        String,
                        Option<String>,
                        i64,
                        Option<String>,
                        i64,
                        i64,
                        Option<i64>,
                        Option<i64>,
                    );
                    let row: Option<Row> = sqlx::query_as(queries().select_payout.clone())
                        .bind(tenant)
                        .bind(id)
                        .fetch_optional(self.pool())
                        .await?;
                    row.map(
                        |(
                            id,
                            account_id,
                            amount,
                            state,
                            vendor_payout_id,
                            attempts,
                            last_error,
                            created_at_ms,
                            updated_at_ms,
                            first_sent_at_ms,
                            not_before_ms,
                        )| {
                            Ok(Payout {
                                id,
                                account_id,
                                amount,
                                status: PayoutState::parse(&state)?,
                                vendor_payout_id,
                                attempts,
                                last_error,
                                created_at_ms,
                                updated_at_ms,
                                first_sent_at_ms,
                                not_before_ms,
                            })
                        },
                    )
                    .transpose()
                })
            }

            fn payouts_in(&self, state: PayoutState, limit: u32) -> BoxFuture<'_, Result<Vec<PayoutTask>, DbError>> {
                Box::pin(async move {
                    let rows: Vec<(String, String, String, i64)> = sqlx::query_as(queries().payouts_in.clone())
                        .bind(state.as_str())
                        .bind(i64::from(limit))
                        .fetch_all(self.pool())
                        .await?;
                    Ok(rows
                        .into_iter()
                        .map(|(tenant, id, account_id, amount)| PayoutTask {
                            tenant,
                            id,
                            account_id,
                            amount,
                        })
                        .collect())
                })
            }

            fn payouts_redriven<'a>(
                &'a self,
                operation: &'a str,
                limit: u32,
            ) -> BoxFuture<'a, Result<Vec<PayoutTask>, DbError>> {
                Box::pin(async move {
                    let rows: Vec<(String, String, String, i64)> = sqlx::query_as(queries().payouts_redriven.clone())
                        .bind(operation)
                        .bind(i64::from(limit))
                        .fetch_all(self.pool())
                        .await?;
                    Ok(rows
                        .into_iter()
                        .map(|(tenant, id, account_id, amount)| PayoutTask {
                            tenant,
                            id,
                            account_id,
                            amount,
                        })
                        .collect())
                })
            }

            fn change_payout<'c>(
                tx: &'c mut <$store as idem_core::TxBackend>::Tx,
                tenant: &'c str,
                id: &'c str,
                change: &'c PayoutChange<'c>,
            ) -> BoxFuture<'c, Result<bool, DbError>> {
                Box::pin(async move {
                    let done = sqlx::query(queries().change_payout.clone())
                        .bind(change.to.as_str())
                        .bind(change.vendor_payout_id)
                        .bind(change.attempts)
                        .bind(change.last_error)
                        .bind(change.now_ms)
                        .bind(tenant)
                        .bind(id)
                        .bind(change.from.as_str())
                        .execute(&mut **tx)
                        .await?;
                    Ok(done.rows_affected() == 1)
                })
            }

            fn ping(&self) -> BoxFuture<'_, Result<(), DbError>> {
                Box::pin(async move {
                    sqlx::query("SELECT 1").execute(self.pool()).await?;
                    Ok(())
                })
            }

            fn insert_account<'c>(
                tx: &'c mut <$store as idem_core::TxBackend>::Tx,
                tenant: &'c str,
                id: &'c str,
                name: &'c str,
                now_ms: i64,
            ) -> BoxFuture<'c, Result<(), DbError>> {
                Box::pin(async move {
                    let q = queries();
                    sqlx::query(q.insert_account.clone())
                        .bind(tenant)
                        .bind(id)
                        .bind(name)
                        .bind(now_ms)
                        .execute(&mut **tx)
                        .await?;
                    Ok(())
                })
            }

            fn account<'a>(&'a self, tenant: &'a str, id: &'a str) -> BoxFuture<'a, Result<Option<Account>, DbError>> {
                Box::pin(async move {
                    let row: Option<(String, String, i64)> = sqlx::query_as(queries().select_account.clone())
                        .bind(tenant)
                        .bind(id)
                        .fetch_optional(self.pool())
                        .await?;
                    Ok(row.map(|(id, name, balance)| Account { id, name, balance }))
                })
            }

            fn top_up<'c>(
                tx: &'c mut <$store as idem_core::TxBackend>::Tx,
                tenant: &'c str,
                journal_id: &'c str,
                kind: &'static str,
                account_id: &'c str,
                amount: i64,
                now_ms: i64,
            ) -> BoxFuture<'c, Result<i64, DbError>> {
                Box::pin(async move {
                    let q = queries();
                    credit(&mut **tx, q, tenant, account_id, amount).await?;
                    journal(
                        &mut **tx,
                        q,
                        tenant,
                        journal_id,
                        kind,
                        amount,
                        None,
                        Some(account_id),
                        now_ms,
                    )
                    .await?;
                    entries(
                        &mut **tx,
                        q,
                        tenant,
                        journal_id,
                        (WORLD, -amount),
                        (account_id, amount),
                    )
                    .await?;
                    let (balance,): (i64,) = sqlx::query_as(q.balance.clone())
                        .bind(tenant)
                        .bind(account_id)
                        .fetch_one(&mut **tx)
                        .await?;
                    Ok(balance)
                })
            }

            fn transfer<'c>(
                tx: &'c mut <$store as idem_core::TxBackend>::Tx,
                tenant: &'c str,
                journal_id: &'c str,
                from: &'c str,
                to: &'c str,
                amount: i64,
                now_ms: i64,
            ) -> BoxFuture<'c, Result<(), DbError>> {
                Box::pin(async move {
                    let q = queries();
                    // Lock the two rows in a fixed order, so two opposite
                    // transfers cannot deadlock each other.
                    if from < to {
                        debit(&mut **tx, q, tenant, from, amount).await?;
                        credit(&mut **tx, q, tenant, to, amount).await?;
                    } else {
                        credit(&mut **tx, q, tenant, to, amount).await?;
                        debit(&mut **tx, q, tenant, from, amount).await?;
                    }
                    journal(
                        &mut **tx,
                        q,
                        tenant,
                        journal_id,
                        "transfer",
                        amount,
                        Some(from),
                        Some(to),
                        now_ms,
                    )
                    .await?;
                    entries(&mut **tx, q, tenant, journal_id, (from, -amount), (to, amount)).await?;
                    Ok(())
                })
            }

            fn audit<'a>(&'a self, tenant: &'a str) -> BoxFuture<'a, Result<Audit, DbError>> {
                Box::pin(async move {
                    let q = queries();
                    let mut tx = self.pool().begin_with(q.dialect.snapshot()).await?;
                    let one = |sql: &SqlStr| sqlx::query_as::<_, (i64,)>(sql.clone()).bind(tenant);
                    let (balances_total,) = one(&q.audit_balances).fetch_one(&mut *tx).await?;
                    let (world_total,) = one(&q.audit_world).fetch_one(&mut *tx).await?;
                    let mut top_ups_total = 0i64;
                    for kind in ["top_up", "webhook_top_up"] {
                        let (t,): (i64,) = one(&q.audit_kind).bind(kind).fetch_one(&mut *tx).await?;
                        top_ups_total = top_ups_total.saturating_add(t);
                    }
                    let (paid_out,) = one(&q.audit_kind).bind("payout").fetch_one(&mut *tx).await?;
                    // A cancelled payout's reversal gives its amount back.
                    let (reversed,) = one(&q.audit_kind)
                        .bind("payout_reversal")
                        .fetch_one(&mut *tx)
                        .await?;
                    let payouts_total = paid_out.saturating_sub(reversed);
                    let (negative_balances,) = one(&q.audit_negative).fetch_one(&mut *tx).await?;
                    let (balance_mismatches,) = one(&q.audit_mismatch).fetch_one(&mut *tx).await?;
                    let (journal_rows,) = one(&q.audit_journal).fetch_one(&mut *tx).await?;
                    tx.rollback().await?;
                    Ok(Audit::new(
                        balances_total,
                        world_total,
                        top_ups_total,
                        payouts_total,
                        negative_balances,
                        balance_mismatches,
                        journal_rows,
                    ))
                })
            }
        }

        fn queries() -> &'static Queries {
            static Q: std::sync::OnceLock<Queries> = std::sync::OnceLock::new();
            Q.get_or_init(|| Queries::new($dialect))
        }

        /// Adds `amount` to an account's balance, refused if it would pass
        /// the balance limit.
        async fn credit(
            conn: &mut <$db as sqlx::Database>::Connection,
            q: &Queries,
            tenant: &str,
            id: &str,
            amount: i64,
        ) -> Result<(), DbError> {
            adjust(conn, q, Change::Credit, tenant, id, amount).await
        }

        /// Takes `amount` from an account's balance, refused if it holds less.
        async fn debit(
            conn: &mut <$db as sqlx::Database>::Connection,
            q: &Queries,
            tenant: &str,
            id: &str,
            amount: i64,
        ) -> Result<(), DbError> {
            adjust(conn, q, Change::Debit, tenant, id, amount).await
        }

        /// One guarded balance update: the guard is part of the UPDATE, so a
        /// refused change writes nothing; the account is then read to say why.
        async fn adjust(
            conn: &mut <$db as sqlx::Database>::Connection,
            q: &Queries,
            change: Change,
            tenant: &str,
            id: &str,
            amount: i64,
        ) -> Result<(), DbError> {
            let (statement, guard) = match change {
                Change::Credit => (q.credit.clone(), MAX_BALANCE - amount),
                Change::Debit => (q.debit.clone(), amount),
            };
            let done = sqlx::query(statement)
                .bind(amount)
                .bind(tenant)
                .bind(id)
                .bind(guard)
                .execute(&mut *conn)
                .await?;
            if done.rows_affected() == 1 {
                return Ok(());
            }
            let exists: Option<(i64,)> = sqlx::query_as(q.account_exists.clone())
                .bind(tenant)
                .bind(id)
                .fetch_optional(&mut *conn)
                .await?;
            Err(match (exists, change) {
                (None, _) => DbError::AccountNotFound(id.to_owned()),
                (Some(_), Change::Credit) => DbError::BalanceLimit,
                (Some((balance,)), Change::Debit) => DbError::InsufficientFunds {
                    balance,
                    requested: amount,
                },
            })
        }

        #[allow(clippy::too_many_arguments)]
        async fn journal(
            conn: &mut <$db as sqlx::Database>::Connection,
            q: &Queries,
            tenant: &str,
            id: &str,
            kind: &str,
            amount: i64,
            from: Option<&str>,
            to: Option<&str>,
            now_ms: i64,
        ) -> Result<(), DbError> {
            sqlx::query(q.insert_journal.clone())
                .bind(tenant)
                .bind(id)
                .bind(kind)
                .bind(amount)
                .bind(from)
                .bind(to)
                .bind(now_ms)
                .execute(&mut *conn)
                .await?;
            Ok(())
        }

        async fn entries(
            conn: &mut <$db as sqlx::Database>::Connection,
            q: &Queries,
            tenant: &str,
            journal_id: &str,
            a: (&str, i64),
            b: (&str, i64),
        ) -> Result<(), DbError> {
            sqlx::query(q.insert_entry.clone())
                .bind(tenant)
                .bind(journal_id)
                .bind(a.0)
                .bind(a.1)
                .bind(tenant)
                .bind(journal_id)
                .bind(b.0)
                .bind(b.1)
                .execute(&mut *conn)
                .await?;
            Ok(())
        }
    };
}

impl Audit {
    fn new(
        balances_total: i64,
        world_total: i64,
        top_ups_total: i64,
        payouts_total: i64,
        negative_balances: i64,
        balance_mismatches: i64,
        journal_rows: i64,
    ) -> Self {
        let entries_balanced = balances_total.checked_add(world_total) == Some(0);
        let conserved = top_ups_total.checked_sub(payouts_total) == Some(balances_total)
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
        }
    }
}

mod postgres {
    use super::*;
    ledger_db!(
        idem_postgres::PgStore,
        sqlx::Postgres,
        idem_postgres::PgOutbox,
        idem_postgres::PgDeadLetters,
        Dialect::Postgres,
        Some("SELECT pg_advisory_lock(7262687201)"),
        Some("SELECT pg_advisory_unlock(7262687201)")
    );
}

mod mysql {
    use super::*;
    ledger_db!(
        idem_mysql::MySqlStore,
        sqlx::MySql,
        idem_mysql::MySqlOutbox,
        idem_mysql::MySqlDeadLetters,
        Dialect::MySql,
        Some("SELECT GET_LOCK('ledger_migrate', 60)"),
        Some("SELECT RELEASE_LOCK('ledger_migrate')")
    );
}

mod sqlite {
    use super::*;
    ledger_db!(
        idem_sqlite::SqliteStore,
        sqlx::Sqlite,
        idem_sqlite::SqliteOutbox,
        idem_sqlite::SqliteDeadLetters,
        Dialect::Sqlite,
        None::<&'static str>,
        None::<&'static str>
    );
}
