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

mod letters;
mod resend;

use std::time::Duration;

use idem_core::{DeadLetter, DeadLetterStore, Settlement, TableName, Verdict, VerdictSource};
use idem_outbound::{RedriveReport, RedriveResult};

pub(crate) use self::letters::AnyDeadLetters;
use crate::output::{Failure, print, print_document, say, store_failure};

/// The dead-letter table and which of its rows a command selects.
#[derive(Debug, clap::Args)]
pub(crate) struct DlqSelection {
    /// The service's database URL (SQLite path, postgres:// or mysql://).
    #[arg(long, env = "IDEM_STORE")]
    store: String,
    /// The dead-letter table.
    #[arg(long, default_value = "idem_dead_letters")]
    table: String,
    /// Only this tenant.
    #[arg(long)]
    tenant: Option<String>,
    /// Only this operation.
    #[arg(long)]
    operation: Option<String>,
    /// Only ids greater than this (the last id of the previous page).
    #[arg(long)]
    after_id: Option<i64>,
}

impl DlqSelection {
    fn filter(&self, state: Option<&str>, limit: u32) -> Result<idem_core::DeadLetterFilter, Failure> {
        Ok(idem_core::DeadLetterFilter {
            tenant: self.tenant.clone(),
            operation: self.operation.clone(),
            state: state
                .map(idem_core::DeadLetterState::parse)
                .transpose()
                .map_err(|e| Failure(2, e.to_string()))?,
            after_id: self.after_id,
            limit,
        })
    }
}

/// One dead letter, by its id.
#[derive(Debug, clap::Args)]
pub(crate) struct OneLetter {
    /// The service's database URL.
    #[arg(long, env = "IDEM_STORE")]
    store: String,
    /// The dead-letter table.
    #[arg(long, default_value = "idem_dead_letters")]
    table: String,
    /// The dead letter's id.
    #[arg(long)]
    id: i64,
}

/// What `idem dlq resolve` records.
#[derive(Debug, clap::Args)]
pub(crate) struct ResolveArgs {
    #[command(flatten)]
    letter: OneLetter,
    /// The vendor applied it.
    #[arg(long, conflicts_with = "not_applied", required_unless_present = "not_applied")]
    applied: bool,
    /// The vendor did not apply it.
    #[arg(long)]
    not_applied: bool,
    /// With --applied: the vendor's success status.
    #[arg(long, default_value_t = 200, value_parser = clap::value_parser!(u16).range(200..=299), requires = "applied")]
    status: u16,
    /// With --applied: the vendor's record of it (its answer), as text.
    #[arg(long, default_value = "", requires = "applied")]
    body: String,
    /// Where it was checked, or why (kept with the letter).
    #[arg(long)]
    note: String,
}

/// Which dead letters `idem dlq redrive` sends again, and how.
#[derive(Debug, clap::Args)]
pub(crate) struct RedriveArgs {
    #[command(flatten)]
    selection: DlqSelection,
    /// Only this dead letter.
    #[arg(long, conflicts_with_all = ["tenant", "operation", "after_id", "state"])]
    id: Option<i64>,
    /// Which state to take them from (`redriving`: holds that ran out).
    #[arg(long, default_value = "dead", value_parser = ["dead", "redriving"])]
    state: String,
    /// At most this many dead letters considered.
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    max: u32,
    /// At most this many sends started per second.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..=1_000))]
    per_second: u32,
    /// Each send's deadline, retries included, in seconds.
    #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..=3_600))]
    deadline_secs: u64,
    #[command(flatten)]
    resend: resend::ResendArgs,
}

#[derive(Debug, clap::Subcommand)]
pub(crate) enum DlqCommand {
    /// Dead letters matching the filters, oldest first.
    List {
        #[command(flatten)]
        selection: DlqSelection,
        /// Only in this state.
        #[arg(long, value_parser = ["dead", "redriving", "resolved", "unknown", "cancelled"])]
        state: Option<String>,
        /// At most this many.
        #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..=1_000))]
        limit: u32,
    },
    /// One dead letter, with its request and the answer that resolved it.
    Show(OneLetter),
    /// Sends dead letters again with their own idempotency key (a vendor
    /// that applied one answers with its recorded result), one at a time,
    /// capped and paced; each is resolved or dead again.
    Redrive(Box<RedriveArgs>),
    /// Records what the vendor says of a dead or unknown letter, checked by
    /// the operator: `--applied` resolves it with the vendor's answer;
    /// `--not-applied` makes it dead again with nothing counted as sent, so a
    /// redrive sends it (even past the vendor's key horizon) and the service
    /// may cancel it.
    Resolve(ResolveArgs),
}

/// The dead letters in `table` of the store at `url`, as they are.
async fn open(url: &str, table: &str) -> Result<AnyDeadLetters, Failure> {
    let table = TableName::new(table.to_owned())?;
    AnyDeadLetters::open(url, table)
        .await
        .map_err(|e| store_failure(url, e))
}

/// A dead-letter store error, with a hint when the table is missing.
fn dlq_failure(table: &str, e: idem_core::Error) -> Failure {
    let Failure(code, message) = e.into();
    if code == 1 {
        Failure(1, format!("dead letters {table}: {message} (is the table there?)"))
    } else {
        Failure(code, message)
    }
}

/// The dead letter `id` of `table`, or exit 1: a mistyped id is an error,
/// not a quiet "skipped".
async fn existing(s: &AnyDeadLetters, table: &str, id: i64) -> Result<DeadLetter, Failure> {
    let letter = s.get(id).await.map_err(|e| dlq_failure(table, e))?;
    letter.ok_or_else(|| Failure(1, format!("no dead letter {id} in {table}")))
}

/// Runs one `idem dlq` command.
pub(crate) async fn run(command: DlqCommand, json: bool) -> Result<(), Failure> {
    match command {
        DlqCommand::List {
            selection,
            state,
            limit,
        } => list(&selection, state.as_deref(), limit, json).await,
        DlqCommand::Show(letter) => show(&letter, json).await,
        DlqCommand::Redrive(args) => redrive(*args, json).await,
        DlqCommand::Resolve(args) => resolve(args, json).await,
    }
}

async fn list(selection: &DlqSelection, state: Option<&str>, limit: u32, json: bool) -> Result<(), Failure> {
    let filter = selection.filter(state, limit)?;
    let store = open(&selection.store, &selection.table).await?;
    let letters = store
        .list(&filter)
        .await
        .map_err(|e| dlq_failure(&selection.table, e))?;
    if json {
        say!(
            "{}",
            serde_json::Value::Array(letters.iter().map(summary_json).collect::<Vec<_>>())
        );
    } else {
        for l in &letters {
            say!("{}", summary_line(l));
        }
        eprintln!("{} dead letter(s)", letters.len());
    }
    Ok(())
}

async fn show(letter: &OneLetter, json: bool) -> Result<(), Failure> {
    let s = open(&letter.store, &letter.table).await?;
    let found = existing(&s, &letter.table, letter.id).await?;
    print_document(json, &detail_json(&found));
    Ok(())
}

async fn resolve(args: ResolveArgs, json: bool) -> Result<(), Failure> {
    let ResolveArgs {
        letter: OneLetter { store, table, id },
        applied,
        not_applied: _,
        status,
        body,
        note,
    } = args;
    let s = open(&store, &table).await?;
    let settlement = settlement(applied, status, body, note)?;
    let letter = existing(&s, &table, id).await?;
    if !s.settle(id, &settlement).await.map_err(|e| dlq_failure(&table, e))? {
        return Err(Failure(
            1,
            format!(
                "dead letter {id} is {}: only a dead or unknown letter is resolved",
                letter.state.as_str()
            ),
        ));
    }
    let after = s.get(id).await.map_err(|e| dlq_failure(&table, e))?;
    let v = after.as_ref().map(detail_json).unwrap_or_default();
    print(json, v, format!("{id}\t{}", after.map_or("gone", |l| l.state.as_str())));
    Ok(())
}

async fn redrive(args: RedriveArgs, json: bool) -> Result<(), Failure> {
    let RedriveArgs {
        selection,
        id,
        state,
        max,
        per_second,
        deadline_secs,
        resend,
    } = args;
    if let Some(hold) = resend.hold_secs()
        && hold < deadline_secs
    {
        return Err(Failure(
            2,
            format!(
                "--hold-secs ({hold}) must be at least --deadline-secs ({deadline_secs}): a hold that runs \
                 out mid-send cuts the send's retries off and lets another redrive take the letter"
            ),
        ));
    }
    if resend.retargets() && id.is_none() && selection.operation.is_none() {
        return Err(Failure(
            2,
            "--url sends every selected letter to one target and stores it in each: \
             name the letters' --operation (or one --id)"
                .into(),
        ));
    }
    let filter = selection.filter(Some(&state), 100)?;
    let config = resend.config(idem_outbound::OutboundConfig {
        name: "idem-cli".into(),
        deadline: Duration::from_secs(deadline_secs),
        ..idem_outbound::OutboundConfig::default()
    })?;
    let client = idem_outbound::OutboundClient::new(config)?;
    let store = open(&selection.store, &selection.table).await?;
    let redriver = resend.redriver(client, store.clone())?;
    let failure = |e| match e {
        idem_outbound::OutboundError::Store(e) => dlq_failure(&selection.table, e),
        other => other.into(),
    };
    let report = match id {
        Some(id) => {
            existing(&store, &selection.table, id).await?;
            let result = redriver.redrive_one(id).await.map_err(failure)?;
            let mut report = RedriveReport::default();
            report.add(id, result);
            report
        }
        None => redriver
            .redrive(&filter, idem_outbound::RedriveOptions { max, per_second })
            .await
            .map_err(failure)?,
    };
    if json {
        say!("{}", report_json(store.kind(), &report));
    } else {
        for item in &report.items {
            say!("{}", result_line(item.id, &item.result));
        }
        say!(
            "{}: {} resolved, {} failed, {} held as unknown, {} skipped, {} refused, {} error(s)",
            store.kind(),
            report.resolved,
            report.failed,
            report.unknown,
            report.skipped,
            report.refused,
            report.errors
        );
    }
    if report.refused > 0 {
        return Err(Failure(
            2,
            format!(
                "{} dead letter(s) do not say the key horizon their sends were made under: nothing sent for \
                 them; give --key-horizon-secs (and --settle-secs) to judge them by",
                report.refused
            ),
        ));
    }
    if report.failed > 0 || report.errors > 0 || report.unknown > 0 {
        return Err(Failure(
            1,
            format!(
                "{} dead letter(s) failed again, {} held as unknown (see `idem dlq resolve`), {} error(s)",
                report.failed, report.unknown, report.errors
            ),
        ));
    }
    Ok(())
}

/// The operator's settlement of `dlq resolve`.
fn settlement(applied: bool, status: u16, body: String, note: String) -> Result<Settlement, Failure> {
    if note.trim().is_empty() || note.len() > idem_core::MAX_DEAD_LETTER_TEXT {
        return Err(Failure(
            2,
            format!(
                "--note: say where it was checked (1 to {} bytes)",
                idem_core::MAX_DEAD_LETTER_TEXT
            ),
        ));
    }
    if body.len() > idem_core::MAX_DEAD_LETTER_RESPONSE {
        return Err(Failure(
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
fn summary_json(l: &DeadLetter) -> serde_json::Value {
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
fn detail_json(l: &DeadLetter) -> serde_json::Value {
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
fn summary_line(l: &DeadLetter) -> String {
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
fn result_json(id: i64, result: &RedriveResult) -> serde_json::Value {
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
fn result_line(id: i64, result: &RedriveResult) -> String {
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
fn report_json(kind: &str, r: &RedriveReport) -> serde_json::Value {
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
