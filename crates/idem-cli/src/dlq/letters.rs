//! [`AnyDeadLetters`]: the dead-letter table of whichever SQL store a URL
//! names.

use idem_core::{Error, Result, TableName};
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

idem_core::dead_letters_of_each!(AnyDeadLetters {
    Sqlite,
    Postgres,
    MySql
});
