//! A key's row outside its claim, the same on every engine: the lookup, the
//! lease holder's writes (mark sent, complete, release, extend), the
//! resolution of an unknown outcome and the sweep.
//!
//! How a key is claimed is each engine's own (PostgreSQL's upsert or
//! advisory lock, MySQL's placeholder row or named lock, SQLite's write
//! lock); once a row exists, every write to it is one statement matched by
//! the key, the holder's token and the row's status, and those statements
//! are written here once. Their placeholders stand in the order they are
//! bound, each once, so the same text serves numbered placeholders
//! (`$1`, `?1`) and positional ones (`?`).
//!
//! Invariant: a holder's write changes exactly one row or none, and none
//! means the lease was fenced ([`Lease::fenced_unless_one`]); a row is
//! held (in progress or sent) whether or not its lease has run out, and
//! only its token says by whom.

use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;

use idem_core::{
    ClaimRequest, Error, IdempotencyKey, Lease, Record, Resolution, Result, STATUS_IN_PROGRESS, STATUS_SENT,
    STATUS_UNKNOWN, Scope, StoredRow, TableName,
};
use sqlx::{AssertSqlSafe, Database, Pool};

use crate::{Arg, Dialect, SqlDb, Statement, TextColumns};

/// The columns a key's row is read back with, in [`StoredRow`]'s order,
/// then the sent mark.
pub const ROW_COLUMNS: &str = "fingerprint, status, token, payload, lease_expires_at_ms, expires_at_ms, sent_at_ms";

/// The statements of a key's row outside its claim, on one table.
#[derive(Debug)]
struct Statements {
    lookup: Arc<str>,
    mark_sent: Arc<str>,
    complete: Arc<str>,
    release: Arc<str>,
    extend: Arc<str>,
    resolve_record: Arc<str>,
    resolve_release: Arc<str>,
    sweep: Arc<str>,
}

impl Statements {
    fn new<D: Dialect>(table: &TableName, sweep: String) -> Self {
        let t = D::quoted(table);
        let p = D::placeholder;
        // The key, at placeholders `from`, `from + 1` and `from + 2`.
        let key = crate::scoped_key::<D>;
        // A row its holder still holds: in progress, or sent (lease run out
        // or not: only the token says who holds it).
        let held = format!("status IN ({STATUS_IN_PROGRESS}, {STATUS_SENT})");
        // The key's row (bound from `at`) that the holder of the token bound
        // right after it still holds.
        let held_by = |at: usize| format!("{} AND token = {} AND {held}", key(at), p(at + 3));
        // An unexpired row holding an unknown outcome at the time bound at
        // `at` and `at + 1`: recorded as unknown, or sent by a holder whose
        // lease has run out. A sent row whose lease still runs is in flight.
        let unknown = |at: usize| {
            format!(
                "expires_at_ms > {} AND (status = {STATUS_UNKNOWN} OR (status = {STATUS_SENT} AND lease_expires_at_ms <= {}))",
                p(at),
                p(at + 1)
            )
        };
        let (least, greatest) = (D::LEAST, D::GREATEST);
        Self {
            lookup: format!("SELECT {ROW_COLUMNS} FROM {t} WHERE {}", key(1)).into(),
            // The first mark of a claim (in progress) sets the time, whatever
            // a row taken over from an expired key still carries; later marks
            // only move it earlier. `sent_at_ms` is assigned before `status`:
            // MySQL's assignments see the columns assigned before them.
            mark_sent: format!(
                "UPDATE {t} SET sent_at_ms = CASE WHEN status = {STATUS_IN_PROGRESS} THEN {} \
                 ELSE {least}(COALESCE(sent_at_ms, {}), {}) END, status = {STATUS_SENT} WHERE {}",
                p(1),
                p(2),
                p(3),
                held_by(4)
            )
            .into(),
            // The outcome keeps `sent_at_ms`: it still says when the request
            // may first have reached the other side.
            complete: format!(
                "UPDATE {t} SET status = {}, payload = {}, lease_expires_at_ms = NULL WHERE {}",
                p(1),
                p(2),
                held_by(3)
            )
            .into(),
            release: format!("DELETE FROM {t} WHERE {}", held_by(1)).into(),
            extend: format!(
                "UPDATE {t} SET lease_expires_at_ms = {}, expires_at_ms = {greatest}(expires_at_ms, {}) WHERE {}",
                p(1),
                p(2),
                held_by(3)
            )
            .into(),
            // An operator's or a reconciliation's answer: the expiry and the
            // sent mark are kept, and a sent claim's lease is cleared.
            resolve_record: format!(
                "UPDATE {t} SET status = {}, payload = {}, lease_expires_at_ms = NULL WHERE {} AND {}",
                p(1),
                p(2),
                key(3),
                unknown(6)
            )
            .into(),
            resolve_release: format!("DELETE FROM {t} WHERE {} AND {}", key(1), unknown(4)).into(),
            sweep: sweep.into(),
        }
    }
}

/// A key's row outside its claim on engine `D`, over one table: the lookup,
/// the lease holder's writes (each matched by the key, the holder's token
/// and a held status, so none means fenced), the resolution of an unknown
/// outcome and the sweep around the engine's own delete.
pub struct SqlKeyRows<D: Dialect> {
    pool: Pool<D::Db>,
    table: TableName,
    sql: Arc<Statements>,
    _dialect: PhantomData<fn() -> D>,
}

impl<D: Dialect> Clone for SqlKeyRows<D> {
    fn clone(&self) -> Self {
        Self {
            pool: self.pool.clone(),
            table: self.table.clone(),
            sql: Arc::clone(&self.sql),
            _dialect: PhantomData,
        }
    }
}

impl<D: Dialect> fmt::Debug for SqlKeyRows<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqlKeyRows")
            .field("engine", &D::NAME)
            .field("table", &self.table)
            .finish_non_exhaustive()
    }
}

/// A key's columns (`tenant, operation, idem_key`) as engine `D` types
/// them: text, or bytes where its text columns are binary.
pub fn key_args<'a, D: Dialect>(scope: &'a Scope, key: &'a IdempotencyKey) -> [Arg<'a>; 3] {
    let text = |s: &'a str| match D::TEXT {
        TextColumns::Binary => Arg::Bytes(s.as_bytes()),
        TextColumns::Text | TextColumns::FreeTextAsBytes => Arg::Text(s),
    };
    [
        text(scope.tenant().as_str()),
        text(scope.operation().as_str()),
        text(key.as_str()),
    ]
}

/// A claim's new row, in the order every engine's claim binds it:
/// `tenant, operation, idem_key, fingerprint, token, created_at_ms,
/// expires_at_ms, lease_expires_at_ms` (in progress, no payload).
pub fn claim_args<'a, D: Dialect>(req: &'a ClaimRequest<'a>, token: i64) -> impl Iterator<Item = Arg<'a>> {
    key_args::<D>(req.scope, req.key).into_iter().chain([
        Arg::Bytes(req.fingerprint.as_bytes()),
        Arg::Int(token),
        Arg::Int(req.now_ms),
        Arg::Int(req.expires_at_ms),
        Arg::OptInt(req.lease_expires_at_ms),
    ])
}

/// A completed row written whole at the record (where the claim wrote
/// nothing), in the order every engine binds it: `tenant, operation,
/// idem_key, fingerprint, status, token, payload, created_at_ms,
/// expires_at_ms`.
pub fn completed_args<'a, D: Dialect>(
    req: &'a ClaimRequest<'a>,
    record: &'a Record,
    token: i64,
) -> impl Iterator<Item = Arg<'a>> {
    key_args::<D>(req.scope, req.key).into_iter().chain([
        Arg::Bytes(req.fingerprint.as_bytes()),
        Arg::Int16(record.status.code()),
        Arg::Int(token),
        Arg::Bytes(&record.payload),
        Arg::Int(req.now_ms),
        Arg::Int(req.expires_at_ms),
    ])
}

/// `sql` with `args` bound in order, on engine `D`.
pub fn bound<'a, 'q, D: Dialect>(
    sql: impl sqlx::SqlSafeStr,
    args: impl IntoIterator<Item = Arg<'a>>,
) -> Statement<'q, D::Db> {
    args.into_iter().fold(sqlx::query(sql), D::Db::bind)
}

impl<D: Dialect> SqlKeyRows<D> {
    /// The rows of `table` on `pool`; `sweep` is the engine's statement
    /// deleting at most its second argument of the rows expired at its
    /// first, oldest first.
    pub fn new(pool: Pool<D::Db>, table: TableName, sweep: String) -> Self {
        let sql = Arc::new(Statements::new::<D>(&table, sweep));
        Self {
            pool,
            table,
            sql,
            _dialect: PhantomData,
        }
    }

    fn statement<'q>(sql: &Arc<str>, args: impl IntoIterator<Item = Arg<'q>>) -> Statement<'q, D::Db> {
        bound::<D>(AssertSqlSafe(Arc::clone(sql)), args)
    }

    fn lookup_statement<'q>(&self, scope: &'q Scope, key: &'q IdempotencyKey) -> Statement<'q, D::Db> {
        Self::statement(&self.sql.lookup, key_args::<D>(scope, key))
    }

    /// The key's row as it is now, with its sent mark.
    pub async fn get(&self, scope: &Scope, key: &IdempotencyKey) -> Result<Option<StoredRow>> {
        let row = D::Db::fetch_optional_pooled(self.lookup_statement(scope, key), &self.pool)
            .await
            .map_err(D::error)?;
        row.as_ref().map(stored::<D>).transpose()
    }

    /// The key's row as `conn` sees it (in its transaction, if it has one).
    pub async fn get_in(
        &self,
        conn: &mut <D::Db as Database>::Connection,
        scope: &Scope,
        key: &IdempotencyKey,
    ) -> Result<Option<StoredRow>> {
        let row = D::Db::fetch_optional(self.lookup_statement(scope, key), conn)
            .await
            .map_err(D::error)?;
        row.as_ref().map(stored::<D>).transpose()
    }

    /// Runs `statement` in autocommit: durable when this returns.
    async fn changed(&self, statement: Statement<'_, D::Db>) -> Result<u64> {
        let mut conn = self.pool.acquire().await.map_err(D::error)?;
        let done = D::Db::execute(statement, &mut conn).await.map_err(D::error)?;
        Ok(D::rows_affected(&done))
    }

    /// The holder's own row, in flight or sent, becomes sent; the earliest
    /// mark's time stays.
    pub async fn mark_sent(&self, lease: &Lease, now_ms: i64) -> Result<()> {
        let args = [Arg::Int(now_ms), Arg::Int(now_ms), Arg::Int(now_ms)]
            .into_iter()
            .chain(key_args::<D>(&lease.scope, &lease.key))
            .chain([Arg::Int(lease.token.0)]);
        let done = self.changed(Self::statement(&self.sql.mark_sent, args)).await?;
        lease.fenced_unless_one(done, "mark sent")
    }

    /// The holder's row takes its outcome.
    pub async fn complete(&self, lease: &Lease, record: &Record) -> Result<()> {
        let args = [Arg::Int16(record.status.code()), Arg::Bytes(&record.payload)]
            .into_iter()
            .chain(key_args::<D>(&lease.scope, &lease.key))
            .chain([Arg::Int(lease.token.0)]);
        let done = self.changed(Self::statement(&self.sql.complete, args)).await?;
        lease.fenced_unless_one(done, "complete")
    }

    /// The holder's row is deleted: the key is free again.
    pub async fn release(&self, lease: &Lease) -> Result<()> {
        let args = key_args::<D>(&lease.scope, &lease.key)
            .into_iter()
            .chain([Arg::Int(lease.token.0)]);
        let done = self.changed(Self::statement(&self.sql.release, args)).await?;
        lease.fenced_unless_one(done, "release")
    }

    /// The holder's lease runs to `lease_expires_at_ms`; the key lives at
    /// least as long.
    pub async fn extend(&self, lease: &Lease, lease_expires_at_ms: i64) -> Result<()> {
        let args = [Arg::Int(lease_expires_at_ms), Arg::Int(lease_expires_at_ms)]
            .into_iter()
            .chain(key_args::<D>(&lease.scope, &lease.key))
            .chain([Arg::Int(lease.token.0)]);
        let done = self.changed(Self::statement(&self.sql.extend, args)).await?;
        lease.fenced_unless_one(done, "extend")
    }

    /// A row holding an unknown outcome at `now_ms` takes `resolution`, or
    /// is deleted without one; whether there was such a row.
    pub async fn resolve_unknown(&self, req: &Resolution<'_>) -> Result<bool> {
        let (sql, outcome) = match req.record {
            Some(record) => (
                &self.sql.resolve_record,
                Some([Arg::Int16(record.status.code()), Arg::Bytes(&record.payload)]),
            ),
            None => (&self.sql.resolve_release, None),
        };
        let args = outcome
            .into_iter()
            .flatten()
            .chain(key_args::<D>(req.scope, req.key))
            .chain([Arg::Int(req.now_ms), Arg::Int(req.now_ms)]);
        Ok(self.changed(Self::statement(sql, args)).await? == 1)
    }

    /// Deletes at most `limit` rows expired at `now_ms`; how many.
    pub async fn sweep_expired(&self, now_ms: i64, limit: u32) -> Result<u64> {
        let args = [Arg::Int(now_ms), Arg::Int(i64::from(limit))];
        let deleted = self.changed(Self::statement(&self.sql.sweep, args)).await?;
        tracing::debug!(
            engine = D::NAME,
            table = self.table.as_str(),
            deleted,
            limit,
            "swept expired keys"
        );
        Ok(deleted)
    }
}

/// A key's row from a row of engine `D` with the columns `fingerprint,
/// status, token, payload, lease_expires_at_ms, expires_at_ms` (by name,
/// wherever they stand), without its sent mark.
pub fn decode_row<D: Dialect>(row: &<D::Db as Database>::Row) -> Result<StoredRow> {
    let e = D::error;
    let fingerprint = D::Db::bytes(row, "fingerprint").map_err(e)?;
    StoredRow::from_columns(
        &fingerprint,
        D::Db::int16(row, "status").map_err(e)?,
        D::Db::int(row, "token").map_err(e)?,
        D::Db::opt_bytes(row, "payload").map_err(e)?,
        D::Db::opt_int(row, "lease_expires_at_ms").map_err(e)?,
        D::Db::int(row, "expires_at_ms").map_err(e)?,
    )
}

/// A key's row read with [`ROW_COLUMNS`].
fn stored<D: Dialect>(row: &<D::Db as Database>::Row) -> Result<StoredRow> {
    let sent_at_ms = D::Db::opt_int(row, "sent_at_ms").map_err(D::error)?;
    Ok(decode_row::<D>(row)?.with_sent_at_ms(sent_at_ms))
}

/// The lease holder's writes and the resolution of an unknown outcome of a
/// [`LeaseStore`](idem_core::LeaseStore) impl, given by the store's field of
/// type [`SqlKeyRows`] (written inside the `impl` block).
#[macro_export]
macro_rules! lease_writes {
    ($rows:ident) => {
        $crate::lease_writes!(@holder $rows, mark_sent(now_ms: i64));
        $crate::lease_writes!(@holder $rows, complete(record: &'a ::idem_core::Record));
        $crate::lease_writes!(@holder $rows, release());
        $crate::lease_writes!(@holder $rows, extend(lease_expires_at_ms: i64));

        fn lookup<'a>(
            &'a self,
            scope: &'a ::idem_core::Scope,
            key: &'a ::idem_core::IdempotencyKey,
        ) -> ::idem_core::BoxFuture<'a, ::idem_core::Result<Option<::idem_core::StoredRow>>> {
            ::std::boxed::Box::pin(self.$rows.get(scope, key))
        }

        fn resolve_unknown<'a>(
            &'a self,
            req: &'a ::idem_core::Resolution<'a>,
        ) -> ::idem_core::BoxFuture<'a, ::idem_core::Result<bool>> {
            ::std::boxed::Box::pin(self.$rows.resolve_unknown(req))
        }
    };
    // One write of the lease holder: the lease, then the write's own
    // arguments, passed on to the method of the same name of `$rows`.
    (@holder $rows:ident, $write:ident($($arg:ident: $ty:ty),*)) => {
        fn $write<'a>(
            &'a self,
            lease: &'a ::idem_core::Lease,
            $($arg: $ty),*
        ) -> ::idem_core::BoxFuture<'a, ::idem_core::Result<()>> {
            ::std::boxed::Box::pin(self.$rows.$write(lease, $($arg),*))
        }
    };
}

/// The [`Sweep`](idem_core::Sweep) impl of the keys store `$store`: its
/// field `$rows` of type [`SqlKeyRows`] deletes the expired rows, by the
/// engine's own sweep statement.
#[macro_export]
macro_rules! key_sweep {
    ($(#[$doc:meta])* $store:ty, $rows:ident) => {
        $(#[$doc])*
        impl ::idem_core::Sweep for $store {
            fn sweep_expired(&self, now_ms: i64, limit: u32) -> ::idem_core::BoxFuture<'_, ::idem_core::Result<u64>> {
                ::std::boxed::Box::pin(self.$rows.sweep_expired(now_ms, limit))
            }
        }
    };
}

/// The `commit` and `rollback` of a [`TxBackend`](idem_core::TxBackend)
/// impl whose transaction type ends itself (its own `commit` and
/// `rollback`), and its `read_committed` (the store's own `get`, one
/// statement on the pool), written inside the `impl` block.
#[macro_export]
macro_rules! tx_ends {
    () => {
        fn commit(&self, tx: Self::Tx) -> ::idem_core::BoxFuture<'_, ::idem_core::Result<()>> {
            ::std::boxed::Box::pin(tx.commit())
        }

        fn rollback(&self, tx: Self::Tx) -> ::idem_core::BoxFuture<'_, ::idem_core::Result<()>> {
            ::std::boxed::Box::pin(tx.rollback())
        }

        fn read_committed<'a>(
            &'a self,
            scope: &'a ::idem_core::Scope,
            key: &'a ::idem_core::IdempotencyKey,
        ) -> ::std::option::Option<
            ::idem_core::BoxFuture<'a, ::idem_core::Result<::std::option::Option<::idem_core::StoredRow>>>,
        > {
            ::std::option::Option::Some(::std::boxed::Box::pin(self.get(scope, key)))
        }
    };
}

/// The `read_then_claim` of a [`TxBackend`](idem_core::TxBackend) impl
/// whose store has a pool (`self.pool`), its key rows (`self.rows`, an
/// [`SqlKeyRows`](crate::SqlKeyRows)) and a `begin_claim_on(conn, req,
/// wait)` that claims on a connection of that pool: the read and the claim
/// on one connection, so a fresh call pays the read's statement and no
/// other checkout of the pool. `$error` maps the pool's error.
#[macro_export]
macro_rules! read_then_claim_on_one_connection {
    ($error:path) => {
        fn read_then_claim<'a>(
            &'a self,
            req: &'a ::idem_core::ClaimRequest<'a>,
            wait: ::std::time::Duration,
        ) -> ::idem_core::BoxFuture<'a, ::idem_core::Result<::idem_core::ReadFirst<Self::Tx>>> {
            ::std::boxed::Box::pin(async move {
                let mut conn = self.pool.acquire().await.map_err($error)?;
                if let ::std::option::Option::Some(row) = self.rows.get_in(&mut conn, req.scope, req.key).await?
                    && row.is_recorded_at(req.now_ms)
                {
                    return ::std::result::Result::Ok(::idem_core::ReadFirst::Recorded(row));
                }
                let (tx, claim) = self.begin_claim_on(conn, req, wait).await?;
                ::std::result::Result::Ok(::idem_core::ReadFirst::Claim(tx, claim))
            })
        }
    };
}

/// Checks the count of transactions sqlx keeps on a claimed transaction's
/// connection (`depth`, from `TransactionManager::get_transaction_depth`)
/// before a record or a commit: it must be 1, the claim's own.
///
/// - More: a nested transaction (a savepoint) begun in the caller's code
///   was never ended, and a `COMMIT` would end only that level.
/// - None: sqlx has rolled the claim's transaction back under it, as it
///   does when a nested `begin` fails or is cancelled; a write sent now
///   would commit on its own, without the claim.
///
/// Either way nothing of the claim may be committed.
pub fn check_claim_depth(depth: usize) -> Result<()> {
    match depth {
        1 => Ok(()),
        0 => Err(Error::Config(
            "the claim's transaction was rolled back under it (sqlx rolls back the enclosing transaction \
             when a nested begin fails or is cancelled); nothing of the claim was committed"
                .into(),
        )),
        _ => Err(Error::Config(
            "a nested transaction begun on the claim's connection was never ended; nothing was committed".into(),
        )),
    }
}

/// The error of a record on a transaction that holds no claim of the
/// record's key (the engines' record statements update or insert exactly
/// the claimed row, or answer this).
pub fn unclaimed_record() -> Error {
    Error::Config("record called on a transaction that holds no claim of this key".into())
}

/// Runs `record`, the statement that writes the outcome on the row the
/// claim of the transaction on `conn` wrote: it changes exactly that row,
/// or the transaction holds no claim of the key ([`unclaimed_record`]).
pub async fn record_claimed<D: Dialect>(
    record: Statement<'_, D::Db>,
    conn: &mut <D::Db as Database>::Connection,
) -> Result<()> {
    let done = D::Db::execute(record, conn).await.map_err(D::error)?;
    if D::rows_affected(&done) != 1 {
        return Err(unclaimed_record());
    }
    Ok(())
}
