//! Dead letters of outbound calls, on any SQL engine.
//!
//! One row per (tenant, operation, key). Every write reads the row with the
//! database's clock under the transaction's lock (`SELECT … FOR UPDATE` at
//! READ COMMITTED, or SQLite's `BEGIN IMMEDIATE`: a concurrent redrive
//! waits, re-reads the row and no longer finds it free), applies one of the
//! core's transitions ([`DeadLetter`](idem_core::DeadLetter)'s methods), and
//! writes the row back: [`DeadLetterTable`] does that once for every table,
//! and this module gives it the statements, binds and row reading once for
//! every engine. A first record is an insert that ignores a twin's row (or,
//! where the engine cannot, fails on it), which then turns into an update
//! of that row. Timestamps and holds are on the database's clock.

use std::sync::Arc;

use idem_core::{
    BoxFuture, DeadLetterFilter, DeadLetterRow, DeadLetterTable, NewDeadLetter, PendingMigration, Result, RowAt,
    StoreErrorKind, TableName,
};
use sqlx::{AssertSqlSafe, Database, Transaction};

use crate::{
    Arg, Dialect, ScopedInsert, SqlDb, Statement, TextColumns, assignments, bound, scoped_args, scoped_key, table_store,
};

/// The default dead-letter table.
pub const DEFAULT_DEAD_LETTER_TABLE: &str = "idem_dead_letters";

/// The columns every read selects, in [`DeadLetterRow`]'s names.
const COLUMNS: &str = "id, tenant, operation, idem_key, method, url, headers, body, attempts, last_error, state, \
                       redrives, created_at_ms, updated_at_ms, redrive_until_ms, response_status, response_body, \
                       first_reached_at_ms, verdict, verdict_by, verdict_at_ms, verdict_note, key_horizon_ms, \
                       horizon_margin_ms, settle_ms";

/// The columns a first record writes that no transition changes, in bind
/// order; it writes [`UPDATED`] after them.
const FIXED: [&str; 7] = [
    "tenant",
    "operation",
    "idem_key",
    "method",
    "headers",
    "body",
    "created_at_ms",
];

/// The columns a transition may change, in bind order (an update binds the
/// row's id after them).
const UPDATED: [&str; 17] = [
    "url",
    "attempts",
    "last_error",
    "state",
    "redrives",
    "updated_at_ms",
    "redrive_until_ms",
    "response_status",
    "response_body",
    "first_reached_at_ms",
    "verdict",
    "verdict_by",
    "verdict_at_ms",
    "verdict_note",
    "key_horizon_ms",
    "horizon_margin_ms",
    "settle_ms",
];

/// An engine's dead-letter schema: its `CREATE TABLE` and the upgrades
/// from older versions. The versions: 1, the first columns; 2, the
/// verdict and first-reach columns and the `unknown` and `cancelled`
/// states; 3 (the latest), the terms the sends were made under.
pub trait DeadLetterSchema: Dialect {
    /// Whether the upgrade from version 1 rebuilds the table as the latest
    /// version at once (an engine that cannot change a `CHECK` constraint).
    const V1_REBUILDS: bool = false;

    /// The latest table and its index.
    fn create_dead_letters(table: &TableName) -> Vec<String>;

    /// From version 1 to 2 (to the latest where [`V1_REBUILDS`](Self::V1_REBUILDS)).
    fn dead_letters_from_v1(table: &TableName) -> Vec<String>;

    /// From version 2 to 3.
    fn dead_letters_from_v2(table: &TableName) -> Vec<String>;
}

/// The version of a dead-letter table with these columns: 0 when it does
/// not exist.
fn version(columns: &[String]) -> u32 {
    let has = |name: &str| columns.iter().any(|c| c == name);
    match () {
        _ if columns.is_empty() => 0,
        _ if has("settle_ms") => 3,
        _ if has("first_reached_at_ms") => 2,
        _ => 1,
    }
}

/// What brings a dead-letter table with these columns to the latest version.
fn plan<D: DeadLetterSchema>(table: &TableName, columns: &[String]) -> Vec<PendingMigration> {
    let step = |version: i64, description: &str, statements: Vec<String>| PendingMigration {
        version,
        description: description.into(),
        statements,
    };
    let terms = || {
        step(
            3,
            "dead letters: the terms the sends were made under (key horizon, settle time)",
            D::dead_letters_from_v2(table),
        )
    };
    match version(columns) {
        0 => vec![step(
            3,
            "dead letters table (states, first reach, verdicts, send terms) and state index",
            D::create_dead_letters(table),
        )],
        1 if D::V1_REBUILDS => vec![step(
            3,
            "dead letters: unknown and cancelled states, first reach, verdicts, send terms",
            D::dead_letters_from_v1(table),
        )],
        1 => vec![
            step(
                2,
                "dead letters: unknown and cancelled states, first reach, verdicts",
                D::dead_letters_from_v1(table),
            ),
            terms(),
        ],
        2 => vec![terms()],
        _ => Vec::new(),
    }
}

/// The statements, built once per table.
struct Sql {
    now: Arc<str>,
    insert: ScopedInsert,
    get: Arc<str>,
    get_locked: Arc<str>,
    find: Arc<str>,
    find_locked: Arc<str>,
    update: Arc<str>,
    purge: Arc<str>,
}

impl Sql {
    fn new<D: Dialect>(t: &str) -> Self {
        let p = D::placeholder;
        let now = D::NOW_MS;
        let lock = D::FOR_UPDATE;
        let by_id = format!("SELECT {COLUMNS}, {now} AS now_ms FROM {t} WHERE id = {}", p(1));
        let by_call = format!(
            "SELECT {COLUMNS}, {now} AS now_ms FROM {t} WHERE {}",
            scoped_key::<D>(1)
        );
        Sql {
            now: format!("SELECT {now} AS now_ms").into(),
            insert: ScopedInsert::new::<D>(t, &[&FIXED[..], &UPDATED[..]].concat()),
            get_locked: format!("{by_id}{lock}").into(),
            find_locked: format!("{by_call}{lock}").into(),
            get: by_id.into(),
            find: by_call.into(),
            update: format!(
                "UPDATE {t} SET {} WHERE id = {}",
                assignments::<D>(&UPDATED, 1),
                p(UPDATED.len() + 1)
            )
            .into(),
            purge: D::delete_first(
                t,
                "id",
                &format!(
                    "state IN ('resolved', 'cancelled') AND updated_at_ms < {now} - {}",
                    p(1)
                ),
                "id",
                &p(2),
            )
            .into(),
        }
    }
}

table_store! {
    /// Dead letters on the engine `D` speaks to: each engine crate names its
    /// own (`PgDeadLetters`, `MySqlDeadLetters`, `SqliteDeadLetters`).
    ///
    /// Its writes are the core's [`DeadLetterStore`](idem_core::DeadLetterStore)
    /// (through [`DeadLetterTable`]); [`record_in`](Self::record_in) and
    /// [`cancel_in`](Self::cancel_in) write in the caller's transaction, with
    /// its business writes.
    SqlDeadLetters<D: DeadLetterSchema>, DEFAULT_DEAD_LETTER_TABLE, "dead letters", "dead letters"
}

impl<D: DeadLetterSchema> SqlDeadLetters<D> {
    /// Records `letter` in the caller's open transaction (see
    /// [`DeadLetterStore::record`](idem_core::DeadLetterStore::record)): it is
    /// kept if and only if that transaction commits. Answers the letter's id.
    pub async fn record_in(&self, conn: &mut <D::Db as Database>::Connection, letter: &NewDeadLetter) -> Result<i64> {
        idem_core::deadletter::record_in(self, conn, letter).await
    }

    /// Cancels letter `id` in the caller's open transaction, if it is known
    /// not to have been applied (see
    /// [`DeadLetterStore::cancel`](idem_core::DeadLetterStore::cancel)).
    pub async fn cancel_in(&self, conn: &mut <D::Db as Database>::Connection, id: i64) -> Result<bool> {
        idem_core::deadletter::cancel_in(self, conn, id).await
    }

    /// The statement reading the row `at` names: `by_id` or `by_call`.
    fn at<'q>(at: RowAt<'q>, by_id: &Arc<str>, by_call: &Arc<str>) -> Statement<'q, D::Db> {
        match at {
            RowAt::Id(id) => bound::<D>(AssertSqlSafe(by_id.clone()), [Arg::Int(id)]),
            RowAt::Call(scope, key) => bound::<D>(AssertSqlSafe(by_call.clone()), scoped_args(scope, key)),
        }
    }
}

/// Free text (errors, notes) as the engine keeps it.
fn free_text<D: Dialect>(text: Option<&str>) -> Arg<'_> {
    match D::TEXT {
        TextColumns::Text => Arg::OptText(text),
        TextColumns::FreeTextAsBytes | TextColumns::Binary => Arg::OptBytes(text.map(str::as_bytes)),
    }
}

/// What [`UPDATED`] binds, in its order, then the id.
fn updated<D: Dialect>(row: &DeadLetterRow) -> [Arg<'_>; 18] {
    [
        Arg::Text(&row.url),
        Arg::Int(row.attempts),
        free_text::<D>(Some(&row.last_error)),
        Arg::Text(&row.state),
        Arg::Int(row.redrives),
        Arg::Int(row.updated_at_ms),
        Arg::OptInt(row.redrive_until_ms),
        Arg::OptInt32(row.response_status.map(|s| s as i32)),
        Arg::OptBytes(row.response_body.as_deref()),
        Arg::OptInt(row.first_reached_at_ms),
        Arg::OptText(row.verdict.as_deref()),
        Arg::OptText(row.verdict_by.as_deref()),
        Arg::OptInt(row.verdict_at_ms),
        free_text::<D>(row.verdict_note.as_deref()),
        Arg::OptInt(row.key_horizon_ms),
        Arg::OptInt(row.horizon_margin_ms),
        Arg::OptInt(row.settle_ms),
        Arg::Int(row.id),
    ]
}

/// What a first record binds: [`FIXED`], then [`UPDATED`].
fn inserted<D: Dialect>(row: &DeadLetterRow) -> impl Iterator<Item = Arg<'_>> {
    let fixed = [
        Arg::Text(&row.tenant),
        Arg::Text(&row.operation),
        Arg::Text(&row.idem_key),
        Arg::Text(&row.method),
        Arg::Text(&row.headers),
        Arg::Bytes(&row.body),
        Arg::Int(row.created_at_ms),
    ];
    // The last of `updated` is the id, which an insert does not bind.
    fixed
        .into_iter()
        .chain(updated::<D>(row).into_iter().take(UPDATED.len()))
}

/// Reads the columns of a row the way engine `D` types them.
struct Columns<'r, D: Dialect> {
    row: &'r <D::Db as Database>::Row,
}

impl<D: Dialect> Columns<'_, D> {
    fn int(&self, name: &str) -> Result<i64> {
        D::Db::int(self.row, name).map_err(D::error)
    }

    fn opt_int(&self, name: &str) -> Result<Option<i64>> {
        D::Db::opt_int(self.row, name).map_err(D::error)
    }

    /// Text that must be what was written.
    fn text(&self, name: &str) -> Result<String> {
        match D::TEXT {
            TextColumns::Binary => String::from_utf8(D::Db::bytes(self.row, name).map_err(D::error)?).map_err(|_| {
                idem_core::Error::store(
                    StoreErrorKind::Other,
                    format!("corrupt dead letter: {name} is not UTF-8"),
                )
            }),
            _ => D::Db::text(self.row, name).map_err(D::error),
        }
    }

    /// Text shown, not acted on: invalid UTF-8 is shown, not refused.
    fn opt_label(&self, name: &str) -> Result<Option<String>> {
        match D::TEXT {
            TextColumns::Binary => Ok(D::Db::opt_bytes(self.row, name).map_err(D::error)?.map(lossy)),
            _ => D::Db::opt_text(self.row, name).map_err(D::error),
        }
    }

    /// Free text (errors, notes), which may hold anything.
    fn opt_free_text(&self, name: &str) -> Result<Option<String>> {
        match D::TEXT {
            TextColumns::Text => D::Db::opt_text(self.row, name).map_err(D::error),
            TextColumns::FreeTextAsBytes | TextColumns::Binary => {
                Ok(D::Db::opt_bytes(self.row, name).map_err(D::error)?.map(lossy))
            }
        }
    }

    /// A dead letter and the database's clock read with it.
    fn letter(&self) -> Result<(DeadLetterRow, i64)> {
        let missing =
            |name: &str| idem_core::Error::store(StoreErrorKind::Other, format!("corrupt dead letter: {name} is NULL"));
        let letter = DeadLetterRow {
            id: self.int("id")?,
            tenant: self.text("tenant")?,
            operation: self.text("operation")?,
            idem_key: self.text("idem_key")?,
            method: self.text("method")?,
            url: self.text("url")?,
            headers: self.text("headers")?,
            body: D::Db::bytes(self.row, "body").map_err(D::error)?,
            attempts: self.int("attempts")?,
            last_error: self.opt_free_text("last_error")?.ok_or_else(|| missing("last_error"))?,
            state: self.text("state")?,
            redrives: self.int("redrives")?,
            created_at_ms: self.int("created_at_ms")?,
            updated_at_ms: self.int("updated_at_ms")?,
            redrive_until_ms: self.opt_int("redrive_until_ms")?,
            response_status: D::Db::opt_int32(self.row, "response_status")
                .map_err(D::error)?
                .map(i64::from),
            response_body: D::Db::opt_bytes(self.row, "response_body").map_err(D::error)?,
            first_reached_at_ms: self.opt_int("first_reached_at_ms")?,
            verdict: self.opt_label("verdict")?,
            verdict_by: self.opt_label("verdict_by")?,
            verdict_at_ms: self.opt_int("verdict_at_ms")?,
            verdict_note: self.opt_free_text("verdict_note")?,
            key_horizon_ms: self.opt_int("key_horizon_ms")?,
            horizon_margin_ms: self.opt_int("horizon_margin_ms")?,
            settle_ms: self.opt_int("settle_ms")?,
        };
        Ok((letter, self.int("now_ms")?))
    }
}

fn lossy(bytes: Vec<u8>) -> String {
    String::from_utf8_lossy(&bytes).into_owned()
}

fn letter<D: Dialect>(row: &<D::Db as Database>::Row) -> Result<(DeadLetterRow, i64)> {
    Columns::<D> { row }.letter()
}

impl<D: DeadLetterSchema> DeadLetterTable for SqlDeadLetters<D> {
    type Conn = <D::Db as Database>::Connection;
    type Tx = Transaction<'static, D::Db>;

    fn begin(&self) -> BoxFuture<'_, Result<Self::Tx>> {
        D::begin(&self.t.pool)
    }

    fn commit(tx: Self::Tx) -> BoxFuture<'static, Result<()>> {
        Box::pin(async move { tx.commit().await.map_err(D::error) })
    }

    fn rollback(tx: Self::Tx) -> BoxFuture<'static, Result<()>> {
        Box::pin(async move { tx.rollback().await.map_err(D::error) })
    }

    fn now<'a>(&'a self, conn: &'a mut Self::Conn) -> BoxFuture<'a, Result<i64>> {
        Box::pin(async move {
            let row = D::Db::fetch_optional(sqlx::query(AssertSqlSafe(self.t.sql.now.clone())), conn)
                .await
                .map_err(D::error)?
                .ok_or_else(|| idem_core::Error::store(StoreErrorKind::Other, "the clock read no row"))?;
            D::Db::int(&row, "now_ms").map_err(D::error)
        })
    }

    fn insert<'a>(&'a self, conn: &'a mut Self::Conn, row: &'a DeadLetterRow) -> BoxFuture<'a, Result<Option<i64>>> {
        Box::pin(async move {
            // `None`: another writer of the same call made the row first, and
            // this record updates it.
            self.t.sql.insert.run::<D>(inserted::<D>(row), conn).await
        })
    }

    fn lock<'a>(
        &'a self,
        conn: &'a mut Self::Conn,
        at: RowAt<'a>,
    ) -> BoxFuture<'a, Result<Option<(DeadLetterRow, i64)>>> {
        Box::pin(async move {
            let statement = Self::at(at, &self.t.sql.get_locked, &self.t.sql.find_locked);
            let row = D::Db::fetch_optional(statement, conn).await.map_err(D::error)?;
            row.as_ref().map(letter::<D>).transpose()
        })
    }

    fn update<'a>(&'a self, conn: &'a mut Self::Conn, row: &'a DeadLetterRow) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            let statement = bound::<D>(AssertSqlSafe(self.t.sql.update.clone()), updated::<D>(row));
            D::Db::execute(statement, conn).await.map_err(D::error)?;
            Ok(())
        })
    }

    fn read<'a>(&'a self, at: RowAt<'a>) -> BoxFuture<'a, Result<Option<DeadLetterRow>>> {
        Box::pin(async move {
            let statement = Self::at(at, &self.t.sql.get, &self.t.sql.find);
            let row = D::Db::fetch_optional_pooled(statement, &self.t.pool)
                .await
                .map_err(D::error)?;
            Ok(row.as_ref().map(letter::<D>).transpose()?.map(|(row, _)| row))
        })
    }

    fn select<'a>(&'a self, filter: &'a DeadLetterFilter) -> BoxFuture<'a, Result<Vec<DeadLetterRow>>> {
        Box::pin(async move {
            let mut sql = format!(
                "SELECT {COLUMNS}, {} AS now_ms FROM {} WHERE id > {}",
                D::ZERO,
                self.t.name,
                D::placeholder(1)
            );
            let mut args = vec![Arg::Int(filter.after_id.unwrap_or(i64::MIN))];
            for (value, column) in [
                (filter.tenant.as_deref(), "tenant"),
                (filter.operation.as_deref(), "operation"),
                (filter.state.map(|s| s.as_str()), "state"),
            ] {
                if let Some(value) = value {
                    args.push(Arg::Text(value));
                    sql.push_str(&format!(" AND {column} = {}", D::placeholder(args.len())));
                }
            }
            args.push(Arg::Int(i64::from(filter.limit)));
            sql.push_str(&format!(" ORDER BY id LIMIT {}", D::placeholder(args.len())));
            let statement = bound::<D>(AssertSqlSafe(sql), args);
            let rows = D::Db::fetch_all_pooled(statement, &self.t.pool)
                .await
                .map_err(D::error)?;
            rows.iter().map(|r| letter::<D>(r).map(|(row, _)| row)).collect()
        })
    }

    fn purge_final(&self, older_than_ms: i64, limit: u32) -> BoxFuture<'_, Result<u64>> {
        Box::pin(self.t.purge_batch(&self.t.sql.purge, older_than_ms.max(0), limit))
    }
}
