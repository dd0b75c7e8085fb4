//! Path spellings at the door, sent as raw bytes (an HTTP client would
//! tidy them first): no spelling reaches a route without its policy, and one
//! key on two spellings reaches the upstream at most once.

mod support;

use support::{BEARER, fresh, gateway_on_sqlite, json, raw};

/// Keys optional by default, required on `POST /v1/payments`.
fn routes() -> String {
    format!(
        "{BEARER}[defaults]\nkey = \"optional\"\n[[routes]]\nmethod = \"POST\"\npath = \"/v1/payments\"\nkey = \"required\"\n"
    )
}

/// Sends `POST target` as raw bytes, with a bearer token and an optional key.
async fn post(addr: std::net::SocketAddr, target: &str, key: Option<&str>) -> (u16, String) {
    let key = key.map_or_else(String::new, |k| format!("Idempotency-Key: \"{k}\"\r\n"));
    let request = format!(
        "POST {target} HTTP/1.1\r\nHost: gateway\r\nAuthorization: Bearer t\r\n{key}Content-Type: application/json\r\n\
         Content-Length: 2\r\nConnection: close\r\n\r\n{{}}"
    );
    let answer = raw(addr, request.as_bytes()).await;
    let status = answer
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no answer to {target}: {answer:?}"));
    let body = answer.split("\r\n\r\n").nth(1).unwrap_or("").to_owned();
    (status, body)
}

/// No spelling of `/v1/payments` reaches the upstream without a key: each is refused as not canonical or as missing its key.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn no_spelling_bypasses_a_required_route() {
    let (g, state) = gateway_on_sqlite(&routes()).await;
    for target in [
        "/v1/x/../payments",
        "/v1/x/%2e%2e/payments",
        "/v1/x/%2E%2E/payments",
        "/v1/x/.%2e/payments",
        "/v1/./payments",
        "/v1/x/..;/payments",
        "/v1/x\\..\\payments",
        "/v1/x%5c..%5cpayments",
        "/v1/x%2f..%2fpayments",
        "/v1//payments",
        "//v1/payments",
        "/v1/payments",
        "/v1/payments/",
        "/V1/Payments",
        "/v1/payments;jsessionid=1",
        "/v1/p%61yments",
        "/%76%31/payments",
        "http://elsewhere.example/v1/payments",
    ] {
        let (status, body) = post(g.addr, target, None).await;
        assert_eq!(status, 400, "{target}: {body}");
        assert!(
            body.contains("path-not-canonical") || body.contains("idempotency-key-missing"),
            "{target}: {body}"
        );
    }
    assert_eq!(
        state.calls(),
        0,
        "no spelling reached the upstream: {:?}",
        state.paths()
    );
}

/// One key on spellings of one path reaches the upstream once: an equivalent spelling replays, a lenient one is refused as reused.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_key_on_two_spellings_calls_the_upstream_once() {
    let (g, state) = gateway_on_sqlite(&routes()).await;
    let key = fresh();
    let (status, first) = post(g.addr, "/v1/payments", Some(&key)).await;
    assert_eq!(status, 201, "{first}");
    for (target, expected) in [
        ("/v1/p%61yments", 201),
        ("/%76%31/payments", 201),
        ("http://elsewhere.example/v1/payments", 201),
        ("/V1/PAYMENTS", 422),
        ("/v1/payments/", 422),
        ("/v1/payments;x=1", 422),
        ("/v1/x/../payments", 400),
        ("/v1/x/%2e%2e/payments", 400),
    ] {
        let (status, body) = post(g.addr, target, Some(&key)).await;
        assert_eq!(status, expected, "{target}: {body}");
        if status == 201 {
            assert_eq!(body, first, "{target} replays the first answer");
        }
    }
    // The same on a path no route names.
    let other = fresh();
    assert_eq!(post(g.addr, "/v1/other", Some(&other)).await.0, 201);
    assert_eq!(post(g.addr, "/v1/%6Fther", Some(&other)).await.0, 201);
    assert_eq!(post(g.addr, "/v1/OTHER", Some(&other)).await.0, 422);
    assert_eq!(state.calls(), 2, "{:?}", state.paths());
    assert_eq!(
        state.paths(),
        ["/v1/payments", "/v1/other"],
        "the upstream got the canonical paths"
    );
    assert_eq!(json(&first)["target"], "/v1/payments");
}

/// Sixteen concurrent requests with one key on four spellings of one path reach the upstream once: every answer is the first one, or refused as reused or in flight.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_spellings_reach_the_upstream_once() {
    let (g, state) = gateway_on_sqlite(&routes()).await;
    let key = fresh();
    let spellings = ["/v1/payments", "/v1/p%61yments", "/V1/payments", "/v1/payments/"];
    let tasks: Vec<_> = (0..16)
        .map(|i| {
            let (addr, key) = (g.addr, key.clone());
            tokio::spawn(async move { post(addr, spellings[i % 4], Some(&key)).await })
        })
        .collect();
    let mut created = Vec::new();
    for task in tasks {
        let (status, body) = task.await.unwrap();
        match status {
            201 => created.push(body),
            409 | 422 => {}
            other => panic!("{other}: {body}"),
        }
    }
    assert!(!created.is_empty());
    assert!(created.iter().all(|b| b == &created[0]), "one answer for every success");
    assert_eq!(state.calls(), 1, "{:?}", state.paths());
}
