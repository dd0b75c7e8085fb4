//! The gateway's configuration: flags, and a TOML file for routes.
//!
//! ```toml
//! upstream = "http://127.0.0.1:9000"
//! store = "postgres://gateway@db/gateway"   # default: ./idem-gateway.db (SQLite)
//! upstream_timeout_secs = 60
//! # upstream_ca_file = "/etc/ssl/upstream-ca.pem"  # an https upstream: this CA only, not the platform's roots
//! header_read_timeout_secs = 10  # a request head not whole by then: the connection is closed
//! body_read_timeout_secs = 30    # the longest wait for a request body's next bytes (then 408)
//! body_total_timeout_secs = 120  # all waits for one body's bytes together (then 408)
//! private_headers = ["x-session-token"]  # never recorded or replayed (Set-Cookie never is)
//! trusted_proxies = ["10.0.0.0/8"]       # peers whose tenant and X-Forwarded-* headers count
//! forwarded_headers = "none"     # or "x-forwarded", "forwarded", "both": added to upstream requests
//! admin_listen = "127.0.0.1:9901"  # /_idem/healthz and /_idem/metrics there, not on the proxy
//!
//! [tenant]                  # who the caller is: keys are scoped by it (required)
//! source = "credentials"    # or "identity", "header", "anonymous"
//! credentials = ["authorization", "header:x-api-key", "cookie:session"]
//!
//! [defaults]
//! key = "required"          # or "optional": no key, no deduplication
//! ttl_secs = 86400
//! in_flight = "wait"        # or "reject": a twin gets 409 at once
//! wait_ms = 10000
//! lease_ms = 30000
//! record_rejections = false # true: 4xx answers (but 408/429) consume the key too
//! on_unknown_outcome = "hold" # or "release": see UnknownOutcome
//!
//! [[routes]]
//! method = "POST"
//! path = "/v1/payouts/{id}"
//! ttl_secs = 604800
//! [routes.reconcile]        # ask the upstream about a held key (see ReconcileConfig)
//! path = "/v1/payouts/{id}"  # GET, with the retrying caller's headers
//! applied = [200]           # recorded (as 201 here) and replayed
//! applied_status = 201
//! not_applied = [404]       # the key is released and the retry sent
//! ```

use std::time::Duration;

use idem_core::{Consume, InFlight, Policy};
use idem_http::RoutePolicy;
use serde::Deserialize;

use crate::path::Template;
use crate::tenant::TenantConfig;
use crate::trust::Trusted;

/// A configuration error.
#[derive(Debug, thiserror::Error)]
#[error("configuration: {0}")]
pub struct ConfigError(pub String);

/// Whether a route needs a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum KeyMode {
    /// A mutating request without a key is refused (400).
    #[default]
    Required,
    /// A request without a key passes through without deduplication.
    Optional,
}

/// What a twin of a running request gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum InFlightMode {
    /// It waits (up to `wait_ms`) and replays.
    #[default]
    Wait,
    /// It gets 409 with `Retry-After` at once.
    Reject,
}

/// What a key becomes when the upstream got the whole request and then
/// answered 5xx, timed out or dropped the connection: the request may have
/// been applied, and nobody knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum UnknownOutcome {
    /// The key is held as an unknown outcome: retries get 409
    /// `idempotency-outcome-unknown` and the upstream is never called again
    /// for it, until `idem keys resolve` (or the route's reconcile request)
    /// says what happened. The default: never a second upstream call for a
    /// request that may have been applied.
    #[default]
    Hold,
    /// The key is released and the client's retry reaches the upstream
    /// again. Choose it only when the upstream honours the forwarded
    /// `Idempotency-Key` itself (it deduplicates the retry), or when its
    /// operation is harmless to repeat.
    Release,
}

/// The request that asks the upstream whether a request held as an
/// unknown outcome was applied (`[routes.reconcile]`, or `[defaults.reconcile]`
/// for every route holding unknown outcomes without one of its own, and for
/// requests no route matches). Sent when a retry meets the held key, with
/// the retry's own headers (its credentials and `Idempotency-Key`) as a
/// forwarded request would carry them, without a body.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReconcileConfig {
    /// `GET` (default) or `HEAD`: asking must change nothing.
    #[serde(default = "default_reconcile_method")]
    pub method: String,
    /// The upstream path (and optional query) asked: `{name}` is the
    /// request's segment under the route's `{name}`, `{key}` the
    /// idempotency key, percent-encoded. In `[defaults]` only `{key}`.
    pub path: String,
    /// The statuses (2xx) that mean the request was applied: the answer
    /// (status, end-to-end headers but private ones, body) is recorded as
    /// the key's outcome and replayed.
    #[serde(default = "default_applied")]
    pub applied: Vec<u16>,
    /// The status recorded in place of the lookup's own for an applied
    /// request (2xx or 3xx: the status the original request would have
    /// had, as 201), with the lookup's headers and body.
    pub applied_status: Option<u16>,
    /// The statuses (4xx) that mean the request was not applied: the key is
    /// released and the retry is sent. Any other answer, an error or a
    /// timeout keeps the key held.
    #[serde(default = "default_not_applied")]
    pub not_applied: Vec<u16>,
    /// How long the upstream may take to answer, milliseconds.
    #[serde(default = "default_reconcile_timeout_ms")]
    pub timeout_ms: u64,
    /// How long after the held request was sent its "not applied" answer is
    /// trusted, milliseconds: the longest the upstream may still be working
    /// on a request whose caller gave up. Before it, a "not applied" keeps
    /// the key held (409 with `Retry-After`). Default: the upstream timeout
    /// plus 5 seconds. The lookup must answer "applied" for any request the
    /// upstream applied once this long has passed since it was sent.
    pub settle_ms: Option<u64>,
}

fn default_reconcile_method() -> String {
    "GET".into()
}

fn default_applied() -> Vec<u16> {
    vec![200]
}

fn default_not_applied() -> Vec<u16> {
    vec![404]
}

fn default_reconcile_timeout_ms() -> u64 {
    5_000
}

impl ReconcileConfig {
    /// Checks the request on its own and against the route's placeholders
    /// (`names`); `what` names the table in messages.
    pub(crate) fn check<'a>(
        &self,
        what: &str,
        names: impl Iterator<Item = &'a str> + Clone,
    ) -> Result<crate::reconcile::LookupTemplate, ConfigError> {
        let method = self.method.to_ascii_uppercase();
        if !matches!(method.as_str(), "GET" | "HEAD") {
            return Err(ConfigError(format!(
                "{what}.method {:?}: asking must change nothing and send no body; use GET or HEAD",
                self.method
            )));
        }
        if self.applied.is_empty() {
            return Err(ConfigError(format!("{what}.applied: name at least one status")));
        }
        for s in &self.applied {
            if !(200..=299).contains(s) {
                return Err(ConfigError(format!(
                    "{what}.applied: {s} is not a 2xx status; only a success says the request was applied"
                )));
            }
        }
        if let Some(s) = self.applied_status
            && !(200..=399).contains(&s)
        {
            return Err(ConfigError(format!(
                "{what}.applied_status: {s} would not be recorded; use a 2xx or 3xx status"
            )));
        }
        for s in &self.not_applied {
            if !(400..=499).contains(s) || matches!(s, 401 | 403 | 407 | 408 | 409 | 425 | 429) {
                return Err(ConfigError(format!(
                    "{what}.not_applied: {s} cannot mean \"not applied\" (only a 4xx that is not 401, 403, \
                     407, 408, 409, 425 or 429: those say the lookup was refused or could not be answered now)"
                )));
            }
        }
        if self.timeout_ms == 0 || self.timeout_ms > 600_000 {
            return Err(ConfigError(format!(
                "{what}.timeout_ms must be between 1 and 600000, not {}",
                self.timeout_ms
            )));
        }
        if self.settle_ms.is_some_and(|ms| ms > 86_400_000) {
            return Err(ConfigError(format!(
                "{what}.settle_ms must be at most 86400000 (a day), not {}",
                self.settle_ms.unwrap_or_default()
            )));
        }
        crate::reconcile::LookupTemplate::parse(&self.path, names)
            .map_err(|why| ConfigError(format!("{what}.path {:?}: {why}", self.path)))
    }
}

/// The policy of routes with none of their own.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Defaults {
    /// Whether a key is needed.
    pub key: KeyMode,
    /// How long a key is kept.
    pub ttl_secs: u64,
    /// What a twin gets.
    pub in_flight: InFlightMode,
    /// How long a twin waits.
    pub wait_ms: u64,
    /// The lease (extended by the heartbeat while the upstream works).
    pub lease_ms: u64,
    /// Whether final 4xx answers consume the key.
    pub record_rejections: bool,
    /// What a possibly applied request's key becomes (`hold` or `release`).
    pub on_unknown_outcome: UnknownOutcome,
    /// How a held key is reconciled, on routes with no reconcile request
    /// of their own (only `{key}` in its path).
    pub reconcile: Option<ReconcileConfig>,
}

impl Default for Defaults {
    fn default() -> Self {
        Self {
            key: KeyMode::Required,
            ttl_secs: 86_400,
            in_flight: InFlightMode::Wait,
            wait_ms: 10_000,
            lease_ms: 30_000,
            record_rejections: false,
            on_unknown_outcome: UnknownOutcome::Hold,
            reconcile: None,
        }
    }
}

fn policy(
    key: KeyMode,
    ttl_secs: u64,
    in_flight: InFlightMode,
    wait_ms: u64,
    lease_ms: u64,
    record_rejections: bool,
) -> Result<RoutePolicy, ConfigError> {
    let policy = Policy::default()
        .with_ttl_secs(ttl_secs)
        .with_lease_ms(lease_ms)
        .with_in_flight(match in_flight {
            InFlightMode::Wait => InFlight::Wait { max_ms: wait_ms },
            InFlightMode::Reject => InFlight::Reject,
        })
        .with_consume(if record_rejections {
            Consume::SuccessOrFinalRejection
        } else {
            Consume::Success
        });
    policy.validate().map_err(|e| ConfigError(e.to_string()))?;
    Ok(match key {
        KeyMode::Required => RoutePolicy::required(),
        KeyMode::Optional => RoutePolicy::optional(),
    }
    .with_policy(policy))
}

impl Defaults {
    /// The route policy these defaults give.
    pub fn policy(&self) -> Result<RoutePolicy, ConfigError> {
        policy(
            self.key,
            self.ttl_secs,
            self.in_flight,
            self.wait_ms,
            self.lease_ms,
            self.record_rejections,
        )
    }
}

/// One route: a method and a path template (`{name}` matches one segment),
/// with any of the defaults overridden.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteConfig {
    /// `POST`, `PUT`, `PATCH` or `DELETE`.
    pub method: String,
    /// `/v1/payouts/{id}`.
    pub path: String,
    /// Overrides.
    pub key: Option<KeyMode>,
    /// Overrides.
    pub ttl_secs: Option<u64>,
    /// Overrides.
    pub in_flight: Option<InFlightMode>,
    /// Overrides.
    pub wait_ms: Option<u64>,
    /// Overrides.
    pub lease_ms: Option<u64>,
    /// Overrides.
    pub record_rejections: Option<bool>,
    /// Overrides.
    pub on_unknown_outcome: Option<UnknownOutcome>,
    /// Overrides (`[routes.reconcile]`).
    pub reconcile: Option<ReconcileConfig>,
}

impl RouteConfig {
    /// The method and the path template, validated.
    pub(crate) fn parsed(&self) -> Result<(String, Template), ConfigError> {
        let method = self.method.to_ascii_uppercase();
        if !matches!(method.as_str(), "POST" | "PUT" | "PATCH" | "DELETE") {
            return Err(ConfigError(format!(
                "route {} {}: only POST, PUT, PATCH and DELETE carry keys",
                self.method, self.path
            )));
        }
        let template = Template::parse(&self.path)
            .map_err(|why| ConfigError(format!("route {} {}: the path {why}", self.method, self.path)))?;
        Ok((method, template))
    }

    /// The route's name in messages and operation names: `POST /v1/payouts/{id}`.
    pub fn name(&self) -> String {
        format!("{} {}", self.method.to_ascii_uppercase(), self.path)
    }

    /// The route's reconcile request over `defaults`, checked against its
    /// path: none when it releases unknown outcomes.
    pub(crate) fn reconcile<'a>(
        &'a self,
        d: &'a Defaults,
    ) -> Result<Option<(&'a ReconcileConfig, crate::reconcile::LookupTemplate)>, ConfigError> {
        let (_, template) = self.parsed()?;
        let holds = self.on_unknown_outcome.unwrap_or(d.on_unknown_outcome) == UnknownOutcome::Hold;
        if let Some(own) = &self.reconcile {
            let what = format!("route {} reconcile", self.name());
            if !holds {
                return Err(ConfigError(format!(
                    "{what}: the route releases unknown outcomes (on_unknown_outcome = \"release\"), so there \
                     is nothing to reconcile; remove one of them"
                )));
            }
            if own.path.contains("{key}") && template.names().any(|n| n == "key") {
                return Err(ConfigError(format!(
                    "{what}.path: {{key}} is the idempotency key, and the route's path has a segment of that name; \
                     rename the segment"
                )));
            }
            return Ok(Some((own, own.check(&what, template.names())?)));
        }
        match &d.reconcile {
            Some(inherited) if holds => Ok(Some((
                inherited,
                inherited.check("[defaults] reconcile", std::iter::empty())?,
            ))),
            _ => Ok(None),
        }
    }

    /// The route's policy over `defaults`.
    pub fn route_policy(&self, d: &Defaults) -> Result<RoutePolicy, ConfigError> {
        policy(
            self.key.unwrap_or(d.key),
            self.ttl_secs.unwrap_or(d.ttl_secs),
            self.in_flight.unwrap_or(d.in_flight),
            self.wait_ms.unwrap_or(d.wait_ms),
            self.lease_ms.unwrap_or(d.lease_ms),
            self.record_rejections.unwrap_or(d.record_rejections),
        )
    }
}

/// Which forwarding headers the gateway adds to upstream requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "kebab-case")]
pub enum ForwardedHeaders {
    /// None: the client's own such headers pass as they came.
    #[default]
    None,
    /// `X-Forwarded-For`, `X-Forwarded-Proto` and `X-Forwarded-Host`.
    XForwarded,
    /// `Forwarded` (RFC 7239).
    Forwarded,
    /// Both.
    Both,
}

/// The whole configuration.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// The API behind the gateway (`http://host:port`, or `https://` with
    /// the `tls` feature).
    pub upstream: Option<String>,
    /// The CA certificates (PEM) an https upstream (and its identity
    /// endpoint) must be signed by, in place of the platform's roots.
    pub upstream_ca_file: Option<std::path::PathBuf>,
    /// The store: a SQLite path (default `./idem-gateway.db`),
    /// `postgres://…`, `mysql://…` or `redis://…`.
    pub store: Option<String>,
    /// Who the caller is: keys are scoped by it. Required (see
    /// [`TenantConfig`]); `idem gateway --tenant` sets it from the command line.
    pub tenant: Option<TenantConfig>,
    /// Replaced by `[tenant]`; present only to be refused with a message
    /// that says so.
    #[doc(hidden)]
    pub tenant_header: Option<String>,
    /// The largest request body accepted (413 above), bytes.
    #[serde(default = "default_request_bytes")]
    pub max_request_bytes: usize,
    /// The most connections served at once; a connection past it is
    /// answered 503 (`gateway-busy`) and closed.
    #[serde(default = "default_max_connections")]
    pub max_connections: usize,
    /// The most request-body bytes held at once, all requests together: a
    /// request whose body (its `Content-Length`, or `max_request_bytes`
    /// when chunked) would go past it is answered 503 (`gateway-busy`,
    /// `Retry-After: 1`) before any of it is read. At least
    /// `max_request_bytes`.
    #[serde(default = "default_max_buffered_bytes")]
    pub max_buffered_bytes: usize,
    /// The largest upstream answer recorded, bytes (a larger 2xx is
    /// answered with a problem and its key kept, never half-recorded).
    #[serde(default = "default_response_bytes")]
    pub max_response_bytes: usize,
    /// How long the upstream may take, seconds.
    #[serde(default = "default_upstream_timeout")]
    pub upstream_timeout_secs: u64,
    /// How long a caller may take to send a request's head (request line
    /// and headers), seconds; an idle kept-alive connection is closed after
    /// as long. A head not whole by then closes the connection.
    #[serde(default = "default_header_read_timeout")]
    pub header_read_timeout_secs: u64,
    /// The longest the gateway waits for the next bytes of a request body,
    /// seconds; then it answers 408 (`request-body-timeout`) and closes the
    /// connection.
    #[serde(default = "default_body_read_timeout")]
    pub body_read_timeout_secs: u64,
    /// All the waits for one request body's bytes together, seconds: a body
    /// trickled in just under `body_read_timeout_secs` per byte is cut
    /// off (408) once its waits add up to this.
    #[serde(default = "default_body_total_timeout")]
    pub body_total_timeout_secs: u64,
    /// Response headers that reach the first caller and are never recorded
    /// or replayed; `Set-Cookie` always is one.
    #[serde(default)]
    pub private_headers: Vec<String>,
    /// Peers (addresses or CIDR blocks: `10.0.0.0/8`, `::1`) whose tenant
    /// header (`tenant.source = "header"`) and forwarding headers count.
    #[serde(default)]
    pub trusted_proxies: Vec<String>,
    /// Which forwarding headers are added to upstream requests.
    #[serde(default)]
    pub forwarded_headers: ForwardedHeaders,
    /// Where `/_idem/healthz` and `/_idem/metrics` are served instead of the
    /// proxy's listener (`127.0.0.1:9901`); the proxy then forwards every path.
    pub admin_listen: Option<String>,
    /// Policies of routes with none of their own.
    #[serde(default)]
    pub defaults: Defaults,
    /// Routes.
    #[serde(default)]
    pub routes: Vec<RouteConfig>,
    /// How a Redis store is used (`[redis]`: `prefix`, `skip_deployment_checks`).
    #[serde(default)]
    pub redis: crate::store::RedisSettings,
    /// The background sweeper (`[sweeper]`: `interval_secs`, `batch`,
    /// `pause_ms`, `max_batches`).
    #[serde(default)]
    pub sweeper: crate::sweeper::SweeperConfig,
}

fn default_request_bytes() -> usize {
    1024 * 1024
}

fn default_max_connections() -> usize {
    1024
}

fn default_max_buffered_bytes() -> usize {
    64 * 1024 * 1024
}

fn default_response_bytes() -> usize {
    1024 * 1024
}

fn default_upstream_timeout() -> u64 {
    60
}

fn default_header_read_timeout() -> u64 {
    10
}

fn default_body_read_timeout() -> u64 {
    30
}

fn default_body_total_timeout() -> u64 {
    120
}

impl Default for Config {
    fn default() -> Self {
        Self {
            upstream: None,
            upstream_ca_file: None,
            store: None,
            tenant: None,
            tenant_header: None,
            max_request_bytes: default_request_bytes(),
            max_connections: default_max_connections(),
            max_buffered_bytes: default_max_buffered_bytes(),
            max_response_bytes: default_response_bytes(),
            upstream_timeout_secs: default_upstream_timeout(),
            header_read_timeout_secs: default_header_read_timeout(),
            body_read_timeout_secs: default_body_read_timeout(),
            body_total_timeout_secs: default_body_total_timeout(),
            private_headers: Vec::new(),
            trusted_proxies: Vec::new(),
            forwarded_headers: ForwardedHeaders::None,
            admin_listen: None,
            defaults: Defaults::default(),
            routes: Vec::new(),
            redis: crate::store::RedisSettings::default(),
            sweeper: crate::sweeper::SweeperConfig::default(),
        }
    }
}

/// Whether the gateway can call `https://` upstreams: only with TLS built
/// in (the `tls` feature); without it such an upstream is refused at start
/// rather than answered with a 502 on every request.
const TLS: bool = cfg!(feature = "tls");

impl Config {
    /// Reads a TOML file.
    pub fn from_file(path: &std::path::Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError(format!("{}: {e}", path.display())))?;
        Self::from_toml(&text).map_err(|e| ConfigError(format!("{}: {}", path.display(), e.0)))
    }

    /// Parses TOML, refusing unknown settings and settings that are wrong
    /// on their own; [`validate`](Self::validate) checks the whole.
    pub fn from_toml(text: &str) -> Result<Self, ConfigError> {
        let config: Config = toml::from_str(text).map_err(|e| ConfigError(e.to_string()))?;
        config.defaults.policy()?;
        config.sweeper.validate()?;
        for r in &config.routes {
            r.parsed()?;
            r.route_policy(&config.defaults)?;
        }
        Ok(config)
    }

    /// Checks the whole configuration, as the gateway does at start: every
    /// setting on its own, and those that only make sense together (a
    /// tenant source, key lifetimes longer than leases and upstream calls,
    /// trusted proxies for a tenant header). The message names the setting.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.tenant_header.is_some() {
            return Err(ConfigError(
                "tenant_header is replaced by [tenant]: source = \"header\", header = \"…\", and \
                 trusted_proxies naming the proxies that set it"
                    .into(),
            ));
        }
        self.upstream()?;
        let tenant = self.tenant.as_ref().ok_or_else(|| {
            ConfigError(
                "no tenant source: keys are scoped by the caller, so say who the caller is with [tenant] \
                 (source = \"credentials\", \"identity\", \"header\" or \"anonymous\") or --tenant \
                 (for example --tenant authorization); see the README"
                    .into(),
            )
        })?;
        tenant.validate(!self.trusted_proxies.is_empty())?;
        self.trusted()?;
        self.private_header_names()?;
        for (name, secs) in [
            ("header_read_timeout_secs", self.header_read_timeout_secs),
            ("body_read_timeout_secs", self.body_read_timeout_secs),
            ("body_total_timeout_secs", self.body_total_timeout_secs),
            ("upstream_timeout_secs", self.upstream_timeout_secs),
        ] {
            if secs == 0 || secs > 3600 {
                return Err(ConfigError(format!("{name} must be between 1 and 3600, not {secs}")));
            }
        }
        if self.redis.deployment_check_secs > 86_400 {
            return Err(ConfigError(format!(
                "[redis] deployment_check_secs must be at most 86400 (0: only at start), not {}",
                self.redis.deployment_check_secs
            )));
        }
        if self.max_connections == 0 || self.max_connections > 1_000_000 {
            return Err(ConfigError(format!(
                "max_connections must be between 1 and 1000000, not {}",
                self.max_connections
            )));
        }
        if self.max_buffered_bytes < self.max_request_bytes {
            return Err(ConfigError(format!(
                "max_buffered_bytes ({}) must be at least max_request_bytes ({}): a request of the largest \
                 accepted size could never be served",
                self.max_buffered_bytes, self.max_request_bytes
            )));
        }
        if let Some(addr) = &self.admin_listen {
            addr.parse::<std::net::SocketAddr>().map_err(|e| {
                ConfigError(format!(
                    "admin_listen {addr:?}: {e} (write host:port, as 127.0.0.1:9901)"
                ))
            })?;
        }
        self.check_lifetimes("[defaults]", &self.defaults.policy()?)?;
        for route in &self.routes {
            self.check_lifetimes(&format!("route {}", route.name()), &route.route_policy(&self.defaults)?)?;
        }
        if let Some(d) = &self.defaults.reconcile {
            if self.defaults.on_unknown_outcome != UnknownOutcome::Hold {
                return Err(ConfigError(
                    "[defaults] reconcile: the defaults release unknown outcomes (on_unknown_outcome = \"release\"), \
                     so there is nothing to reconcile; remove one of them"
                        .into(),
                ));
            }
            d.check("[defaults] reconcile", std::iter::empty())?;
            self.check_settle("[defaults] reconcile", d)?;
        }
        for route in &self.routes {
            if let Some((rc, _)) = route.reconcile(&self.defaults)? {
                self.check_settle(&format!("route {} reconcile", route.name()), rc)?;
            }
        }
        Ok(())
    }

    /// A "not applied" must not be trusted while the upstream may still be
    /// working on the request: a settle time shorter than the upstream
    /// timeout would send a request again that is about to be applied.
    fn check_settle(&self, what: &str, rc: &ReconcileConfig) -> Result<(), ConfigError> {
        match rc.settle_ms {
            Some(ms) if u128::from(ms) < self.upstream_timeout().as_millis() => Err(ConfigError(format!(
                "{what}.settle_ms ({ms}) must be at least upstream_timeout_secs ({}) in milliseconds:                  the upstream may still apply a request that long after it was sent",
                self.upstream_timeout_secs
            ))),
            _ => Ok(()),
        }
    }

    /// A key must outlive its claim: a TTL no longer than the lease or the
    /// upstream's time would let the key expire while its upstream call
    /// runs, and a twin would call the upstream again.
    fn check_lifetimes(&self, what: &str, route: &RoutePolicy) -> Result<(), ConfigError> {
        let policy = route.policy();
        let ttl_ms = policy.ttl_secs().saturating_mul(1000);
        if ttl_ms <= policy.lease_ms() {
            return Err(ConfigError(format!(
                "{what}: ttl_secs ({}) must be longer than lease_ms ({} ms): the key would expire while its \
                 claim is held",
                policy.ttl_secs(),
                policy.lease_ms()
            )));
        }
        if policy.ttl_secs() <= self.upstream_timeout_secs {
            return Err(ConfigError(format!(
                "{what}: ttl_secs ({}) must be longer than upstream_timeout_secs ({}): the key could expire \
                 while its upstream call runs",
                policy.ttl_secs(),
                self.upstream_timeout_secs
            )));
        }
        Ok(())
    }

    /// The upstream URL, validated: `http://`, or `https://` when TLS is
    /// built in, with no user, password, query or fragment. Messages show
    /// the URL without its user and password.
    pub fn upstream(&self) -> Result<reqwest::Url, ConfigError> {
        let raw = self
            .upstream
            .as_deref()
            .ok_or_else(|| ConfigError("no upstream: pass --upstream URL".into()))?;
        let shown = redact(raw);
        let url = reqwest::Url::parse(raw).map_err(|e| ConfigError(format!("upstream {shown:?}: {e}")))?;
        if !matches!(url.scheme(), "http" | "https") || url.host().is_none() {
            return Err(ConfigError(format!(
                "upstream {shown:?} must be an http:// or https:// URL"
            )));
        }
        if url.scheme() == "https" && !TLS {
            return Err(ConfigError(format!(
                "upstream {shown:?}: this build has no TLS, so an https:// upstream cannot be called; use \
                 http:// (a TLS-terminating proxy next to the upstream) or a build with the `tls` feature"
            )));
        }
        if url.query().is_some() || url.fragment().is_some() || !url.username().is_empty() || url.password().is_some() {
            return Err(ConfigError(format!(
                "upstream {shown:?} must be scheme, host, port and an optional base path: no query, fragment, \
                 user or password"
            )));
        }
        Ok(url)
    }

    /// The trusted proxies, parsed.
    pub(crate) fn trusted(&self) -> Result<Trusted, ConfigError> {
        Trusted::parse(&self.trusted_proxies).map_err(|why| ConfigError(format!("trusted_proxies: {why}")))
    }

    /// The private headers: `Set-Cookie` and those configured.
    pub(crate) fn private_header_names(&self) -> Result<Vec<axum::http::HeaderName>, ConfigError> {
        let mut names = vec![axum::http::header::SET_COOKIE];
        for h in &self.private_headers {
            let name = axum::http::HeaderName::from_bytes(h.as_bytes())
                .map_err(|_| ConfigError(format!("private_headers: {h:?} is not a header name")))?;
            if !names.contains(&name) {
                names.push(name);
            }
        }
        Ok(names)
    }

    /// The store URL (default: a SQLite file in the working directory).
    pub fn store_url(&self) -> &str {
        self.store.as_deref().unwrap_or("./idem-gateway.db")
    }

    /// The store's kind, for logs.
    pub fn store_kind(&self) -> &'static str {
        let url = self.store_url();
        if url.starts_with("postgres") {
            "postgres"
        } else if url.starts_with("mysql") || url.starts_with("mariadb") {
            "mysql"
        } else if url.starts_with("redis") {
            "redis"
        } else {
            "sqlite"
        }
    }

    /// How long the upstream may take.
    pub fn upstream_timeout(&self) -> Duration {
        Duration::from_secs(self.upstream_timeout_secs.max(1))
    }

    /// How long a graceful shutdown may take: the upstream's time, and a
    /// margin to record the last outcomes.
    pub fn shutdown_grace(&self) -> Duration {
        self.upstream_timeout() + Duration::from_secs(10)
    }
}

/// `raw` with any user and password between `://` and the host replaced
/// by `***`, for messages.
fn redact(raw: &str) -> String {
    let Some(start) = raw.find("://").map(|i| i + 3) else {
        return raw.to_owned();
    };
    let authority_end = raw[start..].find(['/', '?', '#']).map_or(raw.len(), |i| start + i);
    match raw[start..authority_end].rfind('@') {
        Some(at) => format!("{}***{}", &raw[..start], &raw[start + at..]),
        None => raw.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TENANT: &str = "[tenant]\nsource = \"anonymous\"\n";

    fn valid(extra: &str) -> Result<Config, ConfigError> {
        let c = Config::from_toml(&format!("upstream = \"http://127.0.0.1:9000\"\n{extra}"))?;
        c.validate()?;
        Ok(c)
    }

    #[test]
    fn a_file_is_validated() {
        let c = valid(&format!(
            r#"{TENANT}
            [defaults]
            key = "optional"
            [[routes]]
            method = "post"
            path = "/v1/payouts/{{id}}"
            ttl_secs = 604800
            "#
        ))
        .unwrap();
        assert_eq!(c.routes.len(), 1);
        assert_eq!(c.upstream().unwrap().as_str(), "http://127.0.0.1:9000/");
        assert!(Config::from_toml("unknown = 1").is_err());
        assert!(Config::from_toml("[[routes]]\nmethod = \"GET\"\npath = \"/x\"").is_err());
        assert!(Config::from_toml("[[routes]]\nmethod = \"POST\"\npath = \"x y\"").is_err());
        assert!(Config::from_toml("[[routes]]\nmethod = \"POST\"\npath = \"/a/../b\"").is_err());
        let none = Config::default();
        assert!(none.upstream().is_err());
        let ftp = Config {
            upstream: Some("ftp://x".into()),
            ..Config::default()
        };
        assert!(ftp.upstream().is_err());
        for bad in [
            "http://u:secret@up",
            "http://:secret@up",
            "http://up/?x=1",
            "http://up/#f",
        ] {
            let c = Config {
                upstream: Some(bad.into()),
                ..Config::default()
            };
            let e = c.upstream().unwrap_err().to_string();
            assert!(!e.contains("secret"), "{e}");
        }
        assert_eq!(redact("http://u:p@h:1/x@y"), "http://***@h:1/x@y");
        assert_eq!(redact("http://h/x"), "http://h/x");
    }

    /// Without a tenant source the gateway refuses to start, naming the setting.
    #[test]
    fn a_tenant_source_is_required() {
        let e = valid("").unwrap_err().to_string();
        assert!(e.contains("[tenant]") && e.contains("--tenant"), "{e}");
        let e = valid("tenant_header = \"x-tenant\"").unwrap_err().to_string();
        assert!(e.contains("replaced by [tenant]"), "{e}");
    }

    /// An https:// upstream is refused while no TLS is built in.
    #[test]
    fn https_needs_tls() {
        let c = Config {
            upstream: Some("https://127.0.0.1:9443".into()),
            ..Config::default()
        };
        let e = c.upstream().map(|_| ()).map_err(|e| e.to_string());
        if TLS {
            assert!(e.is_ok());
        } else {
            let e = e.unwrap_err();
            assert!(e.contains("no TLS") && e.contains("https://127.0.0.1:9443"), "{e}");
        }
    }

    /// A key TTL no longer than the lease or the upstream timeout is refused at start, naming the route.
    #[test]
    fn a_ttl_shorter_than_the_call_is_refused() {
        let e = valid(&format!("{TENANT}[defaults]\nttl_secs = 45\n"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("[defaults]") && e.contains("upstream_timeout_secs (60)"),
            "{e}"
        );
        let e = valid(&format!("{TENANT}[defaults]\nttl_secs = 100\nlease_ms = 100000\n"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("lease_ms (100000 ms)"), "{e}");
        let e = valid(&format!(
            "{TENANT}[[routes]]\nmethod = \"POST\"\npath = \"/v1/quick\"\nttl_secs = 5\n"
        ))
        .unwrap_err()
        .to_string();
        assert!(e.contains("route POST /v1/quick"), "{e}");
        assert!(valid(&format!("upstream_timeout_secs = 4\n{TENANT}[[routes]]\nmethod = \"POST\"\npath = \"/v1/quick\"\nttl_secs = 5\nlease_ms = 1000\n")).is_ok());
    }

    /// A reconcile request that cannot work is refused at start, naming the setting; a good one is kept.
    #[test]
    fn reconcile_requests_are_checked() {
        let route = |path: &str, reconcile: &str| {
            format!("{TENANT}[[routes]]\nmethod = \"POST\"\npath = \"{path}\"\n[routes.reconcile]\n{reconcile}\n")
        };
        let c = valid(&route(
            "/v1/payouts/{id}",
            "path = \"/v1/payouts/{id}/by-key/{key}?x={id}\"",
        ))
        .unwrap();
        let r = c.routes[0].reconcile.as_ref().unwrap();
        assert_eq!(
            (r.method.as_str(), r.applied.as_slice(), r.not_applied.as_slice()),
            ("GET", &[200][..], &[404][..])
        );
        assert!(
            valid(&format!(
                "{TENANT}[defaults.reconcile]\npath = \"/v1/keys/{{key}}\"\nmethod = \"head\"\n"
            ))
            .is_ok()
        );
        for (config, named) in [
            (
                route("/v1/p/{id}", "path = \"/v1/p/{nope}\""),
                "route POST /v1/p/{id} reconcile.path",
            ),
            (
                route("/v1/p/{id}", "path = \"/v1/p/{id}\"\nmethod = \"POST\""),
                "reconcile.method",
            ),
            (
                route("/v1/p/{id}", "path = \"/v1/p/{id}\"\napplied = [404]"),
                "reconcile.applied",
            ),
            (
                route("/v1/p/{id}", "path = \"/v1/p/{id}\"\napplied = []"),
                "reconcile.applied",
            ),
            (
                route("/v1/p/{id}", "path = \"/v1/p/{id}\"\napplied_status = 500"),
                "reconcile.applied_status",
            ),
            (
                route("/v1/p/{id}", "path = \"/v1/p/{id}\"\nnot_applied = [401]"),
                "reconcile.not_applied",
            ),
            (
                route("/v1/p/{id}", "path = \"/v1/p/{id}\"\nnot_applied = [200]"),
                "reconcile.not_applied",
            ),
            (
                route("/v1/p/{id}", "path = \"/v1/p/{id}\"\ntimeout_ms = 0"),
                "reconcile.timeout_ms",
            ),
            (route("/v1/p/{id}", "path = \"/v1/p/./{id}\""), "reconcile.path"),
            (route("/v1/p/{key}", "path = \"/v1/p/{key}\""), "rename the segment"),
            (
                format!(
                    "{TENANT}[[routes]]\nmethod = \"POST\"\npath = \"/v1/p/{{id}}\"\non_unknown_outcome = \"release\"\n\
                     [routes.reconcile]\npath = \"/v1/p/{{id}}\"\n"
                ),
                "nothing to reconcile",
            ),
            (
                format!("{TENANT}[defaults.reconcile]\npath = \"/v1/p/{{id}}\"\n"),
                "[defaults] reconcile.path",
            ),
            (
                format!(
                    "{TENANT}[defaults]\non_unknown_outcome = \"release\"\n[defaults.reconcile]\npath = \"/k/{{key}}\"\n"
                ),
                "[defaults] reconcile",
            ),
            (
                route("/v1/p/{id}", "path = \"/v1/p/{id}\"\nretries = 3"),
                "unknown field",
            ),
        ] {
            let e = Config::from_toml(&format!("upstream = \"http://127.0.0.1:9000\"\n{config}"))
                .and_then(|c| c.validate())
                .unwrap_err()
                .to_string();
            assert!(e.contains(named), "{config}\n{e}");
        }
    }

    /// Settings wrong on their own name themselves.
    #[test]
    fn bad_settings_are_named() {
        for (extra, named) in [
            ("private_headers = [\"bad header\"]", "private_headers"),
            ("trusted_proxies = [\"10.0.0.0/33\"]", "trusted_proxies"),
            ("header_read_timeout_secs = 0", "header_read_timeout_secs"),
            ("admin_listen = \"nowhere\"", "admin_listen"),
            ("max_connections = 0", "max_connections"),
            ("max_buffered_bytes = 1000", "max_buffered_bytes"),
            (
                "[redis]\ndeployment_check_secs = 18446744073709551615",
                "deployment_check_secs",
            ),
        ] {
            let e = valid(&format!("{extra}\n{TENANT}")).unwrap_err().to_string();
            assert!(e.contains(named), "{extra}: {e}");
        }
    }
}
