//! Multi-step operations behind the HTTP contract (`idem_http::steps`): the
//! answers table, the checks before anything is written, a client that goes
//! away, and many clients sending one key.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::routing::post_service;
use bytes::Bytes;
use http::request::Parts;
use idem_core::multistep::{MultiStepState, MultiStepStore};
use idem_core::{BoxFuture, IdempotencyKey, Operation as OpName, Scope, Tenant};
use idem_http::Problem;
use idem_http::steps::{HttpOperation, Steps};
use idem_memory::{MemoryMultiSteps, MemoryStore};
use idem_steps::{Consume, Halt, Operation, Run, StepError, StepsEngine};
use serde_json::{Value, json};
use support::send;

/// What the test operation does at its external step.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Vendor {
    Pays,
    Refuses,
    CannotTell,
    Slow,
}

/// `POST /v1/moves` with `{"amount": n}`: a local debit, a payout through
/// a counted stand-in vendor, then a local settle. A refused payout credits
/// the debit back.
#[derive(Clone)]
struct Move {
    debits: Arc<AtomicU32>,
    credits: Arc<AtomicU32>,
    sends: Arc<AtomicU32>,
    vendor: Vendor,
}

impl Move {
    fn new(vendor: Vendor) -> Self {
        Self {
            debits: Arc::default(),
            credits: Arc::default(),
            sends: Arc::default(),
            vendor,
        }
    }
}

fn counted(tx: &mut idem_memory::MemoryTx, counter: &Arc<AtomicU32>) {
    let counter = counter.clone();
    tx.on_commit(move || {
        counter.fetch_add(1, Ordering::SeqCst);
    });
}

impl Operation<MemoryStore> for Move {
    type Input = i64;
    type Output = Value;
    const NAME: &'static str = "move@1";

    fn run<'r>(&'r self, run: &'r mut Run<'_, MemoryStore>, amount: &'r i64) -> BoxFuture<'r, Result<Value, Halt>> {
        Box::pin(async move {
            let (debits, amount) = (self.debits.clone(), *amount);
            let id: String = run
                .local("debit", move |tx| {
                    let debits = debits.clone();
                    Box::pin(async move {
                        if amount > 1_000 {
                            return Err(StepError::Declared(json!({ "insufficient_funds": amount })));
                        }
                        counted(tx, &debits);
                        Ok(uuid_like(amount))
                    })
                })
                .await?;
            let (sends, vendor) = (self.sends.clone(), self.vendor);
            let paid: String = run
                .external("payout", move |sending| async move {
                    sending.may_send().map_err(StepError::Fatal)?;
                    sends.fetch_add(1, Ordering::SeqCst);
                    match vendor {
                        Vendor::Pays => Ok(format!("po_{}", sending.key.as_str())),
                        Vendor::Slow => {
                            tokio::time::sleep(Duration::from_millis(300)).await;
                            Ok(format!("po_{}", sending.key.as_str()))
                        }
                        Vendor::Refuses => Err(StepError::Declared(json!({ "payout_refused": "closed" }))),
                        Vendor::CannotTell => Err(StepError::Unknown("the answer was lost".into())),
                    }
                })
                .await?;
            Ok(json!({ "id": id, "amount": amount, "payout": paid }))
        })
    }

    fn compensate<'r>(
        &'r self,
        run: &'r mut Run<'_, MemoryStore>,
        _amount: &'r i64,
        _failure: &'r Value,
    ) -> BoxFuture<'r, Result<(), Halt>> {
        Box::pin(async move {
            let credits = self.credits.clone();
            run.local("credit-back", move |tx| {
                let credits = credits.clone();
                Box::pin(async move {
                    counted(tx, &credits);
                    Ok(())
                })
            })
            .await
        })
    }
}

fn uuid_like(amount: i64) -> String {
    format!("mv_{amount}_{}", std::process::id())
}

impl HttpOperation<MemoryStore> for Move {
    fn input(&self, _parts: &Parts, body: &Bytes) -> Result<i64, Problem> {
        let bad = |detail: &str| {
            Problem::new(StatusCode::BAD_REQUEST, "invalid-body", "Invalid body").with_detail(detail.to_owned())
        };
        let value: Value = serde_json::from_slice(body).map_err(|e| bad(&e.to_string()))?;
        match value.get("amount").and_then(Value::as_i64) {
            Some(n) if n > 0 => Ok(n),
            _ => Err(bad("amount must be a positive integer")),
        }
    }

    fn completed(&self, output: &Value) -> http::Response<Bytes> {
        http::Response::builder()
            .status(StatusCode::CREATED)
            .header("content-type", "application/json")
            .body(Bytes::from(output.to_string()))
            .expect("valid response")
    }

    fn failed(&self, failure: &Value) -> http::Response<Bytes> {
        http::Response::builder()
            .status(StatusCode::UNPROCESSABLE_ENTITY)
            .header("content-type", "application/problem+json")
            .body(Bytes::from(
                json!({ "type": "move-declined", "failure": failure }).to_string(),
            ))
            .expect("valid response")
    }
}

/// [`Move`] for a service that records final refusals: its first step's
/// refusal consumes the key ([`Operation::CONSUME`]).
#[derive(Clone)]
struct StrictMove(Move);

impl Operation<MemoryStore> for StrictMove {
    type Input = i64;
    type Output = Value;
    const NAME: &'static str = "strict-move@1";
    const CONSUME: Consume = Consume::SuccessOrFinalRejection;

    fn run<'r>(&'r self, run: &'r mut Run<'_, MemoryStore>, amount: &'r i64) -> BoxFuture<'r, Result<Value, Halt>> {
        self.0.run(run, amount)
    }

    fn compensate<'r>(
        &'r self,
        run: &'r mut Run<'_, MemoryStore>,
        amount: &'r i64,
        failure: &'r Value,
    ) -> BoxFuture<'r, Result<(), Halt>> {
        self.0.compensate(run, amount, failure)
    }
}

impl HttpOperation<MemoryStore> for StrictMove {
    fn input(&self, parts: &Parts, body: &Bytes) -> Result<i64, Problem> {
        self.0.input(parts, body)
    }

    fn completed(&self, output: &Value) -> http::Response<Bytes> {
        self.0.completed(output)
    }

    fn failed(&self, failure: &Value) -> http::Response<Bytes> {
        self.0.failed(failure)
    }
}

struct App {
    router: Router,
    steps: Steps<MemoryStore, MemoryMultiSteps>,
    op: Move,
}

fn app(
    vendor: Vendor,
    configure: impl FnOnce(Steps<MemoryStore, MemoryMultiSteps>) -> Steps<MemoryStore, MemoryMultiSteps>,
) -> App {
    let engine = Arc::new(StepsEngine::new(MemoryStore::new(), MemoryMultiSteps::new()).with_lease_ms(60_000));
    let steps = configure(Steps::new(engine, support::tenant));
    let op = Move::new(vendor);
    let router = Router::new().route("/v1/moves", post_service(steps.service(op.clone())));
    App { router, steps, op }
}

fn request(key: Option<&str>, body: &str) -> Request<Body> {
    let mut req = Request::builder()
        .method("POST")
        .uri("/v1/moves")
        .header("content-type", "application/json");
    if let Some(key) = key {
        req = req.header("idempotency-key", format!("\"{key}\""));
    }
    req.body(Body::from(body.to_owned())).expect("valid request")
}

fn scope() -> Scope {
    Scope::new(
        Tenant::new("t").expect("tenant"),
        OpName::new("POST /v1/moves").expect("operation"),
    )
}

async fn row(app: &App, key: &str) -> Option<idem_core::multistep::MultiStep> {
    let key = IdempotencyKey::new(key).expect("key");
    app.steps.engine().store().find(&scope(), &key).await.expect("find")
}

impl App {
    /// Sends `POST /v1/moves` with `key` and `body`.
    async fn send(&self, key: &str, body: &str) -> (StatusCode, bool, Bytes) {
        send(&self.router, request(Some(key), body)).await
    }
}

fn problem(body: &Bytes) -> Value {
    serde_json::from_slice(body).expect("a JSON problem")
}

/// Whether `body` is a problem whose type ends with `slug`.
fn is_problem(body: &Bytes, slug: &str) -> bool {
    problem(body)["type"].as_str().unwrap_or("").ends_with(slug)
}

#[tokio::test]
async fn completed_once_then_replayed_byte_for_byte() {
    let app = app(Vendor::Pays, |s| s);
    let (status, replayed, first) = app.send("k1", r#"{"amount": 5}"#).await;
    assert_eq!(status, StatusCode::CREATED);
    assert!(!replayed, "the first caller's answer is never marked replayed");
    let (status, replayed, again) = app.send("k1", r#"{ "amount":5 }"#).await;
    assert_eq!((status, replayed), (StatusCode::CREATED, true));
    assert_eq!(first, again, "a replay answers the same bytes");
    assert_eq!(app.op.debits.load(Ordering::SeqCst), 1);
    assert_eq!(app.op.sends.load(Ordering::SeqCst), 1);
    assert_eq!(row(&app, "k1").await.expect("row").state, MultiStepState::Completed);
}

#[tokio::test]
async fn bad_requests_are_refused_before_anything_is_written() {
    let app = app(Vendor::Pays, |s| s.max_request_bytes(64));
    let cases: [(Request<Body>, StatusCode, &str); 4] = [
        (
            request(None, r#"{"amount": 5}"#),
            StatusCode::BAD_REQUEST,
            "idempotency-key-missing",
        ),
        (
            request(Some(""), r#"{"amount": 5}"#),
            StatusCode::BAD_REQUEST,
            "idempotency-key-invalid",
        ),
        (
            request(Some("k2"), r#"{"amount": -5}"#),
            StatusCode::BAD_REQUEST,
            "invalid-body",
        ),
        (
            request(Some("k3"), &format!(r#"{{"amount": 5, "pad": "{}"}}"#, "x".repeat(100))),
            StatusCode::PAYLOAD_TOO_LARGE,
            "request-body-too-large",
        ),
    ];
    for (req, want, slug) in cases {
        let (status, _, body) = send(&app.router, req).await;
        assert_eq!(status, want, "{}", String::from_utf8_lossy(&body));
        assert!(is_problem(&body, slug), "{slug}");
    }
    for key in ["k2", "k3"] {
        assert!(row(&app, key).await.is_none(), "{key}: nothing written");
    }
    assert_eq!(app.op.debits.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn a_key_reused_with_another_body_is_refused() {
    let app = app(Vendor::Pays, |s| s);
    assert_eq!(app.send("k", r#"{"amount": 5}"#).await.0, StatusCode::CREATED);
    let (status, _, body) = app.send("k", r#"{"amount": 6}"#).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    assert!(is_problem(&body, "idempotency-key-reused"));
    assert_eq!(app.op.debits.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_first_step_refusal_leaves_the_key_unused() {
    let app = app(Vendor::Pays, |s| s);
    let (status, replayed, body) = app.send("k", r#"{"amount": 5000}"#).await;
    assert_eq!((status, replayed), (StatusCode::UNPROCESSABLE_ENTITY, false));
    assert_eq!(problem(&body)["failure"]["insufficient_funds"], 5000);
    assert!(row(&app, "k").await.is_none(), "nothing recorded");
    // The key is unused: the same key with a corrected body runs.
    assert_eq!(app.send("k", r#"{"amount": 5}"#).await.0, StatusCode::CREATED);
    assert_eq!(app.op.debits.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_first_step_refusal_is_replayed_when_the_operation_consumes_it() {
    let engine = Arc::new(StepsEngine::new(MemoryStore::new(), MemoryMultiSteps::new()).with_lease_ms(60_000));
    let steps = Steps::new(engine, support::tenant);
    let op = StrictMove(Move::new(Vendor::Pays));
    let router = Router::new().route("/v1/moves", post_service(steps.service(op.clone())));
    let refused = r#"{"amount": 5000}"#;
    let (status, replayed, first) = send(&router, request(Some("k"), refused)).await;
    assert_eq!((status, replayed), (StatusCode::UNPROCESSABLE_ENTITY, false));
    assert_eq!(problem(&first)["failure"]["insufficient_funds"], 5000);
    let (status, replayed, again) = send(&router, request(Some("k"), refused)).await;
    assert_eq!((status, replayed), (StatusCode::UNPROCESSABLE_ENTITY, true));
    assert_eq!(first, again, "the refusal is replayed byte for byte");
    // The key is used: another body under it is refused, and runs nothing.
    let (status, _, body) = send(&router, request(Some("k"), r#"{"amount": 5}"#)).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    assert!(is_problem(&body, "idempotency-key-reused"));
    let key = IdempotencyKey::new("k").expect("key");
    let row = steps.engine().store().find(&scope(), &key).await.expect("find");
    assert_eq!(row.expect("the refusal is recorded").state, MultiStepState::Compensated);
    let counts = [&op.0.debits, &op.0.sends, &op.0.credits].map(|c| c.load(Ordering::SeqCst));
    assert_eq!(counts, [0, 0, 0], "nothing debited, sent or credited");
}

#[tokio::test]
async fn a_declared_failure_is_compensated_once_and_replayed() {
    let app = app(Vendor::Refuses, |s| s);
    let (status, replayed, first) = app.send("k", r#"{"amount": 5}"#).await;
    assert_eq!((status, replayed), (StatusCode::UNPROCESSABLE_ENTITY, false));
    assert_eq!(problem(&first)["failure"]["payout_refused"], "closed");
    let (status, replayed, again) = app.send("k", r#"{"amount": 5}"#).await;
    assert_eq!((status, replayed), (StatusCode::UNPROCESSABLE_ENTITY, true));
    assert_eq!(first, again);
    assert_eq!(app.op.debits.load(Ordering::SeqCst), 1);
    assert_eq!(app.op.credits.load(Ordering::SeqCst), 1, "credited back once");
    assert_eq!(row(&app, "k").await.expect("row").state, MultiStepState::Compensated);
}

#[tokio::test]
async fn an_unknown_outcome_is_held_and_says_where() {
    let app = app(Vendor::CannotTell, |s| s);
    for _ in 0..3 {
        let (status, _, body) = app.send("k", r#"{"amount": 5}"#).await;
        assert_eq!(status, StatusCode::CONFLICT);
        let p = problem(&body);
        assert!(
            p["type"]
                .as_str()
                .unwrap_or("")
                .ends_with("idempotency-outcome-unknown"),
            "{p}"
        );
        assert_eq!(p["step"], "payout");
        assert_eq!(p["hold"], "unknown");
    }
    assert_eq!(
        app.op.sends.load(Ordering::SeqCst),
        1,
        "a held operation sends nothing again"
    );
    assert_eq!(app.op.debits.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_slow_operation_answers_in_flight_and_finishes_anyway() {
    let app = app(Vendor::Slow, |s| s.respond_within(Duration::from_millis(50)));
    let (status, _, body) = app.send("k", r#"{"amount": 5}"#).await;
    assert_eq!(status, StatusCode::CONFLICT);
    assert!(is_problem(&body, "idempotency-key-in-flight"));
    // A retry while it runs is in flight too, and starts nothing.
    assert_eq!(app.send("k", r#"{"amount": 5}"#).await.0, StatusCode::CONFLICT);
    tokio::time::timeout(Duration::from_secs(10), app.steps.detached().idle())
        .await
        .expect("the run ends");
    let (status, replayed, _) = app.send("k", r#"{"amount": 5}"#).await;
    assert_eq!((status, replayed), (StatusCode::CREATED, true));
    assert_eq!(app.op.sends.load(Ordering::SeqCst), 1);
    assert_eq!(app.op.debits.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_client_that_goes_away_does_not_cut_a_step_in_half() {
    let app = app(Vendor::Slow, |s| s);
    let pending = tokio::spawn({
        let router = app.router.clone();
        async move { send(&router, request(Some("k"), r#"{"amount": 5}"#)).await }
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    pending.abort();
    assert!(pending.await.is_err(), "the client went away");
    tokio::time::timeout(Duration::from_secs(10), app.steps.detached().idle())
        .await
        .expect("the run ends");
    assert_eq!(row(&app, "k").await.expect("row").state, MultiStepState::Completed);
    let (status, replayed, _) = app.send("k", r#"{"amount": 5}"#).await;
    assert_eq!((status, replayed), (StatusCode::CREATED, true));
    assert_eq!(app.op.sends.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn many_clients_on_one_key_move_money_once() {
    let app = app(Vendor::Slow, |s| s);
    let barrier = Arc::new(tokio::sync::Barrier::new(32));
    let tasks: Vec<_> = (0..32)
        .map(|_| {
            let (router, barrier) = (app.router.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                send(&router, request(Some("k"), r#"{"amount": 5}"#)).await.0
            })
        })
        .collect();
    let mut created = 0;
    for task in tasks {
        match task.await.expect("task") {
            StatusCode::CREATED => created += 1,
            StatusCode::CONFLICT => {}
            other => panic!("unexpected {other}"),
        }
    }
    assert!(created >= 1, "the run that held the key answered");
    tokio::time::timeout(Duration::from_secs(10), app.steps.detached().idle())
        .await
        .expect("the runs end");
    assert_eq!(app.op.debits.load(Ordering::SeqCst), 1);
    assert_eq!(app.op.sends.load(Ordering::SeqCst), 1);
}
