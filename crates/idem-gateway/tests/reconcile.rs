//! The configured reconcile request over real sockets, in front of an
//! upstream that counts its payouts: a retry that meets a key held as an
//! unknown outcome asks the upstream first. Applied (after a 500, after a
//! dropped connection): the lookup's answer is recorded and replayed, the
//! payout is sent once. Not applied (404): the retry is sent once. A lookup
//! that fails keeps the key held (409). Many concurrent retries send the
//! payout no more often than lookups said it was not applied. On SQLite,
//! PostgreSQL, MariaDB and Redis.

mod support;

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use support::{BEARER, fresh, mysql_url, postgres_url, redis_url, send_with, sqlite_store, start_gateway};

/// What the next payout call does.
#[derive(Clone, Copy, Debug)]
enum Fault {
    /// Pays, then answers 500.
    PayThen500,
    /// Pays, then drops the connection unanswered.
    PayThenDrop,
    /// Pays nothing and answers 500.
    Refuse500,
}

/// How lookups answer.
const LOOKUP_OK: usize = 0;
const LOOKUP_503: usize = 1;
const LOOKUP_DROP: usize = 2;

#[derive(Clone, Default)]
struct Payouts {
    /// Calls of `POST /v1/payouts/{id}`.
    posts: Arc<AtomicUsize>,
    /// Payouts paid, by idempotency key.
    paid: Arc<Mutex<HashMap<String, String>>>,
    /// What the next payout calls do, first first.
    faults: Arc<Mutex<Vec<Fault>>>,
    /// Lookups asked.
    lookups: Arc<AtomicUsize>,
    /// How lookups answer.
    lookup_mode: Arc<AtomicUsize>,
    /// Each lookup's `Authorization` and `Idempotency-Key`.
    lookup_headers: Arc<Mutex<Vec<(String, String)>>>,
}

impl Payouts {
    fn posts(&self) -> usize {
        self.posts.load(Ordering::SeqCst)
    }

    fn lookups(&self) -> usize {
        self.lookups.load(Ordering::SeqCst)
    }

    fn paid(&self) -> usize {
        self.paid.lock().unwrap().len()
    }
}

fn header(headers: &HeaderMap, name: &str) -> String {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned()
}

/// The key as sent (a structured-field string), without its quotes.
fn key_of(headers: &HeaderMap) -> String {
    header(headers, "idempotency-key").trim_matches('"').to_owned()
}

async fn pay(State(s): State<Payouts>, Path(id): Path<String>, headers: HeaderMap, body: String) -> Response {
    let n = s.posts.fetch_add(1, Ordering::SeqCst) + 1;
    let fault = {
        let mut faults = s.faults.lock().unwrap();
        (!faults.is_empty()).then(|| faults.remove(0))
    };
    if !matches!(fault, Some(Fault::Refuse500)) {
        s.paid.lock().unwrap().insert(key_of(&headers), id.clone());
    }
    match fault {
        Some(Fault::PayThen500) => (StatusCode::INTERNAL_SERVER_ERROR, "paid, then failed").into_response(),
        // The connection's task ends without an answer, closing the socket.
        Some(Fault::PayThenDrop) => panic!("paid, then the connection drops"),
        Some(Fault::Refuse500) => (StatusCode::INTERNAL_SERVER_ERROR, "not paid").into_response(),
        None => (
            StatusCode::CREATED,
            [("x-call", n.to_string())],
            format!(r#"{{"payout":"{id}","call":{n},"request":{body}}}"#),
        )
            .into_response(),
    }
}

/// `GET /v1/payouts/{id}/by-key/{key}`: 200 with the payout if that key
/// paid it, else 404; slow enough for concurrent retries to meet.
async fn lookup(State(s): State<Payouts>, Path((id, key)): Path<(String, String)>, headers: HeaderMap) -> Response {
    s.lookups.fetch_add(1, Ordering::SeqCst);
    s.lookup_headers
        .lock()
        .unwrap()
        .push((header(&headers, "authorization"), header(&headers, "idempotency-key")));
    tokio::time::sleep(Duration::from_millis(30)).await;
    match s.lookup_mode.load(Ordering::SeqCst) {
        LOOKUP_503 => return (StatusCode::SERVICE_UNAVAILABLE, "lookups are down").into_response(),
        LOOKUP_DROP => panic!("the lookup's connection drops"),
        _ => {}
    }
    let paid = s.paid.lock().unwrap().get(&key).cloned();
    match paid {
        Some(paid) if paid == id => (
            StatusCode::OK,
            [
                ("content-type", "application/json"),
                ("x-found-by", "lookup"),
                ("set-cookie", "lookup-session=1"),
            ],
            format!(r#"{{"payout":"{id}","status":"paid"}}"#),
        )
            .into_response(),
        _ => (StatusCode::NOT_FOUND, "no such payout").into_response(),
    }
}

/// `GET /whoami`: `Authorization: Bearer <user>.<anything>` is `<user>`.
async fn whoami(headers: HeaderMap) -> Response {
    let auth = header(&headers, "authorization");
    match auth.strip_prefix("Bearer ").and_then(|t| t.split('.').next()) {
        Some(user) if !user.is_empty() => ([("x-user-id", user.to_owned())], "").into_response(),
        _ => StatusCode::UNAUTHORIZED.into_response(),
    }
}

async fn upstream() -> (String, Payouts) {
    let state = Payouts::default();
    let app = Router::new()
        .route("/whoami", get(whoami))
        .route("/v1/payouts/{id}", post(pay))
        .route("/v1/payouts/{id}/by-key/{key}", get(lookup))
        .with_state(state.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (format!("http://{addr}"), state)
}

const ROUTES: &str = r#"
[[routes]]
method = "POST"
path = "/v1/payouts/{id}"
[routes.reconcile]
path = "/v1/payouts/{id}/by-key/{key}"
applied = [200]
applied_status = 201
not_applied = [404]
timeout_ms = 2000
"#;

/// Sends the payout `id` with `key` as the caller `token`.
async fn pay_out(base: &str, id: &str, token: &str, key: &str) -> support::Answer {
    send_with(
        base,
        "POST",
        &format!("/v1/payouts/{id}"),
        &[("authorization", &format!("Bearer {token}"))],
        Some(key),
        r#"{"amount":100}"#,
    )
    .await
}

/// Sends a new payout (a fresh id and key) as the caller `token`, its first
/// calls meeting `faults`: its id, its key and the answer.
async fn first_send(base: &str, s: &Payouts, token: &str, faults: &[Fault]) -> (String, String, support::Answer) {
    s.faults.lock().unwrap().extend_from_slice(faults);
    let (id, key) = (fresh(), fresh());
    let answer = pay_out(base, &id, token, &key).await;
    (id, key, answer)
}

async fn answers(store: &str) {
    let (up, s) = upstream().await;
    let g = start_gateway(&up, store, &format!("{BEARER}{ROUTES}")).await;
    let token = fresh();

    // Paid, then 500: the retry asks, records the lookup's answer as 201 and
    // replays it; the payout is not sent again.
    let (id, key, (status, _, body)) = first_send(&g.base, &s, &token, &[Fault::PayThen500]).await;
    assert_eq!(status, 500, "{body}");
    let (status, headers, body) = pay_out(&g.base, &id, &token, &key).await;
    assert_eq!(status, 201, "{body}");
    assert_eq!(body, format!(r#"{{"payout":"{id}","status":"paid"}}"#));
    assert_eq!(headers["idempotent-replayed"], "true");
    assert_eq!(headers["x-found-by"], "lookup");
    assert!(
        !headers.contains_key("set-cookie"),
        "a private header is never recorded"
    );
    assert_eq!((s.posts(), s.lookups()), (1, 1));
    // The lookup carried the retrying caller's credentials and key.
    assert_eq!(
        s.lookup_headers.lock().unwrap().last().cloned().unwrap(),
        (format!("Bearer {token}"), format!("\"{key}\""))
    );
    // Later retries replay the record without asking again.
    let (status, _, again) = pay_out(&g.base, &id, &token, &key).await;
    assert_eq!((status, again.as_str()), (201, body.as_str()));
    assert_eq!((s.posts(), s.lookups()), (1, 1));

    // Paid, then the connection dropped: the same.
    let (id, key, (status, _, body)) = first_send(&g.base, &s, &token, &[Fault::PayThenDrop]).await;
    assert_eq!(status, 502, "{body}");
    let (status, headers, body) = pay_out(&g.base, &id, &token, &key).await;
    assert_eq!(status, 201, "{body}");
    assert_eq!(headers["idempotent-replayed"], "true");
    assert_eq!((s.posts(), s.lookups()), (2, 2));

    // Not paid (the lookup answers 404): the key is released and the retry
    // is sent once; its answer is recorded as a first answer's.
    let (id, key, (status, ..)) = first_send(&g.base, &s, &token, &[Fault::Refuse500]).await;
    assert_eq!(status, 500);
    let (status, headers, first) = pay_out(&g.base, &id, &token, &key).await;
    assert_eq!(status, 201, "{first}");
    assert!(!headers.contains_key("idempotent-replayed"));
    assert_eq!(headers["x-call"], "4");
    assert_eq!((s.posts(), s.lookups()), (4, 3));
    let (status, headers, again) = pay_out(&g.base, &id, &token, &key).await;
    assert_eq!((status, again.as_str()), (201, first.as_str()));
    assert_eq!(headers["idempotent-replayed"], "true");
    assert_eq!((s.posts(), s.lookups()), (4, 3));

    // A lookup that fails (503, a dropped connection) keeps the key held:
    // 409 as without a lookup, and the payout is not sent.
    let (id, key, (status, ..)) = first_send(&g.base, &s, &token, &[Fault::PayThen500]).await;
    assert_eq!(status, 500);
    for mode in [LOOKUP_503, LOOKUP_DROP] {
        s.lookup_mode.store(mode, Ordering::SeqCst);
        let (status, headers, body) = pay_out(&g.base, &id, &token, &key).await;
        assert_eq!(status, 409, "{body}");
        assert_eq!(headers["content-type"], "application/problem+json");
        assert!(body.contains("idempotency-outcome-unknown"), "{body}");
    }
    assert_eq!((s.posts(), s.lookups()), (5, 5));
    // Once lookups work again, the next retry resolves it.
    s.lookup_mode.store(LOOKUP_OK, Ordering::SeqCst);
    let (status, headers, _) = pay_out(&g.base, &id, &token, &key).await;
    assert_eq!(status, 201);
    assert_eq!(headers["idempotent-replayed"], "true");
    assert_eq!((s.posts(), s.lookups(), s.paid()), (5, 6, 4));

    let metrics = reqwest::get(format!("{}/_idem/metrics", g.base))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for result in ["applied", "not_applied", "unknown", "failed"] {
        assert!(
            metrics.contains(&format!("idem_gateway_reconcile_total{{result=\"{result}\"}}")),
            "{result}: {metrics}"
        );
    }
}

/// 32 concurrent retries of a held key, split between two gateway instances
/// sharing the store. Paid: one lookup, every retry gets
/// the recorded answer, the payout was sent once. Not paid, twice: each
/// payout sent again follows a lookup made after the previous send ended,
/// so exactly two more are sent (the second of them pays), never one per
/// retry; the retry whose send failed gets its 500, all others the 201.
async fn concurrent_retries(store: &str) {
    let (up, s) = upstream().await;
    // Two gateway instances on the one store; the retries are split between them.
    let g = start_gateway(&up, store, &format!("{BEARER}{ROUTES}")).await;
    let other = start_gateway(&up, store, &format!("{BEARER}{ROUTES}")).await;
    let token = fresh();
    let retry_all = |id: String, key: String| {
        let (bases, token) = ([g.base.clone(), other.base.clone()], token.clone());
        async move {
            let tasks: Vec<_> = (0..32)
                .map(|i| {
                    let (base, id, token, key) = (bases[i % 2].clone(), id.clone(), token.clone(), key.clone());
                    tokio::spawn(async move { pay_out(&base, &id, &token, &key).await })
                })
                .collect();
            let mut all = Vec::new();
            for t in tasks {
                all.push(t.await.unwrap());
            }
            all
        }
    };

    let (id, key, first) = first_send(&g.base, &s, &token, &[Fault::PayThen500]).await;
    assert_eq!(first.0, 500);
    let all = retry_all(id.clone(), key.clone()).await;
    for (status, headers, body) in &all {
        assert_eq!(*status, 201, "{body}");
        assert_eq!(body, &format!(r#"{{"payout":"{id}","status":"paid"}}"#));
        assert_eq!(headers["idempotent-replayed"], "true");
    }
    assert_eq!(s.posts(), 1, "the payout was sent once");
    assert_eq!(
        s.lookups(),
        1,
        "one retry asked; the others found the answer it recorded"
    );

    // The first send and the first send again are refused; the next pays.
    let (id, key, first) = first_send(&g.base, &s, &token, &[Fault::Refuse500, Fault::Refuse500]).await;
    assert_eq!(first.0, 500);
    let all = retry_all(id.clone(), key.clone()).await;
    let statuses: Vec<u16> = all.iter().map(|a| a.0).collect();
    let odd: Vec<&str> = all.iter().filter(|a| a.0 == 409).map(|a| a.2.as_str()).collect();
    assert!(odd.is_empty(), "{odd:?}");
    assert_eq!(statuses.iter().filter(|s| **s == 500).count(), 1, "{statuses:?}");
    assert_eq!(statuses.iter().filter(|s| **s == 201).count(), 31, "{statuses:?}");
    let fresh_answers = all
        .iter()
        .filter(|a| a.0 == 201 && !a.1.contains_key("idempotent-replayed"))
        .count();
    assert_eq!(
        fresh_answers, 1,
        "one retry got the payout's own answer, the rest its replay"
    );
    assert_eq!(s.posts(), 1 + 3, "two sends after two lookups said not paid");
    assert_eq!(s.lookups(), 1 + 2);
    assert_eq!(s.paid(), 2, "each key paid once");
}

idem_conformance::cases!(answers, 4 => {
    reconcile_answers_on_sqlite(&sqlite_store());
    reconcile_answers_on_postgres(&postgres_url());
    reconcile_answers_on_mariadb(&mysql_url());
    reconcile_answers_on_redis(&redis_url());
});

idem_conformance::cases!(concurrent_retries, 4 => {
    concurrent_retries_on_sqlite(&sqlite_store());
    concurrent_retries_on_postgres(&postgres_url());
    concurrent_retries_on_mariadb(&mysql_url());
    concurrent_retries_on_redis(&redis_url());
});

/// Without a reconcile request the key stays held: 409, no lookup.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_route_without_a_reconcile_request_is_not_asked_about() {
    let (up, s) = upstream().await;
    let g = start_gateway(
        &up,
        &sqlite_store(),
        &format!("{BEARER}[[routes]]\nmethod = \"POST\"\npath = \"/v1/payouts/{{id}}\"\n"),
    )
    .await;
    let token = fresh();
    let (id, key, first) = first_send(&g.base, &s, &token, &[Fault::PayThen500]).await;
    assert_eq!(first.0, 500);
    let (status, _, body) = pay_out(&g.base, &id, &token, &key).await;
    assert_eq!(status, 409, "{body}");
    assert_eq!((s.posts(), s.lookups()), (1, 0));
}

/// The lookup carries the retrying caller's own credentials: under the
/// `identity` source a refreshed token keeps its keys, and the lookup is
/// sent with the token of the retry that asks, not the one of the request
/// that was held.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_lookup_carries_the_retrying_callers_credentials() {
    let (up, s) = upstream().await;
    let identity = "[tenant]\nsource = \"identity\"\ncredentials = [\"authorization\"]\n\
                    [tenant.identity]\npath = \"/whoami\"\nheader = \"x-user-id\"\n";
    let g = start_gateway(&up, &sqlite_store(), &format!("{identity}{ROUTES}")).await;
    let user = fresh();
    let (id, key, (status, _, body)) = first_send(&g.base, &s, &format!("{user}.first"), &[Fault::PayThen500]).await;
    assert_eq!(status, 500, "{body}");
    let (status, headers, body) = pay_out(&g.base, &id, &format!("{user}.refreshed"), &key).await;
    assert_eq!(status, 201, "{body}");
    assert_eq!(headers["idempotent-replayed"], "true");
    assert_eq!(
        s.lookup_headers.lock().unwrap().clone(),
        vec![(format!("Bearer {user}.refreshed"), format!("\"{key}\""))]
    );
    assert_eq!(s.posts(), 1);
}
