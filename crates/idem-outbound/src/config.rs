//! The client's configuration and its checks.

use std::time::Duration;

use reqwest::header::{HeaderName, HeaderValue};

use crate::error::OutboundError;
use crate::reconcile::KeyHorizon;

/// The largest response body a client may be configured to keep (64 MiB).
pub const MAX_RESPONSE_BODY_LIMIT: usize = 64 * 1024 * 1024;
/// The most retries a schedule may hold.
pub const MAX_RETRIES: usize = 64;

/// How each delay of the retry schedule is spread, so that callers that
/// failed together do not all come back at the same instant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Jitter {
    /// Every delay exactly as configured.
    None,
    /// "Full jitter": a delay `d` becomes a uniform draw in `[0, d]`. Spreads
    /// a herd best, halves the mean wait.
    Full,
    /// A delay `d` becomes a uniform draw in `[d - p%, d + p%]` (`percent` at
    /// most 100). Keeps the schedule recognisable.
    Proportional {
        /// The spread either side, in percent of the delay.
        percent: u8,
    },
}

impl Jitter {
    /// `delay` spread by this jitter.
    pub fn apply(self, delay: Duration) -> Duration {
        let nanos = u64::try_from(delay.as_nanos()).unwrap_or(u64::MAX);
        let spread = match self {
            Jitter::None => return delay,
            Jitter::Full => fastrand::u64(0..=nanos),
            Jitter::Proportional { percent } => {
                let width = nanos / 100 * u64::from(percent.min(100));
                let low = nanos - width;
                fastrand::u64(low..=nanos.saturating_add(width))
            }
        };
        Duration::from_nanos(spread)
    }
}

/// The per-host circuit breaker's settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BreakerConfig {
    /// Consecutive failed attempts on one host that open its breaker
    /// (default 5; at least 1).
    pub failure_threshold: u32,
    /// How long an open breaker rejects attempts before it lets one probe
    /// through (default 30 s).
    pub open_for: Duration,
    /// The most hosts whose breaker state is kept (default 1024). When a new
    /// host arrives past it, healthy entries (closed, no failures) are
    /// dropped first, then the least recently used.
    pub max_hosts: usize,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        Self {
            failure_threshold: 5,
            open_for: Duration::from_secs(30),
            max_hosts: 1024,
        }
    }
}

/// How an [`OutboundClient`](crate::OutboundClient) sends, retries and
/// guards a logical call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboundConfig {
    /// The `client` label of this client's metrics (default `"outbound"`).
    pub name: String,
    /// The header carrying the idempotency key (default `Idempotency-Key`).
    /// A header of this name in the request is replaced by the key.
    pub key_header: HeaderName,
    /// The wait before each retry; after the last one the call gives up
    /// (default 500 ms, 2 s, 5 s, 30 s: five attempts at most). Empty: no
    /// retries.
    pub retry_delays: Vec<Duration>,
    /// How each delay is spread (default ±20 %).
    pub jitter: Jitter,
    /// The whole logical call, waits included, ends by then (default 60 s).
    pub deadline: Duration,
    /// One attempt (connect, send, headers and body) ends by then (default
    /// 10 s), and never past the deadline.
    pub attempt_timeout: Duration,
    /// The most bytes of a response body kept (default 1 MiB); the rest is
    /// not read and the response says it was truncated.
    pub max_response_body: usize,
    /// The per-host circuit breaker.
    pub breaker: BreakerConfig,
    /// The most distinct hosts that get their own `host` metric label
    /// (default 64); later hosts share the label `other`.
    pub max_host_labels: usize,
    /// How long the vendor remembers idempotency keys (default Stripe's
    /// 24 h, trusted up to 23 h); [`KeyHorizon::NONE`] for a vendor without
    /// idempotency. A re-send past it is reconciled first.
    pub key_horizon: KeyHorizon,
    /// Per-host horizons (`scheme://host:port`), in place of `key_horizon`.
    pub host_key_horizons: Vec<(String, KeyHorizon)>,
    /// How long after the last send that may have reached the vendor its
    /// lookup's "not applied" is trusted (a vendor may still be working on
    /// a send whose caller gave up, and answer "not found" until it
    /// commits). `None` (the default): the attempt timeout plus
    /// [`SETTLE_MARGIN`](crate::SETTLE_MARGIN). Never shorter than the
    /// attempt timeout. Before it, the vendor is asked again after the
    /// next wait, as for a vendor that says the call is in flight.
    pub reconcile_settle: Option<Duration>,
    /// Headers sent with every attempt but never part of a stored request
    /// (vendor credentials): a dead letter, a listing or a log never holds
    /// them, and a redrive's client sends them again from its own
    /// configuration. Their values are marked sensitive.
    pub secret_headers: Vec<(HeaderName, HeaderValue)>,
    /// Error codes that make a `409` without `Retry-After` mean "this key is
    /// still being processed" (wait and send again within the deadline)
    /// rather than a final rejection: matched against the string values of
    /// the JSON answer's `code`, `type` and `message` fields (top level and
    /// under `error`), equal or ending in `/code` or starting with `code:`.
    /// Default: Stripe's `idempotency_key_in_use` and the Idempotency-Key
    /// draft's problem type `idempotency-key-in-flight`.
    pub in_flight_codes: Vec<String>,
    /// The CA certificates (a PEM file) that `https://` targets must be
    /// signed by, in place of the platform's roots. Needs the `tls`
    /// feature.
    pub ca_file: Option<std::path::PathBuf>,
}

/// The longest deadline a client may be configured for (one day): instants
/// built from it never overflow.
pub const MAX_DEADLINE: Duration = Duration::from_secs(24 * 3600);

impl Default for OutboundConfig {
    fn default() -> Self {
        Self {
            name: "outbound".into(),
            key_header: HeaderName::from_static("idempotency-key"),
            retry_delays: vec![
                Duration::from_millis(500),
                Duration::from_secs(2),
                Duration::from_secs(5),
                Duration::from_secs(30),
            ],
            jitter: Jitter::Proportional { percent: 20 },
            deadline: Duration::from_secs(60),
            attempt_timeout: Duration::from_secs(10),
            max_response_body: 1024 * 1024,
            breaker: BreakerConfig::default(),
            max_host_labels: 64,
            key_horizon: KeyHorizon::new(Duration::from_secs(24 * 3600), Duration::from_secs(3600)),
            host_key_horizons: Vec::new(),
            reconcile_settle: None,
            secret_headers: Vec::new(),
            in_flight_codes: vec!["idempotency_key_in_use".into(), "idempotency-key-in-flight".into()],
            ca_file: None,
        }
    }
}

impl OutboundConfig {
    /// Sets the key header by name; refused unless it is a valid header
    /// name.
    ///
    /// ```
    /// let config = idem_outbound::OutboundConfig::default().with_key_header("X-Request-Key")?;
    /// assert_eq!(config.key_header.as_str(), "x-request-key");
    /// assert!(idem_outbound::OutboundConfig::default().with_key_header("bad header").is_err());
    /// # Ok::<(), idem_outbound::OutboundError>(())
    /// ```
    pub fn with_key_header(mut self, name: &str) -> Result<Self, OutboundError> {
        self.key_header = HeaderName::from_bytes(name.as_bytes())
            .map_err(|_| OutboundError::InvalidConfig(format!("{name:?} is not a valid header name")))?;
        Ok(self)
    }

    /// Adds a secret header (see [`secret_headers`](Self::secret_headers));
    /// refused unless the name and value are valid, or when it is the key
    /// header. The value never appears in the error.
    ///
    /// ```
    /// let config = idem_outbound::OutboundConfig::default().with_secret_header("Authorization", "Bearer sk_test")?;
    /// assert!(format!("{config:?}").contains("Sensitive"));
    /// assert!(!format!("{config:?}").contains("sk_test"));
    /// # Ok::<(), idem_outbound::OutboundError>(())
    /// ```
    pub fn with_secret_header(mut self, name: &str, value: &str) -> Result<Self, OutboundError> {
        let header = HeaderName::from_bytes(name.as_bytes())
            .map_err(|_| OutboundError::InvalidConfig(format!("secret header {name:?} is not a valid header name")))?;
        let mut value = HeaderValue::from_str(value)
            .map_err(|_| OutboundError::InvalidConfig(format!("the value of secret header {name} is not valid")))?;
        value.set_sensitive(true);
        self.secret_headers.push((header, value));
        Ok(self)
    }

    /// How long after the last send a lookup's "not applied" is trusted
    /// (see [`reconcile_settle`](Self::reconcile_settle)).
    pub fn settle_after_send(&self) -> Duration {
        self.reconcile_settle
            .unwrap_or(self.attempt_timeout + crate::SETTLE_MARGIN)
    }

    /// The horizon of `host` (`scheme://host:port`, as the client names a
    /// target). An entry of `host_key_horizons` matches whatever way it is
    /// written: the port may be left out when it is the scheme's own, a
    /// trailing `/` is allowed, letters may be of either case.
    pub fn horizon_of(&self, host: &str) -> KeyHorizon {
        self.host_key_horizons
            .iter()
            .find(|(h, _)| canonical_host(h).is_some_and(|h| h.eq_ignore_ascii_case(host)))
            .map_or(self.key_horizon, |(_, k)| *k)
    }

    /// Checks the settings; the client refuses a configuration that fails.
    pub fn validate(&self) -> Result<(), OutboundError> {
        let bad = |why: String| Err(OutboundError::InvalidConfig(why));
        if self.name.is_empty() || self.name.len() > 64 {
            return bad("the name must have 1 to 64 bytes".into());
        }
        if self.retry_delays.len() > MAX_RETRIES {
            return bad(format!("at most {MAX_RETRIES} retry delays"));
        }
        if let Jitter::Proportional { percent } = self.jitter
            && percent > 100
        {
            return bad(format!("a jitter of {percent}% is over 100%"));
        }
        if self.deadline.is_zero() || self.attempt_timeout.is_zero() {
            return bad("the deadline and the attempt timeout must be positive".into());
        }
        if self.deadline > MAX_DEADLINE || self.attempt_timeout > MAX_DEADLINE {
            return bad(format!(
                "the deadline and the attempt timeout are at most {} s",
                MAX_DEADLINE.as_secs()
            ));
        }
        if let Some(settle) = self.reconcile_settle
            && (settle < self.attempt_timeout || settle > MAX_DEADLINE)
        {
            return bad(format!(
                "reconcile_settle ({} ms) must be at least the attempt timeout ({} ms) and at most {} s: \
                 a lookup asked before a send could have finished proves nothing",
                settle.as_millis(),
                self.attempt_timeout.as_millis(),
                MAX_DEADLINE.as_secs()
            ));
        }
        for (host, _) in &self.host_key_horizons {
            if canonical_host(host).is_none() {
                return bad(format!(
                    "host_key_horizons: {host:?} names no target: write scheme://host[:port], as \
                     https://api.vendor.example (no path, query or credentials)"
                ));
            }
        }
        for (host, k) in std::iter::once(&("key_horizon".to_owned(), self.key_horizon)).chain(&self.host_key_horizons) {
            if !k.horizon.is_zero() && k.margin >= k.horizon {
                return bad(format!(
                    "{host}: the horizon margin ({} s) must be shorter than the horizon ({} s)",
                    k.margin.as_secs(),
                    k.horizon.as_secs()
                ));
            }
        }
        for (name, _) in &self.secret_headers {
            if *name == self.key_header {
                return bad(format!("secret header {name} is the idempotency key header"));
            }
        }
        if self.max_response_body == 0 || self.max_response_body > MAX_RESPONSE_BODY_LIMIT {
            return bad(format!(
                "max_response_body must be between 1 and {MAX_RESPONSE_BODY_LIMIT} bytes"
            ));
        }
        if self.breaker.failure_threshold == 0 || self.breaker.open_for.is_zero() || self.breaker.max_hosts == 0 {
            return bad("the breaker needs a threshold, an open period and room for one host at least".into());
        }
        Ok(())
    }
}

/// `scheme://host:port` of a configured target, the port filled in when it
/// is the scheme's own; `None` for anything that is not just a target
/// (no scheme, a path, a query, credentials).
fn canonical_host(target: &str) -> Option<String> {
    let url = reqwest::Url::parse(target.trim()).ok()?;
    let plain = matches!(url.scheme(), "http" | "https")
        && url.username().is_empty()
        && url.password().is_none()
        && matches!(url.path(), "" | "/")
        && url.query().is_none()
        && url.fragment().is_none();
    match (plain, url.host_str(), url.port_or_known_default()) {
        (true, Some(host), Some(port)) => Some(format!("{}://{host}:{port}", url.scheme())),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The default configuration with one host's key horizon.
    fn with_host_horizon(target: &str, horizon: KeyHorizon) -> OutboundConfig {
        OutboundConfig {
            host_key_horizons: vec![(target.to_owned(), horizon)],
            ..OutboundConfig::default()
        }
    }

    /// Every way of writing a target names it; anything else is refused.
    #[test]
    fn host_key_horizons_match_however_written() {
        let keyless = KeyHorizon::NONE;
        for written in [
            "https://vendor.example",
            "https://vendor.example/",
            "https://Vendor.Example:443",
            "HTTPS://vendor.example:443/",
        ] {
            let c = with_host_horizon(written, keyless);
            c.validate().unwrap_or_else(|e| panic!("{written}: {e}"));
            assert_eq!(c.horizon_of("https://vendor.example:443"), keyless, "{written}");
            assert_eq!(
                c.horizon_of("https://vendor.example:8443"),
                c.key_horizon,
                "{written}: another port is another target"
            );
        }
        for bad in [
            "vendor.example",
            "vendor.example:443",
            "https://vendor.example/v1/payouts",
            "https://vendor.example?x=1",
            "https://user:pw@vendor.example",
            "ftp://vendor.example",
            "",
        ] {
            let c = with_host_horizon(bad, keyless);
            let e = c.validate().expect_err(bad).to_string();
            assert!(e.contains("host_key_horizons"), "{bad}: {e}");
        }
    }

    #[test]
    fn defaults_follow_the_product_schedule_and_validate() {
        let c = OutboundConfig::default();
        assert_eq!(
            c.retry_delays,
            [500, 2000, 5000, 30_000].map(Duration::from_millis).to_vec()
        );
        assert_eq!(c.key_header.as_str(), "idempotency-key");
        c.validate().unwrap();
    }

    #[test]
    fn bad_settings_are_refused() {
        let bad = [
            OutboundConfig {
                deadline: Duration::ZERO,
                ..OutboundConfig::default()
            },
            OutboundConfig {
                max_response_body: 0,
                ..OutboundConfig::default()
            },
            OutboundConfig {
                jitter: Jitter::Proportional { percent: 101 },
                ..OutboundConfig::default()
            },
            OutboundConfig {
                retry_delays: vec![Duration::ZERO; MAX_RETRIES + 1],
                ..OutboundConfig::default()
            },
            OutboundConfig {
                breaker: BreakerConfig {
                    failure_threshold: 0,
                    ..BreakerConfig::default()
                },
                ..OutboundConfig::default()
            },
        ];
        for c in bad {
            assert!(matches!(c.validate(), Err(OutboundError::InvalidConfig(_))), "{c:?}");
        }
    }

    #[test]
    fn jitter_stays_in_its_band() {
        let d = Duration::from_millis(1000);
        assert_eq!(Jitter::None.apply(d), d);
        for _ in 0..1000 {
            let full = Jitter::Full.apply(d);
            assert!(full <= d);
            let p = Jitter::Proportional { percent: 20 }.apply(d);
            assert!(
                p >= Duration::from_millis(800) && p <= Duration::from_millis(1200),
                "{p:?}"
            );
        }
        // Spread, not constant.
        let draws: std::collections::HashSet<_> = (0..50).map(|_| Jitter::Full.apply(d)).collect();
        assert!(draws.len() > 1);
    }
}
