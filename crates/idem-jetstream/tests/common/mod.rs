//! What the consumer tests beside `events.rs` share: the real NATS server
//! (`IDEM_TEST_NATS_URL`, default `nats://127.0.0.1:4222`) and PostgreSQL
//! (`IDEM_TEST_POSTGRES_URL`), streams named after each test's own tag,
//! and consumers running in the background.

#![allow(dead_code, unreachable_pub)]

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::stream::{Config, Stream};
use async_nats::jetstream::{self, Context, consumer::pull, stream};
// Not every test binary that includes this module uses each one.
#[allow(unused_imports)]
pub use idem_conformance::env::{nats_url, postgres_url};
use idem_core::{BoxFuture, TableName, TxBackend};
use idem_jetstream::{Event, HandlerError, InboxConsumer};

/// A name no other test (or run) uses.
pub fn tag() -> String {
    let t = uuid::Uuid::now_v7().simple().to_string();
    t[t.len() - 12..].to_owned()
}

/// A JetStream context on the test server; fails loudly when it is not there.
pub async fn js() -> jetstream::Context {
    let url = nats_url();
    let client = async_nats::connect(&url)
        .await
        .unwrap_or_else(|e| panic!("cannot reach NATS at {url} (set IDEM_TEST_NATS_URL): {e}"));
    jetstream::new(client)
}

/// The largest `max_msg_size` the consumer accepts on this server, for a
/// dead-letter stream without a limit of its own.
pub fn largest_event(js: &jetstream::Context) -> i32 {
    let max_payload = js.client().server_info().max_payload;
    i32::try_from(max_payload - idem_jetstream::DEAD_LETTER_HEADROOM).expect("a size that fits an i32")
}

/// An events stream the consumer accepts: kept an hour (within the inbox
/// TTL), messages at most [`largest_event`]. `edit` changes what a test is
/// about.
pub async fn events_stream(js: &Context, name: &str, subjects: &str, edit: impl FnOnce(&mut Config)) -> Stream {
    let config = Config {
        max_age: Duration::from_secs(3_600),
        max_message_size: largest_event(js),
        duplicate_window: Duration::from_secs(1),
        ..memory_stream(name, subjects)
    };
    create_stream(js, config, edit).await
}

/// A dead-letter stream the consumer accepts (no max_age, no limit), with
/// `edit` applied.
pub async fn dead_stream(js: &Context, name: &str, subjects: &str, edit: impl FnOnce(&mut Config)) -> Stream {
    create_stream(js, memory_stream(name, subjects), edit).await
}

/// A stream in memory named `name` that captures `subjects.>`.
fn memory_stream(name: &str, subjects: &str) -> Config {
    Config {
        name: name.to_owned(),
        subjects: vec![format!("{subjects}.>")],
        storage: stream::StorageType::Memory,
        ..Default::default()
    }
}

/// Creates the stream `config` describes, with `edit` applied.
async fn create_stream(js: &Context, mut config: Config, edit: impl FnOnce(&mut Config)) -> Stream {
    edit(&mut config);
    let name = config.name.clone();
    js.create_stream(config)
        .await
        .unwrap_or_else(|e| panic!("create the stream {name}: {e}"))
}

/// A durable pull consumer as the inbox consumer wants it.
pub async fn durable(stream: &Stream, name: &str, ack_wait: Duration) -> jetstream::consumer::PullConsumer {
    stream
        .get_or_create_consumer(
            name,
            pull::Config {
                durable_name: Some(name.into()),
                ack_policy: jetstream::consumer::AckPolicy::Explicit,
                ack_wait,
                max_deliver: -1,
                ..Default::default()
            },
        )
        .await
        .expect("create the consumer")
}

/// Publishes `payload` to `subject` with `headers` and waits for the PubAck.
pub async fn publish(js: &jetstream::Context, subject: &str, headers: async_nats::HeaderMap, payload: Vec<u8>) {
    let publish = jetstream::message::PublishMessage::build()
        .headers(headers)
        .payload(payload.into());
    js.send_publish(subject.to_owned(), publish)
        .await
        .expect("publish")
        .await
        .expect("the server stored the message");
}

/// Headers from (name, value) pairs.
pub fn headers(pairs: &[(&str, &str)]) -> async_nats::HeaderMap {
    let mut h = async_nats::HeaderMap::new();
    for (name, value) in pairs {
        h.insert(*name, *value);
    }
    h
}

/// Messages stored in a stream now.
pub async fn stored(js: &jetstream::Context, stream: &str) -> Vec<async_nats::jetstream::message::StreamMessage> {
    let mut s = js.get_stream(stream).await.expect("the stream");
    let state = s.info().await.expect("stream info").state.clone();
    let mut out = Vec::new();
    if state.messages == 0 {
        return out;
    }
    for seq in state.first_sequence..=state.last_sequence {
        if let Ok(m) = s.get_raw_message(seq).await {
            out.push(m);
        }
    }
    out
}

/// Whether a durable consumer has nothing pending or unacknowledged.
pub async fn settled(stream: &Stream, name: &str) -> bool {
    let mut c: jetstream::consumer::PullConsumer = stream.get_consumer(name).await.expect("the consumer");
    let info = c.info().await.expect("consumer info");
    info.num_pending == 0 && info.num_ack_pending == 0
}

/// Waits for `check` to hold, up to 30 s.
pub async fn eventually<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while !check().await {
        assert!(tokio::time::Instant::now() < deadline, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A PostgreSQL inbox table of its own, with a pool for the effects.
pub async fn open_postgres(tag: &str) -> (idem_postgres::PgStore, sqlx::PgPool) {
    let url = postgres_url();
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(10)
        .connect(&url)
        .await
        .unwrap_or_else(|e| panic!("cannot reach PostgreSQL at {url} (set IDEM_TEST_POSTGRES_URL): {e}"));
    let store = idem_postgres::PgStore::new(pool.clone()).with_table(TableName::new(format!("inbox_{tag}")).unwrap());
    store.migrate().await.expect("migrate the inbox table");
    (store, pool)
}

/// An SQLite inbox of its own.
pub async fn open_sqlite(tag: &str) -> idem_sqlite::SqliteStore {
    let path = std::env::temp_dir().join(format!("idem-checks-{tag}.db"));
    let store = idem_sqlite::SqliteStore::open(&path)
        .await
        .expect("open the SQLite file")
        .with_table(TableName::new(format!("inbox_{tag}")).unwrap());
    store.migrate().await.expect("migrate the inbox table");
    store
}

/// Forces a closure to the handler's higher-ranked signature.
pub fn handler<B, F>(f: F) -> F
where
    B: TxBackend,
    F: for<'c> Fn(&'c mut B::Tx, Arc<Event>) -> BoxFuture<'c, Result<(), HandlerError>> + Send + Sync + 'static,
{
    f
}

pub use idem_conformance::Running;

/// `consumer` running in the background until stopped.
pub fn run_consumer<B: TxBackend + Clone>(consumer: InboxConsumer<B>) -> Running {
    Running::spawn(move |stop| async move { consumer.run(stop).await })
}
