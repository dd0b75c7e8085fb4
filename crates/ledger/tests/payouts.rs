//! Payouts on every engine: `POST /v1/payouts` debits at once (422 and the
//! key unused when funds are short), and the payout worker pays each payout
//! at the fake vendor exactly once — through 500s, dropped answers and
//! several workers at once — or dead-letters it, and a redrive with the
//! original key settles it without a second payment.

mod common;
mod vendor;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use fake_vendor::Faults;
use idem_core::{DeadLetterFilter, DeadLetterState, DeadLetterStore};
use ledger::payouts::{PassReport, PayoutConfig};
use vendor::FakeVendor;

/// Moves `amount` (as written in the JSON) from `from` to `to`, with a new
/// key.
async fn transfer(l: &Ledger, t: &str, from: &str, to: &str, amount: &str) -> Resp {
    let body = format!(r#"{{"from":"{from}","to":"{to}","amount":{amount}}}"#);
    l.post("/v1/transfers", t, Some(&key()), &body).await
}

/// Requests a payout of `amount` from `account`: its id.
async fn payout_id(l: &Ledger, t: &str, account: &str, amount: i64) -> String {
    l.payout(t, account, amount).await.json()["id"]
        .as_str()
        .unwrap()
        .to_owned()
}

/// The fake vendor, a ledger on `engine` (see [`start`]) and a new
/// tenant's account "a" topped up with `amount`.
async fn vendor_and_funded(engine: Engine, amount: i64) -> (FakeVendor, Ledger, String, String) {
    let vendor = FakeVendor::start().await;
    let l = start(engine).await;
    let (t, a) = l.funded(amount).await;
    (vendor, l, t, a)
}

/// Checks the tenant's books still balance, and stops the ledger.
async fn stop_conserved(l: Ledger, t: &str) {
    assert_eq!(l.audit(t).await["conserved"], true);
    l.stop().await;
}

/// The tenant's dead letters.
fn tenant_letters(t: &str) -> DeadLetterFilter {
    DeadLetterFilter {
        tenant: Some(ledger::tenant_for_token(t).as_str().to_owned()),
        ..Default::default()
    }
}

/// The scope of the tenant's payouts (of their dead letters).
fn payout_scope(t: &str) -> idem_core::Scope {
    idem_core::Scope::parse(ledger::tenant_for_token(t).as_str(), ledger::payouts::PAYOUT_OPERATION).unwrap()
}

async fn a_payout_debits_at_once(engine: Engine, transport: Transport) {
    let l = Ledger::start(engine, transport).await;
    let (t, a) = l.funded(1_000).await;
    let k = key();
    let first = l.post("/v1/payouts", &t, Some(&k), &payout_body(&a, 300)).await;
    assert_eq!(first.status, 201, "{}", String::from_utf8_lossy(&first.body));
    let v = first.json();
    assert_eq!(v["balance"], 700);
    assert_eq!(v["status"], "requested");
    let id = v["id"].as_str().unwrap().to_owned();
    // A retry replays; nothing is debited twice.
    let again = l.post("/v1/payouts", &t, Some(&k), &payout_body(&a, 300)).await;
    assert!(again.replayed());
    assert_eq!(again.body, first.body);
    assert_eq!(l.balance(&t, &a).await, 700);
    let got = l.get(&format!("/v1/payouts/{id}"), &t).await;
    assert_eq!(got.status, 200);
    assert_eq!(got.json()["status"], "requested");
    assert_eq!(got.json()["amount"], 300);
    assert_eq!(got.json()["account_id"], a.as_str());
    // Another tenant sees nothing.
    l.assert_not_found("/v1/payouts", &id, &t, &token(), "payout-not-found")
        .await;
    let audit = l.audit(&t).await;
    assert_eq!(audit["payouts_total"], 300);
    assert_eq!(audit["balances_total"], 700);
    assert_eq!(audit["conserved"], true);
    l.stop().await;
}

async fn refused_payouts_write_nothing(engine: Engine, transport: Transport) {
    let l = Ledger::start(engine, transport).await;
    let (t, a) = l.funded(100).await;
    let k = key();
    l.post("/v1/payouts", &t, Some(&k), &payout_body(&a, 101))
        .await
        .assert_problem(422, "insufficient-funds");
    for bad in [
        payout_body(&a, 0),
        payout_body(&a, -5),
        payout_body(&a, 1_000_000_000_001),
        r#"{"account_id":"x","amount":5}"#.to_owned(),
        format!(r#"{{"account_id":"{a}","amount":5,"extra":1}}"#),
        format!(r#"{{"account_id":"{a}","amount":5.5}}"#),
        format!(r#"{{"account_id":"{a}","amount":4.9999999999999999999}}"#),
        format!(r#"{{"account_id":"{a}","amount":5.000000000000000000001}}"#),
        format!(r#"{{"account_id":"{a}","amount":99.99999999999999999}}"#),
        format!(r#"{{"account_id":"{a}","amount":999999999999.99999}}"#),
        format!(r#"{{"account_id":"{a}"}}"#),
    ] {
        let r = l.post("/v1/payouts", &t, Some(&key()), &bad).await;
        assert_eq!(r.status, 400, "{bad}: {}", String::from_utf8_lossy(&r.body));
    }
    l.post("/v1/payouts", &t, None, &payout_body(&a, 5))
        .await
        .assert_problem(400, "idempotency-key-missing");
    // Every route reads amounts exactly: a fraction a float would round to a
    // whole number is refused, never credited or moved.
    let b = l.account(&t, "b").await;
    for amount in ["4.9999999999999999999", "5.000000000000000000001", "999999999999.99999"] {
        let top_up = format!(r#"{{"account_id":"{a}","amount":{amount}}}"#);
        l.post("/v1/top-ups", &t, Some(&key()), &top_up)
            .await
            .assert_problem(400, "invalid-request");
        transfer(&l, &t, &a, &b, amount)
            .await
            .assert_problem(400, "invalid-request");
    }
    for amount in ["5.0", "5e0", "50e-1"] {
        let r = transfer(&l, &t, &a, &b, amount).await;
        assert_eq!(r.status, 201, "{amount}: {}", String::from_utf8_lossy(&r.body));
        assert_eq!(r.json()["amount"], 5);
    }
    let r = transfer(&l, &t, &b, &a, "15").await;
    assert_eq!(r.status, 201);
    l.post(
        "/v1/payouts",
        &t,
        Some(&key()),
        &payout_body("0193a2b4-0000-7000-8000-000000000000", 5),
    )
    .await
    .assert_problem(404, "account-not-found");
    let audit = l.audit(&t).await;
    assert_eq!(audit["payouts_total"], 0);
    assert_eq!(l.balance(&t, &a).await, 100);
    // The refused key was left unused: topped up, the same key pays out.
    assert_eq!(l.top_up(&t, &a, 1).await.status, 201);
    let r = l.post("/v1/payouts", &t, Some(&k), &payout_body(&a, 101)).await;
    assert_eq!(r.status, 201, "{}", String::from_utf8_lossy(&r.body));
    assert!(!r.replayed());
    assert_eq!(l.balance(&t, &a).await, 0);
    l.stop().await;
}

matrix!(a_payout_debits_at_once, refused_payouts_write_nothing);

/// Quick retries for tests: 20, 40, 80 ms, then a dead letter.
fn fast_config() -> idem_outbound::OutboundConfig {
    idem_outbound::OutboundConfig {
        retry_delays: vec![
            Duration::from_millis(20),
            Duration::from_millis(40),
            Duration::from_millis(80),
        ],
        deadline: Duration::from_secs(20),
        attempt_timeout: Duration::from_secs(5),
        ..Default::default()
    }
}

/// A client of [`fast_config`].
fn fast_client() -> idem_outbound::OutboundClient {
    idem_outbound::OutboundClient::new(fast_config()).expect("a valid configuration")
}

/// [`fast_client`] whose breaker never opens: for tests that need every
/// call to really fail (an open breaker defers payouts instead).
fn unguarded_client() -> idem_outbound::OutboundClient {
    let config = idem_outbound::OutboundConfig {
        breaker: idem_outbound::BreakerConfig {
            failure_threshold: 1_000_000,
            ..Default::default()
        },
        ..fast_config()
    };
    idem_outbound::OutboundClient::new(config).expect("a valid configuration")
}

/// Payouts paid at `url`.
fn config_at(url: &str) -> PayoutConfig {
    PayoutConfig::new(url, ledger::events::Namespace::default())
}

fn config(vendor: &FakeVendor) -> PayoutConfig {
    config_at(&vendor.url)
}

async fn pass(l: &Ledger, vendor: &FakeVendor) -> PassReport {
    ledger::payouts::pass(&l.store, l.clock.clone(), fast_client(), config(vendor))
        .await
        .expect("a payout pass")
}

/// The dead letter of the tenant's payout `id`.
async fn dead_letter(letters: &ledger::DeadLetters, t: &str, id: &str) -> idem_core::DeadLetter {
    letters
        .find(&payout_scope(t), &idem_core::IdempotencyKey::new(id).unwrap())
        .await
        .unwrap()
        .expect("its dead letter")
}

/// An operator's verdict on a dead letter.
fn operator_says(verdict: idem_core::Verdict, status: Option<u16>, body: Vec<u8>, note: &str) -> idem_core::Settlement {
    idem_core::Settlement {
        verdict,
        by: idem_core::VerdictSource::Operator,
        status,
        body,
        note: note.into(),
    }
}

/// An operator settles the dead letter `id` with `settlement`, which it
/// takes.
async fn operator_settles(letters: &ledger::DeadLetters, id: i64, settlement: idem_core::Settlement) {
    assert!(
        letters.settle(id, &settlement).await.unwrap(),
        "the letter takes the operator's verdict: {settlement:?}"
    );
}

/// An operator's verdict that the payout was not applied.
fn operator_says_not_applied(note: &str) -> idem_core::Settlement {
    operator_says(idem_core::Verdict::NotApplied, None, vec![], note)
}

/// A URL nothing listens at.
fn nowhere_url() -> String {
    format!("http://127.0.0.1:{}", {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    })
}

/// Asserts a redrive settled its dead letter.
fn assert_resolved(result: &idem_outbound::RedriveResult) {
    assert!(
        matches!(result, idem_outbound::RedriveResult::Resolved { .. }),
        "{result:?}"
    );
}

async fn status(l: &Ledger, t: &str, id: &str) -> serde_json::Value {
    let r = l.get(&format!("/v1/payouts/{id}"), t).await;
    assert_eq!(r.status, 200);
    r.json()
}

/// A database of the test's own: a worker pays every requested payout in
/// its database, so workers of tests running at once must not share one.
async fn own_database(engine: Engine) -> String {
    common::own_database(engine, "ledger_payouts").await
}

async fn start(engine: Engine) -> Ledger {
    Ledger::start_with(
        &own_database(engine).await,
        Transport::InProcess,
        Arc::new(idem_core::SystemClock),
        ledger::Options::default(),
    )
    .await
}

async fn the_worker_pays_once_through_faults(engine: Engine) {
    let (vendor, l, t, a) = vendor_and_funded(engine, 10_000).await;

    // Every new payment's answer is lost after the vendor applied it: the
    // retry, with the same key, gets the vendor's recorded answer.
    vendor.fault(|f| f.apply_then_drop = 1.0).await;
    let dropped = payout_id(&l, &t, &a, 100).await;
    let report = pass(&l, &vendor).await;
    assert_eq!(report.paid, 1, "{report:?}");
    let settled = status(&l, &t, &dropped).await;
    assert_eq!(settled["status"], "paid");
    assert_eq!(settled["attempts"], 2);
    assert_eq!(vendor.stats().await["dropped"], 1);

    // The vendor fails every call: dead-lettered after four attempts, the
    // debit stands and conservation holds.
    vendor.fault(|f| f.error_500 = 1.0).await;
    let p = payout_id(&l, &t, &a, 250).await;
    let report = pass(&l, &vendor).await;
    assert_eq!(report.dead_lettered, 1, "{report:?}");
    let dead = status(&l, &t, &p).await;
    assert_eq!(dead["status"], "dead_lettered");
    assert!(dead["last_error"].as_str().unwrap().contains("500"), "{dead}");
    assert_eq!(l.audit(&t).await["conserved"], true);
    assert_eq!(l.balance(&t, &a).await, 10_000 - 100 - 250);
    let letters = l.store.dead_letters();
    let tenant = ledger::tenant_for_token(&t).as_str().to_owned();
    let listed = letters
        .list(&DeadLetterFilter {
            tenant: Some(tenant.clone()),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].key.as_str(), p);
    assert_eq!(listed[0].attempts, 4);
    assert_eq!(listed[0].scope.operation().as_str(), ledger::payouts::PAYOUT_OPERATION);
    // A pass while it is dead changes nothing.
    assert_eq!(pass(&l, &vendor).await, PassReport::default());

    // Redriven with the original key once the vendor answers again.
    vendor.faults(&Faults::default()).await;
    let redriver = idem_outbound::Redriver::new(fast_client(), letters.clone());
    let redriven = redriver.redrive_one(listed[0].id).await.unwrap();
    assert_resolved(&redriven);
    assert_eq!(
        letters.get(listed[0].id).await.unwrap().unwrap().state,
        DeadLetterState::Resolved
    );
    let report = pass(&l, &vendor).await;
    assert_eq!(report.reconciled, 1, "{report:?}");
    let settled = status(&l, &t, &p).await;
    assert_eq!(settled["status"], "paid");
    assert!(settled["vendor_payout_id"].as_str().unwrap().starts_with("po_"));
    let paid = vendor.payouts().await;
    assert_eq!(paid["payouts"], 2, "{paid}");
    assert_eq!(paid["total"], 350);
    assert_eq!(pass(&l, &vendor).await, PassReport::default());
    stop_conserved(l, &t).await;
}

/// The vendor applied the payout, but every answer was lost and the payout
/// was dead-lettered: the redrive, with the same key, gets the vendor's
/// recorded answer and the vendor pays nothing more.
async fn a_payout_applied_then_dead_lettered_is_redriven_without_paying_twice(engine: Engine) {
    let (vendor, l, t, a) = vendor_and_funded(engine, 1_000).await;
    vendor.fault(|f| f.apply_then_drop = 1.0).await;
    let p = payout_id(&l, &t, &a, 400).await;
    let slow_retries = || {
        idem_outbound::OutboundClient::new(idem_outbound::OutboundConfig {
            retry_delays: vec![Duration::from_millis(700); 3],
            deadline: Duration::from_secs(30),
            attempt_timeout: Duration::from_secs(5),
            ..Default::default()
        })
        .unwrap()
    };
    let worker = {
        let (store, clock, config) = (l.store.clone(), l.clock.clone(), config(&vendor));
        let client = slow_retries();
        tokio::spawn(async move { ledger::payouts::pass(&store, clock, client, config).await })
    };
    // Once the first answer is lost, the vendor refuses connections for
    // longer than the retries last.
    let dropped_by = tokio::time::Instant::now() + Duration::from_secs(30);
    while vendor.stats().await["dropped"] != 1 {
        assert!(tokio::time::Instant::now() < dropped_by, "the vendor dropped an answer");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    vendor.fault(|f| f.refuse_ms = 4_000).await;
    let report = worker.await.unwrap().unwrap();
    assert_eq!(report.dead_lettered, 1, "{report:?}");
    assert_eq!(status(&l, &t, &p).await["status"], "dead_lettered");
    // The vendor is back after its refusal.
    let back = tokio::time::Instant::now() + Duration::from_secs(30);
    while idem_tls::test_pki::get(format!("{}/_stats", vendor.url)).await.is_err() {
        assert!(
            tokio::time::Instant::now() < back,
            "the vendor accepts connections again"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(vendor.payouts().await["payouts"], 1, "the vendor did pay");
    // The vendor is back: the redrive replays its answer.
    let letters = l.store.dead_letters();
    // The letter keeps the terms the worker sent under, for a redrive run
    // elsewhere (`idem dlq redrive`) to keep to.
    let kept = letters.list(&tenant_letters(&t)).await.unwrap();
    assert_eq!(
        kept[0].sent_under,
        Some(idem_core::SentUnder {
            key_horizon: Duration::from_secs(86_400),
            horizon_margin: Duration::from_secs(3_600),
            settle: Duration::from_secs(10),
        }),
        "{kept:?}"
    );
    let redriver = idem_outbound::Redriver::new(slow_retries(), letters.clone());
    let report = redriver
        .redrive(&tenant_letters(&t), idem_outbound::RedriveOptions::default())
        .await
        .unwrap();
    assert_eq!(report.resolved, 1, "{report:?}");
    assert_eq!(pass(&l, &vendor).await.reconciled, 1);
    assert_eq!(status(&l, &t, &p).await["status"], "paid");
    let paid = vendor.payouts().await;
    assert_eq!(paid["payouts"], 1, "paid once: {paid}");
    assert_eq!(vendor.stats().await["replayed"], 1);
    stop_conserved(l, &t).await;
}

async fn many_workers_pay_each_payout_once(engine: Engine) {
    let vendor = FakeVendor::start().await;
    vendor
        .fault(|f| {
            f.apply_then_drop = 0.2;
            f.error_500 = 0.2;
        })
        .await;
    let l = start(engine).await;
    let (t, a) = l.funded(1_000_000).await;
    let mut ids = Vec::new();
    for i in 0..40 {
        let r = l.payout(&t, &a, 100 + i).await;
        assert_eq!(r.status, 201);
        ids.push(r.json()["id"].as_str().unwrap().to_owned());
    }
    // Four workers on the same payouts at once, two passes each.
    let workers: Vec<_> = (0..4)
        .map(|_| {
            let (store, clock, url) = (l.store.clone(), l.clock.clone(), vendor.url.clone());
            tokio::spawn(async move {
                let mut total = PassReport::default();
                for _ in 0..2 {
                    let config = config_at(&url);
                    // No breaker: an open one would defer a payout (rightly),
                    // and this test counts settlements.
                    let r = ledger::payouts::pass(&store, clock.clone(), unguarded_client(), config)
                        .await
                        .unwrap();
                    total.paid += r.paid;
                    total.dead_lettered += r.dead_lettered;
                }
                total
            })
        })
        .collect();
    let mut settled = 0;
    for w in workers {
        let r = w.await.unwrap();
        settled += r.paid + r.dead_lettered;
    }
    assert_eq!(settled, 40, "each payout settled by exactly one worker");
    let mut paid = 0;
    for id in &ids {
        match status(&l, &t, id).await["status"].as_str().unwrap() {
            "paid" => paid += 1,
            "dead_lettered" => {}
            other => panic!("payout {id} still {other}"),
        }
    }
    let at_vendor = vendor.payouts().await;
    let keys: std::collections::HashSet<String> = serde_json::from_value(at_vendor["keys"].clone()).unwrap();
    assert_eq!(
        at_vendor["payouts"].as_u64().unwrap() as usize,
        keys.len(),
        "no key paid twice"
    );
    for id in &ids {
        let state = status(&l, &t, id).await["status"].as_str().unwrap().to_owned();
        if state == "paid" {
            assert!(keys.contains(id), "a paid payout the vendor never paid: {id}");
        }
    }
    assert!(keys.iter().all(|k| ids.contains(k)));
    assert!(paid > 0);
    stop_conserved(l, &t).await;
}

/// A redriven payout is reconciled however many older dead-lettered payouts
/// are still dead: the first hundred never being redriven does not hide the
/// hundred-and-first.
async fn a_redriven_payout_behind_a_hundred_dead_ones_is_reconciled(engine: Engine) {
    let vendor = FakeVendor::start().await;
    vendor.fault(|f| f.error_500 = 1.0).await;
    let l = start(engine).await;
    let (t, a) = l.funded(1_000_000).await;
    for _ in 0..100 {
        assert_eq!(l.payout(&t, &a, 10).await.status, 201);
    }
    // Requested strictly later than the hundred before it.
    tokio::time::sleep(Duration::from_millis(20)).await;
    let last = payout_id(&l, &t, &a, 10).await;
    let once = || {
        idem_outbound::OutboundClient::new(idem_outbound::OutboundConfig {
            retry_delays: vec![],
            deadline: Duration::from_secs(20),
            attempt_timeout: Duration::from_secs(5),
            // Every payout really fails (an open breaker would defer them).
            breaker: idem_outbound::BreakerConfig {
                failure_threshold: 1_000_000,
                ..Default::default()
            },
            ..Default::default()
        })
        .unwrap()
    };
    let mut dead = 0;
    for _ in 0..3 {
        let r = pass_with(&l, once(), config(&vendor)).await;
        dead += r.dead_lettered;
    }
    assert_eq!(dead, 101);
    assert_eq!(status(&l, &t, &last).await["status"], "dead_lettered");
    // Only the newest one is redriven.
    vendor.faults(&Faults::default()).await;
    let letters = l.store.dead_letters();
    let letter = dead_letter(&letters, &t, &last).await;
    let redriver = idem_outbound::Redriver::new(fast_client(), letters.clone());
    let redriven = redriver.redrive_one(letter.id).await.unwrap();
    assert_resolved(&redriven);
    let report = pass(&l, &vendor).await;
    assert_eq!(report.reconciled, 1, "{report:?}");
    assert_eq!(status(&l, &t, &last).await["status"], "paid");
    assert_eq!(vendor.payouts().await["payouts"], 1);
    stop_conserved(l, &t).await;
}

/// Serves `app` on a loopback port: its URL.
async fn serve(app: axum::Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    url
}

/// A vendor that answers each call with `answer(request body, call
/// number)`: a status and a body.
async fn vendor_answering<F>(answer: F) -> String
where
    F: Fn(&serde_json::Value, usize) -> (u16, String) + Clone + Send + Sync + 'static,
{
    let calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let app = axum::Router::new().route(
        "/v1/payouts",
        axum::routing::post(move |body: axum::body::Bytes| {
            let (answer, calls) = (answer.clone(), calls.clone());
            async move {
                let v: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
                let (status, body) = answer(&v, calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst));
                (
                    axum::http::StatusCode::from_u16(status).unwrap(),
                    [("content-type", "application/json")],
                    body,
                )
            }
        }),
    );
    serve(app).await
}

/// The vendor's promised answer to `request`, with `id`.
fn promised(request: &serde_json::Value, id: &str) -> String {
    serde_json::json!({ "id": id, "amount": request["amount"], "reference": request["reference"] }).to_string()
}

/// A vendor id the database cannot store (a NUL) does not keep a paid
/// payout requested, called again on every pass: it is paid, without the id.
async fn a_vendor_id_with_a_nul_does_not_keep_a_payout_requested(engine: Engine) {
    let url = vendor_answering(|r, _| (201, promised(r, "po_\u{0}x"))).await;
    let l = start(engine).await;
    let (t, a) = l.funded(1_000).await;
    let p = payout_id(&l, &t, &a, 10).await;
    let config = config_at(&url);
    let report = pass_with(&l, fast_client(), config).await;
    assert_eq!(report.paid, 1, "{report:?}");
    let paid = status(&l, &t, &p).await;
    assert_eq!(paid["status"], "paid");
    assert!(paid["vendor_payout_id"].is_null(), "{paid}");
    l.stop().await;
}

/// A vendor that holds every call for an amount of 999 until told to
/// answer, and answers the others at once; it says when a held call came in.
async fn vendor_holding_999() -> (String, Arc<tokio::sync::Notify>, Arc<tokio::sync::Notify>) {
    let (arrived, release) = (
        Arc::new(tokio::sync::Notify::new()),
        Arc::new(tokio::sync::Notify::new()),
    );
    let (a, r) = (arrived.clone(), release.clone());
    let app = axum::Router::new().route(
        "/v1/payouts",
        axum::routing::post(move |body: axum::body::Bytes| {
            let (arrived, release) = (a.clone(), r.clone());
            async move {
                let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
                if v["amount"] == 999 {
                    arrived.notify_one();
                    release.notified().await;
                }
                (
                    axum::http::StatusCode::CREATED,
                    [("content-type", "application/json")],
                    promised(&v, &format!("po_{}", v["reference"].as_str().unwrap_or("x"))),
                )
            }
        }),
    );
    (serve(app).await, arrived, release)
}

/// The running worker refills a slot as soon as its payout settles: payouts
/// requested while a slow vendor call is in flight are paid meanwhile.
async fn a_slow_vendor_call_holds_only_its_own_slot(engine: Engine) {
    let (url, arrived, release) = vendor_holding_999().await;
    let l = start(engine).await;
    let (t, a) = l.funded(100_000).await;
    let slow = payout_id(&l, &t, &a, 999).await;
    let mut config = config_at(&url);
    config.concurrency = 2;
    config.poll = Duration::from_millis(20);
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let worker = {
        let (store, clock) = (l.store.clone(), l.clock.clone());
        // The held call never times out while the test holds it.
        let patient = idem_outbound::OutboundClient::new(idem_outbound::OutboundConfig {
            attempt_timeout: Duration::from_secs(300),
            deadline: Duration::from_secs(300),
            ..Default::default()
        })
        .unwrap();
        tokio::spawn(async move { ledger::payouts::run(&store, clock, patient, config, stopped).await })
    };
    arrived.notified().await;
    let mut later = Vec::new();
    for amount in [1, 2, 3] {
        later.push(l.payout(&t, &a, amount).await.json()["id"].as_str().unwrap().to_owned());
    }
    let by = tokio::time::Instant::now() + Duration::from_secs(30);
    for id in &later {
        while status(&l, &t, id).await["status"] != "paid" {
            assert!(
                tokio::time::Instant::now() < by,
                "a payout requested during a slow call waited for it"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    assert_eq!(
        status(&l, &t, &slow).await["status"],
        "requested",
        "still at the vendor"
    );
    release.notify_one();
    let by = tokio::time::Instant::now() + Duration::from_secs(30);
    while status(&l, &t, &slow).await["status"] != "paid" {
        assert!(
            tokio::time::Instant::now() < by,
            "the slow payout is paid once answered"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let _ = stop.send(true);
    worker.await.unwrap();
    stop_conserved(l, &t).await;
}

const HOUR: Duration = Duration::from_secs(3600);

/// A ledger on a clock the test moves (the worker's and the redrive's).
async fn start_on(engine: Engine, clock: &idem_core::ManualClock) -> Ledger {
    Ledger::start_with(
        &own_database(engine).await,
        Transport::InProcess,
        Arc::new(clock.clone()),
        ledger::Options::default(),
    )
    .await
}

/// A vendor that forgets its keys after an hour.
fn horizon_vendor() -> fake_vendor::Options {
    fake_vendor::Options {
        key_horizon: HOUR,
        ..Default::default()
    }
}

/// The fake vendor with `options`, a ledger on `engine` on a clock the test
/// moves (see [`start_on`]), and a new tenant's account "a" topped up with
/// 1 000.
async fn vendor_and_funded_on_clock(
    engine: Engine,
    options: fake_vendor::Options,
) -> (FakeVendor, idem_core::ManualClock, Ledger, String, String) {
    let vendor = FakeVendor::start_with(options).await;
    let clock = idem_core::ManualClock::starting_now();
    let l = start_on(engine, &clock).await;
    let (t, a) = l.funded(1_000).await;
    (vendor, clock, l, t, a)
}

/// A client that trusts the vendor's keys for an hour less a minute.
fn hour_client(retries: &[u64]) -> idem_outbound::OutboundClient {
    idem_outbound::OutboundClient::new(idem_outbound::OutboundConfig {
        retry_delays: retries.iter().map(|&ms| Duration::from_millis(ms)).collect(),
        deadline: Duration::from_secs(20),
        attempt_timeout: Duration::from_secs(5),
        key_horizon: idem_outbound::KeyHorizon::new(HOUR, Duration::from_secs(60)),
        ..Default::default()
    })
    .unwrap()
}

/// Moves the ledger's clock and the vendor's together.
fn advance(clock: &idem_core::ManualClock, vendor: &FakeVendor, by: Duration) {
    use idem_core::Clock as _;
    let _ = clock.now_ms();
    clock.advance(by);
    vendor.vendor.advance(by);
}

async fn pass_with(l: &Ledger, client: idem_outbound::OutboundClient, config: PayoutConfig) -> PassReport {
    ledger::payouts::pass(&l.store, l.clock.clone(), client, config)
        .await
        .unwrap()
}

/// A payout the vendor paid whose every answer was lost, dead-lettered, then redriven past the vendor's one-hour key horizon: pays once. Without a way to ask the vendor (`idem dlq redrive`) nothing is sent and it is held as unknown; with the ledger's lookup it is found paid.
async fn a_redrive_past_the_vendors_horizon_pays_once(engine: Engine) {
    let (vendor, clock, l, t, a) = vendor_and_funded_on_clock(engine, horizon_vendor()).await;
    vendor.fault(|f| f.apply_then_drop = 1.0).await;
    let p = payout_id(&l, &t, &a, 400).await;
    let report = pass_with(&l, hour_client(&[]), config(&vendor)).await;
    assert_eq!(report.dead_lettered, 1, "{report:?}");
    assert_eq!(vendor.payouts().await["payouts"], 1, "the vendor did pay");
    vendor.faults(&Faults::default()).await;
    advance(&clock, &vendor, 2 * HOUR);
    let letters = l.store.dead_letters();
    let id = dead_letter(&letters, &t, &p).await.id;
    // `idem dlq redrive`: a redriver with no way to ask the vendor.
    let blind = idem_outbound::Redriver::new(hour_client(&[]).with_clock(l.clock.clone()), letters.clone());
    let result = blind.redrive_one(id).await.unwrap();
    assert_eq!(
        vendor.payouts().await["payouts"],
        1,
        "paid twice past the horizon: {result:?}"
    );
    assert!(
        matches!(result, idem_outbound::RedriveResult::Unknown { .. }),
        "{result:?}"
    );
    pass(&l, &vendor).await;
    assert_eq!(status(&l, &t, &p).await["status"], "unknown");
    // With the ledger's lookup the vendor's record settles it; nothing is sent.
    let asking = idem_outbound::Redriver::new(
        hour_client(&[])
            .with_clock(l.clock.clone())
            .with_reconcile(Arc::new(ledger::payouts::VendorLookup::new(&vendor.url).unwrap())),
        letters.clone(),
    );
    let result = asking.redrive_one(id).await.unwrap();
    assert_resolved(&result);
    assert_eq!(pass(&l, &vendor).await.reconciled, 1);
    let paid = status(&l, &t, &p).await;
    assert_eq!(paid["status"], "paid");
    assert!(paid["vendor_payout_id"].as_str().unwrap().starts_with("po_"));
    assert_eq!(vendor.payouts().await["payouts"], 1, "paid once");
    stop_conserved(l, &t).await;
}

/// A worker dies while the vendor pays; the payout is taken over past the vendor's key horizon: paid once (the new worker asks the vendor first), or, without a way to ask, held as unknown and not sent.
async fn a_takeover_past_the_vendors_horizon_pays_once(engine: Engine) {
    takeover(engine, horizon_vendor()).await;
}

/// The same against a vendor without idempotency keys: every re-send is asked about first.
async fn a_takeover_at_a_vendor_without_keys_pays_once(engine: Engine) {
    takeover(
        engine,
        fake_vendor::Options {
            idempotency: false,
            ..Default::default()
        },
    )
    .await;
}

async fn takeover(engine: Engine, options: fake_vendor::Options) {
    let (vendor, clock, l, t, a) = vendor_and_funded_on_clock(engine, options).await;
    let held = payout_id(&l, &t, &a, 300).await;
    let asked = payout_id(&l, &t, &a, 200).await;
    let horizon = if options.idempotency {
        idem_outbound::KeyHorizon::new(HOUR, Duration::from_secs(60))
    } else {
        idem_outbound::KeyHorizon::NONE
    };
    let client = || {
        idem_outbound::OutboundClient::new(idem_outbound::OutboundConfig {
            retry_delays: vec![],
            deadline: Duration::from_secs(20),
            attempt_timeout: Duration::from_secs(10),
            key_horizon: horizon,
            ..Default::default()
        })
        .unwrap()
    };
    let mut short = config(&vendor);
    short.lease = Duration::from_secs(1);
    // The vendor works slowly; the worker dies mid-call; the vendor pays anyway.
    vendor.fault(|f| f.slow_ms = 400).await;
    let worker = {
        let (store, clock, config, client) = (l.store.clone(), l.clock.clone(), short.clone(), client());
        tokio::spawn(async move { ledger::payouts::pass(&store, clock, client, config).await })
    };
    let by = tokio::time::Instant::now() + Duration::from_secs(20);
    let seen = |reference: String| {
        let url = format!("{}/v1/payouts?reference={reference}", vendor.url);
        async move {
            let found: serde_json::Value = idem_tls::test_pki::get(url).await.unwrap().json().await.unwrap();
            !found["data"].as_array().unwrap().is_empty()
        }
    };
    while !(seen(held.clone()).await && seen(asked.clone()).await) {
        assert!(tokio::time::Instant::now() < by, "the vendor never saw the calls");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    worker.abort();
    let _ = worker.await;
    while vendor.payouts().await["payouts"] != 2 {
        assert!(
            tokio::time::Instant::now() < by,
            "the vendor pays both calls it received"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    vendor.faults(&Faults::default()).await;
    assert_eq!(
        status(&l, &t, &held).await["status"],
        "requested",
        "the worker died before it knew"
    );
    // Past the lease and past the vendor's horizon, another worker takes over.
    advance(&clock, &vendor, 2 * HOUR);
    let mut blind = short.clone();
    blind.reconcile = false;
    // Without a way to ask: not sent, held for an operator.
    let report = pass_with(&l, client(), blind).await;
    assert_eq!(report.unknown, 2, "{report:?}");
    assert_eq!(vendor.payouts().await["payouts"], 2, "nothing sent on a guess");
    let got = status(&l, &t, &held).await;
    assert_eq!(got["status"], "unknown", "{got}");
    let letter = dead_letter(&l.store.dead_letters(), &t, &held).await;
    assert_eq!(letter.state, idem_core::DeadLetterState::Unknown);
    // An operator (who checked the vendor) says the second was paid: it is
    // marked paid with no send; the first is asked about by a redrive with
    // the ledger's lookup.
    let letters = l.store.dead_letters();
    let other = dead_letter(&letters, &t, &asked).await;
    let record = promised(&serde_json::json!({ "amount": 200, "reference": asked }), "po_checked");
    let seen = operator_says(
        idem_core::Verdict::Applied,
        Some(201),
        record.into_bytes(),
        "seen on the vendor's dashboard",
    );
    operator_settles(&letters, other.id, seen).await;
    let asking = idem_outbound::Redriver::new(
        client()
            .with_clock(l.clock.clone())
            .with_reconcile(Arc::new(ledger::payouts::VendorLookup::new(&vendor.url).unwrap())),
        letters.clone(),
    );
    let result = asking.redrive_one(letter.id).await.unwrap();
    assert_resolved(&result);
    assert_eq!(pass(&l, &vendor).await.reconciled, 2);
    for id in [&held, &asked] {
        assert_eq!(status(&l, &t, id).await["status"], "paid", "{id}");
    }
    let paid = vendor.payouts().await;
    assert_eq!(paid["payouts"], 2, "each paid once: {paid}");
    assert_eq!(paid["references"].as_array().unwrap().len(), 2);
    stop_conserved(l, &t).await;
}

/// A worker stopped past its lease between two attempts (its first found the vendor refusing connections) wakes up after another worker took the payout over, asked the vendor, paid it, and the vendor has since forgotten the key: it sends nothing, so the payout is paid once.
async fn a_worker_paused_past_its_lease_sends_nothing_when_it_wakes(engine: Engine) {
    let (vendor, clock, l, t, a) = vendor_and_funded_on_clock(engine, horizon_vendor()).await;
    let p = payout_id(&l, &t, &a, 400).await;
    // An hour-long lease on the test's clock: no heartbeat beats within the
    // test, as if the worker's process were stopped.
    let mut hour_lease = config(&vendor);
    hour_lease.lease = HOUR;
    // Connections are refused until the test says otherwise.
    vendor.fault(|f| f.refuse_ms = 600_000).await;
    let by = tokio::time::Instant::now() + Duration::from_secs(30);
    while idem_tls::test_pki::get(format!("{}/_stats", vendor.url)).await.is_ok() {
        assert!(tokio::time::Instant::now() < by, "the vendor never stopped listening");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let sleeper = {
        let (store, clock, config) = (l.store.clone(), l.clock.clone(), hour_lease.clone());
        tokio::spawn(async move { ledger::payouts::pass(&store, clock, hour_client(&[5_000]), config).await })
    };
    // Its first attempt is refused (the call is marked sent just before);
    // it waits to try again.
    while status(&l, &t, &p).await["first_sent_at_ms"].is_null() {
        assert!(tokio::time::Instant::now() < by, "the worker never called");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    vendor
        .vendor
        .refuse_until_ms
        .store(0, std::sync::atomic::Ordering::SeqCst);
    while idem_tls::test_pki::get(format!("{}/_stats", vendor.url)).await.is_err() {
        assert!(tokio::time::Instant::now() < by, "the vendor never listened again");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(vendor.payouts().await["payouts"], 0, "nothing paid yet");
    // Past its lease and past the vendor's horizon, another worker takes
    // the payout over, asks the vendor (not paid) and pays it.
    advance(&clock, &vendor, 2 * HOUR);
    let report = pass_with(&l, hour_client(&[]), hour_lease.clone()).await;
    assert_eq!(report.paid, 1, "{report:?}");
    assert_eq!(vendor.stats().await["lookups"], 1, "asked before the re-send");
    // The vendor forgets that key too before the first worker wakes up.
    advance(&clock, &vendor, 2 * HOUR);
    let woke = sleeper.await.unwrap().unwrap();
    assert_eq!(woke.skipped, 1, "the woken worker left the payout alone: {woke:?}");
    let paid = vendor.payouts().await;
    assert_eq!(paid["payouts"], 1, "paid once: {paid}");
    assert_eq!(status(&l, &t, &p).await["status"], "paid");
    stop_conserved(l, &t).await;
}

/// A vendor's 429s are flow control: they never open the breaker, and
/// twelve rate-limited payouts are all deferred, none dead-lettered. A
/// breaker opened by real failures refuses later calls without sending
/// them: those payouts are deferred too, never dead-lettered.
async fn rate_limits_and_an_open_breaker_defer_never_dead_letter(engine: Engine) {
    let (vendor, l, t, a) = vendor_and_funded(engine, 100_000).await;
    vendor
        .fault(|f| {
            f.rate_limit_429 = 1.0;
            f.retry_after_secs = 3600;
        })
        .await;
    for _ in 0..12 {
        assert_eq!(l.payout(&t, &a, 10).await.status, 201);
    }
    let report = pass_with(&l, fast_client(), config(&vendor)).await;
    assert_eq!((report.deferred, report.dead_lettered), (12, 0), "{report:?}");
    assert_eq!(vendor.stats().await["rate_limited"], 12, "every payout was sent");
    // The vendor fails for real: the first payout's four 500s and the
    // second's first open the breaker (five failures); the rest are refused
    // unsent and deferred.
    let l2 = start(engine).await;
    let a2 = l2.account(&t, "a").await;
    assert_eq!(l2.top_up(&t, &a2, 100_000).await.status, 201);
    vendor.fault(|f| f.error_500 = 1.0).await;
    for _ in 0..4 {
        assert_eq!(l2.payout(&t, &a2, 10).await.status, 201);
    }
    let before = vendor.stats().await["errors_500"].as_u64().unwrap();
    // One payout at a time, so the failures come in order.
    let one_at_a_time = PayoutConfig {
        concurrency: 1,
        ..config(&vendor)
    };
    let report = pass_with(&l2, fast_client(), one_at_a_time).await;
    assert_eq!((report.dead_lettered, report.deferred), (1, 3), "{report:?}");
    assert_eq!(vendor.stats().await["errors_500"].as_u64().unwrap() - before, 5);
    l.stop().await;
    l2.stop().await;
}

/// A 429 whose Retry-After is past the call's deadline defers the payout to that time, still requested, instead of dead-lettering it; it is paid once the time has come.
async fn a_long_retry_after_defers_the_payout(engine: Engine) {
    let (vendor, clock, l, t, a) = vendor_and_funded_on_clock(engine, Default::default()).await;
    vendor
        .fault(|f| {
            f.rate_limit_429 = 1.0;
            f.retry_after_secs = 3600;
        })
        .await;
    let p = payout_id(&l, &t, &a, 10).await;
    let report = pass_with(&l, hour_client(&[20]), config(&vendor)).await;
    assert_eq!((report.deferred, report.dead_lettered), (1, 0), "{report:?}");
    let got = status(&l, &t, &p).await;
    assert_eq!(got["status"], "requested", "{got}");
    use idem_core::Clock as _;
    let not_before = got["not_before_ms"].as_i64().expect("deferred");
    assert!(not_before >= clock.now_ms() + 3_599_000, "{got}");
    vendor.faults(&Faults::default()).await;
    assert_eq!(
        pass_with(&l, hour_client(&[20]), config(&vendor)).await,
        PassReport::default(),
        "not before its time"
    );
    assert_eq!(vendor.stats().await["rate_limited"], 1);
    advance(&clock, &vendor, HOUR);
    assert_eq!(pass_with(&l, hour_client(&[20]), config(&vendor)).await.paid, 1);
    assert_eq!(status(&l, &t, &p).await["status"], "paid");
    assert_eq!(vendor.payouts().await["payouts"], 1);
    l.stop().await;
}

/// A 2xx that does not hold what the vendor promises (a default backend's "200 ok") is not taken as paid: the outcome is unknown and held; a vendor URL ending in `#` is refused at start.
async fn an_answer_without_what_the_vendor_promises_is_not_paid(engine: Engine) {
    let url = vendor_answering(|_, _| (200, "ok".to_owned())).await;
    let l = start(engine).await;
    let (t, a) = l.funded(1_000).await;
    let p = payout_id(&l, &t, &a, 10).await;
    let report = pass_with(&l, fast_client(), config_at(&url)).await;
    assert_eq!((report.paid, report.unknown), (0, 1), "{report:?}");
    let got = status(&l, &t, &p).await;
    assert_eq!(got["status"], "unknown", "{got}");
    assert!(
        got["last_error"]
            .as_str()
            .unwrap()
            .contains("does not match its contract"),
        "{got}"
    );
    // A wrong amount or reference is no better.
    let url = vendor_answering(|r, _| {
        let mut wrong: serde_json::Value = serde_json::from_str(&promised(r, "po_1")).unwrap();
        wrong["amount"] = 1.into();
        (201, wrong.to_string())
    })
    .await;
    let p2 = payout_id(&l, &t, &a, 10).await;
    pass_with(&l, fast_client(), config_at(&url)).await;
    assert_eq!(status(&l, &t, &p2).await["status"], "unknown");
    stop_conserved(l, &t).await;
    // At start: the binary refuses the URL, naming the setting.
    for bad in [
        "http://127.0.0.1:9#",
        "ftp://127.0.0.1:9",
        "http://user:pw@127.0.0.1:9",
        "http://127.0.0.1:0",
    ] {
        let err = refused_worker_start(&["--vendor-url", bad]);
        assert!(err.contains("--vendor-url"), "{bad}: {err}");
    }
    // An https vendor's CA file that cannot be read stops the start, naming it.
    let err = refused_worker_start(&[
        "--vendor-url",
        "https://127.0.0.1:9",
        "--vendor-ca-file",
        "/nonexistent/ca.pem",
    ]);
    assert!(
        err.contains("--vendor-ca-file") && err.contains("CA file /nonexistent/ca.pem: cannot be read"),
        "{err}"
    );
}

/// Runs the ledger's payout worker with `vendor` (the vendor settings) on a
/// database it could never open; it must refuse to start. Its stderr.
fn refused_worker_start(vendor: &[&str]) -> String {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_ledger"))
        .args(["--database-url", "/nonexistent-dir/x.db"])
        .args(vendor)
        .arg("payouts")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "{vendor:?}: {err}");
    err
}

/// A dead-lettered payout has a way out: a redrive to a corrected vendor URL pays it; one the vendor did not pay is cancelled, once, its debit reversed, only after a verdict that it was not applied.
async fn a_dead_lettered_payout_has_a_way_out(engine: Engine) {
    let (vendor, l, t, a) = vendor_and_funded(engine, 1_000).await;
    // A wrong vendor URL (nothing listens): both payouts are dead-lettered.
    let wrong = nowhere_url();
    let fixed = payout_id(&l, &t, &a, 100).await;
    let cancelled = payout_id(&l, &t, &a, 250).await;
    let report = pass_with(&l, unguarded_client(), config_at(&wrong)).await;
    assert_eq!(report.dead_lettered, 2, "{report:?}");
    assert_eq!(l.balance(&t, &a).await, 650);
    let letters = l.store.dead_letters();
    // The target override: the letter goes to the right vendor, and keeps it.
    let redriver = idem_outbound::Redriver::new(fast_client(), letters.clone())
        .with_target(&format!("{}/v1/payouts", vendor.url))
        .unwrap();
    assert!(
        idem_outbound::Redriver::new(fast_client(), letters.clone())
            .with_target("http://v#")
            .is_err()
    );
    let id = dead_letter(&letters, &t, &fixed).await.id;
    let result = redriver.redrive_one(id).await.unwrap();
    assert_resolved(&result);
    assert!(
        dead_letter(&letters, &t, &fixed)
            .await
            .request
            .url()
            .starts_with(&vendor.url)
    );
    assert_eq!(pass(&l, &vendor).await.reconciled, 1);
    assert_eq!(status(&l, &t, &fixed).await["status"], "paid");
    // The other: cancelling is refused until the vendor is known not to have paid it.
    let cancel = |k: String| {
        let (l, t, id) = (&l, t.clone(), cancelled.clone());
        async move { l.post(&format!("/v1/payouts/{id}/cancel"), &t, Some(&k), "").await }
    };
    cancel(key()).await.assert_problem(409, "payout-not-reconciled");
    let letter = dead_letter(&letters, &t, &cancelled).await;
    let nothing_reached = operator_says_not_applied("the vendor URL was wrong: nothing reached the vendor");
    operator_settles(&letters, letter.id, nothing_reached).await;
    let k = key();
    let done = cancel(k.clone()).await;
    assert_eq!(done.status, 200, "{}", String::from_utf8_lossy(&done.body));
    assert_eq!(done.json()["status"], "cancelled");
    assert!(cancel(k).await.replayed(), "the same key replays");
    cancel(key()).await.assert_problem(409, "payout-not-cancellable");
    assert_eq!(status(&l, &t, &cancelled).await["status"], "cancelled");
    assert_eq!(
        dead_letter(&letters, &t, &cancelled).await.state,
        idem_core::DeadLetterState::Cancelled
    );
    assert_eq!(l.balance(&t, &a).await, 900, "the 250 came back, once");
    let audit = l.audit(&t).await;
    assert_eq!(
        (audit["payouts_total"].as_i64(), audit["conserved"].as_bool()),
        (Some(100), Some(true)),
        "{audit}"
    );
    // A paid payout is not cancelled.
    l.post(&format!("/v1/payouts/{fixed}/cancel"), &t, Some(&key()), "")
        .await
        .assert_problem(409, "payout-not-cancellable");
    assert_eq!(vendor.payouts().await["payouts"], 1);
    l.stop().await;
}

/// A redrive answered by a 2xx that is not the payout (`200 {"error": …}`)
/// does not resolve its dead letter: with the ledger's answer check the
/// letter is held as unknown, the payout becomes `unknown`, and the
/// operator's verdict is its way out (not applied: dead-lettered again,
/// then cancelled with its debit reversed).
async fn a_redrive_answered_by_a_2xx_that_is_not_the_payout_keeps_a_way_out(engine: Engine) {
    let wrong = vendor_answering(|_, _| (200, r#"{"error":"no such route"}"#.to_owned())).await;
    let l = start(engine).await;
    let (t, a) = l.funded(1_000).await;
    let p = payout_id(&l, &t, &a, 300).await;
    let nowhere = nowhere_url();
    let report = pass_with(&l, unguarded_client(), config_at(&nowhere)).await;
    assert_eq!(report.dead_lettered, 1, "{report:?}");
    let letters = l.store.dead_letters();
    let letter = dead_letter(&letters, &t, &p).await;
    let redriven = idem_outbound::Redriver::new(fast_client(), letters.clone())
        .with_target(&format!("{wrong}/v1/payouts"))
        .unwrap()
        .with_answer_check(ledger::payouts::answer_check())
        .redrive_one(letter.id)
        .await
        .unwrap();
    assert!(
        matches!(&redriven, idem_outbound::RedriveResult::Unknown { reason } if reason.contains("contract")),
        "{redriven:?}"
    );
    let reconcile = pass_with(&l, fast_client(), config_at(&wrong)).await;
    assert_eq!(reconcile.paid + reconcile.reconciled, 0, "{reconcile:?}");
    assert_eq!(status(&l, &t, &p).await["status"], "unknown");
    // An unknown letter takes the operator's verdict.
    operator_settles(
        &letters,
        letter.id,
        operator_says_not_applied("the vendor has no such payout"),
    )
    .await;
    let done = l.post(&format!("/v1/payouts/{p}/cancel"), &t, Some(&key()), "").await;
    assert_eq!(done.status, 200, "{}", String::from_utf8_lossy(&done.body));
    assert_eq!(l.balance(&t, &a).await, 1_000, "the debit reversed");
    stop_conserved(l, &t).await;
}

/// A redrive's answer over 4 KiB keeps what the ledger needs: the redriven payout is marked paid with the vendor's id.
async fn a_large_vendor_answer_keeps_its_id(engine: Engine) {
    let url = vendor_answering(|r, call| {
        if call == 0 {
            return (503, "{}".to_owned());
        }
        let mut answer: serde_json::Value = serde_json::from_str(&promised(r, "po_large")).unwrap();
        answer["metadata"] = "m".repeat(8 * 1024).into();
        (201, answer.to_string())
    })
    .await;
    let l = start(engine).await;
    let (t, a) = l.funded(1_000).await;
    let p = payout_id(&l, &t, &a, 10).await;
    let once = idem_outbound::OutboundClient::new(idem_outbound::OutboundConfig {
        retry_delays: vec![],
        ..Default::default()
    })
    .unwrap();
    let config = config_at(&url);
    let report = pass_with(&l, once, config.clone()).await;
    assert_eq!(report.dead_lettered, 1, "{report:?}");
    let letters = l.store.dead_letters();
    let id = letters.list(&tenant_letters(&t)).await.unwrap()[0].id;
    let result = idem_outbound::Redriver::new(fast_client(), letters.clone())
        .redrive_one(id)
        .await
        .unwrap();
    assert_resolved(&result);
    pass_with(&l, fast_client(), config).await;
    let got = status(&l, &t, &p).await;
    assert_eq!(
        (got["status"].as_str(), got["vendor_payout_id"].as_str()),
        (Some("paid"), Some("po_large")),
        "{got}"
    );
    l.stop().await;
}

/// Expands each worker test into one per engine.
macro_rules! worker_tests {
    ($($name:ident),* $(,)?) => {
        mod worker {
            use super::*;
            mod sqlite { use super::*; $( #[tokio::test(flavor = "multi_thread", worker_threads = 4)] async fn $name() { super::super::$name(Engine::Sqlite).await } )* }
            mod postgres { use super::*; $( #[tokio::test(flavor = "multi_thread", worker_threads = 4)] async fn $name() { super::super::$name(Engine::Postgres).await } )* }
            mod mysql { use super::*; $( #[tokio::test(flavor = "multi_thread", worker_threads = 4)] async fn $name() { super::super::$name(Engine::Mysql).await } )* }
        }
    };
}

worker_tests!(
    the_worker_pays_once_through_faults,
    many_workers_pay_each_payout_once,
    a_payout_applied_then_dead_lettered_is_redriven_without_paying_twice,
    a_redriven_payout_behind_a_hundred_dead_ones_is_reconciled,
    a_vendor_id_with_a_nul_does_not_keep_a_payout_requested,
    a_slow_vendor_call_holds_only_its_own_slot,
    a_redrive_past_the_vendors_horizon_pays_once,
    a_takeover_past_the_vendors_horizon_pays_once,
    a_takeover_at_a_vendor_without_keys_pays_once,
    a_worker_paused_past_its_lease_sends_nothing_when_it_wakes,
    a_long_retry_after_defers_the_payout,
    rate_limits_and_an_open_breaker_defer_never_dead_letter,
    an_answer_without_what_the_vendor_promises_is_not_paid,
    a_dead_lettered_payout_has_a_way_out,
    a_redrive_answered_by_a_2xx_that_is_not_the_payout_keeps_a_way_out,
    a_large_vendor_answer_keeps_its_id
);

/// A lookup server answering `GET /v1/payouts` with `body` (status 200).
async fn lookup_answering(body: String) -> String {
    let app = axum::Router::new().route(
        "/v1/payouts",
        axum::routing::get(move || {
            let body = body.clone();
            async move { ([("content-type", "application/json")], body) }
        }),
    );
    serve(app).await
}

/// The payout lookup says "not applied" only from a list answer that
/// covers the reference: an empty answer (`{}`, `[]`, nothing, a list
/// without `object: list`), a first page of others with more to come, or
/// an answer over `MAX_LOOKUP_BYTES` is never "not applied"; records of
/// other references are not this payout's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_vendor_lookup_never_takes_an_empty_answer_for_not_applied() {
    use idem_outbound::{Reconcile, Reconciled};
    let request = idem_core::OutboundRequest::new(
        "POST",
        "http://127.0.0.1:9/v1/payouts",
        vec![("content-type".into(), "application/json".into())],
        br#"{"amount":25,"reference":"po-77"}"#.to_vec(),
    )
    .unwrap();
    let key = idem_core::IdempotencyKey::new("po-77").unwrap();
    let ask = |body: String| {
        let (request, key) = (request.clone(), key.clone());
        async move {
            let url = lookup_answering(body).await;
            let lookup = ledger::payouts::VendorLookup::new(&url).unwrap();
            lookup.reconcile(&key, &request, Duration::from_secs(5)).await
        }
    };
    for empty in ["", "{}", "[]", r#"{"data":[]}"#, r#"{"object":"list"}"#, "null"] {
        let answer = ask(empty.to_owned()).await;
        assert!(answer.is_err(), "{empty:?}: {answer:?}");
    }
    let more =
        ask(r#"{"object":"list","has_more":true,"data":[{"reference":"po-1","amount":25,"status":"paid"}]}"#.into())
            .await;
    assert!(matches!(more, Ok(Reconciled::Unknown(_))), "{more:?}");
    let unnamed = ask(r#"{"object":"list","data":[{"amount":25,"status":"paid"}]}"#.into()).await;
    assert!(matches!(unnamed, Ok(Reconciled::Unknown(_))), "{unnamed:?}");
    let others = ask(r#"{"object":"list","data":[{"reference":"po-1","amount":25,"status":"paid"}]}"#.into()).await;
    assert_eq!(others, Ok(Reconciled::NotApplied));
    let ours = ask(r#"{"object":"list","data":[{"reference":"po-77","amount":25,"status":"paid"}]}"#.into()).await;
    assert!(matches!(ours, Ok(Reconciled::Applied { .. })), "{ours:?}");
    let huge = format!(
        r#"{{"object":"list","data":[],"pad":"{}"}}"#,
        "x".repeat(ledger::payouts::MAX_LOOKUP_BYTES)
    );
    let huge = ask(huge).await;
    assert!(matches!(&huge, Err(why) if why.contains("bytes")), "{huge:?}");
}
