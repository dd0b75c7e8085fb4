//! A local round-robin balancer over several instances of one service (the
//! ledger's servers, or `idem gateway` processes).
//!
//! Each new connection goes to the next instance in turn; an instance that
//! refuses the connection (killed, not yet restarted) is passed over for the
//! one after it, so a dead instance costs a connection attempt, not a
//! request. A request already in flight on an instance that is then killed
//! is lost with its connection, as a real balancer loses it: the client
//! sees the connection close and retries with its key. A paused instance
//! (SIGSTOP) still accepts connections in its kernel backlog, so a request
//! sent to it waits, as it would behind a balancer that has not yet marked
//! it down.
//!
//! The balancer does not forward bytes itself: the fault proxy
//! ([`crate::proxy::Proxy`]) asks it for a connection to an instance and
//! then applies the connection's fate (with no faults, a plain
//! pass-through).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use serde::Serialize;
use tokio::net::TcpStream;

/// Round-robin over `upstreams`, with counts per instance.
#[derive(Debug)]
pub struct Balancer {
    upstreams: Vec<SocketAddr>,
    next: AtomicUsize,
    served: Vec<AtomicU64>,
    refused: Vec<AtomicU64>,
    none_up: AtomicU64,
}

/// What the balancer did, per instance and in all.
#[derive(Debug, Clone, Default, Serialize)]
pub struct BalancerCounts {
    /// Connections forwarded to each instance (each client request uses a
    /// connection of its own, so these are requests).
    pub served: Vec<u64>,
    /// Connections each instance refused (it was down), passed on to the
    /// next instance.
    pub refused: Vec<u64>,
    /// Connections no instance accepted (every one was down): closed at
    /// once, and the client retried.
    pub none_up: u64,
}

impl Balancer {
    /// A balancer over `upstreams` (at least one), the first connection to
    /// the first instance.
    pub fn new(upstreams: Vec<SocketAddr>) -> Arc<Self> {
        assert!(!upstreams.is_empty(), "a balancer needs an instance");
        let n = upstreams.len();
        Arc::new(Self {
            upstreams,
            next: AtomicUsize::new(0),
            served: (0..n).map(|_| AtomicU64::new(0)).collect(),
            refused: (0..n).map(|_| AtomicU64::new(0)).collect(),
            none_up: AtomicU64::new(0),
        })
    }

    /// How many instances it balances.
    pub fn len(&self) -> usize {
        self.upstreams.len()
    }

    /// Whether it balances no instance (never: [`Balancer::new`] needs one).
    pub fn is_empty(&self) -> bool {
        self.upstreams.is_empty()
    }

    /// A connection to the next instance that accepts one, and its index;
    /// `None` when every instance refused.
    pub async fn connect(&self) -> Option<(usize, TcpStream)> {
        let n = self.upstreams.len();
        let first = self.next.fetch_add(1, Ordering::Relaxed) % n;
        for k in 0..n {
            let i = (first + k) % n;
            match TcpStream::connect(self.upstreams[i]).await {
                Ok(stream) => {
                    self.served[i].fetch_add(1, Ordering::Relaxed);
                    return Some((i, stream));
                }
                Err(_) => {
                    self.refused[i].fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        self.none_up.fetch_add(1, Ordering::Relaxed);
        None
    }

    /// What it did so far.
    pub fn counts(&self) -> BalancerCounts {
        let read = |v: &[AtomicU64]| v.iter().map(|c| c.load(Ordering::Relaxed)).collect();
        BalancerCounts {
            served: read(&self.served),
            refused: read(&self.refused),
            none_up: self.none_up.load(Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Connections go round the instances in turn, and a dead one's turn
    /// passes to the next instance that accepts.
    #[tokio::test]
    async fn round_robin_passes_over_a_dead_instance() {
        let a = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let b = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        // A port nothing listens on: bound, then closed.
        let dead = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap()
        };
        let balancer = Balancer::new(vec![a.local_addr().unwrap(), dead, b.local_addr().unwrap()]);
        let mut picked = Vec::new();
        for _ in 0..6 {
            let (i, _stream) = balancer.connect().await.expect("an instance is up");
            picked.push(i);
        }
        // Turns 0, 1 (dead: passed to 2), 2, 0, 1 (→ 2), 2.
        assert_eq!(picked, vec![0, 2, 2, 0, 2, 2]);
        let counts = balancer.counts();
        assert_eq!(counts.served, vec![2, 0, 4]);
        assert_eq!(counts.refused, vec![0, 2, 0]);
        assert_eq!(counts.none_up, 0);
        drop((a, b));
    }
}
