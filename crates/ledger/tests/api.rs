//! The ledger's routes and the Idempotency-Key contract on every engine,
//! in-process and over a real socket.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use idem_core::ManualClock;
use ledger::Options;

fn top_up_body(account: &str, amount: i64) -> String {
    format!("{{\"account_id\":\"{account}\",\"amount\":{amount}}}")
}

fn transfer_body(from: &str, to: &str, amount: i64) -> String {
    format!("{{\"from\":\"{from}\",\"to\":\"{to}\",\"amount\":{amount}}}")
}

/// A ledger on `engine` over `transport`, a new tenant's token, and that
/// tenant's accounts named `names`, created in order.
async fn with_accounts<const N: usize>(
    engine: Engine,
    transport: Transport,
    names: [&str; N],
) -> (Ledger, String, [String; N]) {
    let l = Ledger::start(engine, transport).await;
    let t = token();
    let mut ids = std::array::from_fn(|_| String::new());
    for (id, name) in ids.iter_mut().zip(names) {
        *id = l.account(&t, name).await;
    }
    (l, t, ids)
}

/// Accounts: create, read, 404 across tenants and for unknown ids, 401 without a token.
async fn accounts(engine: Engine, transport: Transport) {
    let l = Ledger::start(engine, transport).await;
    let (alice, mallory) = (token(), token());
    let r = l
        .post("/v1/accounts", &alice, Some(&key()), r#"{"name":"alice"}"#)
        .await;
    assert_eq!(r.status, 201);
    let body = r.json();
    assert_eq!(body["name"], "alice");
    assert_eq!(body["balance"], 0);
    let id = body["id"].as_str().unwrap();
    let got = l.get(&format!("/v1/accounts/{id}"), &alice).await;
    assert_eq!(got.status, 200);
    assert_eq!(got.json(), body);
    l.assert_not_found("/v1/accounts", id, &alice, &mallory, "account-not-found")
        .await;
    l.send("GET", &format!("/v1/accounts/{id}"), None, None, None)
        .await
        .assert_problem(401, "unauthorized");
    l.send("POST", "/v1/accounts", None, Some(&key()), Some("{}"))
        .await
        .assert_problem(401, "unauthorized");
    // Account creation takes an optional key: without one it simply runs.
    let a = l.post("/v1/accounts", &alice, None, r#"{"name":"a2"}"#).await;
    let b = l.post("/v1/accounts", &alice, None, r#"{"name":"a2"}"#).await;
    assert_eq!((a.status, b.status), (201, 201));
    assert_ne!(a.json()["id"], b.json()["id"]);
    l.stop().await;
}

/// Top-ups and transfers move money; the audit proves conservation from the rows.
async fn money_moves_and_is_conserved(engine: Engine, transport: Transport) {
    let (l, t, [a, b]) = with_accounts(engine, transport, ["a", "b"]).await;
    let r = l.top_up(&t, &a, 100).await;
    assert_eq!(r.status, 201);
    let v = r.json();
    assert_eq!(
        (v["account_id"].as_str(), v["amount"].as_i64(), v["balance"].as_i64()),
        (Some(a.as_str()), Some(100), Some(100))
    );
    let r = l
        .post("/v1/transfers", &t, Some(&key()), &transfer_body(&a, &b, 30))
        .await;
    assert_eq!(r.status, 201);
    let v = r.json();
    assert_eq!(
        (v["from"].as_str(), v["to"].as_str(), v["amount"].as_i64()),
        (Some(a.as_str()), Some(b.as_str()), Some(30))
    );
    assert!(v["id"].is_string());
    assert_eq!(l.balance(&t, &a).await, 70);
    assert_eq!(l.balance(&t, &b).await, 30);
    let audit = l.audit(&t).await;
    assert_eq!(audit["balances_total"], 100);
    assert_eq!(audit["top_ups_total"], 100);
    assert_eq!(audit["payouts_total"], 0);
    assert_eq!(audit["negative_balances"], 0);
    assert_eq!(audit["conserved"], true);
    // Unknown accounts are 404 problems and move nothing.
    let ghost = "01900000-0000-7000-8000-000000000000";
    l.post("/v1/transfers", &t, Some(&key()), &transfer_body(&a, ghost, 1))
        .await
        .assert_problem(404, "account-not-found");
    l.post("/v1/top-ups", &t, Some(&key()), &top_up_body(ghost, 1))
        .await
        .assert_problem(404, "account-not-found");
    assert_eq!(l.audit(&t).await["journal_rows"], 2);
    l.stop().await;
}

/// A retry replays the byte-identical response, marked, and applies nothing; a reused key with another body is 422.
async fn replay_and_mismatch(engine: Engine, transport: Transport) {
    let (l, t, [a]) = with_accounts(engine, transport, ["a"]).await;
    let k = key();
    let first = l.post("/v1/top-ups", &t, Some(&k), &top_up_body(&a, 40)).await;
    assert_eq!(first.status, 201);
    assert!(!first.replayed(), "a first response is never marked replayed");
    // The same JSON with other key order and spacing is the same request.
    let reordered = format!("{{ \"amount\": 40, \"account_id\": \"{a}\" }}");
    for body in [top_up_body(&a, 40), reordered] {
        let again = l.post("/v1/top-ups", &t, Some(&k), &body).await;
        assert_eq!(again.status, 201);
        assert!(again.replayed());
        assert_eq!(again.body, first.body, "byte-identical replay");
        assert_eq!(again.headers["content-type"], first.headers["content-type"]);
    }
    assert_eq!(l.balance(&t, &a).await, 40, "applied once");
    let other = l.post("/v1/top-ups", &t, Some(&k), &top_up_body(&a, 41)).await;
    other.assert_problem(422, "idempotency-key-reused");
    assert_eq!(l.balance(&t, &a).await, 40);
    l.stop().await;
}

/// Missing and malformed keys on mutating routes are 400 problems; nothing is written.
async fn key_errors(engine: Engine, transport: Transport) {
    let (l, t, [a]) = with_accounts(engine, transport, ["a"]).await;
    l.post("/v1/top-ups", &t, None, &top_up_body(&a, 5))
        .await
        .assert_problem(400, "idempotency-key-missing");
    l.post("/v1/transfers", &t, None, &transfer_body(&a, &a, 5))
        .await
        .assert_problem(400, "idempotency-key-missing");
    for bad in [
        "\"\"",
        "\"unterminated",
        "two words",
        &format!("\"{}\"", "k".repeat(256)),
    ] {
        l.post("/v1/top-ups", &t, Some(bad), &top_up_body(&a, 5))
            .await
            .assert_problem(400, "idempotency-key-invalid");
    }
    // A bare token is accepted too.
    let bare = uuid::Uuid::now_v7().to_string();
    assert_eq!(
        l.post("/v1/top-ups", &t, Some(&bare), &top_up_body(&a, 5)).await.status,
        201
    );
    assert_eq!(l.balance(&t, &a).await, 5);
    l.stop().await;
}

/// Insufficient funds is a 422 problem that leaves the key unused: after a top-up, the same key succeeds.
async fn rejection_leaves_key_unused(engine: Engine, transport: Transport) {
    let (l, t, [a, b]) = with_accounts(engine, transport, ["a", "b"]).await;
    let k = key();
    let body = transfer_body(&a, &b, 50);
    let declined = l.post("/v1/transfers", &t, Some(&k), &body).await;
    declined.assert_problem(422, "insufficient-funds");
    assert!(!declined.replayed());
    assert_eq!(l.audit(&t).await["journal_rows"], 0);
    assert_eq!(l.top_up(&t, &a, 80).await.status, 201);
    let retried = l.post("/v1/transfers", &t, Some(&k), &body).await;
    assert_eq!(retried.status, 201, "the declined key was left unused");
    assert!(!retried.replayed());
    assert_eq!((l.balance(&t, &a).await, l.balance(&t, &b).await), (30, 50));
    l.stop().await;
}

/// Bad input is a 400 problem and writes nothing; the same key then works with a good body.
async fn bad_input_writes_nothing(engine: Engine, transport: Transport) {
    let (l, t, [a, b]) = with_accounts(engine, transport, ["a", "b"]).await;
    assert_eq!(l.top_up(&t, &a, 10).await.status, 201);
    let k = key();
    let cases = [
        ("{not json", "invalid-request"),
        ("[]", "invalid-request"),
        (&format!("{{\"account_id\":\"{a}\"}}"), "invalid-request"),
        (
            &format!("{{\"account_id\":\"{a}\",\"amount\":\"5\"}}"),
            "invalid-request",
        ),
        (
            &format!("{{\"account_id\":\"{a}\",\"amount\":5,\"memo\":\"x\"}}"),
            "invalid-request",
        ),
        (&format!("{{\"account_id\":\"{a}\",\"amount\":1.5}}"), "invalid-request"),
        (&format!("{{\"account_id\":\"{a}\",\"amount\":1e30}}"), "invalid-amount"),
        (
            &format!("{{\"account_id\":\"{a}\",\"amount\":99999999999999999999}}"),
            "invalid-amount",
        ),
        (&format!("{{\"account_id\":\"{a}\",\"amount\":-0.0}}"), "invalid-amount"),
        (&top_up_body(&a, 0), "invalid-amount"),
        (&top_up_body(&a, -5), "invalid-amount"),
        (&top_up_body(&a, 1_000_000_000_001), "invalid-amount"),
        (&top_up_body(&a, i64::MAX), "invalid-amount"),
        (&top_up_body("ABC", 5), "invalid-request"),
    ];
    for (body, slug) in cases {
        let r = l.post("/v1/top-ups", &t, Some(&k), body).await;
        r.assert_problem(400, slug);
    }
    l.post("/v1/transfers", &t, Some(&key()), &transfer_body(&a, &a, 1))
        .await
        .assert_problem(422, "same-account");
    l.post("/v1/transfers", &t, Some(&key()), &transfer_body(&a, &b, -1))
        .await
        .assert_problem(400, "invalid-amount");
    l.post("/v1/accounts", &t, Some(&key()), r#"{"name":""}"#)
        .await
        .assert_problem(400, "invalid-request");
    l.post("/v1/accounts", &t, Some(&key()), r#"{"nom":"x"}"#)
        .await
        .assert_problem(400, "invalid-request");
    let big = format!("{{\"name\":\"{}\"}}", "x".repeat(70_000));
    l.post("/v1/accounts", &t, Some(&key()), &big)
        .await
        .assert_problem(413, "request-body-too-large");
    let audit = l.audit(&t).await;
    assert_eq!(audit["journal_rows"], 1, "nothing was written");
    assert_eq!(audit["balances_total"], 10);
    let good = l.post("/v1/top-ups", &t, Some(&k), &top_up_body(&a, 5)).await;
    assert_eq!(good.status, 201, "the key stayed usable");
    assert_eq!(l.balance(&t, &a).await, 15);
    // JSON Schema's integers: a number with no fractional part is whole.
    let whole = format!("{{\"account_id\":\"{a}\",\"amount\":5.0}}");
    let r = l.post("/v1/top-ups", &t, Some(&key()), &whole).await;
    assert_eq!((r.status, r.json()["amount"].as_i64()), (201, Some(5)));
    assert_eq!(l.balance(&t, &a).await, 20);
    l.stop().await;
}

/// A JSON array in field order is not the object it mimics, and a body that
/// is not sent as JSON is 415: both write nothing and leave the key usable.
async fn wrong_types_and_media_write_nothing(engine: Engine, transport: Transport) {
    let (l, t, [a, b]) = with_accounts(engine, transport, ["a", "b"]).await;
    assert_eq!(l.top_up(&t, &a, 10).await.status, 201);
    let k = key();
    let arrays = [
        ("/v1/top-ups", format!("[\"{a}\", 500]")),
        ("/v1/transfers", format!("[\"{a}\", \"{b}\", 5]")),
        ("/v1/accounts", "[\"eve\"]".to_owned()),
        ("/v1/top-ups", " \n [\"x\"]".to_owned()),
        ("/v1/top-ups", "\"text\"".to_owned()),
        ("/v1/top-ups", "5".to_owned()),
        ("/v1/top-ups", "null".to_owned()),
    ];
    for (path, body) in &arrays {
        l.post(path, &t, Some(&k), body)
            .await
            .assert_problem(400, "invalid-request");
    }
    let auth = ("authorization".to_owned(), format!("Bearer {t}"));
    let idem = ("idempotency-key".to_owned(), k.clone());
    let body = top_up_body(&a, 500);
    for content_type in [
        None,
        Some("text/plain"),
        Some("application/x-www-form-urlencoded"),
        Some("application/jsonx"),
    ] {
        let mut headers = vec![auth.clone(), idem.clone()];
        if let Some(ct) = content_type {
            headers.push(("content-type".to_owned(), ct.to_owned()));
        }
        let r = l.send_raw("POST", "/v1/top-ups", &headers, Some(&body)).await;
        r.assert_problem(415, "unsupported-media-type");
        assert_eq!(r.headers["accept-post"], "application/json", "{content_type:?}");
    }
    let audit = l.audit(&t).await;
    assert_eq!(audit["journal_rows"], 1, "nothing was written");
    assert_eq!(l.balance(&t, &a).await, 10);
    let json_utf8 = ("content-type".to_owned(), "Application/JSON; charset=utf-8".to_owned());
    let r = l
        .send_raw("POST", "/v1/top-ups", &[auth, idem, json_utf8], Some(&body))
        .await;
    assert_eq!(
        r.status, 201,
        "the key stayed usable; media type parameters and case are fine"
    );
    assert_eq!(l.balance(&t, &a).await, 510);
    l.stop().await;
}

/// The Bearer scheme is case-insensitive; a token must be a token68.
async fn bearer_scheme_is_case_insensitive(engine: Engine, transport: Transport) {
    let (l, t, [a]) = with_accounts(engine, transport, ["a"]).await;
    for scheme in ["Bearer", "bearer", "BEARER", "bEaReR"] {
        let headers = [("authorization".to_owned(), format!("{scheme} {t}"))];
        let r = l.send_raw("GET", &format!("/v1/accounts/{a}"), &headers, None).await;
        assert_eq!(r.status, 200, "{scheme}");
    }
    for bad in [
        "Basic abc",
        "Bearer",
        "Bearer ",
        "Bearer a b",
        "Bearer a,b",
        "Bearer =abc",
        "Bearerabc",
    ] {
        let headers = [("authorization".to_owned(), bad.to_owned())];
        l.send_raw("GET", &format!("/v1/accounts/{a}"), &headers, None)
            .await
            .assert_problem(401, "unauthorized");
    }
    l.stop().await;
}

/// Unknown routes and methods are problems too; health and metrics answer.
async fn routes_and_operations(engine: Engine, transport: Transport) {
    let l = Ledger::start(engine, transport).await;
    let t = token();
    l.get("/v1/nothing-here", &t).await.assert_problem(404, "not-found");
    l.send("DELETE", "/v1/audit", Some(&t), Some(&key()), None)
        .await
        .assert_problem(405, "method-not-allowed");
    let h = l.send("GET", "/healthz", None, None, None).await;
    assert_eq!(h.status, 200);
    let a = l.account(&t, "a").await;
    l.top_up(&t, &a, 1).await;
    let m = l.send("GET", "/metrics", None, None, None).await;
    assert_eq!(m.status, 200);
    let text = String::from_utf8_lossy(&m.body);
    assert!(
        text.contains("idem_claims_total"),
        "metrics name idem's claims:\n{text}"
    );
    l.stop().await;
}

/// 50 concurrent identical transfers: exactly one applies; every other response is the same body or a 409 in-flight problem.
async fn fifty_concurrent_identical_transfers(engine: Engine, transport: Transport) {
    let l = Arc::new(Ledger::start(engine, transport).await);
    let t = token();
    let (a, b) = (l.account(&t, "a").await, l.account(&t, "b").await);
    assert_eq!(l.top_up(&t, &a, 1_000).await.status, 201);
    let k = key();
    let body = transfer_body(&a, &b, 7);
    let mut created = Vec::new();
    let mut in_flight = 0;
    for task in transfers_together(&l, &t, &k, &body, 50) {
        let r = task.await.unwrap();
        match r.status {
            201 => created.push(r),
            409 => {
                r.assert_problem(409, "idempotency-key-in-flight");
                in_flight += 1;
            }
            other => panic!("unexpected {other}: {}", String::from_utf8_lossy(&r.body)),
        }
    }
    assert!(!created.is_empty());
    assert!(
        created.iter().all(|r| r.body == created[0].body),
        "every success is the same body"
    );
    assert_eq!(
        created.iter().filter(|r| !r.replayed()).count(),
        1,
        "exactly one executed"
    );
    assert_eq!(created.len() + in_flight, 50);
    assert_eq!(
        (l.balance(&t, &a).await, l.balance(&t, &b).await),
        (993, 7),
        "exactly one transfer applied"
    );
    assert_eq!(l.audit(&t).await["journal_rows"], 2);
    Arc::into_inner(l).unwrap().stop().await;
}

/// `n` tasks that post the transfer `body` under key `k` at the same moment.
fn transfers_together(l: &Arc<Ledger>, t: &str, k: &str, body: &str, n: usize) -> Vec<tokio::task::JoinHandle<Resp>> {
    let barrier = Arc::new(tokio::sync::Barrier::new(n));
    (0..n)
        .map(|_| {
            let (l, t, k, body, barrier) = (l.clone(), t.to_owned(), k.to_owned(), body.to_owned(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                l.post("/v1/transfers", &t, Some(&k), &body).await
            })
        })
        .collect()
}

/// A key used by tenant A and sent by tenant B never returns A's response.
async fn tenants_never_share_responses(engine: Engine, transport: Transport) {
    let l = Ledger::start(engine, transport).await;
    let (ta, tb) = (token(), token());
    let (a, b) = (l.account(&ta, "a").await, l.account(&tb, "b").await);
    let k = key();
    let ra = l.post("/v1/top-ups", &ta, Some(&k), &top_up_body(&a, 11)).await;
    let rb = l.post("/v1/top-ups", &tb, Some(&k), &top_up_body(&b, 22)).await;
    assert_eq!((ra.status, rb.status), (201, 201));
    assert!(!rb.replayed());
    assert_ne!(ra.body, rb.body);
    // Even B sending A's exact body with A's key gets its own outcome (404: not B's account), never A's.
    let rb2 = l.post("/v1/top-ups", &tb, Some(&key()), &top_up_body(&a, 11)).await;
    rb2.assert_problem(404, "account-not-found");
    let rb3 = l.post("/v1/top-ups", &tb, Some(&k), &top_up_body(&b, 22)).await;
    assert!(rb3.replayed());
    assert_eq!(rb3.body, rb.body);
    assert_eq!((l.balance(&ta, &a).await, l.balance(&tb, &b).await), (11, 22));
    l.stop().await;
}

/// After a stop and restart on the same database, a replay is still byte-identical and marked.
async fn replay_survives_restart(engine: Engine, transport: Transport) {
    let (l, t, [a]) = with_accounts(engine, transport, ["a"]).await;
    let k = key();
    let first = l.post("/v1/top-ups", &t, Some(&k), &top_up_body(&a, 9)).await;
    assert_eq!(first.status, 201);
    let url = l.url.clone();
    l.stop().await;
    let l = Ledger::start_with(&url, transport, Arc::new(idem_core::SystemClock), Options::default()).await;
    let again = l.post("/v1/top-ups", &t, Some(&k), &top_up_body(&a, 9)).await;
    assert!(again.replayed());
    assert_eq!(again.body, first.body);
    assert_eq!(l.balance(&t, &a).await, 9);
    l.stop().await;
}

/// With a list of accepted tokens, any other token is refused.
async fn only_listed_tokens_are_accepted(engine: Engine, transport: Transport) {
    let (listed, other) = (token(), token());
    let options = Options {
        tokens: Arc::new([listed.clone()].into_iter().collect()),
        ..Options::default()
    };
    let l = Ledger::start_with(
        &database_url(engine),
        transport,
        Arc::new(idem_core::SystemClock),
        options,
    )
    .await;
    assert_eq!(
        l.post("/v1/accounts", &listed, None, r#"{"name":"a"}"#).await.status,
        201
    );
    l.post("/v1/accounts", &other, None, r#"{"name":"a"}"#)
        .await
        .assert_problem(401, "unauthorized");
    l.get("/v1/audit", &other).await.assert_problem(401, "unauthorized");
    assert_eq!(l.audit(&listed).await["journal_rows"], 0);
    l.stop().await;
}

/// A key past its TTL executes anew.
async fn expired_key_executes_anew(engine: Engine, transport: Transport) {
    let clock = ManualClock::starting_now();
    let l = Ledger::start_with(
        &database_url(engine),
        transport,
        Arc::new(clock.clone()),
        Options {
            key_ttl_secs: 60,
            ..Options::default()
        },
    )
    .await;
    let t = token();
    let a = l.account(&t, "a").await;
    let k = key();
    let body = top_up_body(&a, 5);
    assert!(!l.post("/v1/top-ups", &t, Some(&k), &body).await.replayed());
    clock.advance(Duration::from_secs(59));
    assert!(l.post("/v1/top-ups", &t, Some(&k), &body).await.replayed());
    clock.advance(Duration::from_secs(2));
    let anew = l.post("/v1/top-ups", &t, Some(&k), &body).await;
    assert_eq!(anew.status, 201);
    assert!(!anew.replayed(), "past its TTL the key executes anew");
    assert_eq!(l.balance(&t, &a).await, 10);
    l.stop().await;
}

/// With `read_first` on, the ledger's answers are those without it: the
/// same byte-identical replay, the same 422 for another body, one transfer
/// out of twenty identical ones sent together. (That retries then open no
/// transaction is counted by idem-http's and the conformance suite's
/// read-first tests.)
async fn read_first_replays_and_applies_once(engine: Engine, transport: Transport) {
    let options = Options {
        read_first: true,
        ..Options::default()
    };
    let l = Arc::new(
        Ledger::start_with(
            &database_url(engine),
            transport,
            Arc::new(idem_core::SystemClock),
            options,
        )
        .await,
    );
    let t = token();
    let (a, b) = (l.account(&t, "a").await, l.account(&t, "b").await);
    let k = key();
    let first = l.post("/v1/top-ups", &t, Some(&k), &top_up_body(&a, 40)).await;
    assert_eq!((first.status, first.replayed()), (201, false));
    let again = l.post("/v1/top-ups", &t, Some(&k), &top_up_body(&a, 40)).await;
    assert!(again.replayed());
    assert_eq!(again.body, first.body, "byte-identical replay");
    l.post("/v1/top-ups", &t, Some(&k), &top_up_body(&a, 41))
        .await
        .assert_problem(422, "idempotency-key-reused");
    let (k, body) = (key(), transfer_body(&a, &b, 7));
    let mut executed = 0;
    for task in transfers_together(&l, &t, &k, &body, 20) {
        let r = task.await.unwrap();
        match r.status {
            201 if !r.replayed() => executed += 1,
            201 => {}
            409 => r.assert_problem(409, "idempotency-key-in-flight"),
            other => panic!("unexpected {other}: {}", String::from_utf8_lossy(&r.body)),
        }
    }
    assert!(executed <= 1, "at most one of the twins executed");
    let last = l.post("/v1/transfers", &t, Some(&k), &body).await;
    assert_eq!(last.status, 201);
    assert_eq!(
        (l.balance(&t, &a).await, l.balance(&t, &b).await),
        (33, 7),
        "the top-up and the transfer applied once each"
    );
    Arc::into_inner(l).unwrap().stop().await;
}

matrix!(
    accounts,
    money_moves_and_is_conserved,
    replay_and_mismatch,
    key_errors,
    rejection_leaves_key_unused,
    bad_input_writes_nothing,
    wrong_types_and_media_write_nothing,
    bearer_scheme_is_case_insensitive,
    only_listed_tokens_are_accepted,
    routes_and_operations,
    fifty_concurrent_identical_transfers,
    tenants_never_share_responses,
    replay_survives_restart,
    expired_key_executes_anew,
    read_first_replays_and_applies_once
);
