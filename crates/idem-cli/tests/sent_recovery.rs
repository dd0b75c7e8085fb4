//! `idem gateway` processes at the recovery edge: a request that may have
//! reached the upstream is never sent again blindly.
//!
//! - A gateway killed (SIGKILL) while its request is at the upstream: once
//!   its lease ends, a retry through another gateway on the same store
//!   finds the key marked sent and is held (409 outcome unknown), not sent
//!   again. On SQLite, PostgreSQL, MariaDB and Redis.
//! - The store refuses the completion (a SQLite file write-locked past the
//!   busy timeout; a Redis at `maxmemory` under `noeviction`) while the
//!   upstream works: the completion is tried again until the store takes
//!   it, and the retry replays the answer.
//! - A reconcile lookup asked before the first send settled: the upstream
//!   finishes work after its caller (the gateway, past its upstream
//!   timeout) hung up, so its lookup still says "not found"; the retry is
//!   held until the settle time, then the lookup says "applied" and the
//!   answer is replayed. The upstream applied the request once.

mod support;

use std::collections::HashSet;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::Path;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::{get, post};
use support::{
    Answer, gateway_config, idem_json, keys_command, listed_tenant_and_state, mysql_url, post_keyed, postgres_url,
    redis_url, start_gateway, temp,
};

/// The upstream: `POST /v1/pay` counts the call, applies it after `work`
/// in a task of its own (so it is applied even when its caller hung up,
/// as most servers do), and answers 201; `GET /v1/pay/by-key/{key}`
/// answers 200 once the key was applied, 404 before.
#[derive(Clone, Default)]
struct Upstream {
    calls: Arc<AtomicUsize>,
    applied: Arc<Mutex<HashSet<String>>>,
}

impl Upstream {
    async fn serve(work: Duration) -> (String, Upstream) {
        let up = Upstream::default();
        let (pay, look) = (up.clone(), up.clone());
        let app = Router::new()
            .route(
                "/v1/pay",
                post(move |headers: HeaderMap| {
                    let up = pay.clone();
                    async move {
                        up.calls.fetch_add(1, Ordering::SeqCst);
                        let key = headers
                            .get("idempotency-key")
                            .and_then(|v| v.to_str().ok())
                            .unwrap_or_default()
                            .trim_matches('"')
                            .to_owned();
                        let applied = up.applied.clone();
                        let done = tokio::spawn(async move {
                            tokio::time::sleep(work).await;
                            applied.lock().unwrap().insert(key);
                        });
                        let _ = done.await;
                        (StatusCode::CREATED, r#"{"status":"paid"}"#)
                    }
                }),
            )
            .route(
                "/v1/pay/by-key/{key}",
                get(move |Path(key): Path<String>| {
                    let up = look.clone();
                    async move {
                        if up.applied.lock().unwrap().contains(&key) {
                            (StatusCode::OK, r#"{"status":"paid"}"#)
                        } else {
                            (StatusCode::NOT_FOUND, r#"{"error":"not found"}"#)
                        }
                    }
                }),
            );
        (support::serve(app).await, up)
    }

    fn calls(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }

    async fn wait_for_calls(&self, n: usize) {
        for _ in 0..800 {
            if self.calls() >= n {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("the upstream was not called {n} time(s)");
    }
}

/// The pay route: a lease of 1 s, and retries while it lives turned away.
const HOLD: &str = r#"
[[routes]]
method = "POST"
path = "/v1/pay"
lease_ms = 1000
in_flight = "reject"
"#;

fn ids() -> (String, String) {
    (uuid::Uuid::now_v7().to_string(), uuid::Uuid::now_v7().to_string())
}

/// Retries until the answer is no longer "in flight" (a live lease).
async fn retry_past_in_flight(base: &str, token: &str, key: &str) -> Answer {
    for _ in 0..400 {
        let a = post_keyed(base, "/v1/pay", token, key).await.expect("an answer");
        if a.problem.as_deref() != Some("idempotency-key-in-flight") {
            return a;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("the key stayed in flight");
}

/// A gateway killed while its request is at the upstream: the retry through
/// another gateway is held, never sent again.
async fn killed_mid_request(store: &str) {
    let (up, upstream) = Upstream::serve(Duration::from_secs(3)).await;
    let config = gateway_config(HOLD);
    let (mut first, a) = start_gateway(&up, store, &config).await;
    let (_second, b) = start_gateway(&up, store, &config).await;
    let (token, key) = ids();
    let lost = tokio::spawn({
        let (a, token, key) = (a.clone(), token.clone(), key.clone());
        async move { post_keyed(&a, "/v1/pay", &token, &key).await }
    });
    upstream.wait_for_calls(1).await;
    first.kill();
    assert!(lost.await.unwrap().is_none(), "the first caller lost its gateway");
    // Once the dead gateway's lease ends, the key is held, not taken over.
    let answer = retry_past_in_flight(&b, &token, &key).await;
    assert_eq!(
        (answer.status, answer.problem.as_deref()),
        (409, Some("idempotency-outcome-unknown")),
        "{answer:?}"
    );
    tokio::time::sleep(Duration::from_millis(3_500)).await;
    for _ in 0..3 {
        let again = post_keyed(&b, "/v1/pay", &token, &key).await.unwrap();
        assert_eq!(
            again.problem.as_deref(),
            Some("idempotency-outcome-unknown"),
            "{again:?}"
        );
    }
    assert_eq!(upstream.calls(), 1, "{store}: the upstream was called once");
    let (tenant, state) = listed_tenant_and_state(store, &key, &[]);
    assert_eq!(state, "sent", "the key is listed as sent");
    // The operator, having checked the upstream, records what it did.
    let answer = temp("sent", "answer.json");
    std::fs::write(&answer, r#"{"status":"paid"}"#).unwrap();
    let applied = ["--applied", "--status", "201", "--body", &answer];
    let (code, done) = idem_json(&keys_command("resolve", store, &tenant, "POST /v1/pay", &key, &applied));
    assert_eq!((code, &done["resolved"]), (0, &serde_json::json!("applied")), "{done}");
    let replay = post_keyed(&b, "/v1/pay", &token, &key).await.unwrap();
    assert_eq!((replay.status, replay.replayed), (201, true), "{replay:?}");
    assert_eq!(replay.body, r#"{"status":"paid"}"#);
    assert_eq!(upstream.calls(), 1);
}

idem_conformance::cases!(killed_mid_request, 2 => {
    a_gateway_killed_mid_request_is_never_sent_again_on_sqlite(&temp("sent", "keys.db"));
    a_gateway_killed_mid_request_is_never_sent_again_on_postgres(&postgres_url());
    a_gateway_killed_mid_request_is_never_sent_again_on_mariadb(&mysql_url());
    a_gateway_killed_mid_request_is_never_sent_again_on_redis(&redis_url());
});

/// The store refuses writes from `refuse()` until `allow()` while the
/// upstream works: the first caller still gets its answer once the store
/// takes it, the retry replays it, and the upstream ran once.
async fn refused_completion(store: &str, refuse: impl AsyncFnOnce(), allow: impl AsyncFnOnce()) {
    let (up, upstream) = Upstream::serve(Duration::from_secs(2)).await;
    let (_g, base) = start_gateway(&up, store, &gateway_config(HOLD)).await;
    let (token, key) = ids();
    let first = tokio::spawn({
        let (base, token, key) = (base.clone(), token.clone(), key.clone());
        async move { post_keyed(&base, "/v1/pay", &token, &key).await }
    });
    upstream.wait_for_calls(1).await;
    refuse().await;
    // Past the upstream's answer, the lease and the store's own waits.
    tokio::time::sleep(Duration::from_secs(7)).await;
    allow().await;
    let first = first.await.unwrap().expect("the first caller gets an answer");
    assert_eq!((first.status, first.replayed), (201, false), "{first:?}");
    let again = post_keyed(&base, "/v1/pay", &token, &key).await.unwrap();
    assert_eq!((again.status, again.replayed), (201, true), "{again:?}");
    assert_eq!(again.body, r#"{"status":"paid"}"#);
    assert_eq!(upstream.calls(), 1, "the upstream was called once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completion_refused_by_a_write_locked_sqlite_file_is_tried_again() {
    use sqlx::Connection;
    let path = temp("sent", "locked.db");
    let locker: Arc<tokio::sync::Mutex<Option<sqlx::SqliteConnection>>> = Arc::default();
    let (lock, unlock) = (locker.clone(), locker.clone());
    let url = format!("sqlite://{path}");
    refused_completion(
        &path,
        async move || {
            // A long write transaction of another connection, longer than
            // the gateway's busy timeout (5 s).
            let mut conn = sqlx::SqliteConnection::connect(&url).await.unwrap();
            sqlx::query("BEGIN IMMEDIATE").execute(&mut conn).await.unwrap();
            *lock.lock().await = Some(conn);
        },
        async move || {
            let mut conn = unlock.lock().await.take().unwrap();
            sqlx::query("ROLLBACK").execute(&mut conn).await.unwrap();
            conn.close().await.unwrap();
        },
    )
    .await;
}

/// A Redis server of the test's own, so that filling it harms nobody.
struct PrivateRedis(Child, u16);

impl Drop for PrivateRedis {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

async fn private_redis() -> PrivateRedis {
    let port = support::free_port();
    let child = Command::new("redis-server")
        .args([
            "--bind",
            "127.0.0.1",
            "--port",
            &port.to_string(),
            "--save",
            "",
            "--appendonly",
            "no",
        ])
        .args(["--maxmemory-policy", "noeviction"])
        .stdout(Stdio::null())
        .spawn()
        .expect("redis-server runs");
    let server = PrivateRedis(child, port);
    for _ in 0..400 {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return server;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("the private Redis did not start");
}

async fn redis_config(port: u16, maxmemory: &str) {
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}")).unwrap();
    let mut c = client.get_multiplexed_async_connection().await.unwrap();
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory")
        .arg(maxmemory)
        .query_async(&mut c)
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completion_refused_by_a_full_redis_is_tried_again() {
    let server = private_redis().await;
    let port = server.1;
    refused_completion(
        &format!("redis://127.0.0.1:{port}"),
        async move || redis_config(port, "1").await,
        async move || redis_config(port, "0").await,
    )
    .await;
}

/// The lookup of [`HOLD`]'s route.
const RECONCILE: &str = r#"
[routes.reconcile]
path = "/v1/pay/by-key/{key}"
applied_status = 201
"#;

/// The lookup asked before the held request settled says "not found":
/// the retry is held until the settle time (the upstream timeout plus 5 s),
/// never sent; after it, the lookup says "applied" and that is replayed.
async fn early_lookup(store: &str) {
    let (up, upstream) = Upstream::serve(Duration::from_secs(3)).await;
    // The held route with its lookup, and an upstream timeout of 1 s.
    let config = gateway_config(&format!("upstream_timeout_secs = 1\n{HOLD}{RECONCILE}"));
    let (_g, base) = start_gateway(&up, store, &config).await;
    let (token, key) = ids();
    let sent = Instant::now();
    let first = post_keyed(&base, "/v1/pay", &token, &key).await.unwrap();
    assert_eq!(first.status, 504, "{first:?}");
    tokio::time::sleep(Duration::from_millis(200)).await;
    let early = post_keyed(&base, "/v1/pay", &token, &key).await.unwrap();
    assert_eq!(
        (early.status, early.problem.as_deref()),
        (409, Some("idempotency-outcome-unknown")),
        "{early:?}"
    );
    let wait = early.retry_after.expect("the held retry says when to come back");
    assert!((1..=6).contains(&wait), "Retry-After {wait}");
    assert_eq!(upstream.calls(), 1, "the early retry was not sent");
    // Past the settle time the lookup finds the request applied.
    tokio::time::sleep(Duration::from_secs(6).saturating_sub(sent.elapsed()) + Duration::from_millis(500)).await;
    let late = post_keyed(&base, "/v1/pay", &token, &key).await.unwrap();
    assert_eq!((late.status, late.replayed), (201, true), "{late:?}");
    assert_eq!(late.body, r#"{"status":"paid"}"#);
    assert_eq!(upstream.calls(), 1, "{store}: the upstream applied the request once");
    assert_eq!(upstream.applied.lock().unwrap().len(), 1);
}

idem_conformance::cases!(early_lookup, 2 => {
    a_lookup_asked_before_the_send_settled_holds_the_retry_on_sqlite(&temp("sent", "reconcile.db"));
    a_lookup_asked_before_the_send_settled_holds_the_retry_on_postgres(&postgres_url());
    a_lookup_asked_before_the_send_settled_holds_the_retry_on_mariadb(&mysql_url());
    a_lookup_asked_before_the_send_settled_holds_the_retry_on_redis(&redis_url());
});
