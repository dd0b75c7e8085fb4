//! Dead letters of outbound calls: the vocabulary and the trait their stores
//! implement.
//!
//! An outbound call (a vendor payout) that used up its retries is kept in the
//! service's own database with everything needed to send it again: the
//! request, its idempotency key, the attempts and the last error. A redrive
//! sends the same request with the **same key**, so a vendor that did apply
//! it the first time answers with its recorded result instead of applying it
//! twice. The SQL lives in the store crates; the sending in `idem-outbound`.
//!
//! A dead letter is unique per (tenant, operation, key): recording the same
//! logical call again (a worker that crashed after recording it, a redrive
//! that failed) updates the one row, never adds a second.
//!
//! # Re-sends and the vendor's memory
//!
//! A vendor remembers an idempotency key only for a while (its *key
//! horizon*: 24 h at Stripe, 30 min at Qonto), and some vendors have no keys
//! at all. A dead letter therefore keeps **when the first send that may have
//! reached the vendor started** (`first_reached_at_ms`): a redrive within
//! the horizon may send blindly, one past it must first ask the vendor
//! (reconcile), and what cannot be established is held in state
//! [`Unknown`](DeadLetterState::Unknown) for an operator, never sent on a
//! guess. What the vendor or an operator said is kept as a
//! [`Reconciliation`].
//!
//! # States
//!
//! ```text
//!            record                 begin_redrive                 finish: Resolved
//!   (new) ─────────► dead ◄──────────────────────► redriving ───────────────────► resolved
//!                     │  ▲   finish: Failed            │
//!      settle: applied│  │settle: not applied          │finish: Unknown
//!       (to resolved) │  │                             ▼
//!                     │  └──────────────────────── unknown ◄── record (unknown)
//!                     └─► cancelled (only when reconciled "not applied")
//! ```
//!
//! The transitions are methods of [`DeadLetter`] (`on_record`, `take`,
//! `finish`, `settle`, `cancel`, `retarget`), pure functions of the row and
//! the store's clock; a store reads the row under a lock, applies one, and
//! writes the row back, so every engine makes the same decisions.

mod letter;
mod request;
mod row;
mod table;
#[cfg(test)]
mod tests;

pub use letter::*;
pub use request::*;
pub use row::*;
pub use table::{DeadLetterTable, RowAt, cancel_in, change_in, record_in};

use crate::error::{Error, Result};
use crate::key::IdempotencyKey;
use crate::scope::Scope;
use crate::store::BoxFuture;

/// Which dead letters to list, oldest first, in pages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeadLetterFilter {
    /// Only this tenant's.
    pub tenant: Option<String>,
    /// Only this operation's.
    pub operation: Option<String>,
    /// Only in this state.
    pub state: Option<DeadLetterState>,
    /// Only ids greater than this (the last id of the previous page).
    pub after_id: Option<i64>,
    /// At most this many (1..=1000).
    pub limit: u32,
}

impl Default for DeadLetterFilter {
    fn default() -> Self {
        Self {
            tenant: None,
            operation: None,
            state: None,
            after_id: None,
            limit: 100,
        }
    }
}

/// The most dead letters one listing answers.
pub const MAX_DEAD_LETTER_PAGE: u32 = 1000;

impl DeadLetterFilter {
    /// Refuses a page of no letters or of more than
    /// [`MAX_DEAD_LETTER_PAGE`].
    pub fn check(&self) -> Result<()> {
        if self.limit == 0 || self.limit > MAX_DEAD_LETTER_PAGE {
            return Err(Error::InvalidRequest(format!(
                "a dead-letter page holds 1 to {MAX_DEAD_LETTER_PAGE} letters, not {}",
                self.limit
            )));
        }
        Ok(())
    }
}

/// A dead letter taken for a redrive. `token` proves the hold: a redrive
/// whose hold ran out and was taken by another cannot finish it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedriveHold {
    /// The dead letter as taken.
    pub dead_letter: DeadLetter,
    /// The hold's token (the redrive count after taking it).
    pub token: u32,
    /// When the taken letter was still held by an earlier redrive whose
    /// hold has since run out: that redrive may have sent until then, so a
    /// vendor's "not applied" is trusted only once a send started then has
    /// settled. `None` when the letter was not being redriven.
    pub earlier_hold_until_ms: Option<i64>,
}

/// A store of dead letters. Store crates also offer recording inside the
/// caller's own transaction, so a business row and its dead letter commit
/// together. Each write reads the row under a lock, applies one of
/// [`DeadLetter`]'s transitions on the store's clock, and writes it back.
pub trait DeadLetterStore: Clone + Send + Sync + 'static {
    /// Records a dead letter, or updates the one of the same (tenant,
    /// operation, key) by [`DeadLetter::on_record`]. Answers its id.
    fn record(&self, letter: &NewDeadLetter) -> BoxFuture<'_, Result<i64>>;

    /// Lists dead letters by `filter`, by id ascending.
    fn list(&self, filter: &DeadLetterFilter) -> BoxFuture<'_, Result<Vec<DeadLetter>>>;

    /// One dead letter.
    fn get(&self, id: i64) -> BoxFuture<'_, Result<Option<DeadLetter>>>;

    /// The dead letter of (scope, key), if any.
    fn find(&self, scope: &Scope, key: &IdempotencyKey) -> BoxFuture<'_, Result<Option<DeadLetter>>>;

    /// Takes a dead letter for a redrive ([`DeadLetter::take`]) until
    /// `now + hold_ms` (the store's clock). `None` when it does not exist,
    /// is final, or another redrive holds it.
    fn begin_redrive(&self, id: i64, hold_ms: i64) -> BoxFuture<'_, Result<Option<RedriveHold>>>;

    /// Points a held letter at another URL ([`DeadLetter::retarget`]).
    /// False when the hold was lost.
    fn retarget(&self, id: i64, token: u32, url: &str) -> BoxFuture<'_, Result<bool>>;

    /// Ends a redrive with its outcome ([`DeadLetter::finish`]). Answers
    /// false (and changes nothing) when the hold was lost to another
    /// redrive.
    fn finish_redrive(&self, id: i64, token: u32, outcome: &RedriveOutcome) -> BoxFuture<'_, Result<bool>>;

    /// Records a verdict on a dead or unknown letter
    /// ([`DeadLetter::settle`]). False (nothing changed) when it is missing,
    /// held by a redrive, or final.
    fn settle(&self, id: i64, settlement: &Settlement) -> BoxFuture<'_, Result<bool>>;

    /// Cancels a dead letter known not to have been applied
    /// ([`DeadLetter::cancel`]). False (nothing changed) otherwise.
    fn cancel(&self, id: i64) -> BoxFuture<'_, Result<bool>>;

    /// Deletes at most `limit` final (resolved or cancelled) dead letters
    /// settled more than `older_than_ms` ago; answers how many.
    fn purge_resolved(&self, older_than_ms: i64, limit: u32) -> BoxFuture<'_, Result<u64>>;
}

/// Implements [`DeadLetterStore`] for an enum whose every variant holds one
/// store, each method answered by the store of the variant at hand: the shape
/// of a program that picks its engine at run time.
///
/// `dead_letters_of_each!(Letters { Postgres, Sqlite })` implements it for
/// `enum Letters { Postgres(PgDeadLetters), Sqlite(SqliteDeadLetters) }` (the
/// enum must be `Clone + Send + Sync + 'static`, as every store is).
#[macro_export]
macro_rules! dead_letters_of_each {
    ($enum:ident { $($variant:ident),+ $(,)? }) => {
        impl $crate::DeadLetterStore for $enum {
            fn record(&self, letter: &$crate::NewDeadLetter) -> $crate::BoxFuture<'_, $crate::Result<i64>> {
                match self { $(Self::$variant(s) => s.record(letter),)+ }
            }
            fn list(
                &self,
                filter: &$crate::DeadLetterFilter,
            ) -> $crate::BoxFuture<'_, $crate::Result<Vec<$crate::DeadLetter>>> {
                match self { $(Self::$variant(s) => s.list(filter),)+ }
            }
            fn get(&self, id: i64) -> $crate::BoxFuture<'_, $crate::Result<Option<$crate::DeadLetter>>> {
                match self { $(Self::$variant(s) => s.get(id),)+ }
            }
            fn find(
                &self,
                scope: &$crate::Scope,
                key: &$crate::IdempotencyKey,
            ) -> $crate::BoxFuture<'_, $crate::Result<Option<$crate::DeadLetter>>> {
                match self { $(Self::$variant(s) => s.find(scope, key),)+ }
            }
            fn begin_redrive(
                &self,
                id: i64,
                hold_ms: i64,
            ) -> $crate::BoxFuture<'_, $crate::Result<Option<$crate::RedriveHold>>> {
                match self { $(Self::$variant(s) => s.begin_redrive(id, hold_ms),)+ }
            }
            fn retarget(&self, id: i64, token: u32, url: &str) -> $crate::BoxFuture<'_, $crate::Result<bool>> {
                match self { $(Self::$variant(s) => s.retarget(id, token, url),)+ }
            }
            fn finish_redrive(
                &self,
                id: i64,
                token: u32,
                outcome: &$crate::RedriveOutcome,
            ) -> $crate::BoxFuture<'_, $crate::Result<bool>> {
                match self { $(Self::$variant(s) => s.finish_redrive(id, token, outcome),)+ }
            }
            fn settle(&self, id: i64, settlement: &$crate::Settlement) -> $crate::BoxFuture<'_, $crate::Result<bool>> {
                match self { $(Self::$variant(s) => s.settle(id, settlement),)+ }
            }
            fn cancel(&self, id: i64) -> $crate::BoxFuture<'_, $crate::Result<bool>> {
                match self { $(Self::$variant(s) => s.cancel(id),)+ }
            }
            fn purge_resolved(&self, older_than_ms: i64, limit: u32) -> $crate::BoxFuture<'_, $crate::Result<u64>> {
                match self { $(Self::$variant(s) => s.purge_resolved(older_than_ms, limit),)+ }
            }
        }
    };
}
