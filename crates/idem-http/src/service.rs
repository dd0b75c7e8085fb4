//! [`Idempotency`]: the service that applies the contract.

use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use axum_core::body::Body;
use bytes::Bytes;
use http::{HeaderValue, Method, Request, Response, StatusCode, header, request::Parts};
use idem_core::metrics::Stage;
use idem_core::{
    Acquire, Begin, BoxError, Call, Consume, ContentionRetries, Error, Fingerprint, FingerprintBuilder,
    FingerprintVersion, LeaseStore, Operation, Record, Retryable, Scope, Ticket, TxBackend, http_status_retryable,
};
use tower_service::Service;

use crate::IDEMPOTENT_REPLAYED;
use crate::body::{Chunk, Collected, collect_response};
use crate::future::ResponseFuture;
use crate::key::{KeyHeader, parse_key_header};
use crate::layer::{Config, KeyRequirement, Leased, Shared, Transactional};
use crate::problem::{Problem, slugs};
use crate::recorded::RecordedResponse;
use crate::retry::RetryTransaction;
use crate::tx::{Taken, TxCell};

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

/// How a mode handles requests (implemented by [`Transactional`] and [`Leased`]).
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
        S: Service<Request<Body>, Response = Response<ResBody>> + Send + 'static,
        S::Future: Send,
        S::Error: Send + 'static,
        ResBody: http_body::Body<Data = Bytes> + Send + 'static,
        ResBody::Error: Into<BoxError>;

    #[doc(hidden)]
    fn unkeyed<S, ResBody>(
        &self,
        cfg: &Config,
        inner: S,
        req: Request<Body>,
    ) -> impl Future<Output = Result<Response<Body>, S::Error>> + Send
    where
        S: Service<Request<Body>, Response = Response<ResBody>> + Send + 'static,
        S::Future: Send,
        S::Error: Send + 'static,
        ResBody: http_body::Body<Data = Bytes> + Send + 'static,
        ResBody::Error: Into<BoxError>;
}

impl<S, M, ReqBody, ResBody> Service<Request<ReqBody>> for Idempotency<S, M>
where
    S: Service<Request<Body>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Send + 'static,
    M: Mode,
    ReqBody: http_body::Body<Data = Bytes> + Send + 'static,
    ReqBody::Error: Into<BoxError>,
    ResBody: http_body::Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
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
use crate::fault::{Point, hit};

#[cfg(not(feature = "fault-injection"))]
#[derive(Clone, Copy)]
enum Point {
    AfterClaim,
    BeforeCommit,
    AfterCommit,
}

#[cfg(not(feature = "fault-injection"))]
#[inline(always)]
fn hit(_point: Point) {}

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
fn skips_sent_mark() -> bool {
    crate::fault::skips_sent_mark()
}

#[cfg(not(feature = "fault-injection"))]
#[inline(always)]
fn skips_sent_mark() -> bool {
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

fn outcome(operation: &Operation, result: &'static str, started: Instant) {
    metrics::counter!("idem_http_requests_total", "operation" => operation.metric_label(), "result" => result)
        .increment(1);
    metrics::histogram!("idem_http_request_duration_seconds", "operation" => operation.metric_label())
        .record(started.elapsed().as_secs_f64());
}

async fn handle<S, M, ReqBody, ResBody>(
    shared: Arc<Shared<M>>,
    inner: S,
    req: Request<ReqBody>,
) -> Result<Response<Body>, S::Error>
where
    S: Service<Request<Body>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send,
    S::Error: Send + 'static,
    M: Mode,
    ReqBody: http_body::Body<Data = Bytes> + Send + 'static,
    ReqBody::Error: Into<BoxError>,
    ResBody: http_body::Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
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
    let key = if is_safe(&parts.method) {
        None
    } else {
        match parse_key_header(&parts.headers) {
            KeyHeader::Present(key) => Some(key),
            KeyHeader::Missing if route.requirement() == KeyRequirement::Required => {
                outcome(&op, "key_missing", started);
                cfg.drain.discard(body, 0).await;
                return Ok(
                    Problem::new(StatusCode::BAD_REQUEST, slugs::KEY_MISSING, "Idempotency-Key missing")
                        .with_detail(format!("{op} requires an Idempotency-Key header"))
                        .into_response(&cfg.problem_base),
                );
            }
            KeyHeader::Missing => None,
            KeyHeader::Invalid(why) => {
                outcome(&op, "key_invalid", started);
                cfg.drain.discard(body, 0).await;
                return Ok(
                    Problem::new(StatusCode::BAD_REQUEST, slugs::KEY_INVALID, "Idempotency-Key invalid")
                        .with_detail(why)
                        .into_response(&cfg.problem_base),
                );
            }
        }
    };
    let bytes = match cfg
        .drain
        .read_request(body, &parts.headers, cfg.max_request_bytes)
        .await
    {
        Ok(bytes) => bytes,
        Err(problem) => {
            outcome(&op, "body_rejected", started);
            let mut response = problem.into_response(&cfg.problem_base);
            // The rest of the body may not have been read, so this connection
            // cannot carry another request: tell the client not to reuse it.
            response
                .headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
            return Ok(response);
        }
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
fn fingerprint(version: FingerprintVersion, operation: &Operation, parts: &Parts, body: &Bytes) -> Fingerprint {
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

async fn passthrough<S, ResBody>(mut inner: S, req: Request<Body>) -> Result<Response<Body>, S::Error>
where
    S: Service<Request<Body>, Response = Response<ResBody>>,
    ResBody: http_body::Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    let response = inner.call(req).await?;
    Ok(response.map(Body::new))
}

/// The problem for an error from the engine.
fn error_response(cfg: &Config, call: &Call, e: Error) -> Response<Body> {
    let problem = match e {
        Error::Mismatch => Problem::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            slugs::KEY_REUSED,
            "Idempotency-Key reused",
        )
        .with_detail(format!(
            "the key {:?} was already used for a different request to {}",
            call.key().as_str(),
            call.scope().operation()
        )),
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
        e if e.is_retryable() => {
            tracing::warn!(error = %e, "idempotency store failed");
            Problem::new(
                StatusCode::SERVICE_UNAVAILABLE,
                slugs::STORE_UNAVAILABLE,
                "Idempotency store unavailable",
            )
            .with_detail("the request was not applied; retry with the same Idempotency-Key")
            .with_retry_after_secs(1)
        }
        e => {
            tracing::error!(error = %e, "idempotency store failed");
            Problem::new(
                StatusCode::SERVICE_UNAVAILABLE,
                slugs::STORE_UNAVAILABLE,
                "Idempotency store unavailable",
            )
            .with_detail("the request was not applied; retry with the same Idempotency-Key")
        }
    };
    problem.into_response(&cfg.problem_base)
}

/// The replay of a record; its body is the record's payload, not a copy.
fn replay(cfg: &Config, record: Record) -> Response<Body> {
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
enum Decision {
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
fn applies(status: StatusCode) -> bool {
    status.is_success() || status.is_redirection()
}

fn decide(status: StatusCode, call: &Call) -> Decision {
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
fn first(parts: http::response::Parts, body: Body) -> Response<Body> {
    let mut response = Response::from_parts(parts, body);
    response.headers_mut().remove(&IDEMPOTENT_REPLAYED);
    response
}

impl<B: TxBackend + Clone> Mode for Transactional<B> {
    async fn keyed<S, ResBody>(
        &self,
        cfg: &Config,
        mut inner: S,
        parts: Parts,
        body: Bytes,
        call: Call,
    ) -> Result<Response<Body>, S::Error>
    where
        S: Service<Request<Body>, Response = Response<ResBody>> + Send,
        S::Future: Send,
        ResBody: http_body::Body<Data = Bytes> + Send + 'static,
        ResBody::Error: Into<BoxError>,
    {
        // The request is buffered, so a run that lost a race with concurrent
        // transactions (nothing of it committed) can be run again from the
        // claim on.
        let op = call.scope().operation().as_str();
        let mut retries = ContentionRetries::new();
        loop {
            if retries.runs() > 1 {
                std::future::poll_fn(|cx| inner.poll_ready(cx)).await?;
            }
            let settled = self
                .run_once(cfg, &mut inner, parts.clone(), body.clone(), &call)
                .await?;
            let stage = match settled {
                Settled::Done(response) => return Ok(response),
                Settled::Contention(stage) => stage,
            };
            if !retries.again(op, stage).await {
                tracing::warn!(
                    operation = op,
                    runs = retries.runs(),
                    "the transaction kept conflicting; nothing was applied"
                );
                return Ok(crate::retry::conflict().into_response(&cfg.problem_base));
            }
        }
    }

    async fn unkeyed<S, ResBody>(
        &self,
        cfg: &Config,
        mut inner: S,
        mut req: Request<Body>,
    ) -> Result<Response<Body>, S::Error>
    where
        S: Service<Request<Body>, Response = Response<ResBody>> + Send,
        S::Future: Send,
        ResBody: http_body::Body<Data = Bytes> + Send + 'static,
        ResBody::Error: Into<BoxError>,
    {
        let backend = self.engine.backend().clone();
        let cell = TxCell::lazy(backend.clone());
        req.extensions_mut().insert(cell.clone());
        let response = inner.call(req).await?;
        match cell.take() {
            Taken::Unused => {}
            Taken::Tx(tx) if applies(response.status()) => {
                if let Err(e) = backend.commit(tx).await {
                    tracing::warn!(error = %e, "commit failed");
                    return Ok(Problem::new(
                        StatusCode::SERVICE_UNAVAILABLE,
                        slugs::STORE_UNAVAILABLE,
                        "Commit failed",
                    )
                    .with_detail("the request was not applied")
                    .into_response(&cfg.problem_base));
                }
            }
            Taken::Tx(tx) => {
                let _ = backend.rollback(tx).await;
            }
            Taken::StillLent => {
                tracing::error!("the handler kept the transaction past its response; nothing was committed");
                return Ok(Problem::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    slugs::TRANSACTION_UNAVAILABLE,
                    "Transaction unavailable",
                )
                .into_response(&cfg.problem_base));
            }
        }
        Ok(response.map(Body::new))
    }
}

/// How one run of a transactional request ended.
enum Settled {
    /// With this response (committed, recorded, rolled back or refused).
    Done(Response<Body>),
    /// Rolled back after contention at this stage: run it again.
    Contention(Stage),
}

impl<B: TxBackend + Clone> Transactional<B> {
    /// Claims the key, runs the handler in the claim's transaction and
    /// settles the response by its status.
    async fn run_once<S, ResBody>(
        &self,
        cfg: &Config,
        inner: &mut S,
        mut parts: Parts,
        body: Bytes,
        call: &Call,
    ) -> Result<Settled, S::Error>
    where
        S: Service<Request<Body>, Response = Response<ResBody>> + Send,
        S::Future: Send,
        ResBody: http_body::Body<Data = Bytes> + Send + 'static,
        ResBody::Error: Into<BoxError>,
    {
        let done = |response| Ok(Settled::Done(response));
        let claimed = match self.engine.begin(call).await {
            Err(e) => return done(error_response(cfg, call, e)),
            Ok(Begin::Replay(record)) => return done(replay(cfg, record)),
            Ok(Begin::Claimed(claimed)) => claimed,
        };
        hit(Point::AfterClaim);
        let (tx, ticket) = claimed.split();
        let cell = TxCell::holding(self.engine.backend().clone(), tx);
        parts.extensions.insert(cell.clone());
        // If the handler fails or this future is dropped, the cell and ticket
        // drop with it: the transaction rolls back and the key stays unused.
        let response = inner.call(Request::from_parts(parts, Body::from(body))).await?;
        let (rparts, rbody) = response.into_parts();
        let retry = rparts.extensions.get::<RetryTransaction>().is_some();
        let rejection = match decide(rparts.status, call) {
            _ if retry => {
                // The handler's own statement lost a race: whatever it says,
                // its transaction is rolled back and may run again.
                self.roll_back(&cell, ticket).await;
                return Ok(Settled::Contention(Stage::Work));
            }
            Decision::Record => false,
            Decision::RecordRejection => true,
            Decision::Release => {
                // Nothing is recorded, so the record limit does not apply and
                // the body streams on as the handler made it.
                self.roll_back(&cell, ticket).await;
                return done(first(rparts, Body::new(rbody)));
            }
        };
        // Read the body before taking the transaction back: a body that
        // streams from the transaction gives it back when it ends.
        let collected = collect_response(rbody, cfg.max_response_bytes).await;
        let claimed = match cell.take() {
            Taken::Tx(tx) => ticket.join(tx),
            Taken::Unused | Taken::StillLent => {
                tracing::error!("the handler kept the transaction past its response; nothing was committed");
                return done(
                    Problem::new(
                        StatusCode::INTERNAL_SERVER_ERROR,
                        slugs::TRANSACTION_UNAVAILABLE,
                        "Transaction unavailable",
                    )
                    .with_detail("the handler did not give its transaction back; nothing was applied")
                    .into_response(&cfg.problem_base),
                );
            }
        };
        let (body, trailers) = match collected {
            Collected::Full(body, trailers) => (body, trailers),
            Collected::TooLarge(_) => {
                self.engine.abandon(claimed).await;
                return done(
                    Problem::new(
                        StatusCode::INTERNAL_SERVER_ERROR,
                        slugs::RESPONSE_TOO_LARGE,
                        "Response too large to record",
                    )
                    .with_detail(format!(
                        "the {} response exceeded the record limit of {} bytes; nothing was applied",
                        rparts.status.as_u16(),
                        cfg.max_response_bytes
                    ))
                    .into_response(&cfg.problem_base),
                );
            }
            Collected::Failed(why) => {
                tracing::warn!(%why, "the response body failed before it could be recorded");
                self.engine.abandon(claimed).await;
                return done(
                    Problem::new(
                        StatusCode::INTERNAL_SERVER_ERROR,
                        slugs::RESPONSE_FAILED,
                        "Response failed",
                    )
                    .with_detail(format!(
                        "the {} response's body failed while it was read: {why}; nothing was applied",
                        rparts.status.as_u16()
                    ))
                    .into_response(&cfg.problem_base),
                );
            }
        };
        let record = whole_record(
            rparts.status,
            &rparts.headers,
            &body,
            &trailers,
            rejection,
            &cfg.private_headers,
        );
        hit(Point::BeforeCommit);
        if rejection {
            if let Err(e) = self.engine.reject_final(claimed, record).await {
                // The work is rolled back either way; only the record is missing,
                // so the key stays usable and the rejection still stands.
                tracing::warn!(error = %e, "could not record a final rejection");
            }
        } else {
            match self.engine.commit(claimed, record).await {
                Ok(()) => hit(Point::AfterCommit),
                // A commit that lost a race (40001, 40P01, 1213) committed nothing.
                Err(e) if e.is_contention() => return Ok(Settled::Contention(Stage::Commit)),
                Err(e) => return done(error_response(cfg, call, e)),
            }
        }
        done(first(rparts, crate::body::with_trailers(body, trailers)))
    }

    /// Rolls back a run whose response will not be recorded. If the
    /// response's body still holds the transaction, it rolls back when the
    /// body is dropped; nothing commits either way.
    async fn roll_back(&self, cell: &TxCell<B>, ticket: Ticket) {
        match cell.take() {
            Taken::Tx(tx) => self.engine.abandon(ticket.join(tx)).await,
            Taken::Unused | Taken::StillLent => drop(ticket),
        }
    }
}

/// Holds a lease's outcome as unknown if the handler panics: it ran after
/// the key was marked sent and may have acted.
struct HoldOnPanic<L: LeaseStore> {
    engine: Option<idem_core::LeaseEngine<L>>,
    lease: idem_core::Lease,
}

impl<L: LeaseStore> HoldOnPanic<L> {
    fn disarm(&mut self) {
        self.engine = None;
    }
}

impl<L: LeaseStore> Drop for HoldOnPanic<L> {
    fn drop(&mut self) {
        let Some(engine) = self.engine.take() else { return };
        if !std::thread::panicking() {
            return;
        }
        // The handler ran after the key was marked sent and may have acted
        // before it panicked: its outcome is unknown, never released for a
        // blind second run.
        let lease = self.lease.clone();
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            let detached = engine.detached().clone();
            detached.spawn_on(&handle, async move {
                let _ = engine
                    .settle_retrying(
                        &lease,
                        Some(idem_core::Record::unknown(b"the handler panicked".to_vec())),
                        idem_core::SETTLE_RETRY_WINDOW,
                    )
                    .await;
            });
        }
    }
}

impl<L: LeaseStore> Leased<L> {
    /// Claims the call's key, or answers without running the handler: a
    /// replay or a problem. A key held as an unknown outcome is reconciled
    /// first when the layer has a way to ask about this request.
    async fn claim(&self, cfg: &Config, parts: &Parts, call: &Call) -> Result<idem_core::Lease, Response<Body>> {
        match self.engine.acquire(call).await {
            Ok(Acquire::Claimed(lease)) => Ok(lease),
            Ok(Acquire::Replay(record)) => Err(replay(cfg, record)),
            Err(Error::OutcomeUnknown) => match &self.reconcile {
                Some(reconcile) if reconcile.can_ask(parts, call) => {
                    self.reconcile_held(cfg, reconcile.as_ref(), parts, call).await
                }
                _ => Err(error_response(cfg, call, Error::OutcomeUnknown)),
            },
            Err(e) => Err(error_response(cfg, call, e)),
        }
    }

    /// Reconciles a held key under its reconcile lock: a lease on the same
    /// key in a scope of its own, so that one retry per key asks at a time,
    /// across every instance on the store. Twins wait for the lock as the
    /// policy says for an in-flight request (or get 409 in flight).
    async fn reconcile_held(
        &self,
        cfg: &Config,
        reconcile: &dyn crate::Reconcile,
        parts: &Parts,
        call: &Call,
    ) -> Result<idem_core::Lease, Response<Body>> {
        let unknown = || error_response(cfg, call, Error::OutcomeUnknown);
        let Ok(operation) = idem_core::Operation::new(format!("{} (reconcile)", call.scope().operation())) else {
            return Err(unknown());
        };
        let lock_call = Call::new(
            Scope::new(call.scope().tenant().clone(), operation),
            call.key().clone(),
            *call.fingerprint(),
        )
        .with_policy(*call.policy());
        let lock = match self.engine.acquire(&lock_call).await {
            Ok(Acquire::Claimed(lock)) => lock,
            // A lock is never recorded; a row found there is not ours to use.
            Ok(Acquire::Replay(_)) => return Err(unknown()),
            Err(e) => return Err(error_response(cfg, call, e)),
        };
        let beat = self.engine.heartbeat(&lock, lock_call.policy().effective_lease_ms());
        let held = beat.held().clone();
        // The lock is given back whatever happens to this future.
        let release = ReleaseLock {
            engine: self.engine.clone(),
            lock: Some(lock),
        };
        let result = self.reconcile_locked(cfg, reconcile, parts, call, &held).await;
        beat.stop();
        drop(release);
        result
    }

    async fn reconcile_locked(
        &self,
        cfg: &Config,
        reconcile: &dyn crate::Reconcile,
        parts: &Parts,
        call: &Call,
        lock: &idem_core::HeldLease,
    ) -> Result<idem_core::Lease, Response<Body>> {
        let op = call.scope().operation().as_str();
        let unknown = || error_response(cfg, call, Error::OutcomeUnknown);
        let mut asked = 0;
        loop {
            // Looked at (again) under the lock: another retry may have settled
            // the key while this one waited, or claimed it the moment it was
            // released and sent the request again, which may be held again by
            // now. Only an outcome held now is asked about, so an answer is
            // never applied to a later send than the one it was asked after.
            match self.engine.acquire(call).await {
                Ok(Acquire::Claimed(lease)) => return Ok(lease),
                Ok(Acquire::Replay(record)) => return Err(replay(cfg, record)),
                Err(Error::OutcomeUnknown) if asked < MAX_RECONCILE_ASKS => asked += 1,
                Err(e) => return Err(error_response(cfg, call, e)),
            }
            // When the held request was sent: a "not applied" asked before it
            // has settled may only mean the other side has not finished yet.
            // (An unknown outcome recorded from the other side's answer has
            // settled already: nothing of it is in flight there.)
            let sent_at_ms = match self.engine.lookup(call.scope(), call.key()).await {
                Ok(row) => row.and_then(|row| match &row.state {
                    idem_core::RowState::Done(record) if crate::lease::was_answered(record) => None,
                    _ => row.sent_at_ms,
                }),
                Err(e) => return Err(error_response(cfg, call, e)),
            };
            let answer = reconcile.ask(parts, call).await;
            // A retry stopped past its lock's lease while it asked (a pause,
            // an unreachable store) may have been overtaken by another that
            // asked, released the key and sent the request again: its answer
            // would then be about an outcome that is no longer the one held.
            let margin_ms = i64::try_from(call.policy().effective_lease_ms() / 3)
                .unwrap_or(i64::MAX)
                .min(10_000);
            if !lock.holds_for(self.engine.clock().now_ms(), margin_ms) {
                tracing::warn!(
                    operation = op,
                    "the reconcile lock ran out while asking; the key stays held"
                );
                return Err(unknown());
            }
            let resolution = match answer {
                crate::Reconciled::Applied(response) => {
                    let (rparts, body) = response.into_parts();
                    if body.len() > cfg.max_response_bytes {
                        tracing::warn!(
                            operation = op,
                            bytes = body.len(),
                            "the reconcile answer is larger than the record limit; the key stays held"
                        );
                        return Err(unknown());
                    }
                    let mut headers = rparts.headers;
                    crate::headers::strip_hop_by_hop(&mut headers);
                    Some(whole_record(
                        rparts.status,
                        &headers,
                        &body,
                        &http::HeaderMap::new(),
                        false,
                        &cfg.private_headers,
                    ))
                }
                crate::Reconciled::NotApplied => {
                    let settle_ms = i64::try_from(reconcile.settle_after(parts, call).as_millis()).unwrap_or(i64::MAX);
                    let now_ms = self.engine.clock().now_ms();
                    if let Some(settled_at) = sent_at_ms.map(|at| at.saturating_add(settle_ms))
                        && now_ms < settled_at
                    {
                        let wait_secs = u64::try_from(settled_at - now_ms).unwrap_or(0).div_ceil(1000).max(1);
                        tracing::info!(
                            operation = op,
                            wait_secs,
                            "\"not applied\" asked before the held request settled; the key stays held"
                        );
                        let mut held = unknown();
                        held.headers_mut()
                            .insert(http::header::RETRY_AFTER, http::HeaderValue::from(wait_secs));
                        return Err(held);
                    }
                    None
                }
                crate::Reconciled::Unknown => return Err(unknown()),
            };
            match self
                .engine
                .resolve_unknown(call.scope(), call.key(), resolution.as_ref())
                .await
            {
                Ok(resolved) => tracing::info!(
                    operation = op,
                    applied = resolution.is_some(),
                    resolved,
                    "a held outcome was reconciled"
                ),
                Err(e) => return Err(error_response(cfg, call, e)),
            }
            // Still under the lock: twins that waited for it find the key
            // claimed by this retry (and wait or get 409) or recorded (and
            // replay).
        }
    }
}

/// How many times one retry asks about a key under its reconcile lock:
/// after a "not applied", a retry that was not waiting for the lock may
/// claim the released key first and have its send held again.
const MAX_RECONCILE_ASKS: u32 = 3;

/// Gives a reconcile lock back when dropped, in a task of its own so that a
/// caller that went away still frees it at once rather than at its lease's end.
struct ReleaseLock<L: LeaseStore> {
    engine: idem_core::LeaseEngine<L>,
    lock: Option<idem_core::Lease>,
}

impl<L: LeaseStore> Drop for ReleaseLock<L> {
    fn drop(&mut self) {
        let Some(lock) = self.lock.take() else { return };
        let engine = self.engine.clone();
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            let detached = engine.detached().clone();
            detached.spawn_on(&handle, async move {
                if let Err(e) = engine.release(&lock).await {
                    tracing::warn!(error = %e, "could not give a reconcile lock back; it will expire");
                }
            });
        }
    }
}

/// What the lease-mode task needs of the layer's configuration.
#[derive(Clone)]
struct Recording {
    max_response_bytes: usize,
    problem_base: Arc<str>,
    private_headers: Arc<[http::HeaderName]>,
}

impl<L: LeaseStore> Mode for Leased<L> {
    async fn keyed<S, ResBody>(
        &self,
        cfg: &Config,
        mut inner: S,
        parts: Parts,
        body: Bytes,
        call: Call,
    ) -> Result<Response<Body>, S::Error>
    where
        S: Service<Request<Body>, Response = Response<ResBody>> + Send + 'static,
        S::Future: Send,
        S::Error: Send + 'static,
        ResBody: http_body::Body<Data = Bytes> + Send + 'static,
        ResBody::Error: Into<BoxError>,
    {
        let lease = match self.claim(cfg, &parts, &call).await {
            Ok(lease) => lease,
            Err(answer) => return Ok(answer),
        };
        hit(Point::AfterClaim);
        // From here on the handler may take effect, so everything up to the
        // recorded outcome runs in a task of its own: a request future
        // dropped now (the client went away, an outer timeout) neither
        // releases the key nor stops the recording. The heartbeat keeps the
        // lease alive until the outcome is settled; it beats in that same
        // task, polled beside the work, rather than in a task of its own.
        let (held, beats) = self
            .engine
            .heartbeat_in_place(&lease, call.policy().effective_lease_ms());
        let version = parts.version;
        let mut req = Request::from_parts(parts, Body::from(body));
        let still_held = held.clone();
        req.extensions_mut().insert(crate::lease::HeldLease(held));
        let engine = self.engine.clone();
        let recording = Recording {
            max_response_bytes: cfg.max_response_bytes,
            problem_base: cfg.problem_base.clone(),
            private_headers: cfg.private_headers.clone(),
        };
        // An HTTP/1.0 caller of a body of unknown length would get it
        // close-delimited, where a cut-off looks like the end: it gets the
        // whole response instead.
        let streaming = self.streaming.filter(|_| version >= http::Version::HTTP_11);
        // The task hands the response over as soon as it can be sent (after
        // the record, or at once when it streams) and goes on to its end.
        let (answer, answered) = tokio::sync::oneshot::channel();
        // Counted in the engine's detached work: a graceful shutdown waits
        // for it, so a caller gone before the answer still gets it recorded.
        let task = self.engine.detached().spawn(tracing::Instrument::in_current_span(async move {
            // The work and its settlement, while the heartbeat beats.
            let work = async move {
                // A holder stopped past its whole lease between its claim and
                // here (a paused process) may have been overtaken by a twin
                // that claimed the key and ran the handler: it runs nothing.
                if !still_held.holds_for(engine.clock().now_ms(), 0) {
                    tracing::warn!(
                        operation = call.scope().operation().as_str(),
                        "the lease ran out before the handler started; nothing runs"
                    );
                    let settled = engine.release(&lease).await;
                    let late = Problem::new(StatusCode::CONFLICT, slugs::KEY_IN_FLIGHT, "Request in flight")
                        .with_detail(
                            "this request's claim ran out before it could run; another request with this \
                             Idempotency-Key may hold it now: retry later",
                        )
                        .with_retry_after_secs(1)
                        .into_response(&recording.problem_base);
                    return (settled, Some((answer, Ok(late))), None);
                }
                // Nothing reaches the handler, and so nothing can leave for the
                // other side, before the key is marked sent: a holder that dies
                // from here on leaves an unknown outcome (reconciled or held),
                // never a key that a twin takes over and sends again.
                let marked = if skips_sent_mark() {
                    Ok(())
                } else {
                    engine.mark_sent(&lease).await
                };
                if let Err(e) = marked {
                    let unsent = match e {
                        Error::Fenced => Problem::new(StatusCode::CONFLICT, slugs::KEY_IN_FLIGHT, "Request in flight")
                            .with_detail(
                                "another request with this Idempotency-Key holds it now; retry later",
                            )
                            .with_retry_after_secs(1),
                        e => {
                            tracing::warn!(error = %e, "could not mark the request sent; nothing was sent");
                            Problem::new(
                                StatusCode::SERVICE_UNAVAILABLE,
                                slugs::STORE_UNAVAILABLE,
                                "Idempotency store unavailable",
                            )
                            .with_detail("the request was not applied; retry with the same Idempotency-Key")
                            .with_retry_after_secs(1)
                        }
                    };
                    let settled = engine.release_unsent(&lease).await;
                    return (settled, Some((answer, Ok(unsent.into_response(&recording.problem_base)))), None);
                }
                let mut guard = HoldOnPanic {
                    engine: Some(engine.clone()),
                    lease: lease.clone(),
                };
                let response = inner.call(req).await;
                guard.disarm();
                // A whole response is handed over once its outcome is settled, a
                // streamed one at once; its body ends once the outcome is settled.
                // Either way a caller that has read the whole response can replay it.
                let mut stream_end = None;
                let mut deliver = None;
                let settle = match response {
                    Ok(response) => match streaming {
                        // 204 and 304 have no body to stream.
                        Some(streaming)
                            if !matches!(decide(response.status(), &call), Decision::Release)
                                && !matches!(response.status(), StatusCode::NO_CONTENT | StatusCode::NOT_MODIFIED)
                                && !small_and_whole(&response, recording.max_response_bytes) =>
                        {
                            let (record, tx) = stream_and_record(&recording, &call, streaming, response, answer).await;
                            stream_end = tx;
                            Some(record)
                        }
                        _ => {
                            let (settle, response) = settle_response(&recording, &call, response).await;
                            deliver = Some((answer, response));
                            settle
                        }
                    },
                    Err(e) => {
                        deliver = Some((answer, Err(e)));
                        None
                    }
                };
                hit(Point::BeforeCommit);
                if settle
                    .as_ref()
                    .is_some_and(|record| record.status == idem_core::RecordStatus::Unknown)
                {
                    tracing::warn!(
                        operation = call.scope().operation().as_str(),
                        "the outcome is unknown: the key is held until it is resolved"
                    );
                }
                // A write the store refuses is tried again while the heartbeat
                // keeps the lease; should the lease run out meanwhile, the sent
                // mark holds the key as an unknown outcome, never released.
                let settled = engine
                    .settle_retrying(&lease, settle, idem_core::SETTLE_RETRY_WINDOW)
                    .await;
                (settled, deliver, stream_end)
            };
            // The beats end with the work: once the outcome is settled the
            // lease is no longer extended.
            let (settled, deliver, stream_end) = tokio::select! {
                biased;
                out = work => out,
                never = beats => match never {},
            };
            match settled {
                Ok(()) => hit(Point::AfterCommit),
                Err(Error::Fenced) => tracing::warn!(
                    "lease lost before the outcome was recorded: another request took the key over; nothing was overwritten"
                ),
                Err(e) => tracing::error!(
                    error = %e,
                    "could not record the outcome; the key is held as an unknown outcome once its lease runs out"
                ),
            }
            if let Some((answer, response)) = deliver {
                let _ = answer.send(response);
            }
            if let (Some(end), Some(streaming)) = (stream_end, streaming) {
                end.finish(streaming.stall, Chunk::End).await;
            }
        }));
        match answered.await {
            Ok(response) => response,
            Err(_) => match task.await {
                Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
                _ => {
                    tracing::error!("the lease-mode task was cancelled");
                    Ok(Problem::new(
                        StatusCode::SERVICE_UNAVAILABLE,
                        slugs::STORE_UNAVAILABLE,
                        "Request interrupted",
                    )
                    .with_detail("the service is shutting down; retry with the same Idempotency-Key")
                    .with_retry_after_secs(1)
                    .into_response(&cfg.problem_base))
                }
            },
        }
    }

    async fn unkeyed<S, ResBody>(&self, _cfg: &Config, inner: S, req: Request<Body>) -> Result<Response<Body>, S::Error>
    where
        S: Service<Request<Body>, Response = Response<ResBody>> + Send + 'static,
        S::Future: Send,
        S::Error: Send + 'static,
        ResBody: http_body::Body<Data = Bytes> + Send + 'static,
        ResBody::Error: Into<BoxError>,
    {
        passthrough(inner, req).await
    }
}

/// The most bytes a declared body length may have for the body to be read
/// whole rather than streamed.
const WHOLE_BYTES: u64 = 16 * 1024;

/// Whether a response is answered whole even when responses stream: its
/// body declares an exact length of at most [`WHOLE_BYTES`] that fits the
/// record. A streamed body ends only after the record anyway, so its caller
/// sees the same response at the same moment, without frames handed from the
/// recording task to the connection one by one.
fn small_and_whole<B: http_body::Body>(response: &Response<B>, max_response_bytes: usize) -> bool {
    response
        .body()
        .size_hint()
        .exact()
        .is_some_and(|n| n <= WHOLE_BYTES && n <= max_response_bytes as u64)
}

/// How many frames the channel to the first caller holds; the frames behind
/// them wait in the recording task's queue, bounded in bytes.
const STREAM_FRAMES: usize = 16;

/// The frames a streamed response has read and not yet handed to its first
/// caller.
struct Behind {
    tx: tokio::sync::mpsc::Sender<Chunk>,
    frames: std::collections::VecDeque<http_body::Frame<Bytes>>,
    bytes: usize,
}

impl Behind {
    fn push(&mut self, frame: http_body::Frame<Bytes>) {
        self.bytes += frame.data_ref().map_or(0, Bytes::len);
        self.frames.push_back(frame);
    }

    fn pop(&mut self) -> Option<http_body::Frame<Bytes>> {
        let frame = self.frames.pop_front()?;
        self.bytes -= frame.data_ref().map_or(0, Bytes::len);
        Some(frame)
    }
}

/// Streams a response that is to be recorded to its first caller (through
/// `answer`) while keeping it for the record. The body is read at its own
/// pace while the frames the caller has not taken yet fit in
/// `max_response_bytes` (so a body that fits the record is read whole
/// however slow the caller), then at the caller's; a caller that takes
/// nothing for `stall` is cut off (its body ends in an error).
/// Returns the record and what is still to be sent to the caller once the
/// outcome is settled (its last frames and the end).
async fn stream_and_record<ResBody, E>(
    recording: &Recording,
    call: &Call,
    streaming: crate::layer::Streaming,
    response: Response<ResBody>,
    answer: tokio::sync::oneshot::Sender<Result<Response<Body>, E>>,
) -> (Record, Option<Behind>)
where
    ResBody: http_body::Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    use http_body_util::BodyExt;

    let (rparts, rbody) = response.into_parts();
    let status = rparts.status;
    let headers = rparts.headers.clone();
    let rejected = matches!(decide(status, call), Decision::RecordRejection);
    let (tx, chunks) = tokio::sync::mpsc::channel(STREAM_FRAMES);
    let streamed = crate::body::Streamed::new(chunks, rbody.size_hint().exact());
    let mut caller = answer
        .send(Ok(first(rparts, Body::new(streamed))))
        .is_ok()
        .then(|| Behind {
            tx,
            frames: std::collections::VecDeque::new(),
            bytes: 0,
        });
    let mut tee = crate::body::Tee::new(recording.max_response_bytes);
    let mut body = std::pin::pin!(rbody);
    let mut progress = tokio::time::Instant::now();
    let queue_limit = recording.max_response_bytes.max(1);
    let teed = loop {
        let waiting = caller.as_ref().is_some_and(|c| !c.frames.is_empty());
        // A full queue waits for the caller (who is cut off after `stall`).
        let full = caller.as_ref().is_some_and(|c| c.bytes >= queue_limit);
        let sender = caller.as_ref().filter(|_| waiting).map(|c| c.tx.clone());
        tokio::select! {
            biased;
            // The body's error type need not be Send: it is turned into
            // words before anything else is awaited.
            next = body.frame(), if !full => match next.map(|r| r.map_err(|e| e.into().to_string())) {
                None => break tee.finish(),
                Some(Ok(frame)) => {
                    tee.keep(&frame);
                    // Trailers and a frame the body says is its last go out
                    // with the end, after the record.
                    let last = frame.is_trailers() || body.is_end_stream();
                    if let Some(c) = &mut caller {
                        if c.frames.is_empty() {
                            progress = tokio::time::Instant::now();
                        }
                        c.push(frame);
                    }
                    if last {
                        break tee.finish();
                    }
                }
                Some(Err(why)) => break crate::body::Teed::Failed(why),
            },
            permit = async { sender.expect("waiting").reserve_owned().await }, if waiting => {
                let c = caller.as_mut().expect("waiting");
                match permit {
                    Ok(permit) => {
                        permit.send(Chunk::Frame(c.pop().expect("waiting")));
                        progress = tokio::time::Instant::now();
                    }
                    Err(_) => caller = None,
                }
            },
            () = tokio::time::sleep_until(progress + streaming.stall), if waiting => {
                tracing::warn!(
                    stall_ms = streaming.stall.as_millis() as u64,
                    "the first caller took nothing in time; its response is cut off and the recording goes on"
                );
                caller = None;
            },
        }
    };
    let record = match teed {
        crate::body::Teed::Full(body, trailers) => {
            whole_record(status, &headers, &body, &trailers, rejected, &recording.private_headers)
        }
        crate::body::Teed::TooLarge => stand_in(recording, status, StandIn::TooLarge).0,
        crate::body::Teed::Failed(why) => {
            tracing::warn!(%why, "response body failed after the handler ran");
            // The frames read before the failure, then the error; dropping
            // the sender cuts the caller off with an error even when this
            // does not fit in time.
            if let Some(c) = caller.take() {
                c.finish(streaming.stall, Chunk::Failed(why.clone())).await;
            }
            stand_in(recording, status, StandIn::Failed(why)).0
        }
    };
    (record, caller)
}

impl Behind {
    /// Sends the frames still queued, the last of them marked as the end
    /// (so the connection writes it with the end of the body), then `end`
    /// unless it was `Chunk::End` and went with the last frame.
    async fn finish(mut self, stall: std::time::Duration, end: Chunk) {
        let mut end = Some(end);
        while let Some(chunk) = match self.pop() {
            Some(frame) if self.frames.is_empty() && matches!(end, Some(Chunk::End)) => {
                end = None;
                Some(Chunk::Last(frame))
            }
            Some(frame) => Some(Chunk::Frame(frame)),
            None => end.take(),
        } {
            if !matches!(tokio::time::timeout(stall, self.tx.send(chunk)).await, Ok(Ok(()))) {
                return;
            }
        }
    }
}

/// Decides by status what a lease-mode response does to its key, and reads
/// it if it is to be recorded. A response that is not to be recorded (5xx,
/// and 4xx unless the policy records final rejections) is never read, bounded
/// or recorded: it streams to the client and the key is released. A response
/// to be recorded that is too large or whose body fails has already taken
/// effect: a stand-in saying so is recorded, so a retry does not run it again.
async fn settle_response<ResBody, E>(
    recording: &Recording,
    call: &Call,
    response: Response<ResBody>,
) -> (Option<Record>, Result<Response<Body>, E>)
where
    ResBody: http_body::Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    let (mut rparts, rbody) = response.into_parts();
    let rejected = match decide(rparts.status, call) {
        Decision::Release => {
            // The answer goes to its caller as it is; the key is held
            // rather than released when its outcome is unknown.
            let unknown = rparts
                .extensions
                .remove::<crate::lease::OutcomeUnknown>()
                .map(|u| Record::unknown(u.stored_note()));
            return (unknown, Ok(first(rparts, Body::new(rbody))));
        }
        Decision::Record => false,
        Decision::RecordRejection => true,
    };
    match collect_response(rbody, recording.max_response_bytes).await {
        Collected::Full(body, trailers) => {
            let record = whole_record(
                rparts.status,
                &rparts.headers,
                &body,
                &trailers,
                rejected,
                &recording.private_headers,
            );
            (
                Some(record),
                Ok(first(rparts, crate::body::with_trailers(body, trailers))),
            )
        }
        Collected::TooLarge(body) => (
            Some(stand_in(recording, rparts.status, StandIn::TooLarge).0),
            Ok(first(rparts, body)),
        ),
        Collected::Failed(why) => {
            tracing::warn!(%why, "response body failed after the handler ran");
            let (record, response) = stand_in(recording, rparts.status, StandIn::Failed(why.to_string()));
            (Some(record), Ok(response))
        }
    }
}

/// The record of a response read whole: completed, or a recorded rejection.
/// Private headers are left out: the first caller got them, no replay will.
fn whole_record(
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

/// Why a response that took effect could not be recorded as it was.
enum StandIn {
    TooLarge,
    Failed(String),
}

/// The problem recorded (and, for a failed body, answered) in place of a
/// response that took effect but could not be recorded.
fn stand_in(recording: &Recording, original: StatusCode, why: StandIn) -> (Record, Response<Body>) {
    let (slug, title, detail) = match why {
        StandIn::TooLarge => (
            slugs::RESPONSE_TOO_LARGE,
            "Response too large to record",
            format!(
                "the request was processed (status {}) but its response exceeded the record limit of {} bytes",
                original.as_u16(),
                recording.max_response_bytes
            ),
        ),
        StandIn::Failed(why) => (
            slugs::RESPONSE_FAILED,
            "Response failed",
            format!(
                "the request was processed (status {}) but its response body failed: {why}",
                original.as_u16()
            ),
        ),
    };
    let body = serde_json::json!({
        "type": format!("{}{}", recording.problem_base, slug),
        "title": title,
        "status": 500,
        "detail": detail,
    })
    .to_string();
    let mut headers = http::HeaderMap::new();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static(crate::problem::PROBLEM_JSON),
    );
    let recorded = RecordedResponse {
        status: StatusCode::INTERNAL_SERVER_ERROR,
        headers,
        body: Bytes::from(body),
        trailers: http::HeaderMap::new(),
    };
    let record = Record::completed(recorded.encode());
    let mut response = Response::new(Body::from(recorded.body));
    *response.status_mut() = recorded.status;
    *response.headers_mut() = recorded.headers;
    (record, response)
}
