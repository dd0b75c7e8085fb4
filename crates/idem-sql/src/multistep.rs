//! Multi-step operations on any SQL engine.
//!
//! One row per (tenant, operation, key). The columns are what statements
//! use — uniqueness, the due scan, the conditional write, the operator's
//! listing, the purge — and the rest of the operation is one document the
//! core encodes and decodes ([`MultiStepRow`]). A write is an `UPDATE … WHERE id = ? AND version = ?`
//! that stores the next version: one that updates no row wrote over a
//! version that moved, and is [`Error::Fenced`](idem_core::Error::Fenced).
//! The writes of a local step join the caller's transaction, through the
//! backend's transaction type, which derefs to the engine's connection.

use std::ops::DerefMut;
use std::sync::Arc;

use idem_core::multistep::{MultiStep, MultiStepCursor, MultiStepFilter, MultiStepRow, MultiStepState, MultiStepStore};
use idem_core::{BoxFuture, Error, IdempotencyKey, PendingMigration, Result, Scope, TableName, TxBackend};
use sqlx::{AssertSqlSafe, Database};

use crate::{
    Arg, Dialect, ScopedInsert, SqlDb, Statement, assignments, bound, placeholders, scoped_args, scoped_key,
    shown_text, table_store,
};

/// The default table of multi-step operations.
pub const DEFAULT_MULTISTEP_TABLE: &str = "idem_operations";

/// The columns every read selects.
const COLUMNS: &str = "id, tenant, operation, idem_key, state, version, token, step, lease_until_ms, \
                       not_before_ms, updated_at_ms, expires_at_ms, document";

/// The columns a first write stores that no write changes, in bind order.
const FIXED: [&str; 3] = ["tenant", "operation", "idem_key"];

/// The columns a write changes, in bind order (an update binds the id and
/// the version it was read at after them).
const UPDATED: [&str; 9] = [
    "state",
    "version",
    "token",
    "step",
    "lease_until_ms",
    "not_before_ms",
    "updated_at_ms",
    "expires_at_ms",
    "document",
];

/// An engine's table of multi-step operations: its `CREATE TABLE` and
/// indexes (version 1, the only one).
pub trait MultiStepSchema: Dialect {
    /// The table and its indexes.
    fn create_multisteps(table: &TableName) -> Vec<String>;
}

/// What brings a table with these columns to the latest version.
fn plan<D: MultiStepSchema>(table: &TableName, columns: &[String]) -> Vec<PendingMigration> {
    if !columns.is_empty() {
        return Vec::new();
    }
    vec![PendingMigration {
        version: 1,
        description: "multi-step operations table (recovery points) and due index".into(),
        statements: D::create_multisteps(table),
    }]
}

struct Sql {
    insert: ScopedInsert,
    update: Arc<str>,
    get: Arc<str>,
    find: Arc<str>,
    due: Arc<str>,
    purge: Arc<str>,
}

impl Sql {
    fn new<D: Dialect>(t: &str) -> Self {
        let p = D::placeholder;
        Self {
            insert: ScopedInsert::new::<D>(t, &[&FIXED[..], &UPDATED[..]].concat()),
            update: format!(
                "UPDATE {t} SET {} WHERE id = {} AND version = {}",
                assignments::<D>(&UPDATED, 1),
                p(UPDATED.len() + 1),
                p(UPDATED.len() + 2)
            )
            .into(),
            get: format!("SELECT {COLUMNS} FROM {t} WHERE id = {}", p(1)).into(),
            find: format!("SELECT {COLUMNS} FROM {t} WHERE {}", scoped_key::<D>(1)).into(),
            // A plain read: a runner takes what it found by a conditional
            // write, so the scan locks nothing.
            due: format!(
                "SELECT id FROM {t} WHERE state IN ('running', 'compensating') \
                 AND (lease_until_ms IS NULL OR lease_until_ms <= {}) \
                 AND (not_before_ms IS NULL OR not_before_ms <= {}) \
                 ORDER BY updated_at_ms, id LIMIT {}",
                p(1),
                p(2),
                p(3)
            )
            .into(),
            // A bounded batch of final operations past their expiry, the
            // earliest expired first: a range scan of the expiry index, in
            // its order, that stops at the limit (the index is partial on
            // PostgreSQL and SQLite, over the rows with an expiry, which
            // `expires_at_ms <= ?` implies). The state condition keeps any
            // other row, whatever its expiry; it is written through
            // `COALESCE` (of a column that is never NULL: its value) so
            // that it cannot be served by the due index: SQLite, without
            // statistics, would otherwise read every final row through it
            // and sort them all for each batch. A final row is never
            // written again, so the rows a batch selects are still final
            // and expired when it deletes them.
            purge: D::delete_first(
                t,
                "id",
                &format!(
                    "COALESCE(state, '') IN ('completed', 'compensated') AND expires_at_ms <= {}",
                    p(1)
                ),
                "expires_at_ms",
                &p(2),
            )
            .into(),
        }
    }
}

table_store! {
    /// Multi-step operations on the engine `D` speaks to: each engine crate
    /// names its own (`PgMultiSteps`, `MySqlMultiSteps`, `SqliteMultiSteps`).
    /// Its writes join the transactions of any backend whose transaction
    /// derefs to the engine's connection (each store's own transaction type).
    SqlMultiSteps<D: MultiStepSchema>, DEFAULT_MULTISTEP_TABLE, "operations", "multi-step operations"
}

impl<D: MultiStepSchema> SqlMultiSteps<D> {
    async fn insert(&self, conn: &mut <D::Db as Database>::Connection, op: &MultiStep) -> Result<Option<i64>> {
        let row = MultiStepRow::from(&MultiStep {
            version: 0,
            ..op.clone()
        });
        let args = [
            Arg::Text(&row.tenant),
            Arg::Text(&row.operation),
            Arg::Text(&row.idem_key),
        ]
        .into_iter()
        .chain(changed(&row));
        self.t.sql.insert.run::<D>(args, conn).await
    }

    async fn update(&self, conn: &mut <D::Db as Database>::Connection, op: &MultiStep) -> Result<()> {
        let row = MultiStepRow::from(&MultiStep {
            version: op.version + 1,
            ..op.clone()
        });
        let statement = bound::<D>(
            AssertSqlSafe(self.t.sql.update.clone()),
            changed(&row).chain([Arg::Int(row.id), Arg::Int(op.version)]),
        );
        let done = D::Db::execute(statement, conn).await.map_err(D::error)?;
        match D::rows_affected(&done) {
            1 => Ok(()),
            _ => Err(Error::Fenced),
        }
    }

    /// At most `limit` operations in `states` matching the filter's columns
    /// (tenant, operation, recovery point, age), after `after` in the
    /// listing's order: one statement, served by the (state,
    /// `updated_at_ms`) index.
    async fn select(
        &self,
        filter: &MultiStepFilter,
        states: &[MultiStepState],
        after: Option<MultiStepCursor>,
        limit: u32,
    ) -> Result<Vec<MultiStep>> {
        let p = D::placeholder;
        let mut args: Vec<Arg<'_>> = Vec::new();
        let mut conditions: Vec<String> = Vec::new();
        // Every state scanned is no condition at all.
        if states.len() < 5 {
            let first = args.len() + 1;
            args.extend(states.iter().map(|s| Arg::Text(s.as_str())));
            conditions.push(format!("state IN ({})", placeholders::<D>(first, args.len())));
        }
        for (column, value) in [("tenant", &filter.tenant), ("operation", &filter.operation)] {
            if let Some(value) = value {
                args.push(Arg::Text(value));
                conditions.push(format!("{column} = {}", p(args.len())));
            }
        }
        if let Some(n) = filter.recovery_point {
            args.push(Arg::Int(i64::from(n)));
            conditions.push(format!("step = {}", p(args.len())));
        }
        if let Some(t) = filter.unchanged_since_ms {
            args.push(Arg::Int(t));
            conditions.push(format!("updated_at_ms <= {}", p(args.len())));
        }
        if let Some(after) = after {
            // The time twice: an engine's placeholders may be positional.
            args.extend([
                Arg::Int(after.updated_at_ms),
                Arg::Int(after.updated_at_ms),
                Arg::Int(after.id),
            ]);
            let n = args.len();
            conditions.push(format!(
                "(updated_at_ms > {} OR (updated_at_ms = {} AND id > {}))",
                p(n - 2),
                p(n - 1),
                p(n)
            ));
        }
        args.push(Arg::Int(i64::from(limit)));
        let sql = format!(
            "SELECT {COLUMNS} FROM {} {} ORDER BY updated_at_ms, id LIMIT {}",
            self.t.name,
            if conditions.is_empty() {
                String::new()
            } else {
                format!("WHERE {}", conditions.join(" AND "))
            },
            p(args.len())
        );
        let statement = bound::<D>(AssertSqlSafe(sql), args);
        let rows = D::Db::fetch_all_pooled(statement, &self.t.pool)
            .await
            .map_err(D::error)?;
        rows.iter().map(decode::<D>).collect()
    }

    async fn read(&self, statement: Statement<'_, D::Db>) -> Result<Option<MultiStep>> {
        let row = D::Db::fetch_optional_pooled(statement, &self.t.pool)
            .await
            .map_err(D::error)?;
        row.as_ref().map(decode::<D>).transpose()
    }
}

/// What [`UPDATED`] binds, in its order.
fn changed(row: &MultiStepRow) -> impl Iterator<Item = Arg<'_>> {
    [
        Arg::Text(&row.state),
        Arg::Int(row.version),
        Arg::Int(row.token),
        Arg::Int(row.step),
        Arg::OptInt(row.lease_until_ms),
        Arg::OptInt(row.not_before_ms),
        Arg::Int(row.updated_at_ms),
        Arg::OptInt(row.expires_at_ms),
        Arg::Bytes(&row.document),
    ]
    .into_iter()
}

fn decode<D: Dialect>(r: &<D::Db as Database>::Row) -> Result<MultiStep> {
    let int = |name: &str| D::Db::int(r, name).map_err(D::error);
    let opt_int = |name: &str| D::Db::opt_int(r, name).map_err(D::error);
    MultiStepRow {
        id: int("id")?,
        tenant: shown_text::<D>(r, "tenant")?,
        operation: shown_text::<D>(r, "operation")?,
        idem_key: shown_text::<D>(r, "idem_key")?,
        state: shown_text::<D>(r, "state")?,
        version: int("version")?,
        token: int("token")?,
        step: int("step")?,
        lease_until_ms: opt_int("lease_until_ms")?,
        not_before_ms: opt_int("not_before_ms")?,
        updated_at_ms: int("updated_at_ms")?,
        expires_at_ms: opt_int("expires_at_ms")?,
        document: D::Db::bytes(r, "document").map_err(D::error)?,
    }
    .decode()
}

impl<D, B> MultiStepStore<B> for SqlMultiSteps<D>
where
    D: MultiStepSchema,
    B: TxBackend,
    B::Tx: DerefMut<Target = <D::Db as Database>::Connection>,
{
    /// Refused (nothing written) unless `tx` is still at its own level: a
    /// step's work that swallowed a nested `begin` which failed or was cut
    /// off has had its transaction rolled back by sqlx, and the write would
    /// commit on its own, recording the step done without its work.
    fn insert_in<'a>(&'a self, tx: &'a mut B::Tx, row: &'a MultiStep) -> BoxFuture<'a, Result<Option<i64>>> {
        Box::pin(async move {
            D::check_claim_level(&mut **tx).await?;
            self.insert(&mut **tx, row).await
        })
    }

    /// Refused as [`insert_in`](MultiStepStore::insert_in) is.
    fn write_in<'a>(&'a self, tx: &'a mut B::Tx, row: &'a MultiStep) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            D::check_claim_level(&mut **tx).await?;
            self.update(&mut **tx, row).await
        })
    }

    fn write<'a>(&'a self, row: &'a MultiStep) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            let mut conn = self.t.pool.acquire().await.map_err(D::error)?;
            self.update(&mut conn, row).await
        })
    }

    fn find<'a>(&'a self, scope: &'a Scope, key: &'a IdempotencyKey) -> BoxFuture<'a, Result<Option<MultiStep>>> {
        Box::pin(async move {
            let statement = bound::<D>(AssertSqlSafe(self.t.sql.find.clone()), scoped_args(scope, key));
            self.read(statement).await
        })
    }

    fn get(&self, id: i64) -> BoxFuture<'_, Result<Option<MultiStep>>> {
        Box::pin(async move {
            let statement = bound::<D>(AssertSqlSafe(self.t.sql.get.clone()), [Arg::Int(id)]);
            self.read(statement).await
        })
    }

    fn list<'a>(&'a self, filter: &'a MultiStepFilter) -> BoxFuture<'a, Result<Vec<MultiStep>>> {
        Box::pin(async move {
            filter.check()?;
            let states = filter.scanned_states();
            if states.is_empty() {
                return Ok(Vec::new());
            }
            // The open step is in the document, not a column: pages of the
            // rows the columns select are read until enough of them match
            // (only rows not final, which an open send needs, are read for
            // it). Without it, the first page is the answer.
            let mut found = Vec::new();
            let mut after = filter.after;
            loop {
                let page = self.select(filter, &states, after, filter.limit).await?;
                let full = page.len() == filter.limit as usize;
                for op in page {
                    after = Some(MultiStepCursor::of(&op));
                    if filter.matches(&op) {
                        found.push(op);
                        if found.len() == filter.limit as usize {
                            return Ok(found);
                        }
                    }
                }
                if !full {
                    return Ok(found);
                }
            }
        })
    }

    fn due(&self, now_ms: i64, limit: u32) -> BoxFuture<'_, Result<Vec<i64>>> {
        Box::pin(async move {
            // The time twice: an engine's placeholders may be positional.
            let statement = bound::<D>(
                AssertSqlSafe(self.t.sql.due.clone()),
                [Arg::Int(now_ms), Arg::Int(now_ms), Arg::Int(i64::from(limit))],
            );
            let rows = D::Db::fetch_all_pooled(statement, &self.t.pool)
                .await
                .map_err(D::error)?;
            rows.iter().map(|r| D::Db::int(r, "id").map_err(D::error)).collect()
        })
    }

    fn purge_expired(&self, now_ms: i64, limit: u32) -> BoxFuture<'_, Result<u64>> {
        Box::pin(self.t.purge_batch(&self.t.sql.purge, now_ms, limit))
    }
}
