//! A dead-letter table of a SQL engine, and the store every such table is.
//!
//! What the SQL stores share is written here once: each write reads the row
//! under the transaction's lock with the database's clock, applies one of
//! [`DeadLetter`]'s transitions and writes the row back; a first record is
//! an insert that a concurrent twin's row turns into that same
//! read–transition–write. An engine gives only what differs: its
//! statements, how it binds and reads a [`DeadLetterRow`], how it begins a
//! transaction that locks what it reads (`FOR UPDATE` at READ COMMITTED, or
//! SQLite's `BEGIN IMMEDIATE`), and its error mapping. Every
//! [`DeadLetterTable`] is a [`DeadLetterStore`].

use std::ops::DerefMut;

use super::*;
use crate::error::StoreErrorKind;

/// Which row: by its id, or by its call.
#[derive(Debug, Clone, Copy)]
pub enum RowAt<'a> {
    /// The row with this id.
    Id(i64),
    /// The row of this call.
    Call(&'a Scope, &'a IdempotencyKey),
}

/// A dead-letter table of one SQL engine: the statements the shared logic
/// runs. Implement it and the table is a [`DeadLetterStore`].
pub trait DeadLetterTable: Clone + Send + Sync + 'static {
    /// The engine's connection (what a caller's own transaction lends).
    type Conn: Send;
    /// A transaction of the table's own, on a connection.
    type Tx: DerefMut<Target = Self::Conn> + Send;

    /// Begins a transaction in which [`lock`](Self::lock) holds what it
    /// reads until the end, and a writer waiting for a row re-reads it
    /// rather than failing to serialise.
    fn begin(&self) -> BoxFuture<'_, Result<Self::Tx>>;

    /// Commits `tx`.
    fn commit(tx: Self::Tx) -> BoxFuture<'static, Result<()>>;

    /// Rolls `tx` back.
    fn rollback(tx: Self::Tx) -> BoxFuture<'static, Result<()>>;

    /// The database's clock, in milliseconds since the epoch.
    fn now<'a>(&'a self, conn: &'a mut Self::Conn) -> BoxFuture<'a, Result<i64>>;

    /// Inserts `row` unless its call has a row; answers the new id, or
    /// `None` when the call's row was there (a twin's, committed or not).
    fn insert<'a>(&'a self, conn: &'a mut Self::Conn, row: &'a DeadLetterRow) -> BoxFuture<'a, Result<Option<i64>>>;

    /// Reads a row under the transaction's lock, with the database's clock.
    fn lock<'a>(
        &'a self,
        conn: &'a mut Self::Conn,
        at: RowAt<'a>,
    ) -> BoxFuture<'a, Result<Option<(DeadLetterRow, i64)>>>;

    /// Writes back every changing column of `row` (found by its id).
    fn update<'a>(&'a self, conn: &'a mut Self::Conn, row: &'a DeadLetterRow) -> BoxFuture<'a, Result<()>>;

    /// Reads a row, without a lock.
    fn read<'a>(&'a self, at: RowAt<'a>) -> BoxFuture<'a, Result<Option<DeadLetterRow>>>;

    /// The rows `filter` (already checked) selects, in id order.
    fn select<'a>(&'a self, filter: &'a DeadLetterFilter) -> BoxFuture<'a, Result<Vec<DeadLetterRow>>>;

    /// Deletes at most `limit` final letters settled more than
    /// `older_than_ms` ago (the database's clock); answers how many.
    fn purge_final(&self, older_than_ms: i64, limit: u32) -> BoxFuture<'_, Result<u64>>;
}

/// Records `letter` on `conn`, a transaction of the caller's or the
/// table's own (see [`DeadLetterStore::record`]); answers its id.
pub async fn record_in<T: DeadLetterTable>(table: &T, conn: &mut T::Conn, letter: &NewDeadLetter) -> Result<i64> {
    let now = table.now(conn).await?;
    let row = DeadLetterRow::of(&DeadLetter::created(letter, now))?;
    if let Some(id) = table.insert(conn, &row).await? {
        return Ok(id);
    }
    // A twin's row: wait for it, then record on it.
    let Some((found, now)) = table.lock(conn, RowAt::Call(&letter.scope, &letter.key)).await? else {
        return Err(Error::store(
            StoreErrorKind::Other,
            "a dead letter's row was there for its insert and gone when read",
        ));
    };
    let mut existing = found.decode()?;
    if existing.on_record(letter, now) {
        table.update(conn, &DeadLetterRow::of(&existing)?).await?;
    }
    Ok(existing.id)
}

/// Reads letter `id` under the lock on `conn`, applies `change` (which
/// answers `Some` when it changed the letter) and writes it back.
pub async fn change_in<T: DeadLetterTable, R>(
    table: &T,
    conn: &mut T::Conn,
    id: i64,
    change: impl FnOnce(&mut DeadLetter, i64) -> Result<Option<R>>,
) -> Result<Option<R>> {
    let Some((row, now)) = table.lock(conn, RowAt::Id(id)).await? else {
        return Ok(None);
    };
    let mut letter = row.decode()?;
    let out = change(&mut letter, now)?;
    if out.is_some() {
        table.update(conn, &DeadLetterRow::of(&letter)?).await?;
    }
    Ok(out)
}

/// Cancels letter `id` on `conn` if it is known not to have been applied
/// (see [`DeadLetterStore::cancel`]).
pub async fn cancel_in<T: DeadLetterTable>(table: &T, conn: &mut T::Conn, id: i64) -> Result<bool> {
    let cancelled = change_in(table, conn, id, |l, now| Ok(l.cancel(now).then_some(())));
    Ok(cancelled.await?.is_some())
}

/// [`change_in`] in a transaction of the table's own, committed only when
/// the letter changed.
async fn change<T: DeadLetterTable, R>(
    table: &T,
    id: i64,
    change: impl FnOnce(&mut DeadLetter, i64) -> Result<Option<R>>,
) -> Result<Option<R>> {
    let mut tx = table.begin().await?;
    let out = change_in(table, &mut tx, id, change).await?;
    if out.is_some() {
        T::commit(tx).await?;
    } else {
        T::rollback(tx).await?;
    }
    Ok(out)
}

impl<T: DeadLetterTable> DeadLetterStore for T {
    fn record(&self, letter: &NewDeadLetter) -> BoxFuture<'_, Result<i64>> {
        let letter = letter.clone();
        Box::pin(async move {
            let mut tx = self.begin().await?;
            let id = record_in(self, &mut tx, &letter).await?;
            T::commit(tx).await?;
            Ok(id)
        })
    }

    fn list(&self, filter: &DeadLetterFilter) -> BoxFuture<'_, Result<Vec<DeadLetter>>> {
        let filter = filter.clone();
        Box::pin(async move {
            filter.check()?;
            let rows = self.select(&filter).await?;
            rows.into_iter().map(DeadLetterRow::decode).collect()
        })
    }

    fn get(&self, id: i64) -> BoxFuture<'_, Result<Option<DeadLetter>>> {
        Box::pin(async move { self.read(RowAt::Id(id)).await?.map(DeadLetterRow::decode).transpose() })
    }

    fn find(&self, scope: &Scope, key: &IdempotencyKey) -> BoxFuture<'_, Result<Option<DeadLetter>>> {
        let (scope, key) = (scope.clone(), key.clone());
        Box::pin(async move {
            let row = self.read(RowAt::Call(&scope, &key)).await?;
            row.map(DeadLetterRow::decode).transpose()
        })
    }

    fn begin_redrive(&self, id: i64, hold_ms: i64) -> BoxFuture<'_, Result<Option<RedriveHold>>> {
        Box::pin(async move {
            redrive_hold_ms(hold_ms)?;
            change(self, id, |l, now| l.take_hold(now, hold_ms)).await
        })
    }

    fn retarget(&self, id: i64, token: u32, url: &str) -> BoxFuture<'_, Result<bool>> {
        let url = url.to_owned();
        Box::pin(async move {
            let changed = change(self, id, |l, now| Ok(l.retarget(token, &url, now)?.then_some(())));
            Ok(changed.await?.is_some())
        })
    }

    fn finish_redrive(&self, id: i64, token: u32, outcome: &RedriveOutcome) -> BoxFuture<'_, Result<bool>> {
        let outcome = outcome.clone();
        Box::pin(async move {
            let changed = change(self, id, |l, now| Ok(l.finish(token, &outcome, now).then_some(())));
            Ok(changed.await?.is_some())
        })
    }

    fn settle(&self, id: i64, settlement: &Settlement) -> BoxFuture<'_, Result<bool>> {
        let settlement = settlement.clone();
        Box::pin(async move {
            let changed = change(self, id, |l, now| Ok(l.settle(&settlement, now).then_some(())));
            Ok(changed.await?.is_some())
        })
    }

    fn cancel(&self, id: i64) -> BoxFuture<'_, Result<bool>> {
        Box::pin(async move {
            let changed = change(self, id, |l, now| Ok(l.cancel(now).then_some(())));
            Ok(changed.await?.is_some())
        })
    }

    fn purge_resolved(&self, older_than_ms: i64, limit: u32) -> BoxFuture<'_, Result<u64>> {
        Box::pin(async move { self.purge_final(older_than_ms.max(0), limit).await })
    }
}
