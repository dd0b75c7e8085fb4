//! Verification plus deduplication on SQLite (the ledger's webhook route
//! runs the same piece on PostgreSQL, MariaDB and SQLite).

use http::{HeaderMap, HeaderValue};
use idem_core::{BoxFuture, Error, StoreErrorKind, TableName, Tenant, TxEngine};
use idem_inbox::Inbox;
use idem_webhooks::{ReceiveError, Verifier, WebhookError, WebhookInbox, sign};

const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
const NOW: i64 = 1_732_450_000;

fn headers(id: &str, timestamp: i64, signature: &str) -> HeaderMap {
    let mut h = HeaderMap::new();
    h.insert("webhook-id", HeaderValue::from_str(id).unwrap());
    h.insert(
        "webhook-timestamp",
        HeaderValue::from_str(&timestamp.to_string()).unwrap(),
    );
    h.insert("webhook-signature", HeaderValue::from_str(signature).unwrap());
    h
}

async fn subject() -> (WebhookInbox<idem_sqlite::SqliteStore>, sqlx::SqlitePool) {
    let path = std::env::temp_dir().join(format!("idem-webhooks-{}.db", uuid::Uuid::now_v7()));
    let store = idem_sqlite::SqliteStore::open(&path)
        .await
        .unwrap()
        .with_table(TableName::new("webhook_inbox").unwrap());
    store.migrate().await.unwrap();
    let pool = store.pool().clone();
    sqlx::query("CREATE TABLE effects (id TEXT NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();
    let verifier = Verifier::new(["whsec_b2xkLW9sZC1vbGQtb2xkLXNlY3JldA==", SECRET]).unwrap();
    (
        WebhookInbox::new(verifier, Inbox::new(TxEngine::new(store)), "payments"),
        pool,
    )
}

fn tenant(name: &str) -> Tenant {
    Tenant::new(name).unwrap()
}

async fn receive(
    w: &WebhookInbox<idem_sqlite::SqliteStore>,
    h: &HeaderMap,
    body: &[u8],
) -> Result<bool, ReceiveError<Error>> {
    receive_for(w, &tenant("acme"), h, body).await
}

async fn receive_for(
    w: &WebhookInbox<idem_sqlite::SqliteStore>,
    tenant: &Tenant,
    h: &HeaderMap,
    body: &[u8],
) -> Result<bool, ReceiveError<Error>> {
    w.receive(tenant, h, body, NOW, |tx| insert_effect(tx, "x"))
        .await
        .map(|d| d.is_applied())
}

/// The webhook's effect: one row `id` in `effects`, in the delivery's
/// transaction.
fn insert_effect<'c>(tx: &'c mut idem_sqlite::SqliteTx, id: &'static str) -> BoxFuture<'c, Result<(), Error>> {
    Box::pin(async move {
        sqlx::query("INSERT INTO effects (id) VALUES (?1)")
            .bind(id)
            .execute(&mut **tx)
            .await
            .map_err(|e| Error::store(StoreErrorKind::Other, e))?;
        Ok(())
    })
}

async fn effects(pool: &sqlx::SqlitePool) -> i64 {
    sqlx::query_scalar("SELECT COUNT(*) FROM effects")
        .fetch_one(pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn a_verified_webhook_applies_once_and_a_refused_one_writes_nothing() {
    let (w, pool) = subject().await;
    let body = br#"{"amount":5}"#;
    let good = headers("msg_1", NOW - 10, &sign(SECRET, "msg_1", NOW - 10, body).unwrap());
    assert!(receive(&w, &good, body).await.unwrap(), "first delivery applies");
    assert!(
        !receive(&w, &good, body).await.unwrap(),
        "the provider's retry is a no-op"
    );
    assert_eq!(effects(&pool).await, 1);

    // A tampered body, a wrong secret, a stale timestamp: refused, nothing written.
    let tampered = receive(&w, &good, br#"{"amount":500}"#).await;
    assert!(
        matches!(tampered, Err(ReceiveError::Refused(WebhookError::Signature))),
        "{tampered:?}"
    );
    let other = "whsec_c29tZW9uZS1lbHNlcy1zZWNyZXQ=";
    let forged = headers("msg_2", NOW, &sign(other, "msg_2", NOW, body).unwrap());
    assert!(matches!(
        receive(&w, &forged, body).await,
        Err(ReceiveError::Refused(WebhookError::Signature))
    ));
    let old = NOW - 3_600;
    let stale = headers("msg_3", old, &sign(SECRET, "msg_3", old, body).unwrap());
    assert!(matches!(
        receive(&w, &stale, body).await,
        Err(ReceiveError::Refused(WebhookError::Stale { .. }))
    ));
    assert_eq!(effects(&pool).await, 1);

    // During a rotation the provider sends two signatures; either secret verifies.
    let both = format!("v1,AAAA {}", sign(SECRET, "msg_4", NOW, body).unwrap());
    assert!(receive(&w, &headers("msg_4", NOW, &both), body).await.unwrap());
    assert_eq!(effects(&pool).await, 2);
}

/// Two tenants whose providers happen to send the same `webhook-id` get two
/// effects: the id is scoped to the tenant before it is looked up. Each
/// tenant's retry is still a no-op.
#[tokio::test]
async fn two_tenants_sharing_a_webhook_id_are_two_events() {
    let (w, pool) = subject().await;
    let body = br#"{"amount":5}"#;
    let h = headers("msg_shared", NOW, &sign(SECRET, "msg_shared", NOW, body).unwrap());
    assert!(receive_for(&w, &tenant("acme"), &h, body).await.unwrap());
    assert!(
        receive_for(&w, &tenant("globex"), &h, body).await.unwrap(),
        "another tenant's event"
    );
    assert!(!receive_for(&w, &tenant("acme"), &h, body).await.unwrap());
    assert!(!receive_for(&w, &tenant("globex"), &h, body).await.unwrap());
    assert_eq!(effects(&pool).await, 2);
}

/// What is applied is what was verified: the body and the event id come
/// from the `Verified` value; an event id read from the body keys the
/// webhook, so a provider retry under a new `webhook-id` is a no-op, and
/// the same event id with another (verified) body is a mismatch.
#[tokio::test]
async fn the_verified_body_and_event_id_are_what_is_applied() {
    let (w, pool) = subject().await;
    let acme = tenant("acme");
    let apply = |id: &'static str, body: &'static [u8]| {
        let w = &w;
        let acme = &acme;
        async move {
            let h = headers(id, NOW, &sign(SECRET, id, NOW, body).unwrap());
            let verified = w
                .verify(acme, &h, body, NOW)
                .unwrap()
                .keyed_by(|body| {
                    let v: serde_json::Value = serde_json::from_slice(body).map_err(|e| e.to_string())?;
                    v["event"]
                        .as_str()
                        .map(str::to_owned)
                        .ok_or_else(|| "no event".to_owned())
                })
                .unwrap();
            assert_eq!(verified.body(), body);
            assert_eq!(verified.webhook_id(), id);
            let event = verified.event_id().to_owned();
            let r = w
                .apply(&verified, |tx| insert_effect(tx, "y"))
                .await
                .map(|d| d.is_applied());
            (event, r)
        }
    };
    let (event, first) = apply("msg_a", br#"{"event":"evt_1","amount":5}"#).await;
    assert_eq!(event, "evt_1");
    assert!(first.unwrap());
    let (_, retry) = apply("msg_b", br#"{"event":"evt_1","amount":5}"#).await;
    assert!(!retry.unwrap(), "the same event under a new webhook-id is a no-op");
    let (_, changed) = apply("msg_c", br#"{"event":"evt_1","amount":500}"#).await;
    assert!(matches!(changed, Err(Error::Mismatch)), "{changed:?}");
    assert_eq!(effects(&pool).await, 1);
}

/// Deliveries signed under Svix's header names verify and deduplicate the
/// same way.
#[tokio::test]
async fn svix_header_names_verify_and_deduplicate() {
    let (w, pool) = subject().await;
    let body = br#"{"amount":7}"#;
    let mut h = HeaderMap::new();
    h.insert("svix-id", HeaderValue::from_static("msg_svix"));
    h.insert("svix-timestamp", HeaderValue::from_str(&NOW.to_string()).unwrap());
    h.insert(
        "svix-signature",
        HeaderValue::from_str(&sign(SECRET, "msg_svix", NOW, body).unwrap()).unwrap(),
    );
    assert!(receive(&w, &h, body).await.unwrap());
    assert!(!receive(&w, &h, body).await.unwrap());
    // The standard names for the same message are the same event.
    let standard = headers("msg_svix", NOW, &sign(SECRET, "msg_svix", NOW, body).unwrap());
    assert!(!receive(&w, &standard, body).await.unwrap());
    assert!(matches!(
        receive(&w, &h, br#"{"amount":700}"#).await,
        Err(ReceiveError::Refused(WebhookError::Signature))
    ));
    assert_eq!(effects(&pool).await, 1);
}
