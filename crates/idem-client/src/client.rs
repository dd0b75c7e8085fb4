//! The retrying client.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBuilder};
use bytes::{Bytes, BytesMut};
use reqwest::header::{HeaderMap, HeaderName, HeaderValue};
use tokio::time::Instant;

use crate::error::LastFailure;
use crate::response::{Decision, decide};
use crate::{Error, Key, MemoryPending, Operation, PendingStore, Response, Result};

/// The request header that carries the key.
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";

/// Why an attempt got no answer.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct TransportError {
    /// What failed.
    pub kind: TransportKind,
    /// The underlying error, in words.
    pub message: String,
}

/// The kinds of [`TransportError`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum TransportKind {
    /// No connection (refused, unreachable, DNS): the request was not sent.
    Connect,
    /// The attempt's timeout passed: the request may have arrived.
    Timeout,
    /// The connection failed while sending or before the answer's head
    /// arrived (reset, closed): the request may have arrived.
    Request,
    /// The answer's body was cut off, or is over the response limit while
    /// its status asks for a retry.
    Body,
}

impl fmt::Display for TransportError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match self.kind {
            TransportKind::Connect => "connect",
            TransportKind::Timeout => "timeout",
            TransportKind::Request => "request",
            TransportKind::Body => "body",
        };
        write!(f, "{kind}: {}", self.message)
    }
}

impl std::error::Error for TransportError {}

/// One attempt's report to the observer ([`ClientBuilder::on_attempt`]).
#[derive(Debug)]
#[non_exhaustive]
pub struct AttemptEvent<'a> {
    /// The operation's key.
    pub key: &'a Key,
    /// 1 for the first request of this send or resume.
    pub attempt: u32,
    /// What it got.
    pub outcome: AttemptOutcome<'a>,
    /// What the client does next.
    pub next: Next,
}

/// What an attempt got.
#[derive(Debug)]
#[non_exhaustive]
pub enum AttemptOutcome<'a> {
    /// An answer (final or to be retried).
    Answered(&'a Response),
    /// No answer.
    Failed(&'a TransportError),
}

/// What the client does after an attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Next {
    /// The answer is final.
    Done,
    /// It sends again with the same key after this wait (the server's
    /// `Retry-After` when it gave one, else the jittered backoff).
    RetryIn(Duration),
    /// The deadline or the attempt limit is reached; the operation stays
    /// pending.
    GiveUp,
}

type Observer = Arc<dyn Fn(&AttemptEvent<'_>) + Send + Sync>;

/// Configures a [`Client`].
#[must_use]
pub struct ClientBuilder {
    http: Option<reqwest::Client>,
    ca_file: Option<std::path::PathBuf>,
    store: Option<Arc<dyn PendingStore>>,
    default_headers: HeaderMap,
    error: Option<Error>,
    settings: Settings,
}

/// How a client sends: what the builder sets and the client keeps.
struct Settings {
    attempt_timeout: Duration,
    deadline: Duration,
    min_delay: Duration,
    max_delay: Duration,
    max_attempts: Option<u32>,
    max_retry_after: Duration,
    max_response_bytes: usize,
    jitter_seed: Option<u64>,
    observer: Option<Observer>,
    resume_concurrency: usize,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            attempt_timeout: Duration::from_secs(30),
            deadline: Duration::from_secs(120),
            min_delay: Duration::from_millis(200),
            max_delay: Duration::from_secs(10),
            max_attempts: None,
            max_retry_after: Duration::from_secs(60),
            max_response_bytes: 16 * 1024 * 1024,
            jitter_seed: None,
            observer: None,
            resume_concurrency: 8,
        }
    }
}

impl fmt::Debug for ClientBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClientBuilder")
            .field("attempt_timeout", &self.settings.attempt_timeout)
            .field("deadline", &self.settings.deadline)
            .field("min_delay", &self.settings.min_delay)
            .field("max_delay", &self.settings.max_delay)
            .field("max_attempts", &self.settings.max_attempts)
            .field("max_retry_after", &self.settings.max_retry_after)
            .field("max_response_bytes", &self.settings.max_response_bytes)
            .finish_non_exhaustive()
    }
}

impl Default for ClientBuilder {
    fn default() -> Self {
        Self {
            http: None,
            ca_file: None,
            store: None,
            default_headers: HeaderMap::new(),
            error: None,
            settings: Settings::default(),
        }
    }
}

impl ClientBuilder {
    /// Sends through this reqwest client (e.g. one built with a TLS
    /// feature, a proxy or a pool of your choice). Redirects should be off:
    /// the client treats a 3xx as a final answer. Default: plain HTTP,
    /// redirects off, a 10 s connect timeout.
    pub fn http(mut self, http: reqwest::Client) -> Self {
        self.http = Some(http);
        self
    }

    /// Verifies https servers against the CA certificates of this PEM file
    /// only, in place of the platform's roots (the default client; needs
    /// the `tls` feature).
    pub fn ca_file(mut self, path: impl Into<std::path::PathBuf>) -> Self {
        self.ca_file = Some(path.into());
        self
    }

    /// Keeps pending operations in `store` (default: a [`MemoryPending`]).
    pub fn store(mut self, store: impl PendingStore) -> Self {
        self.store = Some(Arc::new(store));
        self
    }

    /// Keeps pending operations in a store shared with other owners.
    pub fn shared_store(mut self, store: Arc<dyn PendingStore>) -> Self {
        self.store = Some(store);
        self
    }

    /// Sends this header with every attempt of every operation, resumed
    /// ones included, unless the operation sets the same header. Default
    /// headers are never stored: put credentials here. A header named
    /// `Authorization` or `Proxy-Authorization` is marked sensitive.
    pub fn default_header(mut self, name: &str, value: &str) -> Self {
        match (HeaderName::from_bytes(name.as_bytes()), HeaderValue::from_str(value)) {
            (Ok(name), Ok(mut value)) => {
                if name == reqwest::header::AUTHORIZATION || name == reqwest::header::PROXY_AUTHORIZATION {
                    value.set_sensitive(true);
                }
                if name.as_str() == IDEMPOTENCY_KEY {
                    self.error.get_or_insert(Error::InvalidOperation(
                        "the Idempotency-Key header is written by the client; do not set it".into(),
                    ));
                } else {
                    self.default_headers.append(name, value);
                }
            }
            (Err(e), _) => {
                self.error
                    .get_or_insert(Error::InvalidOperation(format!("header name {name:?}: {e}")));
            }
            (_, Err(e)) => {
                self.error
                    .get_or_insert(Error::InvalidOperation(format!("value of header {name:?}: {e}")));
            }
        }
        self
    }

    /// `Authorization: Bearer <token>` as a default header.
    pub fn bearer(self, token: &str) -> Self {
        self.default_header("authorization", &format!("Bearer {token}"))
    }

    /// How long one attempt may take, connection to the end of the body
    /// (default 30 s; never past the deadline).
    pub fn attempt_timeout(mut self, timeout: Duration) -> Self {
        self.settings.attempt_timeout = timeout;
        self
    }

    /// How long one send (or the resend of one operation in
    /// [`Client::resume`]) may keep trying: no attempt starts after it
    /// (default 120 s).
    pub fn deadline(mut self, deadline: Duration) -> Self {
        self.settings.deadline = deadline;
        self
    }

    /// The backoff between attempts when the server gave no `Retry-After`:
    /// exponential from `min` to `max`, doubling, each wait plus a random
    /// jitter of up to itself (defaults 200 ms and 10 s).
    pub fn backoff(mut self, min: Duration, max: Duration) -> Self {
        self.settings.min_delay = min;
        self.settings.max_delay = max.max(min);
        self
    }

    /// Seeds the jitter, so one seed gives one schedule per key (default:
    /// random).
    pub fn jitter_seed(mut self, seed: u64) -> Self {
        self.settings.jitter_seed = Some(seed);
        self
    }

    /// Gives up after this many attempts, even before the deadline (default:
    /// only the deadline bounds them).
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.settings.max_attempts = Some(attempts.max(1));
        self
    }

    /// The longest `Retry-After` honoured as given; longer ones are cut to
    /// it (default 60 s). Shorter ones than the backoff's minimum wait the
    /// minimum.
    pub fn max_retry_after(mut self, max: Duration) -> Self {
        self.settings.max_retry_after = max;
        self
    }

    /// The largest response body read (default 16 MiB).
    pub fn max_response_bytes(mut self, max: usize) -> Self {
        self.settings.max_response_bytes = max;
        self
    }

    /// How many pending operations [`Client::resume`] sends at once
    /// (default 8, at least 1): one unreachable host holds up only its own
    /// operations.
    pub fn resume_concurrency(mut self, concurrency: usize) -> Self {
        self.settings.resume_concurrency = concurrency.max(1);
        self
    }

    /// Calls `observer` after every attempt, with what it got and what the
    /// client does next: for metrics, logs, or a harness that counts
    /// retries and replays.
    pub fn on_attempt(mut self, observer: impl Fn(&AttemptEvent<'_>) + Send + Sync + 'static) -> Self {
        self.settings.observer = Some(Arc::new(observer));
        self
    }

    /// Builds the client.
    pub fn build(self) -> Result<Client> {
        if let Some(e) = self.error {
            return Err(e);
        }
        let plain_http_only = self.http.is_none() && !cfg!(feature = "tls");
        let http = match self.http {
            Some(_) if self.ca_file.is_some() => {
                return Err(Error::Http(
                    "ca_file is for the default client: give the CA to the reqwest client passed to http()".into(),
                ));
            }
            Some(http) => http,
            None => default_http(self.ca_file.as_deref())?,
        };
        let backoff = ExponentialBuilder::new()
            .with_min_delay(self.settings.min_delay)
            .with_max_delay(self.settings.max_delay)
            .with_factor(2.0)
            .with_jitter()
            .without_max_times();
        Ok(Client {
            inner: Arc::new(Inner {
                plain_http_only,
                http,
                store: self.store.unwrap_or_else(|| Arc::new(MemoryPending::new())),
                default_headers: self.default_headers,
                backoff,
                settings: self.settings,
            }),
        })
    }
}

/// A client for idem-protected HTTP APIs: sends each [`Operation`] until
/// it gets a final answer, always with the operation's key, and keeps it in
/// a [`PendingStore`] until then. Cheap to clone.
///
/// - **Retried** with the same key: connection failures, timeouts, resets,
///   bodies cut off, 5xx, 408, 429 and the 409 whose problem type is
///   `…/idempotency-key-in-flight` — after the server's `Retry-After` when
///   it gives one, else on an exponential backoff with jitter; never past
///   the deadline.
/// - **Final**: every other answer. 2xx and 3xx are `Ok`; other 4xx are
///   [`Error::Rejected`], with the problem document parsed.
/// - **Pending**: saved before the first byte is sent, removed on a final
///   answer, kept when the client gives up ([`Error::GaveUp`]: the outcome
///   is unknown) so a later send or [`resume`](Self::resume) carries the
///   same key and the server applies the operation at most once.
#[derive(Clone)]
pub struct Client {
    inner: Arc<Inner>,
}

struct Inner {
    /// The default reqwest client, built without the `tls` feature, has no
    /// TLS backend.
    plain_http_only: bool,
    http: reqwest::Client,
    store: Arc<dyn PendingStore>,
    default_headers: HeaderMap,
    backoff: ExponentialBuilder,
    settings: Settings,
}

impl fmt::Debug for Client {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Client")
            .field("deadline", &self.inner.settings.deadline)
            .field("attempt_timeout", &self.inner.settings.attempt_timeout)
            .finish_non_exhaustive()
    }
}

/// One operation [`Client::resume`] sent again, and how it ended.
#[derive(Debug)]
#[non_exhaustive]
pub struct Resumed {
    /// The operation, with its original key.
    pub operation: Operation,
    /// Its answer, as [`Client::send`] would give it.
    pub result: Result<Response>,
}

/// What one attempt got.
enum Got {
    Answer(Response),
    TooLarge(reqwest::StatusCode, HeaderMap),
    Failed(TransportError),
}

impl Client {
    /// A builder with the defaults.
    pub fn builder() -> ClientBuilder {
        ClientBuilder::default()
    }

    /// The pending store.
    pub fn store(&self) -> &dyn PendingStore {
        self.inner.store.as_ref()
    }

    /// Saves `op` in the pending store, then sends it until a final answer,
    /// the deadline or the attempt limit (see [`Client`]). Nothing is sent
    /// if the save fails. Sending an operation that is still pending (after
    /// [`Error::GaveUp`]) sends it again with its key.
    pub async fn send(&self, op: &Operation) -> Result<Response> {
        self.check_scheme(op)?;
        self.inner.store.save(op).await?;
        self.drive(op).await
    }

    /// Refuses an https operation when the HTTP client cannot speak TLS
    /// (the default one), instead of retrying a connection that cannot be
    /// made. The operation is left as it is in the store.
    fn check_scheme(&self, op: &Operation) -> Result<()> {
        if self.inner.plain_http_only && op.url().scheme() == "https" {
            return Err(Error::InvalidOperation(format!(
                "{} is https, and the default HTTP client has no TLS backend; \
                 build idem-client with its `tls` feature, or pass a reqwest::Client built with TLS \
                 to ClientBuilder::http",
                op.url()
            )));
        }
        Ok(())
    }

    /// Sends every pending operation again, each with its original key,
    /// up to [`ClientBuilder::resume_concurrency`] at once (started oldest
    /// first), and removes each one that gets a final answer; answers them
    /// oldest first. An operation that was applied before the restart gets
    /// its recorded answer replayed ([`Response::replayed`]). Each keeps to
    /// its own deadline, so an unreachable host holds up only its own.
    pub async fn resume(&self) -> Result<Vec<Resumed>> {
        let ops = self.inner.store.list().await?;
        let slots = Arc::new(tokio::sync::Semaphore::new(self.inner.settings.resume_concurrency));
        let mut running = tokio::task::JoinSet::new();
        for (index, operation) in ops.into_iter().enumerate() {
            // Taken here, in order: the oldest operations start first.
            let permit = slots.clone().acquire_owned().await.expect("never closed");
            let client = self.clone();
            running.spawn(async move {
                let _permit = permit;
                tracing::debug!(key = %operation.key(), url = %operation.url(), "resuming a pending operation");
                let result = client.drive(&operation).await;
                (index, Resumed { operation, result })
            });
        }
        let mut out = Vec::new();
        while let Some(done) = running.join_next().await {
            match done {
                Ok(resumed) => out.push(resumed),
                Err(e) => std::panic::resume_unwind(e.into_panic()),
            }
        }
        out.sort_by_key(|(index, _)| *index);
        Ok(out.into_iter().map(|(_, r)| r).collect())
    }

    /// Sends a saved operation until a final answer; removes it then.
    async fn drive(&self, op: &Operation) -> Result<Response> {
        self.check_scheme(op)?;
        let result = self.attempts(op).await;
        let is_final = match &result {
            Ok(_) => true,
            Err(e) => matches!(e, Error::Rejected(_) | Error::ResponseTooLarge { .. } | Error::Http(_)),
        };
        if is_final && let Err(e) = self.inner.store.remove(op.key()).await {
            // The answer is final and the caller gets it; the copy left in
            // the store is sent again on resume and answered by a replay.
            tracing::warn!(key = %op.key(), error = %e, "could not remove a finished operation from the pending store");
        }
        result
    }

    async fn attempts(&self, op: &Operation) -> Result<Response> {
        let inner = &self.inner;
        // A deadline too far away to represent is no deadline at all.
        let deadline = instant_after(inner.settings.deadline);
        let mut builder = inner.backoff;
        if let Some(seed) = inner.settings.jitter_seed {
            builder = builder.with_jitter_seed(seed ^ fnv1a(op.key().as_str().as_bytes()));
        }
        let mut backoff = builder.build();
        let mut attempt = 0u32;
        loop {
            attempt += 1;
            let remaining = deadline.saturating_duration_since(Instant::now());
            let got = self
                .attempt(op, attempt, inner.settings.attempt_timeout.min(remaining))
                .await?;
            let (after, last) = match got {
                Got::Answer(response) => match decide(response.status(), response.headers(), response.problem()) {
                    Decision::Retry { after } => (after, LastFailure::Response(Box::new(response))),
                    Decision::Final => {
                        self.observe(op, attempt, AttemptOutcome::Answered(&response), Next::Done);
                        return if response.status().is_client_error() || response.status().is_server_error() {
                            Err(Error::Rejected(Box::new(response)))
                        } else {
                            Ok(response)
                        };
                    }
                },
                Got::TooLarge(status, headers) => match decide(status, &headers, None) {
                    Decision::Retry { after } => (
                        after,
                        LastFailure::Transport(TransportError {
                            kind: TransportKind::Body,
                            message: format!(
                                "the {status} answer's body is over the limit of {} bytes",
                                inner.settings.max_response_bytes
                            ),
                        }),
                    ),
                    Decision::Final => {
                        let e = TransportError {
                            kind: TransportKind::Body,
                            message: format!(
                                "the final {status} answer's body is over the limit of {} bytes",
                                inner.settings.max_response_bytes
                            ),
                        };
                        self.observe(op, attempt, AttemptOutcome::Failed(&e), Next::Done);
                        return Err(Error::ResponseTooLarge {
                            key: op.key().clone(),
                            status: status.as_u16(),
                            max_bytes: inner.settings.max_response_bytes,
                        });
                    }
                },
                Got::Failed(e) => (None, LastFailure::Transport(e)),
            };
            let wait = match after {
                // `Retry-After: 0` must not turn into a busy loop.
                Some(after) => after.min(inner.settings.max_retry_after).max(inner.settings.min_delay),
                None => backoff.next().unwrap_or(inner.settings.max_delay),
            };
            let out_of_attempts = inner.settings.max_attempts.is_some_and(|max| attempt >= max);
            let past_deadline = Instant::now().checked_add(wait).is_none_or(|at| at >= deadline);
            let next = if out_of_attempts || past_deadline {
                Next::GiveUp
            } else {
                Next::RetryIn(wait)
            };
            let outcome = match &last {
                LastFailure::Response(r) => AttemptOutcome::Answered(r),
                LastFailure::Transport(e) => AttemptOutcome::Failed(e),
            };
            self.observe(op, attempt, outcome, next);
            if next == Next::GiveUp {
                tracing::warn!(key = %op.key(), attempts = attempt, last = %last, "no final answer; the operation stays pending");
                return Err(Error::GaveUp {
                    key: op.key().clone(),
                    attempts: attempt,
                    last,
                });
            }
            tracing::debug!(key = %op.key(), attempt, last = %last, wait_ms = wait.as_millis() as u64, "retrying with the same key");
            tokio::time::sleep(wait).await;
        }
    }

    fn observe(&self, op: &Operation, attempt: u32, outcome: AttemptOutcome<'_>, next: Next) {
        if let Some(observer) = &self.inner.settings.observer {
            observer(&AttemptEvent {
                key: op.key(),
                attempt,
                outcome,
                next,
            });
        }
    }

    /// One request. `Err` only for a request the HTTP client refuses to
    /// build; every network failure is a `Got::Failed`.
    async fn attempt(&self, op: &Operation, attempt: u32, timeout: Duration) -> Result<Got> {
        let inner = &self.inner;
        let mut headers = inner.default_headers.clone();
        for name in op.headers().keys() {
            headers.remove(name);
        }
        for (name, value) in op.headers() {
            headers.append(name.clone(), value.clone());
        }
        headers.insert(HeaderName::from_static(IDEMPOTENCY_KEY), op.key().header_value());
        let request = inner
            .http
            .request(op.method().clone(), op.url().clone())
            .headers(headers)
            .body(op.body().clone())
            .timeout(timeout);
        let exchange = async {
            let mut res = match request.send().await {
                Ok(res) => res,
                Err(e) if e.is_builder() => return Err(Error::Http(e.to_string())),
                Err(e) => return Ok(Got::Failed(transport(&e, TransportKind::Request))),
            };
            let status = res.status();
            let headers = std::mem::take(res.headers_mut());
            let max = inner.settings.max_response_bytes;
            if res.content_length().is_some_and(|n| n > max as u64) {
                return Ok(Got::TooLarge(status, headers));
            }
            let mut body = BytesMut::new();
            loop {
                match res.chunk().await {
                    Ok(Some(chunk)) => {
                        if body.len() + chunk.len() > max {
                            return Ok(Got::TooLarge(status, headers));
                        }
                        body.extend_from_slice(&chunk);
                    }
                    Ok(None) => break,
                    Err(e) => return Ok(Got::Failed(transport(&e, TransportKind::Body))),
                }
            }
            let body: Bytes = body.freeze();
            Ok(Got::Answer(Response::new(
                status,
                headers,
                body,
                op.key().clone(),
                attempt,
            )))
        };
        // reqwest's timeout covers the body too; this one also bounds a
        // client passed in without it.
        match tokio::time::timeout(timeout, exchange).await {
            Ok(got) => got,
            Err(_) => Ok(Got::Failed(TransportError {
                kind: TransportKind::Timeout,
                message: format!("no complete answer within {} ms", timeout.as_millis()),
            })),
        }
    }
}

/// `now + by`, saturating a century away instead of overflowing.
fn instant_after(by: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(by)
        .unwrap_or_else(|| now + Duration::from_secs(100 * 365 * 24 * 3600))
}

/// The default HTTP client: redirects off, a 10 s connect timeout, and with
/// the `tls` feature https verified against the platform's roots or only
/// `ca_file`'s certificates.
fn default_http(ca_file: Option<&std::path::Path>) -> Result<reqwest::Client> {
    let builder = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .connect_timeout(Duration::from_secs(10));
    #[cfg(feature = "tls")]
    let builder = {
        let tls = idem_tls::Roots::ca_file(ca_file)
            .client_config()
            .map_err(|e| Error::Http(e.to_string()))?;
        builder.tls_backend_preconfigured(tls)
    };
    #[cfg(not(feature = "tls"))]
    if let Some(file) = ca_file {
        return Err(Error::Http(format!(
            "ca_file {}: this build has no TLS (the `tls` feature of idem-client)",
            file.display()
        )));
    }
    builder.build().map_err(|e| Error::Http(e.to_string()))
}

/// Classifies a reqwest error; `stage` is what was going on.
fn transport(e: &reqwest::Error, stage: TransportKind) -> TransportError {
    let kind = if e.is_timeout() {
        TransportKind::Timeout
    } else if e.is_connect() {
        TransportKind::Connect
    } else {
        stage
    };
    #[cfg(feature = "tls")]
    if let Some(failed) = idem_tls::handshake_failure(e) {
        let at = e
            .url()
            .map_or("?".to_owned(), |u| format!("{}://{}", u.scheme(), u.authority()));
        return TransportError {
            kind,
            message: format!("{at}: {failed}"),
        };
    }
    // The chain names the cause ("connection refused", "connection reset").
    let mut message = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        message.push_str(": ");
        message.push_str(&s.to_string());
        source = s.source();
    }
    TransportError { kind, message }
}

/// FNV-1a, to mix a key into the jitter seed.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    })
}
