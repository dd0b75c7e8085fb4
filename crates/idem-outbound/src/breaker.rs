//! The per-host circuit breaker.
//!
//! A small state machine rather than `recloser`: recloser keeps time with
//! `std::time::Instant` (so the open period cannot run on tokio's paused
//! clock), does not expose its state (no gauge, no "retry in" for the
//! caller), and in half-open admits every caller that arrives until its ring
//! buffer fills — even with a buffer of one, every caller that sees the open
//! period expired is let through. A permit wrapped around it cannot tell
//! when half-open starts, so it cannot hold that to one probe. The rules
//! here fit in one mutex-guarded `match`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::time::Instant;

use crate::config::BreakerConfig;

/// Where a host's breaker stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BreakerState {
    /// Attempts go through; consecutive failures are counted.
    Closed,
    /// Attempts are refused without being sent until the open period ends;
    /// the first attempt after it becomes the probe.
    Open,
    /// One probe is in flight (or about to be): every other attempt is
    /// refused; the probe's success closes the breaker, its failure opens it
    /// again.
    HalfOpen,
}

impl BreakerState {
    /// `closed`, `open` or `half_open` (metric labels).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Closed => "closed",
            Self::Open => "open",
            Self::HalfOpen => "half_open",
        }
    }

    /// 0 closed, 1 half-open, 2 open (the state gauge).
    pub(crate) fn gauge(self) -> f64 {
        match self {
            Self::Closed => 0.0,
            Self::HalfOpen => 1.0,
            Self::Open => 2.0,
        }
    }
}

#[derive(Debug, Clone, Copy)]
enum State {
    Closed,
    Open { until: Instant },
    HalfOpen { probing: bool },
}

impl State {
    fn public(self) -> BreakerState {
        match self {
            State::Closed => BreakerState::Closed,
            State::Open { .. } => BreakerState::Open,
            State::HalfOpen { .. } => BreakerState::HalfOpen,
        }
    }
}

#[derive(Debug)]
struct Entry {
    state: State,
    failures: u32,
    /// Changes with every transition (unique across hosts and entries), so
    /// an outcome that arrives after the state moved on is ignored.
    generation: u64,
    last_used: Instant,
}

type OnTransition = Box<dyn Fn(&str, BreakerState) + Send + Sync>;

struct Inner {
    config: BreakerConfig,
    hosts: Mutex<Hosts>,
    on_transition: OnTransition,
}

#[derive(Default)]
struct Hosts {
    entries: HashMap<Arc<str>, Entry>,
    next_generation: u64,
}

impl Hosts {
    fn generation(&mut self) -> u64 {
        self.next_generation += 1;
        self.next_generation
    }
}

/// The breakers of every host a client calls.
#[derive(Clone)]
pub(crate) struct Breakers {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Breakers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Breakers")
            .field("config", &self.inner.config)
            .field("hosts", &self.lock().entries.len())
            .finish()
    }
}

/// Whether an attempt may be sent.
#[derive(Debug)]
pub(crate) enum Admission {
    /// Send it, then report the outcome on the permit.
    Allowed(Permit),
    /// Do not send it. `retry_in`: until the open period ends (zero while a
    /// probe is in flight).
    Refused { state: BreakerState, retry_in: Duration },
}

/// The right to send one attempt. Dropped without an outcome (the call was
/// cancelled), a probe gives its place to the next caller.
#[derive(Debug)]
pub(crate) struct Permit {
    breakers: Breakers,
    host: Arc<str>,
    generation: u64,
    probe: bool,
    done: bool,
}

impl Permit {
    /// Reports the attempt: `healthy` when the host answered in a way that
    /// says it works (a success or a final rejection).
    pub(crate) fn finish(mut self, healthy: bool) {
        self.done = true;
        self.breakers.finish(&self.host, self.generation, healthy);
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        if !self.done && self.probe {
            self.breakers.abandon(&self.host, self.generation);
        }
    }
}

impl Breakers {
    pub(crate) fn new(config: BreakerConfig, on_transition: OnTransition) -> Self {
        Self {
            inner: Arc::new(Inner {
                config,
                hosts: Mutex::new(Hosts::default()),
                on_transition,
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Hosts> {
        self.inner.hosts.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The state of `host`'s breaker (closed when it has none). An open
    /// breaker whose period has ended turns half-open at its next attempt.
    pub(crate) fn state(&self, host: &str) -> BreakerState {
        self.lock()
            .entries
            .get(host)
            .map_or(BreakerState::Closed, |e| e.state.public())
    }

    /// Asks to send one attempt to `host`.
    pub(crate) fn admit(&self, host: &Arc<str>) -> Admission {
        let now = Instant::now();
        let mut hosts = self.lock();
        if !hosts.entries.contains_key(&**host) {
            self.make_room(&mut hosts);
            let generation = hosts.generation();
            hosts.entries.insert(
                host.clone(),
                Entry {
                    state: State::Closed,
                    failures: 0,
                    generation,
                    last_used: now,
                },
            );
        }
        let generation = hosts.generation();
        let entry = hosts.entries.get_mut(&**host).expect("inserted above");
        entry.last_used = now;
        let permit = |generation, probe| Permit {
            breakers: self.clone(),
            host: host.clone(),
            generation,
            probe,
            done: false,
        };
        match entry.state {
            State::Closed => Admission::Allowed(permit(entry.generation, false)),
            State::Open { until } if now < until => Admission::Refused {
                state: BreakerState::Open,
                retry_in: until - now,
            },
            State::HalfOpen { probing: true } => Admission::Refused {
                state: BreakerState::HalfOpen,
                retry_in: Duration::ZERO,
            },
            State::Open { .. } | State::HalfOpen { probing: false } => {
                let was_open = matches!(entry.state, State::Open { .. });
                entry.state = State::HalfOpen { probing: true };
                entry.generation = generation;
                drop(hosts);
                if was_open {
                    (self.inner.on_transition)(host, BreakerState::HalfOpen);
                }
                Admission::Allowed(permit(generation, true))
            }
        }
    }

    fn finish(&self, host: &str, generation: u64, healthy: bool) {
        let mut hosts = self.lock();
        let next = hosts.generation();
        let threshold = self.inner.config.failure_threshold;
        let Some(entry) = hosts.entries.get_mut(host).filter(|e| e.generation == generation) else {
            return;
        };
        let to = match (entry.state, healthy) {
            (State::Closed, true) => {
                entry.failures = 0;
                None
            }
            (State::Closed, false) => {
                entry.failures = entry.failures.saturating_add(1);
                (entry.failures >= threshold).then_some(BreakerState::Open)
            }
            (State::HalfOpen { .. }, true) => Some(BreakerState::Closed),
            (State::HalfOpen { .. }, false) => Some(BreakerState::Open),
            // No permit is issued while open.
            (State::Open { .. }, _) => None,
        };
        let Some(to) = to else { return };
        entry.generation = next;
        entry.failures = 0;
        entry.state = match to {
            BreakerState::Open => State::Open {
                until: crate::client::instant_after(self.inner.config.open_for),
            },
            _ => State::Closed,
        };
        drop(hosts);
        (self.inner.on_transition)(host, to);
    }

    fn abandon(&self, host: &str, generation: u64) {
        let mut hosts = self.lock();
        if let Some(entry) = hosts.entries.get_mut(host)
            && entry.generation == generation
            && matches!(entry.state, State::HalfOpen { probing: true })
        {
            entry.state = State::HalfOpen { probing: false };
        }
    }

    /// Keeps the map under `max_hosts`: healthy entries carry nothing worth
    /// keeping and go first, then the least recently used.
    fn make_room(&self, hosts: &mut Hosts) {
        let max = self.inner.config.max_hosts;
        if hosts.entries.len() < max {
            return;
        }
        hosts
            .entries
            .retain(|_, e| !(matches!(e.state, State::Closed) && e.failures == 0));
        while hosts.entries.len() >= max {
            let Some(oldest) = hosts
                .entries
                .iter()
                .min_by_key(|(_, e)| e.last_used)
                .map(|(h, _)| h.clone())
            else {
                break;
            };
            hosts.entries.remove(&oldest);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    type Seen = Arc<Mutex<Vec<(String, BreakerState)>>>;

    fn breakers(threshold: u32, open_ms: u64) -> (Breakers, Seen) {
        breakers_open_for(threshold, Duration::from_millis(open_ms))
    }

    fn breakers_open_for(threshold: u32, open_for: Duration) -> (Breakers, Seen) {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let log = seen.clone();
        let b = Breakers::new(
            BreakerConfig {
                failure_threshold: threshold,
                open_for,
                max_hosts: 3,
            },
            Box::new(move |h, s| log.lock().unwrap().push((h.to_owned(), s))),
        );
        (b, seen)
    }

    fn allowed(a: Admission) -> Permit {
        match a {
            Admission::Allowed(p) => p,
            Admission::Refused { state, .. } => panic!("refused ({state:?})"),
        }
    }

    fn refused(a: Admission) -> (BreakerState, Duration) {
        match a {
            Admission::Refused { state, retry_in } => (state, retry_in),
            Admission::Allowed(_) => panic!("allowed"),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn opens_after_consecutive_failures_only() {
        let (b, seen) = breakers(3, 1000);
        let h: Arc<str> = "http://a:80".into();
        allowed(b.admit(&h)).finish(false);
        allowed(b.admit(&h)).finish(false);
        // A success in between resets the count.
        allowed(b.admit(&h)).finish(true);
        allowed(b.admit(&h)).finish(false);
        allowed(b.admit(&h)).finish(false);
        assert_eq!(b.state(&h), BreakerState::Closed);
        allowed(b.admit(&h)).finish(false);
        assert_eq!(b.state(&h), BreakerState::Open);
        let (state, retry_in) = refused(b.admit(&h));
        assert_eq!((state, retry_in), (BreakerState::Open, Duration::from_millis(1000)));
        tokio::time::advance(Duration::from_millis(400)).await;
        assert_eq!(refused(b.admit(&h)).1, Duration::from_millis(600));
        assert_eq!(*seen.lock().unwrap(), [("http://a:80".to_owned(), BreakerState::Open)]);
        // Other hosts are not affected.
        allowed(b.admit(&"http://b:80".into())).finish(true);
    }

    #[tokio::test(start_paused = true)]
    async fn an_open_period_beyond_any_instant_stays_open() {
        let (b, seen) = breakers_open_for(1, Duration::MAX);
        let h: Arc<str> = "http://a:80".into();
        allowed(b.admit(&h)).finish(false);
        assert_eq!(b.state(&h), BreakerState::Open);
        tokio::time::advance(Duration::from_secs(86_400)).await;
        assert_eq!(refused(b.admit(&h)).0, BreakerState::Open);
        allowed(b.admit(&"http://b:80".into())).finish(true);
        assert_eq!(*seen.lock().unwrap(), [("http://a:80".to_owned(), BreakerState::Open)]);
    }

    #[tokio::test(start_paused = true)]
    async fn half_open_admits_one_probe_at_a_time() {
        let (b, seen) = breakers(1, 1000);
        let h: Arc<str> = "http://a:80".into();
        allowed(b.admit(&h)).finish(false);
        tokio::time::advance(Duration::from_millis(1000)).await;
        let probe = allowed(b.admit(&h));
        for _ in 0..8 {
            assert_eq!(refused(b.admit(&h)), (BreakerState::HalfOpen, Duration::ZERO));
        }
        // The probe fails: open again for a full period.
        probe.finish(false);
        assert_eq!(refused(b.admit(&h)), (BreakerState::Open, Duration::from_millis(1000)));
        tokio::time::advance(Duration::from_millis(1000)).await;
        let probe = allowed(b.admit(&h));
        assert_eq!(refused(b.admit(&h)).0, BreakerState::HalfOpen);
        probe.finish(true);
        assert_eq!(b.state(&h), BreakerState::Closed);
        allowed(b.admit(&h));
        allowed(b.admit(&h));
        use BreakerState::*;
        let states: Vec<_> = seen.lock().unwrap().iter().map(|(_, s)| *s).collect();
        assert_eq!(states, [Open, HalfOpen, Open, HalfOpen, Closed]);
    }

    #[tokio::test(start_paused = true)]
    async fn an_abandoned_probe_lets_the_next_caller_probe() {
        let (b, _) = breakers(1, 10);
        let h: Arc<str> = "http://a:80".into();
        allowed(b.admit(&h)).finish(false);
        tokio::time::advance(Duration::from_millis(10)).await;
        drop(allowed(b.admit(&h)));
        let probe = allowed(b.admit(&h));
        assert_eq!(refused(b.admit(&h)).0, BreakerState::HalfOpen);
        probe.finish(true);
        assert_eq!(b.state(&h), BreakerState::Closed);
    }

    #[tokio::test(start_paused = true)]
    async fn late_outcomes_of_an_earlier_state_are_ignored() {
        let (b, _) = breakers(2, 1000);
        let h: Arc<str> = "http://a:80".into();
        let slow = allowed(b.admit(&h));
        allowed(b.admit(&h)).finish(false);
        allowed(b.admit(&h)).finish(false);
        assert_eq!(b.state(&h), BreakerState::Open);
        // Admitted while closed, answered while open: changes nothing.
        slow.finish(true);
        assert_eq!(b.state(&h), BreakerState::Open);
    }

    #[tokio::test(start_paused = true)]
    async fn the_map_of_hosts_is_bounded() {
        let (b, _) = breakers(5, 1000);
        let failing: Arc<str> = "http://failing:80".into();
        allowed(b.admit(&failing)).finish(false);
        for i in 0..10 {
            tokio::time::advance(Duration::from_millis(1)).await;
            allowed(b.admit(&format!("http://h{i}:80").into())).finish(true);
        }
        let hosts = b.lock();
        assert!(hosts.entries.len() <= 3);
        // The host with failures outlived the healthy ones.
        assert!(hosts.entries.contains_key("http://failing:80"));
    }
}
