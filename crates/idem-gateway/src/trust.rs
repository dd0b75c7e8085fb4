//! Which peers are trusted proxies, and what the gateway knows of a peer.
//!
//! A header such as a tenant header or `X-Forwarded-For` is only as good as
//! whoever set it. The gateway believes such headers only from the peers
//! named in `trusted_proxies`; from anyone else a tenant header is refused
//! (403) and forwarding headers are replaced.

use std::net::{IpAddr, SocketAddr};

/// The address of the connection a request came on, as the serving loop
/// saw it. A request without one (served in-process) is from no trusted
/// proxy.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Peer(pub(crate) SocketAddr);

/// One address block: an address and a prefix length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Block {
    addr: IpAddr,
    prefix: u8,
}

impl Block {
    fn parse(raw: &str) -> Result<Self, String> {
        let (addr, prefix) = match raw.split_once('/') {
            Some((a, p)) => (a, Some(p)),
            None => (raw, None),
        };
        let addr: IpAddr = addr
            .trim()
            .parse()
            .map_err(|_| format!("{raw:?} is not an address or CIDR block (10.0.0.0/8, ::1)"))?;
        let addr = addr.to_canonical();
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let prefix = match prefix {
            None => max,
            Some(p) => p
                .trim()
                .parse::<u8>()
                .ok()
                .filter(|p| *p <= max)
                .ok_or_else(|| format!("{raw:?}: the prefix length must be 0 to {max}"))?,
        };
        Ok(Self { addr, prefix })
    }

    fn contains(&self, ip: IpAddr) -> bool {
        let masked = |bits: u128, width: u32| {
            let shift = width - u32::from(self.prefix);
            if shift >= 128 { 0 } else { bits >> shift }
        };
        match (self.addr, ip.to_canonical()) {
            (IpAddr::V4(a), IpAddr::V4(b)) => masked(u32::from(a).into(), 32) == masked(u32::from(b).into(), 32),
            (IpAddr::V6(a), IpAddr::V6(b)) => masked(u128::from(a), 128) == masked(u128::from(b), 128),
            _ => false,
        }
    }
}

/// The trusted proxies.
#[derive(Debug, Clone, Default)]
pub(crate) struct Trusted {
    blocks: Vec<Block>,
}

impl Trusted {
    /// Parses addresses and CIDR blocks.
    pub(crate) fn parse(entries: &[String]) -> Result<Self, String> {
        let blocks = entries.iter().map(|e| Block::parse(e)).collect::<Result<_, _>>()?;
        Ok(Self { blocks })
    }

    /// Whether a request from `peer` comes from a trusted proxy.
    pub(crate) fn trusts(&self, peer: Option<&Peer>) -> bool {
        peer.is_some_and(|p| self.blocks.iter().any(|b| b.contains(p.0.ip())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer(ip: &str) -> Peer {
        Peer(SocketAddr::new(ip.parse().unwrap(), 1234))
    }

    /// Blocks contain what they should, IPv4-mapped IPv6 peers included, and nothing else.
    #[test]
    fn blocks_contain_their_addresses() {
        let t = Trusted::parse(&["10.0.0.0/8".into(), "192.168.1.7".into(), "fd00::/8".into()]).unwrap();
        for ip in [
            "10.1.2.3",
            "10.255.255.255",
            "192.168.1.7",
            "::ffff:10.9.9.9",
            "fd12::1",
        ] {
            assert!(t.trusts(Some(&peer(ip))), "{ip}");
        }
        for ip in ["11.0.0.1", "192.168.1.8", "127.0.0.1", "fe80::1", "::1"] {
            assert!(!t.trusts(Some(&peer(ip))), "{ip}");
        }
        assert!(!t.trusts(None), "an unknown peer is not trusted");
        let all = Trusted::parse(&["0.0.0.0/0".into()]).unwrap();
        assert!(all.trusts(Some(&peer("8.8.8.8"))));
        assert!(!all.trusts(Some(&peer("::1"))));
        assert!(Trusted::parse(&["10.0.0.0/33".into()]).is_err());
        assert!(Trusted::parse(&["localhost".into()]).is_err());
    }
}
