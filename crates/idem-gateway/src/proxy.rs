//! Forwarding to the upstream: the request as it came (hop-by-hop headers
//! aside), the answer streamed back.

use std::convert::Infallible;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderMap, HeaderName, Request, Response, StatusCode, header};
use futures_util::TryStreamExt;
use idem_http::{DEFAULT_PROBLEM_BASE, Problem};

use crate::ConfigError;

/// The hop-by-hop headers of RFC 9110 §7.6.1 (and the obsolete ones proxies
/// still meet); they belong to one connection and are never forwarded.
const HOP_BY_HOP: [&str; 8] = [
    "connection",
    "proxy-connection",
    "keep-alive",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "proxy-authorization",
];

/// Removes hop-by-hop headers, and every header `Connection` names.
pub(crate) fn strip_hop_by_hop(headers: &mut HeaderMap) {
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

/// The upstream as a tower service.
#[derive(Clone)]
pub(crate) struct Proxy {
    client: reqwest::Client,
    upstream: Arc<reqwest::Url>,
}

impl Proxy {
    pub(crate) fn new(upstream: reqwest::Url, timeout: Duration) -> Result<Self, ConfigError> {
        let client = reqwest::Client::builder()
            .timeout(timeout)
            .redirect(reqwest::redirect::Policy::none())
            .pool_max_idle_per_host(64)
            .build()
            .map_err(|e| ConfigError(format!("HTTP client: {e}")))?;
        Ok(Self {
            client,
            upstream: Arc::new(upstream),
        })
    }

    async fn forward(self, req: Request<Body>) -> Response<Body> {
        let (mut parts, body) = req.into_parts();
        let mut url = (*self.upstream).clone();
        let base = url.path().trim_end_matches('/').to_owned();
        url.set_path(&format!("{base}{}", parts.uri.path()));
        url.set_query(parts.uri.query());
        strip_hop_by_hop(&mut parts.headers);
        // reqwest sets Host for the upstream.
        parts.headers.remove(header::HOST);
        let sent = self
            .client
            .request(parts.method, url)
            .headers(parts.headers)
            .body(reqwest::Body::wrap_stream(body.into_data_stream()))
            .send()
            .await;
        match sent {
            Ok(answer) => {
                let status = answer.status();
                let mut headers = answer.headers().clone();
                strip_hop_by_hop(&mut headers);
                headers.remove(header::CONTENT_LENGTH);
                let mut response = Response::new(Body::from_stream(answer.bytes_stream().map_err(axum::Error::new)));
                *response.status_mut() = status;
                *response.headers_mut() = headers;
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

fn problem(status: StatusCode, slug: &str, title: &str, e: &reqwest::Error) -> Response<Body> {
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

    #[test]
    fn hop_by_hop_headers_are_removed() {
        let mut h = HeaderMap::new();
        h.insert("connection", "keep-alive, x-secret-hop".parse().unwrap());
        h.insert("x-secret-hop", "1".parse().unwrap());
        h.insert("keep-alive", "timeout=5".parse().unwrap());
        h.insert("transfer-encoding", "chunked".parse().unwrap());
        h.insert("idempotency-key", "\"k\"".parse().unwrap());
        h.insert("content-type", "application/json".parse().unwrap());
        strip_hop_by_hop(&mut h);
        let mut left: Vec<&str> = h.keys().map(|k| k.as_str()).collect();
        left.sort_unstable();
        assert_eq!(left, vec!["content-type", "idempotency-key"]);
    }
}
