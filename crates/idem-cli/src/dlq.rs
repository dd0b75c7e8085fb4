//! `idem dlq`: dead letters of outbound calls on the SQL stores, listed,
//! shown and redriven.

use idem_core::{
    BoxFuture, DeadLetter, DeadLetterFilter, DeadLetterStore, Error, IdempotencyKey, NewDeadLetter, RedriveHold,
    RedriveOutcome, Result, Scope, TableName,
};
use idem_gateway::AnyLease;
use idem_outbound::{RedriveReport, RedriveResult};

/// The dead letters of one of the SQL stores, chosen by URL.
#[derive(Clone, Debug)]
pub(crate) enum AnyDeadLetters {
    /// A SQLite file.
    Sqlite(idem_sqlite::SqliteDeadLetters),
    /// PostgreSQL.
    Postgres(idem_postgres::PgDeadLetters),
    /// MySQL or MariaDB.
    MySql(idem_mysql::MySqlDeadLetters),
}

macro_rules! each {
    ($self:expr, $s:ident => $body:expr) => {
        match $self {
            AnyDeadLetters::Sqlite($s) => $body,
            AnyDeadLetters::Postgres($s) => $body,
            AnyDeadLetters::MySql($s) => $body,
        }
    };
}

impl AnyDeadLetters {
    /// The dead letters in `table` of the store at `url` (the URLs of
    /// [`AnyLease::open`]); nothing is created. Redis keeps none.
    pub(crate) async fn open(url: &str, table: TableName) -> Result<Self> {
        Ok(match AnyLease::open(url).await? {
            AnyLease::Sqlite(s) => Self::Sqlite(idem_sqlite::SqliteDeadLetters::with_table(s.pool().clone(), table)),
            AnyLease::Postgres(s) => Self::Postgres(idem_postgres::PgDeadLetters::with_table(s.pool().clone(), table)),
            AnyLease::MySql(s) => Self::MySql(idem_mysql::MySqlDeadLetters::with_table(s.pool().clone(), table)),
            AnyLease::Redis(_) => {
                return Err(Error::Config(
                    "Redis keeps no dead letters: use the service's SQL database".into(),
                ));
            }
        })
    }

    /// The schema versions the dead-letter table has not had yet.
    pub(crate) async fn pending_migrations(&self) -> Result<Vec<idem_core::PendingMigration>> {
        each!(self, s => s.pending_migrations().await)
    }

    /// Creates or upgrades the dead-letter table.
    pub(crate) async fn migrate(&self) -> Result<()> {
        each!(self, s => s.migrate().await)
    }

    /// The store's kind.
    pub(crate) fn kind(&self) -> &'static str {
        match self {
            Self::Sqlite(_) => "sqlite",
            Self::Postgres(_) => "postgres",
            Self::MySql(_) => "mysql",
        }
    }
}

impl DeadLetterStore for AnyDeadLetters {
    fn record(&self, letter: &NewDeadLetter) -> BoxFuture<'_, Result<i64>> {
        each!(self, s => s.record(letter))
    }

    fn list(&self, filter: &DeadLetterFilter) -> BoxFuture<'_, Result<Vec<DeadLetter>>> {
        each!(self, s => s.list(filter))
    }

    fn get(&self, id: i64) -> BoxFuture<'_, Result<Option<DeadLetter>>> {
        each!(self, s => s.get(id))
    }

    fn find(&self, scope: &Scope, key: &IdempotencyKey) -> BoxFuture<'_, Result<Option<DeadLetter>>> {
        each!(self, s => s.find(scope, key))
    }

    fn begin_redrive(&self, id: i64, hold_ms: i64) -> BoxFuture<'_, Result<Option<RedriveHold>>> {
        each!(self, s => s.begin_redrive(id, hold_ms))
    }

    fn finish_redrive(&self, id: i64, token: u32, outcome: &RedriveOutcome) -> BoxFuture<'_, Result<bool>> {
        each!(self, s => s.finish_redrive(id, token, outcome))
    }

    fn purge_resolved(&self, older_than_ms: i64, limit: u32) -> BoxFuture<'_, Result<u64>> {
        each!(self, s => s.purge_resolved(older_than_ms, limit))
    }
}

/// Text kept from a body or error: at most this many characters.
const SHOWN_CHARS: usize = 4096;

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).chars().take(SHOWN_CHARS).collect()
}

/// A dead letter's summary (`list`).
pub(crate) fn summary_json(l: &DeadLetter) -> serde_json::Value {
    serde_json::json!({
        "id": l.id,
        "tenant": l.scope.tenant().as_str(),
        "operation": l.scope.operation().as_str(),
        "key": l.key.as_str(),
        "state": l.state.as_str(),
        "method": l.request.method(),
        "url": l.request.url(),
        "attempts": l.attempts,
        "redrives": l.redrives,
        "last_error": l.last_error,
        "created_at_ms": l.created_at_ms,
        "updated_at_ms": l.updated_at_ms,
        "redrive_until_ms": l.redrive_until_ms,
        "response_status": l.response_status,
    })
}

/// A dead letter in full (`show`): the request's headers and body, and the
/// answer of a redrive that resolved it.
pub(crate) fn detail_json(l: &DeadLetter) -> serde_json::Value {
    let mut v = summary_json(l);
    v["headers"] = l
        .request
        .headers()
        .iter()
        .map(|(n, value)| serde_json::json!([n, value]))
        .collect::<Vec<_>>()
        .into();
    v["body"] = text(l.request.body()).into();
    v["response_body"] = l.response_body.as_deref().map(text).into();
    v
}

/// One line of `list`.
pub(crate) fn summary_line(l: &DeadLetter) -> String {
    format!(
        "{}\t{}\t{}\t{}\t{}\t{} {}\t{} attempt(s)\t{}",
        l.id,
        l.scope.tenant().as_str(),
        l.scope.operation().as_str(),
        l.key.as_str(),
        l.state.as_str(),
        l.request.method(),
        l.request.url(),
        l.attempts,
        l.last_error.lines().next().unwrap_or_default(),
    )
}

/// One redrive's result as JSON.
pub(crate) fn result_json(id: i64, result: &RedriveResult) -> serde_json::Value {
    match result {
        RedriveResult::Resolved { status, attempts } => {
            serde_json::json!({ "id": id, "result": "resolved", "status": status, "attempts": attempts })
        }
        RedriveResult::Failed { attempts, error } => {
            serde_json::json!({ "id": id, "result": "failed", "attempts": attempts, "error": error })
        }
        RedriveResult::Skipped => serde_json::json!({ "id": id, "result": "skipped" }),
        RedriveResult::HoldLost => serde_json::json!({ "id": id, "result": "hold_lost" }),
        RedriveResult::StoreError(e) => serde_json::json!({ "id": id, "result": "store_error", "error": e }),
    }
}

/// One redrive's result as a line.
pub(crate) fn result_line(id: i64, result: &RedriveResult) -> String {
    match result {
        RedriveResult::Resolved { status, attempts } => {
            format!("{id}\tresolved\tHTTP {status} after {attempts} attempt(s)")
        }
        RedriveResult::Failed { attempts, error } => format!("{id}\tfailed\t{attempts} attempt(s): {error}"),
        RedriveResult::Skipped => format!("{id}\tskipped\t(resolved, gone, or held by another redrive)"),
        RedriveResult::HoldLost => format!("{id}\thold lost\t(another redrive took it over)"),
        RedriveResult::StoreError(e) => format!("{id}\tstore error\t{e}"),
    }
}

/// A run's report as JSON.
pub(crate) fn report_json(kind: &str, r: &RedriveReport) -> serde_json::Value {
    serde_json::json!({
        "store": kind,
        "resolved": r.resolved,
        "failed": r.failed,
        "skipped": r.skipped,
        "errors": r.errors,
        "items": r.items.iter().map(|i| result_json(i.id, &i.result)).collect::<Vec<_>>(),
    })
}
