//! [`AnyOperations`]: the multi-step operations table of whichever SQL
//! store a URL names.

use idem_core::multistep::{MultiStep, MultiStepFilter, MultiStepStore};
use idem_core::{Error, PendingMigration, Result, TableName, TimeSource};
use idem_gateway::AnyLease;

/// The multi-step operations of one of the SQL stores, chosen by URL.
#[derive(Clone, Debug)]
pub(crate) enum AnyOperations {
    /// A SQLite file.
    Sqlite(idem_sqlite::SqliteMultiSteps),
    /// PostgreSQL.
    Postgres(idem_postgres::PgMultiSteps),
    /// MySQL or MariaDB.
    MySql(idem_mysql::MySqlMultiSteps),
}

/// Runs `$body` with `$s` the store of whichever engine, and `$b` the
/// backend whose transactions its writes would join (the trait is the
/// same for every backend of an engine; the command only needs one).
macro_rules! each {
    ($self:expr, $s:ident, $b:ident => $body:expr) => {
        match $self {
            AnyOperations::Sqlite($s) => {
                type $b = idem_sqlite::SqliteStore;
                $body
            }
            AnyOperations::Postgres($s) => {
                type $b = idem_postgres::PgStore;
                $body
            }
            AnyOperations::MySql($s) => {
                type $b = idem_mysql::MySqlStore;
                $body
            }
        }
    };
}

impl AnyOperations {
    /// The operations in `table` beside `store`'s keys (its pool); Redis
    /// keeps none.
    pub(crate) fn beside(store: &AnyLease, table: TableName) -> Result<Self> {
        Ok(match store {
            AnyLease::Sqlite(s) => Self::Sqlite(idem_sqlite::SqliteMultiSteps::with_table(s.pool().clone(), table)),
            AnyLease::Postgres(s) => Self::Postgres(idem_postgres::PgMultiSteps::with_table(s.pool().clone(), table)),
            AnyLease::MySql(s) => Self::MySql(idem_mysql::MySqlMultiSteps::with_table(s.pool().clone(), table)),
            AnyLease::Redis(_) => {
                return Err(Error::Config(
                    "Redis keeps no multi-step operations: use the service's SQL database".into(),
                ));
            }
        })
    }

    /// The operations in `table` of the store at `url` (the URLs of
    /// [`AnyLease::open`]); nothing is created.
    pub(crate) async fn open(url: &str, table: TableName) -> Result<Self> {
        Self::beside(&AnyLease::open(url).await?, table)
    }

    /// The table.
    pub(crate) fn table(&self) -> &TableName {
        each!(self, s, _B => s.table())
    }

    /// The schema versions the table has not had yet (all of them: it is
    /// not there).
    pub(crate) async fn pending_migrations(&self) -> Result<Vec<PendingMigration>> {
        each!(self, s, _B => s.pending_migrations().await)
    }

    /// Creates the table.
    pub(crate) async fn migrate(&self) -> Result<()> {
        each!(self, s, _B => s.migrate().await)
    }

    /// The operation `id`, as committed.
    pub(crate) async fn get(&self, id: i64) -> Result<Option<MultiStep>> {
        each!(self, s, B => MultiStepStore::<B>::get(s, id).await)
    }

    /// Writes `row` over the version it was read at ([`Error::Fenced`] if
    /// that version moved).
    pub(crate) async fn write(&self, row: &MultiStep) -> Result<()> {
        each!(self, s, B => MultiStepStore::<B>::write(s, row).await)
    }

    /// The operations `filter` selects.
    pub(crate) async fn list(&self, filter: &MultiStepFilter) -> Result<Vec<MultiStep>> {
        each!(self, s, B => MultiStepStore::<B>::list(s, filter).await)
    }

    /// Deletes at most `limit` final operations expired by `now_ms`: how
    /// many it deleted.
    pub(crate) async fn purge_expired(&self, now_ms: i64, limit: u32) -> Result<u64> {
        each!(self, s, B => MultiStepStore::<B>::purge_expired(s, now_ms, limit).await)
    }

    /// The database's clock, in ms: the time the service's anchored clock
    /// reads, and so the one its operations' expiry was set by.
    pub(crate) async fn database_now_ms(&self) -> Result<i64> {
        each!(self, s, B => TimeSource::source_now_ms(&B::new(s.pool().clone())).await)
    }
}
