//! `idem ops show`: one operation in full.

use idem_core::{Clock, SystemClock};

use super::{OneOperation, view};
use crate::output::{Failure, print_document};

/// Prints the operation.
pub(super) async fn run(one: &OneOperation, json: bool) -> Result<(), Failure> {
    let (_, op) = one.read().await?;
    print_document(json, &view::detail(&op, SystemClock.now_ms()));
    Ok(())
}
