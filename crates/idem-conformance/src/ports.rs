//! Free loopback ports for servers that tests start in other processes.

use std::net::TcpListener;
use std::sync::atomic::{AtomicU32, Ordering};

/// The lowest port handed out.
const FIRST: u32 = 15_000;

/// The first port of the kernel's ephemeral range on Linux (where every
/// `bind(…:0)` and every outgoing connection takes its port).
const EPHEMERAL: u32 = 32_768;

/// A free loopback port for a server a test starts in another process,
/// which binds it itself. It is taken below the kernel's ephemeral range,
/// where no other test's `bind(…:0)` and no outgoing connection can land,
/// so between its choice and its use only another caller of this function
/// could take it, and each process walks the range from its own point.
pub fn free_port() -> u16 {
    free_port_beside(0)
}

/// [`free_port`], where `port + offset` is free as well (a Redis Cluster
/// node's bus port, for one).
pub fn free_port_beside(offset: u16) -> u16 {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let span = EPHEMERAL - FIRST - u32::from(offset);
    let start = std::process::id().wrapping_mul(2_654_435_761) % span;
    for _ in 0..span {
        let port = FIRST + (start + NEXT.fetch_add(7_919, Ordering::Relaxed)) % span;
        let free = |p: u32| TcpListener::bind(("127.0.0.1", p as u16)).is_ok();
        if free(port) && (offset == 0 || free(port + u32::from(offset))) {
            return port as u16;
        }
    }
    panic!("no free loopback port below {EPHEMERAL}");
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Ports come from below the ephemeral range, free, and differ from call to call.
    #[test]
    fn ports_are_free_below_the_ephemeral_range() {
        let ports: Vec<u16> = (0..50).map(|_| free_port()).collect();
        for &p in &ports {
            assert!((FIRST..EPHEMERAL).contains(&u32::from(p)), "{p}");
        }
        let distinct: std::collections::HashSet<u16> = ports.iter().copied().collect();
        assert_eq!(distinct.len(), ports.len());
        let held = TcpListener::bind(("127.0.0.1", ports[0])).unwrap();
        let beside = free_port_beside(10_000);
        assert!(u32::from(beside) + 10_000 < EPHEMERAL);
        assert!(TcpListener::bind(("127.0.0.1", beside + 10_000)).is_ok());
        drop(held);
    }
}
