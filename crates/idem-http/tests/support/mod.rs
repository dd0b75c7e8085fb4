//! What several test files share: one tenant for every request, keyed JSON
//! `POST`s, a `POST /pay` that counts its runs, a request sent with its
//! whole answer read, and counters of runs and commits.

#![allow(dead_code)]

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::Router;
use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::response::IntoResponse;
use axum::routing::post;
use bytes::Bytes;
use http_body_util::BodyExt;
use idem_core::{Tenant, TxBackend};
use idem_http::{Problem, Tx};
use idem_memory::MemoryTx;
use tower::ServiceExt;

/// Every request is tenant `t`.
pub(crate) fn tenant(_: &http::request::Parts) -> Result<Tenant, Problem> {
    Ok(Tenant::new("t").expect("valid tenant"))
}

/// `POST /pay` with `{}` and the key `key`.
pub(crate) fn post_with_key(key: &str) -> Request<Body> {
    post_to("/pay", key)
}

/// `POST path` with `{}` and the key `key`.
pub(crate) fn post_to(path: &str, key: &str) -> Request<Body> {
    Request::builder()
        .method("POST")
        .uri(path)
        .header("idempotency-key", format!("\"{key}\""))
        .header("content-type", "application/json")
        .body(Body::from("{}"))
        .expect("valid request")
}

/// Sends `req` and reads the whole answer: its status, whether it is marked
/// replayed, and its body.
pub(crate) async fn send(app: &Router, req: Request<Body>) -> (StatusCode, bool, Bytes) {
    let response = app.clone().oneshot(req).await.expect("infallible");
    let status = response.status();
    let replayed = response.headers().contains_key("idempotent-replayed");
    let body = response.into_body().collect().await.expect("body").to_bytes();
    (status, replayed, body)
}

/// A router whose `POST /pay` counts its runs in `runs` and answers with
/// `handler(run)`, where `run` counts from 0; the caller adds the layer.
pub(crate) fn counted_pay<F, Fut, R>(runs: &Arc<AtomicUsize>, handler: F) -> Router
where
    F: Fn(usize) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = R> + Send + 'static,
    R: IntoResponse + 'static,
{
    let runs = runs.clone();
    Router::new().route(
        "/pay",
        post(move || {
            let (runs, handler) = (runs.clone(), handler.clone());
            async move { handler(runs.fetch_add(1, Ordering::SeqCst)).await }
        }),
    )
}

/// A router whose `POST path` counts its runs in `runs` and answers with
/// `handler(run, body)`, where `run` counts from 1 and `body` is the request
/// body as text; the caller adds the layer.
pub(crate) fn counted_post<F, Fut, R>(path: &str, runs: &Arc<AtomicUsize>, handler: F) -> Router
where
    F: Fn(usize, String) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = R> + Send + 'static,
    R: IntoResponse + 'static,
{
    let runs = runs.clone();
    Router::new().route(
        path,
        post(move |body: String| {
            let (runs, handler) = (runs.clone(), handler.clone());
            async move { handler(runs.fetch_add(1, Ordering::SeqCst) + 1, body).await }
        }),
    )
}

/// A body that yields `first`, then fails with `error`.
pub(crate) fn failing_body(first: &'static [u8], error: &'static str) -> Body {
    Body::from_stream(futures_util::stream::iter([
        Ok(Bytes::from_static(first)),
        Err(std::io::Error::other(error)),
    ]))
}

/// Counts handler runs and committed effects (transactional mode only).
#[derive(Clone, Default)]
pub(crate) struct Counters {
    pub(crate) runs: Arc<AtomicUsize>,
    pub(crate) committed: Arc<AtomicUsize>,
}

impl Counters {
    /// Counts a run, and the effect of `tx` once it commits: the run's
    /// number, from 1.
    pub(crate) fn run_in<B: TxBackend<Tx = MemoryTx> + Clone>(&self, tx: &mut Tx<B>) -> usize {
        let run = self.runs.fetch_add(1, Ordering::SeqCst) + 1;
        let committed = self.committed.clone();
        tx.on_commit(move || {
            committed.fetch_add(1, Ordering::SeqCst);
        });
        run
    }

    /// The handler's runs so far.
    pub(crate) fn run_count(&self) -> usize {
        self.runs.load(Ordering::SeqCst)
    }

    /// The effects committed so far.
    pub(crate) fn commit_count(&self) -> usize {
        self.committed.load(Ordering::SeqCst)
    }
}
