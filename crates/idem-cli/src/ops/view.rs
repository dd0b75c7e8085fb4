//! How an operation is shown: a summary (`list`), in full (`show` and the
//! commands that change one), and the pieces of a listing's line.

use idem_core::multistep::{JournalEntry, MultiStep, StepOutcome};

/// Text kept from a body, an input or a step's value: at most this many
/// characters.
const SHOWN_CHARS: usize = 4096;

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).chars().take(SHOWN_CHARS).collect()
}

/// A JSON value as it is when small, or its text cut to [`SHOWN_CHARS`].
fn value(v: &serde_json::Value) -> serde_json::Value {
    let s = v.to_string();
    if s.len() <= SHOWN_CHARS {
        v.clone()
    } else {
        format!("{}…", s.chars().take(SHOWN_CHARS).collect::<String>()).into()
    }
}

/// The last step recorded: its name, and whether it is a compensation
/// step.
fn last_step(op: &MultiStep) -> Option<&JournalEntry> {
    op.journal.entries().last()
}

/// An operation's summary (`list`): where it stands, why it is held, how
/// often it ran, and how long it has been unchanged at `now_ms`.
pub(super) fn summary(op: &MultiStep, now_ms: i64) -> serde_json::Value {
    serde_json::json!({
        "id": op.id,
        "tenant": op.scope.tenant().as_str(),
        "operation": op.scope.operation().as_str(),
        "key": op.key.as_str(),
        "definition": op.definition,
        "state": op.state.as_str(),
        "recovery_point": op.journal.len(),
        "last_step": last_step(op).map(|e| e.name.as_str()),
        "open_step": op.open.as_ref().map(|o| o.step.as_str()),
        "hold": op.hold.as_ref().map(|h| serde_json::json!({
            "kind": h.kind.as_str(),
            "note": h.note,
            "at_ms": h.at_ms,
        })),
        "runs": op.runs,
        "lease_until_ms": op.lease_until_ms,
        "not_before_ms": op.not_before_ms,
        "created_at_ms": op.created_at_ms,
        "updated_at_ms": op.updated_at_ms,
        "age_ms": now_ms.saturating_sub(op.updated_at_ms).max(0),
    })
}

/// An operation in full (`show`): the summary, its journal, open send,
/// verdict, failure, input and response.
pub(super) fn detail(op: &MultiStep, now_ms: i64) -> serde_json::Value {
    let mut v = summary(op, now_ms);
    v["version"] = op.version.into();
    v["token"] = op.token.into();
    v["fingerprint"] = hex(op.fingerprint.as_bytes()).into();
    v["input"] = text(&op.input).into();
    v["journal"] = op
        .journal
        .entries()
        .iter()
        .map(|e| {
            let (outcome, val) = match &e.outcome {
                StepOutcome::Output(v) => ("output", v),
                StepOutcome::Failed(v) => ("failed", v),
            };
            serde_json::json!({
                "name": e.name,
                "kind": match e.kind {
                    idem_core::multistep::StepKind::Local => "local",
                    idem_core::multistep::StepKind::External => "external",
                },
                "compensation": e.undo,
                "outcome": outcome,
                "value": value(val),
                "at_ms": e.at_ms,
            })
        })
        .collect::<Vec<_>>()
        .into();
    v["open"] = op
        .open
        .as_ref()
        .map(|o| {
            serde_json::json!({
                "step": o.step,
                "first_sent_at_ms": o.first_sent_at_ms,
                "last_sent_at_ms": o.last_sent_at_ms,
                "sends": o.sends,
                "sent_under": o.sent_under.map(|t| serde_json::json!({
                    "key_horizon_secs": t.key_horizon.as_secs_f64(),
                    "horizon_margin_secs": t.horizon_margin.as_secs_f64(),
                    "settle_secs": t.settle.as_secs_f64(),
                })),
            })
        })
        .into();
    v["verdict"] = op
        .verdict
        .as_ref()
        .map(|s| {
            serde_json::json!({
                "verdict": s.reconciliation.verdict.as_str(),
                "by": s.reconciliation.by.as_str(),
                "at_ms": s.reconciliation.at_ms,
                "note": s.reconciliation.note,
                "status": s.status,
                "body": text(&s.body),
            })
        })
        .into();
    v["failure"] = op.failure.as_ref().map(value).into();
    v["response"] = op.response.as_deref().map(text).into();
    v["ttl_ms"] = op.ttl_ms.into();
    v["expires_at_ms"] = op.expires_at_ms.into();
    v
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Where an operation stands, as a listing shows it: how many steps are
/// recorded, and the step whose send is open (or the last recorded).
pub(super) fn step_text(op: &MultiStep) -> String {
    let n = op.journal.len();
    match (&op.open, last_step(op)) {
        (Some(open), _) => format!("{n} open:{}", open.step),
        (None, Some(last)) if last.undo => format!("{n} after:undo:{}", last.name),
        (None, Some(last)) => format!("{n} after:{}", last.name),
        (None, None) => format!("{n}"),
    }
}

/// Its state, with why it is held.
pub(super) fn state_text(op: &MultiStep) -> String {
    match &op.hold {
        Some(h) => format!("{} ({})", op.state.as_str(), h.kind.as_str()),
        None => op.state.as_str().to_owned(),
    }
}

/// Free text on one line of a table: control characters as spaces, cut
/// to `max` characters.
pub(super) fn one_line(s: &str, max: usize) -> String {
    let mut out: String = s
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .take(max)
        .collect();
    if s.chars().count() > max {
        out.push('…');
    }
    out
}

/// A duration in ms, as `45s`, `12m5s`, `3h20m` or `2d4h`.
pub(super) fn age(ms: i64) -> String {
    let s = ms.max(0) / 1000;
    match s {
        0..60 => format!("{s}s"),
        60..3_600 => format!("{}m{}s", s / 60, s % 60),
        3_600..86_400 => format!("{}h{}m", s / 3_600, s % 3_600 / 60),
        _ => format!("{}d{}h", s / 86_400, s % 86_400 / 3_600),
    }
}
