//! Lease mode, for handlers whose effects are outside the database: the
//! claim is a lease kept alive by a heartbeat; the key is marked sent before
//! the handler runs; the outcome is recorded (tried again if the store
//! refuses it) by work that outlives a caller who goes away (run in the
//! caller's task while it stays); and a key held as an unknown outcome is
//! handed to the [`Reconcile`](crate::Reconcile) hook under a reconcile lock.

use std::sync::Arc;

use axum_core::body::Body;
use bytes::Bytes;
use http::{HeaderValue, Request, Response, StatusCode, header, request::Parts};
use idem_core::{Acquire, Call, Error, LeaseStore, Record, Scope};

use crate::body::{Chunk, Collected, collect_response};
use crate::layer::{Config, Leased};
use crate::problem::{Problem, slugs};
use crate::recorded::RecordedResponse;
use crate::service::{ByteBody, InnerService};
use crate::service::{
    Decision, Mode, Point, decide, error_response, first, hit, passthrough, replay, skips_sent_mark, store_unavailable,
    whole_record,
};
use crate::stream::{small_and_whole, stream_and_record};

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

/// What the lease-mode work needs of the layer's configuration.
#[derive(Clone)]
pub(crate) struct Recording {
    pub(crate) max_response_bytes: usize,
    pub(crate) problem_base: Arc<str>,
    pub(crate) private_headers: Arc<[http::HeaderName]>,
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
        S: InnerService<ResBody>,
        ResBody: ByteBody,
    {
        let lease = match self.claim(cfg, &parts, &call).await {
            Ok(lease) => lease,
            Err(answer) => return Ok(answer),
        };
        hit(Point::AfterClaim);
        // From here on the handler may take effect, so everything up to the
        // recorded outcome must end even if this request future is dropped
        // (the client went away, an outer timeout): it runs here, in the
        // caller's task, through `Detached::finish`, which moves the rest of
        // it into a task of its own only if the caller goes away first. The
        // heartbeat keeps the lease alive until the outcome is settled; it
        // beats beside the work, in the same future.
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
        // The work hands the response over as soon as it can be sent (after
        // the record, or at once when it streams) and goes on to its end.
        let (answer, mut answered) = tokio::sync::oneshot::channel();
        // Counted in the engine's detached work: a graceful shutdown waits
        // for it, so a caller gone before the answer still gets it recorded.
        let work = async move {
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
                            .with_detail("another request with this Idempotency-Key holds it now; retry later")
                            .with_retry_after_secs(1),
                        e => {
                            tracing::warn!(error = %e, "could not mark the request sent; nothing was sent");
                            store_unavailable().with_retry_after_secs(1)
                        }
                    };
                    let settled = engine.release_unsent(&lease).await;
                    return (
                        settled,
                        Some((answer, Ok(unsent.into_response(&recording.problem_base)))),
                        None,
                    );
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
        };
        let mut work = self.engine.detached().finish(work);
        // The answer is taken as soon as it is sent; work still to do then
        // (a streamed body being recorded) moves into a task of its own when
        // `work` is dropped here.
        let answer = tokio::select! {
            biased;
            answer = &mut answered => answer,
            () = &mut work => answered.await,
        };
        match answer {
            Ok(response) => response,
            // The work ended without an answer: only a runtime shutting down
            // drops it so (a panic would have gone on unwinding here).
            Err(_) => {
                tracing::error!("the lease-mode work ended without an answer");
                Ok(Problem::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    slugs::STORE_UNAVAILABLE,
                    "Request interrupted",
                )
                .with_detail("the service is shutting down; retry with the same Idempotency-Key")
                .with_retry_after_secs(1)
                .into_response(&cfg.problem_base))
            }
        }
    }

    async fn unkeyed<S, ResBody>(&self, _cfg: &Config, inner: S, req: Request<Body>) -> Result<Response<Body>, S::Error>
    where
        S: InnerService<ResBody>,
        ResBody: ByteBody,
    {
        passthrough(inner, req).await
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
    ResBody: ByteBody,
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

/// Why a response that took effect could not be recorded as it was.
pub(crate) enum StandIn {
    TooLarge,
    Failed(String),
}

/// The problem recorded (and, for a failed body, answered) in place of a
/// response that took effect but could not be recorded.
pub(crate) fn stand_in(recording: &Recording, original: StatusCode, why: StandIn) -> (Record, Response<Body>) {
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
