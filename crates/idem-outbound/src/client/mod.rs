//! The client: one logical call, its attempts, their classification, and
//! the reconcile before a re-send the vendor may no longer recognise.
//!
//! One concern a file: the client and its construction here; the public
//! calls and the terms they are made under (`call.rs`); one step of a call,
//! the reconcile it may need before its attempt (`step.rs`); the schedule
//! that drives the attempts (`drive.rs`); what a failed attempt means
//! (`failure.rs`); one attempt over HTTP (`attempt.rs`); target URLs and
//! their hosts (`target.rs`).

mod attempt;
mod call;
mod drive;
mod failure;
mod step;
mod target;

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use idem_core::{SentUnder, SharedClock};
use reqwest::header::HeaderMap;

use crate::breaker::{BreakerState, Breakers};
use crate::config::OutboundConfig;
use crate::error::{OutboundError, Result};
use crate::metrics::Labels;
use crate::reconcile::Reconcile;

pub(crate) use drive::instant_after;
use target::{host_of, parse_target};

/// Whether the HTTP client that [`OutboundClient::new`] builds can speak
/// TLS: with the `tls` feature (rustls on ring, the platform's roots or the
/// configured CA file). Without it an `https://` target is refused at once
/// (never retried as if the network had failed). A client passed to
/// [`OutboundClient::with_http_client`] is the caller's to equip.
const BUILT_IN_TLS: bool = cfg!(feature = "tls");

/// A success (2xx) answer to a logical call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboundResponse {
    /// The status (200..=299).
    pub status: u16,
    /// The response headers (none when `reconciled`).
    pub headers: HeaderMap,
    /// The body, at most `max_response_body` bytes.
    pub body: Vec<u8>,
    /// Whether the body was longer than `max_response_body` (the rest was
    /// not read).
    pub body_truncated: bool,
    /// Attempts made, this one included.
    pub attempts: u32,
    /// Whether the answer is the vendor's record, found by a reconcile,
    /// rather than the answer to a send (nothing was sent for it).
    pub reconciled: bool,
}

/// What is known of a call's earlier sends, for a re-send (a lease
/// takeover, a redrive).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Earlier {
    /// When the first earlier send that may have reached the vendor started
    /// (ms, the client's clock); `None` for a first send, or when none can
    /// have reached it.
    pub first_reached_at_ms: Option<i64>,
    /// Ask the vendor before any send, whatever the horizon (an outcome
    /// held as unknown).
    pub must_reconcile: bool,
    /// The operator's override: send even past the horizon without asking
    /// (the operator has checked the vendor).
    pub past_horizon_override: bool,
    /// The latest time an earlier send may have started, when it is later
    /// than the first reach (an earlier redrive's hold): a vendor's "not
    /// applied" is trusted only once a send started then has settled.
    pub last_sent_at_ms: Option<i64>,
    /// The terms the earlier sends were made under (a dead letter's): the
    /// re-send keeps to the strictest of them and this client's own (the
    /// shorter key horizon, the longer margin and settle time), so a
    /// process with other defaults never sends blindly what was sent to a
    /// vendor that forgets sooner.
    pub sent_under: Option<SentUnder>,
}

/// What is added to the attempt timeout to make the settle time of a send:
/// a vendor's "not applied" (its lookup found nothing) is trusted only once
/// the attempt timeout plus this has passed since the last send that may
/// have reached it started. Before it the vendor is asked again after the
/// next wait, as for a vendor that says the call is in flight.
pub const SETTLE_MARGIN: Duration = Duration::from_secs(5);

/// Sends logical calls with one idempotency key across every retry, behind
/// a per-host circuit breaker. Clones are cheap and share the connection
/// pool and the breakers.
#[derive(Clone)]
pub struct OutboundClient {
    inner: Arc<Inner>,
}

#[derive(Clone)]
struct Inner {
    http: reqwest::Client,
    /// Whether `http` can speak TLS (see [`BUILT_IN_TLS`]).
    tls: bool,
    config: OutboundConfig,
    breakers: Breakers,
    labels: Arc<Labels>,
    clock: SharedClock,
    reconcile: Option<Arc<dyn Reconcile>>,
}

impl fmt::Debug for OutboundClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OutboundClient")
            .field("config", &self.inner.config)
            .field("breakers", &self.inner.breakers)
            .field("reconcile", &self.inner.reconcile.is_some())
            .finish_non_exhaustive()
    }
}

impl OutboundClient {
    /// A client with its own connection pool, on the system clock, without
    /// a reconcile hook. Redirects are not followed (a 3xx ends the call as
    /// [`OutboundError::Rejected`]).
    ///
    /// With the `tls` feature, `https://` targets are verified against the
    /// platform's roots, or only `config.ca_file`'s certificates when set.
    /// Without it an `https://` target is refused as
    /// [`OutboundError::Invalid`] at once (check targets at start with
    /// [`check_target`](Self::check_target)), or pass a client with TLS to
    /// [`with_http_client`](Self::with_http_client).
    pub fn new(config: OutboundConfig) -> Result<Self> {
        let builder = reqwest::Client::builder().redirect(reqwest::redirect::Policy::none());
        #[cfg(feature = "tls")]
        let builder = {
            let tls = idem_tls::Roots::ca_file(config.ca_file.clone())
                .client_config()
                .map_err(|e| OutboundError::InvalidConfig(e.to_string()))?;
            builder.tls_backend_preconfigured(tls)
        };
        let http = builder
            .build()
            .map_err(|e| OutboundError::InvalidConfig(format!("the HTTP client cannot be built: {e}")))?;
        Self::build(http, BUILT_IN_TLS, config)
    }

    /// A client over `http` (its TLS, proxy and pool settings). Its own
    /// timeout, if set, counts as a failed attempt; leave redirects off.
    pub fn with_http_client(http: reqwest::Client, config: OutboundConfig) -> Result<Self> {
        if config.ca_file.is_some() {
            return Err(OutboundError::InvalidConfig(
                "ca_file is for the client OutboundClient::new builds: give the CA to the reqwest client passed in"
                    .into(),
            ));
        }
        Self::build(http, true, config)
    }

    /// The HTTP client every attempt goes through (its TLS settings and
    /// connection pool), for other requests to the same vendors.
    pub fn http_client(&self) -> &reqwest::Client {
        &self.inner.http
    }

    fn build(http: reqwest::Client, tls: bool, config: OutboundConfig) -> Result<Self> {
        config.validate()?;
        let labels = Arc::new(Labels::new(config.name.clone(), config.max_host_labels));
        let on_transition = {
            let labels = labels.clone();
            Box::new(move |host: &str, to: BreakerState| {
                tracing::warn!(host, state = to.as_str(), "outbound circuit breaker changed state");
                labels.transition(host, to);
            })
        };
        Ok(Self {
            inner: Arc::new(Inner {
                http,
                tls,
                breakers: Breakers::new(config.breaker.clone(), on_transition),
                config,
                labels,
                clock: idem_core::system_clock(),
                reconcile: None,
            }),
        })
    }

    /// Reads time from `clock` for the age of earlier sends (the store's
    /// clock in production: an `AnchoredClock`, so every instance measures
    /// the same age).
    pub fn with_clock(self, clock: SharedClock) -> Self {
        let mut inner = (*self.inner).clone();
        inner.clock = clock;
        Self { inner: Arc::new(inner) }
    }

    /// Whether the client asks the vendor (a reconcile hook) before it
    /// sends again past the vendor's memory of keys.
    pub fn reconciles(&self) -> bool {
        self.inner.reconcile.is_some()
    }

    /// Asks the vendor through `reconcile` before a re-send it may no
    /// longer recognise (see the crate docs). Without one, such a re-send
    /// ends as [`OutboundError::Unknown`], never sent.
    pub fn with_reconcile(self, reconcile: Arc<dyn Reconcile>) -> Self {
        let mut inner = (*self.inner).clone();
        inner.reconcile = Some(reconcile);
        Self { inner: Arc::new(inner) }
    }

    /// The configuration.
    pub fn config(&self) -> &OutboundConfig {
        &self.inner.config
    }

    /// The clock.
    pub fn clock(&self) -> &SharedClock {
        &self.inner.clock
    }

    pub(crate) fn labels(&self) -> &Labels {
        &self.inner.labels
    }

    /// The state of the breaker of `url`'s host (`scheme://host:port`).
    pub fn breaker_state(&self, url: &str) -> Result<BreakerState> {
        let url = reqwest::Url::parse(url).map_err(|e| OutboundError::Invalid(format!("{url:?}: {e}")))?;
        Ok(self.inner.breakers.state(&host_of(&url)?))
    }

    /// Checks a target URL as every send does, so a service refuses a bad
    /// one at start: absolute `http://` (or `https://` when the client can
    /// speak TLS), a host, a port other than 0, no user information (put
    /// credentials in secret headers) and no fragment (it is never sent:
    /// `http://v/#/v1/payouts` would post to `/`).
    ///
    /// ```
    /// let client = idem_outbound::OutboundClient::new(Default::default())?;
    /// assert!(client.check_target("http://vendor:9100/v1/payouts").is_ok());
    /// for bad in ["http://vendor#", "http://u:p@vendor/", "http://vendor:0/", "http://vendor:99999/", "ftp://vendor/"] {
    ///     assert!(client.check_target(bad).is_err(), "{bad}");
    /// }
    /// // https needs the `tls` feature.
    /// assert_eq!(client.check_target("https://vendor/").is_ok(), cfg!(feature = "tls"));
    /// # Ok::<(), idem_outbound::OutboundError>(())
    /// ```
    pub fn check_target(&self, url: &str) -> Result<()> {
        parse_target(url, self.inner.tls).map(|_| ())
    }
}
