//! `idem ops cancel`: an operation's compensation runs instead of its
//! remaining steps.

use super::{MAX_NOTE, OneOperation, text_flag};
use crate::output::Failure;

/// What `idem ops cancel` records.
#[derive(Debug, clap::Args)]
pub(crate) struct CancelArgs {
    #[command(flatten)]
    one: OneOperation,
    /// Why (kept as its failure: {"cancelled": reason}).
    #[arg(long)]
    reason: String,
}

/// Cancels the operation.
pub(super) async fn run(args: &CancelArgs, json: bool) -> Result<(), Failure> {
    text_flag("--reason", &args.reason, MAX_NOTE)?;
    args.one
        .change(
            json,
            "cancelled: the service's completer or the caller's retry runs its compensation",
            |op, now| op.cancel(&args.reason, now),
        )
        .await
}
