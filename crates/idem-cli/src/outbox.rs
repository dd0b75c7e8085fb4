//! `idem outbox`: the transactional outbox of a service's SQL database.

use idem_core::TableName;
use idem_gateway::AnyLease;

use crate::output::{Failure, print};

#[derive(Debug, clap::Subcommand)]
pub(crate) enum OutboxCommand {
    /// Unsent events and the age of the oldest.
    Status {
        /// The service's database URL.
        #[arg(long, env = "IDEM_STORE")]
        store: String,
        /// The outbox table.
        #[arg(long, default_value = "idem_outbox")]
        table: String,
    },
}

/// Runs one `idem outbox` command.
pub(crate) async fn run(
    command: OutboxCommand,
    redis: &idem_gateway::RedisSettings,
    json: bool,
) -> Result<(), Failure> {
    let OutboxCommand::Status { store, table } = command;
    let table = TableName::new(table)?;
    let s = crate::store::open(&store, None, redis).await?;
    if matches!(s, AnyLease::Redis(_)) {
        return Err(Failure(
            2,
            "Redis keeps no outbox: use the service's SQL database".into(),
        ));
    }
    if !s.table_exists(&table).await? {
        return Err(Failure(
            3,
            format!("table {table} does not exist (the service's outbox table?)"),
        ));
    }
    let lag = s.outbox_lag(table.clone()).await.map_err(|e| match e {
        idem_core::Error::Config(m) => Failure(2, m),
        other => Failure(1, format!("outbox {table}: {other}")),
    })?;
    let age = lag.oldest_unsent_age_ms.map(|ms| ms as f64 / 1000.0);
    print(
        json,
        serde_json::json!({ "store": s.kind(), "table": table.as_str(), "unsent": lag.unsent, "oldest_unsent_age_seconds": age }),
        format!(
            "{table}: {} unsent{}",
            lag.unsent,
            age.map(|a| format!(", the oldest {a:.1} s old")).unwrap_or_default()
        ),
    );
    Ok(())
}
