//! Multi-step operations behind the HTTP contract (feature `steps`): one
//! route, one [`HttpOperation`], one line of wiring.
//!
//! ```no_run
//! # use std::sync::Arc;
//! # use axum::{Router, routing::post_service};
//! # use idem_core::Tenant;
//! # use idem_http::{Problem, steps::{HttpOperation, Steps}};
//! # use idem_memory::{MemoryMultiSteps, MemoryStore};
//! # use idem_steps::StepsEngine;
//! # fn wire<O: HttpOperation<MemoryStore>>(op: O) -> Router {
//! let engine = Arc::new(StepsEngine::new(MemoryStore::new(), MemoryMultiSteps::new()));
//! let steps = Steps::new(engine, |parts| {
//!     let tenant = parts.headers.get("x-tenant").and_then(|v| v.to_str().ok());
//!     tenant.and_then(|t| Tenant::new(t).ok()).ok_or_else(|| {
//!         Problem::new(http::StatusCode::UNAUTHORIZED, "unauthorized", "Unauthorized")
//!     })
//! });
//! Router::new().route("/v1/withdrawals", post_service(steps.service(op)))
//! # }
//! ```
//!
//! The request goes through the same checks as the layer's before anything
//! is written: the `Idempotency-Key` (required), the bounded body, the
//! tenant, the fingerprint, then [`HttpOperation::input`]. The scope's
//! operation is the matched route (`POST /v1/withdrawals`), so a route
//! wired this way must not also sit under an [`IdempotencyLayer`]'s
//! `route_layer` (add it after the layer).
//!
//! The operation runs in a task of its own, counted in
//! [`Steps::detached`]: a client that goes away never cuts a step in half,
//! and a server that stops waits for it. The request waits for it up to
//! [`Steps::respond_within`]; past that the client gets 409
//! `idempotency-key-in-flight` and its retry with the same key answers the
//! outcome.
//!
//! | outcome | answer |
//! |---|---|
//! | completed | [`HttpOperation::completed`] of its recorded output; `Idempotent-Replayed: true` on replays |
//! | compensated after a declared failure | [`HttpOperation::failed`] of the failure; marked on replays too |
//! | its first step refused (nothing recorded, the key unused) | [`HttpOperation::failed`] |
//! | its first step refused, for an operation whose [`CONSUME`](idem_steps::Operation::CONSUME) records it | [`HttpOperation::failed`]; marked on replays too |
//! | held on an unknown outcome | 409 `idempotency-outcome-unknown`, with `step` |
//! | held otherwise | 409 `idempotency-operation-held`, with `step` and `hold` |
//! | another run holds it, or it waits to run again | 409 `idempotency-key-in-flight`, `Retry-After` |
//! | the key was used with another request | 422 `idempotency-key-reused` |
//! | the store failed | 503 `idempotency-store-unavailable` |
//!
//! [`IdempotencyLayer`]: crate::IdempotencyLayer

use std::convert::Infallible;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum_core::body::Body;
use bytes::Bytes;
use http::{HeaderValue, Request, Response, StatusCode, request::Parts};
use idem_core::multistep::{HoldKind, MultiStep, MultiStepStore};
use idem_core::{BoxFuture, Call, Detached, Error, FingerprintVersion, Scope, Tenant, TxBackend};
use idem_steps::{Finished, Operation, StepsEngine};
use tower_service::Service;

use crate::IDEMPOTENT_REPLAYED;
use crate::drain::Drain;
use crate::key::{KeyHeader, parse_key_header};
use crate::layer::{TenantFn, matched_route_operation};
use crate::problem::{DEFAULT_PROBLEM_BASE, Problem, slugs};
use crate::service::{
    Arrival, ByteBody, fingerprint, key_invalid, key_missing, key_reused, outcome, store_failed, unavailable,
};

/// A multi-step operation served over HTTP: how a request becomes its
/// input, and how its outcome becomes a response.
///
/// `completed` and `failed` read only what is recorded (the output, the
/// failure), never the request: an operation a completer finished answers
/// its client's retry with the same bytes as one its client saw finish.
pub trait HttpOperation<B: TxBackend>: Operation<B> + 'static {
    /// The operation's input from the request; a problem refuses the
    /// request and nothing is written.
    fn input(&self, parts: &Parts, body: &Bytes) -> Result<Self::Input, Problem>;

    /// The response of a completed operation.
    fn completed(&self, output: &Self::Output) -> Response<Bytes>;

    /// The response of a declared failure: the operation was compensated,
    /// or its first step refused it before anything was recorded (and that
    /// refusal was recorded when the operation's
    /// [`CONSUME`](idem_steps::Operation::CONSUME) says so).
    fn failed(&self, failure: &serde_json::Value) -> Response<Bytes>;
}

/// The default time a request waits for its operation: 25 s.
pub const DEFAULT_RESPOND_WITHIN: Duration = Duration::from_secs(25);

/// Serves [`HttpOperation`]s on a [`StepsEngine`]; clones share it.
pub struct Steps<B: TxBackend, S: MultiStepStore<B>> {
    shared: Arc<Shared<B, S>>,
}

struct Shared<B: TxBackend, S: MultiStepStore<B>> {
    engine: Arc<StepsEngine<B, S>>,
    tenant: TenantFn,
    max_request_bytes: usize,
    problem_base: Arc<str>,
    drain: Drain,
    respond_within: Duration,
    detached: Detached,
}

impl<B: TxBackend, S: MultiStepStore<B>> Clone for Steps<B, S> {
    fn clone(&self) -> Self {
        Self {
            shared: self.shared.clone(),
        }
    }
}

impl<B: TxBackend, S: MultiStepStore<B>> std::fmt::Debug for Steps<B, S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Steps")
            .field("max_request_bytes", &self.shared.max_request_bytes)
            .field("respond_within", &self.shared.respond_within)
            .finish_non_exhaustive()
    }
}

impl<B: TxBackend, S: MultiStepStore<B>> Steps<B, S> {
    /// Serves operations on `engine`; `tenant` names each request's tenant
    /// (as the layer's does). Bodies up to 1 MiB, answers within
    /// [`DEFAULT_RESPOND_WITHIN`].
    pub fn new(
        engine: Arc<StepsEngine<B, S>>,
        tenant: impl Fn(&Parts) -> Result<Tenant, Problem> + Send + Sync + 'static,
    ) -> Self {
        Self {
            shared: Arc::new(Shared {
                engine,
                tenant: Arc::new(tenant),
                max_request_bytes: 1 << 20,
                problem_base: Arc::from(DEFAULT_PROBLEM_BASE),
                drain: Drain::default(),
                respond_within: DEFAULT_RESPOND_WITHIN,
                detached: Detached::new(),
            }),
        }
    }

    fn config_mut(&mut self) -> &mut Shared<B, S> {
        Arc::get_mut(&mut self.shared).expect("Steps is configured before it is cloned")
    }

    /// The largest request body read (default 1 MiB); larger ones get 413
    /// before anything is written.
    pub fn max_request_bytes(mut self, bytes: usize) -> Self {
        self.config_mut().max_request_bytes = bytes;
        self
    }

    /// How long a request waits for its operation before it answers 409
    /// `idempotency-key-in-flight` (the operation goes on).
    pub fn respond_within(mut self, within: Duration) -> Self {
        self.config_mut().respond_within = within;
        self
    }

    /// The base of problem `type` URIs (default [`DEFAULT_PROBLEM_BASE`]).
    pub fn problem_base(mut self, base: impl Into<String>) -> Self {
        self.config_mut().problem_base = Arc::from(base.into());
        self
    }

    /// The engine, for completers.
    pub fn engine(&self) -> &Arc<StepsEngine<B, S>> {
        &self.shared.engine
    }

    /// The operations still running after their request was answered; a
    /// server waits for [`Detached::idle`] before it stops.
    pub fn detached(&self) -> &Detached {
        &self.shared.detached
    }

    /// The service of `op`, for `axum::routing::post_service`.
    pub fn service<O: HttpOperation<B>>(&self, op: O) -> StepsService<O, B, S> {
        StepsService {
            op: Arc::new(op),
            steps: self.clone(),
        }
    }
}

/// The service of one [`HttpOperation`] (see [`Steps::service`]).
pub struct StepsService<O, B: TxBackend, S: MultiStepStore<B>> {
    op: Arc<O>,
    steps: Steps<B, S>,
}

impl<O, B: TxBackend, S: MultiStepStore<B>> Clone for StepsService<O, B, S> {
    fn clone(&self) -> Self {
        Self {
            op: self.op.clone(),
            steps: self.steps.clone(),
        }
    }
}

impl<O, B: TxBackend, S: MultiStepStore<B>> std::fmt::Debug for StepsService<O, B, S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StepsService").finish_non_exhaustive()
    }
}

impl<O, B, S, ReqBody> Service<Request<ReqBody>> for StepsService<O, B, S>
where
    O: HttpOperation<B>,
    B: TxBackend,
    S: MultiStepStore<B>,
    ReqBody: ByteBody,
{
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<'static, Result<Response<Body>, Infallible>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<ReqBody>) -> Self::Future {
        let (op, shared) = (self.op.clone(), self.steps.shared.clone());
        Box::pin(async move { Ok(handle(op, shared, req).await) })
    }
}

async fn handle<O, B, S, ReqBody>(op: Arc<O>, shared: Arc<Shared<B, S>>, req: Request<ReqBody>) -> Response<Body>
where
    O: HttpOperation<B>,
    B: TxBackend,
    S: MultiStepStore<B>,
    ReqBody: ByteBody,
{
    let started = Instant::now();
    let base = &*shared.problem_base;
    let (parts, body) = req.into_parts();
    let Some(operation) = matched_route_operation(&parts) else {
        return Problem::new(StatusCode::NOT_FOUND, "not-found", "Not found").into_response(base);
    };
    let arrival = Arrival {
        operation: &operation,
        started,
        drain: &shared.drain,
        problem_base: base,
    };
    let key = match parse_key_header(&parts.headers) {
        KeyHeader::Present(key) => key,
        KeyHeader::Missing => return arrival.refuse("key_missing", body, key_missing(&operation)).await,
        KeyHeader::Invalid(why) => return arrival.refuse("key_invalid", body, key_invalid(why)).await,
    };
    let bytes = match arrival.read_body(body, &parts, shared.max_request_bytes).await {
        Ok(bytes) => bytes,
        Err(refused) => return refused,
    };
    let tenant = match (shared.tenant)(&parts) {
        Ok(tenant) => tenant,
        Err(problem) => return problem.into_response(base),
    };
    let print = fingerprint(FingerprintVersion::V2, &operation, &parts, &bytes);
    let input = match op.input(&parts, &bytes) {
        Ok(input) => input,
        Err(problem) => {
            outcome(&operation, "input_rejected", started);
            return problem.into_response(base);
        }
    };
    let call = Call::new(Scope::new(tenant, operation.clone()), key, print);
    let span = tracing::info_span!("idem.steps", operation = %operation, key = %call.key(), definition = O::NAME);
    let run = {
        let (op, engine, call) = (op.clone(), shared.engine.clone(), call.clone());
        shared.detached.spawn(tracing::Instrument::instrument(
            async move { engine.execute(&*op, &call, &input).await },
            span,
        ))
    };
    let (result, response) = match tokio::time::timeout(shared.respond_within, run).await {
        Err(_) => ("in_flight", in_flight(1).into_response(base)),
        Ok(Err(join)) => {
            tracing::error!(error = %join, "a multi-step operation's run failed");
            let problem = Problem::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "idempotency-operation-failed",
                "Operation failed",
            )
            .with_detail("the operation's run stopped unexpectedly; retry with the same Idempotency-Key");
            ("failed", problem.into_response(base))
        }
        Ok(Ok(Ok(finished))) => answer(&*op, &shared, &call, finished).await,
        Ok(Ok(Err(e))) => ("error", error(base, &call, e)),
    };
    outcome(&operation, result, started);
    response
}

/// The response of a finished call, and its metric result.
async fn answer<O, B, S>(
    op: &O,
    shared: &Shared<B, S>,
    call: &Call,
    finished: Finished<O::Output>,
) -> (&'static str, Response<Body>)
where
    O: HttpOperation<B>,
    B: TxBackend,
    S: MultiStepStore<B>,
{
    let base = &*shared.problem_base;
    let (response, replayed) = match finished {
        Finished::Completed { output, replayed } => (op.completed(&output), replayed),
        Finished::Compensated { failure, replayed } => (op.failed(&failure), replayed),
        Finished::Rejected(failure) => (op.failed(&failure), false),
        Finished::InFlight => return ("in_flight", in_flight(1).into_response(base)),
        Finished::Held(kind) => {
            // The step it stands at, for the client and the operator.
            let row = shared
                .engine
                .store()
                .find(call.scope(), call.key())
                .await
                .ok()
                .flatten();
            return ("held", held(kind, row.as_ref()).into_response(base));
        }
    };
    let mut response = response.map(Body::from);
    if replayed {
        response
            .headers_mut()
            .insert(IDEMPOTENT_REPLAYED.clone(), HeaderValue::from_static("true"));
        ("replayed", response)
    } else {
        response.headers_mut().remove(&IDEMPOTENT_REPLAYED);
        ("handled", response)
    }
}

fn in_flight(secs: u64) -> Problem {
    Problem::new(StatusCode::CONFLICT, slugs::KEY_IN_FLIGHT, "Request in flight")
        .with_detail("the operation under this Idempotency-Key is still running; retry later with the same key")
        .with_retry_after_secs(secs)
}

/// The step a held operation stands at: its open send, else the next one
/// after its journal.
fn step_of(row: &MultiStep) -> String {
    match (&row.open, row.journal.entries().last()) {
        (Some(open), _) => open.step.clone(),
        (None, Some(last)) => format!("after {}", last.name),
        (None, None) => "start".to_owned(),
    }
}

fn held(kind: HoldKind, row: Option<&MultiStep>) -> Problem {
    let step = row.map_or_else(|| "unknown".to_owned(), step_of);
    let id = row.map_or(0, |r| r.id);
    let problem = if kind == HoldKind::Unknown {
        Problem::new(StatusCode::CONFLICT, slugs::OUTCOME_UNKNOWN, "Outcome unknown").with_detail(format!(
            "step {step:?} of this operation may have been applied by the other side, which cannot tell; the \
             operation is held and nothing is sent again. An operator gives a verdict: `idem ops mark {id} \
             --applied|--not-applied`"
        ))
    } else {
        Problem::new(StatusCode::CONFLICT, slugs::OPERATION_HELD, "Operation held").with_detail(format!(
            "the operation is held at step {step:?} ({}) until an operator acts: `idem ops show {id}`",
            kind.as_str()
        ))
    };
    problem.with_member("step", step).with_member("hold", kind.as_str())
}

fn error(base: &str, call: &Call, e: Error) -> Response<Body> {
    let problem = match e {
        Error::Mismatch => key_reused(call),
        Error::InvalidRequest(why) => Problem::new(
            StatusCode::CONFLICT,
            slugs::OPERATION_HELD,
            "Operation of another definition",
        )
        .with_detail(why),
        e => store_failed(
            "multi-step",
            &e,
            unavailable("the operation may not have finished; retry with the same Idempotency-Key"),
        ),
    };
    problem.into_response(base)
}
