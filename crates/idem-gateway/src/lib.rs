//! `idem gateway`: a reverse proxy that gives any HTTP API the
//! Idempotency-Key contract of idem, in lease mode with the heartbeat.
//!
//! The gateway sits in front of an upstream that knows nothing of idem.
//! For each mutating request with a key it claims (tenant, operation, key)
//! in a lease store, forwards the request, and records the upstream's
//! answer; a retry with the same key gets the recorded answer with
//! `Idempotent-Replayed: true` and never reaches the upstream. A twin sent
//! while the first is running waits and replays, or gets 409. A 5xx, or a
//! request the upstream never answered, is not recorded: the key stays
//! usable. The lease is extended while the upstream works, so an upstream
//! slower than the lease is still called once.
//!
//! - **Operations** come from the configured routes (`POST /v1/payments/{id}`);
//!   a request no route matches is still protected, as `"<METHOD> (unrouted)"`.
//!   Every fingerprint covers the method, the concrete path, the query and
//!   the body (JSON compared exactly, spelling aside).
//! - **Tenants** come from a configured header, or else from a digest of
//!   `Authorization` (so two callers never share keys), or else are
//!   `anonymous`.
//! - **Stores**: a SQLite file (default), PostgreSQL, MySQL/MariaDB or Redis
//!   (`redis://`), the last three when several gateway instances share keys.
//! - Hop-by-hop headers (RFC 9110 §7.6.1, and those named in `Connection`)
//!   are never forwarded, either way.
//! - `GET /healthz` (the store answers) and `GET /metrics` (Prometheus) are
//!   served by the gateway itself, at `/_idem/healthz` and `/_idem/metrics`,
//!   so they never shadow an upstream route.

mod config;
mod proxy;
mod store;

use std::future::Future;
use std::sync::Arc;

use axum::Router;
use axum::http::request::Parts;
use idem_core::{LeaseEngine, Operation, SharedClock, Tenant, TimeSource};
use idem_http::{IdempotencyLayer, Problem, UNROUTED, method_label};
use sha2::{Digest, Sha256};
use tokio::net::TcpListener;

pub use config::{Config, ConfigError, Defaults, InFlightMode, KeyMode, RouteConfig};
pub use store::AnyLease;

/// Why the gateway could not start.
#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    /// The configuration is invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The store could not be reached or migrated.
    #[error("store: {0}")]
    Store(#[from] idem_core::Error),
    /// The listener failed.
    #[error("listener: {0}")]
    Io(#[from] std::io::Error),
}

/// The operation of a request: the first configured route whose method and
/// path template match, else `"<METHOD> (unrouted)"`.
fn operation_of(routes: &[(String, Vec<String>)], parts: &Parts) -> Option<Operation> {
    let method = method_label(&parts.method);
    let segments: Vec<&str> = parts.uri.path().split('/').collect();
    for (route_method, template) in routes {
        if route_method != method || template.len() != segments.len() {
            continue;
        }
        let matches = template
            .iter()
            .zip(&segments)
            .all(|(t, s)| (t.starts_with('{') && t.ends_with('}') && !s.is_empty()) || t == s);
        if matches {
            return Operation::new(format!("{method} {}", template.join("/"))).ok();
        }
    }
    Operation::new(format!("{method} {UNROUTED}")).ok()
}

/// The tenant of a request: the configured header's value, else a digest of
/// `Authorization`, else `anonymous`.
fn tenant_of(header: Option<&str>, parts: &Parts) -> Result<Tenant, Problem> {
    if let Some(name) = header {
        let value = parts.headers.get(name).and_then(|v| v.to_str().ok());
        return match value.map(Tenant::new) {
            Some(Ok(t)) => Ok(t),
            _ => Err(
                Problem::new(axum::http::StatusCode::BAD_REQUEST, "tenant-missing", "Tenant missing")
                    .with_detail(format!("send the tenant in the {name} header")),
            ),
        };
    }
    Ok(match parts.headers.get(axum::http::header::AUTHORIZATION) {
        Some(auth) => {
            let digest = Sha256::digest(auth.as_bytes());
            Tenant::new(format!("auth_{}", &hex::encode(digest)[..40])).expect("a hex digest is a valid tenant")
        }
        None => Tenant::new("anonymous").expect("a valid tenant"),
    })
}

/// The gateway's router on `store`: the protected proxy, `/_idem/healthz`
/// and `/_idem/metrics`.
pub fn router(config: &Config, store: AnyLease, clock: SharedClock) -> Result<Router, GatewayError> {
    let upstream = config.upstream()?;
    let defaults = config.defaults.policy()?;
    let mut routes = Vec::new();
    let mut layer_routes = Vec::new();
    for route in &config.routes {
        let (method, template) = route.parsed()?;
        let name = format!("{method} {}", template.join("/"));
        layer_routes.push((name, route.route_policy(&config.defaults)?));
        routes.push((method, template));
    }
    let routes = Arc::new(routes);
    let tenant_header = config.tenant_header.clone();
    let engine = LeaseEngine::new(store.clone()).with_clock(clock);
    let mut layer = IdempotencyLayer::lease(engine, move |parts: &Parts| tenant_of(tenant_header.as_deref(), parts))
        .default_route(defaults)
        .operation(move |parts: &Parts| operation_of(&routes, parts))
        .max_request_bytes(config.max_request_bytes)
        .max_response_bytes(config.max_response_bytes)
        // The upstream's answer reaches the first caller as it comes, and is
        // recorded up to max_response_bytes on the way; a caller that stops
        // reading for as long as the upstream may take is left behind.
        .stream_responses(config.upstream_timeout());
    for (name, policy) in layer_routes {
        layer = layer.route(name, policy);
    }
    let proxy = proxy::Proxy::new(upstream, config.upstream_timeout())?;
    let metrics = metrics_handle();
    let health_store = store.clone();
    Ok(Router::new()
        .route(
            "/_idem/healthz",
            axum::routing::get(move || {
                let store = health_store.clone();
                async move {
                    match store.source_now_ms().await {
                        Ok(_) => (axum::http::StatusCode::OK, "ok"),
                        Err(_) => (axum::http::StatusCode::SERVICE_UNAVAILABLE, "store unavailable"),
                    }
                }
            }),
        )
        .route(
            "/_idem/metrics",
            axum::routing::get(move || {
                let metrics = metrics.clone();
                async move { metrics.map(|m| m.render()).unwrap_or_default() }
            }),
        )
        .fallback_service(tower_layer::Layer::layer(&layer, proxy)))
}

/// The process-wide Prometheus recorder (installed on first call).
pub fn metrics_handle() -> Option<metrics_exporter_prometheus::PrometheusHandle> {
    static HANDLE: std::sync::OnceLock<Option<metrics_exporter_prometheus::PrometheusHandle>> =
        std::sync::OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
            let handle = recorder.handle();
            metrics::set_global_recorder(recorder).ok().map(|_| handle)
        })
        .clone()
}

/// Connects the configured store, migrates it, and serves on `listener`
/// until `shutdown` completes; in-flight requests are drained.
pub async fn serve(
    config: &Config,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), GatewayError> {
    let store = AnyLease::connect(config.store_url()).await?;
    let clock = idem_core::AnchoredClock::start(Arc::new(store.clone()), idem_core::AnchorOptions::default())
        .await
        .map_err(|e| ConfigError(format!("cannot read the store's clock: {e}")))?;
    let app = router(config, store, Arc::new(clock))?;
    tracing::info!(
        addr = %listener.local_addr()?,
        upstream = %config.upstream()?,
        store = config.store_kind(),
        "idem gateway listening"
    );
    // An answer streams to its caller in several writes (the end of the body
    // waits for the record): with Nagle's algorithm the last write would wait
    // for the caller's delayed ACK, some 40 ms, on every fresh request.
    let listener = axum::serve::ListenerExt::tap_io(listener, |tcp: &mut tokio::net::TcpStream| {
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!(error = %e, "cannot set TCP_NODELAY on a caller's connection");
        }
    });
    axum::serve(listener, app).with_graceful_shutdown(shutdown).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(method: &str, uri: &str, headers: &[(&str, &str)]) -> Parts {
        let mut b = axum::http::Request::builder().method(method).uri(uri);
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        b.body(()).unwrap().into_parts().0
    }

    #[test]
    fn operations_come_from_route_templates() {
        let routes = vec![
            ("POST".to_owned(), vec!["".to_owned(), "v1".into(), "payments".into()]),
            (
                "POST".to_owned(),
                vec![
                    "".to_owned(),
                    "v1".into(),
                    "payments".into(),
                    "{id}".into(),
                    "refund".into(),
                ],
            ),
        ];
        let op = |m, u| operation_of(&routes, &parts(m, u, &[])).unwrap().as_str().to_owned();
        assert_eq!(op("POST", "/v1/payments"), "POST /v1/payments");
        assert_eq!(
            op("POST", "/v1/payments/p_1/refund?x=1"),
            "POST /v1/payments/{id}/refund"
        );
        assert_eq!(op("POST", "/v1/payments//refund"), "POST (unrouted)");
        assert_eq!(op("PUT", "/v1/payments"), "PUT (unrouted)");
    }

    #[test]
    fn tenants_come_from_the_header_or_a_digest_of_authorization() {
        let t = tenant_of(Some("x-tenant"), &parts("POST", "/", &[("x-tenant", "acme")])).unwrap();
        assert_eq!(t.as_str(), "acme");
        assert!(tenant_of(Some("x-tenant"), &parts("POST", "/", &[])).is_err());
        let a = tenant_of(None, &parts("POST", "/", &[("authorization", "Bearer a")])).unwrap();
        let b = tenant_of(None, &parts("POST", "/", &[("authorization", "Bearer b")])).unwrap();
        assert_ne!(a, b);
        assert!(a.as_str().starts_with("auth_"));
        assert_eq!(tenant_of(None, &parts("POST", "/", &[])).unwrap().as_str(), "anonymous");
    }
}
