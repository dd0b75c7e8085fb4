//! `idem ops`: multi-step operations on the SQL stores, listed, shown, and
//! driven by an operator: resumed, given a verdict on a step's send,
//! cancelled (their compensation runs) or held; and the final ones past
//! their expiry purged.
//!
//! The commands only write the operation's row, each change one of the
//! row's own transitions ([`MultiStep::resume`], [`MultiStep::settle`],
//! [`MultiStep::cancel`], [`MultiStep::hold_for_operator`]) written over
//! the version read: a row that changed meanwhile (a runner, another
//! operator) is left as it is, and the command says so. The steps run in
//! the service, which alone holds their code: its completer, or the
//! caller's retry of the same key, takes the operation on from there.

mod cancel;
mod hold;
mod list;
mod mark;
mod operations;
mod purge;
mod resume;
mod show;
mod view;

use idem_core::multistep::MultiStep;
use idem_core::{Clock, SystemClock, TableName};

pub(crate) use self::operations::AnyOperations;
use crate::output::{Failure, print, store_failure};

/// The default table of multi-step operations.
pub(crate) const DEFAULT_TABLE: &str = "idem_operations";

/// The operations table a command works on.
#[derive(Debug, clap::Args)]
pub(crate) struct OpsTable {
    /// The service's database URL (SQLite path, postgres:// or mysql://).
    #[arg(long, env = "IDEM_STORE")]
    store: String,
    /// The operations table.
    #[arg(long, default_value = DEFAULT_TABLE)]
    table: String,
}

impl OpsTable {
    /// Opens the table as it is, or exit 3 when it is not there: only
    /// `idem migrate --operations` creates it.
    async fn open(&self) -> Result<AnyOperations, Failure> {
        let table = TableName::new(self.table.clone()).map_err(|e| Failure(2, format!("--table: {e}")))?;
        let ops = AnyOperations::open(&self.store, table).await.map_err(|e| match e {
            idem_core::Error::Config(why) => Failure(2, why),
            e => store_failure(&self.store, e),
        })?;
        if !ops.pending_migrations().await?.is_empty() {
            let migrate = if self.table == DEFAULT_TABLE {
                "`idem migrate --operations`".to_owned()
            } else {
                format!("`idem migrate --operations --operations-table {}`", self.table)
            };
            return Err(Failure(
                3,
                format!("table {} does not exist; run {migrate}", self.table),
            ));
        }
        Ok(ops)
    }
}

/// One operation, by its id.
#[derive(Debug, clap::Args)]
pub(crate) struct OneOperation {
    #[command(flatten)]
    at: OpsTable,
    /// The operation's id (`idem ops list` shows it).
    #[arg(value_parser = clap::value_parser!(i64).range(1..))]
    id: i64,
}

impl OneOperation {
    /// The table and the operation as committed; a mistyped id is an
    /// error (exit 1), not a quiet "nothing to do".
    async fn read(&self) -> Result<(AnyOperations, MultiStep), Failure> {
        let ops = self.at.open().await?;
        let op = ops
            .get(self.id)
            .await?
            .ok_or_else(|| Failure(1, format!("no operation {} in {}", self.id, ops.table())))?;
        Ok((ops, op))
    }

    /// Applies `change` (one of the row's operator transitions, at the
    /// current time) to the operation and writes it over the version read;
    /// prints the operation as written and what happens next. A refused
    /// change, or a row that changed meanwhile, writes nothing (exit 1).
    async fn change(
        &self,
        json: bool,
        next: &str,
        change: impl FnOnce(&mut MultiStep, i64) -> idem_core::Result<()>,
    ) -> Result<(), Failure> {
        let (ops, mut op) = self.read().await?;
        let id = op.id;
        let now = SystemClock.now_ms();
        change(&mut op, now).map_err(|e| match e {
            idem_core::Error::InvalidRequest(why) => Failure(
                1,
                format!("operation {id} is {}: {why}; nothing was changed", op.state.as_str()),
            ),
            e => e.into(),
        })?;
        match ops.write(&op).await {
            Ok(()) => op.version += 1,
            Err(idem_core::Error::Fenced) => {
                return Err(Failure(
                    1,
                    format!(
                        "operation {id} changed meanwhile (a runner or another operator wrote it): nothing was \
                         changed; look again (`idem ops show {id}`) and try again"
                    ),
                ));
            }
            Err(e) => return Err(e.into()),
        }
        let mut v = view::detail(&op, now);
        v["next"] = next.into();
        print(json, v, format!("{id}\t{}\t{next}", view::state_text(&op)));
        Ok(())
    }
}

#[derive(Debug, clap::Subcommand)]
pub(crate) enum OpsCommand {
    /// Operations matching the filters, the longest unchanged first: where
    /// each stands (its recorded steps, an open send), why it is held, its
    /// runs and age.
    List(list::ListArgs),
    /// One operation in full: its journal, open send, hold, verdict and
    /// failure.
    Show(OneOperation),
    /// Lets a held operation go on from where it stopped (not one held on
    /// an unknown outcome: `mark` settles those). The service's completer,
    /// or the caller's retry, runs it.
    Resume(OneOperation),
    /// Records what the vendor says of the send an operation is held on
    /// (an unknown outcome): --applied lets it go on with the vendor's
    /// answer, --not-applied (only once its last send has settled) lets it
    /// send afresh, --unknown keeps it held with the note.
    Mark(mark::MarkArgs),
    /// Cancels a running or held operation: its compensation runs, with
    /// {"cancelled": reason} as its failure. Refused while a runner holds
    /// it, and while a send may have been applied (mark it --not-applied
    /// first).
    Cancel(cancel::CancelArgs),
    /// Holds a running or compensating operation no runner holds, until an
    /// operator resumes it.
    Hold(hold::HoldArgs),
    /// Deletes final operations (completed or compensated) past their
    /// expiry, in batches until none is left (or --limit): a retry of a
    /// deleted one's key starts a new operation. Running, held and
    /// compensating operations are never deleted.
    Purge(purge::PurgeArgs),
}

/// Runs one `idem ops` command.
pub(crate) async fn run(command: OpsCommand, json: bool) -> Result<(), Failure> {
    match command {
        OpsCommand::List(args) => list::run(&args, json).await,
        OpsCommand::Show(one) => show::run(&one, json).await,
        OpsCommand::Resume(one) => resume::run(&one, json).await,
        OpsCommand::Mark(args) => mark::run(args, json).await,
        OpsCommand::Cancel(args) => cancel::run(&args, json).await,
        OpsCommand::Hold(args) => hold::run(&args, json).await,
        OpsCommand::Purge(args) => purge::run(&args, json).await,
    }
}

/// Checks an operator's free text (a note, a reason): 1 to `max` bytes,
/// not blank.
fn text_flag(flag: &str, value: &str, max: usize) -> Result<(), Failure> {
    if value.trim().is_empty() || value.len() > max {
        return Err(Failure(2, format!("{flag}: give 1 to {max} bytes of text")));
    }
    Ok(())
}

/// The longest note or reason an operator gives (the row keeps 1 KiB).
const MAX_NOTE: usize = 1024;
