//! `idem ops hold`: an operation stops where it stands until an operator
//! resumes it.

use super::{MAX_NOTE, OneOperation, text_flag};
use crate::output::Failure;

/// What `idem ops hold` records.
#[derive(Debug, clap::Args)]
pub(crate) struct HoldArgs {
    #[command(flatten)]
    one: OneOperation,
    /// Why (kept with the hold).
    #[arg(long)]
    note: String,
}

/// Holds the operation.
pub(super) async fn run(args: &HoldArgs, json: bool) -> Result<(), Failure> {
    text_flag("--note", &args.note, MAX_NOTE)?;
    args.one
        .change(json, "held: no runner takes it until `idem ops resume`", |op, now| {
            op.hold_for_operator(&args.note, now)
        })
        .await
}
