//! Final answers, problem documents and the default retry decisions.

use std::time::Duration;

use bytes::Bytes;
use reqwest::StatusCode;
use reqwest::header::{CONTENT_TYPE, HeaderMap, RETRY_AFTER};
use serde::de::DeserializeOwned;

use crate::{Error, Key, Result};

/// The header a replayed answer carries.
pub const IDEMPOTENT_REPLAYED: &str = "idempotent-replayed";

/// The last segment of the problem type of a key whose first request is
/// still running (409 with `Retry-After`).
pub const KEY_IN_FLIGHT: &str = "idempotency-key-in-flight";

/// An answer from the server, read in full (bounded by the client's
/// response limit).
#[derive(Debug, Clone)]
pub struct Response {
    pub(crate) status: StatusCode,
    pub(crate) headers: HeaderMap,
    pub(crate) body: Bytes,
    pub(crate) key: Key,
    pub(crate) attempt: u32,
    pub(crate) problem: Option<Problem>,
}

impl Response {
    pub(crate) fn new(status: StatusCode, headers: HeaderMap, body: Bytes, key: Key, attempt: u32) -> Self {
        let problem = Problem::parse(&headers, &body);
        Self {
            status,
            headers,
            body,
            key,
            attempt,
            problem,
        }
    }

    /// The status.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// The headers.
    pub fn headers(&self) -> &HeaderMap {
        &self.headers
    }

    /// The body.
    pub fn body(&self) -> &Bytes {
        &self.body
    }

    /// The body as text (invalid UTF-8 replaced).
    pub fn text(&self) -> std::borrow::Cow<'_, str> {
        String::from_utf8_lossy(&self.body)
    }

    /// The body parsed as JSON.
    pub fn json<T: DeserializeOwned>(&self) -> Result<T> {
        serde_json::from_slice(&self.body).map_err(|e| {
            Error::Decode(format!(
                "the {} response body is not the JSON expected: {e}",
                self.status
            ))
        })
    }

    /// The key the operation was sent with.
    pub fn key(&self) -> &Key {
        &self.key
    }

    /// Which attempt got this answer (1 for the first request).
    pub fn attempt(&self) -> u32 {
        self.attempt
    }

    /// Whether the server replayed a recorded answer (`Idempotent-Replayed:
    /// true`): the operation had been applied by an earlier request with the
    /// same key, whose answer this client may never have seen.
    pub fn replayed(&self) -> bool {
        self.headers
            .get(IDEMPOTENT_REPLAYED)
            .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"true"))
    }

    /// The `application/problem+json` document (RFC 9457) of the answer, if
    /// it has one.
    pub fn problem(&self) -> Option<&Problem> {
        self.problem.as_ref()
    }

    /// `Retry-After` in delay-seconds, if present in that form (an
    /// HTTP-date is not used).
    pub fn retry_after(&self) -> Option<Duration> {
        retry_after(&self.headers)
    }
}

/// An RFC 9457 problem document.
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize)]
#[non_exhaustive]
pub struct Problem {
    /// The problem type URI (`about:blank` when absent).
    #[serde(rename = "type", default = "about_blank")]
    pub type_uri: String,
    /// A short summary of the type.
    #[serde(default)]
    pub title: Option<String>,
    /// The HTTP status the server gave it.
    #[serde(default)]
    pub status: Option<u16>,
    /// This occurrence, in words.
    #[serde(default)]
    pub detail: Option<String>,
}

fn about_blank() -> String {
    "about:blank".to_owned()
}

/// The largest problem body parsed.
const MAX_PROBLEM_BYTES: usize = 64 * 1024;

impl Problem {
    /// Whether the type is `slug` or ends in `/slug`, e.g.
    /// `problem.is("insufficient-funds")`.
    pub fn is(&self, slug: &str) -> bool {
        self.type_uri == slug || self.type_uri.strip_suffix(slug).is_some_and(|head| head.ends_with('/'))
    }

    /// `type: detail` (or the title when there is no detail), for messages.
    pub fn summary(&self) -> String {
        match (&self.detail, &self.title) {
            (Some(d), _) => format!("{} ({d})", self.type_uri),
            (None, Some(t)) => format!("{} ({t})", self.type_uri),
            (None, None) => self.type_uri.clone(),
        }
    }

    /// The problem of a body whose `Content-Type` is
    /// `application/problem+json`, if it parses.
    fn parse(headers: &HeaderMap, body: &[u8]) -> Option<Self> {
        let media = headers.get(CONTENT_TYPE)?.to_str().ok()?;
        let media = media.split(';').next().unwrap_or("").trim();
        if !media.eq_ignore_ascii_case("application/problem+json") || body.len() > MAX_PROBLEM_BYTES {
            return None;
        }
        serde_json::from_slice(body).ok()
    }
}

/// What to do after an answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Decision {
    /// A final answer: retrying with the same key would get the same one.
    Final,
    /// A transient answer: retry with the same key, after `after` when the
    /// server said how long to wait (`Retry-After`), else on the backoff
    /// schedule.
    Retry {
        /// The server's `Retry-After`, in delay-seconds.
        after: Option<Duration>,
    },
}

/// The default decision for an answer, usable on its own:
///
/// - 5xx: retry (the server committed nothing it would not replay);
/// - 409 whose problem type ends in `idempotency-key-in-flight`: retry after
///   `Retry-After` (the first request with this key is still running);
/// - 408 and 429: retry, after `Retry-After` when given (the request was not
///   processed);
/// - anything else (2xx, 3xx, other 4xx): final.
///
/// ```
/// use idem_client::{Decision, decide};
/// use reqwest::StatusCode;
/// let none = reqwest::header::HeaderMap::new();
/// assert_eq!(decide(StatusCode::CREATED, &none, None), Decision::Final);
/// assert_eq!(decide(StatusCode::BAD_GATEWAY, &none, None), Decision::Retry { after: None });
/// assert_eq!(decide(StatusCode::UNPROCESSABLE_ENTITY, &none, None), Decision::Final);
/// ```
pub fn decide(status: StatusCode, headers: &HeaderMap, problem: Option<&Problem>) -> Decision {
    let retry = Decision::Retry {
        after: retry_after(headers),
    };
    if status.is_server_error() || status == StatusCode::TOO_MANY_REQUESTS || status == StatusCode::REQUEST_TIMEOUT {
        return retry;
    }
    if status == StatusCode::CONFLICT && problem.is_some_and(|p| p.is(KEY_IN_FLIGHT)) {
        return retry;
    }
    Decision::Final
}

/// `Retry-After` as delay-seconds (RFC 9110 §10.2.3); an HTTP-date or
/// anything else is ignored.
pub fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    let text = headers.get(RETRY_AFTER)?.to_str().ok()?.trim();
    if text.is_empty() || text.len() > 10 || !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    text.parse().ok().map(Duration::from_secs)
}

#[cfg(test)]
mod tests {
    use super::*;
    use reqwest::header::HeaderValue;

    fn problem_headers() -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(CONTENT_TYPE, HeaderValue::from_static("application/problem+json"));
        h
    }

    /// A 409 is retried only when its problem says the key is in flight.
    #[test]
    fn in_flight_conflict_is_retried_other_conflicts_are_final() {
        let mut h = problem_headers();
        h.insert(RETRY_AFTER, HeaderValue::from_static("2"));
        let body = br#"{"type":"https://idem.dev/problems/idempotency-key-in-flight","title":"t","status":409}"#;
        let p = Problem::parse(&h, body);
        assert_eq!(
            decide(StatusCode::CONFLICT, &h, p.as_ref()),
            Decision::Retry {
                after: Some(Duration::from_secs(2))
            }
        );
        let body = br#"{"type":"https://example.com/problems/version-conflict","status":409}"#;
        let p = Problem::parse(&h, body);
        assert_eq!(decide(StatusCode::CONFLICT, &h, p.as_ref()), Decision::Final);
        assert_eq!(decide(StatusCode::CONFLICT, &h, None), Decision::Final);
    }

    /// Final and transient statuses per the contract.
    #[test]
    fn statuses() {
        let h = HeaderMap::new();
        for s in [200, 201, 204, 302, 400, 401, 403, 404, 413, 415, 422] {
            assert_eq!(
                decide(StatusCode::from_u16(s).unwrap(), &h, None),
                Decision::Final,
                "{s}"
            );
        }
        for s in [408, 429, 500, 502, 503, 504] {
            assert_eq!(
                decide(StatusCode::from_u16(s).unwrap(), &h, None),
                Decision::Retry { after: None },
                "{s}"
            );
        }
    }

    /// Only delay-seconds count as Retry-After.
    #[test]
    fn retry_after_forms() {
        let mut h = HeaderMap::new();
        for (v, want) in [
            ("0", Some(0)),
            ("7", Some(7)),
            (" 3 ", Some(3)),
            ("-1", None),
            ("1.5", None),
            ("Wed, 21 Oct 2015 07:28:00 GMT", None),
            ("99999999999", None),
        ] {
            h.insert(RETRY_AFTER, HeaderValue::from_str(v).unwrap());
            assert_eq!(retry_after(&h), want.map(Duration::from_secs), "{v:?}");
        }
    }

    /// Problems parse only from problem+json bodies, and `is` matches whole segments.
    #[test]
    fn problems() {
        let body = br#"{"type":"https://idem.dev/problems/insufficient-funds","title":"Insufficient funds","status":422,"detail":"d"}"#;
        let p = Problem::parse(&problem_headers(), body).unwrap();
        assert!(p.is("insufficient-funds"));
        assert!(!p.is("funds"));
        assert_eq!(p.status, Some(422));
        assert_eq!(p.detail.as_deref(), Some("d"));
        let mut json = HeaderMap::new();
        json.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        assert!(Problem::parse(&json, body).is_none());
        assert!(Problem::parse(&problem_headers(), b"not json").is_none());
        let mut charset = HeaderMap::new();
        charset.insert(
            CONTENT_TYPE,
            HeaderValue::from_static("Application/Problem+JSON; charset=utf-8"),
        );
        let p = Problem::parse(&charset, br#"{"status":400}"#).unwrap();
        assert_eq!(p.type_uri, "about:blank");
    }
}
