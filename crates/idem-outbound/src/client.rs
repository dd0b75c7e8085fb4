//! The client: one logical call, its attempts, their classification.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, SystemTime};

use backon::Retryable;
use idem_core::{IdempotencyKey, OutboundRequest, Retryable as Transience, http_status_retryable};
use reqwest::header::{self, HeaderMap, HeaderName, HeaderValue};
use tokio::time::Instant;
use tracing::Instrument;

use crate::breaker::{Admission, BreakerState, Breakers};
use crate::config::{Jitter, OutboundConfig};
use crate::error::{OutboundError, Result, snippet};
use crate::metrics::Labels;
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

/// A success (2xx) answer to a logical call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboundResponse {
    /// The status (200..=299).
    pub status: u16,
    /// The response headers.
    pub headers: HeaderMap,
    /// The body, at most `max_response_body` bytes.
    pub body: Vec<u8>,
    /// Whether the body was longer than `max_response_body` (the rest was
    /// not read).
    pub body_truncated: bool,
    /// Attempts made, this one included.
    pub attempts: u32,
}

/// Sends logical calls with one idempotency key across every retry, behind
/// a per-host circuit breaker. Clones are cheap and share the connection
/// pool and the breakers.
#[derive(Clone)]
pub struct OutboundClient {
    inner: Arc<Inner>,
}

struct Inner {
    http: reqwest::Client,
    config: OutboundConfig,
    breakers: Breakers,
    labels: Arc<Labels>,
}

impl fmt::Debug for OutboundClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OutboundClient")
            .field("config", &self.inner.config)
            .field("breakers", &self.inner.breakers)
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
    },
    /// No complete answer within the attempt's time.
    Timeout(Option<Duration>),
    /// Connect refused or failed, reset, the body cut off.
    Network(String),
    /// Not sent: the host's breaker refused it.
    CircuitOpen {
        host: Arc<str>,
        state: BreakerState,
        retry_in: Duration,
    },
    /// Cannot be sent at all.
    Invalid(String),
}

impl Failure {
    fn transient(&self) -> bool {
        match self {
            // A 409 with `Retry-After` is the Idempotency-Key draft's "a
            // request with this key is still being processed": the same key
            // is sent again, after the wait, never dead-lettered for it.
            Failure::Status {
                status: 409,
                retry_after: Some(_),
                ..
            } => true,
            Failure::Status { status, .. } => http_status_retryable(*status) == Transience::Transient,
            Failure::Invalid(_) => false,
            Failure::Timeout(_) | Failure::Network(_) | Failure::CircuitOpen { .. } => true,
        }
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
            Failure::Status { status: 429, .. } => ("http_429", false),
            Failure::Status {
                status: 409,
                retry_after: Some(_),
                ..
            } => ("in_flight", true),
            Failure::Status { status: 500.., .. } => ("http_5xx", false),
            Failure::Status { .. } => ("rejected", true),
            Failure::Timeout(_) => ("timeout", false),
            Failure::Network(_) => ("network", false),
            Failure::CircuitOpen { .. } => ("circuit_open", false),
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
            } => {
                write!(f, "HTTP {status}: {}", snippet(body))?;
                if let Some(wait) = retry_after {
                    write!(f, " (Retry-After {}s)", wait.as_secs_f64())?;
                }
                Ok(())
            }
            Failure::Timeout(Some(t)) => write!(f, "no complete answer within {} ms", t.as_millis()),
            Failure::Timeout(None) => write!(f, "the HTTP client timed out"),
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
            Failure::Invalid(e) => write!(f, "{e}"),
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

/// Runs one logical call: `attempt(timeout)` until a success, a final
/// failure, the end of the schedule or the deadline. Waits honour a
/// `Retry-After` (or a breaker's open period) when it is longer than the
/// scheduled delay, and never reach past the deadline: a wait that would
/// ends the call at once.
pub(crate) async fn drive<F, Fut>(
    config: &OutboundConfig,
    labels: &Labels,
    host_label: &str,
    mut attempt: F,
) -> Result<OutboundResponse>
where
    F: FnMut(Duration) -> Fut,
    Fut: Future<Output = Result<OutboundResponse, Failure>>,
{
    let deadline = Instant::now() + config.deadline;
    let attempts = AtomicU32::new(0);
    let mut gave_up: Option<String> = None;
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
            return None;
        };
        let wait = failure.wait_hint().map_or(scheduled, |hint| hint.max(scheduled));
        if Instant::now() + wait >= deadline {
            gave_up = Some(format!(
                "the next attempt, in {} ms, would be past the {} ms deadline",
                wait.as_millis(),
                config.deadline.as_millis()
            ));
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
    match result {
        Ok(response) => Ok(OutboundResponse { attempts, ..response }),
        Err(Failure::Invalid(why)) => Err(OutboundError::Invalid(why)),
        Err(failure @ Failure::Status { .. }) if !failure.transient() => {
            let Failure::Status { status, body, .. } = failure else {
                unreachable!("matched as a status")
            };
            Err(OutboundError::Rejected { status, body, attempts })
        }
        Err(failure) => Err(OutboundError::Exhausted {
            attempts,
            last_error: match gave_up {
                Some(why) => format!("{failure}; {why}"),
                None => failure.to_string(),
            },
        }),
    }
}

impl OutboundClient {
    /// A client with its own connection pool. Redirects are not followed
    /// (a 3xx ends the call as [`OutboundError::Rejected`]).
    ///
    /// HTTPS needs a TLS backend in reqwest, which this crate does not pick:
    /// enable one in the application (`reqwest = { version = "0.13",
    /// features = ["rustls"] }`; features are shared) or pass a client to
    /// [`with_http_client`](Self::with_http_client).
    pub fn new(config: OutboundConfig) -> Result<Self> {
        let http = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|e| OutboundError::InvalidConfig(format!("the HTTP client cannot be built: {e}")))?;
        Self::with_http_client(http, config)
    }

    /// A client over `http` (its TLS, proxy and pool settings). Its own
    /// timeout, if set, counts as a failed attempt; leave redirects off.
    pub fn with_http_client(http: reqwest::Client, config: OutboundConfig) -> Result<Self> {
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
                breakers: Breakers::new(config.breaker.clone(), on_transition),
                config,
                labels,
            }),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &OutboundConfig {
        &self.inner.config
    }

    pub(crate) fn labels(&self) -> &Labels {
        &self.inner.labels
    }

    /// The state of the breaker of `url`'s host (`scheme://host:port`).
    pub fn breaker_state(&self, url: &str) -> Result<BreakerState> {
        let url = reqwest::Url::parse(url).map_err(|e| OutboundError::Invalid(format!("{url:?}: {e}")))?;
        Ok(self.inner.breakers.state(&host_of(&url)?))
    }

    /// Sends `request` with `key` in the key header, retrying by the
    /// configuration until a success, a final rejection, or the end of the
    /// schedule or the deadline; every attempt carries the same key.
    pub async fn send(&self, key: &IdempotencyKey, request: &OutboundRequest) -> Result<OutboundResponse> {
        let prepared = self.prepare(key, request)?;
        let host: Arc<str> = host_of(prepared.url())?.into();
        let host_label = self.inner.labels.host(&host);
        let span = tracing::info_span!(
            "outbound_call",
            key = %key,
            method = %request.method(),
            host = %host,
            attempts = tracing::field::Empty,
        );
        async {
            let labels = &self.inner.labels;
            let result = drive(&self.inner.config, labels, &host_label, |timeout| {
                self.attempt(&prepared, &host, &host_label, timeout)
            })
            .await;
            let (label, attempts) = match &result {
                Ok(r) => ("success", r.attempts),
                Err(e @ OutboundError::Rejected { .. }) => ("rejected", e.attempts()),
                Err(e) => ("exhausted", e.attempts()),
            };
            labels.call(&host_label, label);
            tracing::Span::current().record("attempts", attempts);
            match &result {
                Ok(r) => tracing::debug!(status = r.status, "outbound call succeeded"),
                Err(e) => tracing::warn!(error = %e, "outbound call failed"),
            }
            result
        }
        .instrument(span)
        .await
    }

    /// The request as reqwest sends it, checked once for all attempts.
    fn prepare(&self, key: &IdempotencyKey, request: &OutboundRequest) -> Result<reqwest::Request> {
        let invalid = |why: String| OutboundError::Invalid(why);
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
        let key_value =
            HeaderValue::from_str(key.as_str()).map_err(|_| invalid("the key is not a valid header value".into()))?;
        headers.insert(key_header.clone(), key_value);
        self.inner
            .http
            .request(method, request.url())
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
        if matches!(result, Err(Failure::Invalid(_))) {
            // Says nothing about the host: a probe hands its turn on.
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
            });
        }
        let retry_after = match status {
            409 | 429 | 503 => headers
                .get(header::RETRY_AFTER)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| parse_retry_after(v, SystemTime::now())),
            _ => None,
        };
        Err(Failure::Status {
            status,
            body,
            retry_after,
        })
    }
}

/// The breaker's and the metrics' name of a URL's host:
/// `scheme://host:port`.
fn host_of(url: &reqwest::Url) -> Result<String> {
    match (url.host_str(), url.port_or_known_default()) {
        (Some(host), Some(port)) => Ok(format!("{}://{host}:{port}", url.scheme())),
        _ => Err(OutboundError::Invalid(format!("{url} has no host"))),
    }
}

/// An error and its sources, on one line.
fn error_chain(e: &dyn std::error::Error) -> String {
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
    use std::sync::Mutex;

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
        }
    }

    fn status(status: u16, retry_after_secs: Option<u64>) -> Failure {
        Failure::Status {
            status,
            body: b"no".to_vec(),
            retry_after: retry_after_secs.map(Duration::from_secs),
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
        let result = drive(config, &labels, "h", |timeout| {
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
            Err(OutboundError::Exhausted { attempts, last_error }) => {
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
                Err(OutboundError::Rejected { status, body, attempts }) => {
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

    /// A Retry-After past the deadline ends the call at once: no sleep.
    #[tokio::test(start_paused = true)]
    async fn retry_after_past_the_deadline_gives_up_at_once() {
        let c = config(&[500, 2000], 10_000);
        let start = Instant::now();
        let (result, seen) = run(&c, vec![Err(status(429, Some(60)))]).await;
        assert_eq!(start.elapsed(), Duration::ZERO);
        assert_eq!(seen.len(), 1);
        match result {
            Err(OutboundError::Exhausted {
                attempts: 1,
                last_error,
            }) => {
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
