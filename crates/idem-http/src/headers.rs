//! Which headers belong to one connection, and which to one caller.
//!
//! Hop-by-hop headers (RFC 9110 §7.6.1) describe one connection: a proxy
//! never forwards them and a recorded response never keeps them, so the
//! first answer and its replays carry the same end-to-end headers. Private
//! headers (`Set-Cookie` in the gateway) belong to the caller who got the
//! first answer: they reach that caller and are never recorded, so a replay
//! never hands one caller's session to another.

use http::{HeaderMap, HeaderName, header};

/// The hop-by-hop headers of RFC 9110 §7.6.1 and the obsolete ones proxies
/// still meet. `Proxy-Authenticate` and `Proxy-Authorization` are here too:
/// they are between a client and the proxy next to it (RFC 9110 §11.7), so
/// a challenge from behind a reverse proxy is never passed on to its callers.
pub const HOP_BY_HOP: [&str; 9] = [
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

/// Whether `name` is one of [`HOP_BY_HOP`].
pub fn is_hop_by_hop(name: &HeaderName) -> bool {
    HOP_BY_HOP.contains(&name.as_str())
}

/// Removes the hop-by-hop headers of `headers`: those of [`HOP_BY_HOP`] and
/// every header its `Connection` names.
///
/// ```
/// let mut h = http::HeaderMap::new();
/// h.insert("connection", "x-hop".parse().unwrap());
/// h.insert("x-hop", "1".parse().unwrap());
/// h.insert("proxy-authenticate", "Basic".parse().unwrap());
/// h.insert("content-type", "text/plain".parse().unwrap());
/// idem_http::strip_hop_by_hop(&mut h);
/// assert_eq!(h.keys().map(|k| k.as_str()).collect::<Vec<_>>(), ["content-type"]);
/// ```
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|n| HeaderName::from_bytes(n.trim().as_bytes()).ok())
        .collect();
    for name in named {
        headers.remove(name);
    }
    for name in HOP_BY_HOP {
        headers.remove(name);
    }
}
