//! How the layer is wired into an axum app: per router with `route_layer`
//! (operations named by route template), with `Router::layer`, or around the
//! whole app as a tower layer. No wiring switches protection off.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::routing::post;
use http_body_util::BodyExt;
use idem_core::{LeaseEngine, Tenant};
use idem_http::{IdempotencyLayer, Leased, Problem};
use idem_memory::MemoryStore;
use tower::{Layer, Service, ServiceExt};
use tracing::field::{Field, Visit};

fn layer() -> IdempotencyLayer<Leased<MemoryStore>> {
    IdempotencyLayer::lease(LeaseEngine::new(MemoryStore::new()), |_parts| {
        Tenant::new("t").map_err(|_| Problem::new(StatusCode::UNAUTHORIZED, "unauthorized", "Unauthorized"))
    })
}

fn routes(runs: Arc<AtomicUsize>) -> Router {
    Router::new().route(
        "/v1/things/{id}",
        post(move || {
            let runs = runs.clone();
            async move {
                runs.fetch_add(1, Ordering::SeqCst);
                (StatusCode::CREATED, "created")
            }
        }),
    )
}

async fn send<S>(app: &mut S, path: &str, key: Option<&str>) -> (StatusCode, String)
where
    S: Service<Request<Body>, Response = axum::response::Response, Error = std::convert::Infallible>,
{
    let mut b = Request::post(path).header("content-type", "application/json");
    if let Some(k) = key {
        b = b.header("idempotency-key", k);
    }
    let res = app
        .ready()
        .await
        .unwrap()
        .call(b.body(Body::from("{}")).unwrap())
        .await
        .unwrap();
    let status = res.status();
    let body = res.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8_lossy(&body).into_owned())
}

/// Error events seen by the test's subscriber.
#[derive(Default, Clone)]
struct Errors(Arc<Mutex<Vec<String>>>);

struct Message(String);
impl Visit for Message {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            self.0 = format!("{value:?}");
        }
    }
}

impl tracing::Subscriber for Errors {
    fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }
    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, event: &tracing::Event<'_>) {
        if *event.metadata().level() == tracing::Level::ERROR {
            let mut m = Message(String::new());
            event.record(&mut m);
            self.0.lock().unwrap().push(m.0);
        }
    }
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
}

/// Same key three times → one run; no key → 400; a bad key → 400.
async fn assert_protected<S>(app: &mut S, runs: &AtomicUsize)
where
    S: Service<Request<Body>, Response = axum::response::Response, Error = std::convert::Infallible>,
{
    for _ in 0..3 {
        let (status, body) = send(app, "/v1/things/1", Some("\"k-1\"")).await;
        assert_eq!(status, StatusCode::CREATED, "{body}");
    }
    assert_eq!(
        runs.load(Ordering::SeqCst),
        1,
        "the same key ran the handler more than once"
    );
    let (status, body) = send(app, "/v1/things/1", None).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert!(body.contains("idempotency-key-missing"), "{body}");
    let (status, body) = send(app, "/v1/things/1", Some("{}")).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn route_layer_names_operations_by_route_and_logs_nothing() {
    let errors = Errors::default();
    let _guard = tracing::subscriber::set_default(errors.clone());
    let runs = Arc::new(AtomicUsize::new(0));
    let mut app = routes(runs.clone()).route_layer(layer());
    assert_protected(&mut app, &runs).await;
    // An unknown path never reaches a route layer.
    assert_eq!(send(&mut app, "/nowhere", None).await.0, StatusCode::NOT_FOUND);
    assert!(errors.0.lock().unwrap().is_empty(), "{:?}", errors.0.lock().unwrap());
}

#[tokio::test]
async fn router_layer_protects_routes() {
    let runs = Arc::new(AtomicUsize::new(0));
    let mut app = routes(runs.clone()).layer(layer());
    assert_protected(&mut app, &runs).await;
}

#[tokio::test]
async fn a_layer_around_the_whole_app_fails_closed_and_says_so() {
    let errors = Errors::default();
    let _guard = tracing::subscriber::set_default(errors.clone());
    let runs = Arc::new(AtomicUsize::new(0));
    // Applied outside the router: no request has a matched route.
    let mut app = layer().layer(routes(runs.clone()));
    assert_protected(&mut app, &runs).await;
    // Scoped by the concrete path: the same key on another resource is a
    // different request, not a replay.
    let (status, body) = send(&mut app, "/v1/things/2", Some("\"k-1\"")).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{body}");
    let (status, _) = send(&mut app, "/v1/things/2", Some("\"k-2\"")).await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(runs.load(Ordering::SeqCst), 2);
    let errors = errors.0.lock().unwrap();
    assert_eq!(errors.len(), 1, "one error per layer, got {errors:?}");
    assert!(errors[0].contains("route_layer"), "{}", errors[0]);
}
