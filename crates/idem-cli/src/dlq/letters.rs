//! [`AnyDeadLetters`]: the dead-letter table of whichever SQL store a URL
//! names.

use idem_core::{
    BoxFuture, DeadLetter, DeadLetterFilter, DeadLetterStore, Error, IdempotencyKey, NewDeadLetter, RedriveHold,
    RedriveOutcome, Result, Scope, Settlement, TableName,
};
use idem_gateway::AnyLease;

/// The dead letters of one of the SQL stores, chosen by URL.
#[derive(Clone, Debug)]
pub(crate) enum AnyDeadLetters {
    /// A SQLite file.
    Sqlite(idem_sqlite::SqliteDeadLetters),
    /// PostgreSQL.
    Postgres(idem_postgres::PgDeadLetters),
    /// MySQL or MariaDB.
    MySql(idem_mysql::MySqlDeadLetters),
}

macro_rules! each {
    ($self:expr, $s:ident => $body:expr) => {
        match $self {
            AnyDeadLetters::Sqlite($s) => $body,
            AnyDeadLetters::Postgres($s) => $body,
            AnyDeadLetters::MySql($s) => $body,
        }
    };
}

impl AnyDeadLetters {
    /// The dead letters in `table` of the store at `url` (the URLs of
    /// [`AnyLease::open`]); nothing is created. Redis keeps none.
    pub(crate) async fn open(url: &str, table: TableName) -> Result<Self> {
        Ok(match AnyLease::open(url).await? {
            AnyLease::Sqlite(s) => Self::Sqlite(idem_sqlite::SqliteDeadLetters::with_table(s.pool().clone(), table)),
            AnyLease::Postgres(s) => Self::Postgres(idem_postgres::PgDeadLetters::with_table(s.pool().clone(), table)),
            AnyLease::MySql(s) => Self::MySql(idem_mysql::MySqlDeadLetters::with_table(s.pool().clone(), table)),
            AnyLease::Redis(_) => {
                return Err(Error::Config(
                    "Redis keeps no dead letters: use the service's SQL database".into(),
                ));
            }
        })
    }

    /// The schema versions the dead-letter table has not had yet.
    pub(crate) async fn pending_migrations(&self) -> Result<Vec<idem_core::PendingMigration>> {
        each!(self, s => s.pending_migrations().await)
    }

    /// Creates or upgrades the dead-letter table.
    pub(crate) async fn migrate(&self) -> Result<()> {
        each!(self, s => s.migrate().await)
    }

    /// The store's kind.
    pub(crate) fn kind(&self) -> &'static str {
        match self {
            Self::Sqlite(_) => "sqlite",
            Self::Postgres(_) => "postgres",
            Self::MySql(_) => "mysql",
        }
    }
}

impl DeadLetterStore for AnyDeadLetters {
    fn record(&self, letter: &NewDeadLetter) -> BoxFuture<'_, Result<i64>> {
        each!(self, s => s.record(letter))
    }

    fn list(&self, filter: &DeadLetterFilter) -> BoxFuture<'_, Result<Vec<DeadLetter>>> {
        each!(self, s => s.list(filter))
    }

    fn get(&self, id: i64) -> BoxFuture<'_, Result<Option<DeadLetter>>> {
        each!(self, s => s.get(id))
    }

    fn find(&self, scope: &Scope, key: &IdempotencyKey) -> BoxFuture<'_, Result<Option<DeadLetter>>> {
        each!(self, s => s.find(scope, key))
    }

    fn begin_redrive(&self, id: i64, hold_ms: i64) -> BoxFuture<'_, Result<Option<RedriveHold>>> {
        each!(self, s => s.begin_redrive(id, hold_ms))
    }

    fn finish_redrive(&self, id: i64, token: u32, outcome: &RedriveOutcome) -> BoxFuture<'_, Result<bool>> {
        each!(self, s => s.finish_redrive(id, token, outcome))
    }

    fn purge_resolved(&self, older_than_ms: i64, limit: u32) -> BoxFuture<'_, Result<u64>> {
        each!(self, s => s.purge_resolved(older_than_ms, limit))
    }

    fn retarget(&self, id: i64, token: u32, url: &str) -> BoxFuture<'_, Result<bool>> {
        each!(self, s => s.retarget(id, token, url))
    }

    fn settle(&self, id: i64, settlement: &Settlement) -> BoxFuture<'_, Result<bool>> {
        each!(self, s => s.settle(id, settlement))
    }

    fn cancel(&self, id: i64) -> BoxFuture<'_, Result<bool>> {
        each!(self, s => s.cancel(id))
    }
}
