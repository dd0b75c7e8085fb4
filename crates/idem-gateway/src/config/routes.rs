//! Routes and their policies: the `[defaults]`, each `[[routes]]` entry
//! overriding them, and the key lifetimes a policy must keep.

use idem_core::{Consume, InFlight, Policy};
use idem_http::RoutePolicy;
use serde::Deserialize;

use super::{Config, ConfigError, ReconcileConfig};
use crate::path::Template;

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

impl Config {
    /// A key must outlive its claim: a TTL no longer than the lease or the
    /// upstream's time would let the key expire while its upstream call
    /// runs, and a twin would call the upstream again.
    pub(super) fn check_lifetimes(&self, what: &str, route: &RoutePolicy) -> Result<(), ConfigError> {
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
}

#[cfg(test)]
mod tests {
    use crate::config::tests::{TENANT, valid};

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
}
