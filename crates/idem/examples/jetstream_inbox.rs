//! A NATS JetStream consumer whose handler applies each event once: the
//! inbox claims (handler, event id) in the transaction of the handler's own
//! writes, so a redelivery finds the recorded outcome and runs nothing.
//!
//! Run (NATS with JetStream on 127.0.0.1:4222; the inbox in a SQLite file):
//!
//! ```sh
//! NATS_URL=nats://127.0.0.1:4222 cargo run -p idem --features jetstream,inbox,sqlite --example jetstream_inbox
//! #   published 3 messages for 2 events; applied 2 (one row per event)
//! ```

use std::time::Duration;

use idem::jetstream::async_nats::{
    self,
    jetstream::{self, consumer::pull, stream},
};
use idem::jetstream::{ConsumerOptions, HandlerError, InboxConsumer, handler};
use idem::sqlite::SqliteStore;
use idem::{TableName, TxEngine, inbox::Inbox};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into());
    let js = jetstream::new(async_nats::connect(&url).await?);
    let run = std::process::id();
    let (name, subjects) = (format!("EXAMPLE_{run}"), format!("example_{run}"));
    let max_payload = js.client().server_info().max_payload;
    let events = js
        .create_stream(stream::Config {
            name: name.clone(),
            subjects: vec![format!("{subjects}.>")],
            max_age: Duration::from_secs(24 * 3600), // the inbox keeps keys 7 days: longer than any redelivery
            // Room for a dead letter's headers under the server's max_payload.
            max_message_size: i32::try_from(max_payload - idem::jetstream::DEAD_LETTER_HEADROOM)?,
            duplicate_window: Duration::from_millis(100), // short, so that the example can show a duplicate
            storage: stream::StorageType::Memory,
            ..Default::default()
        })
        .await?;
    // Dead letters in a stream of their own, kept until they are handled
    // (no max_age, no limit).
    let dead = format!("{name}_DEAD");
    js.create_stream(stream::Config {
        name: dead.clone(),
        subjects: vec![format!("{subjects}_dead.>")],
        storage: stream::StorageType::Memory,
        ..Default::default()
    })
    .await?;
    let pull = events
        .get_or_create_consumer(
            "statements",
            pull::Config {
                durable_name: Some("statements".into()),
                ack_policy: jetstream::consumer::AckPolicy::Explicit,
                filter_subject: format!("{subjects}.orders.>"),
                ..Default::default()
            },
        )
        .await?;

    // The inbox, and the handler's own table, in one SQLite file.
    let path = std::env::temp_dir().join(format!("idem-example-inbox-{run}.db"));
    let store = SqliteStore::open(&path)
        .await?
        .with_table(TableName::new("idem_inbox")?);
    store.migrate().await?;
    sqlx::query("CREATE TABLE IF NOT EXISTS applied (event_id TEXT NOT NULL)")
        .execute(store.pool())
        .await?;
    let work = handler::<SqliteStore, _>(|tx, event| {
        Box::pin(async move {
            sqlx::query("INSERT INTO applied (event_id) VALUES (?)")
                .bind(event.id.clone())
                .execute(&mut **tx) // commits with the inbox's claim, or not at all
                .await
                .map_err(HandlerError::retry)?;
            Ok(())
        })
    });
    let mut options = ConsumerOptions::new("statements");
    options.dead_letter_subject = format!("{subjects}_dead.statements");
    let consumer = InboxConsumer::start(
        js.clone(),
        pull,
        Inbox::new(TxEngine::new(store.clone())),
        options,
        work,
    )
    .await?;

    // Two events, one of them published again later (as a relay that
    // crashed after the broker's acknowledgement would, once the stream's
    // duplicate window has passed): the stream keeps both copies, and the
    // inbox applies the event once.
    for (i, id) in ["order-1", "order-2", "order-1"].into_iter().enumerate() {
        if i == 2 {
            tokio::time::sleep(Duration::from_millis(300)).await; // past the duplicate window
        }
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(idem::jetstream::MSG_ID, id);
        js.publish_with_headers(format!("{subjects}.orders.created"), headers, "{}".into())
            .await?
            .await?;
    }
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(async move {
        consumer
            .run(async move {
                let _ = stopped.await;
            })
            .await
    });
    tokio::time::sleep(Duration::from_secs(2)).await;
    let _ = stop.send(());
    running.await?;

    let applied: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM applied")
        .fetch_one(store.pool())
        .await?;
    println!("published 3 messages for 2 events; applied {applied} (one row per event)");
    js.delete_stream(&name).await?;
    js.delete_stream(&dead).await?;
    let _ = std::fs::remove_file(&path);
    Ok(())
}
