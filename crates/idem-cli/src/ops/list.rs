//! `idem ops list`: operations by state, scope, step and age, the longest
//! unchanged first, a page at a time.

use idem_core::multistep::{MAX_MULTISTEP_PAGE, MultiStepCursor, MultiStepFilter, MultiStepState};
use idem_core::{Clock, SystemClock};

use super::{OpsTable, view};
use crate::output::{Failure, refuse_empty_filters, say};

/// Which operations `idem ops list` selects.
#[derive(Debug, clap::Args)]
pub(crate) struct ListArgs {
    #[command(flatten)]
    at: OpsTable,
    /// Only in this state (repeatable: any of them).
    #[arg(long = "state", value_parser = ["running", "held", "compensating", "completed", "compensated"])]
    states: Vec<String>,
    /// Only this tenant's.
    #[arg(long)]
    tenant: Option<String>,
    /// Only this operation's (the route, `POST /v1/withdrawals`).
    #[arg(long)]
    operation: Option<String>,
    /// Only those whose send of this external step is open (sent, not
    /// answered: where an operation held on an unknown outcome stands).
    #[arg(long)]
    step: Option<String>,
    /// Only those with this many steps recorded (their recovery point).
    #[arg(long)]
    recovery_point: Option<u32>,
    /// Only those unchanged for at least this long (`90s`, `10m`, `2h`,
    /// `1d`).
    #[arg(long, value_parser = parse_age)]
    older_than: Option<i64>,
    /// Only those after this one (`UPDATED_AT_MS:ID`, the last line of the
    /// previous page; the listing says it when a page is full).
    #[arg(long, value_parser = parse_cursor)]
    after: Option<MultiStepCursor>,
    /// At most this many.
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..=i64::from(MAX_MULTISTEP_PAGE)))]
    limit: u32,
}

impl ListArgs {
    /// The filter the flags give at `now_ms`; an empty value is refused.
    fn filter(&self, now_ms: i64) -> Result<MultiStepFilter, Failure> {
        refuse_empty_filters(&[
            ("--tenant", &self.tenant),
            ("--operation", &self.operation),
            ("--step", &self.step),
        ])?;
        if let Some(step) = &self.step {
            idem_core::multistep::check_step_name(step).map_err(|e| Failure(2, format!("--step: {e}")))?;
        }
        let mut states = Vec::new();
        for s in &self.states {
            let state = MultiStepState::parse(s).map_err(|e| Failure(2, format!("--state: {e}")))?;
            if !states.contains(&state) {
                states.push(state);
            }
        }
        let filter = MultiStepFilter {
            states,
            tenant: self.tenant.clone(),
            operation: self.operation.clone(),
            recovery_point: self.recovery_point,
            open_step: self.step.clone(),
            unchanged_since_ms: self.older_than.map(|age| now_ms.saturating_sub(age)),
            after: self.after,
            limit: self.limit,
        };
        filter.check().map_err(|e| Failure(2, e.to_string()))?;
        Ok(filter)
    }
}

/// A duration of `N` and a unit (`ms`, `s`, `m`, `h`, `d`), in ms.
pub(super) fn parse_age(s: &str) -> Result<i64, String> {
    let digits = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (n, unit) = s.split_at(digits);
    let n: i64 = n
        .parse()
        .map_err(|_| format!("{s:?}: write a number and a unit (90s, 10m, 2h, 1d)"))?;
    let ms = match unit {
        "ms" => 1,
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        _ => return Err(format!("{s:?}: the unit is ms, s, m, h or d (90s, 10m, 2h, 1d)")),
    };
    n.checked_mul(ms)
        .filter(|ms| *ms <= 100 * 365 * 86_400_000)
        .ok_or_else(|| format!("{s:?}: at most a hundred years"))
}

/// `UPDATED_AT_MS:ID`.
fn parse_cursor(s: &str) -> Result<MultiStepCursor, String> {
    let bad = || format!("{s:?}: write UPDATED_AT_MS:ID, as a full page's listing says");
    let (at, id) = s.split_once(':').ok_or_else(bad)?;
    Ok(MultiStepCursor {
        updated_at_ms: at.parse().map_err(|_| bad())?,
        id: id.parse().map_err(|_| bad())?,
    })
}

/// Lists the operations the flags select.
pub(super) async fn run(args: &ListArgs, json: bool) -> Result<(), Failure> {
    let now = SystemClock.now_ms();
    let filter = args.filter(now)?;
    let ops = args.at.open().await?;
    let found = ops.list(&filter).await?;
    if json {
        say!(
            "{}",
            serde_json::Value::Array(found.iter().map(|op| view::summary(op, now)).collect())
        );
    } else {
        if !found.is_empty() {
            say!("id\ttenant\toperation\tkey\tdefinition\tstate\tstep\truns\tage\tnote");
        }
        for op in &found {
            say!(
                "{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}",
                op.id,
                view::one_line(op.scope.tenant().as_str(), 40),
                view::one_line(op.scope.operation().as_str(), 40),
                view::one_line(op.key.as_str(), 40),
                op.definition,
                view::state_text(op),
                view::step_text(op),
                op.runs,
                view::age(now.saturating_sub(op.updated_at_ms)),
                op.hold
                    .as_ref()
                    .map_or_else(String::new, |h| view::one_line(&h.note, 80)),
            );
        }
        match found.last() {
            Some(last) if found.len() == filter.limit as usize => eprintln!(
                "{} operation(s); the next page: --after {}:{}",
                found.len(),
                last.updated_at_ms,
                last.id
            ),
            _ => eprintln!("{} operation(s)", found.len()),
        }
    }
    Ok(())
}
