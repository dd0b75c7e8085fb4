//! Configuration: [`IdempotencyLayer`] and per-route [`RoutePolicy`].

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use http::Method;

use http::request::Parts;
use idem_core::{LeaseEngine, LeaseStore, Operation, Policy, Tenant, TxBackend, TxEngine};
use tower_layer::Layer;

use crate::drain::Drain;
use crate::problem::{DEFAULT_PROBLEM_BASE, Problem};
use crate::service::Idempotency;

/// Whether a mutating request on a route must carry a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyRequirement {
    /// A missing key is a 400 `idempotency-key-missing` problem.
    Required,
    /// A request without a key runs without deduplication.
    Optional,
}

/// How one route (one operation) behaves.
///
/// ```
/// use idem_core::{InFlight, Policy};
/// use idem_http::RoutePolicy;
/// // Payout keys live 7 days; a twin is rejected at once with 409.
/// let payouts = RoutePolicy::required()
///     .with_policy(Policy::default().with_ttl_secs(7 * 86_400).with_in_flight(InFlight::Reject));
/// assert_eq!(payouts.policy().ttl_secs(), 604_800);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RoutePolicy {
    requirement: KeyRequirement,
    policy: Policy,
}

impl RoutePolicy {
    /// Keys required, default [`Policy`].
    pub fn required() -> Self {
        Self {
            requirement: KeyRequirement::Required,
            policy: Policy::default(),
        }
    }

    /// Keys optional, default [`Policy`].
    pub fn optional() -> Self {
        Self {
            requirement: KeyRequirement::Optional,
            policy: Policy::default(),
        }
    }

    /// Sets the core policy: TTL, in-flight behaviour, what consumes a key
    /// (2xx and 3xx always; final 4xx only with
    /// [`Consume::SuccessOrFinalRejection`](idem_core::Consume); 5xx, 408,
    /// 425 and 429 never), lease length and record limit.
    pub fn with_policy(mut self, policy: Policy) -> Self {
        self.policy = policy;
        self
    }

    /// Whether a key is required.
    pub fn requirement(&self) -> KeyRequirement {
        self.requirement
    }

    /// The core policy.
    pub fn policy(&self) -> &Policy {
        &self.policy
    }
}

/// Finds the tenant of a request (for example from an authenticated
/// principal an outer layer put in the extensions). An `Err` is sent as the
/// response, and nothing is claimed.
pub type TenantFn = Arc<dyn Fn(&Parts) -> Result<Tenant, Problem> + Send + Sync>;

/// Names the operation of a request: by default
/// [`matched_route_operation`]. The name scopes keys and is a metric label,
/// so a custom function must draw it from a bounded set (never the raw path
/// or a client-chosen string). A request for which it returns `None` passes
/// through unprotected: that is the function's explicit choice.
pub type OperationFn = Arc<dyn Fn(&Parts) -> Option<Operation> + Send + Sync>;

/// The operation name of a request with no matched route: `"<METHOD> (unrouted)"`.
pub const UNROUTED: &str = "(unrouted)";

/// The method as it appears in operation names and metric labels: one of
/// the nine methods of RFC 9110 and RFC 5789 (`GET`, `HEAD`, `POST`, `PUT`,
/// `DELETE`, `CONNECT`, `OPTIONS`, `TRACE`, `PATCH`), or `OTHER` for any
/// extension method, so that clients cannot mint labels.
pub fn method_label(method: &Method) -> &'static str {
    match *method {
        Method::GET => "GET",
        Method::HEAD => "HEAD",
        Method::POST => "POST",
        Method::PUT => "PUT",
        Method::DELETE => "DELETE",
        Method::CONNECT => "CONNECT",
        Method::OPTIONS => "OPTIONS",
        Method::TRACE => "TRACE",
        Method::PATCH => "PATCH",
        _ => "OTHER",
    }
}

/// The default [`OperationFn`]: [`method_label`] and axum's matched route
/// template (`POST /v1/accounts/{id}`), never the raw path.
///
/// A request with no matched route (the layer was applied outside the
/// router, or around a router mounted with `fallback_service`, or the path
/// matched no route) is still protected: its operation is
/// `"<METHOD> (unrouted)"`, and as every fingerprint covers the concrete path
/// and query, one key sent to two paths is refused as reused (422). An
/// extension method's name is covered by the fingerprint too.
///
/// ```
/// use idem_http::matched_route_operation;
/// let (parts, ()) = http::Request::post("/v1/x/1").body(()).unwrap().into_parts();
/// assert_eq!(matched_route_operation(&parts).unwrap().as_str(), "POST (unrouted)");
/// ```
pub fn matched_route_operation(parts: &Parts) -> Option<Operation> {
    let method = method_label(&parts.method);
    let name = match parts.extensions.get::<axum::extract::MatchedPath>() {
        Some(path) => format!("{method} {}", path.as_str()),
        None => format!("{method} {UNROUTED}"),
    };
    Operation::new(name).ok()
}

/// The operation function of a new layer: [`matched_route_operation`], and
/// one error in the log (per layer) the first time a request has no matched
/// route, because that means the layer is wired outside the router.
fn default_operation() -> OperationFn {
    let logged = AtomicBool::new(false);
    Arc::new(move |parts: &Parts| {
        if parts.extensions.get::<axum::extract::MatchedPath>().is_none() && !logged.swap(true, Ordering::Relaxed) {
            tracing::error!(
                method = %parts.method,
                path = parts.uri.path(),
                "the idempotency layer received a request with no matched route: it is applied outside the \
                 router (around the whole app, to a router mounted with `fallback_service`, or with \
                 `Router::layer`, which also wraps the fallback). Such requests are still protected, scoped \
                 as \"<METHOD> (unrouted)\" with the concrete path in the fingerprint, so route policies do \
                 not apply to them. Apply the layer with `Router::route_layer` on each router, after its \
                 routes; this is logged once per layer"
            );
        }
        matched_route_operation(parts)
    })
}

/// The layer's configuration, as modes see it (not nameable outside the crate).
#[derive(Clone)]
#[allow(unreachable_pub)]
pub struct Config {
    pub(crate) default_route: RoutePolicy,
    pub(crate) routes: HashMap<String, RoutePolicy>,
    pub(crate) tenant: TenantFn,
    pub(crate) operation: OperationFn,
    pub(crate) max_request_bytes: usize,
    pub(crate) max_response_bytes: usize,
    pub(crate) problem_base: Arc<str>,
    pub(crate) drain: Drain,
    pub(crate) accept_previous_fingerprints: bool,
    pub(crate) private_headers: Arc<[http::HeaderName]>,
}

impl Config {
    pub(crate) fn route(&self, operation: &Operation) -> RoutePolicy {
        self.routes
            .get(operation.as_str())
            .copied()
            .unwrap_or(self.default_route)
    }
}

/// Transactional mode: the handler's writes, the key claim and the recorded
/// response commit as one database transaction (handlers take [`Tx`](crate::Tx)).
#[derive(Clone)]
pub struct Transactional<B> {
    pub(crate) engine: TxEngine<B>,
}

/// Lease mode: the claim commits at once with a lease; for handlers whose
/// effects are outside the database.
pub struct Leased<L> {
    pub(crate) engine: LeaseEngine<L>,
    pub(crate) streaming: Option<Streaming>,
    pub(crate) reconcile: Option<Arc<dyn crate::Reconcile>>,
}

impl<L> Clone for Leased<L> {
    fn clone(&self) -> Self {
        Self {
            engine: self.engine.clone(),
            streaming: self.streaming,
            reconcile: self.reconcile.clone(),
        }
    }
}

/// The shortest stall [`IdempotencyLayer::stream_responses`] accepts.
const MIN_STALL: std::time::Duration = std::time::Duration::from_millis(100);

/// How lease mode streams a response it records (see
/// [`IdempotencyLayer::stream_responses`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Streaming {
    /// How long the first caller may take to accept one frame before it is
    /// left behind (its response cut off) and the recording goes on alone.
    pub(crate) stall: std::time::Duration,
}

#[derive(Clone)]
pub(crate) struct Shared<M> {
    pub(crate) mode: M,
    pub(crate) config: Config,
}

/// A tower [`Layer`] giving the routes it wraps the IETF `Idempotency-Key`
/// contract. Holds configuration only; [`Idempotency`] does the work.
///
/// Limits default to 1 MiB for request bodies (larger ones get 413 before
/// anything is claimed) and 1 MiB for recorded responses.
pub struct IdempotencyLayer<M> {
    shared: Arc<Shared<M>>,
}

impl<M> Clone for IdempotencyLayer<M> {
    fn clone(&self) -> Self {
        Self {
            shared: self.shared.clone(),
        }
    }
}

impl<M> fmt::Debug for IdempotencyLayer<M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let c = &self.shared.config;
        f.debug_struct("IdempotencyLayer")
            .field("default_route", &c.default_route)
            .field("routes", &c.routes)
            .field("max_request_bytes", &c.max_request_bytes)
            .field("max_response_bytes", &c.max_response_bytes)
            .field("drain_max_bytes", &c.drain.max_bytes)
            .field("drain_timeout", &c.drain.timeout)
            .finish_non_exhaustive()
    }
}

impl<M> IdempotencyLayer<M> {
    /// A layer in `mode` with the default configuration; `tenant` names
    /// each request's tenant.
    fn with_mode(mode: M, tenant: TenantFn) -> Self {
        let config = Config {
            default_route: RoutePolicy::required(),
            routes: HashMap::new(),
            tenant,
            operation: default_operation(),
            max_request_bytes: 1 << 20,
            max_response_bytes: 1 << 20,
            problem_base: Arc::from(DEFAULT_PROBLEM_BASE),
            drain: Drain::default(),
            accept_previous_fingerprints: true,
            private_headers: Arc::from([]),
        };
        Self {
            shared: Arc::new(Shared { mode, config }),
        }
    }
}

impl<B: TxBackend + Clone> IdempotencyLayer<Transactional<B>> {
    /// A layer in transactional mode on `engine`; `tenant` names each
    /// request's tenant.
    pub fn transactional(
        engine: TxEngine<B>,
        tenant: impl Fn(&Parts) -> Result<Tenant, Problem> + Send + Sync + 'static,
    ) -> Self {
        Self::with_mode(Transactional { engine }, Arc::new(tenant))
    }
}

impl<L: LeaseStore> IdempotencyLayer<Leased<L>> {
    /// A layer in lease mode on `engine`; `tenant` names each request's tenant.
    pub fn lease(
        engine: LeaseEngine<L>,
        tenant: impl Fn(&Parts) -> Result<Tenant, Problem> + Send + Sync + 'static,
    ) -> Self {
        let mode = Leased {
            engine,
            streaming: None,
            reconcile: None,
        };
        Self::with_mode(mode, Arc::new(tenant))
    }

    /// The work this layer runs apart from its callers: once a handler may
    /// have acted, its outcome is recorded even if the caller goes away (the
    /// rest of the work then moves into a task of its own), so that the key
    /// is not left in progress. A server that stops when its last connection
    /// closes would drop such a task half-way, and the caller's retry would run the handler again: after
    /// the graceful shutdown, wait for [`Detached::idle`](idem_core::Detached::idle)
    /// (bounded) before the runtime stops.
    ///
    /// ```no_run
    /// # async fn run(layer: idem_http::IdempotencyLayer<idem_http::Leased<idem_memory::MemoryStore>>,
    /// #              app: axum::Router, listener: tokio::net::TcpListener,
    /// #              stop: impl std::future::Future<Output = ()> + Send + 'static) {
    /// let detached = layer.detached().clone();
    /// axum::serve(listener, app).with_graceful_shutdown(stop).await.unwrap();
    /// let _ = tokio::time::timeout(std::time::Duration::from_secs(60), detached.idle()).await;
    /// # }
    /// ```
    pub fn detached(&self) -> &idem_core::Detached {
        self.shared.mode.engine.detached()
    }

    /// Streams each response that is to be recorded to its first caller as
    /// the handler produces it, while recording it (default: off; the
    /// response is read whole, up to
    /// [`max_response_bytes`](Self::max_response_bytes), recorded, then sent).
    ///
    /// With streaming on:
    /// - the status, headers and each body frame reach the first caller as
    ///   they come; only the end of the body (with the last frame, when the
    ///   body tells it is the last) waits for the outcome to be recorded, so
    ///   a caller that has read the whole response can replay it at once.
    ///   Serve with `TCP_NODELAY` on (axum: `ListenerExt::tap_io` with
    ///   `set_nodelay(true)`, as `idem gateway` does):
    ///   with Nagle's algorithm, a short final write can wait for the
    ///   caller's delayed ACK (about 40 ms on Linux);
    /// - at most `max_response_bytes` are kept for the record; a longer
    ///   response still streams whole to the first caller, and retries replay
    ///   the 500 `idempotency-response-too-large` problem;
    /// - a body that fails midway cuts the first caller's response off (the
    ///   status is already sent), and retries replay the 500
    ///   `idempotency-response-failed` problem: the handler took effect;
    /// - the body is read at its own pace while the frames the first caller
    ///   has not taken yet fit in `max_response_bytes`, so a response that
    ///   fits the record is read (and recorded) whole however slow the
    ///   caller; past that, at the caller's pace. A caller that goes away, or
    ///   takes nothing for `stall` (at least 100 ms), is left behind, its
    ///   response cut off with an error; the body is still read to its end
    ///   and recorded;
    /// - HTTP/1.0 callers, and 204 and 304 answers, get the whole response as
    ///   without streaming; so does a body that declares a length of at most
    ///   16 KiB (and within the record limit): it is read whole, recorded and
    ///   then answered, which its caller cannot tell from a stream whose end
    ///   waits for the record, and it saves handing frames from task to task.
    ///
    /// Responses that are not recorded (5xx, 4xx unless the policy records
    /// rejections) stream as they always do.
    pub fn stream_responses(mut self, stall: std::time::Duration) -> Self {
        let stall = stall.max(MIN_STALL);
        Arc::make_mut(&mut self.shared).mode.streaming = Some(Streaming { stall });
        self
    }

    /// Asks `reconcile` about a key held as an unknown outcome when a retry
    /// meets it, instead of answering 409 at once: an applied request's
    /// answer is recorded and replayed, a request that was not applied is
    /// run once by this retry, and anything else keeps the key held (see
    /// [`Reconcile`](crate::Reconcile)). One retry per key asks at a time.
    pub fn reconcile(mut self, reconcile: impl crate::Reconcile) -> Self {
        Arc::make_mut(&mut self.shared).mode.reconcile = Some(Arc::new(reconcile));
        self
    }
}

impl<M: Clone> IdempotencyLayer<M> {
    fn config_mut(&mut self) -> &mut Config {
        &mut Arc::make_mut(&mut self.shared).config
    }

    /// The policy of routes with no policy of their own (default: keys
    /// required, default [`Policy`]).
    pub fn default_route(mut self, route: RoutePolicy) -> Self {
        self.config_mut().default_route = route;
        self
    }

    /// The policy of one operation, named as the operation function names it
    /// (by default `"POST /v1/transfers"`: method, space, route template).
    pub fn route(mut self, operation: impl Into<String>, route: RoutePolicy) -> Self {
        self.config_mut().routes.insert(operation.into(), route);
        self
    }

    /// Replaces how operations are named (for tower services outside axum).
    pub fn operation(mut self, f: impl Fn(&Parts) -> Option<Operation> + Send + Sync + 'static) -> Self {
        self.config_mut().operation = Arc::new(f);
        self
    }

    /// The largest request body accepted (default 1 MiB).
    pub fn max_request_bytes(mut self, bytes: usize) -> Self {
        self.config_mut().max_request_bytes = bytes;
        self
    }

    /// The largest response recorded (default 1 MiB). In transactional mode a
    /// larger response rolls the work back and answers 500
    /// `idempotency-response-too-large`, so no effect exists without its
    /// record. In lease mode the effect has already happened: the first caller
    /// gets the full response, and retries replay a 500
    /// `idempotency-response-too-large` problem naming the original status.
    pub fn max_response_bytes(mut self, bytes: usize) -> Self {
        self.config_mut().max_response_bytes = bytes;
        self
    }

    /// How many bytes of a request body are read and discarded before an
    /// early answer (413 for a body over [`max_request_bytes`](Self::max_request_bytes),
    /// 400 for a missing or invalid key), so that clients that write their
    /// whole body before reading get the answer instead of a reset
    /// connection (default 8 MiB). A body declared larger than this is not
    /// read at all: the answer is sent and the connection closed.
    pub fn drain_max_bytes(mut self, bytes: u64) -> Self {
        self.config_mut().drain.max_bytes = bytes;
        self
    }

    /// How long a body is drained before an early answer, at most
    /// (default 10 s); see [`drain_max_bytes`](Self::drain_max_bytes).
    pub fn drain_timeout(mut self, timeout: Duration) -> Self {
        self.config_mut().drain.timeout = timeout;
        self
    }

    /// Accepts only fingerprints in the current format.
    ///
    /// By default a retry is also the same request when its fingerprint in
    /// the previous format ([`FingerprintVersion::V1`](idem_core::FingerprintVersion::V1))
    /// equals the stored one, so a retry across an upgrade is replayed rather
    /// than refused with 422. The previous fingerprint is computed only when
    /// the stored one differs. V1 rounds numbers through `f64`, so two bodies
    /// that differ only past double precision match a V1 record; once no
    /// record older than the upgrade is live (after the longest key TTL),
    /// this switch closes that gap.
    pub fn strict_fingerprints(mut self) -> Self {
        self.config_mut().accept_previous_fingerprints = false;
        self
    }

    /// Marks response headers as private to the caller who got the first
    /// answer (added to those marked before; default: none). A private
    /// header reaches the first caller as the handler set it, and is never
    /// recorded (it is not stored either), so no replay carries it.
    ///
    /// Mark `Set-Cookie` private when a replay may reach another session of
    /// the tenant than the one that made the first request (the tenant is
    /// an account, not a session), or a header carrying a secret minted for
    /// one caller. `idem gateway` always marks `Set-Cookie`.
    pub fn private_headers(mut self, names: impl IntoIterator<Item = http::HeaderName>) -> Self {
        let config = self.config_mut();
        let mut all: Vec<_> = config.private_headers.to_vec();
        for name in names {
            if !all.contains(&name) {
                all.push(name);
            }
        }
        config.private_headers = Arc::from(all);
        self
    }

    /// The base of problem `type` URIs (default [`DEFAULT_PROBLEM_BASE`]).
    pub fn problem_base(mut self, base: impl Into<String>) -> Self {
        self.config_mut().problem_base = Arc::from(base.into());
        self
    }
}

impl<S, M> Layer<S> for IdempotencyLayer<M> {
    type Service = Idempotency<S, M>;

    fn layer(&self, inner: S) -> Self::Service {
        Idempotency::new(inner, self.shared.clone())
    }
}
