//! The quote API's contract: no idempotency keys (every booking books),
//! lookups by reference, cancellation, bad input refused with nothing
//! booked, and the faults that lose answers and fail lookups.

use std::sync::Arc;
use std::time::Duration;

use serde_json::{Value, json};

async fn start() -> (String, Arc<fake_vendor::Vendor>) {
    fake_vendor::start(fake_vendor::Options::default(), None).await.unwrap()
}

fn client() -> reqwest::Client {
    idem_tls::test_pki::http_client()
}

/// POSTs `body` to `path`, with an `Idempotency-Key` header the vendor ignores.
async fn post(base: &str, path: &str, body: Value) -> reqwest::Result<reqwest::Response> {
    client()
        .post(format!("{base}{path}"))
        .timeout(Duration::from_secs(5))
        .header("idempotency-key", "the-same-key")
        .json(&body)
        .send()
        .await
}

/// Books the quote `body`: the vendor's answer.
async fn book(base: &str, body: Value) -> Value {
    let r = post(base, "/v1/quotes", body).await.unwrap();
    r.json().await.unwrap()
}

async fn get(base: &str, path: &str) -> reqwest::Response {
    client().get(format!("{base}{path}")).send().await.unwrap()
}

async fn faults(base: &str, f: Value) {
    let r = client().put(format!("{base}/_faults")).json(&f).send().await.unwrap();
    assert_eq!(r.status(), 204);
}

async fn quotes_of(base: &str, reference: &str) -> Vec<Value> {
    let r = get(base, &format!("/v1/quotes?reference={reference}")).await;
    assert_eq!(r.status(), 200);
    let list: Value = r.json().await.unwrap();
    list["data"].as_array().unwrap().clone()
}

fn quote(reference: &str, from: &str, to: &str, amount: i64) -> Value {
    json!({ "reference": reference, "from": from, "to": to, "amount": amount })
}

/// The same request twice, with the same key header, books two quotes: the vendor has no keys.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_request_books_a_new_quote() {
    let (base, vendor) = start().await;
    let a = book(&base, quote("w-1", "EUR", "USD", 100)).await;
    let b = post(&base, "/v1/quotes", quote("w-1", "EUR", "USD", 100))
        .await
        .unwrap();
    assert_eq!(b.status(), 201);
    assert!(b.headers().get("idempotent-replayed").is_none());
    let b: Value = b.json().await.unwrap();
    assert_ne!(a["id"], b["id"]);
    assert_eq!(
        (a["rate"].as_str(), a["amount_out"].as_i64()),
        (Some("1.0842"), Some(108))
    );
    assert_eq!(a["status"], "booked");
    assert_eq!(vendor.quotes_booked().await, 2);
    let ledger: Value = get(&base, "/v1/quotes/ledger").await.json().await.unwrap();
    assert_eq!(ledger, json!({ "quotes": 2, "cancelled": 0, "references": ["w-1"] }));
    assert_eq!(quotes_of(&base, "w-1").await.len(), 2);
    assert!(quotes_of(&base, "w-2").await.is_empty());
}

/// A lookup shows a booking still in progress as "processing", then the booked quote.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lookup_sees_a_booking_in_progress() {
    let (base, _) = start().await;
    faults(&base, json!({ "slow_ms": 600 })).await;
    let booking = tokio::spawn({
        let base = base.clone();
        async move { post(&base, "/v1/quotes", quote("w-slow", "GBP", "EUR", 1000)).await }
    });
    let mut seen = Vec::new();
    for _ in 0..100 {
        seen = quotes_of(&base, "w-slow").await;
        if !seen.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(seen, vec![json!({ "reference": "w-slow", "status": "processing" })]);
    assert_eq!(booking.await.unwrap().unwrap().status(), 201);
    let after = quotes_of(&base, "w-slow").await;
    assert_eq!(after.len(), 1);
    assert_eq!(
        (after[0]["status"].as_str(), after[0]["amount_out"].as_i64()),
        (Some("booked"), Some(1166))
    );
}

/// A lost answer still booked the quote, and only a lookup tells; a failing lookup answers 500.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_answers_and_failing_lookups() {
    let (base, vendor) = start().await;
    faults(&base, json!({ "apply_then_drop": 1.0 })).await;
    assert!(
        post(&base, "/v1/quotes", quote("w-lost", "USD", "EUR", 500))
            .await
            .is_err()
    );
    assert_eq!(vendor.quotes_booked().await, 1);
    faults(&base, json!({ "lookup_error_500": 1.0 })).await;
    assert_eq!(get(&base, "/v1/quotes?reference=w-lost").await.status(), 500);
    assert_eq!(get(&base, "/v1/payouts?reference=w-lost").await.status(), 500);
    let stats: Value = get(&base, "/_stats").await.json().await.unwrap();
    assert_eq!(
        (stats["lookup_errors"].as_u64(), stats["quotes_booked"].as_u64()),
        (Some(2), Some(1))
    );
    faults(&base, json!({})).await;
    let found = quotes_of(&base, "w-lost").await;
    assert_eq!((found.len(), found[0]["amount_out"].as_i64()), (1, Some(461)));
    let bad = client()
        .put(format!("{base}/_faults"))
        .json(&json!({ "lookup_error_500": 1.5 }))
        .send()
        .await
        .unwrap();
    assert_eq!(bad.status(), 400);
}

/// Bad input is refused with a clear error and books nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_books_nothing() {
    let (base, vendor) = start().await;
    let cases = [
        (
            json!({ "reference": "r", "from": "EUR", "to": "USD" }),
            400,
            "invalid_request",
        ),
        (
            json!({ "reference": "r", "from": "EUR", "to": "USD", "amount": 5, "x": 1 }),
            400,
            "invalid_request",
        ),
        (quote("r", "eur", "USD", 5), 400, "invalid_request"),
        (quote("r", "EUR", "USD", 0), 400, "invalid_request"),
        (quote("", "EUR", "USD", 5), 400, "invalid_request"),
        (quote("r", "EUR", "JPY", 5), 422, "unsupported_pair"),
        (quote("r", "USD", "GBP", 1), 422, "amount_too_small"),
    ];
    for (body, status, kind) in cases {
        let r = post(&base, "/v1/quotes", body.clone()).await.unwrap();
        assert_eq!(r.status(), status, "{body}");
        let answer: Value = r.json().await.unwrap();
        assert_eq!(answer["error"]["type"], kind, "{body}");
    }
    assert_eq!(vendor.quotes_booked().await, 0);
}

/// Cancelling a quote is idempotent; an unknown quote is 404.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_is_idempotent() {
    let (base, _) = start().await;
    let q = book(&base, quote("w-c", "EUR", "GBP", 700)).await;
    let path = format!("/v1/quotes/{}/cancel", q["id"].as_str().unwrap());
    for _ in 0..2 {
        let r = post(&base, &path, json!({})).await.unwrap();
        assert_eq!(r.status(), 200);
        let c: Value = r.json().await.unwrap();
        assert_eq!(
            (c["id"].clone(), c["status"].as_str()),
            (q["id"].clone(), Some("cancelled"))
        );
    }
    assert_eq!(
        post(&base, "/v1/quotes/qt_none/cancel", json!({}))
            .await
            .unwrap()
            .status(),
        404
    );
    let ledger: Value = get(&base, "/v1/quotes/ledger").await.json().await.unwrap();
    assert_eq!(ledger, json!({ "quotes": 1, "cancelled": 1, "references": ["w-c"] }));
    assert_eq!(quotes_of(&base, "w-c").await[0]["status"], "cancelled");
}
