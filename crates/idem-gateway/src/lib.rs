//! `idem gateway`: a reverse proxy that gives any HTTP API the
//! Idempotency-Key contract of idem, in lease mode with the heartbeat.
//!
//! The guide, with examples: `docs/gateway.md` in the repository.
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
//! - **The door**: every request target is made canonical or refused (400 `path-not-canonical`) before anything
//!   else, so routing, route policy, scope, fingerprint and forwarding see
//!   one spelling of it.
//! - **Operations** come from the configured routes (`POST /v1/payments/{id}`);
//!   a request no route matches is still protected, as `"<METHOD> (unrouted)"`.
//!   Every fingerprint covers the method, the canonical path, the query and
//!   the body (JSON compared exactly, spelling aside).
//! - **Tenants** come from an explicit source ([`TenantConfig`]): a digest
//!   of credentials, the principal the upstream names (an identity request,
//!   so a refreshed token keeps its keys), a header set by a trusted proxy,
//!   or one `anonymous` key space. Without one the gateway does not start.
//! - **Stores**: a SQLite file (default), PostgreSQL, MySQL/MariaDB or Redis
//!   (`redis://`, or a Redis Cluster: its seed URLs separated by commas),
//!   the last three when several gateway instances share keys. The store is
//!   migrated at start (the only `idem` process besides `idem migrate`
//!   that changes a schema); a Redis deployment is checked at start
//!   (eviction policy refused, missing persistence warned about); expired
//!   keys are swept in the background ([`Sweeper`], `[sweeper]`).
//! - **Unknown outcomes**: a request the upstream got whole and then failed
//!   (5xx, timeout, dropped connection) may have been applied; by default
//!   its key is held and retries get 409 until it is resolved, by an
//!   operator (`idem keys resolve`) or by the route's reconcile request
//!   ([`ReconcileConfig`]): the upstream is asked, with the retrying
//!   caller's own headers, and an applied request's answer is recorded and
//!   replayed, a request not applied is sent once more.
//! - Hop-by-hop headers (RFC 9110 §7.6.1, `Proxy-Authenticate` among them,
//!   and those named in `Connection`) are never forwarded, either way.
//!   `Set-Cookie` and the configured private headers reach the first caller
//!   and are never recorded or replayed.
//! - **Connections** have read timeouts: a request head must be whole within
//!   `header_read_timeout_secs`, and a body that stops arriving is answered
//!   408. A stop (SIGTERM) finishes open requests and waits for the
//!   recordings of callers that went away, bounded by the upstream timeout.
//! - `GET /healthz` (the store answers) and `GET /metrics` (Prometheus) are
//!   served by the gateway itself, at `/_idem/healthz` and `/_idem/metrics`
//!   (so they never shadow an upstream route), or on a listener of their own
//!   (`admin_listen`).

mod body;
mod config;
mod door;
mod path;
mod proxy;
mod reconcile;
mod serve;
mod store;
mod sweeper;
mod tenant;
mod trust;

use std::future::Future;
use std::sync::Arc;

use axum::Router;
use idem_core::{Detached, LeaseEngine, SharedClock, TimeSource};
use idem_http::IdempotencyLayer;
use tokio::net::TcpListener;

pub use config::{
    Config, ConfigError, Defaults, ForwardedHeaders, InFlightMode, KeyMode, ReconcileConfig, RouteConfig,
    UnknownOutcome,
};
pub use reconcile::RECONCILE_TOTAL;
pub use store::{AnyLease, RedisSettings};
pub use sweeper::{SWEEP_LAST_SUCCESS, SWEEP_RUNS, SWEEP_SECONDS, Sweeper, SweeperConfig};
pub use tenant::{IdentityConfig, TenantConfig, TenantSource};

/// Why the gateway could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
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

/// The gateway on one store: the door and protected proxy, and its own
/// endpoints.
pub struct Gateway {
    door: door::Door,
    admin: Router,
    detached: Detached,
    config: Config,
    store: AnyLease,
    deployment: store::DeploymentHealth,
}

impl Gateway {
    /// Builds the gateway of a configuration (validated here) on `store`.
    pub fn new(config: &Config, store: AnyLease, clock: SharedClock) -> Result<Self, GatewayError> {
        config.validate()?;
        let client = proxy::Proxy::client(config.upstream_timeout(), config.upstream_ca_file.as_deref())?;
        let defaults = config.defaults.policy()?;
        let mut routes = path::Routes::default();
        let mut layer_routes = Vec::new();
        for route in &config.routes {
            let (method, template) = route.parsed()?;
            let name = routes.push(method, template);
            layer_routes.push((name, route.route_policy(&config.defaults)?));
        }
        let tenant = config
            .tenant
            .as_ref()
            .ok_or_else(|| ConfigError("no tenant source".into()))?;
        let tenants = Arc::new(tenant::Tenants::new(tenant, client.clone(), &config.upstream()?)?);
        let engine = LeaseEngine::new(store.clone()).with_clock(clock);
        let detached = engine.detached().clone();
        let mut layer = IdempotencyLayer::lease(engine, door::tenant_of)
            .default_route(defaults)
            .operation(move |parts| routes.operation(&parts.method, parts.uri.path()))
            .max_request_bytes(config.max_request_bytes)
            .max_response_bytes(config.max_response_bytes)
            .private_headers(config.private_header_names()?)
            // The upstream's answer reaches the first caller as it comes, and is
            // recorded up to max_response_bytes on the way; a caller that stops
            // reading for as long as the upstream may take is left behind.
            .stream_responses(config.upstream_timeout());
        for (name, policy) in layer_routes {
            layer = layer.route(name, policy);
        }
        if let Some(reconciler) = reconcile::Reconciler::new(config, client.clone())? {
            layer = layer.reconcile(reconciler);
        }
        let proxy = proxy::Proxy::new(config, client)?;
        let deployment = store::DeploymentHealth::default();
        let admin = admin_router(store.clone(), deployment.clone());
        let door = door::Door {
            protected: tower_layer::Layer::layer(&layer, proxy),
            admin: Some(admin.clone()),
            tenants,
            trusted: Arc::new(config.trusted()?),
            drain_bytes: config.max_request_bytes,
        };
        Ok(Self {
            door,
            admin,
            detached,
            config: config.clone(),
            store,
            deployment,
        })
    }

    /// The work still running apart from its callers (recordings of
    /// callers that went away); [`serve`] waits for it before returning.
    pub fn detached(&self) -> &Detached {
        &self.detached
    }

    /// The proxy listener's handler; the gateway's own endpoints are
    /// answered there too unless they have a listener of their own.
    fn proxy_handler(&self, separate_admin: bool) -> serve::Handler {
        let mut door = self.door.clone();
        if separate_admin {
            door.admin = None;
        }
        Arc::new(move |req| Box::pin(door.clone().handle(req)))
    }

    fn admin_handler(&self) -> serve::Handler {
        let admin = self.admin.clone();
        Arc::new(move |req| {
            let admin = admin.clone();
            Box::pin(async move {
                let Ok(response) = tower::ServiceExt::oneshot(admin, req).await;
                response
            })
        })
    }

    /// Serves the proxy on `listeners.proxy` (and the gateway's own
    /// endpoints on `listeners.admin`, when given) until `shutdown`
    /// completes. Then the listeners close, open requests finish, and the
    /// recordings of callers that went away complete, all within
    /// [`Config::shutdown_grace`].
    pub async fn serve(
        self,
        listeners: Listeners,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), GatewayError> {
        let grace = self.config.shutdown_grace();
        let body = body::BodyTimeouts {
            idle: std::time::Duration::from_secs(self.config.body_read_timeout_secs),
            total: std::time::Duration::from_secs(self.config.body_total_timeout_secs),
        };
        let header_read_timeout = std::time::Duration::from_secs(self.config.header_read_timeout_secs);
        let (stop, stopped) = tokio::sync::watch::channel(false);
        // The Redis deployment checked again while serving.
        let watch = self.deployment.watch(self.store.clone(), &self.config.redis);
        let mut servers = Vec::new();
        servers.push(tokio::spawn(serve::serve(
            serve::Listener {
                listener: listeners.proxy,
                handler: self.proxy_handler(listeners.admin.is_some()),
                header_read_timeout,
                body,
                limits: serve::Limits::new(
                    self.config.max_connections,
                    self.config.max_buffered_bytes,
                    self.config.max_request_bytes,
                ),
            },
            stopped.clone(),
            grace,
        )));
        if let Some(admin) = listeners.admin {
            servers.push(tokio::spawn(serve::serve(
                serve::Listener {
                    listener: admin,
                    handler: self.admin_handler(),
                    header_read_timeout,
                    body,
                    // The admin listener's own, small: an attack on the
                    // proxy's never starves the health check.
                    limits: serve::Limits::new(64, self.config.max_request_bytes, self.config.max_request_bytes),
                },
                stopped.clone(),
                grace,
            )));
        }
        shutdown.await;
        let deadline = tokio::time::Instant::now() + grace;
        tracing::info!(
            grace_secs = grace.as_secs(),
            "idem gateway stopping: finishing open requests and recordings"
        );
        let _ = stop.send(true);
        for server in servers {
            let _ = server.await;
        }
        drop(watch);
        // A caller that went away left its request's recording running on
        // its own: the upstream may have acted, so its outcome is recorded
        // before the process ends, or the caller's retry would act again.
        let running = self.detached.running();
        if running > 0 {
            tracing::info!(running, "waiting for requests still being recorded");
        }
        if tokio::time::timeout_at(deadline, self.detached.idle()).await.is_err() {
            tracing::warn!(
                running = self.detached.running(),
                "recordings still running after the grace period are abandoned; their keys were marked sent, \
                 and are held as unknown outcomes once their leases expire"
            );
        }
        Ok(())
    }
}

/// The listeners of [`Gateway::serve`].
#[derive(Debug)]
pub struct Listeners {
    /// The proxy's.
    pub proxy: TcpListener,
    /// The gateway's own endpoints' (`/_idem/healthz`, `/_idem/metrics`);
    /// without it they are served on the proxy's listener.
    pub admin: Option<TcpListener>,
}

impl From<TcpListener> for Listeners {
    fn from(proxy: TcpListener) -> Self {
        Self { proxy, admin: None }
    }
}

/// `/_idem/healthz` (the store answers) and `/_idem/metrics` (Prometheus).
fn admin_router(store: AnyLease, deployment: store::DeploymentHealth) -> Router {
    let metrics = metrics_handle();
    Router::new()
        .route(
            "/_idem/healthz",
            axum::routing::get(move || {
                let (store, deployment) = (store.clone(), deployment.clone());
                async move {
                    if let Some(problem) = deployment.problem() {
                        return (
                            axum::http::StatusCode::SERVICE_UNAVAILABLE,
                            format!("store deployment refused: {problem}"),
                        );
                    }
                    match store.source_now_ms().await {
                        Ok(_) => (axum::http::StatusCode::OK, "ok".to_owned()),
                        Err(_) => (
                            axum::http::StatusCode::SERVICE_UNAVAILABLE,
                            "store unavailable".to_owned(),
                        ),
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

/// Validates the configuration, connects the configured store, migrates
/// it, and serves until `shutdown` completes (see [`Gateway::serve`]). The
/// admin listener is bound from `admin_listen` when `listeners` brings none.
pub async fn serve(
    config: &Config,
    listeners: impl Into<Listeners>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), GatewayError> {
    config.validate()?;
    let mut listeners = listeners.into();
    if listeners.admin.is_none()
        && let Some(addr) = &config.admin_listen
    {
        let admin = TcpListener::bind(addr)
            .await
            .map_err(|e| ConfigError(format!("admin_listen {addr}: cannot listen: {e}")))?;
        listeners.admin = Some(admin);
    }
    let store = AnyLease::connect_with(config.store_url(), &config.redis).await?;
    let clock = idem_core::AnchoredClock::start(Arc::new(store.clone()), idem_core::AnchorOptions::default())
        .await
        .map_err(|e| ConfigError(format!("cannot read the store's clock: {e}")))?;
    let _sweeper = Sweeper::start(store.clone(), Arc::new(clock.clone()), &config.sweeper)?;
    let gateway = Gateway::new(config, store, Arc::new(clock))?;
    tracing::info!(
        addr = %listeners.proxy.local_addr()?,
        admin = ?listeners.admin.as_ref().and_then(|l| l.local_addr().ok()),
        upstream = %config.upstream()?,
        store = config.store_kind(),
        "idem gateway listening"
    );
    gateway.serve(listeners, shutdown).await
}
