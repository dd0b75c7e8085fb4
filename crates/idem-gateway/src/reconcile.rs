//! The configured reconcile request: when a retry meets a key held as an
//! unknown outcome, the upstream is asked whether the request was applied,
//! with the retry's own headers (see [`ReconcileConfig`]).
//!
//! The layer (`idem_http::Reconcile`) decides what the answer does to the
//! key and makes sure one retry per key asks at a time; this module only
//! builds the request and reads its answer.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::http::{Response, StatusCode, header, request::Parts};
use idem_core::{BoxFuture, Call};
use idem_http::{Reconcile, Reconciled, strip_hop_by_hop};

use crate::config::{Config, ConfigError, ReconcileConfig};
use crate::path::{Template, canonical_path, canonical_query, is_unreserved, push_encoded};
use crate::proxy::Forwarding;
use crate::trust::Peer;

/// Counter: reconcile requests by what they said (`result` = `applied` |
/// `not_applied` | `unknown` (another status) | `failed` (no answer, or one
/// too large to record)).
pub const RECONCILE_TOTAL: &str = "idem_gateway_reconcile_total";

/// One piece of a reconcile path template.
#[derive(Debug, Clone)]
enum Piece {
    Literal(String),
    /// The idempotency key.
    Key,
    /// The request's segment under the route's placeholder of this name.
    Segment(String),
}

/// A reconcile request's path and query, with `{key}` and the route's
/// `{name}` placeholders.
#[derive(Debug, Clone)]
pub(crate) struct LookupTemplate {
    path: Vec<Piece>,
    query: Option<Vec<Piece>>,
}

/// The pieces of `text`, and `text` with every placeholder written `x`.
fn pieces<'a>(text: &str, names: impl Iterator<Item = &'a str> + Clone) -> Result<(Vec<Piece>, String), String> {
    let mut pieces = Vec::new();
    let mut sample = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(open) = rest.find(['{', '}']) {
        if rest.as_bytes()[open] == b'}' {
            return Err("has a } without its {".into());
        }
        let literal = &rest[..open];
        let close = rest[open..]
            .find('}')
            .map(|i| open + i)
            .ok_or("has a { without its }")?;
        let name = &rest[open + 1..close];
        if name.is_empty() || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_') {
            return Err(format!("has a placeholder {{{name}}} whose name is not alphanumeric"));
        }
        if !literal.is_empty() {
            pieces.push(Piece::Literal(literal.to_owned()));
            sample.push_str(literal);
        }
        if name == "key" {
            pieces.push(Piece::Key);
        } else if names.clone().any(|n| n == name) {
            pieces.push(Piece::Segment(name.to_owned()));
        } else {
            let known: Vec<String> = names.clone().map(|n| format!("{{{n}}}")).collect();
            return Err(format!(
                "{{{name}}} is neither {{key}} nor a placeholder of the route's path{}",
                if known.is_empty() {
                    " (it has none)".to_owned()
                } else {
                    format!(" ({})", known.join(", "))
                }
            ));
        }
        sample.push('x');
        rest = &rest[close + 1..];
    }
    if !rest.is_empty() {
        pieces.push(Piece::Literal(rest.to_owned()));
        sample.push_str(rest);
    }
    Ok((pieces, sample))
}

impl LookupTemplate {
    /// Parses a configured template: a canonical path, an optional query,
    /// placeholders among `names` and `{key}`.
    pub(crate) fn parse<'a>(text: &str, names: impl Iterator<Item = &'a str> + Clone) -> Result<Self, String> {
        if text.len() > 400 {
            return Err("is longer than 400 bytes".into());
        }
        if !text.starts_with('/') {
            return Err("must start with /".into());
        }
        if text.contains('#') {
            return Err("must hold no fragment".into());
        }
        let (path, query) = match text.split_once('?') {
            Some((p, q)) => (p, Some(q)),
            None => (text, None),
        };
        let (path_pieces, sample) = pieces(path, names.clone())?;
        let canonical = canonical_path(&sample)?;
        if canonical != sample {
            return Err(format!("is not written canonically (as {canonical})"));
        }
        let query = match query {
            Some(q) => {
                let (query_pieces, sample) = pieces(q, names)?;
                let canonical = canonical_query(&sample)?;
                if canonical != sample {
                    return Err(format!("has a query not written canonically (as {canonical})"));
                }
                Some(query_pieces)
            }
            None => None,
        };
        Ok(Self {
            path: path_pieces,
            query,
        })
    }

    /// The path and query for one request: `segments` are the request's
    /// canonical segments by placeholder name.
    fn render(&self, segments: &[(&str, &str)], key: &str) -> (String, Option<String>) {
        let render = |pieces: &[Piece], in_query: bool| {
            let mut out = String::new();
            for piece in pieces {
                match piece {
                    Piece::Literal(l) => out.push_str(l),
                    Piece::Key => {
                        for b in key.bytes() {
                            if is_unreserved(b) {
                                out.push(b as char);
                            } else {
                                push_encoded(&mut out, b);
                            }
                        }
                    }
                    Piece::Segment(name) => {
                        let value = segments.iter().find(|(n, _)| n == name).map_or("", |(_, v)| v);
                        // A canonical segment is already encoded for a path;
                        // in a query, the characters that split it are encoded too.
                        for b in value.bytes() {
                            if in_query && matches!(b, b'&' | b'=' | b'+') {
                                push_encoded(&mut out, b);
                            } else {
                                out.push(b as char);
                            }
                        }
                    }
                }
            }
            out
        };
        (
            render(&self.path, false),
            self.query.as_deref().map(|q| render(q, true)),
        )
    }
}

/// One configured reconcile request, ready to send.
struct Lookup {
    /// The route's template, whose segments fill the placeholders (none
    /// for `[defaults]`).
    route: Option<Template>,
    method: reqwest::Method,
    target: LookupTemplate,
    applied: Vec<u16>,
    applied_status: Option<StatusCode>,
    not_applied: Vec<u16>,
    timeout: Duration,
    /// How long after a send its "not applied" is trusted.
    settle: Duration,
}

/// What is added to the upstream timeout to make a route's default settle time.
pub(crate) const SETTLE_MARGIN: Duration = Duration::from_secs(5);

impl Lookup {
    fn new(
        config: &ReconcileConfig,
        route: Option<Template>,
        target: LookupTemplate,
        upstream_timeout: Duration,
    ) -> Result<Self, ConfigError> {
        Ok(Self {
            route,
            method: reqwest::Method::from_bytes(config.method.to_ascii_uppercase().as_bytes())
                .map_err(|e| ConfigError(format!("reconcile.method: {e}")))?,
            target,
            applied: config.applied.clone(),
            applied_status: config.applied_status.and_then(|s| StatusCode::from_u16(s).ok()),
            not_applied: config.not_applied.clone(),
            timeout: Duration::from_millis(config.timeout_ms),
            settle: config
                .settle_ms
                .map_or(upstream_timeout + SETTLE_MARGIN, Duration::from_millis),
        })
    }
}

/// Asks the upstream about held keys, as configured per route.
pub(crate) struct Reconciler {
    client: reqwest::Client,
    upstream: reqwest::Url,
    forwarding: Forwarding,
    /// Each route's operation name, and its request (none: never asked).
    by_operation: HashMap<String, Option<Arc<Lookup>>>,
    /// The request of keys no route names (`[defaults]`).
    unrouted: Option<Arc<Lookup>>,
    max_response_bytes: usize,
}

impl Reconciler {
    /// The reconcile requests of `config`, or none when no route has one.
    pub(crate) fn new(config: &Config, client: reqwest::Client) -> Result<Option<Self>, ConfigError> {
        let unrouted = match &config.defaults.reconcile {
            Some(d) if config.defaults.on_unknown_outcome == crate::config::UnknownOutcome::Hold => {
                let target = d.check("[defaults] reconcile", std::iter::empty())?;
                Some(Arc::new(Lookup::new(d, None, target, config.upstream_timeout())?))
            }
            _ => None,
        };
        let mut by_operation = HashMap::new();
        for route in &config.routes {
            let (method, template) = route.parsed()?;
            let name = format!("{method} {}", route.path);
            if by_operation.contains_key(&name) {
                // The first route of a name is the one requests match.
                continue;
            }
            let lookup = match route.reconcile(&config.defaults)? {
                Some((rc, target)) => Some(Arc::new(Lookup::new(
                    rc,
                    Some(template),
                    target,
                    config.upstream_timeout(),
                )?)),
                None => None,
            };
            by_operation.insert(name, lookup);
        }
        if unrouted.is_none() && by_operation.values().all(Option::is_none) {
            return Ok(None);
        }
        Ok(Some(Self {
            client,
            upstream: config.upstream()?,
            forwarding: Forwarding::new(config)?,
            by_operation,
            unrouted,
            max_response_bytes: config.max_response_bytes,
        }))
    }

    fn lookup(&self, call: &Call) -> Option<&Arc<Lookup>> {
        match self.by_operation.get(call.scope().operation().as_str()) {
            Some(lookup) => lookup.as_ref(),
            None => self.unrouted.as_ref(),
        }
    }

    async fn ask_upstream(&self, parts: &Parts, call: &Call) -> Reconciled {
        let Some(lookup) = self.lookup(call) else {
            return Reconciled::Unknown;
        };
        let segments = match &lookup.route {
            Some(route) => match route.captures(parts.uri.path()) {
                Some(segments) => segments,
                None => return Reconciled::Unknown,
            },
            None => Vec::new(),
        };
        let (path, query) = lookup.target.render(&segments, call.key().as_str());
        let mut url = self.upstream.clone();
        let base = url.path().trim_end_matches('/').to_owned();
        url.set_path(&format!("{base}{path}"));
        url.set_query(query.as_deref());
        // The retry's own headers, as a forwarded request would carry them
        // (its credentials and Idempotency-Key), but nothing of its body.
        let mut headers = parts.headers.clone();
        strip_hop_by_hop(&mut headers);
        let host = headers.remove(header::HOST);
        for name in [
            header::CONTENT_LENGTH,
            header::CONTENT_TYPE,
            header::CONTENT_ENCODING,
            header::EXPECT,
        ] {
            headers.remove(name);
        }
        self.forwarding
            .apply(&mut headers, parts.extensions.get::<Peer>(), host);
        let sent = self
            .client
            .request(lookup.method.clone(), url)
            .headers(headers)
            .timeout(lookup.timeout)
            .send()
            .await;
        let answer = match sent {
            Ok(answer) => answer,
            Err(e) => {
                tracing::warn!(error = %e, "the reconcile request failed; the key stays held");
                return counted("failed", Reconciled::Unknown);
            }
        };
        let status = answer.status();
        if lookup.not_applied.contains(&status.as_u16()) {
            return counted("not_applied", Reconciled::NotApplied);
        }
        if !lookup.applied.contains(&status.as_u16()) {
            tracing::warn!(
                status = status.as_u16(),
                "the reconcile request was answered with a status that says neither applied nor not applied; \
                 the key stays held"
            );
            return counted("unknown", Reconciled::Unknown);
        }
        let mut headers = answer.headers().clone();
        strip_hop_by_hop(&mut headers);
        let body = match read_bounded(answer, self.max_response_bytes).await {
            Ok(body) => body,
            Err(why) => {
                tracing::warn!(%why, "the reconcile answer could not be read; the key stays held");
                return counted("failed", Reconciled::Unknown);
            }
        };
        let mut response = Response::new(body);
        *response.status_mut() = lookup.applied_status.unwrap_or(status);
        // Content-Length is never recorded (a replay says its own), so a
        // HEAD answer's length of the body it did not send goes too.
        *response.headers_mut() = headers;
        counted("applied", Reconciled::Applied(response))
    }
}

fn counted(result: &'static str, reconciled: Reconciled) -> Reconciled {
    metrics::counter!(RECONCILE_TOTAL, "result" => result).increment(1);
    reconciled
}

/// The whole body of `answer`, refused past `limit` bytes.
async fn read_bounded(mut answer: reqwest::Response, limit: usize) -> Result<Bytes, String> {
    let mut body = Vec::new();
    while let Some(chunk) = answer.chunk().await.map_err(|e| e.to_string())? {
        if body.len() + chunk.len() > limit {
            return Err(format!("the answer is larger than max_response_bytes ({limit})"));
        }
        body.extend_from_slice(&chunk);
    }
    Ok(Bytes::from(body))
}

impl Reconcile for Reconciler {
    fn can_ask(&self, _parts: &Parts, call: &Call) -> bool {
        self.lookup(call).is_some()
    }

    fn ask<'a>(&'a self, parts: &'a Parts, call: &'a Call) -> BoxFuture<'a, Reconciled> {
        Box::pin(self.ask_upstream(parts, call))
    }

    fn settle_after(&self, _parts: &Parts, call: &Call) -> Duration {
        self.lookup(call)
            .map_or(idem_http::DEFAULT_SETTLE, |lookup| lookup.settle)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Templates name only `{key}` and the route's placeholders, and are written canonically.
    #[test]
    fn templates_are_checked() {
        let names = ["id", "account"];
        let t =
            LookupTemplate::parse("/v1/payouts/{id}/by-key/{key}?account={account}", names.iter().copied()).unwrap();
        let (path, query) = t.render(&[("id", "p%20x"), ("account", "a&b=c")], "k 1/é");
        assert_eq!(path, "/v1/payouts/p%20x/by-key/k%201%2F%C3%A9");
        assert_eq!(query.as_deref(), Some("account=a%26b%3Dc"));
        for (bad, why) in [
            ("/v1/{nope}", "{nope} is neither {key}"),
            ("v1/{key}", "must start with /"),
            ("/v1/{key", "without its }"),
            ("/v1/}", "without its {"),
            ("/v1/{a-b}", "not alphanumeric"),
            ("/v1/../{key}", "dot segment"),
            ("/v1/{key}#x", "fragment"),
            ("/v1/a b", "canonically"),
        ] {
            let e = LookupTemplate::parse(bad, names.iter().copied()).unwrap_err();
            assert!(e.contains(why), "{bad}: {e}");
        }
    }
}
