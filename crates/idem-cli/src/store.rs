//! Opening the keys store a command works on: as it is (only `idem
//! migrate` creates a file, a table or a schema), with its schema checked
//! for the commands that read keys, and its Redis deployment too for those
//! that delete some.

use idem_core::TableName;
use idem_gateway::AnyLease;

use crate::output::{Failure, store_failure};

/// The table a flag (`--table`) names, or exit 2.
pub(crate) fn table_flag(flag: &str, name: &str) -> Result<TableName, Failure> {
    TableName::new(name).map_err(|e| Failure(2, format!("{flag}: {e}")))
}

/// Opens the store at `url` as it is (no file, table or schema created), on
/// `table` if given.
pub(crate) async fn open(
    url: &str,
    table: Option<&str>,
    redis: &idem_gateway::RedisSettings,
) -> Result<AnyLease, Failure> {
    let s = AnyLease::open_with(url, redis)
        .await
        .map_err(|e| store_failure(url, e))?;
    match table {
        Some(t) => Ok(s.with_table(table_flag("--table", t)?)?),
        None => Ok(s),
    }
}

/// Fails with exit 3 unless the keys table is there and current: the
/// commands other than `migrate` never create or change a schema.
async fn require_schema(s: &AnyLease) -> Result<(), Failure> {
    let Some(table) = s.table() else { return Ok(()) };
    let migrate = if table.as_str() == idem_core::TableName::default().as_str() {
        "`idem migrate`".to_owned()
    } else {
        format!("`idem migrate --table {table}`")
    };
    if !s.table_exists(table).await? {
        return Err(Failure(3, format!("table {table} does not exist; run {migrate}")));
    }
    let pending: Vec<i64> = s.pending_migrations().await?.iter().map(|m| m.version).collect();
    if !pending.is_empty() {
        return Err(Failure(
            3,
            format!("table {table} lacks schema version(s) {pending:?}; run {migrate}"),
        ));
    }
    Ok(())
}

/// The keys store and table a command works on.
#[derive(Debug, clap::Args)]
pub(crate) struct KeysTable {
    /// The store URL.
    #[arg(long, env = "IDEM_STORE")]
    pub(crate) store: String,
    /// The keys table (an inbox or job table shares its schema).
    #[arg(long)]
    pub(crate) table: Option<String>,
}

impl KeysTable {
    /// Opens the keys for a command that reads them.
    pub(crate) async fn open(&self, redis: &idem_gateway::RedisSettings) -> Result<AnyLease, Failure> {
        let s = open(&self.store, self.table.as_deref(), redis).await?;
        require_schema(&s).await?;
        Ok(s)
    }

    /// Opens the keys for a command that deletes some or changes one: a
    /// Redis deployment is checked first.
    pub(crate) async fn open_to_write(&self, redis: &idem_gateway::RedisSettings) -> Result<AnyLease, Failure> {
        let s = self.open(redis).await?;
        s.check_deployment(redis)
            .await
            .map_err(|e| store_failure(&self.store, e))?;
        Ok(s)
    }
}

/// A keys-table summary as JSON: `value` with the table named, if the
/// store has one.
pub(crate) fn with_table(s: &AnyLease, mut value: serde_json::Value) -> serde_json::Value {
    if let Some(t) = s.table() {
        value["table"] = t.as_str().into();
    }
    value
}
