//! The fake vendor's contract: deduplication by key, its ledger, and each
//! fault doing what it says.

use std::sync::Arc;
use std::time::{Duration, Instant};

async fn start() -> (String, Arc<fake_vendor::Vendor>) {
    start_with(fake_vendor::Options::default()).await
}

async fn start_with(options: fake_vendor::Options) -> (String, Arc<fake_vendor::Vendor>) {
    fake_vendor::start(options, None).await.unwrap()
}

async fn pay(base: &str, key: Option<&str>, body: &str) -> reqwest::Result<reqwest::Response> {
    let mut r = idem_tls::test_pki::http_client()
        .post(format!("{base}/v1/payouts"))
        .timeout(Duration::from_secs(5))
        .header("content-type", "application/json")
        .body(body.to_owned());
    if let Some(k) = key {
        r = r.header("idempotency-key", k);
    }
    r.send().await
}

/// PUTs `body` as JSON to `path` on the vendor.
async fn put(base: &str, path: &str, body: serde_json::Value) -> reqwest::Response {
    idem_tls::test_pki::http_client()
        .put(format!("{base}{path}"))
        .json(&body)
        .send()
        .await
        .unwrap()
}

async fn get_json(url: String) -> serde_json::Value {
    idem_tls::test_pki::get(url).await.unwrap().json().await.unwrap()
}

async fn faults(base: &str, f: serde_json::Value) {
    assert_eq!(put(base, "/_faults", f).await.status(), 204);
}

async fn ledger(base: &str) -> serde_json::Value {
    get_json(format!("{base}/v1/ledger")).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_key_pays_once() {
    let (base, _) = start().await;
    let first = pay(&base, Some("k1"), r#"{"amount":100}"#).await.unwrap();
    assert_eq!(first.status(), 201);
    let first: serde_json::Value = first.json().await.unwrap();
    let again = pay(&base, Some("k1"), r#"{"amount":100}"#).await.unwrap();
    assert_eq!(again.status(), 201);
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(again.json::<serde_json::Value>().await.unwrap(), first);
    assert_eq!(pay(&base, Some("k1"), r#"{"amount":101}"#).await.unwrap().status(), 422);
    assert_eq!(pay(&base, None, r#"{"amount":1}"#).await.unwrap().status(), 400);
    assert_eq!(pay(&base, Some("k2"), r#"{"amount":-1}"#).await.unwrap().status(), 400);
    let l = ledger(&base).await;
    assert_eq!((l["payouts"].as_u64(), l["total"].as_u64()), (Some(1), Some(100)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn faults_do_what_they_say() {
    let (base, vendor) = start().await;
    // 500 and 429 (with Retry-After) before paying.
    faults(&base, serde_json::json!({ "error_500": 1.0 })).await;
    assert_eq!(pay(&base, Some("a"), r#"{"amount":1}"#).await.unwrap().status(), 500);
    faults(
        &base,
        serde_json::json!({ "rate_limit_429": 1.0, "retry_after_secs": 7 }),
    )
    .await;
    let r = pay(&base, Some("a"), r#"{"amount":1}"#).await.unwrap();
    assert_eq!(
        (r.status().as_u16(), r.headers()["retry-after"].to_str().unwrap()),
        (429, "7")
    );
    assert_eq!(ledger(&base).await["payouts"], 0, "nothing paid");
    // Paid, then the connection dropped: the retry with the key gets the record.
    faults(&base, serde_json::json!({ "apply_then_drop": 1.0 })).await;
    assert!(pay(&base, Some("b"), r#"{"amount":5}"#).await.is_err(), "no answer");
    faults(&base, serde_json::json!({})).await;
    let r = pay(&base, Some("b"), r#"{"amount":5}"#).await.unwrap();
    assert_eq!(r.headers()["idempotent-replayed"], "true");
    assert_eq!(ledger(&base).await["payouts"], 1);
    // Slow answers.
    faults(&base, serde_json::json!({ "slow_ms": 300 })).await;
    let t = Instant::now();
    pay(&base, Some("c"), r#"{"amount":1}"#).await.unwrap();
    assert!(t.elapsed() >= Duration::from_millis(300));
    // Refused connections, then accepted again.
    faults(&base, serde_json::json!({ "refuse_ms": 600 })).await;
    tokio::time::sleep(Duration::from_millis(150)).await;
    let refused = pay(&base, Some("d"), r#"{"amount":1}"#).await;
    assert!(refused.as_ref().is_err_and(|e| e.is_connect()), "{refused:?}");
    tokio::time::sleep(Duration::from_millis(900)).await;
    assert_eq!(pay(&base, Some("d"), r#"{"amount":1}"#).await.unwrap().status(), 201);
    assert!(vendor.refuse_until_ms.load(std::sync::atomic::Ordering::SeqCst) > 0);
    let bad = put(&base, "/_faults", serde_json::json!({ "error_500": 2.0 })).await;
    assert_eq!(bad.status(), 400);
}

async fn lookup(base: &str, reference: &str) -> serde_json::Value {
    get_json(format!("{base}/v1/payouts?reference={reference}")).await
}

/// A key older than the vendor's horizon is forgotten: the same request pays again, and the lookup by reference shows both payments.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_its_horizon_a_key_pays_again() {
    let (base, vendor) = start_with(fake_vendor::Options {
        key_horizon: Duration::from_secs(3600),
        ..Default::default()
    })
    .await;
    let body = r#"{"amount":7,"reference":"p-1"}"#;
    assert_eq!(pay(&base, Some("k"), body).await.unwrap().status(), 201);
    vendor.advance(Duration::from_secs(3599));
    let within = pay(&base, Some("k"), body).await.unwrap();
    assert_eq!(within.headers()["idempotent-replayed"], "true");
    // Moved over HTTP too.
    let r = put(&base, "/_clock", serde_json::json!({ "advance_ms": 1000 })).await;
    assert_eq!(r.status(), 204);
    let past = pay(&base, Some("k"), body).await.unwrap();
    assert_eq!(past.status(), 201);
    assert!(
        past.headers().get("idempotent-replayed").is_none(),
        "forgotten: paid again"
    );
    let l = ledger(&base).await;
    assert_eq!(
        (l["payouts"].as_u64(), l["keys"].as_array().unwrap().len()),
        (Some(2), 1)
    );
    assert_eq!(l["references"], serde_json::json!(["p-1"]));
    let found = lookup(&base, "p-1").await;
    assert_eq!(found["data"].as_array().unwrap().len(), 2);
    assert!(
        found["data"]
            .as_array()
            .unwrap()
            .iter()
            .all(|p| p["status"] == "paid" && p["amount"] == 7)
    );
    assert_eq!(lookup(&base, "nope").await["data"], serde_json::json!([]));
}

/// Without idempotency the key is ignored (none is needed) and every request pays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_idempotency_every_request_pays() {
    let (base, _) = start_with(fake_vendor::Options {
        idempotency: false,
        ..Default::default()
    })
    .await;
    let body = r#"{"amount":3,"reference":"p-2"}"#;
    assert_eq!(pay(&base, Some("k"), body).await.unwrap().status(), 201);
    assert_eq!(pay(&base, Some("k"), body).await.unwrap().status(), 201);
    assert_eq!(pay(&base, None, body).await.unwrap().status(), 201);
    assert_eq!(ledger(&base).await["payouts"], 3);
    assert_eq!(lookup(&base, "p-2").await["data"].as_array().unwrap().len(), 3);
}

/// A second request with a key still being processed gets 409 idempotency_key_in_use without Retry-After, and the lookup says "processing" meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_in_flight_is_409_and_its_reference_processing() {
    let (base, _) = start().await;
    faults(&base, serde_json::json!({ "slow_ms": 800 })).await;
    let body = r#"{"amount":4,"reference":"p-3"}"#;
    let first = {
        let base = base.clone();
        tokio::spawn(async move { pay(&base, Some("k"), body).await.unwrap().status() })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    let second = pay(&base, Some("k"), body).await.unwrap();
    assert_eq!(second.status(), 409);
    assert!(second.headers().get("retry-after").is_none());
    let text = second.text().await.unwrap();
    assert!(text.contains("idempotency_key_in_use"), "{text}");
    let seen = lookup(&base, "p-3").await;
    assert_eq!(seen["data"][0]["status"], "processing", "{seen}");
    assert_eq!(first.await.unwrap(), 201);
    assert_eq!(lookup(&base, "p-3").await["data"][0]["status"], "paid");
}

/// A closed destination is declined with 402, recorded under its key (its retry gets the same 402), and nothing is paid.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_destination_is_declined_once_and_for_all() {
    let (base, _) = start().await;
    let body = r#"{"amount":9,"reference":"p-4","destination":"closed-acct-1"}"#;
    let first = pay(&base, Some("k"), body).await.unwrap();
    assert_eq!(first.status(), 402);
    let first: serde_json::Value = first.json().await.unwrap();
    assert_eq!(first["error"]["type"], "destination_closed");
    let again = pay(&base, Some("k"), body).await.unwrap();
    assert_eq!(again.status(), 402);
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(again.json::<serde_json::Value>().await.unwrap(), first);
    assert_eq!(ledger(&base).await["payouts"], 0, "nothing paid");
    assert_eq!(lookup(&base, "p-4").await["data"], serde_json::json!([]));
    let stats = get_json(format!("{base}/_stats")).await;
    assert_eq!(stats["declined"], 1);
    // An open destination pays, and its answer names it.
    let open = r#"{"amount":9,"reference":"p-5","destination":"acct-2"}"#;
    let paid = pay(&base, Some("k2"), open).await.unwrap();
    assert_eq!(paid.status(), 201);
    assert_eq!(paid.json::<serde_json::Value>().await.unwrap()["destination"], "acct-2");
    assert_eq!(ledger(&base).await["payouts"], 1);
}
