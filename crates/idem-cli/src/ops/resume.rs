//! `idem ops resume`: a held operation goes on from where it stopped.

use super::OneOperation;
use crate::output::Failure;

/// Resumes the operation.
pub(super) async fn run(one: &OneOperation, json: bool) -> Result<(), Failure> {
    one.change(
        json,
        "resumed: the service's completer or the caller's retry runs it from its recovery point",
        |op, now| op.resume(now),
    )
    .await
}
