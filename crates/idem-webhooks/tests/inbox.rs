//! Verification plus deduplication on SQLite (the ledger's webhook route
//! runs the same piece on PostgreSQL, MariaDB and SQLite).

use http::{HeaderMap, HeaderValue};
use idem_core::{Error, StoreErrorKind, TableName, TxEngine};
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

async fn receive(
    w: &WebhookInbox<idem_sqlite::SqliteStore>,
    h: &HeaderMap,
    body: &[u8],
) -> Result<bool, ReceiveError<Error>> {
    w.receive(h, body, NOW, |tx| {
        Box::pin(async move {
            sqlx::query("INSERT INTO effects (id) VALUES ('x')")
                .execute(&mut **tx)
                .await
                .map_err(|e| Error::store(StoreErrorKind::Other, e))?;
            Ok::<_, Error>(())
        })
    })
    .await
    .map(|d| d.is_applied())
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
