//! The client: one logical call, its attempts, their classification, and
//! the reconcile before a re-send the vendor may no longer recognise.

use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime};

use backon::Retryable;
use idem_core::{
    IdempotencyKey, OutboundRequest, Retryable as Transience, SentUnder, SharedClock, http_status_retryable,
};
use reqwest::header::{self, HeaderMap, HeaderName, HeaderValue};
use tokio::time::Instant;
use tracing::Instrument;

use crate::breaker::{Admission, BreakerState, Breakers};
use crate::config::{Jitter, OutboundConfig};
use crate::error::{OutboundError, Result, snippet};
use crate::metrics::Labels;
use crate::reconcile::{KeyHorizon, Reconcile, Reconciled};
use crate::retry_after::parse_retry_after;

/// Request headers never copied from a stored request: the connection's
/// own (the client sets them for each attempt).
const FRAMING_HEADERS: [&str; 9] = [
    "host",
    "content-length",
    "transfer-encoding",
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "upgrade",
];

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

/// The shortest wait a call the breaker refused is deferred by (a probe in
/// flight says "now" until it ends).
const MIN_BREAKER_WAIT: Duration = Duration::from_secs(1);

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

/// Why one attempt did not end the call with a success.
#[derive(Debug)]
pub(crate) enum Failure {
    /// An answer that is not a success; retried or final by its status.
    Status {
        status: u16,
        body: Vec<u8>,
        /// What `Retry-After` asked for (429, 503, and 409: see
        /// [`Failure::transient`]).
        retry_after: Option<Duration>,
        /// A 409 whose body says the key is still being processed.
        in_flight: bool,
    },
    /// No complete answer within the attempt's time.
    Timeout(Option<Duration>),
    /// No connection (refused, DNS): the request was not sent.
    Connect(String),
    /// Reset, closed, the body cut off: the request may have arrived.
    Network(String),
    /// Not sent: the host's breaker refused it.
    CircuitOpen {
        host: Arc<str>,
        state: BreakerState,
        retry_in: Duration,
    },
    /// Not sent: the vendor, asked, is still processing this call.
    VendorBusy,
    /// Not sent: the vendor could not be asked.
    ReconcileFailed(String),
    /// Not sent, and not to be sent on a guess: the outcome is unknown.
    Held(String),
    /// Not sent: the caller's guard said it may no longer send.
    Stopped(String),
    /// Cannot be sent at all.
    Invalid(String),
}

impl Failure {
    fn transient(&self) -> bool {
        match self {
            // A 409 with `Retry-After` is the Idempotency-Key draft's "a
            // request with this key is still being processed", and one whose
            // body says so (Stripe's `idempotency_key_in_use`) means the
            // same: the same key is sent again after the wait, never
            // dead-lettered for it.
            Failure::Status {
                status: 409,
                retry_after: Some(_),
                ..
            }
            | Failure::Status { in_flight: true, .. } => true,
            Failure::Status { status, .. } => http_status_retryable(*status) == Transience::Transient,
            Failure::Invalid(_) | Failure::Held(_) | Failure::Stopped(_) => false,
            Failure::Timeout(_)
            | Failure::Connect(_)
            | Failure::Network(_)
            | Failure::CircuitOpen { .. }
            | Failure::VendorBusy
            | Failure::ReconcileFailed(_) => true,
        }
    }

    /// Whether the request may have reached the vendor (and been applied):
    /// any answer, a timeout, a connection lost after sending. A refused
    /// connection, a breaker's refusal or a reconcile sent nothing.
    fn may_have_reached(&self) -> bool {
        matches!(self, Failure::Status { .. } | Failure::Timeout(_) | Failure::Network(_))
    }

    /// A wait the answer asked for, in place of a shorter scheduled one.
    fn wait_hint(&self) -> Option<Duration> {
        match self {
            Failure::Status { retry_after, .. } => *retry_after,
            Failure::CircuitOpen { retry_in, .. } => Some(*retry_in),
            _ => None,
        }
    }

    /// The outcome label, and whether it says the host works.
    fn outcome(&self) -> (&'static str, bool) {
        match self {
            Failure::Status { status: 408, .. } => ("http_408", false),
            Failure::Status { status: 425, .. } => ("http_425", false),
            // The vendor's flow control: neutral for the breaker (see `attempt`).
            Failure::Status { status: 429, .. } => ("http_429", true),
            Failure::Status {
                status: 409,
                retry_after: Some(_),
                ..
            }
            | Failure::Status { in_flight: true, .. } => ("in_flight", true),
            Failure::Status { status: 500.., .. } => ("http_5xx", false),
            Failure::Status { .. } => ("rejected", true),
            Failure::Timeout(_) => ("timeout", false),
            Failure::Connect(_) => ("connect", false),
            Failure::Network(_) => ("network", false),
            Failure::CircuitOpen { .. } => ("circuit_open", false),
            Failure::VendorBusy | Failure::ReconcileFailed(_) | Failure::Held(_) => ("reconcile", true),
            Failure::Stopped(_) => ("stopped", true),
            Failure::Invalid(_) => ("invalid", true),
        }
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Failure::Status {
                status,
                body,
                retry_after,
                in_flight,
            } => {
                write!(f, "HTTP {status}: {}", snippet(body))?;
                if let Some(wait) = retry_after {
                    write!(f, " (Retry-After {}s)", wait.as_secs_f64())?;
                }
                if *in_flight {
                    write!(f, " (the key is still being processed)")?;
                }
                Ok(())
            }
            Failure::Timeout(Some(t)) => write!(f, "no complete answer within {} ms", t.as_millis()),
            Failure::Timeout(None) => write!(f, "the HTTP client timed out"),
            Failure::Connect(e) => write!(f, "not sent, no connection: {e}"),
            Failure::Network(e) => write!(f, "network error: {e}"),
            Failure::CircuitOpen {
                host,
                state: BreakerState::HalfOpen,
                ..
            } => write!(
                f,
                "not sent: the circuit breaker of {host} is half-open and its probe is in flight"
            ),
            Failure::CircuitOpen { host, retry_in, .. } => write!(
                f,
                "not sent: the circuit breaker of {host} is open for {} ms more",
                retry_in.as_millis()
            ),
            Failure::VendorBusy => write!(f, "not sent: the vendor is still processing an earlier send"),
            Failure::ReconcileFailed(e) => write!(f, "not sent: the vendor could not be asked: {e}"),
            Failure::Held(e) | Failure::Invalid(e) => write!(f, "{e}"),
            Failure::Stopped(e) => write!(f, "not sent: {e}"),
        }
    }
}

/// The configured delays, each spread by the jitter: the schedule `backon`
/// walks.
#[derive(Debug)]
pub(crate) struct Schedule {
    delays: std::vec::IntoIter<Duration>,
    jitter: Jitter,
}

impl Schedule {
    pub(crate) fn new(config: &OutboundConfig) -> Self {
        Self {
            delays: config.retry_delays.clone().into_iter(),
            jitter: config.jitter,
        }
    }
}

impl Iterator for Schedule {
    type Item = Duration;

    fn next(&mut self) -> Option<Duration> {
        self.delays.next().map(|d| self.jitter.apply(d))
    }
}

/// What the attempts of one call learnt of the vendor, across attempts.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct CallState {
    /// When the first send that may have reached the vendor started.
    pub(crate) reached_at_ms: Option<i64>,
    /// When the last send that may have reached the vendor started (at
    /// least the first one known): a vendor's "not applied" is trusted only
    /// once that send has settled.
    pub(crate) last_sent_at_ms: Option<i64>,
    /// When the vendor said it had not applied the call, if nothing may
    /// have reached it since.
    pub(crate) not_applied_at_ms: Option<i64>,
}

/// `now + by`, saturating far in the future instead of overflowing.
pub(crate) fn instant_after(by: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(by)
        .unwrap_or_else(|| now + Duration::from_secs(100 * 365 * 24 * 3600))
}

/// Runs one logical call: `attempt(timeout)` until a success, a final
/// failure, the end of the schedule or the deadline. Waits honour a
/// `Retry-After` (or a breaker's open period) when it is longer than the
/// scheduled delay, and never reach past the deadline: a wait that would
/// ends the call at once (a server's `Retry-After` then ends it as
/// `RetryLater`). `state` is what the attempts recorded of the vendor.
pub(crate) async fn drive<F, Fut>(
    config: &OutboundConfig,
    labels: &Labels,
    host_label: &str,
    state: &Mutex<CallState>,
    mut attempt: F,
) -> Result<OutboundResponse>
where
    F: FnMut(Duration) -> Fut,
    Fut: Future<Output = Result<OutboundResponse, Failure>>,
{
    let deadline = instant_after(config.deadline);
    let attempts = AtomicU32::new(0);
    let mut gave_up: Option<String> = None;
    let mut retry_later: Option<Duration> = None;
    let result = (|| {
        attempts.fetch_add(1, Ordering::Relaxed);
        let remaining = deadline.saturating_duration_since(Instant::now());
        attempt(config.attempt_timeout.min(remaining))
    })
    .retry(Schedule::new(config))
    .sleep(tokio::time::sleep)
    .when(Failure::transient)
    .adjust(|failure, next| {
        let Some(scheduled) = next else {
            gave_up = Some(format!("no retries left ({} configured)", config.retry_delays.len()));
            // A breaker's refusal sent nothing: the call is for later, never
            // a dead letter.
            if let Failure::CircuitOpen { retry_in, .. } = failure {
                retry_later = Some((*retry_in).max(MIN_BREAKER_WAIT));
            }
            return None;
        };
        let wait = failure.wait_hint().map_or(scheduled, |hint| hint.max(scheduled));
        if Instant::now().checked_add(wait).is_none_or(|at| at >= deadline) {
            gave_up = Some(format!(
                "the next attempt, in {} ms, would be past the {} ms deadline",
                wait.as_millis(),
                config.deadline.as_millis()
            ));
            match failure {
                Failure::Status {
                    status: 429 | 503,
                    retry_after: Some(after),
                    ..
                } => retry_later = Some(*after),
                Failure::CircuitOpen { retry_in, .. } => retry_later = Some((*retry_in).max(MIN_BREAKER_WAIT)),
                _ => {}
            }
            return None;
        }
        Some(wait)
    })
    .notify(|failure, wait| {
        labels.retry(host_label);
        tracing::info!(error = %failure, wait_ms = wait.as_millis() as u64, "outbound attempt failed; retrying");
    })
    .await;
    let attempts = attempts.into_inner();
    let CallState {
        reached_at_ms: first_reached_at_ms,
        not_applied_at_ms,
        ..
    } = *state.lock().unwrap_or_else(PoisonError::into_inner);
    match result {
        Ok(response) => Ok(OutboundResponse { attempts, ..response }),
        Err(Failure::Invalid(why)) => Err(OutboundError::Invalid(why)),
        Err(Failure::Held(reason)) => Err(OutboundError::Unknown {
            attempts,
            reason,
            first_reached_at_ms,
            sent_under: None,
        }),
        Err(Failure::Stopped(reason)) => Err(OutboundError::Stopped {
            // The attempt the guard stopped was not made.
            attempts: attempts.saturating_sub(1),
            reason,
            first_reached_at_ms,
        }),
        Err(failure @ Failure::Status { .. }) if !failure.transient() => {
            let Failure::Status { status, body, .. } = failure else {
                unreachable!("matched as a status")
            };
            Err(OutboundError::Rejected {
                status,
                body,
                attempts,
                first_reached_at_ms,
            })
        }
        Err(failure) => {
            let last_error = match gave_up {
                Some(why) => format!("{failure}; {why}"),
                None => failure.to_string(),
            };
            match retry_later {
                Some(after) => Err(OutboundError::RetryLater {
                    after,
                    attempts,
                    last_error,
                    first_reached_at_ms,
                    sent_under: None,
                }),
                None => Err(OutboundError::Exhausted {
                    attempts,
                    last_error,
                    first_reached_at_ms,
                    not_applied_at_ms,
                    sent_under: None,
                }),
            }
        }
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

    /// Sends `request` with `key` in the key header, retrying by the
    /// configuration until a success, a final rejection, or the end of the
    /// schedule or the deadline; every attempt carries the same key. A
    /// first send: nothing of this call can have reached the vendor before.
    pub async fn send(&self, key: &IdempotencyKey, request: &OutboundRequest) -> Result<OutboundResponse> {
        self.resend(key, request, Earlier::default()).await
    }

    /// Sends `request` again with `key`, knowing what `earlier` sends of the
    /// call may have done. While the first send that may have reached the
    /// vendor is within the target's key horizon, attempts are sent blindly
    /// (the vendor answers a key it remembers with its recorded result).
    /// Past it, for a vendor without keys, or with `must_reconcile`, the
    /// vendor is asked first through the reconcile hook: applied → its
    /// answer is returned (`reconciled`) and nothing is sent; not applied →
    /// sent; in flight → asked again after the next wait; unknown, or no
    /// hook → [`OutboundError::Unknown`], nothing sent. Within one call,
    /// each retry after an attempt that may have reached the vendor is
    /// judged the same way.
    pub async fn resend(
        &self,
        key: &IdempotencyKey,
        request: &OutboundRequest,
        earlier: Earlier,
    ) -> Result<OutboundResponse> {
        self.resend_while(key, request, earlier, &|| Ok(())).await
    }

    /// [`resend`](Self::resend), asking `may_send` right before each attempt
    /// (after any reconcile): `Err(reason)` ends the call at once with
    /// [`OutboundError::Stopped`], nothing more sent. A lease holder passes
    /// a check of its lease, so a holder that was paused past its lease
    /// (and whose call another holder has since taken over, asked about and
    /// sent) never sends again on its own, even to a vendor that has by then
    /// forgotten the key.
    pub async fn resend_while(
        &self,
        key: &IdempotencyKey,
        request: &OutboundRequest,
        earlier: Earlier,
        may_send: &(dyn Fn() -> std::result::Result<(), String> + Send + Sync),
    ) -> Result<OutboundResponse> {
        let prepared = self.prepare(key, request)?;
        let host: Arc<str> = host_of(prepared.url())?.into();
        let host_label = self.inner.labels.host(&host);
        let terms = self.terms_for(&host, earlier.sent_under);
        let horizon = KeyHorizon::new(terms.key_horizon, terms.horizon_margin);
        let span = tracing::info_span!(
            "outbound_call",
            key = %key,
            method = %request.method(),
            host = %host,
            attempts = tracing::field::Empty,
        );
        let state = Mutex::new(CallState {
            reached_at_ms: earlier.first_reached_at_ms,
            last_sent_at_ms: earlier.first_reached_at_ms.max(earlier.last_sent_at_ms),
            not_applied_at_ms: None,
        });
        let must_reconcile = std::sync::atomic::AtomicBool::new(earlier.must_reconcile);
        async {
            let labels = &self.inner.labels;
            let result = drive(&self.inner.config, labels, &host_label, &state, |timeout| {
                self.step(
                    key,
                    request,
                    &prepared,
                    (&host, &host_label, horizon, terms.settle),
                    (&state, &must_reconcile, earlier.past_horizon_override, may_send),
                    timeout,
                )
            })
            .await;
            let (label, attempts) = match &result {
                Ok(r) if r.reconciled => ("reconciled", r.attempts),
                Ok(r) => ("success", r.attempts),
                Err(e @ OutboundError::Rejected { .. }) => ("rejected", e.attempts()),
                Err(e @ OutboundError::Unknown { .. }) => ("unknown", e.attempts()),
                Err(e @ OutboundError::Stopped { .. }) => ("stopped", e.attempts()),
                Err(e @ OutboundError::RetryLater { .. }) => ("retry_later", e.attempts()),
                Err(e) => ("exhausted", e.attempts()),
            };
            labels.call(&host_label, label);
            tracing::Span::current().record("attempts", attempts);
            match &result {
                Ok(r) => tracing::debug!(status = r.status, reconciled = r.reconciled, "outbound call succeeded"),
                Err(e) => tracing::warn!(error = %e, "outbound call failed"),
            }
            result.map_err(|e| e.sent_under_terms(terms))
        }
        .instrument(span)
        .await
    }

    /// The terms a send of `request` is made under (its target's key
    /// horizon and this client's settle time), to keep with a dead letter
    /// the caller writes itself.
    pub fn terms_of(&self, request: &OutboundRequest) -> SentUnder {
        let host = reqwest::Url::parse(request.url())
            .ok()
            .and_then(|url| host_of(&url).ok())
            .unwrap_or_default();
        self.terms_for(&host, None)
    }

    /// The terms a send to `host` is made under: the target's key horizon
    /// and this client's settle time, made strict by `earlier` terms.
    fn terms_for(&self, host: &str, earlier: Option<SentUnder>) -> SentUnder {
        let horizon = self.inner.config.horizon_of(host);
        let own = SentUnder {
            key_horizon: horizon.horizon,
            horizon_margin: horizon.margin,
            settle: self.inner.config.settle_after_send(),
        };
        earlier.map_or(own, |t| own.strictest(t))
    }

    /// One step of a call: the reconcile its state asks for, then (unless
    /// that settled it) one attempt; records in `state` whether the attempt
    /// may have reached the vendor.
    async fn step(
        &self,
        key: &IdempotencyKey,
        request: &OutboundRequest,
        prepared: &reqwest::Request,
        (host, host_label, horizon, settle): (&Arc<str>, &str, KeyHorizon, Duration),
        (state, must_reconcile, past_horizon_override, may_send): (
            &Mutex<CallState>,
            &std::sync::atomic::AtomicBool,
            bool,
            &(dyn Fn() -> std::result::Result<(), String> + Send + Sync),
        ),
        timeout: Duration,
    ) -> Result<OutboundResponse, Failure> {
        let now = self.inner.clock.now_ms();
        let reached = state.lock().unwrap_or_else(PoisonError::into_inner).reached_at_ms;
        let forced = must_reconcile.load(Ordering::SeqCst);
        let remembered = reached.is_some_and(|at| horizon.remembers(at, now));
        let ask = (forced || (reached.is_some() && !remembered)) && !past_horizon_override;
        if ask {
            let labels = &self.inner.labels;
            let Some(hook) = &self.inner.reconcile else {
                labels.reconcile("held");
                return Err(Failure::Held(match (forced, reached) {
                    (true, _) => {
                        "its outcome is held as unknown, and there is no reconcile hook to ask the vendor".into()
                    }
                    (false, Some(at)) => format!(
                        "a send that may have reached the vendor started {} s ago, past the vendor's key horizon \
                         ({} s less a margin of {} s), and there is no reconcile hook to ask the vendor",
                        now.saturating_sub(at) / 1000,
                        horizon.horizon.as_secs(),
                        horizon.margin.as_secs()
                    ),
                    (false, None) => "no reconcile hook".into(),
                }));
            };
            match tokio::time::timeout(timeout, hook.reconcile(key, request, timeout)).await {
                Err(_) => {
                    labels.reconcile("error");
                    return Err(Failure::ReconcileFailed(format!(
                        "no answer within {} ms",
                        timeout.as_millis()
                    )));
                }
                Ok(Err(e)) => {
                    labels.reconcile("error");
                    return Err(Failure::ReconcileFailed(e));
                }
                Ok(Ok(Reconciled::Applied { status, body })) => {
                    labels.reconcile("applied");
                    tracing::info!(key = %key, "the vendor had applied it: its record stands, nothing is sent");
                    return Ok(OutboundResponse {
                        status,
                        headers: HeaderMap::new(),
                        body,
                        body_truncated: false,
                        attempts: 0,
                        reconciled: true,
                    });
                }
                Ok(Ok(Reconciled::InFlight)) => {
                    labels.reconcile("in_flight");
                    return Err(Failure::VendorBusy);
                }
                Ok(Ok(Reconciled::Unknown(why))) => {
                    labels.reconcile("unknown");
                    return Err(Failure::Held(format!(
                        "the vendor cannot say whether it applied it: {why}"
                    )));
                }
                Ok(Ok(Reconciled::NotApplied)) => {
                    // A vendor may still be working on a send whose caller gave
                    // up (an attempt that timed out), and its lookup says "not
                    // found" until it commits: the answer is trusted only once
                    // the last send has settled (by default its attempt
                    // timeout and a margin after it started).
                    let last_sent = state.lock().unwrap_or_else(PoisonError::into_inner).last_sent_at_ms;
                    let settle_ms = i64::try_from(settle.as_millis()).unwrap_or(i64::MAX);
                    if last_sent.is_some_and(|at| now < at.saturating_add(settle_ms)) {
                        labels.reconcile("not_settled");
                        tracing::info!(
                            key = %key,
                            "the vendor has no record of it yet, but its last send may still be in flight; asking again later"
                        );
                        return Err(Failure::VendorBusy);
                    }
                    labels.reconcile("not_applied");
                    must_reconcile.store(false, Ordering::SeqCst);
                    let mut s = state.lock().unwrap_or_else(PoisonError::into_inner);
                    s.reached_at_ms = None;
                    s.not_applied_at_ms = Some(now);
                }
            }
        }
        // Asked last, right before the send: a reconcile may have taken a
        // while.
        if let Err(reason) = may_send() {
            self.inner.labels.attempt(host_label, "stopped");
            return Err(Failure::Stopped(reason));
        }
        let started = self.inner.clock.now_ms();
        let result = self.attempt(prepared, host, host_label, timeout).await;
        if let Err(failure) = &result
            && failure.may_have_reached()
        {
            let mut s = state.lock().unwrap_or_else(PoisonError::into_inner);
            s.reached_at_ms.get_or_insert(started);
            s.last_sent_at_ms = Some(s.last_sent_at_ms.map_or(started, |at| at.max(started)));
            s.not_applied_at_ms = None;
        }
        result
    }

    /// The request as reqwest sends it, checked once for all attempts.
    fn prepare(&self, key: &IdempotencyKey, request: &OutboundRequest) -> Result<reqwest::Request> {
        let invalid = |why: String| OutboundError::Invalid(why);
        let url = parse_target(request.url(), self.inner.tls)?;
        let method = reqwest::Method::from_bytes(request.method().as_bytes())
            .map_err(|_| invalid(format!("invalid method {:?}", request.method())))?;
        let key_header = &self.inner.config.key_header;
        let mut headers = HeaderMap::new();
        for (name, value) in request.headers() {
            let name = HeaderName::from_bytes(name.as_bytes())
                .map_err(|_| invalid(format!("invalid header name {name:?}")))?;
            if name == *key_header || FRAMING_HEADERS.contains(&name.as_str()) {
                continue;
            }
            let value = HeaderValue::from_bytes(value.as_bytes())
                .map_err(|_| invalid(format!("invalid value of header {name}")))?;
            headers.append(name, value);
        }
        // Secret headers come from the configuration, never from storage.
        for (name, value) in &self.inner.config.secret_headers {
            headers.insert(name.clone(), value.clone());
        }
        let key_value =
            HeaderValue::from_str(key.as_str()).map_err(|_| invalid("the key is not a valid header value".into()))?;
        headers.insert(key_header.clone(), key_value);
        self.inner
            .http
            .request(method, url)
            .headers(headers)
            .body(request.body().to_vec())
            .build()
            .map_err(|e| invalid(error_chain(&e)))
    }

    /// One attempt: through the breaker, bounded by `timeout`, classified.
    async fn attempt(
        &self,
        prepared: &reqwest::Request,
        host: &Arc<str>,
        host_label: &str,
        timeout: Duration,
    ) -> Result<OutboundResponse, Failure> {
        let labels = &self.inner.labels;
        let Some(request) = prepared.try_clone() else {
            return Err(Failure::Invalid("the request body cannot be sent twice".into()));
        };
        let permit = match self.inner.breakers.admit(host) {
            Admission::Allowed(permit) => permit,
            Admission::Refused { state, retry_in } => {
                labels.attempt(host_label, "circuit_open");
                return Err(Failure::CircuitOpen {
                    host: host.clone(),
                    state,
                    retry_in,
                });
            }
        };
        let result = tokio::time::timeout(timeout, self.exchange(request))
            .await
            .unwrap_or(Err(Failure::Timeout(Some(timeout))));
        let (outcome, healthy) = match &result {
            Ok(_) => ("success", true),
            Err(failure) => failure.outcome(),
        };
        if matches!(result, Err(Failure::Invalid(_) | Failure::Status { status: 429, .. })) {
            // Says nothing of the host's health (a 429 is its flow control,
            // not a failure, nor a sign it works): no count moves, and a
            // probe hands its turn on.
            drop(permit);
        } else {
            permit.finish(healthy);
        }
        labels.attempt(host_label, outcome);
        tracing::debug!(outcome, "outbound attempt");
        result
    }

    /// Sends one request and reads its answer (the body bounded).
    async fn exchange(&self, request: reqwest::Request) -> Result<OutboundResponse, Failure> {
        let mut response = self.inner.http.execute(request).await.map_err(|e| {
            if e.is_builder() {
                Failure::Invalid(error_chain(&e))
            } else if e.is_connect() {
                Failure::Connect(error_chain(&e))
            } else if e.is_timeout() {
                Failure::Timeout(None)
            } else {
                Failure::Network(error_chain(&e))
            }
        })?;
        let status = response.status().as_u16();
        let headers = std::mem::take(response.headers_mut());
        let max = self.inner.config.max_response_body;
        let mut body = Vec::new();
        let mut body_truncated = false;
        loop {
            let chunk = response.chunk().await.map_err(|e| {
                if e.is_timeout() {
                    Failure::Timeout(None)
                } else {
                    Failure::Network(format!("the response body was cut off: {}", error_chain(&e)))
                }
            })?;
            let Some(chunk) = chunk else { break };
            let room = max - body.len();
            if chunk.len() > room {
                body.extend_from_slice(&chunk[..room]);
                body_truncated = true;
                break;
            }
            body.extend_from_slice(&chunk);
        }
        if (200..300).contains(&status) {
            return Ok(OutboundResponse {
                status,
                headers,
                body,
                body_truncated,
                attempts: 0,
                reconciled: false,
            });
        }
        let retry_after = match status {
            409 | 429 | 503 => headers
                .get(header::RETRY_AFTER)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| parse_retry_after(v, SystemTime::now())),
            _ => None,
        };
        let in_flight = status == 409 && says_in_flight(&body, &self.inner.config.in_flight_codes);
        Err(Failure::Status {
            status,
            body,
            retry_after,
            in_flight,
        })
    }
}

/// Whether a 409's JSON body says the key is still being processed: a
/// string value of `code`, `type` or `message` (at the top level or under
/// `error`) that is one of `codes`, ends in `/code`, or starts with
/// `code:` or `code ` — how Stripe (`idempotency_key_in_use`) and the
/// Idempotency-Key draft (a problem type ending in
/// `idempotency-key-in-flight`) say it. A body that is not JSON says
/// nothing.
pub(crate) fn says_in_flight(body: &[u8], codes: &[String]) -> bool {
    let Ok(value) = serde_json::from_slice::<serde_json::Value>(body) else {
        return false;
    };
    let matches = |text: &str| {
        codes.iter().any(|code| {
            text == code
                || text.ends_with(&format!("/{code}"))
                || text.starts_with(&format!("{code}:"))
                || text.starts_with(&format!("{code} "))
        })
    };
    [&value, &value["error"]].iter().any(|v| {
        ["code", "type", "message"]
            .iter()
            .filter_map(|field| v.get(field).and_then(serde_json::Value::as_str))
            .any(matches)
    })
}

/// A target URL, checked (see [`OutboundClient::check_target`]).
fn parse_target(url: &str, tls: bool) -> Result<reqwest::Url> {
    let invalid = |why: String| Err(OutboundError::Invalid(why));
    let parsed = match reqwest::Url::parse(url) {
        Ok(u) => u,
        Err(e) => return invalid(format!("{url:?} is not a valid URL: {e}")),
    };
    match parsed.scheme() {
        "http" => {}
        "https" if tls => {}
        "https" => {
            return invalid(format!(
                "{url:?} is https, and this client has no TLS backend: it could never be reached \
                 (build idem-outbound with its `tls` feature, or pass a reqwest client built with TLS \
                 to OutboundClient::with_http_client)"
            ));
        }
        other => return invalid(format!("{url:?}: the scheme must be http or https, not {other}")),
    }
    if parsed.host_str().is_none_or(str::is_empty) {
        return invalid(format!("{url:?} has no host"));
    }
    if parsed.port() == Some(0) {
        return invalid(format!("{url:?}: port 0 cannot be called"));
    }
    if !parsed.username().is_empty() || parsed.password().is_some() {
        return invalid(
            "the URL carries user information: give credentials as secret headers, never in a URL that is \
             stored and shown"
                .into(),
        );
    }
    if parsed.fragment().is_some() {
        return invalid(format!(
            "{url:?} has a fragment (#…), which is never sent: everything after it is lost"
        ));
    }
    Ok(parsed)
}

/// The breaker's and the metrics' name of a URL's host:
/// `scheme://host:port`.
fn host_of(url: &reqwest::Url) -> Result<String> {
    match (url.host_str(), url.port_or_known_default()) {
        (Some(host), Some(port)) => Ok(format!("{}://{host}:{port}", url.scheme())),
        _ => Err(OutboundError::Invalid(format!("{url} has no host"))),
    }
}

/// An error and its sources, on one line; a failed TLS handshake is said
/// as such, with the URL it was for and rustls's reason.
fn error_chain(e: &reqwest::Error) -> String {
    #[cfg(feature = "tls")]
    if let Some(failed) = idem_tls::handshake_failure(e) {
        return match e.url() {
            Some(url) => format!("{}: {failed}", host_of(url).unwrap_or_else(|_| url.to_string())),
            None => failed,
        };
    }
    source_chain(e)
}

/// An error and its sources, on one line.
fn source_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let part = s.to_string();
        if !text.contains(&part) {
            text.push_str(": ");
            text.push_str(&part);
        }
        source = s.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(delays_ms: &[u64], deadline_ms: u64) -> OutboundConfig {
        OutboundConfig {
            retry_delays: delays_ms.iter().copied().map(Duration::from_millis).collect(),
            jitter: Jitter::None,
            deadline: Duration::from_millis(deadline_ms),
            attempt_timeout: Duration::from_secs(10),
            ..OutboundConfig::default()
        }
    }

    fn ok() -> OutboundResponse {
        OutboundResponse {
            status: 201,
            headers: HeaderMap::new(),
            body: b"{}".to_vec(),
            body_truncated: false,
            attempts: 0,
            reconciled: false,
        }
    }

    fn status(status: u16, retry_after_secs: Option<u64>) -> Failure {
        Failure::Status {
            status,
            body: b"no".to_vec(),
            retry_after: retry_after_secs.map(Duration::from_secs),
            in_flight: false,
        }
    }

    /// Runs `drive` over scripted answers; answers what it returned, and
    /// when (on the paused clock) each attempt started with which timeout.
    async fn run(
        config: &OutboundConfig,
        script: Vec<Result<OutboundResponse, Failure>>,
    ) -> (Result<OutboundResponse>, Vec<(Duration, Duration)>) {
        let labels = Labels::new("test".into(), 4);
        let start = Instant::now();
        let script = Mutex::new(script.into_iter());
        let seen = Mutex::new(Vec::new());
        let state = Mutex::new(CallState::default());
        let result = drive(config, &labels, "h", &state, |timeout| {
            seen.lock().unwrap().push((start.elapsed(), timeout));
            let next = script.lock().unwrap().next().unwrap_or(Err(status(503, None)));
            async move { next }
        })
        .await;
        (result, seen.into_inner().unwrap())
    }

    fn secs(s: f64) -> Duration {
        Duration::from_secs_f64(s)
    }

    /// The schedule is the configured list, then the call gives up with
    /// attempts = delays + 1.
    #[tokio::test(start_paused = true)]
    async fn the_schedule_is_the_configured_list() {
        let c = config(&[500, 2000, 5000, 30_000], 60_000);
        let (result, seen) = run(&c, vec![]).await;
        let starts: Vec<_> = seen.iter().map(|s| s.0).collect();
        assert_eq!(starts, [0.0, 0.5, 2.5, 7.5, 37.5].map(secs));
        match result {
            Err(OutboundError::Exhausted {
                attempts, last_error, ..
            }) => {
                assert_eq!(attempts, 5);
                assert!(last_error.starts_with("HTTP 503: no"), "{last_error}");
                assert!(last_error.contains("no retries left"), "{last_error}");
            }
            other => panic!("{other:?}"),
        }
    }

    /// Success after failures answers the attempts made.
    #[tokio::test(start_paused = true)]
    async fn success_after_retries_counts_its_attempts() {
        let c = config(&[100, 100, 100], 60_000);
        let script = vec![
            Err(status(500, None)),
            Err(Failure::Network("reset".into())),
            Err(status(408, None)),
            Ok(ok()),
        ];
        let (result, _) = run(&c, script).await;
        assert_eq!(result.unwrap().attempts, 4);
    }

    /// A final 4xx is not retried.
    #[tokio::test(start_paused = true)]
    async fn final_rejections_are_not_retried() {
        for code in [400, 404, 409, 422, 301] {
            let (result, seen) = run(&config(&[100, 100], 60_000), vec![Err(status(code, None))]).await;
            assert_eq!(seen.len(), 1);
            match result {
                Err(OutboundError::Rejected {
                    status, body, attempts, ..
                }) => {
                    assert_eq!((status, body.as_slice(), attempts), (code, &b"no"[..], 1));
                }
                other => panic!("{other:?}"),
            }
        }
    }

    /// A 409 with Retry-After (another attempt with this key is in flight at
    /// the vendor) is waited out and sent again with the same key.
    #[tokio::test(start_paused = true)]
    async fn an_in_flight_conflict_is_retried_after_its_wait() {
        let (result, seen) = run(&config(&[100, 100], 60_000), vec![Err(status(409, Some(2))), Ok(ok())]).await;
        assert_eq!(result.unwrap().attempts, 2);
        assert_eq!(seen.len(), 2);
        assert!(seen[1].0 >= Duration::from_secs(2), "{seen:?}");
        // Still in flight when the retries run out: given up, not rejected.
        let (result, _) = run(
            &config(&[100], 60_000),
            vec![Err(status(409, Some(1))), Err(status(409, Some(1)))],
        )
        .await;
        assert!(
            matches!(result, Err(OutboundError::Exhausted { attempts: 2, .. })),
            "{result:?}"
        );
    }

    /// A Retry-After longer than the scheduled delay is waited in full; a
    /// shorter one does not shorten the schedule.
    #[tokio::test(start_paused = true)]
    async fn retry_after_is_honoured() {
        let c = config(&[500, 500], 60_000);
        let script = vec![Err(status(429, Some(3))), Err(status(503, Some(0))), Ok(ok())];
        let (result, seen) = run(&c, script).await;
        assert_eq!(result.unwrap().attempts, 3);
        let starts: Vec<_> = seen.iter().map(|s| s.0).collect();
        assert_eq!(starts, [0.0, 3.0, 3.5].map(secs));
    }

    /// A Retry-After past the deadline ends the call at once, no sleep, as "retry later" with the wait asked for (not a dead end).
    #[tokio::test(start_paused = true)]
    async fn retry_after_past_the_deadline_gives_up_at_once() {
        let c = config(&[500, 2000], 10_000);
        let start = Instant::now();
        let (result, seen) = run(&c, vec![Err(status(429, Some(60)))]).await;
        assert_eq!(start.elapsed(), Duration::ZERO);
        assert_eq!(seen.len(), 1);
        match result {
            Err(OutboundError::RetryLater {
                attempts: 1,
                after,
                last_error,
                ..
            }) => {
                assert_eq!(after, Duration::from_secs(60));
                assert!(last_error.contains("Retry-After 60s"), "{last_error}");
                assert!(last_error.contains("past the 10000 ms deadline"), "{last_error}");
            }
            other => panic!("{other:?}"),
        }
    }

    /// The deadline also cuts the schedule, and each attempt's timeout.
    #[tokio::test(start_paused = true)]
    async fn the_deadline_bounds_waits_and_attempts() {
        let mut c = config(&[1000, 1000, 1000, 1000], 2500);
        c.attempt_timeout = Duration::from_secs(2);
        let (result, seen) = run(&c, vec![]).await;
        assert_eq!(
            seen,
            [(secs(0.0), secs(2.0)), (secs(1.0), secs(1.5)), (secs(2.0), secs(0.5))]
        );
        assert_eq!(result.unwrap_err().attempts(), 3);
    }

    /// A breaker refusal waits for the end of the open period when it is
    /// longer than the scheduled delay.
    #[tokio::test(start_paused = true)]
    async fn an_open_breaker_is_waited_out() {
        let c = config(&[100, 100], 60_000);
        let open = Failure::CircuitOpen {
            host: "http://v:80".into(),
            state: BreakerState::Open,
            retry_in: Duration::from_secs(5),
        };
        let (result, seen) = run(&c, vec![Err(open), Ok(ok())]).await;
        assert_eq!(result.unwrap().attempts, 2);
        assert_eq!(seen[1].0, secs(5.0));
    }

    /// A jittered schedule stays within its band around the list.
    #[test]
    fn jittered_schedules_follow_the_list() {
        let c = OutboundConfig::default();
        for _ in 0..100 {
            let delays: Vec<_> = Schedule::new(&c).collect();
            assert_eq!(delays.len(), 4);
            for (d, base) in delays.iter().zip(&c.retry_delays) {
                assert!(*d >= *base * 4 / 5 && *d <= *base * 6 / 5, "{d:?} vs {base:?}");
            }
        }
    }

    #[test]
    fn hosts_are_scheme_host_and_port() {
        let url = |u: &str| reqwest::Url::parse(u).unwrap();
        assert_eq!(host_of(&url("http://v.example/x")).unwrap(), "http://v.example:80");
        assert_eq!(host_of(&url("https://v.example/x")).unwrap(), "https://v.example:443");
        assert_eq!(host_of(&url("http://[::1]:8080/")).unwrap(), "http://[::1]:8080");
    }
}

#[cfg(test)]
mod in_flight_tests {
    use super::*;

    /// Proves a 409 is recognised as "still being processed" by Stripe's code and the draft's problem type, and nothing else.
    #[test]
    fn in_flight_409_bodies_are_recognised() {
        let codes = OutboundConfig::default().in_flight_codes;
        for yes in [
            r#"{"error":{"type":"idempotency_error","code":"idempotency_key_in_use","message":"x"}}"#,
            r#"{"error":{"type":"idempotency_error","message":"idempotency_key_in_use: retry later"}}"#,
            r#"{"type":"https://idem.dev/problems/idempotency-key-in-flight","status":409}"#,
        ] {
            assert!(says_in_flight(yes.as_bytes(), &codes), "{yes}");
        }
        for no in [
            r#"{"error":{"type":"invalid_request_error","code":"resource_already_exists"}}"#,
            r#"{"message":"not_idempotency_key_in_use"}"#,
            "idempotency_key_in_use",
            "",
        ] {
            assert!(!says_in_flight(no.as_bytes(), &codes), "{no}");
        }
    }

    /// Proves targets are checked as the issue asks: fragments, user information, port 0 or out of range, https without TLS.
    #[test]
    fn targets_are_checked() {
        assert!(parse_target("http://v:9100/v1/payouts?x=1", false).is_ok());
        assert!(parse_target("https://v/", true).is_ok());
        for bad in [
            "http://v#",
            "http://v/#/v1/payouts",
            "http://user:pw@v/",
            "http://v:0/",
            "http://v:65536/",
            "https://v/",
            "ftp://v/",
        ] {
            assert!(parse_target(bad, false).is_err(), "{bad}");
        }
    }
}
