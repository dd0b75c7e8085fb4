//! Response trailers reach the first caller and are recorded for replays, in
//! both modes.

use std::convert::Infallible;

use axum::Router;
use axum::body::Body;
use axum::http::{HeaderMap, HeaderValue, Request, StatusCode};
use axum::response::Response;
use axum::routing::post;
use bytes::Bytes;
use http_body::Frame;
use http_body_util::{BodyExt, StreamBody};
use idem_core::{LeaseEngine, Tenant, TxEngine};
use idem_http::{IdempotencyLayer, Problem};
use idem_memory::MemoryStore;
use tower::ServiceExt;

fn tenant(_: &http::request::Parts) -> Result<Tenant, Problem> {
    Ok(Tenant::new("t").expect("valid tenant"))
}

async fn with_trailers() -> Response {
    let mut trailers = HeaderMap::new();
    trailers.insert("x-checksum", HeaderValue::from_static("abc123"));
    let frames = futures_util::stream::iter([
        Ok::<_, Infallible>(Frame::data(Bytes::from_static(b"paid"))),
        Ok(Frame::trailers(trailers)),
    ]);
    Response::builder()
        .status(StatusCode::CREATED)
        .header("trailer", "x-checksum")
        .body(Body::new(StreamBody::new(frames)))
        .expect("response")
}

fn request() -> Request<Body> {
    Request::builder()
        .method("POST")
        .uri("/pay")
        .header("idempotency-key", "\"trailers-1\"")
        .body(Body::from("{}"))
        .expect("request")
}

async fn trailers_of(app: &Router) -> (bool, Bytes, Option<HeaderMap>) {
    let response = app.clone().oneshot(request()).await.expect("infallible");
    assert_eq!(response.status(), StatusCode::CREATED);
    let replayed = response.headers().contains_key("idempotent-replayed");
    let collected = response.into_body().collect().await.expect("body");
    let trailers = collected.trailers().cloned();
    (replayed, collected.to_bytes(), trailers)
}

async fn check(app: Router) {
    for expect_replay in [false, true] {
        let (replayed, body, trailers) = trailers_of(&app).await;
        assert_eq!(replayed, expect_replay);
        assert_eq!(&body[..], b"paid");
        let trailers = trailers.expect("the trailers are sent");
        assert_eq!(trailers.get("x-checksum").expect("x-checksum"), "abc123");
    }
}

#[tokio::test]
async fn transactional_mode_keeps_trailers() {
    let layer = IdempotencyLayer::transactional(TxEngine::new(MemoryStore::new()), tenant);
    check(Router::new().route("/pay", post(with_trailers)).route_layer(layer)).await;
}

#[tokio::test]
async fn lease_mode_keeps_trailers() {
    let layer = IdempotencyLayer::lease(LeaseEngine::new(MemoryStore::new()), tenant);
    check(Router::new().route("/pay", post(with_trailers)).route_layer(layer)).await;
}
