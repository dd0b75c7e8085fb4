//! The HTTP layer's own cost per request, stage by stage, on the in-memory
//! store: the same handler driven in-process with `oneshot`, bare and behind
//! `IdempotencyLayer` (transactional mode), fresh keys and replays, with a
//! 100 B and an 8 KiB JSON body; then each stage alone (body collection, the
//! fingerprint with its canonical JSON, record encode, replay decode).
//!
//! Run: `cargo bench -p idem-http --bench layer_cost` (`-- --quick` for a
//! short run, `-- --size 100` for one body size). It prints figures and ratios; it asserts nothing.

use std::hint::black_box;
use std::time::Instant;

use axum::Router;
use axum::body::Body;
use axum::http::{HeaderMap, HeaderValue, Request, StatusCode, header};
use axum::routing::post;
use bytes::Bytes;
use http_body_util::BodyExt;
use idem_core::{FingerprintBuilder, Operation, Tenant, TxEngine, canonical_json};
use idem_http::{IdempotencyLayer, Problem, RecordedResponse, Tx};
use idem_memory::MemoryStore;
use tower::ServiceExt;

/// A JSON object of about `size` bytes, shaped like an API request.
fn body_of(size: usize) -> Bytes {
    let mut items = Vec::new();
    let mut i = 0;
    loop {
        let item = serde_json::json!({
            "sku": format!("SKU-{i:06}"),
            "quantity": i % 7 + 1,
            "unit_price": "19.99",
            "note": "gift wrap, ribbon",
        });
        items.push(item);
        let doc = serde_json::json!({
            "account_id": 9007199254740993u64,
            "currency": "EUR",
            "items": items,
        });
        let text = serde_json::to_vec(&doc).unwrap();
        if text.len() >= size || size < 200 {
            return Bytes::from(text);
        }
        i += 1;
    }
}

fn tenant(_: &http::request::Parts) -> Result<Tenant, Problem> {
    Ok(Tenant::new("bench").unwrap())
}

async fn bare_handler(body: Bytes) -> (StatusCode, [(header::HeaderName, &'static str); 1], Bytes) {
    (
        StatusCode::CREATED,
        [(header::CONTENT_TYPE, "application/json")],
        body.slice(..body.len().min(100)),
    )
}

async fn tx_handler(_tx: Tx<MemoryStore>, body: Bytes) -> (StatusCode, [(header::HeaderName, &'static str); 1], Bytes) {
    bare_handler(body).await
}

fn request(body: &Bytes, key: Option<&str>) -> Request<Body> {
    let mut b = Request::post("/v1/orders?dry_run=false")
        .header(header::CONTENT_TYPE, "application/json")
        .header(header::CONTENT_LENGTH, body.len());
    if let Some(key) = key {
        b = b.header("idempotency-key", key);
    }
    b.body(Body::from(body.clone())).unwrap()
}

/// Per-iteration nanoseconds: the best of `rounds` rounds of `n` calls.
fn time<F: FnMut(u64)>(n: u64, rounds: u32, mut f: F) -> f64 {
    let mut best = f64::MAX;
    let mut i = 0;
    for _ in 0..rounds {
        let t = Instant::now();
        for _ in 0..n {
            f(i);
            i += 1;
        }
        best = best.min(t.elapsed().as_nanos() as f64 / n as f64);
    }
    best
}

fn us(ns: f64) -> String {
    format!("{:8.2} µs", ns / 1000.0)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    // `--size N` measures one body size only.
    let sizes: Vec<usize> = match args.iter().position(|a| a == "--size") {
        Some(i) => vec![
            args.get(i + 1)
                .and_then(|n| n.parse().ok())
                .expect("--size takes a number of bytes"),
        ],
        None => vec![100, 8192],
    };
    let (n, rounds) = if quick { (2_000, 3) } else { (10_000, 5) };
    let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
    println!("# the HTTP layer's own cost ({n} calls a round, best of {rounds}; one thread)");
    for size in sizes {
        let body = body_of(size);
        println!("\n## JSON body of {} bytes", body.len());

        let bare = Router::new().route("/v1/orders", post(bare_handler));
        let layer = IdempotencyLayer::transactional(TxEngine::new(MemoryStore::new()), tenant);
        let wrapped = Router::new().route("/v1/orders", post(tx_handler)).route_layer(layer);

        let call = |app: &Router, key: Option<String>| {
            let res = rt
                .block_on(app.clone().oneshot(request(&body, key.as_deref())))
                .unwrap();
            let bytes = rt.block_on(res.into_body().collect()).unwrap().to_bytes();
            black_box(bytes);
        };
        let t_bare = time(n, rounds, |_| call(&bare, None));
        let run = std::process::id();
        let t_fresh = time(n, rounds, |i| call(&wrapped, Some(format!("fresh-{run}-{size}-{i}"))));
        call(&wrapped, Some("replayed".into()));
        let t_replay = time(n, rounds, |_| call(&wrapped, Some("replayed".into())));
        println!("request, bare handler          {}", us(t_bare));
        println!(
            "request, layer, fresh key      {}   ({:.2}x bare, +{})",
            us(t_fresh),
            t_fresh / t_bare,
            us(t_fresh - t_bare)
        );
        println!(
            "request, layer, replay         {}   ({:.2}x bare, +{})",
            us(t_replay),
            t_replay / t_bare,
            us(t_replay - t_bare)
        );

        // The stages, each alone.
        let t_collect = time(n, rounds, |_| {
            let b = rt.block_on(Body::from(body.clone()).collect()).unwrap().to_bytes();
            black_box(b);
        });
        let op = Operation::new("POST /v1/orders").unwrap();
        let t_canonical = time(n, rounds, |_| {
            black_box(canonical_json(&body).unwrap());
        });
        let canonical = canonical_json(&body).unwrap();
        let t_sha = time(n, rounds, |_| {
            let f = FingerprintBuilder::new(&op)
                .field("path", "/v1/orders")
                .field("query", "dry_run=false")
                .bytes(&canonical)
                .finish();
            black_box(f);
        });
        let t_fingerprint = time(n, rounds, |_| {
            let f = FingerprintBuilder::new(&op)
                .field("path", "/v1/orders")
                .field("query", "dry_run=false")
                .json(&body)
                .unwrap()
                .finish();
            black_box(f);
        });
        let mut headers = HeaderMap::new();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
        headers.insert(header::CONTENT_LENGTH, HeaderValue::from(100));
        let recorded = RecordedResponse {
            status: StatusCode::CREATED,
            headers,
            body: body.slice(..body.len().min(100)),
            trailers: HeaderMap::new(),
        };
        let t_encode = time(n, rounds, |_| {
            black_box(recorded.encode());
        });
        let encoded = recorded.encode();
        let t_decode = time(n, rounds, |_| {
            black_box(RecordedResponse::decode(&encoded).unwrap().into_replay());
        });
        println!("stage: body collection        {}", us(t_collect));
        println!("stage: canonical JSON         {}", us(t_canonical));
        println!("stage: sha2 of the parts       {}", us(t_sha));
        println!("stage: fingerprint, whole     {}", us(t_fingerprint));
        println!("stage: record encode          {}", us(t_encode));
        println!("stage: replay decode          {}", us(t_decode));
    }
}
