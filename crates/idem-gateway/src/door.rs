//! The door: what every request meets before the idempotency layer.
//!
//! In order: the target is made canonical or refused (400
//! `path-not-canonical`), so every later step sees one spelling; a tenant
//! header from a peer that is no trusted proxy is refused (403
//! `tenant-header-untrusted`); the gateway's own endpoints are answered
//! when they share this listener; and a request that carries an
//! `Idempotency-Key` on a mutating method gets its tenant (which may take
//! an identity request to the upstream), or the answer that refuses it.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::{HeaderValue, Method, Request, Response, StatusCode, header, request::Parts};
use http_body_util::BodyExt;
use idem_core::Tenant;
use idem_http::{DEFAULT_PROBLEM_BASE, IDEMPOTENCY_KEY, Idempotency, Leased, Problem};
use tower::ServiceExt;

use crate::path::canonical_target;
use crate::proxy::Proxy;
use crate::store::AnyLease;
use crate::tenant::{Resolved, Tenants};
use crate::trust::{Peer, Trusted};

/// The prefix of the gateway's own endpoints.
pub(crate) const ADMIN_PREFIX: &str = "/_idem/";

/// The idempotency layer around the proxy.
pub(crate) type Protected = Idempotency<Proxy, Leased<AnyLease>>;

/// The door in front of the protected proxy.
#[derive(Clone)]
pub(crate) struct Door {
    pub(crate) protected: Protected,
    /// The gateway's own endpoints, when they are served on this listener.
    pub(crate) admin: Option<Router>,
    pub(crate) tenants: Arc<Tenants>,
    pub(crate) trusted: Arc<Trusted>,
    /// The most bytes of a refused request's body read before answering.
    pub(crate) drain_bytes: usize,
}

/// The tenant the door found for the layer; a keyed request without one is
/// refused (it cannot happen: the door resolves every request the layer
/// would ask about).
pub(crate) fn tenant_of(parts: &Parts) -> Result<Tenant, Problem> {
    parts.extensions.get::<Resolved>().map(|r| r.0.clone()).ok_or_else(|| {
        Problem::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "tenant-unresolved",
            "Tenant unresolved",
        )
        .with_detail("the gateway did not find this request's tenant; nothing was sent")
    })
}

/// Whether the idempotency layer will ask for this request's tenant: a key
/// on a mutating method (the layer never claims for safe methods).
fn needs_tenant(parts: &Parts) -> bool {
    !matches!(
        parts.method,
        Method::GET | Method::HEAD | Method::OPTIONS | Method::TRACE
    ) && parts.headers.contains_key(IDEMPOTENCY_KEY)
}

fn refused(status: StatusCode, slug: &str, title: &str, detail: impl Into<String>) -> Response<Body> {
    Problem::new(status, slug, title)
        .with_detail(detail)
        .into_response(DEFAULT_PROBLEM_BASE)
}

/// Reads and drops a refused request's body (bounded), so a client that
/// writes its whole body before reading gets the answer, not a reset.
async fn discard(body: Body, max: usize) {
    let read = async move {
        let mut body = std::pin::pin!(body);
        let mut seen = 0usize;
        while seen <= max {
            match body.frame().await {
                Some(Ok(frame)) => seen += frame.data_ref().map_or(0, |d| d.len()),
                _ => return,
            }
        }
    };
    let _ = tokio::time::timeout(Duration::from_secs(5), read).await;
}

impl Door {
    /// Answers one request.
    pub(crate) async fn handle(self, req: Request<Body>) -> Response<Body> {
        let (mut parts, body) = req.into_parts();
        match canonical_target(&parts.uri) {
            Ok(uri) => parts.uri = uri,
            Err(why) => {
                metrics::counter!("idem_gateway_refused_total", "reason" => "path").increment(1);
                discard(body, self.drain_bytes).await;
                let mut response = refused(
                    StatusCode::BAD_REQUEST,
                    "path-not-canonical",
                    "Path not canonical",
                    format!("{why}; send the path as the upstream should see it"),
                );
                response
                    .headers_mut()
                    .insert(header::CONNECTION, HeaderValue::from_static("close"));
                return response;
            }
        }
        if let Some(name) = self.tenants.trusted_header()
            && parts.headers.contains_key(name)
            && !self.trusted.trusts(parts.extensions.get::<Peer>())
        {
            metrics::counter!("idem_gateway_refused_total", "reason" => "untrusted_tenant_header").increment(1);
            let peer = parts
                .extensions
                .get::<Peer>()
                .map_or_else(|| "an unknown peer".to_owned(), |p| p.0.ip().to_string());
            tracing::warn!(%peer, header = %name, "a tenant header from a peer that is no trusted proxy; refused");
            discard(body, self.drain_bytes).await;
            return refused(
                StatusCode::FORBIDDEN,
                "tenant-header-untrusted",
                "Tenant header untrusted",
                format!("the {name} header is accepted only from the gateway's trusted proxies"),
            );
        }
        if let Some(admin) = &self.admin
            && parts.uri.path().starts_with(ADMIN_PREFIX)
        {
            let Ok(response) = admin.clone().oneshot(Request::from_parts(parts, body)).await;
            return response;
        }
        if needs_tenant(&parts) {
            match self.tenants.resolve(&parts).await {
                Ok(tenant) => {
                    parts.extensions.insert(Resolved(tenant));
                }
                Err(response) => {
                    metrics::counter!("idem_gateway_refused_total", "reason" => "tenant").increment(1);
                    discard(body, self.drain_bytes).await;
                    return *response;
                }
            }
        }
        let Ok(response): Result<_, Infallible> = self.protected.oneshot(Request::from_parts(parts, body)).await;
        response
    }
}
