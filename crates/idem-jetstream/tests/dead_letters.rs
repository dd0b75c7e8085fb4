//! Dead letters and redrives against the real NATS JetStream server
//! (`IDEM_TEST_NATS_URL`, default `nats://127.0.0.1:4222`) and PostgreSQL
//! or SQLite: a redrive applies an event at most once however late its
//! copies come, a message at the size limit still ends as a dead letter,
//! and a dead letter the dead-letter stream refuses is kept later without
//! the handler running again.
//!
//! Each test has its own streams and tables, and deletes its streams at the
//! end.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use async_nats::jetstream::Context;
use async_nats::jetstream::stream::{Config, DiscardPolicy, Stream};
use common::*;
use idem_core::{BoxFuture, ManualClock, TxBackend, TxEngine};
use idem_inbox::Inbox;
use idem_jetstream::{
    ConsumerOptions, DeadLetterFilter, EVENT_ID, Event, HandlerError, InboxConsumer, MSG_ID, REDRIVE,
};

/// A test's events stream (`EV_<tag>`, subjects `ev_<tag>.>`) and its
/// dead-letter stream (`DL_<tag>`, subjects `dl_<tag>.>`).
struct Streams {
    tag: String,
    js: Context,
    events: String,
    dead: String,
    events_stream: Stream,
}

impl Streams {
    /// Creates the two streams under a fresh tag, the dead-letter stream
    /// with `edit` applied.
    async fn create(edit: impl FnOnce(&mut Config)) -> Self {
        let tag = tag();
        let js = js().await;
        let (events, dead) = (format!("EV_{tag}"), format!("DL_{tag}"));
        let events_stream = events_stream(&js, &events, &format!("ev_{tag}"), |_| {}).await;
        dead_stream(&js, &dead, &format!("dl_{tag}"), edit).await;
        Self {
            tag,
            js,
            events,
            dead,
            events_stream,
        }
    }

    /// Starts the inbox consumer `name` of the events stream (a durable
    /// consumer that waits 5 s for an acknowledgement), running `work`
    /// through `inbox` in the background.
    async fn consume<B, H>(&self, name: &str, inbox: Inbox<B>, options: ConsumerOptions, work: H) -> Running
    where
        B: TxBackend + Clone,
        H: for<'c> Fn(&'c mut B::Tx, Arc<Event>) -> BoxFuture<'c, Result<(), HandlerError>> + Send + Sync + 'static,
    {
        let consumer = durable(&self.events_stream, name, Duration::from_secs(5)).await;
        let consumer = InboxConsumer::start(self.js.clone(), consumer, inbox, options, work)
            .await
            .expect("start");
        run_consumer(consumer)
    }

    async fn delete(&self) {
        let _ = self.js.delete_stream(&self.events).await;
        let _ = self.js.delete_stream(&self.dead).await;
    }
}

/// A redriven event is applied once, even when a copy comes after the
/// inbox forgot the event's own "dead-lettered" record: the copy a
/// consumer committed and did not acknowledge, delivered again after its
/// restart eight days later, and a second redrive of a dead letter whose
/// delete failed, eight days later still.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_redriven_event_is_applied_once_after_its_dead_letter_record_expires() {
    // The dead letter's delete fails: it stays after its redrive.
    let streams = Streams::create(|d| d.deny_delete = true).await;
    let (tag, js, dead, events_stream) = (&streams.tag, &streams.js, &streams.dead, &streams.events_stream);
    let subject = format!("ev_{tag}.created");
    let (store, pool) = open_postgres(tag).await;
    let effects = format!("effects_{tag}");
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE {effects} (event_id TEXT NOT NULL)"
    )))
    .execute(&pool)
    .await
    .expect("create the effects table");
    let count = || {
        let (pool, effects) = (pool.clone(), effects.clone());
        async move {
            sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(format!("SELECT COUNT(*) FROM {effects}")))
                .fetch_one(&pool)
                .await
                .expect("count the effects")
        }
    };

    let clock = ManualClock::starting_now();
    let broken = Arc::new(AtomicBool::new(true));
    let (down, table) = (broken.clone(), effects.clone());
    let work = handler::<idem_postgres::PgStore, _>(move |tx, event| {
        let (down, table) = (down.clone(), table.clone());
        Box::pin(async move {
            if down.load(Ordering::SeqCst) {
                return Err(HandlerError::reject("the projection is broken"));
            }
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "INSERT INTO {table} (event_id) VALUES ($1)"
            )))
            .bind(event.id.clone())
            .execute(&mut **tx)
            .await
            .map_err(HandlerError::retry)?;
            Ok(())
        })
    });
    let mut options = ConsumerOptions::new("projection");
    options.dead_letter_subject = format!("dl_{tag}.projection");
    let inbox = Inbox::new(TxEngine::new(store).with_clock(Arc::new(clock.clone())));
    let running = streams.consume("projection", inbox, options, work).await;

    let id = format!("evt-{tag}");
    publish(js, &subject, headers(&[(MSG_ID, &id)]), br#"{"v":1}"#.to_vec()).await;
    eventually("a dead letter", || async { stored(js, dead).await.len() == 1 }).await;
    broken.store(false, Ordering::SeqCst);
    let filter = DeadLetterFilter {
        handler: Some("projection".into()),
        limit: 10,
        ..Default::default()
    };
    let pace = idem_jetstream::RedriveOptions {
        max: 10,
        per_second: 50,
    };
    let report = idem_jetstream::redrive(js, dead, &filter, pace).await.expect("redrive");
    assert!(report.redriven.is_empty(), "the delete is denied: {report:?}");
    assert_eq!(report.failed.len(), 1, "{report:?}");
    assert!(report.failed[0].1.contains("not deleted"), "{report:?}");
    eventually("the redrive applied it", || async { count().await == 1 }).await;
    eventually("the copy is acknowledged", || settled(events_stream, "projection")).await;

    // Eight days later the event's own record (seven days) is gone; the
    // consumer that committed the copy without acknowledging it gets it
    // again.
    clock.advance(Duration::from_secs(8 * 86_400));
    let copy = headers(&[
        (REDRIVE, "projection"),
        (EVENT_ID, &id),
        (MSG_ID, "the-same-copy-delivered-again"),
    ]);
    publish(js, &subject, copy, br#"{"v":1}"#.to_vec()).await;
    eventually("the copy is acknowledged", || settled(events_stream, "projection")).await;
    assert_eq!(count().await, 1, "the copy delivered again applied nothing");

    // Eight more days: the dead letter is still there, and redriven again
    // (past the events stream's one-second duplicate window).
    clock.advance(Duration::from_secs(8 * 86_400));
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    let report = idem_jetstream::redrive(js, dead, &filter, pace).await.expect("redrive");
    assert_eq!(report.failed.len(), 1, "a copy is published again: {report:?}");
    eventually("the second copy is acknowledged", || async {
        settled(events_stream, "projection").await && stored(js, &streams.events).await.len() == 4
    })
    .await;
    running.stop().await;
    assert_eq!(count().await, 1, "a second redrive applied nothing");
    streams.delete().await;
}

/// A message exactly at its stream's `max_msg_size`, with the longest
/// handler name, event id and error and a long subject, still ends as a
/// dead letter (its error text cut to fit the server's `max_payload`)
/// instead of being delivered again and again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_message_at_the_size_limit_ends_as_a_dead_letter() {
    let streams = Streams::create(|_| {}).await;
    let (tag, js, dead, events_stream) = (&streams.tag, &streams.js, &streams.dead, &streams.events_stream);
    let largest = usize::try_from(largest_event(js)).unwrap();
    let subject = format!("ev_{tag}.{}", vec!["abcdefghijklmnopqrstuvwxyz"; 75].join("."));
    assert!(subject.len() > 2_000);
    let handler_name = format!("h{}", "x".repeat(254));
    let id = format!("e{tag}{}", "i".repeat(254 - tag.len()));
    assert_eq!((handler_name.len(), id.len()), (255, 255));
    // "NATS/1.0\r\n", "Nats-Msg-Id: <id>\r\n", "\r\n".
    let payload = vec![b'x'; largest - (12 + MSG_ID.len() + 4 + id.len())];
    let over = headers(&[(MSG_ID, "one-byte-over")]);
    let too_large = vec![b'x'; largest - (12 + MSG_ID.len() + 4 + "one-byte-over".len()) + 1];
    let refused = js
        .send_publish(
            subject.clone(),
            async_nats::jetstream::message::PublishMessage::build()
                .headers(over)
                .payload(too_large.into()),
        )
        .await
        .expect("sent")
        .await;
    assert!(refused.is_err(), "one byte over max_msg_size is refused");
    publish(js, &subject, headers(&[(MSG_ID, &id)]), payload.clone()).await;

    let store = open_sqlite(tag).await;
    let runs = Arc::new(AtomicUsize::new(0));
    let seen = runs.clone();
    let work = handler::<idem_sqlite::SqliteStore, _>(move |_tx, _event| {
        seen.fetch_add(1, Ordering::SeqCst);
        Box::pin(async { Err(HandlerError::reject("€".repeat(600))) })
    });
    let mut options = ConsumerOptions::new(handler_name.clone());
    options.dead_letter_subject = format!("dl_{tag}.h");
    options.retry_delays = vec![Duration::from_millis(50)];
    let inbox = Inbox::new(TxEngine::new(store));
    let running = streams.consume("big", inbox, options, work).await;
    eventually("a dead letter", || async { stored(js, dead).await.len() == 1 }).await;
    eventually("the message is terminated", || settled(events_stream, "big")).await;
    running.stop().await;
    assert_eq!(runs.load(Ordering::SeqCst), 1, "rejected once, kept at once");
    let letter = stored(js, dead).await.remove(0);
    let header = |name: &str| letter.headers.get(name).map(|v| v.as_str().to_owned());
    assert_eq!(header(EVENT_ID).as_deref(), Some(id.as_str()));
    assert_eq!(header("Idem-Handler").as_deref(), Some(handler_name.as_str()));
    assert_eq!(header("Idem-Subject").as_deref(), Some(subject.as_str()));
    let error = header("Idem-Error").unwrap_or_default();
    assert!(error.starts_with("permanent failure: €€"), "{error}");
    assert!(error.len() < 1_500, "cut to fit: {} bytes", error.len());
    assert_eq!(letter.payload.as_ref(), payload.as_slice());
    streams.delete().await;
}

/// A dead-letter stream that is full refuses the dead letter (discard New)
/// instead of evicting another: the event's key is closed first, so the
/// message is delivered again without running the handler, until there is
/// room and its dead letter is stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_dead_letter_refused_by_a_full_stream_is_kept_once_there_is_room() {
    let streams = Streams::create(|d| {
        d.max_messages = 1;
        d.discard = DiscardPolicy::New;
    })
    .await;
    let (tag, js, dead, events_stream) = (&streams.tag, &streams.js, &streams.dead, &streams.events_stream);
    publish(js, &format!("dl_{tag}.other"), headers(&[]), b"another".to_vec()).await;
    let filler = stored(js, dead).await.remove(0).sequence;

    let store = open_sqlite(tag).await;
    let runs = Arc::new(AtomicUsize::new(0));
    let seen = runs.clone();
    let work = handler::<idem_sqlite::SqliteStore, _>(move |_tx, _event| {
        seen.fetch_add(1, Ordering::SeqCst);
        Box::pin(async { Err(HandlerError::retry("the database is down")) })
    });
    let mut options = ConsumerOptions::new("h");
    options.dead_letter_subject = format!("dl_{tag}.h");
    options.max_deliveries = 2;
    options.retry_delays = vec![Duration::from_millis(100)];
    let inbox = Inbox::new(TxEngine::new(store));
    let running = streams.consume("h", inbox, options, work).await;
    let id = format!("evt-{tag}");
    publish(
        js,
        &format!("ev_{tag}.created"),
        headers(&[(MSG_ID, &id)]),
        b"{}".to_vec(),
    )
    .await;
    eventually("the dead letter is refused a few times", || {
        let events_stream = events_stream.clone();
        async move {
            let mut c: async_nats::jetstream::consumer::PullConsumer =
                events_stream.get_consumer("h").await.expect("the consumer");
            c.info().await.expect("consumer info").delivered.consumer_sequence >= 5
        }
    })
    .await;
    assert_eq!(stored(js, dead).await.len(), 1, "only the other message");
    js.get_stream(dead)
        .await
        .unwrap()
        .delete_message(filler)
        .await
        .expect("make room");
    eventually("the dead letter is stored", || async {
        stored(js, dead)
            .await
            .iter()
            .any(|m| m.headers.get(EVENT_ID).map(|v| v.as_str()) == Some(id.as_str()))
    })
    .await;
    eventually("the message is terminated", || settled(events_stream, "h")).await;
    running.stop().await;
    assert_eq!(
        runs.load(Ordering::SeqCst),
        2,
        "the handler never ran after its key was closed"
    );
    let letter = stored(js, dead).await.remove(0);
    assert_eq!(letter.headers.get("Idem-Deliveries").map(|v| v.as_str()), Some("2"));
    streams.delete().await;
}
