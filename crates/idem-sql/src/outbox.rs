//! The transactional outbox, on any SQL engine.
//!
//! Rows are enqueued in the caller's transaction. Every relay pass looks at
//! every unsent row (no high-water mark), so a row whose transaction
//! commits after later rows is still found. How a relay holds the rows it
//! publishes is the engine's [`Relay`]:
//!
//! - [`Relay::Held`]: it takes unsent rows `FOR UPDATE SKIP LOCKED` in a
//!   READ COMMITTED transaction that it keeps open while it publishes.
//!   Parallel relays never take the same row, and a relay that dies lets go
//!   of its rows with its connection.
//! - [`Relay::Leased`]: where the database has one writer at a time (a
//!   relay cannot keep a transaction open while it publishes: every
//!   business write would wait for the broker), one short statement marks
//!   up to `limit` unsent, unleased rows with the relay's token and a lease
//!   deadline; finishing marks the published ones sent and schedules the
//!   rest for a retry, by token. A relay that dies holding rows loses them
//!   when the lease runs out, and another relay takes them again (the
//!   broker's deduplication window and the consumers' inbox absorb the
//!   second publish).

use std::collections::HashSet;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use idem_core::{
    BoxFuture, OutboxBatch, OutboxEvent, OutboxLag, OutboxMessage, OutboxStore, PendingMigration, Result, RetryBackoff,
    TableName,
};
use sqlx::{AssertSqlSafe, Database, Pool, Transaction};

use crate::{Arg, Dialect, SqlDb, SqlTable, bound, default_table};

/// The default outbox table.
pub const DEFAULT_OUTBOX_TABLE: &str = "idem_outbox";

/// How long a leasing relay holds the rows it took, by default.
pub const DEFAULT_RELAY_LEASE: Duration = Duration::from_secs(30);

/// Row sequences marked per statement where they are listed one by one:
/// under every engine's limit of bound values (MySQL 65,535, SQLite
/// 32,766), whatever the relay's batch size.
const MARK_CHUNK: usize = 1_000;

/// How a relay holds the rows it publishes (see the [module](self)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Relay {
    /// In a transaction kept open while it publishes, rows locked
    /// `FOR UPDATE SKIP LOCKED`.
    Held,
    /// By a lease marked on the rows with the relay's token.
    Leased,
}

/// An engine's outbox: how its relays hold rows, its `CREATE TABLE`, and
/// how it names a set of rows in one statement.
pub trait OutboxSchema: Dialect {
    /// How relays hold the rows they publish.
    const RELAY: Relay;

    /// The statements that create the table and its indexes if they do not
    /// exist.
    fn create_outbox(table: &TableName) -> Vec<String>;

    /// Runs `head` (a statement ending in `WHERE` or `AND`) on the rows
    /// whose `seq` is in `seqs`, `leading` bound first. By default in
    /// statements of at most 1,000 listed values (`seq IN (…)`).
    fn for_rows<'c>(
        conn: &'c mut <Self::Db as Database>::Connection,
        head: &'c str,
        leading: &'c [Arg<'c>],
        seqs: &'c [i64],
    ) -> BoxFuture<'c, Result<()>> {
        Box::pin(async move {
            for chunk in seqs.chunks(MARK_CHUNK) {
                let first = leading.len() + 1;
                let list = crate::placeholders::<Self>(first, first + chunk.len() - 1);
                let statement = sqlx::query(AssertSqlSafe(format!("{head} seq IN ({list})")));
                let statement = leading
                    .iter()
                    .copied()
                    .chain(chunk.iter().map(|seq| Arg::Int(*seq)))
                    .fold(statement, Self::Db::bind);
                Self::Db::execute(statement, conn).await.map_err(Self::error)?;
            }
            Ok(())
        })
    }
}

/// The statements, built once per table.
struct Sql {
    insert: Arc<str>,
    take: Arc<str>,
    mark_sent: String,
    mark_failed: String,
    lag: Arc<str>,
    purge: Arc<str>,
}

/// What every read of rows selects.
const COLUMNS: &str = "seq, event_id, subject, payload, created_at_ms, attempts";

impl Sql {
    fn new<D: OutboxSchema>(t: &str) -> Self {
        let p = D::placeholder;
        let (now, least, int) = (D::NOW_MS, D::LEAST, D::BIGINT);
        let backoff = format!("{now} + {least}({}, {} << {least}(attempts, 20))", p(1), p(2));
        let due = format!("sent_at_ms IS NULL AND next_attempt_at_ms <= {now}");
        let (take, mark_sent, mark_failed) = match D::RELAY {
            Relay::Held => (
                format!(
                    "SELECT {COLUMNS} FROM {t} WHERE {due} ORDER BY seq LIMIT {} FOR UPDATE SKIP LOCKED",
                    p(1)
                ),
                format!("UPDATE {t} SET sent_at_ms = {now} WHERE"),
                // The backoff reads `attempts` before it is counted up, on
                // every engine (MySQL assigns left to right).
                format!("UPDATE {t} SET next_attempt_at_ms = {backoff}, attempts = attempts + 1 WHERE"),
            ),
            Relay::Leased => (
                format!(
                    "UPDATE {t} SET relay_token = {}, lease_until_ms = {now} + {} WHERE seq IN \
                     (SELECT seq FROM {t} WHERE {due} \
                      AND (lease_until_ms IS NULL OR lease_until_ms <= {now}) ORDER BY seq LIMIT {}) \
                     RETURNING {COLUMNS}",
                    p(1),
                    p(2),
                    p(3)
                ),
                format!(
                    "UPDATE {t} SET sent_at_ms = {now}, relay_token = NULL, lease_until_ms = NULL \
                     WHERE relay_token = {} AND sent_at_ms IS NULL AND",
                    p(1)
                ),
                // What is left of the batch was not confirmed.
                format!(
                    "UPDATE {t} SET relay_token = NULL, lease_until_ms = NULL, next_attempt_at_ms = {backoff}, \
                     attempts = attempts + 1 WHERE relay_token = {} AND sent_at_ms IS NULL",
                    p(3)
                ),
            ),
        };
        Sql {
            insert: format!(
                "INSERT INTO {t} (event_id, subject, payload, created_at_ms) VALUES ({}, {}, {}, {now})",
                p(1),
                p(2),
                p(3)
            )
            .into(),
            take: take.into(),
            mark_sent,
            mark_failed,
            lag: format!(
                "SELECT CAST(COUNT(*) AS {int}) AS unsent, CAST({now} - MIN(created_at_ms) AS {int}) AS age \
                 FROM {t} WHERE sent_at_ms IS NULL"
            )
            .into(),
            purge: D::delete_first(
                t,
                "seq",
                &format!("sent_at_ms IS NOT NULL AND sent_at_ms < {now} - {}", p(1)),
                "sent_at_ms",
                &p(2),
            )
            .into(),
        }
    }
}

/// The outbox on the engine `D` speaks to: enqueue inside a transaction;
/// relays take rows through [`OutboxStore`]. Each engine crate names its
/// own (`PgOutbox`, `MySqlOutbox`, `SqliteOutbox`).
pub struct SqlOutbox<D: OutboxSchema> {
    t: SqlTable<D, Sql>,
    lease: Duration,
}

impl<D: OutboxSchema> Clone for SqlOutbox<D> {
    fn clone(&self) -> Self {
        Self {
            t: self.t.clone(),
            lease: self.lease,
        }
    }
}

impl<D: OutboxSchema> fmt::Debug for SqlOutbox<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut s = f.debug_struct("SqlOutbox");
        s.field("engine", &D::NAME).field("table", &self.t.name);
        if D::RELAY == Relay::Leased {
            s.field("lease", &self.lease);
        }
        s.finish_non_exhaustive()
    }
}

impl<D: OutboxSchema> SqlOutbox<D> {
    /// The outbox in [`DEFAULT_OUTBOX_TABLE`].
    pub fn new(pool: Pool<D::Db>) -> Self {
        Self::with_table(pool, default_table(DEFAULT_OUTBOX_TABLE))
    }

    /// The outbox in `table`.
    pub fn with_table(pool: Pool<D::Db>, table: TableName) -> Self {
        Self {
            t: SqlTable::new(pool, table, Sql::new::<D>),
            lease: DEFAULT_RELAY_LEASE,
        }
    }

    /// How long a relay holds the rows it took before another may take
    /// them, where relays lease rows ([`Relay::Leased`]; default
    /// [`DEFAULT_RELAY_LEASE`]). Keep it longer than a batch's publish and
    /// shorter than the broker's deduplication window. Where relays hold
    /// rows in a transaction it has no effect: a relay holds its rows until
    /// it finishes or its connection goes.
    pub fn with_lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// The relay lease (see [`with_lease`](Self::with_lease)).
    pub fn lease(&self) -> Duration {
        self.lease
    }

    /// The table.
    pub fn table(&self) -> &TableName {
        &self.t.name
    }

    /// The pool.
    pub fn pool(&self) -> &Pool<D::Db> {
        &self.t.pool
    }

    /// Creates the table and its indexes if they do not exist. Safe from
    /// several processes at once (they take turns on the engine's migration
    /// lock).
    pub async fn migrate(&self) -> Result<()> {
        crate::migrate::<D>(&self.t.pool, "outbox", &self.t.name, plan::<D>).await
    }

    /// Enqueues `event` in the caller's open transaction: it is published if
    /// and only if that transaction commits.
    pub async fn enqueue(&self, conn: &mut <D::Db as Database>::Connection, event: &OutboxEvent) -> Result<()> {
        let statement = bound::<D>(
            AssertSqlSafe(self.t.sql.insert.clone()),
            [
                Arg::Text(event.id()),
                Arg::Text(event.subject()),
                Arg::Bytes(event.payload()),
            ],
        );
        D::Db::execute(statement, conn).await.map_err(D::error)?;
        Ok(())
    }
}

/// Every `CREATE … IF NOT EXISTS`, whatever is there: they cost nothing
/// when it is.
fn plan<D: OutboxSchema>(table: &TableName, _: &[String]) -> Vec<PendingMigration> {
    vec![PendingMigration {
        version: 1,
        description: "outbox table and its indexes".into(),
        statements: D::create_outbox(table),
    }]
}

/// A token that tells one relay's batch from every other's.
fn relay_token() -> i64 {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    // Process id, a counter and the time: distinct across relays and
    // processes on one database.
    let mixed = (u64::from(std::process::id()) << 40) ^ (n << 20) ^ nanos.rotate_left(17) ^ nanos;
    (mixed >> 1) as i64
}

/// How a batch holds its rows.
enum Hold<DB: Database> {
    /// The open transaction that locks them; `None` once finished.
    Tx(Option<Transaction<'static, DB>>),
    /// The lease marked on them with this token.
    Lease { pool: Pool<DB>, token: i64 },
}

/// Rows taken by one relay.
pub struct SqlOutboxBatch<D: OutboxSchema> {
    hold: Hold<D::Db>,
    messages: Vec<OutboxMessage>,
    sql: Arc<Sql>,
}

impl<D: OutboxSchema> fmt::Debug for SqlOutboxBatch<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqlOutboxBatch")
            .field("engine", &D::NAME)
            .field("messages", &self.messages.len())
            .finish()
    }
}

impl<D: OutboxSchema> OutboxBatch for SqlOutboxBatch<D> {
    fn messages(&self) -> &[OutboxMessage] {
        &self.messages
    }

    fn finish(mut self, sent: Vec<i64>, backoff: RetryBackoff) -> BoxFuture<'static, Result<()>> {
        Box::pin(async move {
            let (max, min) = (Arg::Int(backoff.max_ms.max(1)), Arg::Int(backoff.min_ms.max(1)));
            match &mut self.hold {
                Hold::Tx(tx) => {
                    let Some(mut tx) = tx.take() else { return Ok(()) };
                    if self.messages.is_empty() {
                        return tx.rollback().await.map_err(D::error);
                    }
                    let confirmed: HashSet<i64> = sent.iter().copied().collect();
                    let failed: Vec<i64> = self
                        .messages
                        .iter()
                        .map(|m| m.seq)
                        .filter(|s| !confirmed.contains(s))
                        .collect();
                    D::for_rows(&mut tx, &self.sql.mark_sent, &[], &sent).await?;
                    D::for_rows(&mut tx, &self.sql.mark_failed, &[max, min], &failed).await?;
                    tx.commit().await.map_err(D::error)
                }
                Hold::Lease { pool, token } => {
                    if self.messages.is_empty() {
                        return Ok(());
                    }
                    let mut tx = D::begin(pool).await?;
                    D::for_rows(&mut tx, &self.sql.mark_sent, &[Arg::Int(*token)], &sent).await?;
                    let statement = bound::<D>(
                        AssertSqlSafe(self.sql.mark_failed.clone()),
                        [max, min, Arg::Int(*token)],
                    );
                    D::Db::execute(statement, &mut tx).await.map_err(D::error)?;
                    tx.commit().await.map_err(D::error)
                }
            }
        })
    }
}

fn message<D: Dialect>(row: &<D::Db as Database>::Row) -> Result<OutboxMessage> {
    Ok(OutboxMessage {
        seq: D::Db::int(row, "seq").map_err(D::error)?,
        id: crate::shown_text::<D>(row, "event_id")?,
        subject: crate::shown_text::<D>(row, "subject")?,
        payload: D::Db::bytes(row, "payload").map_err(D::error)?,
        created_at_ms: D::Db::int(row, "created_at_ms").map_err(D::error)?,
        attempts: D::Db::int32(row, "attempts").map_err(D::error)?,
    })
}

impl<D: OutboxSchema> OutboxStore for SqlOutbox<D> {
    type Batch = SqlOutboxBatch<D>;

    fn take(&self, limit: usize) -> BoxFuture<'_, Result<SqlOutboxBatch<D>>> {
        Box::pin(async move {
            let limit = Arg::Int(i64::try_from(limit).unwrap_or(i64::MAX));
            let statement = sqlx::query(AssertSqlSafe(self.t.sql.take.clone()));
            let (hold, rows) = match D::RELAY {
                Relay::Held => {
                    // READ COMMITTED whatever the database's default: a row
                    // another relay marked sent after this transaction
                    // began is re-checked when it is locked, not reported
                    // as a serialisation failure, and no gap is locked
                    // against enqueuers.
                    let mut tx = D::begin(&self.t.pool).await?;
                    let rows = D::Db::fetch_all(D::Db::bind(statement, limit), &mut tx)
                        .await
                        .map_err(D::error)?;
                    (Hold::Tx(Some(tx)), rows)
                }
                Relay::Leased => {
                    let token = relay_token();
                    let lease_ms = i64::try_from(self.lease.as_millis()).unwrap_or(i64::MAX / 4);
                    let statement = [Arg::Int(token), Arg::Int(lease_ms), limit]
                        .into_iter()
                        .fold(statement, D::Db::bind);
                    let rows = D::Db::fetch_all_pooled(statement, &self.t.pool)
                        .await
                        .map_err(D::error)?;
                    let pool = self.t.pool.clone();
                    (Hold::Lease { pool, token }, rows)
                }
            };
            let mut messages = rows.iter().map(message::<D>).collect::<Result<Vec<_>>>()?;
            // RETURNING gives no order.
            messages.sort_unstable_by_key(|m| m.seq);
            Ok(SqlOutboxBatch {
                hold,
                messages,
                sql: self.t.sql.clone(),
            })
        })
    }

    fn lag(&self) -> BoxFuture<'_, Result<OutboxLag>> {
        Box::pin(async move {
            let row = D::Db::fetch_optional_pooled(sqlx::query(AssertSqlSafe(self.t.sql.lag.clone())), &self.t.pool)
                .await
                .map_err(D::error)?;
            let Some(row) = row else {
                return Ok(OutboxLag {
                    unsent: 0,
                    oldest_unsent_age_ms: None,
                });
            };
            let unsent = D::Db::int(&row, "unsent").map_err(D::error)?;
            let age = D::Db::opt_int(&row, "age").map_err(D::error)?;
            Ok(OutboxLag {
                unsent: u64::try_from(unsent).unwrap_or(0),
                oldest_unsent_age_ms: age.map(|a| a.max(0)),
            })
        })
    }

    fn purge_sent(&self, older_than_ms: i64, limit: u32) -> BoxFuture<'_, Result<u64>> {
        Box::pin(self.t.purge_batch(&self.t.sql.purge, older_than_ms.max(0), limit))
    }
}
