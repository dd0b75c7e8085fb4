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
//!
//! One section a file: routes and their policies (`routes.rs`), the
//! reconcile requests (`reconcile.rs`), the upstream (`upstream.rs`), the
//! headers the gateway adds, trusts and keeps private (`headers.rs`), and
//! the bounds on time, sizes and connections (`limits.rs`); each with its
//! validation. The whole file, its defaults and the checks across sections
//! stay here.

mod headers;
mod limits;
mod reconcile;
mod routes;
mod upstream;

use serde::Deserialize;

use crate::tenant::TenantConfig;

pub use headers::ForwardedHeaders;
pub use reconcile::ReconcileConfig;
pub use routes::{Defaults, InFlightMode, KeyMode, RouteConfig, UnknownOutcome};

/// A configuration error.
#[derive(Debug, thiserror::Error)]
#[error("configuration: {0}")]
pub struct ConfigError(pub String);

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
    /// `postgres://…`, `mysql://…`, `redis://…` or
    /// `redis+sentinel://host:port,…/SERVICE`.
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
    /// How a Redis store is used (`[redis]`: `prefix`, `skip_deployment_checks`,
    /// `deployment_check_secs`, `replica_acks`, `replica_ack_timeout_ms`).
    #[serde(default)]
    pub redis: crate::store::RedisSettings,
    /// The background sweeper (`[sweeper]`: `interval_secs`, `batch`,
    /// `busy_percent`, `pause_ms`, `max_batches`).
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
        self.check_limits()?;
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
        self.check_reconciles()
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
}

#[cfg(test)]
mod tests {
    use super::upstream::redact;
    use super::*;

    /// The smallest tenant table: every test's configuration needs one.
    pub(super) const TENANT: &str = "[tenant]\nsource = \"anonymous\"\n";

    /// `extra` under an upstream, parsed and validated.
    pub(super) fn valid(extra: &str) -> Result<Config, ConfigError> {
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
            ("[redis]\nreplica_acks = 17", "replica_acks"),
            (
                "[redis]\nreplica_acks = 1\nreplica_ack_timeout_ms = 5000",
                "replica_ack_timeout_ms",
            ),
        ] {
            let e = valid(&format!("{extra}\n{TENANT}")).unwrap_err().to_string();
            assert!(e.contains(named), "{extra}: {e}");
        }
    }

    /// The sweeper's busy share is a percentage of at least 1: 0 and 101
    /// are refused naming the setting, 100 (rest only `pause_ms`) is taken.
    #[test]
    fn the_sweepers_busy_percent_is_1_to_100() {
        for bad in [0, 101] {
            let e = valid(&format!("{TENANT}[sweeper]\nbusy_percent = {bad}\n"))
                .unwrap_err()
                .to_string();
            assert_eq!(
                e,
                format!("configuration: [sweeper] busy_percent = {bad} must be 1 to 100")
            );
        }
        let c = valid(&format!("{TENANT}[sweeper]\nbusy_percent = 100\n")).unwrap();
        assert_eq!(c.sweeper.busy_percent, 100);
        assert_eq!(
            valid(TENANT).unwrap().sweeper.busy_percent,
            idem_core::DEFAULT_SWEEP_BUSY_PERCENT
        );
    }
}
