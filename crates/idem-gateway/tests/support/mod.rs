//! What the gateway's tests share: a counting upstream that is not
//! idempotent at all, a gateway on a real socket, and a client.

#![allow(dead_code, unreachable_pub)]

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get, post};
// Not every test binary that includes this module uses each one.
#[allow(unused_imports)]
pub use idem_conformance::env::{mysql_url, postgres_url, redis_url};

/// The tenant source of most tests: a digest of `Authorization`.
pub const BEARER: &str = "[tenant]\nsource = \"credentials\"\ncredentials = [\"authorization\"]\n";

/// What the upstream counts.
#[derive(Clone)]
pub struct Upstream {
    /// Calls of every route but `/whoami`.
    pub calls: Arc<AtomicUsize>,
    /// Calls of `/v1/flaky`.
    pub flaky: Arc<AtomicUsize>,
    /// Identity requests.
    pub whoami: Arc<AtomicUsize>,
    /// `/v1/stream` sends its last chunk once this has a permit.
    pub gate: Arc<tokio::sync::Semaphore>,
    /// Paths the upstream was called on, in order.
    pub paths: Arc<std::sync::Mutex<Vec<String>>>,
    /// Calls of `/v1/slow` that finished.
    pub finished: Arc<AtomicUsize>,
}

impl Upstream {
    pub fn calls(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }

    pub fn paths(&self) -> Vec<String> {
        self.paths.lock().unwrap().clone()
    }
}

fn header_str(headers: &HeaderMap, name: &str) -> String {
    headers
        .get_all(name)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .collect::<Vec<_>>()
        .join(" | ")
}

/// Every mutating route not named below: counts the call and answers 201
/// with what it saw, a cookie, a proxy challenge and a location; the status
/// is the `status` query parameter's when there is one.
async fn echo(State(s): State<Upstream>, method: Method, uri: Uri, headers: HeaderMap, body: Bytes) -> Response {
    let n = s.calls.fetch_add(1, Ordering::SeqCst) + 1;
    s.paths.lock().unwrap().push(uri.to_string());
    let status = uri
        .query()
        .and_then(|q| q.split('&').find_map(|p| p.strip_prefix("status=")))
        .and_then(|c| c.parse::<u16>().ok())
        .and_then(|c| StatusCode::from_u16(c).ok())
        .unwrap_or(StatusCode::CREATED);
    let seen = serde_json::json!({
        "call": n,
        "method": method.as_str(),
        "target": uri.to_string(),
        "authorization": header_str(&headers, "authorization"),
        "cookie": header_str(&headers, "cookie"),
        "api_key": header_str(&headers, "x-api-key"),
        "hop_seen": headers.contains_key("keep-alive") || headers.contains_key("x-hop"),
        "x_forwarded_for": header_str(&headers, "x-forwarded-for"),
        "x_forwarded_proto": header_str(&headers, "x-forwarded-proto"),
        "x_forwarded_host": header_str(&headers, "x-forwarded-host"),
        "forwarded": header_str(&headers, "forwarded"),
        "tenant_header": header_str(&headers, "x-tenant-id"),
        "body": String::from_utf8_lossy(&body),
    });
    let who = headers
        .get("x-login")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("someone")
        .to_owned();
    (
        status,
        [
            ("x-upstream-call", n.to_string()),
            ("set-cookie", format!("session={who}-{n}; HttpOnly")),
            ("proxy-authenticate", "Basic realm=\"upstream\"".to_owned()),
            ("location", format!("/v1/orders/{n}")),
            ("content-type", "application/json".to_owned()),
        ],
        seen.to_string(),
    )
        .into_response()
}

/// `GET /whoami`: `Authorization: Bearer <user>.<anything>` is `<user>`
/// (named in `x-user-id` and in `{"user":{"id":…}}`); `Bearer bad` is 401.
async fn whoami(State(s): State<Upstream>, headers: HeaderMap) -> Response {
    s.whoami.fetch_add(1, Ordering::SeqCst);
    let token = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    match token
        .and_then(|t| t.split('.').next())
        .filter(|u| *u != "bad" && !u.is_empty())
    {
        Some(user) => (
            [("x-user-id", user.to_owned())],
            serde_json::json!({"user": {"id": user}}).to_string(),
        )
            .into_response(),
        None => (
            StatusCode::UNAUTHORIZED,
            [("www-authenticate", "Bearer error=\"invalid_token\"")],
            "who are you?",
        )
            .into_response(),
    }
}

/// Starts the upstream on a free port.
pub async fn start_upstream() -> (String, Upstream) {
    let (app, state) = upstream_app();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (format!("http://{addr}"), state)
}

/// Starts the upstream on a free port, serving https with `pki`'s
/// certificate.
pub async fn start_tls_upstream(pki: &idem_tls::test_pki::TestPki) -> (String, Upstream) {
    let (app, state) = upstream_app();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let tls = fake_vendor::TlsListener::new(listener, pki.server_config());
    tokio::spawn(async move { axum::serve(tls, app).await.unwrap() });
    (format!("https://{addr}"), state)
}

fn upstream_app() -> (Router, Upstream) {
    let state = Upstream {
        calls: Arc::default(),
        flaky: Arc::default(),
        whoami: Arc::default(),
        gate: Arc::new(tokio::sync::Semaphore::new(0)),
        paths: Arc::default(),
        finished: Arc::default(),
    };
    let app = Router::new()
        .route("/whoami", get(whoami))
        .route(
            "/v1/flaky",
            post(|State(s): State<Upstream>| async move {
                let n = s.flaky.fetch_add(1, Ordering::SeqCst) + 1;
                if n == 1 {
                    (StatusCode::SERVICE_UNAVAILABLE, "try again".to_owned())
                } else {
                    (StatusCode::CREATED, format!("attempt {n}"))
                }
            }),
        )
        .route(
            "/v1/doc",
            get(|| async { ([(header::CONTENT_LENGTH, "11")], "hello world") }),
        )
        .route(
            "/v1/stream",
            post(|State(s): State<Upstream>| async move {
                s.calls.fetch_add(1, Ordering::SeqCst);
                let chunks = futures_util::stream::unfold(0u8, move |step| {
                    let gate = s.gate.clone();
                    async move {
                        match step {
                            0 => Some((Ok::<_, std::io::Error>(Bytes::from_static(b"first ")), 1)),
                            1 => {
                                gate.acquire().await.ok()?.forget();
                                Some((Ok(Bytes::from_static(b"last")), 2))
                            }
                            _ => None,
                        }
                    }
                });
                (StatusCode::CREATED, axum::body::Body::from_stream(chunks))
            }),
        )
        .route(
            "/v1/slow",
            post(|State(s): State<Upstream>| async move {
                s.calls.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(2_500)).await;
                s.finished.fetch_add(1, Ordering::SeqCst);
                (StatusCode::CREATED, "slow and done")
            }),
        )
        .fallback(any(echo))
        .with_state(state.clone());
    (app, state)
}

/// A gateway serving on a real socket; dropped, it stops.
pub struct Gateway {
    pub base: String,
    pub addr: std::net::SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Drop for Gateway {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
    }
}

/// Starts a gateway in front of `upstream` on `store`; `extra` is more TOML
/// (top-level settings first, then tables).
pub async fn start_gateway(upstream: &str, store: &str, extra: &str) -> Gateway {
    let toml = format!("upstream = {upstream:?}\nstore = {store:?}\n{extra}");
    let config = idem_gateway::Config::from_toml(&toml).unwrap_or_else(|e| panic!("{e}\n{toml}"));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let base = format!("http://{addr}");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let named = store.to_owned();
    tokio::spawn(async move {
        idem_gateway::serve(&config, listener, async {
            let _ = stopped.await;
        })
        .await
        .unwrap_or_else(|e| panic!("the gateway on {named} failed: {e}"));
    });
    wait_healthy(&base).await;
    Gateway {
        base,
        addr,
        stop: Some(stop),
    }
}

/// Starts the upstream and a gateway in front of it on a new SQLite store;
/// `extra` as for [`start_gateway`].
pub async fn gateway_on_sqlite(extra: &str) -> (Gateway, Upstream) {
    let (upstream, state) = start_upstream().await;
    (start_gateway(&upstream, &sqlite_store(), extra).await, state)
}

/// Starts a gateway on `toml` and returns why it refused to start.
pub async fn refusal(toml: &str) -> String {
    let config = idem_gateway::Config::from_toml(toml).unwrap_or_else(|e| panic!("{e}\n{toml}"));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let served = tokio::time::timeout(
        Duration::from_secs(10),
        idem_gateway::serve(&config, listener, std::future::ready(())),
    )
    .await
    .expect("the gateway answers at once");
    served.expect_err("the gateway started").to_string()
}

/// Waits until `base` answers `/_idem/healthz` with 200.
pub async fn wait_healthy(base: &str) {
    let client = idem_tls::test_pki::http_client();
    for _ in 0..400 {
        if client
            .get(format!("{base}/_idem/healthz"))
            .send()
            .await
            .is_ok_and(|r| r.status() == 200)
        {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("the gateway at {base} did not become healthy");
}

pub fn sqlite_store() -> String {
    std::env::temp_dir()
        .join(format!("idem-gateway-{}.db", uuid::Uuid::now_v7()))
        .display()
        .to_string()
}

pub fn fresh() -> String {
    uuid::Uuid::now_v7().to_string()
}

/// An answer: status, headers, body.
pub type Answer = (u16, HeaderMap, String);

/// Awaits each task's answer and checks that every one is `status` with
/// the same body: the twins of one key got one answer.
pub async fn one_answer(tasks: Vec<tokio::task::JoinHandle<Answer>>, status: u16) {
    let mut bodies = Vec::new();
    for task in tasks {
        let (got, _, body) = task.await.unwrap();
        assert_eq!(got, status, "{body}");
        bodies.push(body);
    }
    assert!(
        bodies.iter().all(|b| b == &bodies[0]),
        "one answer for every twin: {bodies:?}"
    );
}

/// Sends `POST base+path` with a bearer token, an optional key and a JSON
/// body (and a hop-by-hop header the gateway must drop).
pub async fn send(base: &str, path: &str, token: &str, key: Option<&str>, body: &str) -> Answer {
    send_with(
        base,
        "POST",
        path,
        &[("authorization", &format!("Bearer {token}"))],
        key,
        body,
    )
    .await
}

/// Sends a request with the given headers.
pub async fn send_with(
    base: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    key: Option<&str>,
    body: &str,
) -> Answer {
    let client = idem_tls::test_pki::http_builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap();
    let mut r = client
        .request(method.parse().unwrap(), format!("{base}{path}"))
        .header("content-type", "application/json")
        .header("x-hop", "1")
        .header("connection", "x-hop")
        .body(body.to_owned());
    for (k, v) in headers {
        r = r.header(*k, *v);
    }
    if let Some(k) = key {
        r = r.header("idempotency-key", format!("\"{k}\""));
    }
    let r = r.send().await.unwrap();
    let (status, headers) = (r.status().as_u16(), r.headers().clone());
    (status, headers, r.text().await.unwrap())
}

/// Sends raw bytes on a new connection and reads the answer until the
/// gateway closes the connection.
pub async fn raw(addr: std::net::SocketAddr, request: &[u8]) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    tcp.write_all(request).await.unwrap();
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), tcp.read_to_end(&mut out)).await;
    String::from_utf8_lossy(&out).into_owned()
}

pub fn json(body: &str) -> serde_json::Value {
    serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {body}"))
}
