//! Running an engine's migrations of a kind of table, once for every kind.

use std::time::{SystemTime, UNIX_EPOCH};

use idem_core::{PendingMigration, Result, TableName};
use sqlx::{AssertSqlSafe, Database, Pool};

use crate::{Arg, Dialect, Migrations, SqlDb, Statement};

/// The names of `table`'s columns; none when it does not exist.
pub(crate) async fn columns<D: Dialect>(
    conn: &mut <D::Db as Database>::Connection,
    table: &TableName,
) -> Result<Vec<String>> {
    let statement = D::Db::bind(sqlx::query(D::COLUMNS_OF), Arg::Text(table.as_str()));
    let rows = D::Db::fetch_all(statement, conn).await.map_err(D::error)?;
    rows.iter()
        .map(|row| D::Db::text(row, "name").map_err(D::error))
        .collect()
}

/// What would bring `table` to its latest version: `plan` maps the
/// table's columns (none when it does not exist) to the migrations from its
/// version on.
pub async fn pending<D: Dialect>(
    pool: &Pool<D::Db>,
    table: &TableName,
    plan: fn(&TableName, &[String]) -> Vec<PendingMigration>,
) -> Result<Vec<PendingMigration>> {
    let mut conn = pool.acquire().await.map_err(D::error)?;
    let columns = columns::<D>(&mut conn, table).await?;
    Ok(plan(table, &columns))
}

/// Brings `table`, a `kind` of table, to its latest version under the
/// engine's migration lock (see [`pending`] for `plan`). Safe to run again
/// and from several processes at once.
pub async fn migrate<D: Dialect>(
    pool: &Pool<D::Db>,
    kind: &str,
    table: &TableName,
    plan: fn(&TableName, &[String]) -> Vec<PendingMigration>,
) -> Result<()> {
    let owned = table.clone();
    D::under_migration_lock(
        pool,
        kind,
        table,
        Box::new(move |conn| {
            Box::pin(async move {
                let columns = columns::<D>(conn, &owned).await?;
                for migration in plan(&owned, &columns) {
                    for statement in migration.statements {
                        D::Db::execute(sqlx::query(AssertSqlSafe(statement)), conn)
                            .await
                            .map_err(D::error)?;
                    }
                }
                Ok(())
            })
        }),
    )
    .await
}

/// Runs `work` in one transaction begun by [`Dialect::begin`] and commits
/// it: the migration commits or rolls back whole. `lock`, when the
/// transaction's `begin` does not already hold the engine's migration lock,
/// is the statement that takes it for the transaction, run first; the lock
/// goes with the transaction. An engine whose DDL is transactional gives
/// this as its [`Dialect::under_migration_lock`].
pub async fn migrate_in_transaction<D: Dialect>(
    pool: &Pool<D::Db>,
    lock: Option<Statement<'_, D::Db>>,
    work: Migrations<'_, D::Db>,
) -> Result<()> {
    let mut tx = D::begin(pool).await?;
    if let Some(lock) = lock {
        D::Db::execute(lock, &mut tx).await.map_err(D::error)?;
    }
    work(&mut tx).await?;
    tx.commit().await.map_err(D::error)
}

/// The wall-clock time in milliseconds, for the `applied_at_ms` an engine
/// records with a schema version: bookkeeping for operators, never a claim
/// decision (those take the time from the engine's clock).
pub fn applied_at_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// One schema version of an engine's keys table: the statements that bring
/// a table from the previous version to this one, rendered for its name.
/// An engine lists its versions oldest first, and never edits a released
/// one: a schema change is a new entry.
pub struct KeyMigration {
    /// The version number recorded in the `{table}_schema` table.
    pub version: i64,
    /// A short description, recorded next to the version.
    pub description: &'static str,
    /// Renders the statements for a keys table name.
    pub statements: fn(&str) -> Vec<String>,
}

impl KeyMigration {
    /// The versions of `all` after `current`, rendered for `table`; refuses
    /// a table at a version newer than the last of `all` (written by a newer
    /// `store`), as every command that reads or changes it does.
    pub fn after<'a>(
        all: &'a [KeyMigration],
        store: &str,
        table: &str,
        current: i64,
    ) -> Result<impl Iterator<Item = &'a KeyMigration>> {
        let latest = all.last().map_or(0, |m| m.version);
        PendingMigration::refuse_newer(store, table, current, latest)?;
        Ok(all.iter().filter(move |m| m.version > current))
    }

    /// [`after`](Self::after), as the pending migrations an operator is
    /// shown.
    pub fn pending(all: &[KeyMigration], store: &str, table: &str, current: i64) -> Result<Vec<PendingMigration>> {
        Ok(Self::after(all, store, table, current)?
            .map(|m| PendingMigration {
                version: m.version,
                description: m.description.to_owned(),
                statements: (m.statements)(table),
            })
            .collect())
    }
}
