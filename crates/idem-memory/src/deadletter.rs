//! Dead letters of outbound calls, in memory.
//!
//! ```
//! use idem_core::{DeadLetterStore, IdempotencyKey, NewDeadLetter, OutboundRequest, Scope};
//! use idem_memory::MemoryDeadLetters;
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> idem_core::Result<()> {
//! let letters = MemoryDeadLetters::new();
//! let id = letters
//!     .record(&NewDeadLetter::new(
//!         Scope::parse("acme", "payout")?,
//!         IdempotencyKey::new("p-1")?,
//!         OutboundRequest::new("POST", "https://vendor.example/v1/payouts", vec![], b"{}".to_vec())?,
//!         5,
//!         "503 Service Unavailable",
//!     ))
//!     .await?;
//! let hold = letters.begin_redrive(id, 30_000).await?.expect("a dead letter can be taken");
//! assert!(letters.begin_redrive(id, 30_000).await?.is_none()); // held
//! # let _ = hold; Ok(()) }
//! ```

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use idem_core::{
    BoxFuture, DeadLetter, DeadLetterFilter, DeadLetterStore, Error, IdempotencyKey, NewDeadLetter, RedriveHold,
    RedriveOutcome, Result, Scope, Settlement, SharedClock, system_clock,
};

#[derive(Default)]
struct Letters {
    last_id: i64,
    rows: BTreeMap<i64, DeadLetter>,
    by_key: HashMap<(Scope, IdempotencyKey), i64>,
}

/// Dead letters kept in memory, on a clock that tests can set. Clones share
/// the same letters.
#[derive(Clone)]
pub struct MemoryDeadLetters {
    letters: Arc<Mutex<Letters>>,
    clock: SharedClock,
}

impl Default for MemoryDeadLetters {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for MemoryDeadLetters {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryDeadLetters")
            .field("letters", &self.len())
            .field("clock", &self.clock)
            .finish()
    }
}

impl MemoryDeadLetters {
    /// No dead letters, on the system clock.
    pub fn new() -> Self {
        Self {
            letters: Arc::default(),
            clock: system_clock(),
        }
    }

    /// Reads time from `clock` (a [`ManualClock`](idem_core::ManualClock) in
    /// tests) for timestamps, holds and purges.
    pub fn with_clock(mut self, clock: SharedClock) -> Self {
        self.clock = clock;
        self
    }

    /// The clock.
    pub fn clock(&self) -> &SharedClock {
        &self.clock
    }

    /// How many dead letters are kept, in every state.
    pub fn len(&self) -> usize {
        self.lock().rows.len()
    }

    /// Whether none is kept.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> MutexGuard<'_, Letters> {
        self.letters.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn now_ms(&self) -> i64 {
        self.clock.now_ms()
    }
}

impl MemoryDeadLetters {
    /// Applies `change` to letter `id` on the store's clock; `None` when it
    /// is missing.
    fn with_letter<T>(&self, id: i64, change: impl FnOnce(&mut DeadLetter, i64) -> T) -> Option<T> {
        let now = self.now_ms();
        let mut letters = self.lock();
        letters.rows.get_mut(&id).map(|row| change(row, now))
    }
}

impl DeadLetterStore for MemoryDeadLetters {
    fn record(&self, letter: &NewDeadLetter) -> BoxFuture<'_, Result<i64>> {
        let letter = letter.clone();
        Box::pin(async move {
            let now = self.now_ms();
            let mut guard = self.lock();
            let letters = &mut *guard;
            let slot = (letter.scope.clone(), letter.key.clone());
            if let Some(&id) = letters.by_key.get(&slot) {
                let row = letters
                    .rows
                    .get_mut(&id)
                    .ok_or_else(|| Error::Config(format!("dead letter {id} is indexed but missing")))?;
                row.on_record(&letter, now);
                return Ok(id);
            }
            letters.last_id += 1;
            let id = letters.last_id;
            let mut row = DeadLetter::created(&letter, now);
            row.id = id;
            letters.rows.insert(id, row);
            letters.by_key.insert(slot, id);
            Ok(id)
        })
    }

    fn list(&self, filter: &DeadLetterFilter) -> BoxFuture<'_, Result<Vec<DeadLetter>>> {
        let filter = filter.clone();
        Box::pin(async move {
            filter.check()?;
            let letters = self.lock();
            let from = filter.after_id.map_or(i64::MIN, |a| a.saturating_add(1));
            Ok(letters
                .rows
                .range(from..)
                .map(|(_, row)| row)
                .filter(|row| {
                    filter
                        .tenant
                        .as_deref()
                        .is_none_or(|t| row.scope.tenant().as_str() == t)
                })
                .filter(|row| {
                    filter
                        .operation
                        .as_deref()
                        .is_none_or(|o| row.scope.operation().as_str() == o)
                })
                .filter(|row| filter.state.is_none_or(|s| row.state == s))
                .take(filter.limit as usize)
                .cloned()
                .collect())
        })
    }

    fn get(&self, id: i64) -> BoxFuture<'_, Result<Option<DeadLetter>>> {
        Box::pin(async move { Ok(self.lock().rows.get(&id).cloned()) })
    }

    fn find(&self, scope: &Scope, key: &IdempotencyKey) -> BoxFuture<'_, Result<Option<DeadLetter>>> {
        let slot = (scope.clone(), key.clone());
        Box::pin(async move {
            let letters = self.lock();
            Ok(letters.by_key.get(&slot).and_then(|id| letters.rows.get(id)).cloned())
        })
    }

    fn begin_redrive(&self, id: i64, hold_ms: i64) -> BoxFuture<'_, Result<Option<RedriveHold>>> {
        Box::pin(async move {
            idem_core::redrive_hold_ms(hold_ms)?;
            let taken = self.with_letter(id, |row, now| row.take_hold(now, hold_ms));
            Ok(taken.transpose()?.flatten())
        })
    }

    fn retarget(&self, id: i64, token: u32, url: &str) -> BoxFuture<'_, Result<bool>> {
        let url = url.to_owned();
        Box::pin(async move {
            Ok(self
                .with_letter(id, |row, now| row.retarget(token, &url, now))
                .transpose()?
                .unwrap_or(false))
        })
    }

    fn finish_redrive(&self, id: i64, token: u32, outcome: &RedriveOutcome) -> BoxFuture<'_, Result<bool>> {
        let outcome = outcome.clone();
        Box::pin(async move { Ok(self.with_letter(id, |row, now| row.finish(token, &outcome, now)) == Some(true)) })
    }

    fn settle(&self, id: i64, settlement: &Settlement) -> BoxFuture<'_, Result<bool>> {
        let settlement = settlement.clone();
        Box::pin(async move { Ok(self.with_letter(id, |row, now| row.settle(&settlement, now)) == Some(true)) })
    }

    fn cancel(&self, id: i64) -> BoxFuture<'_, Result<bool>> {
        Box::pin(async move { Ok(self.with_letter(id, |row, now| row.cancel(now)) == Some(true)) })
    }

    fn purge_resolved(&self, older_than_ms: i64, limit: u32) -> BoxFuture<'_, Result<u64>> {
        Box::pin(async move {
            let cutoff = self.now_ms().saturating_sub(older_than_ms.max(0));
            let mut guard = self.lock();
            let letters = &mut *guard;
            let doomed: Vec<i64> = letters
                .rows
                .values()
                .filter(|row| row.state.is_final() && row.updated_at_ms < cutoff)
                .map(|row| row.id)
                .take(limit as usize)
                .collect();
            for id in &doomed {
                if let Some(row) = letters.rows.remove(id) {
                    letters.by_key.remove(&(row.scope, row.key));
                }
            }
            Ok(doomed.len() as u64)
        })
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use idem_core::{ManualClock, OutboundRequest};

    use super::*;

    fn letter(key: &str) -> NewDeadLetter {
        NewDeadLetter::new(
            Scope::parse("t", "payout").unwrap(),
            IdempotencyKey::new(key).unwrap(),
            OutboundRequest::new("POST", "http://vendor/v1/payouts", vec![], vec![1, 2]).unwrap(),
            3,
            "timeout",
        )
    }

    #[tokio::test]
    async fn the_hold_runs_out_on_the_clock_it_was_given() {
        // Proves the store decides holds and purges by its injected clock.
        let clock = ManualClock::new(1_000);
        let letters = MemoryDeadLetters::new().with_clock(std::sync::Arc::new(clock.clone()));
        let id = letters.record(&letter("a")).await.unwrap();
        let first = letters.begin_redrive(id, 500).await.unwrap().unwrap();
        assert_eq!(first.dead_letter.redrive_until_ms, Some(1_500));
        assert!(letters.begin_redrive(id, 500).await.unwrap().is_none());
        clock.advance(Duration::from_millis(500));
        let second = letters.begin_redrive(id, 500).await.unwrap().unwrap();
        assert!(second.token > first.token);
        let resolved = RedriveOutcome::Resolved {
            status: 200,
            body: b"ok".to_vec(),
            reconciled: false,
        };
        assert!(!letters.finish_redrive(id, first.token, &resolved).await.unwrap());
        assert!(letters.finish_redrive(id, second.token, &resolved).await.unwrap());
        assert_eq!(letters.purge_resolved(0, 10).await.unwrap(), 0, "not older than now");
        clock.advance(Duration::from_millis(10));
        assert_eq!(letters.purge_resolved(5, 10).await.unwrap(), 1);
        assert!(letters.is_empty());
        assert!(
            letters
                .find(&letter("a").scope, &letter("a").key)
                .await
                .unwrap()
                .is_none()
        );
    }
}
