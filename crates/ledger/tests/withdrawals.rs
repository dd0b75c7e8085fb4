//! Withdrawals on every engine: `POST /v1/withdrawals` debits once, books
//! one quote at an FX vendor without keys and pays once at a Stripe-like
//! vendor — through lost answers resumed by the client's retry or by a
//! completer, completers racing each other and the client's retries, a
//! declined payout compensated once, and an outcome nobody can establish
//! held until an operator's verdict. The kills are in
//! `withdrawal_kills.rs`.

mod common;
mod vendor;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use idem_core::multistep::{HoldKind, MultiStepState, MultiStepStore};
use idem_core::{Clock, IdempotencyKey, Scope, Settlement, Verdict, VerdictSource};
use ledger::withdrawals::{WITHDRAWAL_OPERATION, WithdrawalsConfig};
use ledger::{LedgerDb, Store};
use vendor::FakeVendor;

/// Withdrawals through `vendor`, one attempt per vendor call (a lost answer
/// ends the step's call, and the run waits a second before it is resumed),
/// runs leased for 2 s.
fn config(vendor: &FakeVendor) -> WithdrawalsConfig {
    let mut config = WithdrawalsConfig::new(&vendor.url, &vendor.url);
    for calls in [&mut config.fx, &mut config.payout] {
        calls.retry_delays = Vec::new();
        calls.attempt_timeout = Duration::from_secs(3);
    }
    config.lease = Duration::from_secs(2);
    config
}

/// A ledger with withdrawals through `vendor`, on a database of its own
/// (a completer takes every due withdrawal of its database).
async fn start(engine: Engine, transport: Transport, vendor: &FakeVendor) -> Ledger {
    let options = ledger::Options {
        withdrawals: Some(config(vendor)),
        ..ledger::Options::default()
    };
    let url = own_database(engine, "ledger_withdrawals").await;
    Ledger::start_with(&url, transport, Arc::new(idem_core::SystemClock), options).await
}

/// A fake vendor, a ledger withdrawing through it (see [`start`]), and a
/// new tenant's account there topped up with `amount`: the vendor, the
/// ledger, the token and the account.
async fn funded(engine: Engine, transport: Transport, amount: i64) -> (FakeVendor, Ledger, String, String) {
    let vendor = FakeVendor::start().await;
    let l = start(engine, transport, &vendor).await;
    let (t, a) = l.funded(amount).await;
    (vendor, l, t, a)
}

fn body(account: &str, amount: i64, destination: &str) -> String {
    format!(
        r#"{{"account":"{account}","amount":{amount},"currency":"EUR","payout_currency":"USD","destination":"{destination}"}}"#
    )
}

async fn withdraw(l: &Ledger, t: &str, k: &str, body: &str) -> Resp {
    l.post("/v1/withdrawals", t, Some(k), body).await
}

/// The problem type's slug of a response.
fn slug(r: &Resp) -> String {
    r.json()["type"]
        .as_str()
        .unwrap_or_default()
        .rsplit('/')
        .next()
        .unwrap_or_default()
        .to_owned()
}

/// Sends the request again, as a client does, until it is no longer 409
/// in flight (at most 30 s): the answer.
async fn until_done(l: &Ledger, t: &str, k: &str, body: &str) -> Resp {
    let until = Instant::now() + Duration::from_secs(30);
    loop {
        let r = withdraw(l, t, k, body).await;
        if !(r.status == 409 && slug(&r) == "idempotency-key-in-flight") {
            return r;
        }
        assert!(Instant::now() < until, "still in flight after 30 s");
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
}

/// One completer pass on the ledger's store.
async fn complete(l: &Ledger, vendor: &FakeVendor) -> idem_steps::Pass {
    l.store
        .complete_withdrawals(
            l.clock.clone(),
            &config(vendor),
            &ledger::events::Namespace::default(),
            64,
        )
        .await
        .expect("a completer pass")
}

/// The key as stored: the sf-string unquoted.
fn bare(key: &str) -> &str {
    key.trim_matches('"')
}

/// Checks the tenant's books: conserved, with `withdrawn` out and
/// `journal_rows` journal rows.
async fn assert_books(l: &Ledger, t: &str, withdrawn: i64, journal_rows: i64) {
    let audit = l.audit(t).await;
    assert_eq!(audit["conserved"], true, "{audit}");
    assert_eq!(audit["withdrawals_total"], withdrawn, "{audit}");
    assert_eq!(audit["journal_rows"], journal_rows, "{audit}");
}

/// A withdrawal pays once at each vendor, answers 201, and its retry replays the same bytes.
async fn a_withdrawal_crosses_two_vendors_once(engine: Engine) {
    let (vendor, l, t, a) = funded(engine, Transport::Socket, 10_000).await;
    let k = key();
    let first = withdraw(&l, &t, &k, &body(&a, 1_000, "acct-1")).await;
    assert_eq!(first.status, 201, "{}", String::from_utf8_lossy(&first.body));
    assert!(!first.replayed());
    let w = first.json();
    let id = w["id"].as_str().unwrap().to_owned();
    assert_eq!(w["status"], "paid");
    assert_eq!(
        (w["amount"].as_i64(), w["amount_out"].as_i64()),
        (Some(1_000), Some(1_084))
    );
    assert_eq!(w["rate"], "1.0842");
    assert_eq!(w["destination"], "acct-1");
    assert!(w["quote_id"].as_str().unwrap().starts_with("qt_"), "{w}");
    assert!(w["vendor_payout_id"].as_str().unwrap().starts_with("po_"), "{w}");
    let again = withdraw(&l, &t, &k, &body(&a, 1_000, "acct-1")).await;
    assert_eq!(again.status, 201);
    assert!(again.replayed());
    assert_eq!(again.body, first.body, "a replay is the first answer, byte for byte");
    assert_eq!(l.balance(&t, &a).await, 9_000);
    let quotes = vendor.quotes().await;
    assert_eq!(
        (quotes["quotes"].as_u64(), quotes["cancelled"].as_u64()),
        (Some(1), Some(0))
    );
    assert_eq!(quotes["references"], serde_json::json!([id]));
    let paid = vendor.payouts().await;
    assert_eq!(
        (paid["payouts"].as_u64(), paid["total"].as_u64()),
        (Some(1), Some(1_084))
    );
    assert_eq!(paid["references"], serde_json::json!([id]));
    let got = l.get(&format!("/v1/withdrawals/{id}"), &t).await;
    assert_eq!(got.status, 200);
    let got = got.json();
    assert_eq!(got["status"], "paid");
    assert_eq!(got["quote_id"], w["quote_id"]);
    assert_eq!(got["vendor_payout_id"], w["vendor_payout_id"]);
    assert_eq!(
        (got["amount"].as_i64(), got["amount_out"].as_i64()),
        (Some(1_000), Some(1_084))
    );
    l.assert_not_found("/v1/withdrawals", &id, &t, &token(), "withdrawal-not-found")
        .await;
    assert_books(&l, &t, 1_000, 2).await;
    l.stop().await;
}

/// Bad input is refused before anything is written; short funds are 422 and leave the key unused.
async fn refused_withdrawals_write_nothing(engine: Engine) {
    let (vendor, l, t, a) = funded(engine, Transport::InProcess, 100).await;
    let ok = |amount: &str, currency: &str, to: &str, destination: &str| {
        format!(
            r#"{{"account":"{a}","amount":{amount},"currency":"{currency}","payout_currency":"{to}","destination":"{destination}"}}"#
        )
    };
    let long = "d".repeat(101);
    for bad in [
        ok("0", "EUR", "USD", "acct"),
        ok("-5", "EUR", "USD", "acct"),
        ok("1000000000001", "EUR", "USD", "acct"),
        ok("5.5", "EUR", "USD", "acct"),
        ok("5", "eur", "USD", "acct"),
        ok("5", "EURO", "USD", "acct"),
        ok("5", "EUR", "US", "acct"),
        ok("5", "EUR", "USD", ""),
        ok("5", "EUR", "USD", "two words"),
        ok("5", "EUR", "USD", &long),
        body("x", 5, "acct"),
        format!(r#"{{"account":"{a}","amount":5,"currency":"EUR","payout_currency":"USD"}}"#),
        format!(r#"{{"account":"{a}","amount":5,"currency":"EUR","payout_currency":"USD","destination":"d","x":1}}"#),
        r#"["a",5,"EUR","USD","d"]"#.to_owned(),
        "not json".to_owned(),
    ] {
        let r = withdraw(&l, &t, &key(), &bad).await;
        assert_eq!(r.status, 400, "{bad}: {}", String::from_utf8_lossy(&r.body));
        assert_eq!(r.headers["content-type"], "application/problem+json");
    }
    let headers = [
        ("authorization".to_owned(), format!("Bearer {t}")),
        ("idempotency-key".to_owned(), key()),
        ("content-type".to_owned(), "text/plain".to_owned()),
    ];
    let r = l
        .send_raw("POST", "/v1/withdrawals", &headers, Some(&body(&a, 5, "acct")))
        .await;
    r.assert_problem(415, "unsupported-media-type");
    l.post("/v1/withdrawals", &t, None, &body(&a, 5, "acct"))
        .await
        .assert_problem(400, "idempotency-key-missing");
    let unknown = "0193a2b4-0000-7000-8000-000000000000";
    withdraw(&l, &t, &key(), &body(unknown, 5, "acct"))
        .await
        .assert_problem(404, "account-not-found");
    // Short of funds: 422, nothing written, and the key stays unused.
    let k = key();
    withdraw(&l, &t, &k, &body(&a, 101, "acct"))
        .await
        .assert_problem(422, "insufficient-funds");
    assert_eq!(l.balance(&t, &a).await, 100);
    assert_books(&l, &t, 0, 1).await;
    assert_eq!(vendor.quotes().await["quotes"], 0, "no vendor was called");
    assert_eq!(l.top_up(&t, &a, 1).await.status, 201);
    let r = withdraw(&l, &t, &k, &body(&a, 101, "acct")).await;
    assert_eq!(r.status, 201, "{}", String::from_utf8_lossy(&r.body));
    assert!(!r.replayed());
    // The key is now the withdrawal's: another request with it is refused.
    withdraw(&l, &t, &k, &body(&a, 1, "acct"))
        .await
        .assert_problem(422, "idempotency-key-reused");
    assert_eq!(l.balance(&t, &a).await, 0);
    assert_eq!(vendor.quotes().await["quotes"], 1);
    assert_eq!(vendor.payouts().await["payouts"], 1);
    assert_books(&l, &t, 101, 3).await;
    l.stop().await;
}

/// Answers lost at both vendors are recovered by the client's retries: the quote by asking the FX vendor, the payout by its key; each paid once.
async fn a_retry_resumes_after_lost_answers(engine: Engine) {
    let (vendor, l, t, a) = funded(engine, Transport::InProcess, 10_000).await;
    // Every answer to a new quote or payment is lost after the vendor
    // applied it.
    vendor.fault(|f| f.apply_then_drop = 1.0).await;
    let (k, b) = (key(), body(&a, 2_000, "acct-2"));
    let first = withdraw(&l, &t, &k, &b).await;
    first.assert_problem(409, "idempotency-key-in-flight");
    assert!(first.headers.contains_key("retry-after"));
    let done = until_done(&l, &t, &k, &b).await;
    assert_eq!(done.status, 201, "{}", String::from_utf8_lossy(&done.body));
    assert!(!done.replayed(), "this request's own run finished it");
    let id = done.json()["id"].as_str().unwrap().to_owned();
    let stats = vendor.stats().await;
    assert_eq!(
        stats["dropped"], 2,
        "the quote's answer and the payout's were lost: {stats}"
    );
    assert!(stats["lookups"].as_u64() >= Some(1), "the FX vendor was asked: {stats}");
    assert_eq!(
        stats["replayed"], 1,
        "the payout's key was sent again and replayed: {stats}"
    );
    let quotes = vendor.quotes().await;
    assert_eq!(
        (quotes["quotes"].as_u64(), &quotes["references"]),
        (Some(1), &serde_json::json!([id]))
    );
    let paid = vendor.payouts().await;
    assert_eq!(
        (paid["payouts"].as_u64(), &paid["references"]),
        (Some(1), &serde_json::json!([id]))
    );
    let again = withdraw(&l, &t, &k, &b).await;
    assert!(again.replayed());
    assert_eq!(again.body, done.body);
    assert_books(&l, &t, 2_000, 2).await;
    l.stop().await;
}

/// A withdrawal whose client went away is finished by a completer; the client's retry then gets its answer, replayed.
async fn a_completer_finishes_what_the_client_left(engine: Engine) {
    let (vendor, l, t, a) = funded(engine, Transport::InProcess, 10_000).await;
    vendor.fault(|f| f.apply_then_drop = 1.0).await;
    let (k, b) = (key(), body(&a, 3_000, "acct-3"));
    withdraw(&l, &t, &k, &b)
        .await
        .assert_problem(409, "idempotency-key-in-flight");
    vendor.fault(|_| {}).await;
    // The client is gone; completers pass until one finishes it.
    let until = Instant::now() + Duration::from_secs(30);
    let mut completed = 0;
    while completed == 0 {
        assert!(Instant::now() < until, "no completer finished it in 30 s");
        tokio::time::sleep(Duration::from_millis(200)).await;
        completed += complete(&l, &vendor).await.completed;
    }
    assert_eq!(complete(&l, &vendor).await.taken, 0, "nothing left to complete");
    let answer = withdraw(&l, &t, &k, &b).await;
    assert_eq!(answer.status, 201, "{}", String::from_utf8_lossy(&answer.body));
    assert!(answer.replayed(), "the completer's outcome, replayed");
    assert_eq!(answer.json()["status"], "paid");
    assert_eq!(vendor.quotes().await["quotes"], 1);
    assert_eq!(vendor.payouts().await["payouts"], 1);
    assert_books(&l, &t, 3_000, 2).await;
    l.stop().await;
}

/// Two completers and the clients' own retries race over stopped withdrawals: each is quoted once, paid once, debited once.
async fn completers_and_retries_race_each_withdrawal_once(engine: Engine) {
    const N: usize = 5;
    let (vendor, l, t, a) = funded(engine, Transport::InProcess, 100_000).await;
    let l = Arc::new(l);
    vendor.fault(|f| f.apply_then_drop = 1.0).await;
    let mut keys = Vec::new();
    for i in 0..N {
        let (k, b) = (key(), body(&a, 1_000 + i as i64, &format!("acct-{i}")));
        withdraw(&l, &t, &k, &b)
            .await
            .assert_problem(409, "idempotency-key-in-flight");
        keys.push((k, b));
    }
    vendor.fault(|_| {}).await;
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    let vendor = Arc::new(vendor);
    let mut racers = tokio::task::JoinSet::new();
    for _ in 0..2 {
        let (l, vendor) = (l.clone(), vendor.clone());
        racers.spawn(async move {
            let mut completed = 0;
            for _ in 0..5 {
                completed += complete(&l, &vendor).await.completed;
            }
            Err(completed)
        });
    }
    for (k, b) in keys.clone() {
        let (l, t) = (l.clone(), t.clone());
        racers.spawn(async move {
            let r = until_done(&l, &t, &k, &b).await;
            Ok((k, r.status, r.replayed(), r.body))
        });
    }
    let (mut answers, mut by_completers) = (Vec::new(), 0);
    while let Some(done) = racers.join_next().await {
        match done.unwrap() {
            Ok(answer) => answers.push(answer),
            Err(completed) => by_completers += completed,
        }
    }
    assert_eq!(answers.len(), N);
    // Each withdrawal was finished by exactly one run: a completer's, or
    // the retry's own (its answer then not a replay).
    let by_retries = answers.iter().filter(|(_, _, replayed, _)| !replayed).count() as u64;
    eprintln!("finished by completers: {by_completers}, by retries: {by_retries}");
    assert_eq!(by_completers + by_retries, N as u64);
    let mut ids = Vec::new();
    for (k, status, _, first) in answers {
        assert_eq!(status, 201, "{}", String::from_utf8_lossy(&first));
        let (_, b) = keys.iter().find(|(key, _)| *key == k).unwrap();
        let again = withdraw(&l, &t, &k, b).await;
        assert!(again.replayed());
        assert_eq!(again.body, first, "every answer to a key is the same bytes");
        ids.push(again.json()["id"].as_str().unwrap().to_owned());
    }
    ids.sort();
    let mut quoted: Vec<String> = serde_json::from_value(vendor.quotes().await["references"].clone()).unwrap();
    let mut paid: Vec<String> = serde_json::from_value(vendor.payouts().await["references"].clone()).unwrap();
    quoted.sort();
    paid.sort();
    assert_eq!((&quoted, &paid), (&ids, &ids));
    assert_eq!(vendor.quotes().await["quotes"], N, "one quote per withdrawal");
    assert_eq!(vendor.payouts().await["payouts"], N, "one payout per withdrawal");
    let withdrawn: i64 = (0..N as i64).map(|i| 1_000 + i).sum();
    assert_books(&l, &t, withdrawn, 1 + N as i64).await;
    assert_eq!(complete(&l, &vendor).await.taken, 0);
}

/// Twins of a first request, all at once with one key: one debit, one quote, one payout, and every answer the first one or 409 in flight.
async fn twins_of_a_first_request_withdraw_once(engine: Engine) {
    const TWINS: usize = 8;
    let (vendor, l, t, a) = funded(engine, Transport::InProcess, 100_000).await;
    let l = Arc::new(l);
    // A slow vendor keeps the first run busy while its twins arrive.
    vendor.fault(|f| f.slow_ms = 300).await;
    let (k, b) = (key(), body(&a, 2_500, "acct-5"));
    let answers = futures_util::future::join_all((0..TWINS).map(|_| {
        let (l, t, k, b) = (l.clone(), t.clone(), k.clone(), b.clone());
        async move { withdraw(&l, &t, &k, &b).await }
    }))
    .await;
    let ran: Vec<&Resp> = answers.iter().filter(|r| r.status == 201 && !r.replayed()).collect();
    assert!(ran.len() <= 1, "one run answers as the first");
    for r in &answers {
        match r.status {
            201 => {}
            409 => r.assert_problem(409, "idempotency-key-in-flight"),
            other => panic!("unexpected {other}: {}", String::from_utf8_lossy(&r.body)),
        }
    }
    let done = until_done(&l, &t, &k, &b).await;
    assert_eq!(done.status, 201, "{}", String::from_utf8_lossy(&done.body));
    for r in answers.iter().filter(|r| r.status == 201) {
        assert_eq!(r.body, done.body, "every 201 is the same bytes");
    }
    assert_eq!(vendor.quotes().await["quotes"], 1);
    assert_eq!(vendor.payouts().await["payouts"], 1);
    assert_eq!(l.balance(&t, &a).await, 97_500, "debited once");
    assert_books(&l, &t, 2_500, 2).await;
}

/// A payout the vendor declines is compensated once: the quote released, the debit credited back, 422 replayed as it was.
async fn a_declined_withdrawal_is_compensated_once(engine: Engine) {
    let (vendor, l, t, a) = funded(engine, Transport::InProcess, 10_000).await;
    let (k, b) = (key(), body(&a, 4_000, "closed-acct-9"));
    let first = withdraw(&l, &t, &k, &b).await;
    first.assert_problem(422, "withdrawal-declined");
    let problem = first.json();
    assert_eq!(
        (problem["step"].as_str(), problem["reason"].as_str()),
        (Some("payout"), Some("destination_closed"))
    );
    let again = withdraw(&l, &t, &k, &b).await;
    assert!(again.replayed());
    assert_eq!(again.body, first.body);
    assert_eq!(l.balance(&t, &a).await, 10_000, "credited back");
    let id = vendor.quotes().await["references"][0].as_str().unwrap().to_owned();
    let quotes = vendor.quotes().await;
    assert_eq!(
        (quotes["quotes"].as_u64(), quotes["cancelled"].as_u64()),
        (Some(1), Some(1)),
        "{quotes}"
    );
    assert_eq!(vendor.payouts().await["payouts"], 0);
    assert_eq!(vendor.stats().await["declined"], 1);
    let got = l.get(&format!("/v1/withdrawals/{id}"), &t).await.json();
    assert_eq!(got["status"], "declined");
    assert!(got["reason"].as_str().unwrap().contains("destination_closed"), "{got}");
    // Debited once, credited back once.
    assert_books(&l, &t, 0, 3).await;
    assert_eq!(complete(&l, &vendor).await.taken, 0, "nothing left to compensate");
    // A pair the FX vendor does not quote: no quote to release, the debit
    // credited back.
    let jpy =
        format!(r#"{{"account":"{a}","amount":500,"currency":"EUR","payout_currency":"JPY","destination":"acct"}}"#);
    let r = withdraw(&l, &t, &key(), &jpy).await;
    r.assert_problem(422, "withdrawal-declined");
    assert_eq!(r.json()["step"], "fx-quote");
    assert_eq!(vendor.quotes().await["quotes"], 1, "nothing booked");
    assert_eq!(l.balance(&t, &a).await, 10_000);
    assert_books(&l, &t, 0, 5).await;
    l.stop().await;
}

/// An operator's verdict on the operation `(tenant, key)`, held on the
/// unknown outcome of step `step`: applied, with `body` as the vendor's
/// answer.
async fn operator_says_applied<D: LedgerDb>(db: &D, t: &str, key: &str, step: &str, body: Vec<u8>) {
    let ops = db.multi_steps();
    let scope = Scope::parse(ledger::tenant_for_token(t).as_str(), WITHDRAWAL_OPERATION).unwrap();
    let key = IdempotencyKey::new(bare(key)).unwrap();
    let mut row = MultiStepStore::<D>::find(&ops, &scope, &key)
        .await
        .unwrap()
        .expect("the operation");
    assert_eq!(row.state, MultiStepState::Held);
    assert_eq!(row.hold.as_ref().map(|h| h.kind), Some(HoldKind::Unknown));
    assert_eq!(row.open.as_ref().map(|o| o.step.as_str()), Some(step));
    let settlement = Settlement {
        verdict: Verdict::Applied,
        by: VerdictSource::Operator,
        status: Some(201),
        body,
        note: "the vendor's record shows it booked".into(),
    };
    row.settle(&settlement, idem_core::SystemClock.now_ms()).unwrap();
    MultiStepStore::<D>::write(&ops, &row).await.unwrap();
}

/// A lost quote answer the FX vendor cannot be asked about is held, never booked again; an operator's verdict lets it finish once.
async fn an_unknown_outcome_is_held_until_an_operator_says(engine: Engine) {
    let (vendor, l, t, a) = funded(engine, Transport::InProcess, 10_000).await;
    vendor
        .fault(|f| {
            f.apply_then_drop = 1.0;
            f.lookup_error_500 = 1.0;
        })
        .await;
    let (k, b) = (key(), body(&a, 1_500, "acct-4"));
    let held = until_done(&l, &t, &k, &b).await;
    held.assert_problem(409, "idempotency-outcome-unknown");
    assert_eq!(held.json()["step"], "fx-quote");
    assert!(!held.headers.contains_key("retry-after"), "an operator must act");
    assert_eq!(
        complete(&l, &vendor).await.taken,
        0,
        "a held withdrawal is no completer's"
    );
    withdraw(&l, &t, &k, &b)
        .await
        .assert_problem(409, "idempotency-outcome-unknown");
    assert_eq!(
        vendor.quotes().await["quotes"],
        1,
        "booked once, never again on a guess"
    );
    assert_eq!(vendor.payouts().await["payouts"], 0);
    // The operator reads the vendor's record and says it was booked.
    vendor.fault(|_| {}).await;
    let id = vendor.quotes().await["references"][0].as_str().unwrap().to_owned();
    let record = vendor.get_json(&format!("/v1/quotes?reference={id}")).await["data"][0].clone();
    assert_eq!(record["status"], "booked");
    let record = serde_json::to_vec(&record).unwrap();
    match &l.store {
        Store::Postgres(db) => operator_says_applied(db, &t, &k, "fx-quote", record).await,
        Store::MySql(db) => operator_says_applied(db, &t, &k, "fx-quote", record).await,
        Store::Sqlite(db) => operator_says_applied(db, &t, &k, "fx-quote", record).await,
    }
    let done = until_done(&l, &t, &k, &b).await;
    assert_eq!(done.status, 201, "{}", String::from_utf8_lossy(&done.body));
    let w = done.json();
    assert_eq!(
        (w["id"].as_str(), w["amount_out"].as_i64()),
        (Some(id.as_str()), Some(1_626))
    );
    assert_eq!(vendor.quotes().await["quotes"], 1);
    assert_eq!(vendor.payouts().await["payouts"], 1);
    assert_books(&l, &t, 1_500, 2).await;
    l.stop().await;
}

/// Expands each test into one per engine.
macro_rules! per_engine {
    ($($name:ident),* $(,)?) => {
        mod sqlite { use super::*; $( #[tokio::test(flavor = "multi_thread", worker_threads = 4)] async fn $name() { super::$name(Engine::Sqlite).await } )* }
        mod postgres { use super::*; $( #[tokio::test(flavor = "multi_thread", worker_threads = 4)] async fn $name() { super::$name(Engine::Postgres).await } )* }
        mod mysql { use super::*; $( #[tokio::test(flavor = "multi_thread", worker_threads = 4)] async fn $name() { super::$name(Engine::Mysql).await } )* }
    };
}

per_engine!(
    a_withdrawal_crosses_two_vendors_once,
    refused_withdrawals_write_nothing,
    a_retry_resumes_after_lost_answers,
    a_completer_finishes_what_the_client_left,
    completers_and_retries_race_each_withdrawal_once,
    twins_of_a_first_request_withdraw_once,
    a_declined_withdrawal_is_compensated_once,
    an_unknown_outcome_is_held_until_an_operator_says,
);
