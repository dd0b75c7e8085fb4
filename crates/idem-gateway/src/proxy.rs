//! Forwarding to the upstream: the request at its canonical target
//! (hop-by-hop headers aside, forwarding headers added if configured), the
//! answer streamed back with its end-to-end headers.

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::IpAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderMap, HeaderValue, Request, Response, StatusCode, header};
use idem_http::{DEFAULT_PROBLEM_BASE, Problem, strip_hop_by_hop};

use crate::body::is_slow_body;
use crate::config::{ForwardedHeaders, UnknownOutcome};
use crate::trust::{Peer, Trusted};
use crate::{Config, ConfigError};

const X_FORWARDED_FOR: &str = "x-forwarded-for";
const X_FORWARDED_PROTO: &str = "x-forwarded-proto";
const X_FORWARDED_HOST: &str = "x-forwarded-host";
const X_REAL_IP: &str = "x-real-ip";

/// Headers other proxies and CDNs use to name the client's address: each
/// follows `forwarded_headers` as `X-Forwarded-For` does (an untrusted
/// caller's are removed), so an upstream that reads one never takes a
/// caller's word for its own address.
const CLIENT_ADDRESS_HEADERS: [&str; 6] = [
    X_REAL_IP,
    "x-client-ip",
    "true-client-ip",
    "cf-connecting-ip",
    "x-cluster-client-ip",
    "fastly-client-ip",
];

/// Which forwarding headers to add, and whose to believe.
#[derive(Clone)]
pub(crate) struct Forwarding {
    mode: ForwardedHeaders,
    trusted: Trusted,
}

impl Forwarding {
    /// The forwarding of `config`.
    pub(crate) fn new(config: &Config) -> Result<Self, ConfigError> {
        Ok(Self {
            mode: config.forwarded_headers,
            trusted: config.trusted()?,
        })
    }

    /// Adds the forwarding headers of one hop from `peer`. Those a trusted
    /// proxy sent are kept and extended; anyone else's are replaced, so an
    /// upstream never takes a caller's word for its own address.
    pub(crate) fn apply(&self, headers: &mut HeaderMap, peer: Option<&Peer>, host: Option<HeaderValue>) {
        if self.mode == ForwardedHeaders::None {
            return;
        }
        let trusted = self.trusted.trusts(peer);
        if !trusted {
            for name in ["forwarded", X_FORWARDED_FOR, X_FORWARDED_PROTO, X_FORWARDED_HOST]
                .into_iter()
                .chain(CLIENT_ADDRESS_HEADERS)
            {
                headers.remove(name);
            }
        }
        let ip = peer.map(|p| p.0.ip().to_canonical());
        if matches!(self.mode, ForwardedHeaders::XForwarded | ForwardedHeaders::Both) {
            // The client's address as nginx names it, unless a trusted
            // proxy already did.
            if !headers.contains_key(X_REAL_IP)
                && let Some(ip) = ip
                && let Ok(v) = HeaderValue::from_str(&ip.to_string())
            {
                headers.insert(X_REAL_IP, v);
            }
            let mut chain: Vec<String> = headers
                .get_all(X_FORWARDED_FOR)
                .iter()
                .filter_map(|v| v.to_str().ok())
                .map(str::to_owned)
                .collect();
            chain.push(ip.map_or_else(|| "unknown".to_owned(), |ip| ip.to_string()));
            if let Ok(v) = HeaderValue::from_str(&chain.join(", ")) {
                headers.insert(X_FORWARDED_FOR, v);
            }
            if !headers.contains_key(X_FORWARDED_PROTO) {
                headers.insert(X_FORWARDED_PROTO, HeaderValue::from_static("http"));
            }
            if !headers.contains_key(X_FORWARDED_HOST)
                && let Some(host) = &host
            {
                headers.insert(X_FORWARDED_HOST, host.clone());
            }
        }
        if matches!(self.mode, ForwardedHeaders::Forwarded | ForwardedHeaders::Both) {
            let node = match ip {
                Some(IpAddr::V6(ip)) => format!("\"[{ip}]\""),
                Some(IpAddr::V4(ip)) => ip.to_string(),
                None => "unknown".into(),
            };
            let mut element = format!("for={node};proto=http");
            if let Some(host) = host.as_ref().and_then(|h| h.to_str().ok()) {
                // A host is a token, or else a quoted string (a port's colon).
                let escaped = host.replace('\\', "\\\\").replace('"', "\\\"");
                element.push_str(&format!(";host=\"{escaped}\""));
            }
            let mut elements: Vec<String> = headers
                .get_all("forwarded")
                .iter()
                .filter_map(|v| v.to_str().ok())
                .map(str::to_owned)
                .collect();
            elements.push(element);
            if let Ok(v) = HeaderValue::from_str(&elements.join(", ")) {
                headers.insert("forwarded", v);
            }
        }
    }
}

/// Which routes hold a possibly applied request's key as an unknown
/// outcome, and which release it.
struct Unknowns {
    routes: crate::path::Routes,
    by_operation: HashMap<String, UnknownOutcome>,
    default: UnknownOutcome,
}

impl Unknowns {
    fn new(config: &Config) -> Result<Self, ConfigError> {
        let mut routes = crate::path::Routes::default();
        let mut by_operation = HashMap::new();
        for route in &config.routes {
            let (method, template) = route.parsed()?;
            let name = routes.push(method, template);
            // The first route of a name is the one requests match.
            by_operation
                .entry(name)
                .or_insert(route.on_unknown_outcome.unwrap_or(config.defaults.on_unknown_outcome));
        }
        Ok(Self {
            routes,
            by_operation,
            default: config.defaults.on_unknown_outcome,
        })
    }

    fn holds(&self, method: &axum::http::Method, path: &str) -> bool {
        let configured = self
            .routes
            .operation(method, path)
            .and_then(|op| self.by_operation.get(op.as_str()).copied());
        configured.unwrap_or(self.default) == UnknownOutcome::Hold
    }
}

/// Watches a request body on its way to the upstream: `whole` turns true
/// once every byte of it was handed to the connection (its stream ended,
/// or as many bytes as it holds went out). Until then the upstream cannot
/// have the whole request; after, it may.
struct Watched<S> {
    inner: S,
    sent: u64,
    length: Option<u64>,
    whole: Arc<AtomicBool>,
}

impl<S> futures_util::Stream for Watched<S>
where
    S: futures_util::Stream<Item = Result<axum::body::Bytes, axum::Error>> + Unpin,
{
    type Item = Result<axum::body::Bytes, axum::Error>;

    fn poll_next(mut self: std::pin::Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let next = std::pin::Pin::new(&mut self.inner).poll_next(cx);
        match &next {
            Poll::Ready(None) => self.whole.store(true, Ordering::SeqCst),
            Poll::Ready(Some(Ok(chunk))) => {
                self.sent += chunk.len() as u64;
                if self.length.is_some_and(|l| self.sent >= l) {
                    self.whole.store(true, Ordering::SeqCst);
                }
            }
            _ => {}
        }
        next
    }
}

/// An upstream body's data frames, its trailers left out; its size hint
/// (the declared length) is kept.
struct DataOnly<B>(B);

impl<B> http_body::Body for DataOnly<B>
where
    B: http_body::Body + Unpin,
{
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        loop {
            match std::task::ready!(std::pin::Pin::new(&mut self.0).poll_frame(cx)) {
                Some(Ok(frame)) if !frame.is_data() => continue,
                other => return Poll::Ready(other),
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.0.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.0.size_hint()
    }
}

/// The upstream as a tower service.
#[derive(Clone)]
pub(crate) struct Proxy {
    client: reqwest::Client,
    upstream: Arc<reqwest::Url>,
    /// The upstream's path, less a trailing slash: the prefix of every
    /// forwarded path.
    base: Arc<str>,
    forwarding: Arc<Forwarding>,
    unknowns: Arc<Unknowns>,
}

impl Proxy {
    pub(crate) fn new(config: &Config, client: reqwest::Client) -> Result<Self, ConfigError> {
        let upstream = config.upstream()?;
        Ok(Self {
            client,
            base: Arc::from(upstream.path().trim_end_matches('/')),
            upstream: Arc::new(upstream),
            forwarding: Arc::new(Forwarding::new(config)?),
            unknowns: Arc::new(Unknowns::new(config)?),
        })
    }

    /// The HTTP client of upstream calls.
    /// With TLS, an https upstream is verified against the platform's
    /// roots, or only `ca_file`'s certificates.
    pub(crate) fn client(timeout: Duration, ca_file: Option<&std::path::Path>) -> Result<reqwest::Client, ConfigError> {
        let builder = reqwest::Client::builder()
            .timeout(timeout)
            .redirect(reqwest::redirect::Policy::none())
            .pool_max_idle_per_host(64);
        #[cfg(feature = "tls")]
        let builder = {
            let tls = idem_tls::Roots::ca_file(ca_file)
                .client_config()
                .map_err(|e| ConfigError(format!("upstream_ca_file: {e}")))?;
            builder.tls_backend_preconfigured(tls)
        };
        #[cfg(not(feature = "tls"))]
        if let Some(file) = ca_file {
            return Err(ConfigError(format!(
                "upstream_ca_file {}: this build has no TLS",
                file.display()
            )));
        }
        builder.build().map_err(|e| ConfigError(format!("HTTP client: {e}")))
    }

    async fn forward(self, req: Request<Body>) -> Response<Body> {
        let (mut parts, body) = req.into_parts();
        // The door made the target canonical; it is forwarded as it is, so
        // the upstream gets the path that was routed and fingerprinted.
        let mut url = (*self.upstream).clone();
        let joined;
        let path = if self.base.is_empty() {
            parts.uri.path()
        } else {
            joined = format!("{}{}", self.base, parts.uri.path());
            &joined
        };
        url.set_path(path);
        url.set_query(parts.uri.query());
        if url.path() != path || url.query() != parts.uri.query() {
            tracing::error!(target = %parts.uri, "a canonical target would be forwarded otherwise; refused");
            return Problem::new(StatusCode::BAD_REQUEST, "path-not-canonical", "Path not canonical")
                .with_detail("the request target cannot be forwarded as it was sent")
                .into_response(DEFAULT_PROBLEM_BASE);
        }
        strip_hop_by_hop(&mut parts.headers);
        // reqwest sets Host for the upstream.
        let host = parts.headers.remove(header::HOST);
        self.forwarding
            .apply(&mut parts.headers, parts.extensions.get::<Peer>(), host);
        let holds = self.unknowns.holds(&parts.method, parts.uri.path());
        let length = http_body::Body::size_hint(&body).exact();
        // An empty body is whole as soon as the request's head is sent: a
        // connection may never ask for it.
        let whole = Arc::new(AtomicBool::new(length == Some(0)));
        let watched = Watched {
            inner: body.into_data_stream(),
            sent: 0,
            length,
            whole: whole.clone(),
        };
        let sent = self
            .client
            .request(parts.method, url)
            .headers(parts.headers)
            .body(reqwest::Body::wrap_stream(watched))
            .send()
            .await;
        // The upstream may have applied the request once it had all of it.
        let unknown = |what: String, answered: bool| {
            (holds && whole.load(Ordering::SeqCst)).then_some(idem_http::OutcomeUnknown { note: what, answered })
        };
        let sent = match sent {
            // A request that never got a connection never reached the upstream.
            Err(e) if !is_slow_body(&e) && !e.is_connect() => {
                match unknown(format!("the upstream did not answer: {e}"), false) {
                    Some(held) => return held_failure(&e, held),
                    None => Err(e),
                }
            }
            other => other,
        };
        match sent {
            Ok(answer) => {
                // The answer's head is taken over as it is, not copied.
                let (mut head, body) = axum::http::Response::from(answer).into_parts();
                // Content-Length stays: the body is streamed unchanged, and a
                // HEAD answer has no other way to say its length.
                strip_hop_by_hop(&mut head.headers);
                let status = head.status;
                // Its data and its declared length; trailers are not forwarded.
                let mut response = Response::new(Body::new(DataOnly(body)));
                *response.status_mut() = status;
                *response.headers_mut() = head.headers;
                if status.is_server_error()
                    && let Some(unknown) = unknown(format!("the upstream answered {}", status.as_u16()), true)
                {
                    response.extensions_mut().insert(unknown);
                }
                response
            }
            Err(e) if is_slow_body(&e) => {
                let mut response = Problem::new(
                    StatusCode::REQUEST_TIMEOUT,
                    idem_http::slugs::BODY_TIMEOUT,
                    "Request body timed out",
                )
                .with_detail("the request body stopped arriving; the upstream got part of it and was cut off")
                .into_response(DEFAULT_PROBLEM_BASE);
                response
                    .headers_mut()
                    .insert(header::CONNECTION, HeaderValue::from_static("close"));
                response
            }
            Err(e) if e.is_timeout() => {
                problem(StatusCode::GATEWAY_TIMEOUT, "upstream-timeout", "Upstream timeout", &e)
            }
            Err(e) => problem(
                StatusCode::BAD_GATEWAY,
                "upstream-unreachable",
                "Upstream unreachable",
                &e,
            ),
        }
    }
}

/// The answer to a first caller whose upstream got the whole request and
/// then failed: a 504 or 502 problem that says the key is held.
fn held_failure(e: &reqwest::Error, held: idem_http::OutcomeUnknown) -> Response<Body> {
    tracing::warn!(error = %e, "upstream failed after it got the whole request; its outcome is unknown");
    let (status, slug, title) = if e.is_timeout() {
        (StatusCode::GATEWAY_TIMEOUT, "upstream-timeout", "Upstream timeout")
    } else {
        (StatusCode::BAD_GATEWAY, "upstream-unreachable", "Upstream failed")
    };
    let mut response = Problem::new(status, slug, title)
        .with_detail(
            "the upstream got the whole request and then did not answer: it may have applied it. The key is held \
             as an unknown outcome; a retry with the same Idempotency-Key is answered 409 until an operator \
             resolves it",
        )
        .into_response(DEFAULT_PROBLEM_BASE);
    response.extensions_mut().insert(held);
    response
}

fn problem(status: StatusCode, slug: &str, title: &str, e: &reqwest::Error) -> Response<Body> {
    #[cfg(feature = "tls")]
    if let Some(failed) = idem_tls::handshake_failure(e) {
        let upstream = e
            .url()
            .map_or("?".to_owned(), |u| format!("{}://{}", u.scheme(), u.authority()));
        tracing::error!("upstream {upstream}: {failed}");
        return Problem::new(status, slug, title)
            .with_detail("the upstream's TLS certificate was refused; nothing was recorded")
            .into_response(DEFAULT_PROBLEM_BASE);
    }
    tracing::warn!(error = %e, "upstream failed");
    Problem::new(status, slug, title)
        .with_detail("the upstream did not answer; nothing was recorded, retry with the same Idempotency-Key")
        .into_response(DEFAULT_PROBLEM_BASE)
}

impl tower_service::Service<Request<Body>> for Proxy {
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = std::pin::Pin<Box<dyn std::future::Future<Output = Result<Response<Body>, Infallible>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        let this = self.clone();
        Box::pin(async move { Ok(this.forward(req).await) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer(ip: &str) -> Peer {
        Peer(std::net::SocketAddr::new(ip.parse().unwrap(), 5555))
    }

    fn forwarding(mode: ForwardedHeaders, trusted: &[&str]) -> Forwarding {
        Forwarding {
            mode,
            trusted: Trusted::parse(&trusted.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>()).unwrap(),
        }
    }

    fn spoofed() -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(X_FORWARDED_FOR, "6.6.6.6".parse().unwrap());
        h.insert(X_FORWARDED_PROTO, "https".parse().unwrap());
        h.insert("forwarded", "for=6.6.6.6".parse().unwrap());
        for name in CLIENT_ADDRESS_HEADERS {
            h.insert(name, "6.6.6.6".parse().unwrap());
        }
        h
    }

    /// An untrusted peer's forwarding headers are replaced; a trusted proxy's are extended.
    #[test]
    fn forwarding_headers_believe_only_trusted_proxies() {
        let f = forwarding(ForwardedHeaders::Both, &["10.0.0.0/8"]);
        let host = Some(HeaderValue::from_static("api.example:8000"));
        let mut h = spoofed();
        f.apply(&mut h, Some(&peer("192.0.2.1")), host.clone());
        assert_eq!(h[X_FORWARDED_FOR], "192.0.2.1");
        assert_eq!(h[X_FORWARDED_PROTO], "http");
        assert_eq!(h[X_FORWARDED_HOST], "api.example:8000");
        assert_eq!(h["forwarded"], "for=192.0.2.1;proto=http;host=\"api.example:8000\"");
        assert_eq!(h[X_REAL_IP], "192.0.2.1", "the caller's X-Real-IP replaced");
        for name in &CLIENT_ADDRESS_HEADERS[1..] {
            assert!(!h.contains_key(*name), "the caller's {name} removed");
        }
        let mut h = spoofed();
        forwarding(ForwardedHeaders::Forwarded, &[]).apply(&mut h, Some(&peer("192.0.2.1")), None);
        assert!(
            CLIENT_ADDRESS_HEADERS.iter().all(|name| !h.contains_key(*name)),
            "Forwarded mode: removed, none added: {h:?}"
        );
        let mut h = spoofed();
        f.apply(&mut h, Some(&peer("10.0.0.5")), host.clone());
        assert_eq!(h[X_FORWARDED_FOR], "6.6.6.6, 10.0.0.5");
        assert_eq!(h[X_FORWARDED_PROTO], "https");
        assert_eq!(h[X_REAL_IP], "6.6.6.6", "a trusted proxy's X-Real-IP is kept");
        assert_eq!(
            h["forwarded"],
            "for=6.6.6.6, for=10.0.0.5;proto=http;host=\"api.example:8000\""
        );
        let mut h = HeaderMap::new();
        f.apply(&mut h, Some(&peer("::1")), None);
        assert_eq!(h["forwarded"], "for=\"[::1]\";proto=http");
        let mut h = spoofed();
        forwarding(ForwardedHeaders::None, &[]).apply(&mut h, Some(&peer("192.0.2.1")), host);
        assert_eq!(h, spoofed(), "off: the headers pass as they came");
    }
}
