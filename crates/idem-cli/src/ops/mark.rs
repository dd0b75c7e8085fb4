//! `idem ops mark`: an operator's verdict on the send an operation is
//! held on, checked with the vendor.

use idem_core::{Settlement, Verdict, VerdictSource};

use super::{MAX_NOTE, OneOperation, text_flag};
use crate::output::Failure;

/// What `idem ops mark` records.
#[derive(Debug, clap::Args)]
#[command(group(
    clap::ArgGroup::new("verdict")
        .required(true)
        .args(["applied", "not_applied", "unknown"])
))]
pub(crate) struct MarkArgs {
    #[command(flatten)]
    one: OneOperation,
    /// The vendor applied the send: the operation goes on, and its step
    /// decides its output from the answer given here.
    #[arg(long)]
    applied: bool,
    /// The vendor did not apply it (trusted only once its last send has
    /// settled): the step sends afresh.
    #[arg(long)]
    not_applied: bool,
    /// It cannot be told yet: it stays held, with the note.
    #[arg(long)]
    unknown: bool,
    /// With --applied: the vendor's success status.
    #[arg(long, default_value_t = 200, value_parser = clap::value_parser!(u16).range(200..=299), requires = "applied")]
    status: u16,
    /// With --applied: a file holding the vendor's answer (its record of
    /// the send), as its API answers it.
    #[arg(long, requires = "applied")]
    body_file: Option<std::path::PathBuf>,
    /// Where it was checked, or why (kept with the verdict).
    #[arg(long)]
    note: Option<String>,
    /// Who says so (kept with the verdict).
    #[arg(long, env = "IDEM_OPERATOR")]
    by: String,
}

/// The longest operator's name.
const MAX_BY: usize = 100;

impl MarkArgs {
    /// The verdict the flags give, with the note as kept: who, then why.
    fn settlement(&self) -> Result<Settlement, Failure> {
        if self.by.trim().is_empty() || self.by.len() > MAX_BY || self.by.chars().any(char::is_control) {
            return Err(Failure(
                2,
                format!("--by: say who you are (1 to {MAX_BY} bytes, one line)"),
            ));
        }
        if let Some(note) = &self.note {
            text_flag("--note", note, MAX_NOTE)?;
        }
        let body = match &self.body_file {
            Some(path) => read_bounded(path)?,
            None => Vec::new(),
        };
        let verdict = if self.applied {
            Verdict::Applied
        } else if self.not_applied {
            Verdict::NotApplied
        } else {
            Verdict::Unknown
        };
        Ok(Settlement {
            verdict,
            by: VerdictSource::Operator,
            status: self.applied.then_some(self.status),
            body,
            note: match &self.note {
                Some(note) => format!("{}: {note}", self.by.trim()),
                None => self.by.trim().to_owned(),
            },
        })
    }
}

/// The file at `path`, refused past [`idem_core::MAX_DEAD_LETTER_RESPONSE`]
/// (a vendor's answer as a dead letter keeps it) without reading more.
fn read_bounded(path: &std::path::Path) -> Result<Vec<u8>, Failure> {
    use std::io::Read;
    let max = idem_core::MAX_DEAD_LETTER_RESPONSE;
    let bad = |e: std::io::Error| Failure(2, format!("--body-file {}: {e}", path.display()));
    let mut body = Vec::new();
    std::fs::File::open(path)
        .map_err(bad)?
        .take(max as u64 + 1)
        .read_to_end(&mut body)
        .map_err(bad)?;
    if body.len() > max {
        return Err(Failure(
            2,
            format!("--body-file {}: at most {max} bytes", path.display()),
        ));
    }
    Ok(body)
}

/// Records the verdict.
pub(super) async fn run(args: MarkArgs, json: bool) -> Result<(), Failure> {
    let settlement = args.settlement()?;
    let next = match settlement.verdict {
        Verdict::Applied => {
            "marked applied: the service's completer or the caller's retry records the step from the answer \
             given, and goes on"
        }
        Verdict::NotApplied => {
            "marked not applied: the service's completer or the caller's retry sends the step afresh, with its \
             own key"
        }
        Verdict::Unknown => "still held on an unknown outcome, with the note",
    };
    args.one.change(json, next, |op, now| op.settle(&settlement, now)).await
}
