//! `idem migrate`: creates or upgrades the keys table, with
//! `--dead-letters` the dead-letter table of outbound calls, and with
//! `--operations` the table of multi-step operations; the only command
//! that creates a database file or a table.

use idem_gateway::AnyLease;

use crate::dlq::AnyDeadLetters;
use crate::ops::AnyOperations;
use crate::output::{Failure, print, say, store_failure};
use crate::store::{KeysTable, table_flag};

/// The flags of `idem migrate`.
#[derive(Debug, clap::Args)]
pub(crate) struct MigrateArgs {
    #[command(flatten)]
    at: KeysTable,
    /// Say which versions would be applied, and apply nothing.
    #[arg(long)]
    dry_run: bool,
    /// Print the SQL of the versions to apply.
    #[arg(long)]
    show_sql: bool,
    /// Also create or upgrade the dead-letter table of outbound calls
    /// (SQL stores).
    #[arg(long)]
    dead_letters: bool,
    /// The dead-letter table, with --dead-letters.
    #[arg(long, default_value = "idem_dead_letters")]
    dead_letter_table: String,
    /// Also create the table of multi-step operations (SQL stores).
    #[arg(long)]
    operations: bool,
    /// The table of multi-step operations, with --operations.
    #[arg(long, default_value = crate::ops::DEFAULT_TABLE, requires = "operations")]
    operations_table: String,
}

/// Migrates (or with `--dry-run` says what it would apply).
pub(crate) async fn run(args: MigrateArgs, redis: &idem_gateway::RedisSettings, json: bool) -> Result<(), Failure> {
    let MigrateArgs {
        at: KeysTable { store, table },
        dry_run,
        show_sql,
        dead_letters,
        dead_letter_table,
        operations,
        operations_table,
    } = args;
    // A dry run creates nothing: where no SQLite file is yet, an
    // empty in-memory database stands in for it.
    let s = if dry_run {
        AnyLease::open_for_dry_run(&store, redis).await
    } else {
        AnyLease::create_with(&store, redis).await
    }
    .map_err(|e| store_failure(&store, e))?;
    let s = match &table {
        Some(t) => s.with_table(table_flag("--table", t)?)?,
        None => s,
    };
    s.check_deployment(redis).await.map_err(|e| store_failure(&store, e))?;
    let letters = if dead_letters {
        let table = table_flag("--dead-letter-table", &dead_letter_table)?;
        Some(match &s {
            // The same file (or stand-in) as the keys table.
            AnyLease::Sqlite(sqlite) => {
                AnyDeadLetters::Sqlite(idem_sqlite::SqliteDeadLetters::with_table(sqlite.pool().clone(), table))
            }
            _ => AnyDeadLetters::open(&store, table).await.map_err(|e| match e {
                idem_core::Error::Config(why) => Failure(2, why),
                e => store_failure(&store, e),
            })?,
        })
    } else {
        None
    };
    let ops = if operations {
        // The same pool (and SQLite file, or stand-in) as the keys table.
        let table = table_flag("--operations-table", &operations_table)?;
        Some(AnyOperations::beside(&s, table).map_err(|e| match e {
            idem_core::Error::Config(why) => Failure(2, why),
            e => store_failure(&store, e),
        })?)
    } else {
        None
    };
    let mut pending = s.pending_migrations().await?;
    if let Some(letters) = &letters {
        pending.extend(letters.pending_migrations().await?);
    }
    if let Some(ops) = &ops {
        pending.extend(ops.pending_migrations().await?);
    }
    if show_sql && !json {
        for m in &pending {
            say!("-- version {}: {}", m.version, m.description);
            for statement in &m.statements {
                say!("{};", statement.trim());
            }
        }
    }
    if !dry_run {
        s.migrate().await?;
        if let Some(letters) = &letters {
            letters.migrate().await?;
        }
        if let Some(ops) = &ops {
            ops.migrate().await?;
        }
    }
    let versions: Vec<i64> = pending.iter().map(|m| m.version).collect();
    let mut v = serde_json::json!({ "store": s.kind(), "pending": versions, "applied": !dry_run });
    if show_sql {
        v["sql"] = pending
            .iter()
            .flat_map(|m| m.statements.clone())
            .collect::<Vec<_>>()
            .into();
    }
    let what = s
        .table()
        .map_or_else(|| "the keys table".to_owned(), |t| format!("table {t}"));
    let others: Vec<&str> = [
        letters.as_ref().map(|_| "the dead-letter table"),
        ops.as_ref().map(|_| "the operations table"),
    ]
    .into_iter()
    .flatten()
    .collect();
    let text = match (pending.is_empty(), dry_run) {
        (true, _) if !others.is_empty() => format!("{}: {what} and {} are current", s.kind(), others.join(" and ")),
        (true, _) if s.table().is_none() => format!("{}: no schema to migrate", s.kind()),
        (true, _) => format!("{}: {what} is current", s.kind()),
        (false, true) => format!("{}: would apply version(s) {versions:?} (nothing applied)", s.kind()),
        (false, false) => format!("{}: applied version(s) {versions:?}", s.kind()),
    };
    print(json, v, text);
    Ok(())
}
