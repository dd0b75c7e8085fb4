//! The gateway over real sockets, in front of a non-idempotent upstream
//! that counts its calls: the contract, which answers are recorded (3xx
//! too, 5xx never), which headers cross it, twins through two gateway
//! instances sharing PostgreSQL and sharing Redis, and an upstream slower
//! than the lease.

mod support;

use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::http::HeaderMap;
use support::{
    BEARER, fresh, gateway_on_sqlite, one_answer, postgres_url, redis_url, send, send_with, sqlite_store,
    start_gateway, start_upstream,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_contract_in_front_of_any_api() {
    let (g, state) = gateway_on_sqlite(&format!(
        "{BEARER}[[routes]]\nmethod = \"POST\"\npath = \"/v1/payments\""
    ))
    .await;
    let (t, k) = (fresh(), fresh());
    // No key: refused before the upstream sees anything.
    let (status, headers, body) = send(&g.base, "/v1/payments", &t, None, r#"{"amount":5}"#).await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(headers["content-type"], "application/problem+json");
    assert_eq!(state.calls(), 0);
    // The first call reaches the upstream, without the hop-by-hop headers.
    let (status, headers, first) = send(&g.base, "/v1/payments", &t, Some(&k), r#"{"amount":5}"#).await;
    assert_eq!(status, 201, "{first}");
    assert!(first.contains(r#""hop_seen":false"#), "{first}");
    assert!(!headers.contains_key("x-hop"));
    assert!(!headers.contains_key("idempotent-replayed"));
    // Retries replay it, byte for byte, with the upstream's headers.
    for _ in 0..3 {
        let (status, headers, again) = send(&g.base, "/v1/payments", &t, Some(&k), r#"{ "amount": 5 }"#).await;
        assert_eq!(status, 201);
        assert_eq!(again, first);
        assert_eq!(headers["idempotent-replayed"], "true");
        assert_eq!(headers["x-upstream-call"], "1");
    }
    assert_eq!(state.calls(), 1);
    // The same key with another body, or on another path: 422.
    let (status, _, _) = send(&g.base, "/v1/payments", &t, Some(&k), r#"{"amount":6}"#).await;
    assert_eq!(status, 422);
    let (status, _, _) = send(&g.base, "/v1/payments?x=1", &t, Some(&k), r#"{"amount":5}"#).await;
    assert_eq!(status, 422);
    // Another caller's key space: the same key is a new request.
    let (status, headers, _) = send(&g.base, "/v1/payments", &fresh(), Some(&k), r#"{"amount":5}"#).await;
    assert_eq!(status, 201);
    assert!(!headers.contains_key("idempotent-replayed"));
    assert_eq!(state.calls(), 2);
}

/// Under `on_unknown_outcome = "release"` a 5xx releases the key: the
/// retry reaches the upstream (under the default, `hold`, it would be held
/// as an unknown outcome: see `idem-cli`'s `unknown_outcome` tests).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_5xx_is_never_recorded() {
    let (g, state) = gateway_on_sqlite(&format!("{BEARER}[defaults]\non_unknown_outcome = \"release\"\n")).await;
    let (t, k) = (fresh(), fresh());
    let (status, _, _) = send(&g.base, "/v1/flaky", &t, Some(&k), "{}").await;
    assert_eq!(status, 503);
    let (status, headers, body) = send(&g.base, "/v1/flaky", &t, Some(&k), "{}").await;
    assert_eq!(
        (status, body.as_str()),
        (201, "attempt 2"),
        "the retry reached the upstream"
    );
    assert!(!headers.contains_key("idempotent-replayed"));
    let (status, headers, body) = send(&g.base, "/v1/flaky", &t, Some(&k), "{}").await;
    assert_eq!((status, body.as_str()), (201, "attempt 2"));
    assert_eq!(headers["idempotent-replayed"], "true");
    assert_eq!(state.flaky.load(Ordering::SeqCst), 2);
}

/// Under the default `hold`, a request with an empty body that the upstream
/// answered 500 is held like any other: its retry is a 409 and the upstream
/// is called once. An upstream that cannot be connected to never got the
/// request: its key stays free (502, then 502 again, never 409).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_empty_body_is_held_after_a_500_and_a_refused_connection_is_not() {
    let (g, state) = gateway_on_sqlite(BEARER).await;
    let (t, k) = (fresh(), fresh());
    let auth = format!("Bearer {t}");
    let bearer = [("authorization", auth.as_str())];
    let delete = || send_with(&g.base, "DELETE", "/v1/orders/1?status=500", &bearer, Some(&k), "");
    let (status, _, _) = delete().await;
    assert_eq!(status, 500);
    let (status, headers, body) = delete().await;
    assert_eq!(status, 409, "{body}");
    assert_eq!(headers["content-type"], "application/problem+json");
    assert!(body.contains("idempotency-outcome-unknown"), "{body}");
    assert_eq!(state.calls(), 1, "the upstream was called once");
    let down = start_gateway("http://127.0.0.1:9", &sqlite_store(), BEARER).await;
    for _ in 0..2 {
        let (status, _, body) = send(&down.base, "/v1/payments", &t, Some(&k), "{}").await;
        assert_eq!(status, 502, "{body}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_unreachable_upstream_is_a_502_problem() {
    let g = start_gateway("http://127.0.0.1:9", &sqlite_store(), BEARER).await;
    let (status, headers, _) = send(&g.base, "/v1/payments", &fresh(), Some(&fresh()), "{}").await;
    assert_eq!(status, 502);
    assert_eq!(headers["content-type"], "application/problem+json");
}

/// Twins split across two gateway instances on one shared store: the
/// upstream sees one call, every caller gets its answer.
async fn twins_through_two_instances(store: &str) {
    let (upstream, state) = start_upstream().await;
    let a = start_gateway(&upstream, store, BEARER).await;
    let b = start_gateway(&upstream, store, BEARER).await;
    let (t, k) = (fresh(), fresh());
    let tasks: Vec<_> = (0..16)
        .map(|i| {
            let base = if i % 2 == 0 { a.base.clone() } else { b.base.clone() };
            let (t, k) = (t.clone(), k.clone());
            tokio::spawn(async move { send(&base, "/v1/payments", &t, Some(&k), r#"{"amount":7}"#).await })
        })
        .collect();
    one_answer(tasks, 201).await;
    assert_eq!(state.calls(), 1, "the upstream saw one call");
}

idem_conformance::cases!(twins_through_two_instances, 4 => {
    twins_through_two_instances_sharing_postgres(&postgres_url());
    twins_through_two_instances_sharing_redis(&redis_url());
});

/// The upstream takes 2.5 s; the lease is 1 s. The heartbeat keeps the
/// lease, so twins arriving during the call wait and replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_upstream_slower_than_the_lease_is_called_once() {
    let (g, state) = gateway_on_sqlite(&format!("{BEARER}[defaults]\nlease_ms = 1000\nwait_ms = 10000")).await;
    let (t, k) = (fresh(), fresh());
    let mut tasks = Vec::new();
    for delay in [0u64, 1_200, 2_000] {
        let (base, t, k) = (g.base.clone(), t.clone(), k.clone());
        tasks.push(tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(delay)).await;
            send(&base, "/v1/slow", &t, Some(&k), "{}").await
        }));
    }
    for task in tasks {
        let (status, _, body) = task.await.unwrap();
        assert_eq!((status, body.as_str()), (201, "slow and done"));
    }
    assert_eq!(state.calls(), 1);
}

/// The upstream's answer streams through the gateway: the first caller reads
/// the status and the first chunk while the upstream has not finished, and
/// the whole answer is recorded on the way.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_answer_streams_to_the_first_caller_while_it_is_recorded() {
    let (g, state) = gateway_on_sqlite(BEARER).await;
    let (t, k) = (fresh(), fresh());
    let mut first = tokio::time::timeout(
        Duration::from_secs(10),
        idem_tls::test_pki::http_client()
            .post(format!("{}/v1/stream", g.base))
            .bearer_auth(&t)
            .header("idempotency-key", format!("\"{k}\""))
            .header("content-type", "application/json")
            .body("{}")
            .send(),
    )
    .await
    .expect("the head arrives while the upstream is still answering")
    .unwrap();
    assert_eq!(first.status(), 201);
    let chunk = tokio::time::timeout(Duration::from_secs(10), first.chunk())
        .await
        .expect("the first chunk arrives while the upstream is still answering")
        .unwrap();
    assert_eq!(chunk.as_deref(), Some(&b"first "[..]));
    state.gate.add_permits(1);
    let mut rest = Vec::new();
    while let Some(c) = first.chunk().await.unwrap() {
        rest.extend_from_slice(&c);
    }
    assert_eq!(rest, b"last");
    let (status, headers, body) = send(&g.base, "/v1/stream", &t, Some(&k), "{}").await;
    assert_eq!((status, body.as_str()), (201, "first last"));
    assert_eq!(
        headers.get("idempotent-replayed").map(|v| v.as_bytes()),
        Some(&b"true"[..])
    );
    assert_eq!(state.calls(), 1);
}

/// Sends a keyed `POST path` twice through a new gateway: both answers are
/// `status`, the second is a replay, and the upstream ran once. Returns the
/// first answer's headers and the replay's.
async fn answered_then_replayed(path: &str, status: u16) -> (HeaderMap, HeaderMap) {
    let (g, state) = gateway_on_sqlite(BEARER).await;
    let (t, k) = (fresh(), fresh());
    let (got, first, _) = send(&g.base, path, &t, Some(&k), "{}").await;
    assert_eq!(got, status, "{path}: the first answer");
    let (got, again, _) = send(&g.base, path, &t, Some(&k), "{}").await;
    assert_eq!(got, status, "{path}: the retry");
    assert_eq!(
        again.get("idempotent-replayed").map(|v| v.as_bytes()),
        Some(&b"true"[..]),
        "{path}: the retry is a replay"
    );
    assert_eq!(state.calls(), 1, "{path}: the upstream ran once");
    (first, again)
}

/// A `303 See Other` after a create consumes the key: the retry replays it, Location included, and the upstream ran once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_303_is_recorded_and_replayed() {
    let (first, again) = answered_then_replayed("/v1/orders?status=303", 303).await;
    assert_eq!(first["location"], "/v1/orders/1");
    assert_eq!(again["location"], "/v1/orders/1");
}

/// `Set-Cookie` reaches the first caller and is never replayed, even to the same caller.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn set_cookie_reaches_the_first_caller_only() {
    let (first, again) = answered_then_replayed("/v1/login", 201).await;
    assert_eq!(first["set-cookie"], "session=someone-1; HttpOnly");
    assert!(
        !again.contains_key("set-cookie"),
        "a replay carries no cookie: {again:?}"
    );
}

/// `Proxy-Authenticate` is the upstream's challenge to the gateway: neither a first answer nor a replay passes it on.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn proxy_authenticate_never_crosses() {
    let (g, _) = gateway_on_sqlite(BEARER).await;
    let (t, k) = (fresh(), fresh());
    for attempt in ["first", "replay"] {
        let (status, headers, _) = send(&g.base, "/v1/orders", &t, Some(&k), "{}").await;
        assert_eq!(status, 201);
        assert!(headers.contains_key("location"), "{attempt}: end-to-end headers pass");
        assert!(!headers.contains_key("proxy-authenticate"), "{attempt}: {headers:?}");
    }
}

/// A HEAD answer keeps the upstream's `Content-Length`, as the GET does.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn head_keeps_its_content_length() {
    let (g, _) = gateway_on_sqlite(BEARER).await;
    for method in ["HEAD", "GET"] {
        let (status, headers, body) = send_with(&g.base, method, "/v1/doc", &[], None, "").await;
        assert_eq!(status, 200, "{method}");
        assert_eq!(
            headers.get("content-length").map(|v| v.as_bytes()),
            Some(&b"11"[..]),
            "{method}: {headers:?}"
        );
        assert_eq!(body, if method == "GET" { "hello world" } else { "" });
    }
}
