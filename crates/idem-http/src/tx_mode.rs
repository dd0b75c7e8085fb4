//! Transactional mode: the claim opens a database transaction that the
//! handler writes through ([`Tx`](crate::Tx)), so its writes, the claim and
//! the recorded response commit together, or nothing does. A run that loses
//! a race with concurrent transactions is rolled back and run again.

use axum_core::body::Body;
use bytes::Bytes;
use http::{Request, Response, StatusCode, request::Parts};
use idem_core::metrics::Stage;
use idem_core::{Begin, Call, ContentionRetries, Ticket, TxBackend};

use crate::body::{Collected, collect_response};
use crate::layer::{Config, Transactional};
use crate::problem::{Problem, slugs};
use crate::retry::RetryTransaction;
use crate::service::{ByteBody, InnerService};
use crate::service::{Decision, Mode, Point, applies, decide, error_response, first, hit, replay, whole_record};
use crate::tx::{Taken, TxCell};

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
        S: InnerService<ResBody>,
        ResBody: ByteBody,
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
        S: InnerService<ResBody>,
        ResBody: ByteBody,
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
        S: InnerService<ResBody>,
        ResBody: ByteBody,
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
        let recordable = match collected {
            Collected::Full(body, trailers) => Ok((body, trailers)),
            Collected::TooLarge(_) => Err(Problem::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                slugs::RESPONSE_TOO_LARGE,
                "Response too large to record",
            )
            .with_detail(format!(
                "the {} response exceeded the record limit of {} bytes; nothing was applied",
                rparts.status.as_u16(),
                cfg.max_response_bytes
            ))),
            Collected::Failed(why) => {
                tracing::warn!(%why, "the response body failed before it could be recorded");
                Err(Problem::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    slugs::RESPONSE_FAILED,
                    "Response failed",
                )
                .with_detail(format!(
                    "the {} response's body failed while it was read: {why}; nothing was applied",
                    rparts.status.as_u16()
                )))
            }
        };
        // A response that cannot be recorded is not applied either.
        let (body, trailers) = match recordable {
            Ok(whole) => whole,
            Err(problem) => {
                self.engine.abandon(claimed).await;
                return done(problem.into_response(&cfg.problem_base));
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
