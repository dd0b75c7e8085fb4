//! The identity answers' cache: per credential digest, bounded in time and
//! in size.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::time::Duration;

use idem_core::Tenant;

/// Identity answers per credential digest, for a bounded time, at most a
/// bounded number (the oldest answer goes first).
pub(super) struct Cache {
    ttl: Duration,
    max: usize,
    inner: Mutex<CacheInner>,
}

#[derive(Default)]
struct CacheInner {
    /// The answer, until when it holds, and the number of its insertion.
    entries: HashMap<[u8; 32], (Tenant, tokio::time::Instant, u64)>,
    /// Insertions, oldest first.
    order: VecDeque<([u8; 32], u64)>,
    inserted: u64,
}

impl Cache {
    pub(super) fn new(ttl: Duration, max: usize) -> Self {
        Self {
            ttl,
            max: max.max(1),
            inner: Mutex::default(),
        }
    }

    pub(super) fn get(&self, digest: &[u8; 32]) -> Option<Tenant> {
        let now = tokio::time::Instant::now();
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        match inner.entries.get(digest) {
            Some((tenant, until, _)) if *until > now => Some(tenant.clone()),
            Some(_) => {
                inner.entries.remove(digest);
                None
            }
            None => None,
        }
    }

    pub(super) fn insert(&self, digest: [u8; 32], tenant: Tenant) {
        let until = tokio::time::Instant::now() + self.ttl;
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let CacheInner {
            entries,
            order,
            inserted,
        } = &mut *inner;
        *inserted += 1;
        entries.insert(digest, (tenant, until, *inserted));
        order.push_back((digest, *inserted));
        let live = |entries: &HashMap<[u8; 32], (Tenant, tokio::time::Instant, u64)>, d: &[u8; 32], n: u64| {
            entries.get(d).is_some_and(|(_, _, m)| *m == n)
        };
        while entries.len() > self.max {
            let Some((old, n)) = order.pop_front() else { break };
            if live(entries, &old, n) {
                entries.remove(&old);
            }
        }
        // An answer inserted again leaves its older insertion in the queue;
        // those are dropped once they outnumber the answers.
        if order.len() > 2 * self.max {
            order.retain(|(d, n)| live(entries, d, *n));
        }
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.inner.lock().unwrap().entries.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The cache forgets answers after its time and keeps at most its size, the oldest going first.
    #[tokio::test(start_paused = true)]
    async fn the_cache_is_bounded_in_time_and_size() {
        let cache = Cache::new(Duration::from_secs(60), 2);
        let t = |n: &str| Tenant::new(n).unwrap();
        cache.insert([1; 32], t("a"));
        cache.insert([2; 32], t("b"));
        assert_eq!(cache.get(&[1; 32]), Some(t("a")));
        cache.insert([3; 32], t("c"));
        assert_eq!(cache.len(), 2);
        assert_eq!(cache.get(&[1; 32]), None, "the oldest went first");
        for _ in 0..100 {
            cache.insert([2; 32], t("b"));
        }
        assert_eq!(cache.len(), 2);
        assert_eq!(cache.get(&[3; 32]), Some(t("c")));
        tokio::time::advance(Duration::from_secs(61)).await;
        assert_eq!(cache.get(&[2; 32]), None, "expired");
    }
}
