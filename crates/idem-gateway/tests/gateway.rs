//! The gateway over real sockets, in front of a non-idempotent upstream
//! that counts its calls: the contract, 5xx never recorded, hop-by-hop
//! headers, twins through two gateway instances sharing PostgreSQL and
//! sharing Redis, and an upstream slower than the lease.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;

fn postgres_url() -> String {
    std::env::var("IDEM_TEST_POSTGRES_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

fn redis_url() -> String {
    std::env::var("IDEM_TEST_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

#[derive(Clone)]
struct Upstream {
    calls: Arc<AtomicUsize>,
    flaky: Arc<AtomicUsize>,
    /// `/v1/stream` sends its last chunk once this has a permit.
    gate: Arc<tokio::sync::Semaphore>,
}

/// A tiny API that is not idempotent at all.
async fn start_upstream() -> (String, Upstream) {
    let state = Upstream {
        calls: Arc::default(),
        flaky: Arc::default(),
        gate: Arc::new(tokio::sync::Semaphore::new(0)),
    };
    let s = state.clone();
    let app = Router::new()
        .route(
            "/v1/payments",
            post(move |headers: HeaderMap, body: String| {
                let s = s.clone();
                async move {
                    let n = s.calls.fetch_add(1, Ordering::SeqCst) + 1;
                    let hop = headers.contains_key("keep-alive") || headers.contains_key("x-hop");
                    (
                        StatusCode::CREATED,
                        [("x-upstream-call", n.to_string())],
                        format!(r#"{{"call":{n},"hop_seen":{hop},"body":{body:?}}}"#),
                    )
                }
            }),
        )
        .route(
            "/v1/flaky",
            post({
                let s = state.clone();
                move || {
                    let s = s.clone();
                    async move {
                        let n = s.flaky.fetch_add(1, Ordering::SeqCst) + 1;
                        if n == 1 {
                            (StatusCode::SERVICE_UNAVAILABLE, "try again".to_owned())
                        } else {
                            (StatusCode::CREATED, format!("attempt {n}"))
                        }
                    }
                }
            }),
        )
        .route(
            "/v1/stream",
            post({
                let s = state.clone();
                move || {
                    let s = s.clone();
                    async move {
                        s.calls.fetch_add(1, Ordering::SeqCst);
                        let chunks = futures_util::stream::unfold(0u8, move |step| {
                            let gate = s.gate.clone();
                            async move {
                                match step {
                                    0 => Some((Ok::<_, std::io::Error>(axum::body::Bytes::from_static(b"first ")), 1)),
                                    1 => {
                                        gate.acquire().await.ok()?.forget();
                                        Some((Ok(axum::body::Bytes::from_static(b"last")), 2))
                                    }
                                    _ => None,
                                }
                            }
                        });
                        (StatusCode::CREATED, axum::body::Body::from_stream(chunks))
                    }
                }
            }),
        )
        .route(
            "/v1/slow",
            post({
                let s = state.clone();
                move || {
                    let s = s.clone();
                    async move {
                        s.calls.fetch_add(1, Ordering::SeqCst);
                        tokio::time::sleep(Duration::from_millis(2_500)).await;
                        (StatusCode::CREATED, "slow and done")
                    }
                }
            }),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (format!("http://{addr}"), state)
}

struct Gateway {
    base: String,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Drop for Gateway {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
    }
}

async fn start_gateway(upstream: &str, store: &str, extra: &str) -> Gateway {
    let toml = format!("upstream = {upstream:?}\nstore = {store:?}\n{extra}");
    let config = idem_gateway::Config::from_toml(&toml).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let store = store.to_owned();
    let named = store.clone();
    tokio::spawn(async move {
        idem_gateway::serve(&config, listener, async {
            let _ = stopped.await;
        })
        .await
        .unwrap_or_else(|e| panic!("the gateway on {named} failed: {e}"));
    });
    // Wait until it answers.
    let client = reqwest::Client::new();
    for _ in 0..200 {
        if client
            .get(format!("{base}/_idem/healthz"))
            .send()
            .await
            .is_ok_and(|r| r.status() == 200)
        {
            return Gateway { base, stop: Some(stop) };
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("the gateway on {store} did not become healthy");
}

fn sqlite_store() -> String {
    std::env::temp_dir()
        .join(format!("idem-gateway-{}.db", uuid::Uuid::now_v7()))
        .display()
        .to_string()
}

async fn send(base: &str, path: &str, token: &str, key: Option<&str>, body: &str) -> (u16, HeaderMap, String) {
    let mut r = reqwest::Client::new()
        .post(format!("{base}{path}"))
        .bearer_auth(token)
        .header("content-type", "application/json")
        .header("x-hop", "1")
        .header("connection", "x-hop")
        .body(body.to_owned());
    if let Some(k) = key {
        r = r.header("idempotency-key", format!("\"{k}\""));
    }
    let r = r.send().await.unwrap();
    let (status, headers) = (r.status().as_u16(), r.headers().clone());
    (status, headers, r.text().await.unwrap())
}

fn fresh() -> String {
    uuid::Uuid::now_v7().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_contract_in_front_of_any_api() {
    let (upstream, state) = start_upstream().await;
    let g = start_gateway(
        &upstream,
        &sqlite_store(),
        "[[routes]]\nmethod = \"POST\"\npath = \"/v1/payments\"",
    )
    .await;
    let (t, k) = (fresh(), fresh());
    // No key: refused before the upstream sees anything.
    let (status, headers, body) = send(&g.base, "/v1/payments", &t, None, r#"{"amount":5}"#).await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(headers["content-type"], "application/problem+json");
    assert_eq!(state.calls.load(Ordering::SeqCst), 0);
    // The first call reaches the upstream, without the hop-by-hop headers.
    let (status, headers, first) = send(&g.base, "/v1/payments", &t, Some(&k), r#"{"amount":5}"#).await;
    assert_eq!(status, 201, "{first}");
    assert!(first.contains(r#""hop_seen":false"#), "{first}");
    assert!(!headers.contains_key("idempotent-replayed"));
    // Retries replay it, byte for byte, with the upstream's headers.
    for _ in 0..3 {
        let (status, headers, again) = send(&g.base, "/v1/payments", &t, Some(&k), r#"{ "amount": 5 }"#).await;
        assert_eq!(status, 201);
        assert_eq!(again, first);
        assert_eq!(headers["idempotent-replayed"], "true");
        assert_eq!(headers["x-upstream-call"], "1");
    }
    assert_eq!(state.calls.load(Ordering::SeqCst), 1);
    // The same key with another body, or on another path: 422.
    let (status, _, _) = send(&g.base, "/v1/payments", &t, Some(&k), r#"{"amount":6}"#).await;
    assert_eq!(status, 422);
    let (status, _, _) = send(&g.base, "/v1/payments?x=1", &t, Some(&k), r#"{"amount":5}"#).await;
    assert_eq!(status, 422);
    // Another caller's key space: the same key is a new request.
    let (status, headers, _) = send(&g.base, "/v1/payments", &fresh(), Some(&k), r#"{"amount":5}"#).await;
    assert_eq!(status, 201);
    assert!(!headers.contains_key("idempotent-replayed"));
    assert_eq!(state.calls.load(Ordering::SeqCst), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_5xx_is_never_recorded() {
    let (upstream, state) = start_upstream().await;
    let g = start_gateway(&upstream, &sqlite_store(), "").await;
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

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_unreachable_upstream_is_a_502_problem() {
    let g = start_gateway("http://127.0.0.1:9", &sqlite_store(), "").await;
    let (status, headers, _) = send(&g.base, "/v1/payments", &fresh(), Some(&fresh()), "{}").await;
    assert_eq!(status, 502);
    assert_eq!(headers["content-type"], "application/problem+json");
}

/// Twins split across two gateway instances on one shared store: the
/// upstream sees one call, every caller gets its answer.
async fn twins_through_two_instances(store: &str) {
    let (upstream, state) = start_upstream().await;
    let a = start_gateway(&upstream, store, "").await;
    let b = start_gateway(&upstream, store, "").await;
    let (t, k) = (fresh(), fresh());
    let tasks: Vec<_> = (0..16)
        .map(|i| {
            let base = if i % 2 == 0 { a.base.clone() } else { b.base.clone() };
            let (t, k) = (t.clone(), k.clone());
            tokio::spawn(async move { send(&base, "/v1/payments", &t, Some(&k), r#"{"amount":7}"#).await })
        })
        .collect();
    let mut bodies = Vec::new();
    for task in tasks {
        let (status, _, body) = task.await.unwrap();
        assert_eq!(status, 201, "{body}");
        bodies.push(body);
    }
    assert!(bodies.iter().all(|b| b == &bodies[0]), "one answer for every twin");
    assert_eq!(state.calls.load(Ordering::SeqCst), 1, "the upstream saw one call");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn twins_through_two_instances_sharing_postgres() {
    twins_through_two_instances(&postgres_url()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn twins_through_two_instances_sharing_redis() {
    twins_through_two_instances(&redis_url()).await;
}

/// The upstream takes 2.5 s; the lease is 1 s. The heartbeat keeps the
/// lease, so twins arriving during the call wait and replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_upstream_slower_than_the_lease_is_called_once() {
    let (upstream, state) = start_upstream().await;
    let store = sqlite_store();
    let g = start_gateway(&upstream, &store, "[defaults]\nlease_ms = 1000\nwait_ms = 10000").await;
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
    assert_eq!(state.calls.load(Ordering::SeqCst), 1);
}

/// The upstream's answer streams through the gateway: the first caller reads
/// the status and the first chunk while the upstream has not finished, and
/// the whole answer is recorded on the way.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_answer_streams_to_the_first_caller_while_it_is_recorded() {
    let (upstream, state) = start_upstream().await;
    let store = sqlite_store();
    let g = start_gateway(&upstream, &store, "").await;
    let (t, k) = (fresh(), fresh());
    let mut first = tokio::time::timeout(
        Duration::from_secs(10),
        reqwest::Client::new()
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
    assert_eq!(state.calls.load(Ordering::SeqCst), 1);
}
