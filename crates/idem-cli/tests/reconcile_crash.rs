//! `idem gateway` processes with a reconcile request, one of them killed
//! (SIGKILL) while it asks the upstream about a held key: its reconcile lock
//! outlives it only until its lease ends. A second gateway on the same
//! store turns retries away as in flight meanwhile (the lock is real across
//! processes), then takes the lock over, asks, and replays the applied
//! answer; the upstream's payout was called once.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::http::StatusCode;
use axum::routing::{get, post};
use support::{gateway_config, start_gateway};

#[derive(Clone, Default)]
struct Counts {
    pays: Arc<AtomicUsize>,
    lookups: Arc<AtomicUsize>,
}

/// `POST /v1/pay` pays, then answers 500 the first time; `GET
/// /v1/pay/by-key/{key}` never answers its first asker, and says "paid"
/// (200) to the others.
async fn upstream() -> (String, Counts) {
    let counts = Counts::default();
    let (pays, lookups) = (counts.pays.clone(), counts.lookups.clone());
    let app = Router::new()
        .route(
            "/v1/pay",
            post(move || {
                let pays = pays.clone();
                async move {
                    if pays.fetch_add(1, Ordering::SeqCst) == 0 {
                        (StatusCode::INTERNAL_SERVER_ERROR, "paid, then failed")
                    } else {
                        (StatusCode::CREATED, "paid again")
                    }
                }
            }),
        )
        .route(
            "/v1/pay/by-key/{key}",
            get(move || {
                let lookups = lookups.clone();
                async move {
                    if lookups.fetch_add(1, Ordering::SeqCst) == 0 {
                        std::future::pending::<()>().await;
                    }
                    (StatusCode::OK, r#"{"status":"paid"}"#)
                }
            }),
        );
    (support::serve(app).await, counts)
}

const ROUTES: &str = r#"
[[routes]]
method = "POST"
path = "/v1/pay"
lease_ms = 2000
in_flight = "reject"
[routes.reconcile]
path = "/v1/pay/by-key/{key}"
applied_status = 201
timeout_ms = 60000
"#;

/// Status, whether replayed, and body; `None` when the connection failed.
async fn pay(base: &str, token: &str, key: &str) -> Option<(u16, bool, String)> {
    let a = support::post_keyed(base, "/v1/pay", token, key).await?;
    Some((a.status, a.replayed, a.body))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_gateway_killed_while_asking_holds_the_key_only_until_its_lock_lease_ends() {
    let (up, counts) = upstream().await;
    let (store, config) = (support::temp("reconcile", "gateway.db"), gateway_config(ROUTES));
    let (token, key) = (uuid::Uuid::now_v7().to_string(), uuid::Uuid::now_v7().to_string());

    let (mut first, base) = start_gateway(&up, &store, &config).await;
    // Another gateway on the store, up before the first one dies.
    let (_second, other) = start_gateway(&up, &store, &config).await;
    let (status, _, body) = pay(&base, &token, &key).await.expect("an answer");
    assert_eq!(status, 500, "{body}");
    // A retry asks, and the upstream never answers it; its gateway is killed.
    let asking = tokio::spawn({
        let (base, token, key) = (base.clone(), token.clone(), key.clone());
        async move { pay(&base, &token, &key).await }
    });
    for _ in 0..400 {
        if counts.lookups.load(Ordering::SeqCst) == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert_eq!(counts.lookups.load(Ordering::SeqCst), 1, "the retry asked");
    first.kill();
    assert!(
        asking.await.unwrap().is_none(),
        "the asking retry's connection died with its gateway"
    );

    // The other gateway: the dead one's lock still holds for a moment (409
    // in flight), then it is taken over, the upstream is asked again, and
    // its answer is recorded and replayed.
    let mut in_flight = 0;
    let answer = loop {
        let (status, replayed, body) = pay(&other, &token, &key).await.expect("an answer");
        if status == 409 && body.contains("idempotency-key-in-flight") {
            in_flight += 1;
            assert!(
                in_flight < 400,
                "the lock of a killed gateway must expire with its lease"
            );
            tokio::time::sleep(Duration::from_millis(25)).await;
            continue;
        }
        break (status, replayed, body);
    };
    assert!(in_flight > 0, "the dead gateway's lock was held until its lease ended");
    assert_eq!(answer, (201, true, r#"{"status":"paid"}"#.to_owned()));
    assert_eq!(counts.lookups.load(Ordering::SeqCst), 2);
    assert_eq!(counts.pays.load(Ordering::SeqCst), 1, "the payout was called once");
}
