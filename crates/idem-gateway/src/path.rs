//! One spelling per request target, decided once at the door.
//!
//! Routing, route policy, scope, fingerprint and forwarding all see the
//! canonical target this module makes, so no spelling can reach a route
//! under another route's policy or split one key into two scopes:
//!
//! - **Normalised** (RFC 3986 §6.2.2, spellings of the same URI): a
//!   percent-encoded unreserved character is decoded (`%61` is `a`, `%2E`
//!   is `.`), other percent-encodings get upper-case hex (`%c3` is `%C3`),
//!   and characters a URI may not hold raw (`"`, `{`, non-ASCII bytes, …)
//!   are percent-encoded. An absolute-form target (`POST http://host/p`)
//!   becomes its path and query.
//! - **Refused** with 400 `path-not-canonical` (spellings an upstream may
//!   read as another path, so the gateway cannot know which route they
//!   reach): dot segments (`.`, `..`, also as `%2e%2e` or `..;x`), empty
//!   segments (`//`), a backslash raw or encoded (`%5C`), an encoded slash
//!   (`%2F`), encoded control characters, broken percent-encoding, and any
//!   target that is not a path.
//! - **Matched leniently** (spellings some upstreams treat as the same
//!   path and others do not): routes match whatever the letter case of
//!   their literal segments, whatever `;parameters` a segment carries, and
//!   with or without one trailing slash. Such a request gets the route's
//!   policy and scope; its fingerprint keeps the exact canonical path, so
//!   one key sent on two of these spellings is refused as reused (422),
//!   never run twice.

use axum::http::Uri;
use axum::http::uri::PathAndQuery;
use idem_core::Operation;
use idem_http::{UNROUTED, method_label};

/// Why a target is refused.
pub(crate) type NotCanonical = String;

pub(crate) fn is_unreserved(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~')
}

/// Characters a path segment may hold raw (RFC 3986 `pchar` less
/// percent-encodings), and `/`.
fn is_path_char(b: u8) -> bool {
    is_unreserved(b)
        || matches!(
            b,
            b'!' | b'$' | b'&' | b'\'' | b'(' | b')' | b'*' | b'+' | b',' | b';' | b'=' | b':' | b'@' | b'/'
        )
}

fn hex(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

pub(crate) fn push_encoded(out: &mut String, b: u8) {
    out.push_str(&format!("%{b:02X}"));
}

/// The canonical form of a path, or why it has none.
pub(crate) fn canonical_path(raw: &str) -> Result<String, NotCanonical> {
    if !raw.starts_with('/') {
        return Err("the request target must be a path starting with /".into());
    }
    let bytes = raw.as_bytes();
    let mut out = String::with_capacity(raw.len());
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        if b == b'%' {
            let decoded = bytes
                .get(i + 1..i + 3)
                .and_then(|h| Some(hex(h[0])? << 4 | hex(h[1])?))
                .ok_or_else(|| "the path holds a % that does not start a percent-encoded byte".to_owned())?;
            match decoded {
                b'/' => return Err("the path holds an encoded slash (%2F)".into()),
                b'\\' => return Err("the path holds an encoded backslash (%5C)".into()),
                0..0x20 | 0x7f => return Err("the path holds an encoded control character".into()),
                b if is_unreserved(b) => out.push(b as char),
                b => push_encoded(&mut out, b),
            }
            i += 3;
            continue;
        }
        match b {
            b'\\' => return Err("the path holds a backslash".into()),
            0..0x20 | 0x7f => return Err("the path holds a control character".into()),
            b if is_path_char(b) => out.push(b as char),
            b => push_encoded(&mut out, b),
        }
        i += 1;
    }
    let segments: Vec<&str> = out[1..].split('/').collect();
    let last = segments.len() - 1;
    for (n, segment) in segments.iter().enumerate() {
        let base = segment.split(';').next().unwrap_or("");
        if base == "." || base == ".." {
            return Err("the path holds a dot segment (. or ..)".into());
        }
        if base.is_empty() && n != last {
            return Err("the path holds an empty segment (//)".into());
        }
    }
    Ok(out)
}

/// The canonical form of a query: percent-encodings get upper-case hex,
/// and the characters a forwarded URL would encode are encoded here, so
/// the fingerprinted query is the forwarded one.
pub(crate) fn canonical_query(raw: &str) -> Result<String, NotCanonical> {
    let bytes = raw.as_bytes();
    let mut out = String::with_capacity(raw.len());
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        if b == b'%'
            && let Some(h) = bytes.get(i + 1..i + 3)
            && let (Some(hi), Some(lo)) = (hex(h[0]), hex(h[1]))
        {
            push_encoded(&mut out, hi << 4 | lo);
            i += 3;
            continue;
        }
        match b {
            0..0x20 | 0x7f => return Err("the query holds a control character".into()),
            b'"' | b'#' | b'<' | b'>' | b'\'' | b'`' | b'{' | b'}' | b'|' | b'\\' | b'^' | b'[' | b']' | b' ' => {
                push_encoded(&mut out, b)
            }
            b if b >= 0x80 => push_encoded(&mut out, b),
            b => out.push(b as char),
        }
        i += 1;
    }
    Ok(out)
}

/// The canonical origin-form target of `uri` (path and query), or why it
/// has none. The result is checked to be what a forwarded URL keeps as is.
pub(crate) fn canonical_target(uri: &Uri) -> Result<Uri, NotCanonical> {
    let raw = uri.path_and_query().map(PathAndQuery::as_str).unwrap_or("/");
    if raw == "*" {
        return Err("the request target * is not forwarded".into());
    }
    let path = canonical_path(uri.path())?;
    let query = uri.query().map(canonical_query).transpose()?;
    // The forwarded URL is parsed by the WHATWG rules, which would rewrite a
    // spelling they treat otherwise (a backslash, a dot segment): a target
    // they would change is refused rather than forwarded as another path.
    let mut check = reqwest::Url::parse("http://gateway.invalid/").expect("a valid URL");
    check.set_path(&path);
    check.set_query(query.as_deref());
    if check.path() != path || check.query() != query.as_deref() {
        return Err("the target would not be forwarded as it was sent".into());
    }
    let target = match &query {
        Some(q) => format!("{path}?{q}"),
        None => path,
    };
    target
        .parse::<Uri>()
        .map_err(|e| format!("the target is not a valid URI: {e}"))
}

/// A route's path template: literal segments and `{name}` placeholders,
/// each matching one non-empty segment.
#[derive(Debug, Clone)]
pub(crate) struct Template {
    path: String,
    segments: Vec<Segment>,
}

#[derive(Debug, Clone)]
enum Segment {
    Literal(String),
    /// `{name}`.
    Any(String),
}

/// A path's segments as routes match them: the part of each segment before
/// any `;`, and no trailing empty segment (the root path has one, empty).
/// An iterator, so that matching a request against every route allocates
/// nothing.
fn match_segments(path: &str) -> impl Iterator<Item = &str> {
    fn base(segment: &str) -> &str {
        segment.split(';').next().unwrap_or("")
    }
    let relative = path.strip_prefix('/').unwrap_or(path);
    // A last segment that is empty before any `;` is no segment of its own,
    // unless it is the only one.
    let relative = match relative.rfind('/') {
        Some(i) if base(&relative[i + 1..]).is_empty() => &relative[..i],
        _ => relative,
    };
    relative.split('/').map(base)
}

impl Template {
    /// Parses a configured template: a canonical path (see
    /// [`canonical_path`]) without `;`, whose `{name}` placeholders are whole
    /// segments.
    pub(crate) fn parse(path: &str) -> Result<Self, String> {
        if path.len() > 200 {
            return Err("is longer than 200 bytes".into());
        }
        if path.contains(['?', '#', ';']) {
            return Err("must hold no query, fragment or ;".into());
        }
        // Placeholders are checked apart: braces are not path characters.
        let mut literal = String::with_capacity(path.len());
        let mut segments = Vec::new();
        let relative = path.strip_prefix('/').ok_or("must start with /")?;
        for segment in relative.split('/') {
            if segment.starts_with('{') && segment.ends_with('}') && segment.len() > 2 {
                let name = &segment[1..segment.len() - 1];
                if !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_') {
                    return Err(format!("has a placeholder {segment} whose name is not alphanumeric"));
                }
                literal.push_str("/x");
                segments.push(Segment::Any(name.to_owned()));
            } else {
                literal.push('/');
                literal.push_str(segment);
                segments.push(Segment::Literal(segment.to_owned()));
            }
        }
        let canonical = canonical_path(&literal)?;
        if canonical != literal {
            return Err(format!("is not written canonically (as {canonical})"));
        }
        if segments.len() > 1 && matches!(segments.last(), Some(Segment::Literal(s)) if s.is_empty()) {
            segments.pop();
        }
        Ok(Self {
            path: path.to_owned(),
            segments,
        })
    }

    /// Whether the canonical `path` is this route.
    fn matches(&self, path: &str) -> bool {
        let mut got = match_segments(path);
        self.segments.iter().all(|t| match (t, got.next()) {
            (_, None) => false,
            (Segment::Any(_), Some(s)) => !s.is_empty(),
            (Segment::Literal(l), Some(s)) => l.eq_ignore_ascii_case(s),
        }) && got.next().is_none()
    }

    /// The names of its `{name}` placeholders, in order.
    pub(crate) fn names(&self) -> impl Iterator<Item = &str> + Clone {
        self.segments.iter().filter_map(|s| match s {
            Segment::Any(name) => Some(name.as_str()),
            Segment::Literal(_) => None,
        })
    }

    /// The canonical `path`'s segment under each placeholder (without any
    /// `;parameters`), when `path` is this route.
    pub(crate) fn captures<'p>(&self, path: &'p str) -> Option<Vec<(&str, &'p str)>> {
        if !self.matches(path) {
            return None;
        }
        Some(
            self.segments
                .iter()
                .zip(match_segments(path))
                .filter_map(|(t, s)| match t {
                    Segment::Any(name) => Some((name.as_str(), s)),
                    Segment::Literal(_) => None,
                })
                .collect(),
        )
    }
}

/// The method labels an operation name may start with (see
/// [`method_label`]).
const METHOD_LABELS: [&str; 10] = [
    "GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH", "OTHER",
];

/// The configured routes, in order, each with its operation made once, and
/// the operation of an unrouted request per method: finding a request's
/// operation allocates nothing.
#[derive(Debug, Clone)]
pub(crate) struct Routes {
    routes: Vec<(String, Template, Option<Operation>)>,
    unrouted: Vec<(&'static str, Operation)>,
}

impl Default for Routes {
    fn default() -> Self {
        let unrouted = METHOD_LABELS
            .iter()
            .map(|m| {
                (
                    *m,
                    Operation::new(format!("{m} {UNROUTED}")).expect("a valid operation name"),
                )
            })
            .collect();
        Self {
            routes: Vec::new(),
            unrouted,
        }
    }
}

impl Routes {
    /// Adds a route; returns its operation name (`POST /v1/payouts/{id}`).
    pub(crate) fn push(&mut self, method: String, template: Template) -> String {
        let name = format!("{method} {}", template.path);
        // A name that is no valid operation (too long) protects nothing,
        // as before: the layer passes such a request through.
        let operation = Operation::new(&name).ok();
        self.routes.push((method, template, operation));
        name
    }

    /// The operation of a request whose target is canonical: the first
    /// route whose method and template match, else `"<METHOD> (unrouted)"`.
    pub(crate) fn operation(&self, method: &axum::http::Method, path: &str) -> Option<Operation> {
        let method = method_label(method);
        let route = self.routes.iter().find(|(m, t, _)| m == method && t.matches(path));
        match route {
            Some((_, _, operation)) => operation.clone(),
            None => self
                .unrouted
                .iter()
                .find(|(m, _)| *m == method)
                .map(|(_, op)| op.clone()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target(raw: &str) -> Result<String, String> {
        let uri: Uri = raw.parse().map_err(|e| format!("unparsable: {e}"))?;
        canonical_target(&uri).map(|u| u.to_string())
    }

    /// Spellings of one URI become one target.
    #[test]
    fn equivalent_spellings_are_normalised() {
        for (raw, canonical) in [
            ("/v1/payments", "/v1/payments"),
            ("/v1/p%61yments", "/v1/payments"),
            ("/v1/%70%41yments", "/v1/pAyments"),
            ("/v1/caf%c3%a9", "/v1/caf%C3%A9"),
            ("/v1/a%7eb", "/v1/a~b"),
            ("/v1/a%2eb", "/v1/a.b"),
            ("/v1/x;v=1/", "/v1/x;v=1/"),
            ("/v1/a%20b?q=%2f%2F&x=a'b", "/v1/a%20b?q=%2F%2F&x=a%27b"),
            ("/v1/{id}", "/v1/%7Bid%7D"),
            ("http://elsewhere.example/v1/payments?x=1", "/v1/payments?x=1"),
            ("http://elsewhere.example", "/"),
            ("/", "/"),
            ("/v1/payments/", "/v1/payments/"),
        ] {
            assert_eq!(target(raw).as_deref(), Ok(canonical), "{raw}");
            assert_eq!(
                target(canonical).as_deref(),
                Ok(canonical),
                "{canonical} is a fixed point"
            );
        }
    }

    /// Spellings an upstream may read as another path are refused.
    #[test]
    fn ambiguous_spellings_are_refused() {
        for raw in [
            "/v1/x/../payments",
            "/v1/x/%2e%2e/payments",
            "/v1/x/%2E%2E/payments",
            "/v1/x/.%2e/payments",
            "/v1/./payments",
            "/v1/%2e/payments",
            "/v1/x/..;a=b/payments",
            "/v1/x/..",
            "/v1//payments",
            "//v1/payments",
            "/v1/;x/payments",
            "/v1/x%2fy",
            "/v1/x%2F..%2Fpayments",
            "/v1/x%5c..%5cpayments",
            "/v1/x%00",
            "/v1/x%zz",
            "/v1/x%4",
            "*",
        ] {
            let got = target(raw);
            assert!(got.is_err(), "{raw} was accepted as {got:?}");
        }
    }

    /// A raw backslash never reaches the upstream, whatever the URI parser made of it.
    #[test]
    fn a_backslash_is_refused() {
        assert!(canonical_path("/v1/x\\..\\payments").is_err());
        if let Ok(uri) = "/v1/x\\..\\payments".parse::<Uri>() {
            assert!(canonical_target(&uri).is_err());
        }
    }

    fn routes() -> Routes {
        let mut r = Routes::default();
        for (m, p) in [
            ("POST", "/v1/payments"),
            ("POST", "/v1/payments/{id}/refund"),
            ("POST", "/v1/items/"),
        ] {
            r.push(m.into(), Template::parse(p).unwrap());
        }
        r
    }

    /// The segments routes match are the path's, `;parameters` cut, less one
    /// trailing empty segment unless it is the only one.
    #[test]
    fn match_segments_cut_parameters_and_one_trailing_slash() {
        for (path, want) in [
            ("/", vec![""]),
            ("/;x", vec![""]),
            ("/v1", vec!["v1"]),
            ("/v1/", vec!["v1"]),
            ("/v1/;x", vec!["v1"]),
            ("/v1//", vec!["v1", ""]),
            ("/v1/p;a=1/q;b", vec!["v1", "p", "q"]),
            ("/v1/p/", vec!["v1", "p"]),
        ] {
            assert_eq!(match_segments(path).collect::<Vec<_>>(), want, "{path}");
        }
    }

    /// Routes match their own path and its lenient spellings, and nothing else.
    #[test]
    fn operations_come_from_route_templates() {
        let r = routes();
        let op = |m: &str, p: &str| r.operation(&m.parse().unwrap(), p).unwrap().as_str().to_owned();
        for p in [
            "/v1/payments",
            "/v1/payments/",
            "/V1/Payments",
            "/v1/payments;jsessionid=1",
        ] {
            assert_eq!(op("POST", p), "POST /v1/payments", "{p}");
        }
        assert_eq!(op("POST", "/v1/payments/p_1/refund"), "POST /v1/payments/{id}/refund");
        assert_eq!(op("POST", "/v1/payments/;x/refund"), "POST (unrouted)");
        assert_eq!(op("POST", "/v1/items"), "POST /v1/items/");
        assert_eq!(op("POST", "/v1/items/"), "POST /v1/items/");
        assert_eq!(op("POST", "/v1/paymentsx"), "POST (unrouted)");
        assert_eq!(op("PUT", "/v1/payments"), "PUT (unrouted)");
        assert_eq!(op("POST", "/"), "POST (unrouted)");
    }

    /// Templates must be canonical and their placeholders whole segments.
    #[test]
    fn templates_are_validated() {
        assert!(Template::parse("/v1/payouts/{id}").is_ok());
        assert!(Template::parse("/").is_ok());
        for bad in [
            "v1",
            "/v1/../x",
            "/v1//x",
            "/v1/x;y",
            "/v1/%2F",
            "/v1/{a-b}",
            "/v1/p%61y",
            "/v1/x?y",
        ] {
            assert!(Template::parse(bad).is_err(), "{bad}");
        }
    }
}
