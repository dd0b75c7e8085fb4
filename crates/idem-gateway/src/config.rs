//! The gateway's configuration: flags, and a TOML file for routes.
//!
//! ```toml
//! upstream = "http://127.0.0.1:9000"
//! store = "postgres://gateway@db/gateway"   # default: ./idem-gateway.db (SQLite)
//! tenant_header = "x-tenant-id"             # default: a digest of Authorization
//!
//! [defaults]
//! key = "required"          # or "optional": no key, no deduplication
//! ttl_secs = 86400
//! in_flight = "wait"        # or "reject": a twin gets 409 at once
//! wait_ms = 10000
//! lease_ms = 30000
//! record_rejections = false # true: 4xx answers (but 408/429) consume the key too
//!
//! [[routes]]
//! method = "POST"
//! path = "/v1/payouts/{id}"
//! ttl_secs = 604800
//! ```

use std::time::Duration;

use idem_core::{Consume, InFlight, Policy};
use idem_http::RoutePolicy;
use serde::Deserialize;

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
}

impl RouteConfig {
    /// The method and the template's segments, validated.
    pub fn parsed(&self) -> Result<(String, Vec<String>), ConfigError> {
        let method = self.method.to_ascii_uppercase();
        if !matches!(method.as_str(), "POST" | "PUT" | "PATCH" | "DELETE") {
            return Err(ConfigError(format!(
                "route {} {}: only POST, PUT, PATCH and DELETE carry keys",
                self.method, self.path
            )));
        }
        let ok = self.path.starts_with('/')
            && self.path.len() <= 200
            && self.path.chars().all(|c| c.is_ascii_graphic())
            && !self.path.contains(['?', '#']);
        if !ok {
            return Err(ConfigError(format!(
                "route path {:?} must start with / and hold no spaces, query or fragment",
                self.path
            )));
        }
        Ok((method, self.path.split('/').map(str::to_owned).collect()))
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

/// The whole configuration.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// The API behind the gateway (`http://host:port`).
    pub upstream: Option<String>,
    /// The store: a SQLite path (default `./idem-gateway.db`),
    /// `postgres://…`, `mysql://…` or `redis://…`.
    pub store: Option<String>,
    /// The header naming the tenant; unset: a digest of `Authorization`.
    pub tenant_header: Option<String>,
    /// The largest request body accepted (413 above), bytes.
    #[serde(default = "default_request_bytes")]
    pub max_request_bytes: usize,
    /// The largest upstream answer recorded, bytes (a larger 2xx is
    /// answered with a problem and its key kept, never half-recorded).
    #[serde(default = "default_response_bytes")]
    pub max_response_bytes: usize,
    /// How long the upstream may take, seconds.
    #[serde(default = "default_upstream_timeout")]
    pub upstream_timeout_secs: u64,
    /// Policies of routes with none of their own.
    #[serde(default)]
    pub defaults: Defaults,
    /// Routes.
    #[serde(default)]
    pub routes: Vec<RouteConfig>,
}

fn default_request_bytes() -> usize {
    1024 * 1024
}

fn default_response_bytes() -> usize {
    1024 * 1024
}

fn default_upstream_timeout() -> u64 {
    60
}

impl Default for Config {
    fn default() -> Self {
        Self {
            upstream: None,
            store: None,
            tenant_header: None,
            max_request_bytes: default_request_bytes(),
            max_response_bytes: default_response_bytes(),
            upstream_timeout_secs: default_upstream_timeout(),
            defaults: Defaults::default(),
            routes: Vec::new(),
        }
    }
}

impl Config {
    /// Reads a TOML file.
    pub fn from_file(path: &std::path::Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError(format!("{}: {e}", path.display())))?;
        Self::from_toml(&text).map_err(|e| ConfigError(format!("{}: {}", path.display(), e.0)))
    }

    /// Parses TOML, refusing unknown settings.
    pub fn from_toml(text: &str) -> Result<Self, ConfigError> {
        let config: Config = toml::from_str(text).map_err(|e| ConfigError(e.to_string()))?;
        config.defaults.policy()?;
        for r in &config.routes {
            r.parsed()?;
            r.route_policy(&config.defaults)?;
        }
        if let Some(h) = &config.tenant_header
            && axum::http::HeaderName::from_bytes(h.as_bytes()).is_err()
        {
            return Err(ConfigError(format!("tenant_header {h:?} is not a header name")));
        }
        Ok(config)
    }

    /// The upstream URL, validated.
    pub fn upstream(&self) -> Result<reqwest::Url, ConfigError> {
        let raw = self
            .upstream
            .as_deref()
            .ok_or_else(|| ConfigError("no upstream: pass --upstream URL".into()))?;
        let url = reqwest::Url::parse(raw).map_err(|e| ConfigError(format!("upstream {raw:?}: {e}")))?;
        if !matches!(url.scheme(), "http" | "https") || url.host().is_none() {
            return Err(ConfigError(format!(
                "upstream {raw:?} must be an http:// or https:// URL"
            )));
        }
        Ok(url)
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
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_is_validated() {
        let c = Config::from_toml(
            r#"
            upstream = "http://127.0.0.1:9000"
            [defaults]
            key = "optional"
            [[routes]]
            method = "post"
            path = "/v1/payouts/{id}"
            ttl_secs = 604800
            "#,
        )
        .unwrap();
        assert_eq!(c.routes.len(), 1);
        assert_eq!(c.upstream().unwrap().as_str(), "http://127.0.0.1:9000/");
        assert!(Config::from_toml("unknown = 1").is_err());
        assert!(Config::from_toml("[[routes]]\nmethod = \"GET\"\npath = \"/x\"").is_err());
        assert!(Config::from_toml("[[routes]]\nmethod = \"POST\"\npath = \"x y\"").is_err());
        assert!(Config::from_toml("tenant_header = \"bad header\"").is_err());
        let none = Config::default();
        assert!(none.upstream().is_err());
        let ftp = Config {
            upstream: Some("ftp://x".into()),
            ..Config::default()
        };
        assert!(ftp.upstream().is_err());
    }
}
