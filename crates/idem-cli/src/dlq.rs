//! `idem dlq`: dead letters of outbound calls on the SQL stores, listed,
//! shown, redriven and resolved.
//!
//! `idem dlq redrive` has no way to ask a vendor what became of a call (a
//! reconcile hook is the service's: it knows the vendor's lookup). So a
//! letter whose first send may have reached the vendor longer ago than the
//! vendor remembers keys (the horizon the letter's sends were made under,
//! kept with it, or a shorter `--key-horizon-secs`), or whose outcome is
//! held as unknown, is not sent: it is held as unknown, and the operator
//! checks the vendor and records what it says with `idem dlq resolve`, or
//! sends it anyway with `--past-horizon`. A letter that does not say its
//! terms is refused unless `--key-horizon-secs` is given: they are never
//! guessed.

use std::time::Duration;

use idem_core::{
    BoxFuture, DeadLetter, DeadLetterFilter, DeadLetterStore, Error, IdempotencyKey, NewDeadLetter, RedriveHold,
    RedriveOutcome, Result, Scope, Settlement, TableName, Verdict, VerdictSource,
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

    fn retarget(&self, id: i64, token: u32, url: &str) -> BoxFuture<'_, Result<bool>> {
        each!(self, s => s.retarget(id, token, url))
    }

    fn settle(&self, id: i64, settlement: &Settlement) -> BoxFuture<'_, Result<bool>> {
        each!(self, s => s.settle(id, settlement))
    }

    fn cancel(&self, id: i64) -> BoxFuture<'_, Result<bool>> {
        each!(self, s => s.cancel(id))
    }
}

/// The longest key horizon `--key-horizon-secs` takes (366 days).
const MAX_HORIZON_SECS: u64 = 31_622_400;

/// How `dlq redrive` sends: the target, the vendor's key horizon, the
/// operator's override and the secret headers.
#[derive(Debug, clap::Args)]
pub(crate) struct ResendArgs {
    /// Send to this URL instead of each letter's own (a vendor URL fixed
    /// since), and keep it in each letter sent.
    #[arg(long)]
    url: Option<String>,
    /// How long the vendor remembers idempotency keys, in seconds (0: it
    /// has none). By default each letter's own: the horizon its sends were
    /// made under, kept with it; a letter that does not say is refused, not
    /// sent. Given, the shorter of this and the letter's applies. A letter
    /// whose first send may have reached the vendor longer ago is held as
    /// unknown, not sent.
    #[arg(long, value_parser = clap::value_parser!(u64).range(0..=MAX_HORIZON_SECS))]
    key_horizon_secs: Option<u64>,
    /// Kept from the horizon, in seconds (default the letter's; with
    /// `--key-horizon-secs`, an hour, at most a tenth of a horizon shorter
    /// than ten hours). The longer of this and the letter's applies.
    #[arg(long, value_parser = clap::value_parser!(u64).range(0..=MAX_HORIZON_SECS))]
    horizon_margin_secs: Option<u64>,
    /// How long after a send started the vendor's "not found" is trusted,
    /// in seconds (default the attempt timeout plus 5 s). The longer of
    /// this and the letter's applies.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=3_600))]
    settle_secs: Option<u64>,
    /// Send letters past the horizon anyway: you have checked the vendor
    /// (a letter held as unknown still needs `idem dlq resolve`).
    #[arg(long)]
    past_horizon: bool,
    /// How long each letter is held against other redrives once taken, in
    /// seconds (default: the deadline plus 30 s). A redrive that dies
    /// leaves its letters `redriving` until their hold runs out; no send is
    /// started with less than a third of the hold left.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=86_400))]
    hold_secs: Option<u64>,
    /// A field the vendor's 2xx answer must hold as a non-empty string, as
    /// its contract promises (`id`). Repeatable. An answer without it holds the
    /// letter as unknown, for `idem dlq resolve`, instead of resolving it.
    #[arg(long = "answer-field", value_name = "NAME")]
    answer_fields: Vec<String>,
    /// A field of the request's JSON body the 2xx answer must repeat with
    /// the same value (`amount`, `reference`). Repeatable; as
    /// `--answer-field`, an answer that does not holds the letter as unknown.
    #[arg(long = "answer-echo", value_name = "NAME")]
    answer_echoes: Vec<String>,
    /// A header to send with every redrive but never store (the vendor's
    /// credentials), as NAME:ENV_VAR: the value is read from that
    /// environment variable, never from the command line. Repeatable.
    #[arg(long = "secret-header")]
    secret_headers: Vec<String>,
    /// The CA certificates (PEM) an https vendor must be signed by, in
    /// place of the platform's roots.
    #[arg(long)]
    ca_file: Option<std::path::PathBuf>,
}

impl ResendArgs {
    /// `--hold-secs`, if given.
    pub(crate) fn hold_secs(&self) -> Option<u64> {
        self.hold_secs
    }

    /// Whether `--url` sends the letters to another target.
    pub(crate) fn retargets(&self) -> bool {
        self.url.is_some()
    }

    /// `base` with the horizon, the settle time and the secret headers.
    /// Without `--key-horizon-secs` the client has no horizon of its own
    /// (the longest there is, no margin): each letter's terms apply, as the
    /// strictest of both always does.
    pub(crate) fn config(
        &self,
        base: idem_outbound::OutboundConfig,
    ) -> std::result::Result<idem_outbound::OutboundConfig, crate::Failure> {
        let bad = |why: String| crate::Failure(2, why);
        let key_horizon = match self.key_horizon_secs {
            Some(secs) => {
                let horizon = Duration::from_secs(secs);
                let margin = self
                    .horizon_margin_secs
                    .map(Duration::from_secs)
                    .unwrap_or_else(|| Duration::from_secs(3600).min(horizon / 10));
                idem_outbound::KeyHorizon::new(horizon, margin)
            }
            None => idem_outbound::KeyHorizon::new(
                Duration::from_secs(MAX_HORIZON_SECS),
                Duration::from_secs(self.horizon_margin_secs.unwrap_or(0)),
            ),
        };
        let mut config = idem_outbound::OutboundConfig {
            key_horizon,
            reconcile_settle: self.settle_secs.map(Duration::from_secs),
            ca_file: self.ca_file.clone(),
            ..base
        };
        for spec in &self.secret_headers {
            let Some((name, var)) = spec.split_once(':') else {
                return Err(bad(format!("--secret-header {spec:?}: expected NAME:ENV_VAR")));
            };
            let value = std::env::var(var).map_err(|_| {
                bad(format!(
                    "--secret-header {name}: the environment variable {var} is not set"
                ))
            })?;
            config = config
                .with_secret_header(name, &value)
                .map_err(|e| bad(format!("--secret-header {name}: {e}")))?;
        }
        config.validate().map_err(|e| bad(e.to_string()))?;
        Ok(config)
    }

    /// The redriver, with the target override checked.
    pub(crate) fn redriver<S: DeadLetterStore>(
        &self,
        client: idem_outbound::OutboundClient,
        store: S,
    ) -> std::result::Result<idem_outbound::Redriver<S>, crate::Failure> {
        let mut redriver = idem_outbound::Redriver::new(client, store)
            .with_past_horizon_override(self.past_horizon)
            .with_terms_required(self.key_horizon_secs.is_none());
        if let Some(secs) = self.hold_secs {
            redriver = redriver.with_hold(Duration::from_secs(secs));
        }
        if !self.answer_fields.is_empty() || !self.answer_echoes.is_empty() {
            let (fields, echoes) = (self.answer_fields.clone(), self.answer_echoes.clone());
            redriver = redriver.with_answer_check(std::sync::Arc::new(move |request, body| {
                check_answer(&fields, &echoes, request.body(), body)
            }));
        }
        match &self.url {
            Some(url) => redriver
                .with_target(url)
                .map_err(|e| crate::Failure(2, format!("--url: {e}"))),
            None => Ok(redriver),
        }
    }
}

/// The operator's settlement of `dlq resolve`.
pub(crate) fn settlement(
    applied: bool,
    status: u16,
    body: String,
    note: String,
) -> std::result::Result<Settlement, crate::Failure> {
    if note.trim().is_empty() || note.len() > idem_core::MAX_DEAD_LETTER_TEXT {
        return Err(crate::Failure(
            2,
            format!(
                "--note: say where it was checked (1 to {} bytes)",
                idem_core::MAX_DEAD_LETTER_TEXT
            ),
        ));
    }
    if body.len() > idem_core::MAX_DEAD_LETTER_RESPONSE {
        return Err(crate::Failure(
            2,
            format!("--body: at most {} bytes", idem_core::MAX_DEAD_LETTER_RESPONSE),
        ));
    }
    Ok(Settlement {
        verdict: if applied { Verdict::Applied } else { Verdict::NotApplied },
        by: VerdictSource::Operator,
        status: applied.then_some(status),
        body: body.into_bytes(),
        note,
    })
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
        "first_reached_at_ms": l.first_reached_at_ms,
        "sent_under": l.sent_under.map(|t| serde_json::json!({
            "key_horizon_secs": t.key_horizon.as_secs_f64(),
            "horizon_margin_secs": t.horizon_margin.as_secs_f64(),
            "settle_secs": t.settle.as_secs_f64(),
        })),
        "verdict": l.reconciliation.as_ref().map(|r| serde_json::json!({
            "verdict": r.verdict.as_str(),
            "by": r.by.as_str(),
            "at_ms": r.at_ms,
            "note": r.note,
        })),
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
        RedriveResult::Unknown { reason } => serde_json::json!({ "id": id, "result": "unknown", "reason": reason }),
        RedriveResult::Skipped => serde_json::json!({ "id": id, "result": "skipped" }),
        RedriveResult::Refused { reason } => serde_json::json!({ "id": id, "result": "refused", "reason": reason }),
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
        RedriveResult::Unknown { reason } => format!("{id}\tunknown\tnot sent, held for an operator: {reason}"),
        RedriveResult::Skipped => format!("{id}\tskipped\t(resolved, cancelled, or held by another redrive)"),
        RedriveResult::Refused { reason } => format!("{id}\trefused\tnot sent: {reason}"),
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
        "unknown": r.unknown,
        "skipped": r.skipped,
        "refused": r.refused,
        "errors": r.errors,
        "items": r.items.iter().map(|i| result_json(i.id, &i.result)).collect::<Vec<_>>(),
    })
}

/// Whether a 2xx `answer` holds each of `fields` (non-null, non-empty) and
/// repeats each of `echoes` of the `sent` JSON body.
fn check_answer(fields: &[String], echoes: &[String], sent: &[u8], answer: &[u8]) -> std::result::Result<(), String> {
    let answer: serde_json::Value =
        serde_json::from_slice(answer).map_err(|e| format!("the answer is not JSON ({e})"))?;
    if !answer.is_object() {
        return Err("the answer is not a JSON object".into());
    }
    for field in fields {
        // An identifier: a non-empty string, as a service storing it
        // expects (a number or an object is not one).
        match answer.get(field) {
            Some(serde_json::Value::String(s)) if !s.is_empty() => {}
            None | Some(serde_json::Value::Null) => return Err(format!("the answer has no {field:?}")),
            Some(other) => return Err(format!("the answer's {field:?} is {other}, not a non-empty string")),
        }
    }
    if !echoes.is_empty() {
        let sent: serde_json::Value =
            serde_json::from_slice(sent).map_err(|e| format!("the request is not JSON ({e})"))?;
        for field in echoes {
            if sent.get(field).is_none() || answer.get(field) != sent.get(field) {
                return Err(format!(
                    "the answer's {field:?} is {}, the request's {}",
                    answer.get(field).unwrap_or(&serde_json::Value::Null),
                    sent.get(field).unwrap_or(&serde_json::Value::Null)
                ));
            }
        }
    }
    Ok(())
}
