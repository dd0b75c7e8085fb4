//! Servers the tests call: the fake vendor, and a scripted server that
//! answers exactly what a test asks and records what it was sent.

#![allow(dead_code, unreachable_pub)]

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use idem_core::{IdempotencyKey, OutboundRequest};
use idem_outbound::{BreakerConfig, Jitter, OutboundConfig};
use tokio::sync::Semaphore;

/// A client configuration for tests: short fixed delays, no jitter.
pub fn config(delays_ms: &[u64]) -> OutboundConfig {
    OutboundConfig {
        retry_delays: delays_ms.iter().copied().map(Duration::from_millis).collect(),
        jitter: Jitter::None,
        deadline: Duration::from_secs(20),
        attempt_timeout: Duration::from_secs(5),
        breaker: BreakerConfig {
            failure_threshold: 50,
            ..BreakerConfig::default()
        },
        ..OutboundConfig::default()
    }
}

pub fn key(k: &str) -> IdempotencyKey {
    IdempotencyKey::new(k).unwrap()
}

pub fn payout(base: &str, body: &str) -> OutboundRequest {
    OutboundRequest::new(
        "POST",
        format!("{base}/v1/payouts"),
        vec![("content-type".into(), "application/json".into())],
        body.as_bytes().to_vec(),
    )
    .unwrap()
}

/// A free loopback address.
pub fn free_addr() -> SocketAddr {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    ([127, 0, 0, 1], port).into()
}

/// Starts the fake vendor on loopback.
pub async fn vendor() -> (String, Arc<fake_vendor::Vendor>) {
    vendor_with(fake_vendor::Options::default()).await
}

/// Starts the fake vendor on loopback, treating keys by `options`.
pub async fn vendor_with(options: fake_vendor::Options) -> (String, Arc<fake_vendor::Vendor>) {
    fake_vendor::start(options, None).await.unwrap()
}

pub async fn set_faults(base: &str, faults: serde_json::Value) {
    let r = idem_tls::test_pki::http_client()
        .put(format!("{base}/_faults"))
        .json(&faults)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 204);
}

pub async fn get_json(url: String) -> serde_json::Value {
    idem_tls::test_pki::http_client()
        .get(url)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

/// The vendor's ledger: payouts made and the keys that paid.
pub async fn ledger(base: &str) -> (u64, Vec<String>) {
    let l = get_json(format!("{base}/v1/ledger")).await;
    let keys = l["keys"]
        .as_array()
        .unwrap()
        .iter()
        .map(|k| k.as_str().unwrap().to_owned())
        .collect();
    (l["payouts"].as_u64().unwrap(), keys)
}

pub async fn stats(base: &str) -> serde_json::Value {
    get_json(format!("{base}/_stats")).await
}

/// One scripted answer.
#[derive(Debug, Clone)]
pub struct Answer {
    pub status: u16,
    pub headers: Vec<(&'static str, String)>,
    pub body: String,
    /// Wait for [`Scripted::release`] before answering.
    pub held: bool,
}

impl Answer {
    pub fn status(status: u16) -> Self {
        Self {
            status,
            headers: Vec::new(),
            body: format!("{{\"status\":{status}}}"),
            held: false,
        }
    }

    pub fn header(mut self, name: &'static str, value: impl Into<String>) -> Self {
        self.headers.push((name, value.into()));
        self
    }

    pub fn body(mut self, body: impl Into<String>) -> Self {
        self.body = body.into();
        self
    }

    pub fn held(mut self) -> Self {
        self.held = true;
        self
    }
}

/// A server answering from a script (the last answer repeats), recording
/// each request's headers.
#[derive(Clone)]
pub struct Scripted {
    pub base: String,
    state: Arc<ScriptState>,
}

struct ScriptState {
    answers: Mutex<VecDeque<Answer>>,
    last: Mutex<Answer>,
    seen: Mutex<Vec<HeaderMap>>,
    gate: Semaphore,
}

async fn scripted(State(s): State<Arc<ScriptState>>, headers: HeaderMap) -> Response {
    s.seen.lock().unwrap().push(headers);
    let answer = {
        let mut answers = s.answers.lock().unwrap();
        match answers.pop_front() {
            Some(a) => {
                *s.last.lock().unwrap() = a.clone();
                a
            }
            None => s.last.lock().unwrap().clone(),
        }
    };
    if answer.held {
        s.gate.acquire().await.unwrap().forget();
    }
    let mut response = (StatusCode::from_u16(answer.status).unwrap(), answer.body).into_response();
    for (name, value) in answer.headers {
        response.headers_mut().append(name, value.parse().unwrap());
    }
    response
}

impl Scripted {
    pub async fn start(script: Vec<Answer>) -> Self {
        let state = Arc::new(ScriptState {
            last: Mutex::new(script.last().cloned().unwrap_or(Answer::status(200))),
            answers: Mutex::new(script.into()),
            seen: Mutex::new(Vec::new()),
            gate: Semaphore::new(0),
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let app = axum::Router::new().fallback(scripted).with_state(state.clone());
        tokio::spawn(async move { axum::serve(listener, app).await });
        Self { base, state }
    }

    /// Replaces what is left of the script.
    pub fn script(&self, script: Vec<Answer>) {
        if let Some(last) = script.last() {
            *self.state.last.lock().unwrap() = last.clone();
        }
        *self.state.answers.lock().unwrap() = script.into();
    }

    /// Lets `n` held answers go.
    pub fn release(&self, n: usize) {
        self.state.gate.add_permits(n);
    }

    /// Requests received.
    pub fn count(&self) -> usize {
        self.state.seen.lock().unwrap().len()
    }

    /// The values of `header` in each request received.
    pub fn header_values(&self, header: &str) -> Vec<Vec<String>> {
        self.state
            .seen
            .lock()
            .unwrap()
            .iter()
            .map(|h| {
                h.get_all(header)
                    .iter()
                    .map(|v| v.to_str().unwrap().to_owned())
                    .collect()
            })
            .collect()
    }

    pub fn request(&self, path: &str) -> OutboundRequest {
        OutboundRequest::new("POST", format!("{}{path}", self.base), vec![], b"{}".to_vec()).unwrap()
    }

    /// Waits until `n` requests have arrived.
    pub async fn wait_for(&self, n: usize) {
        for _ in 0..500 {
            if self.count() >= n {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("{} requests arrived, not {n}", self.count());
    }
}

/// A reconcile hook for the fake vendor: a lookup by the request's
/// `reference`, counted.
pub struct Lookup {
    pub base: String,
    pub asked: std::sync::atomic::AtomicUsize,
}

impl Lookup {
    pub fn new(base: &str) -> Arc<Self> {
        Arc::new(Self {
            base: base.to_owned(),
            asked: std::sync::atomic::AtomicUsize::new(0),
        })
    }

    pub fn asked(&self) -> usize {
        self.asked.load(std::sync::atomic::Ordering::SeqCst)
    }
}

impl idem_outbound::Reconcile for Lookup {
    fn reconcile<'a>(
        &'a self,
        _key: &'a IdempotencyKey,
        request: &'a OutboundRequest,
        timeout: Duration,
    ) -> idem_core::BoxFuture<'a, Result<idem_outbound::Reconciled, String>> {
        Box::pin(async move {
            self.asked.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let body: serde_json::Value = serde_json::from_slice(request.body()).map_err(|e| e.to_string())?;
            let reference = body["reference"].as_str().ok_or("no reference")?;
            let found: serde_json::Value = idem_tls::test_pki::http_client()
                .get(format!("{}/v1/payouts?reference={reference}", self.base))
                .timeout(timeout)
                .send()
                .await
                .map_err(|e| e.to_string())?
                .json()
                .await
                .map_err(|e| e.to_string())?;
            let data = found["data"].as_array().cloned().unwrap_or_default();
            let paid: Vec<_> = data.iter().filter(|p| p["status"] == "paid").collect();
            Ok(match (paid.as_slice(), data.len()) {
                ([one], _) => idem_outbound::Reconciled::Applied {
                    status: 201,
                    body: serde_json::to_vec(one).unwrap(),
                },
                ([], 0) => idem_outbound::Reconciled::NotApplied,
                ([], _) => idem_outbound::Reconciled::InFlight,
                (many, _) => idem_outbound::Reconciled::Unknown(format!("paid {} times", many.len())),
            })
        })
    }
}
