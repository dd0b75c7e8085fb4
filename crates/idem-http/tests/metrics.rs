//! Metric label values come from bounded sets, whatever clients send.

use std::collections::HashSet;

use axum::Router;
use axum::body::Body;
use axum::http::{Method, Request, StatusCode};
use axum::routing::post;
use idem_core::{LeaseEngine, Tenant};
use idem_http::{IdempotencyLayer, Problem};
use idem_memory::MemoryStore;
use metrics_util::debugging::DebuggingRecorder;
use tower::{Layer, ServiceExt};

#[test]
fn client_chosen_methods_do_not_mint_labels() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    metrics::with_local_recorder(&recorder, || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let layer = || {
                IdempotencyLayer::lease(LeaseEngine::new(MemoryStore::new()), |_parts| {
                    Tenant::new("t").map_err(|_| Problem::new(StatusCode::UNAUTHORIZED, "unauthorized", "Unauthorized"))
                })
            };
            let routes = || Router::new().route("/v1/things", post(|| async { StatusCode::CREATED }));
            let routed = routes().route_layer(layer());
            let outside = layer().layer(routes());
            for i in 0..200 {
                let method = Method::from_bytes(format!("M{i}").as_bytes()).unwrap();
                for path in ["/v1/things".to_owned(), format!("/v1/things/{i}")] {
                    let req = || {
                        Request::builder()
                            .method(method.clone())
                            .uri(path.as_str())
                            .header("idempotency-key", format!("\"k{i}\""))
                            .body(Body::from("{}"))
                            .unwrap()
                    };
                    routed.clone().oneshot(req()).await.unwrap();
                    outside.clone().oneshot(req()).await.unwrap();
                }
            }
        });
    });
    let mut values: HashSet<(String, String)> = HashSet::new();
    for (key, _, _, _) in snapshotter.snapshot().into_vec() {
        for label in key.key().labels() {
            if matches!(label.key(), "operation" | "method" | "route") {
                values.insert((label.key().to_owned(), label.value().to_owned()));
            }
        }
    }
    assert!(!values.is_empty(), "no labels recorded");
    assert!(values.len() <= 10, "{} label values: {values:?}", values.len());
}
