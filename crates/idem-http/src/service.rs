//! [`Idempotency`]: the service that applies the contract, and the part of
//! it both modes share: the key, body and fingerprint checks before anything
//! is claimed, the hand-over to a [`Mode`] (`tx_mode.rs`, `lease_mode.rs`),
//! and what a response's status means for its key.

use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use axum_core::body::Body;
use bytes::Bytes;
use http::{HeaderValue, Method, Request, Response, StatusCode, header, request::Parts};
use idem_core::{
    BoxError, Call, Consume, Error, Fingerprint, FingerprintBuilder, FingerprintVersion, Operation, Record, Retryable,
    Scope, http_status_retryable,
};
use tower_service::Service;

use crate::IDEMPOTENT_REPLAYED;
use crate::drain::Drain;
use crate::future::ResponseFuture;
use crate::key::{KeyHeader, parse_key_header};
use crate::layer::{Config, KeyRequirement, Shared};
use crate::problem::{Problem, slugs};
use crate::recorded::RecordedResponse;

/// The service built by [`IdempotencyLayer`](crate::IdempotencyLayer).
pub struct Idempotency<S, M> {
    inner: S,
    shared: Arc<Shared<M>>,
}

impl<S: Clone, M> Clone for Idempotency<S, M> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            shared: self.shared.clone(),
        }
    }
}

impl<S: std::fmt::Debug, M> std::fmt::Debug for Idempotency<S, M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Idempotency")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl<S, M> Idempotency<S, M> {
    pub(crate) fn new(inner: S, shared: Arc<Shared<M>>) -> Self {
        Self { inner, shared }
    }
}

/// The service the layer wraps, as a [`Mode`] calls it: it answers a
/// buffered request, and its future and error can cross tasks. Every axum
/// router and tower service of that shape is one (a blanket impl).
pub trait InnerService<ResBody>:
    Service<Request<Body>, Response = Response<ResBody>, Future: Send, Error: Send + 'static> + Send + 'static
{
}

impl<S, ResBody> InnerService<ResBody> for S where
    S: Service<Request<Body>, Response = Response<ResBody>, Future: Send, Error: Send + 'static> + Send + 'static
{
}

/// A body the layer reads, buffers or streams: bytes, with an error it can
/// box (a blanket impl).
pub trait ByteBody: http_body::Body<Data = Bytes, Error: Into<BoxError>> + Send + 'static {}

impl<B> ByteBody for B where B: http_body::Body<Data = Bytes, Error: Into<BoxError>> + Send + 'static {}

/// How a mode handles requests (implemented by [`Transactional`](crate::Transactional) and
/// [`Leased`](crate::Leased)).
pub trait Mode: Clone + Send + Sync + 'static {
    #[doc(hidden)]
    fn keyed<S, ResBody>(
        &self,
        cfg: &Config,
        inner: S,
        parts: Parts,
        body: Bytes,
        call: Call,
    ) -> impl Future<Output = Result<Response<Body>, S::Error>> + Send
    where
        S: InnerService<ResBody>,
        ResBody: ByteBody;

    #[doc(hidden)]
    fn unkeyed<S, ResBody>(
        &self,
        cfg: &Config,
        inner: S,
        req: Request<Body>,
    ) -> impl Future<Output = Result<Response<Body>, S::Error>> + Send
    where
        S: InnerService<ResBody>,
        ResBody: ByteBody;
}

impl<S, M, ReqBody, ResBody> Service<Request<ReqBody>> for Idempotency<S, M>
where
    S: Service<Request<Body>, Response = Response<ResBody>> + InnerService<ResBody> + Clone,
    M: Mode,
    ReqBody: ByteBody,
    ResBody: ByteBody,
{
    type Response = Response<Body>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqBody>) -> Self::Future {
        // The clone is not ready; keep the one that was polled (tower's rule).
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let shared = self.shared.clone();
        Box::pin(async move { handle(shared, inner, req).await })
    }
}

#[cfg(feature = "fault-injection")]
pub(crate) use crate::fault::{Point, hit};

#[cfg(not(feature = "fault-injection"))]
#[derive(Clone, Copy)]
pub(crate) enum Point {
    AfterClaim,
    BeforeCommit,
    AfterCommit,
}

#[cfg(not(feature = "fault-injection"))]
#[inline(always)]
pub(crate) fn hit(_point: Point) {}

#[cfg(feature = "fault-injection")]
fn bypassed() -> bool {
    crate::fault::bypassed()
}

#[cfg(not(feature = "fault-injection"))]
#[inline(always)]
fn bypassed() -> bool {
    false
}

#[cfg(feature = "fault-injection")]
pub(crate) fn skips_sent_mark() -> bool {
    crate::fault::skips_sent_mark()
}

#[cfg(not(feature = "fault-injection"))]
#[inline(always)]
pub(crate) fn skips_sent_mark() -> bool {
    false
}

fn is_safe(method: &Method) -> bool {
    matches!(*method, Method::GET | Method::HEAD | Method::OPTIONS | Method::TRACE)
}

fn is_json(parts: &Parts) -> bool {
    parts
        .headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(|v| v.split(';').next().unwrap_or("").trim())
        .is_some_and(|v| {
            // Compared without a lower-cased copy.
            v.eq_ignore_ascii_case("application/json")
                || v.len() >= 5 && v.is_char_boundary(v.len() - 5) && v[v.len() - 5..].eq_ignore_ascii_case("+json")
        })
}

pub(crate) fn outcome(operation: &Operation, result: &'static str, started: Instant) {
    metrics::counter!("idem_http_requests_total", "operation" => operation.metric_label(), "result" => result)
        .increment(1);
    metrics::histogram!("idem_http_request_duration_seconds", "operation" => operation.metric_label())
        .record(started.elapsed().as_secs_f64());
}

/// A routed request on its way in, before its body is read: what an early
/// answer to it needs (its operation and arrival for the metrics, the body
/// drain, the base of problem types).
pub(crate) struct Arrival<'a> {
    pub(crate) operation: &'a Operation,
    pub(crate) started: Instant,
    pub(crate) drain: &'a Drain,
    pub(crate) problem_base: &'a str,
}

impl Arrival<'_> {
    /// Refuses the request with `problem` before reading its body, which is
    /// drained; `result` is the metric's.
    pub(crate) async fn refuse<B: ByteBody>(&self, result: &'static str, body: B, problem: Problem) -> Response<Body> {
        outcome(self.operation, result, self.started);
        self.drain.discard(body, 0).await;
        problem.into_response(self.problem_base)
    }

    /// The request's body, read up to `limit` bytes; a body refused (too
    /// large, or broken off) is answered.
    pub(crate) async fn read_body<B: ByteBody>(
        &self,
        body: B,
        parts: &Parts,
        limit: usize,
    ) -> Result<Bytes, Response<Body>> {
        self.drain
            .read_request(body, &parts.headers, limit)
            .await
            .map_err(|problem| {
                outcome(self.operation, "body_rejected", self.started);
                body_refused(problem, self.problem_base)
            })
    }
}

async fn handle<S, M, ReqBody, ResBody>(
    shared: Arc<Shared<M>>,
    inner: S,
    req: Request<ReqBody>,
) -> Result<Response<Body>, S::Error>
where
    S: InnerService<ResBody>,
    M: Mode,
    ReqBody: ByteBody,
    ResBody: ByteBody,
{
    let cfg = &shared.config;
    let started = Instant::now();
    let (parts, body) = req.into_parts();
    let Some(operation) = (cfg.operation)(&parts) else {
        // Not a routed operation (an unknown route): nothing to protect.
        return passthrough(inner, Request::from_parts(parts, Body::new(body))).await;
    };
    let op = operation.clone();
    let route = cfg.route(&operation);
    let arrival = Arrival {
        operation: &op,
        started,
        drain: &cfg.drain,
        problem_base: &cfg.problem_base,
    };
    let key = if is_safe(&parts.method) {
        None
    } else {
        match parse_key_header(&parts.headers) {
            KeyHeader::Present(key) => Some(key),
            KeyHeader::Missing if route.requirement() == KeyRequirement::Required => {
                return Ok(arrival.refuse("key_missing", body, key_missing(&op)).await);
            }
            KeyHeader::Missing => None,
            KeyHeader::Invalid(why) => return Ok(arrival.refuse("key_invalid", body, key_invalid(why)).await),
        }
    };
    let bytes = match arrival.read_body(body, &parts, cfg.max_request_bytes).await {
        Ok(bytes) => bytes,
        Err(refused) => return Ok(refused),
    };
    let key = if bypassed() { None } else { key };
    let Some(key) = key else {
        outcome(&op, "unkeyed", started);
        return shared
            .mode
            .unkeyed(cfg, inner, Request::from_parts(parts, Body::from(bytes)))
            .await;
    };
    let tenant = match (cfg.tenant)(&parts) {
        Ok(tenant) => tenant,
        Err(problem) => return Ok(problem.into_response(&cfg.problem_base)),
    };
    let mut call = Call::new(
        Scope::new(tenant, operation.clone()),
        key,
        fingerprint(FingerprintVersion::V2, &operation, &parts, &bytes),
    )
    .with_policy(*route.policy());
    if cfg.accept_previous_fingerprints {
        let (path, query, json, body) = (
            parts.uri.path().to_owned(),
            parts.uri.query().map(str::to_owned),
            is_json(&parts),
            bytes.clone(),
        );
        call = call.with_previous_fingerprint_from(move || {
            let base = FingerprintBuilder::with_version(&operation, FingerprintVersion::V1)
                .field("path", &path)
                .field("query", query.as_deref().unwrap_or(""));
            Some(body_fingerprint(base, json, &body))
        });
    }
    let span = tracing::info_span!("idem.http", operation = %op, key = %call.key());
    let response = {
        let _enter = span.enter();
        tracing::debug!("idempotent request");
        drop(_enter);
        tracing::Instrument::instrument(shared.mode.keyed(cfg, inner, parts, bytes, call), span).await?
    };
    let result = if response.headers().contains_key(&IDEMPOTENT_REPLAYED) {
        "replayed"
    } else {
        "handled"
    };
    outcome(&op, result, started);
    Ok(response)
}

/// The fingerprint covers the operation, the concrete path and query (two
/// resources under one route template are different requests) and the body,
/// in its canonical form when it is JSON that has one, else byte for byte.
pub(crate) fn fingerprint(
    version: FingerprintVersion,
    operation: &Operation,
    parts: &Parts,
    body: &Bytes,
) -> Fingerprint {
    let mut base = FingerprintBuilder::with_version(operation, version);
    if crate::layer::method_label(&parts.method) == "OTHER" {
        // An extension method is named `OTHER` in the operation.
        base = base.field("method", parts.method.as_str());
    }
    let base = base
        .field("path", parts.uri.path())
        .field("query", parts.uri.query().unwrap_or(""));
    body_fingerprint(base, is_json(parts), body)
}

fn body_fingerprint(base: FingerprintBuilder, json: bool, body: &Bytes) -> Fingerprint {
    if json && let Ok(json) = base.clone().json(body) {
        return json.finish();
    }
    base.bytes(body).finish()
}

pub(crate) async fn passthrough<S, ResBody>(mut inner: S, req: Request<Body>) -> Result<Response<Body>, S::Error>
where
    S: Service<Request<Body>, Response = Response<ResBody>>,
    ResBody: ByteBody,
{
    let response = inner.call(req).await?;
    Ok(response.map(Body::new))
}

/// The problem for an error from the engine.
pub(crate) fn error_response(cfg: &Config, call: &Call, e: Error) -> Response<Body> {
    let problem = match e {
        Error::Mismatch => key_reused(call),
        Error::InFlight { retry_after } => {
            let secs = retry_after.as_millis().div_ceil(1000).max(1) as u64;
            Problem::new(StatusCode::CONFLICT, slugs::KEY_IN_FLIGHT, "Request in flight")
                .with_detail("a request with this Idempotency-Key is still being processed; retry later")
                .with_retry_after_secs(secs)
        }
        Error::OutcomeUnknown => Problem::new(StatusCode::CONFLICT, slugs::OUTCOME_UNKNOWN, "Outcome unknown")
            .with_detail(format!(
                "an earlier request with the Idempotency-Key {:?} reached the upstream and may have been applied, \
             but its outcome is unknown; it is not sent again. An operator resolves it: \
             `idem keys resolve --tenant {:?} --operation {:?} --key {:?} --applied --status <code> --body <file>` \
             records what the upstream did (retries then replay it), `--not-applied` releases the key (the next \
             retry is sent)",
                call.key().as_str(),
                call.scope().tenant().as_str(),
                call.scope().operation().as_str(),
                call.key().as_str()
            )),
        Error::RecordTooLarge { size, limit } => Problem::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            slugs::RESPONSE_TOO_LARGE,
            "Response too large to record",
        )
        .with_detail(format!(
            "the response of {size} bytes exceeds the record limit of {limit} bytes; nothing was applied"
        )),
        e => store_failed("idempotency", &e, store_unavailable()),
    };
    problem.into_response(&cfg.problem_base)
}

/// The problem for a request to `operation`, which requires a key, that
/// has none.
pub(crate) fn key_missing(operation: &Operation) -> Problem {
    Problem::new(StatusCode::BAD_REQUEST, slugs::KEY_MISSING, "Idempotency-Key missing")
        .with_detail(format!("{operation} requires an Idempotency-Key header"))
}

/// The problem for a key header that is not a valid key, saying `why`.
pub(crate) fn key_invalid(why: String) -> Problem {
    Problem::new(StatusCode::BAD_REQUEST, slugs::KEY_INVALID, "Idempotency-Key invalid").with_detail(why)
}

/// The answer to a request whose body was refused (`problem`, rendered
/// with `base`). The rest of the body may not have been read, so this
/// connection cannot carry another request: the client is told not to
/// reuse it.
pub(crate) fn body_refused(problem: Problem, base: &str) -> Response<Body> {
    let mut response = problem.into_response(base);
    response
        .headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("close"));
    response
}

/// The problem for a key already used for a different request to the
/// call's operation.
pub(crate) fn key_reused(call: &Call) -> Problem {
    Problem::new(
        StatusCode::UNPROCESSABLE_ENTITY,
        slugs::KEY_REUSED,
        "Idempotency-Key reused",
    )
    .with_detail(format!(
        "the key {:?} was already used for a different request to {}",
        call.key().as_str(),
        call.scope().operation()
    ))
}

/// Answers `unavailable` to the failure `e` of the `what` store
/// (`idempotency`, `multi-step`) and logs it: a retryable failure as a
/// warning, and with a `Retry-After` of one second; any other as an error.
pub(crate) fn store_failed(what: &str, e: &Error, unavailable: Problem) -> Problem {
    if e.is_retryable() {
        tracing::warn!(error = %e, "{what} store failed");
        unavailable.with_retry_after_secs(1)
    } else {
        tracing::error!(error = %e, "{what} store failed");
        unavailable
    }
}

/// The problem for a store that failed before the request was applied.
pub(crate) fn store_unavailable() -> Problem {
    unavailable("the request was not applied; retry with the same Idempotency-Key")
}

/// The problem for a store that failed, saying with `detail` what became
/// of the request.
pub(crate) fn unavailable(detail: &str) -> Problem {
    Problem::new(
        StatusCode::SERVICE_UNAVAILABLE,
        slugs::STORE_UNAVAILABLE,
        "Idempotency store unavailable",
    )
    .with_detail(detail)
}

/// The replay of a record; its body is the record's payload, not a copy.
pub(crate) fn replay(cfg: &Config, record: Record) -> Response<Body> {
    match RecordedResponse::decode_shared(Bytes::from(record.payload)) {
        Ok(recorded) => recorded.into_replay(),
        Err(why) => {
            tracing::error!(%why, "a recorded response is corrupt");
            Problem::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "idempotency-record-corrupt",
                "Recorded response corrupt",
            )
            .with_detail("the recorded response of this key cannot be decoded")
            .into_response(&cfg.problem_base)
        }
    }
}

/// What a response's status means for its key.
pub(crate) enum Decision {
    /// A success or a redirection: record it; the key is consumed.
    Record,
    /// A final rejection under a policy that records them.
    RecordRejection,
    /// Anything else: the key stays unused.
    Release,
}

/// Whether an answer applies the request: every 2xx, and every 3xx (a
/// `303 See Other` is the usual answer of a create, a `201`'s equal). Such an
/// answer consumes the key, and in transactional mode its writes commit.
pub(crate) fn applies(status: StatusCode) -> bool {
    status.is_success() || status.is_redirection()
}

pub(crate) fn decide(status: StatusCode, call: &Call) -> Decision {
    if applies(status) {
        Decision::Record
    } else if status.is_client_error()
        && http_status_retryable(status.as_u16()) == Retryable::Fatal
        && call.policy().consume() == Consume::SuccessOrFinalRejection
    {
        Decision::RecordRejection
    } else {
        Decision::Release
    }
}

/// The first response: exactly what the handler said, never marked replayed.
pub(crate) fn first(parts: http::response::Parts, body: Body) -> Response<Body> {
    let mut response = Response::from_parts(parts, body);
    response.headers_mut().remove(&IDEMPOTENT_REPLAYED);
    response
}

/// The record of a response read whole: completed, or a recorded rejection.
/// Private headers are left out: the first caller got them, no replay will.
pub(crate) fn whole_record(
    status: StatusCode,
    headers: &http::HeaderMap,
    body: &Bytes,
    trailers: &http::HeaderMap,
    rejected: bool,
    private: &[http::HeaderName],
) -> Record {
    let encoded = crate::recorded::encode(status, headers, body, trailers, private);
    if rejected {
        Record::rejected(encoded)
    } else {
        Record::completed(encoded)
    }
}
