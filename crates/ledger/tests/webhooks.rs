//! `POST /v1/webhooks/payments` on every engine, in-process and over a
//! socket: signed per Standard Webhooks, applied once per (tenant, event
//! id), and refused with a problem (nothing written) for a bad signature, a
//! stale timestamp or a malformed body.

mod common;

use common::*;
use ledger::api::DEMO_WEBHOOK_SECRET;

fn now_secs() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
}

fn body(event_id: &str, account: &str, amount: i64) -> String {
    format!(r#"{{"event_id":"{event_id}","account_id":"{account}","amount":{amount}}}"#)
}

/// Sends a webhook signed with `secret` at `timestamp`.
async fn webhook(l: &Ledger, token: &str, body: &str, secret: &str, timestamp: i64) -> Resp {
    let id = format!("msg_{}", uuid::Uuid::now_v7().simple());
    let signature = idem_webhooks::sign(secret, &id, timestamp, body.as_bytes()).unwrap();
    let headers = vec![
        ("authorization".to_owned(), format!("Bearer {token}")),
        ("content-type".to_owned(), "application/json".to_owned()),
        ("webhook-id".to_owned(), id),
        ("webhook-timestamp".to_owned(), timestamp.to_string()),
        ("webhook-signature".to_owned(), signature),
    ];
    l.send_raw("POST", "/v1/webhooks/payments", &headers, Some(body)).await
}

async fn signed(l: &Ledger, token: &str, body: &str) -> Resp {
    webhook(l, token, body, DEMO_WEBHOOK_SECRET, now_secs()).await
}

async fn a_signed_webhook_tops_up_once(engine: Engine, transport: Transport) {
    let l = Ledger::start(engine, transport).await;
    let t = token();
    let a = l.account(&t, "a").await;
    let b = body("evt_1", &a, 700);
    let first = signed(&l, &t, &b).await;
    assert_eq!(first.status, 200, "{}", String::from_utf8_lossy(&first.body));
    assert!(!first.replayed());
    assert_eq!(first.json()["balance"], 700);
    assert_eq!(first.json()["event_id"], "evt_1");
    // The provider retries (a new webhook-id and signature, the same event).
    for _ in 0..3 {
        let again = signed(&l, &t, &b).await;
        assert_eq!(again.status, 200);
        assert!(again.replayed(), "a redelivery is answered from the record");
        assert_eq!(again.body, first.body);
    }
    assert_eq!(l.balance(&t, &a).await, 700);
    let audit = l.audit(&t).await;
    assert_eq!(audit["top_ups_total"], 700);
    assert_eq!(audit["conserved"], true);
    // The same event id with another body is a provider bug: refused.
    signed(&l, &t, &body("evt_1", &a, 701))
        .await
        .assert_problem(422, "webhook-event-reused");
    assert_eq!(l.balance(&t, &a).await, 700);
    l.stop().await;
}

async fn refused_webhooks_write_nothing(engine: Engine, transport: Transport) {
    let l = Ledger::start(engine, transport).await;
    let t = token();
    let a = l.account(&t, "a").await;
    let b = body("evt_2", &a, 50);
    let other_secret = "whsec_c29tZW9uZS1lbHNlcy1zZWNyZXQ=";
    webhook(&l, &t, &b, other_secret, now_secs())
        .await
        .assert_problem(401, "webhook-signature-invalid");
    webhook(&l, &t, &b, DEMO_WEBHOOK_SECRET, now_secs() - 3_600)
        .await
        .assert_problem(400, "webhook-timestamp-invalid");
    webhook(&l, &t, &b, DEMO_WEBHOOK_SECRET, now_secs() + 3_600)
        .await
        .assert_problem(400, "webhook-timestamp-invalid");
    // Signed, but not a valid body: malformed JSON, unknown fields, bad amounts.
    for bad in [
        "{".to_owned(),
        format!(r#"{{"event_id":"e","account_id":"{a}","amount":5,"extra":1}}"#),
        body("evt_3", &a, 0),
        body("evt_3", &a, -5),
        body("", &a, 5),
        r#"["evt_3"]"#.to_owned(),
    ] {
        let r = signed(&l, &t, &bad).await;
        assert_eq!(r.status, 400, "{bad}: {}", String::from_utf8_lossy(&r.body));
    }
    // A valid webhook for an account that does not exist (for this tenant).
    signed(&l, &t, &body("evt_4", "0193aaaa-bbbb-7ccc-8ddd-eeeeeeeeeeee", 5))
        .await
        .assert_problem(404, "account-not-found");
    // Missing headers, or no bearer token.
    let plain = vec![
        ("authorization".to_owned(), format!("Bearer {t}")),
        ("content-type".to_owned(), "application/json".to_owned()),
    ];
    l.send_raw("POST", "/v1/webhooks/payments", &plain, Some(&b))
        .await
        .assert_problem(400, "webhook-headers-invalid");
    l.send_raw("POST", "/v1/webhooks/payments", &plain[1..], Some(&b))
        .await
        .assert_problem(401, "unauthorized");
    // Over the body limit: a problem, before anything is verified or written.
    let huge = format!(
        r#"{{"event_id":"evt_9","account_id":"{a}","amount":5,"pad":"{}"}}"#,
        "x".repeat(70_000)
    );
    let r = signed(&l, &t, &huge).await;
    assert_eq!(r.status, 413, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(
        r.headers.get("content-type").map(|v| v.to_str().unwrap()),
        Some("application/problem+json")
    );
    let audit = l.audit(&t).await;
    assert_eq!(audit["journal_rows"], 0, "nothing was written");
    assert_eq!(l.balance(&t, &a).await, 0);
    // None of the refusals consumed the event id.
    assert_eq!(signed(&l, &t, &b).await.status, 200);
    assert_eq!(l.balance(&t, &a).await, 50);
    l.stop().await;
}

async fn event_ids_are_scoped_by_tenant(engine: Engine, transport: Transport) {
    let l = Ledger::start(engine, transport).await;
    let (ta, tb) = (token(), token());
    let (a, b) = (l.account(&ta, "a").await, l.account(&tb, "b").await);
    let ra = signed(&l, &ta, &body("evt_shared", &a, 10)).await;
    let rb = signed(&l, &tb, &body("evt_shared", &b, 20)).await;
    assert_eq!((ra.status, rb.status), (200, 200));
    assert!(!rb.replayed(), "another tenant's event is its own");
    assert_eq!(rb.json()["account_id"], b.as_str());
    assert_eq!((l.balance(&ta, &a).await, l.balance(&tb, &b).await), (10, 20));
    l.stop().await;
}

async fn concurrent_deliveries_apply_once(engine: Engine, transport: Transport) {
    let l = std::sync::Arc::new(Ledger::start(engine, transport).await);
    let t = token();
    let a = l.account(&t, "a").await;
    let b = body("evt_twins", &a, 3);
    let tasks: Vec<_> = (0..16)
        .map(|_| {
            let (l, t, b) = (l.clone(), t.clone(), b.clone());
            tokio::spawn(async move {
                loop {
                    let r = signed(&l, &t, &b).await;
                    if r.status != 409 {
                        return r;
                    }
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                }
            })
        })
        .collect();
    let mut applied = 0;
    for task in tasks {
        let r = task.await.unwrap();
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        applied += usize::from(!r.replayed());
    }
    assert_eq!(applied, 1);
    assert_eq!(l.balance(&t, &a).await, 3);
    std::sync::Arc::into_inner(l).unwrap().stop().await;
}

/// Deliveries under Svix's header names (`svix-id`, `svix-timestamp`,
/// `svix-signature`) verify and apply once like the standard ones; a
/// signature header with another scheme next to `v1` (`v1a,…`) verifies
/// by its `v1` signature.
async fn svix_header_names_are_accepted(engine: Engine, transport: Transport) {
    let l = Ledger::start(engine, transport).await;
    let t = token();
    let a = l.account(&t, "a").await;
    let b = body("evt_svix", &a, 40);
    let send = |family: &'static str, extra: &'static str| {
        let (l, t, b) = (&l, t.clone(), b.clone());
        async move {
            let id = format!("msg_{}", uuid::Uuid::now_v7().simple());
            let ts = now_secs();
            let signature = idem_webhooks::sign(DEMO_WEBHOOK_SECRET, &id, ts, b.as_bytes()).unwrap();
            let headers = vec![
                ("authorization".to_owned(), format!("Bearer {t}")),
                ("content-type".to_owned(), "application/json".to_owned()),
                (format!("{family}-id"), id),
                (format!("{family}-timestamp"), ts.to_string()),
                (format!("{family}-signature"), format!("{extra}{signature}")),
            ];
            l.send_raw("POST", "/v1/webhooks/payments", &headers, Some(&b)).await
        }
    };
    let first = send("svix", "").await;
    assert_eq!(first.status, 200, "{}", String::from_utf8_lossy(&first.body));
    assert!(!first.replayed());
    let again = send("svix", "v1a,c29tZSBvdGhlciBzY2hlbWU= ").await;
    assert_eq!(again.status, 200, "{}", String::from_utf8_lossy(&again.body));
    assert!(again.replayed());
    let standard = send("webhook", "v1a,c29tZSBvdGhlciBzY2hlbWU= ").await;
    assert_eq!(standard.status, 200);
    assert!(standard.replayed());
    assert_eq!(l.balance(&t, &a).await, 40);
    l.stop().await;
}

matrix!(
    svix_header_names_are_accepted,
    a_signed_webhook_tops_up_once,
    refused_webhooks_write_nothing,
    event_ids_are_scoped_by_tenant,
    concurrent_deliveries_apply_once
);
