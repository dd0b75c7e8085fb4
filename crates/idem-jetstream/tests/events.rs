//! The outbox, the relays and the inbox consumer on PostgreSQL, MariaDB and
//! SQLite against the real NATS JetStream server (`IDEM_TEST_NATS_URL`,
//! default `nats://127.0.0.1:4222`).
//!
//! Each test has its own tables, its own stream and subjects, and deletes
//! its streams at the end.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, consumer::pull, stream};
use common::{
    Running, dead_stream, durable, events_stream, eventually, handler, headers, js, publish, run_consumer, tag,
};
use idem_core::{BoxFuture, IdempotencyKey, OutboxBatch, OutboxEvent, OutboxStore, TableName, TxBackend, TxEngine};
use idem_inbox::Delivery;
use idem_inbox::Inbox;
use idem_jetstream::{
    ConsumerError, ConsumerOptions, DeadLetterFilter, Event, HandlerError, InboxConsumer, JetStreamPublisher, Recorded,
    RedriveOptions,
};
use idem_outbox::{Publisher, Relay, RelayOptions};

/// A stream of its own for one test.
struct Broker {
    js: jetstream::Context,
    events: stream::Stream,
    stream: String,
    subjects: String,
    dead_stream: String,
    dead_subject: String,
}

impl Broker {
    async fn new(tag: &str, duplicate_window: Duration) -> Self {
        let js = js().await;
        let (stream, subjects) = (format!("EVENTS_{tag}"), format!("events_{tag}"));
        let (dead_stream_name, dead_subject) = (format!("DEAD_{tag}"), format!("dead_{tag}"));
        // Kept within the inbox's TTL (only max_age bounds a redelivery),
        // with room for a dead letter's headers under the server's max_payload.
        let events = events_stream(&js, &stream, &subjects, |c| c.duplicate_window = duplicate_window).await;
        dead_stream(&js, &dead_stream_name, &dead_subject, |_| {}).await;
        Self {
            js,
            events,
            stream,
            subjects,
            dead_stream: dead_stream_name,
            dead_subject,
        }
    }

    fn subject(&self, kind: &str) -> String {
        format!("{}.{kind}", self.subjects)
    }

    async fn consumer(&self, name: &str, ack_wait: Duration) -> jetstream::consumer::PullConsumer {
        durable(&self.events, name, ack_wait).await
    }

    /// Every message of a stream: (event id, subject) per stored copy.
    async fn stored(&self, stream: &str, id_header: &str) -> Vec<(String, String)> {
        common::stored(&self.js, stream)
            .await
            .into_iter()
            .map(|m| {
                let id = m
                    .headers
                    .get(id_header)
                    .map(|v| v.as_str().to_owned())
                    .unwrap_or_default();
                (id, m.subject.to_string())
            })
            .collect()
    }

    /// Whether a durable consumer has nothing pending or unacknowledged.
    async fn settled(&self, name: &str) -> bool {
        common::settled(&self.events, name).await
    }

    /// Deliveries a durable consumer made, redeliveries included.
    async fn deliveries(&self, name: &str) -> u64 {
        let mut c = self.consumer(name, Duration::from_secs(5)).await;
        c.info().await.expect("consumer info").delivered.consumer_sequence
    }

    async fn published_ids(&self) -> Vec<String> {
        self.stored(&self.stream, "Nats-Msg-Id")
            .await
            .into_iter()
            .map(|(id, _)| id)
            .collect()
    }

    /// Publishes a copy of event `id` on the `created` subject under
    /// `msg_id`, as a redrive for `redrive` when given.
    async fn publish_copy(&self, id: &str, msg_id: &str, redrive: Option<&str>) {
        let mut copy = headers(&[("Nats-Msg-Id", msg_id)]);
        if let Some(handler) = redrive {
            copy.insert(idem_jetstream::REDRIVE, handler);
            copy.insert(idem_jetstream::EVENT_ID, id);
        }
        publish(&self.js, &self.subject("created"), copy, br#"{"v":1}"#.to_vec()).await;
    }

    /// Starts a consumer whose handler does nothing, which must be refused
    /// (`why` says why).
    async fn refused(
        &self,
        consumer: jetstream::consumer::PullConsumer,
        inbox: Inbox<idem_sqlite::SqliteStore>,
        options: ConsumerOptions,
        why: &str,
    ) -> ConsumerError {
        let work = handler::<idem_sqlite::SqliteStore, _>(|_tx, _e| Box::pin(async { Ok(()) }));
        InboxConsumer::start(self.js.clone(), consumer, inbox, options, work)
            .await
            .expect_err(why)
    }

    async fn cleanup(&self) {
        let _ = self.js.delete_stream(&self.stream).await;
        let _ = self.js.delete_stream(&self.dead_stream).await;
    }
}

/// A broker of its own and an SQLite inbox, for the start-up checks.
async fn sqlite_broker(duplicate_window: Duration) -> (String, Broker, idem_sqlite::SqliteStore) {
    let tag = tag();
    let broker = Broker::new(&tag, duplicate_window).await;
    let (store, _outbox, _pool) = open_sqlite(&tag).await;
    store.migrate().await.unwrap();
    (tag, broker, store)
}

/// Relays running in the background until stopped.
struct Relays(Vec<Running>);

impl Relays {
    fn start<S: OutboxStore>(n: usize, store: &S, js: &jetstream::Context) -> Self {
        Self(
            (0..n)
                .map(|i| {
                    let relay = Relay::new(
                        store.clone(),
                        JetStreamPublisher::new(js.clone()),
                        RelayOptions {
                            name: format!("test{i}"),
                            idle_wait: Duration::from_millis(10),
                            batch_size: 20,
                            backoff_min: Duration::from_millis(200),
                            backoff_max: Duration::from_secs(2),
                            ..Default::default()
                        },
                    );
                    Running::spawn(move |stop| async move { relay.run(stop).await })
                })
                .collect(),
        )
    }

    async fn stop(self) {
        for relay in self.0 {
            relay.stop().await;
        }
    }
}

/// How many times a handler ran, by event id.
#[derive(Clone, Default)]
struct Runs(Arc<std::sync::Mutex<BTreeMap<String, i64>>>);

impl Runs {
    fn count(&self, id: &str) {
        *self.0.lock().unwrap().entry(id.to_owned()).or_default() += 1;
    }

    fn get(&self) -> BTreeMap<String, i64> {
        self.0.lock().unwrap().clone()
    }
}

macro_rules! events_suite {
    (
        $engine:ident, $store:ty, $outbox:ty, $pool:ty, $open:expr,
        late_commit_first: $late_first:expr,
        create: $create:literal, insert: $insert:literal, count: $count:literal, total: $total:literal
    ) => {
        mod $engine {
            use super::*;

            struct Subject {
                tag: String,
                pool: $pool,
                store: $store,
                outbox: $outbox,
                effects: Arc<String>,
                broker: Broker,
            }

            async fn subject(duplicate_window: Duration) -> Subject {
                let tag = tag();
                let (store, outbox, pool): ($store, $outbox, $pool) = $open(&tag).await;
                store.migrate().await.expect("migrate the inbox table");
                outbox.migrate().await.expect("migrate the outbox table");
                let effects = format!("effects_{tag}");
                sqlx::query(sqlx::AssertSqlSafe(format!($create, effects)))
                    .execute(&pool)
                    .await
                    .expect("create the effects table");
                let broker = Broker::new(&tag, duplicate_window).await;
                Subject {
                    tag,
                    pool,
                    store,
                    outbox,
                    effects: Arc::new(effects),
                    broker,
                }
            }

            impl Subject {
                /// Enqueues one event per transaction; commits or rolls back.
                async fn enqueue(&self, kind: &str, commit: bool) -> String {
                    let event = OutboxEvent::new(self.broker.subject(kind), br#"{"v":1}"#.to_vec()).expect("an event");
                    let mut tx = self.pool.begin().await.expect("begin");
                    self.outbox.enqueue(&mut *tx, &event).await.expect("enqueue");
                    if commit {
                        tx.commit().await.expect("commit");
                    } else {
                        tx.rollback().await.expect("rollback");
                    }
                    event.id().to_owned()
                }

                fn inbox(&self) -> Inbox<$store> {
                    Inbox::new(TxEngine::new(self.store.clone()))
                }

                /// A consumer of its own for `name`, running, whose handler
                /// records one effect row per application.
                async fn running(&self, name: &str) -> Running {
                    let effects = self.effects.clone();
                    let handler_name = Arc::new(name.to_owned());
                    let work = handler::<$store, _>(move |tx, event| {
                        let (effects, handler_name) = (effects.clone(), handler_name.clone());
                        Box::pin(async move { record_effect(tx, &effects, &handler_name, &event.id).await })
                    });
                    self.run(Duration::from_secs(5), self.options(name), work).await
                }

                /// Starts `work` with `options` on the durable consumer named
                /// after its handler, and runs it in the background.
                async fn run<H>(&self, ack_wait: Duration, options: ConsumerOptions, work: H) -> Running
                where
                    H: for<'c> Fn(
                            &'c mut <$store as TxBackend>::Tx,
                            Arc<Event>,
                        ) -> BoxFuture<'c, Result<(), HandlerError>>
                        + Send
                        + Sync
                        + 'static,
                {
                    let consumer = self.broker.consumer(&options.handler, ack_wait).await;
                    let consumer = InboxConsumer::start(self.broker.js.clone(), consumer, self.inbox(), options, work)
                        .await
                        .expect("start the consumer");
                    run_consumer(consumer)
                }

                fn options(&self, handler: &str) -> ConsumerOptions {
                    let mut o = ConsumerOptions::new(handler);
                    o.dead_letter_subject = format!("{}.{handler}", self.broker.dead_subject);
                    o
                }

                /// Options that make a dead letter of an event after
                /// `max_deliveries`, 50 ms apart.
                fn bounded(&self, handler: &str, max_deliveries: i64) -> ConsumerOptions {
                    let mut o = self.options(handler);
                    o.max_deliveries = max_deliveries;
                    o.retry_delays = vec![Duration::from_millis(50)];
                    o
                }

                async fn effects(&self, handler: &str, id: &str) -> i64 {
                    sqlx::query_scalar(sqlx::AssertSqlSafe(format!($count, self.effects)))
                        .bind(handler)
                        .bind(id)
                        .fetch_one(&self.pool)
                        .await
                        .expect("count effects")
                }

                async fn total_effects(&self, handler: &str) -> i64 {
                    sqlx::query_scalar(sqlx::AssertSqlSafe(format!($total, self.effects)))
                        .bind(handler)
                        .fetch_one(&self.pool)
                        .await
                        .expect("count effects")
                }

                /// What the inbox recorded for `handler`'s event `id` (the
                /// handler must have seen it): `None` applied, `Some` a dead letter.
                async fn recorded(&self, handler: &str, id: &str) -> Recorded {
                    let delivery = self
                        .inbox()
                        .process(handler, id, br#"{"v":1}"#, |_tx| {
                            Box::pin(async { Err::<Recorded, _>(idem_core::Error::Config("not recorded".into())) })
                        })
                        .await
                        .expect("a recorded outcome");
                    match delivery {
                        Delivery::Duplicate(recorded) => recorded,
                        Delivery::Applied(_) => unreachable!("the probe fails when it runs"),
                    }
                }

                async fn unsent(&self) -> u64 {
                    self.outbox.lag().await.expect("lag").unsent
                }

                /// Publishes every committed event with one relay, then stops it.
                async fn publish_all(&self) {
                    let relays = Relays::start(1, &self.outbox, &self.broker.js);
                    eventually("sent", || async { self.unsent().await == 0 }).await;
                    relays.stop().await;
                }

                /// Enqueues one `created` event and publishes it; answers its id.
                async fn publish_one(&self) -> String {
                    let id = self.enqueue("created", true).await;
                    self.publish_all().await;
                    id
                }

                /// Enqueues `n` `created` events, each committed; answers their ids.
                async fn enqueue_many(&self, n: usize) -> Vec<String> {
                    let mut ids = Vec::new();
                    for _ in 0..n {
                        ids.push(self.enqueue("created", true).await);
                    }
                    ids
                }

                /// Waits until the dead-letter stream holds `n` events.
                async fn wait_dead_letters(&self, n: usize) {
                    eventually(&format!("{n} dead letters"), || async {
                        self.dead_letters().await.len() == n
                    })
                    .await;
                }

                /// The dead-letter stream's events, by event id.
                async fn dead_letters(&self) -> BTreeMap<String, String> {
                    self.broker
                        .stored(&self.broker.dead_stream, "Idem-Event-Id")
                        .await
                        .into_iter()
                        .collect()
                }
            }

            /// Records one application of `event` by `handler` in the effects table.
            async fn record_effect(
                tx: &mut <$store as TxBackend>::Tx,
                effects: &str,
                handler: &str,
                event: &str,
            ) -> Result<(), HandlerError> {
                sqlx::query(sqlx::AssertSqlSafe(format!($insert, effects)))
                    .bind(handler)
                    .bind(event)
                    .execute(&mut **tx)
                    .await
                    .map_err(HandlerError::retry)?;
                Ok(())
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn every_committed_event_is_published_once_and_no_rolled_back_one() {
                let s = subject(Duration::from_secs(120)).await;
                let mut committed = BTreeSet::new();
                let mut rolled_back = BTreeSet::new();
                for i in 0..60 {
                    if i % 4 == 3 {
                        rolled_back.insert(s.enqueue("created", false).await);
                    } else {
                        committed.insert(s.enqueue("created", true).await);
                    }
                }
                let relays = Relays::start(4, &s.outbox, &s.broker.js);
                eventually("every row is marked sent", || async { s.unsent().await == 0 }).await;
                relays.stop().await;
                let ids = s.broker.published_ids().await;
                let published: BTreeSet<String> = ids.iter().cloned().collect();
                assert_eq!(ids.len(), published.len(), "no event stored twice");
                assert_eq!(published, committed, "exactly the committed events");
                assert!(published.is_disjoint(&rolled_back));
                let lag = s.outbox.lag().await.unwrap();
                assert_eq!(lag.oldest_unsent_age_ms, None);
                // Retention: sent rows go in bounded batches; unsent ones never.
                s.enqueue("late", true).await;
                assert_eq!(
                    s.outbox.purge_sent(60_000, 100).await.unwrap(),
                    0,
                    "nothing is an hour old"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
                assert_eq!(s.outbox.purge_sent(0, 30).await.unwrap(), 30, "a bounded batch");
                assert_eq!(s.outbox.purge_sent(0, 100).await.unwrap(), 15);
                assert_eq!(s.unsent().await, 1, "the unsent row is kept");
                s.broker.cleanup().await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn a_transaction_opened_first_and_committed_last_is_still_published() {
                let s = Arc::new(subject(Duration::from_secs(120)).await);
                let relays = Relays::start(4, &s.outbox, &s.broker.js);
                // Warm up: the relays have published rows after the one
                // still to come, so a high-water mark would be past it.
                let before = s.enqueue("warmup", true).await;
                eventually("the warm-up event is published", || async {
                    s.broker.published_ids().await.contains(&before)
                })
                .await;

                let early = OutboxEvent::new(s.broker.subject("early"), b"{}".to_vec()).unwrap();
                let mut first = s.pool.begin().await.expect("begin the first transaction");
                s.outbox
                    .enqueue(&mut *first, &early)
                    .await
                    .expect("enqueue in the first transaction");

                let s2 = s.clone();
                let later = tokio::spawn(async move {
                    let mut ids = Vec::new();
                    for _ in 0..5 {
                        ids.push(s2.enqueue("later", true).await);
                    }
                    ids
                });
                if $late_first {
                    // The later transactions commit while the first is
                    // open, and their events are published before it commits.
                    let later = later.await.unwrap();
                    eventually("the later events are published", || async {
                        let ids = s.broker.published_ids().await;
                        later.iter().all(|id| ids.contains(id))
                    })
                    .await;
                    assert!(!s.broker.published_ids().await.contains(&early.id().to_owned()));
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    first.commit().await.expect("commit the first transaction last");
                } else {
                    // SQLite has one writer: the later transactions wait for
                    // the first, which commits after the relays have run.
                    tokio::time::sleep(Duration::from_millis(300)).await;
                    first.commit().await.expect("commit the first transaction");
                    later.await.unwrap();
                }
                eventually("the first transaction's event is published", || async {
                    s.broker.published_ids().await.contains(&early.id().to_owned())
                })
                .await;
                eventually("nothing is left unsent", || async { s.unsent().await == 0 }).await;
                relays.stop().await;
                let ids = s.broker.published_ids().await;
                let unique: BTreeSet<_> = ids.iter().collect();
                assert_eq!(ids.len(), unique.len(), "no event stored twice");
                assert_eq!(ids.len(), 7);
                s.broker.cleanup().await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn a_relay_dying_between_publish_and_mark_sent_causes_no_duplicate_effect() {
                let s = subject(Duration::from_secs(120)).await;
                let ids = s.enqueue_many(10).await;
                // A relay takes the rows, the broker confirms them, and the
                // relay dies before marking them sent.
                let batch = s.outbox.take(100).await.expect("take");
                assert_eq!(batch.messages().len(), 10);
                let publisher = JetStreamPublisher::new(s.broker.js.clone());
                let results = publisher.publish(batch.messages()).await;
                assert!(results.iter().all(|r| r.is_ok()), "{results:?}");
                drop(batch);
                assert_eq!(s.unsent().await, 10, "nothing was marked sent");
                // SQLite holds taken rows by lease: let it run out.
                tokio::time::sleep(Duration::from_millis(if $late_first { 0 } else { 1_200 })).await;

                let consumer = s.running("projection").await;
                let relays = Relays::start(2, &s.outbox, &s.broker.js);
                eventually("every row is marked sent", || async { s.unsent().await == 0 }).await;
                eventually("every event is applied", || async {
                    s.total_effects("projection").await == 10
                })
                .await;
                tokio::time::sleep(Duration::from_millis(300)).await;
                relays.stop().await;
                consumer.stop().await;
                for id in &ids {
                    assert_eq!(s.effects("projection", id).await, 1, "{id}");
                }
                assert_eq!(
                    s.broker.published_ids().await.len(),
                    10,
                    "the broker dropped the second publish"
                );
                s.broker.cleanup().await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn a_row_no_stream_captures_does_not_hold_up_the_rest() {
                let s = subject(Duration::from_secs(120)).await;
                // Oldest first: a batch's worth of rows on a subject without a stream.
                for _ in 0..25 {
                    let lost = OutboxEvent::new(format!("nowhere_{}.x", s.tag), b"{}".to_vec()).unwrap();
                    let mut tx = s.pool.begin().await.unwrap();
                    s.outbox.enqueue(&mut *tx, &lost).await.unwrap();
                    tx.commit().await.unwrap();
                }
                let mut ids = BTreeSet::new();
                for _ in 0..30 {
                    ids.insert(s.enqueue("created", true).await);
                }
                let relays = Relays::start(2, &s.outbox, &s.broker.js);
                eventually("every routable row is published", || async {
                    s.broker
                        .published_ids()
                        .await
                        .into_iter()
                        .collect::<BTreeSet<_>>()
                        == ids
                })
                .await;
                relays.stop().await;
                assert_eq!(s.unsent().await, 25, "the unroutable rows wait for their retry");
                s.broker.cleanup().await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn a_handler_slower_than_ack_wait_keeps_its_message_with_progress_acks() {
                let s = subject(Duration::from_secs(120)).await;
                let id = s.publish_one().await;
                // The server redelivers after 1 s without news; the handler takes 3 s.
                let runs = Arc::new(std::sync::atomic::AtomicUsize::new(0));
                let seen = runs.clone();
                let effects = s.effects.clone();
                let work = handler::<$store, _>(move |tx, event| {
                    seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    let effects = effects.clone();
                    Box::pin(async move {
                        tokio::time::sleep(Duration::from_secs(3)).await;
                        record_effect(tx, &effects, "slow", &event.id).await
                    })
                });
                let running = s.run(Duration::from_secs(1), s.options("slow"), work).await;
                eventually("applied", || async { s.effects("slow", &id).await == 1 }).await;
                eventually("acknowledged", || s.broker.settled("slow")).await;
                running.stop().await;
                assert_eq!(
                    s.broker.deliveries("slow").await,
                    1,
                    "progress acks kept the message from being delivered again"
                );
                assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 1);
                s.broker.cleanup().await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn a_redelivered_event_is_a_no_op() {
                // A one-second window: a copy published after it is stored
                // again and delivered again.
                let s = subject(Duration::from_secs(1)).await;
                let id = s.publish_one().await;
                let consumer = s.running("projection").await;
                eventually("applied", || async { s.effects("projection", &id).await == 1 }).await;
                tokio::time::sleep(Duration::from_millis(1_200)).await;
                for _ in 0..3 {
                    s.broker.publish_copy(&id, &id, None).await;
                    tokio::time::sleep(Duration::from_millis(1_100)).await;
                }
                assert_eq!(
                    s.broker.published_ids().await.len(),
                    4,
                    "the stream holds four copies"
                );
                eventually("every copy is acknowledged", || s.broker.settled("projection")).await;
                consumer.stop().await;
                assert_eq!(
                    s.effects("projection", &id).await,
                    1,
                    "four deliveries, one effect"
                );
                s.broker.cleanup().await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn two_handlers_of_one_event_each_apply_it_once() {
                let s = subject(Duration::from_secs(120)).await;
                let ids = s.enqueue_many(20).await;
                let relays = Relays::start(2, &s.outbox, &s.broker.js);
                let a = s.running("projection").await;
                let b = s.running("notifier").await;
                // A second instance of each handler on the same durable consumer.
                let a2 = s.running("projection").await;
                eventually("both handlers applied every event", || async {
                    s.total_effects("projection").await == 20 && s.total_effects("notifier").await == 20
                })
                .await;
                tokio::time::sleep(Duration::from_millis(300)).await;
                for r in [a, b, a2] {
                    r.stop().await;
                }
                relays.stop().await;
                for id in &ids {
                    assert_eq!(s.effects("projection", id).await, 1);
                    assert_eq!(s.effects("notifier", id).await, 1);
                }
                s.broker.cleanup().await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn a_failing_handler_ends_as_a_dead_letter_after_its_bound() {
                let s = subject(Duration::from_secs(120)).await;
                let id = s.enqueue("created", true).await;
                let poison = s.enqueue("poison", true).await;
                s.publish_all().await;
                let deliveries = Runs::default();
                let seen = deliveries.clone();
                let work = handler::<$store, _>(move |_tx, event| {
                    seen.count(&event.id);
                    Box::pin(async move {
                        if event.subject.ends_with(".poison") {
                            Err(HandlerError::reject("malformed payload"))
                        } else {
                            Err(HandlerError::retry("the downstream is down"))
                        }
                    })
                });
                let running = s.run(Duration::from_secs(5), s.bounded("flaky", 3), work).await;
                s.wait_dead_letters(2).await;
                running.stop().await;
                let dead = s.dead_letters().await;
                assert!(dead.contains_key(&id) && dead.contains_key(&poison), "{dead:?}");
                let seen = deliveries.get();
                assert_eq!(
                    seen.get(&id),
                    Some(&3),
                    "a transient failure is retried up to the bound"
                );
                assert_eq!(seen.get(&poison), Some(&1), "a permanent failure is not retried");
                assert!(s.broker.settled("flaky").await, "both were terminated");
                // Each dead letter is recorded as such in the inbox: if its
                // termination were lost, a redelivery would not run the handler.
                for dead_id in [&id, &poison] {
                    assert!(
                        s.recorded("flaky", dead_id).await.is_some(),
                        "{dead_id} is closed"
                    );
                }
                s.broker.cleanup().await;
                let _ = &s.tag;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn a_panicking_handler_ends_as_a_dead_letter_after_its_bound() {
                // A panic, in the handler's future or before it, is a failure
                // like any other: counted, then kept as a dead letter.
                let s = subject(Duration::from_secs(120)).await;
                let runs = Runs::default();
                let late = s.enqueue("late", true).await;
                let early = s.enqueue("early", true).await;
                s.publish_all().await;
                let seen = runs.clone();
                let work = handler::<$store, _>(move |_tx, event| {
                    seen.count(&event.id);
                    if event.subject.ends_with(".early") {
                        panic!("the handler panicked before its future");
                    }
                    Box::pin(async move {
                        tokio::task::yield_now().await;
                        if !event.id.is_empty() {
                            panic!("the handler panicked in its future");
                        }
                        Ok(())
                    })
                });
                let running = s.run(Duration::from_secs(1), s.bounded("panicky", 2), work).await;
                s.wait_dead_letters(2).await;
                // Longer than the ack wait: nothing comes back.
                tokio::time::sleep(Duration::from_millis(2_500)).await;
                running.stop().await;
                let runs = runs.get();
                assert_eq!(runs.get(&late), Some(&2), "{runs:?}");
                assert_eq!(runs.get(&early), Some(&2), "{runs:?}");
                assert_eq!(s.dead_letters().await.len(), 2);
                assert!(s.broker.settled("panicky").await, "both were terminated");
                for id in [&late, &early] {
                    let mark = s
                        .recorded("panicky", id)
                        .await
                        .expect("recorded as a dead letter");
                    assert!(mark.error.contains("panicked"), "{mark:?}");
                }
                s.broker.cleanup().await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn a_dead_letter_is_not_an_applied_event_and_a_redrive_applies_it_once() {
                // Recorded as dead-lettered, not run by an ordinary
                // redelivery even once its cause is fixed, run exactly once
                // by a redrive (however many copies), and by no other handler.
                let s = subject(Duration::from_secs(1)).await;
                let id = s.publish_one().await;
                let broken = Arc::new(std::sync::atomic::AtomicBool::new(true));
                let (effects, down) = (s.effects.clone(), broken.clone());
                let work = handler::<$store, _>(move |tx, event| {
                    let (effects, down) = (effects.clone(), down.clone());
                    Box::pin(async move {
                        if down.load(std::sync::atomic::Ordering::SeqCst) {
                            return Err(HandlerError::retry("the database is down"));
                        }
                        record_effect(tx, &effects, "projection", &event.id).await
                    })
                });
                let running = s
                    .run(Duration::from_secs(5), s.bounded("projection", 2), work)
                    .await;
                let notifier = s.running("notifier").await;
                s.wait_dead_letters(1).await;
                eventually("the other handler applied it", || async {
                    s.effects("notifier", &id).await == 1
                })
                .await;
                let mark = s
                    .recorded("projection", &id)
                    .await
                    .expect("recorded as a dead letter, not as applied");
                assert_eq!(mark.dead_lettered_after, 2);
                assert!(mark.error.contains("the database is down"), "{mark:?}");

                // The cause is fixed; an ordinary redelivery still runs nothing.
                broken.store(false, std::sync::atomic::Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(1_200)).await;
                s.broker.publish_copy(&id, &id, None).await;
                eventually("the copy is acknowledged", || s.broker.settled("projection")).await;
                assert_eq!(
                    s.effects("projection", &id).await,
                    0,
                    "a redelivery does not run it"
                );

                let dead = s.broker.dead_stream.clone();
                let filter = DeadLetterFilter {
                    handler: Some("projection".into()),
                    limit: 10,
                    ..Default::default()
                };
                let letters = idem_jetstream::dead_letters(&s.broker.js, &dead, &filter)
                    .await
                    .unwrap();
                assert_eq!(letters.len(), 1, "{letters:?}");
                assert_eq!(letters[0].event_id.as_deref(), Some(id.as_str()));
                assert_eq!(letters[0].deliveries, Some(2));
                let other = DeadLetterFilter {
                    handler: Some("notifier".into()),
                    limit: 10,
                    ..Default::default()
                };
                assert!(
                    idem_jetstream::dead_letters(&s.broker.js, &dead, &other)
                        .await
                        .unwrap()
                        .is_empty()
                );

                let options = RedriveOptions {
                    max: 10,
                    per_second: 50,
                };
                let report = idem_jetstream::redrive(&s.broker.js, &dead, &filter, options)
                    .await
                    .unwrap();
                assert_eq!(report.redriven, vec![letters[0].seq], "{report:?}");
                eventually("the redrive applied it", || async {
                    s.effects("projection", &id).await == 1
                })
                .await;
                // More copies of the redrive (a second operator, a retry of
                // the command) and another ordinary redelivery.
                tokio::time::sleep(Duration::from_millis(1_200)).await;
                s.broker
                    .publish_copy(&id, "another-redrive", Some("projection"))
                    .await;
                s.broker
                    .publish_copy(&id, "yet-another-redrive", Some("projection"))
                    .await;
                s.broker.publish_copy(&id, &id, None).await;
                eventually("every copy is acknowledged", || async {
                    s.broker.settled("projection").await && s.broker.settled("notifier").await
                })
                .await;
                running.stop().await;
                notifier.stop().await;
                assert_eq!(
                    s.effects("projection", &id).await,
                    1,
                    "one effect from the redrive"
                );
                assert_eq!(
                    s.effects("notifier", &id).await,
                    1,
                    "the other handler ignores redrives"
                );
                assert!(
                    idem_jetstream::dead_letters(&s.broker.js, &dead, &filter)
                        .await
                        .unwrap()
                        .is_empty()
                );
                assert_eq!(
                    s.dead_letters().await.len(),
                    0,
                    "the redriven letter left the dead-letter stream"
                );
                s.broker.cleanup().await;
            }
        }
    };
}

/// A pool of 20 on `url` (read from `var`).
async fn connect<DB: sqlx::Database>(url: String, var: &str) -> sqlx::Pool<DB> {
    sqlx::pool::PoolOptions::<DB>::new()
        .max_connections(20)
        .connect(&url)
        .await
        .unwrap_or_else(|e| panic!("cannot reach {url} (set {var}): {e}"))
}

/// The table `{prefix}_{tag}`.
fn table(prefix: &str, tag: &str) -> TableName {
    TableName::new(format!("{prefix}_{tag}")).unwrap()
}

/// An inbox and an outbox with tables of their own (`inbox_{tag}`,
/// `outbox_{tag}`) on a pool of the server at `$url` (read from `$var`).
macro_rules! open_server {
    ($store:ty, $outbox:ty, $url:expr, $var:literal, $tag:expr) => {{
        let pool = connect($url, $var).await;
        let store = <$store>::new(pool.clone()).with_table(table("inbox", $tag));
        (store, <$outbox>::with_table(pool.clone(), table("outbox", $tag)), pool)
    }};
}

async fn open_postgres(tag: &str) -> (idem_postgres::PgStore, idem_postgres::PgOutbox, sqlx::PgPool) {
    open_server!(
        idem_postgres::PgStore,
        idem_postgres::PgOutbox,
        common::postgres_url(),
        "IDEM_TEST_POSTGRES_URL",
        tag
    )
}

async fn open_mysql(tag: &str) -> (idem_mysql::MySqlStore, idem_mysql::MySqlOutbox, sqlx::MySqlPool) {
    open_server!(
        idem_mysql::MySqlStore,
        idem_mysql::MySqlOutbox,
        idem_conformance::env::mysql_url(),
        "IDEM_TEST_MYSQL_URL",
        tag
    )
}

async fn open_sqlite(tag: &str) -> (idem_sqlite::SqliteStore, idem_sqlite::SqliteOutbox, sqlx::SqlitePool) {
    let path = std::env::temp_dir().join(format!("idem-events-{tag}.db"));
    let store = idem_sqlite::SqliteStore::open(&path)
        .await
        .expect("open the SQLite file")
        .with_table(table("inbox", tag));
    let pool = store.pool().clone();
    let outbox =
        idem_sqlite::SqliteOutbox::with_table(pool.clone(), table("outbox", tag)).with_lease(Duration::from_secs(1));
    (store, outbox, pool)
}

events_suite!(
    postgres, idem_postgres::PgStore, idem_postgres::PgOutbox, sqlx::PgPool, open_postgres,
    late_commit_first: true,
    create: "CREATE TABLE {} (handler TEXT NOT NULL, event_id TEXT NOT NULL)",
    insert: "INSERT INTO {} (handler, event_id) VALUES ($1, $2)",
    count: "SELECT COUNT(*) FROM {} WHERE handler = $1 AND event_id = $2",
    total: "SELECT COUNT(*) FROM {} WHERE handler = $1"
);

events_suite!(
    mysql, idem_mysql::MySqlStore, idem_mysql::MySqlOutbox, sqlx::MySqlPool, open_mysql,
    late_commit_first: true,
    create: "CREATE TABLE {} (handler VARCHAR(64) NOT NULL, event_id VARCHAR(64) NOT NULL)",
    insert: "INSERT INTO {} (handler, event_id) VALUES (?, ?)",
    count: "SELECT COUNT(*) FROM {} WHERE handler = ? AND event_id = ?",
    total: "SELECT COUNT(*) FROM {} WHERE handler = ?"
);

events_suite!(
    sqlite, idem_sqlite::SqliteStore, idem_sqlite::SqliteOutbox, sqlx::SqlitePool, open_sqlite,
    late_commit_first: false,
    create: "CREATE TABLE {} (handler TEXT NOT NULL, event_id TEXT NOT NULL)",
    insert: "INSERT INTO {} (handler, event_id) VALUES (?1, ?2)",
    count: "SELECT COUNT(*) FROM {} WHERE handler = ?1 AND event_id = ?2",
    total: "SELECT COUNT(*) FROM {} WHERE handler = ?1"
);

/// The start-up check refuses settings under which a redelivery could
/// reach the handler after the inbox forgot the event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn start_refuses_an_inbox_ttl_shorter_than_the_redelivery_horizon() {
    let (_tag, broker, store) = sqlite_broker(Duration::from_secs(120)).await;
    let short = Inbox::new(TxEngine::new(store.clone())).with_policy(idem_core::Policy::default().with_ttl_secs(60));
    let consumer = broker.consumer("short", Duration::from_secs(30)).await;
    let mut options = ConsumerOptions::new("short");
    options.dead_letter_subject = format!("{}.short", broker.dead_subject);
    let err = broker.refused(consumer, short, options, "refused").await;
    let ConsumerError::Config(message) = err else {
        panic!("{err:?}")
    };
    assert!(message.contains("keeps event ids for 60 s"), "{message}");

    // A server-side delivery bound below the consumer's is refused too: the
    // server would stop before the dead letter is kept.
    let bounded = broker
        .events
        .get_or_create_consumer(
            "bounded",
            pull::Config {
                durable_name: Some("bounded".into()),
                ack_policy: jetstream::consumer::AckPolicy::Explicit,
                max_deliver: 2,
                ..Default::default()
            },
        )
        .await
        .unwrap();
    let mut options = ConsumerOptions::new("bounded");
    options.dead_letter_subject = format!("{}.bounded", broker.dead_subject);
    let err = broker
        .refused(bounded, Inbox::new(TxEngine::new(store)), options, "refused")
        .await;
    assert!(err.to_string().contains("max_deliver"), "{err}");
    broker.cleanup().await;
}

/// Only the stream's max_age bounds when a message can come back (a
/// consumer killed between its commit and its ack gets it whenever it next
/// pulls): a stream that keeps messages for ever, or longer than the inbox
/// keeps ids, is refused whatever the delivery bounds, and so is one that
/// would drop a failing message before its last delivery (the retry delays
/// counted, an empty list as the 1 s it waits).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn start_bounds_the_redelivery_horizon_by_the_streams_max_age() {
    let (tag, broker, store) = sqlite_broker(Duration::from_secs(1)).await;
    let inbox = |ttl_secs: u64| {
        Inbox::new(TxEngine::new(store.clone())).with_policy(idem_core::Policy::default().with_ttl_secs(ttl_secs))
    };
    let stream_with = |name: &str, max_age: Duration| {
        let js = broker.js.clone();
        let (name, subjects) = (format!("{name}_{tag}"), format!("{}_{tag}", name.to_lowercase()));
        async move { events_stream(&js, &name, &subjects, |c| c.max_age = max_age).await }
    };
    let consumer_on = |stream: stream::Stream| async move { durable(&stream, "c", Duration::from_secs(1)).await };
    let options = |max_deliveries: i64, retry_delays: Vec<Duration>| {
        let mut o = ConsumerOptions::new("h");
        o.dead_letter_subject = format!("{}.h", broker.dead_subject);
        o.max_deliveries = max_deliveries;
        o.retry_delays = retry_delays;
        o
    };

    // Kept for ever: a 3 s TTL (which the delivery bounds alone would
    // cover: 1 × (1 s + 0) + 1 s) and even seven days are refused.
    let forever = stream_with("FOREVER", Duration::ZERO).await;
    for ttl in [3, 7 * 86_400] {
        let c = consumer_on(forever.clone()).await;
        let err = broker
            .refused(c, inbox(ttl), options(1, vec![]), "an unlimited max_age is refused")
            .await;
        assert!(err.to_string().contains("max_age unlimited"), "{err}");
    }

    // Kept a minute, ids kept 30 s: refused; kept two minutes: accepted.
    let minute = stream_with("MINUTE", Duration::from_secs(60)).await;
    let c = consumer_on(minute.clone()).await;
    let err = broker
        .refused(c, inbox(30), options(1, vec![]), "a TTL under max_age is refused")
        .await;
    assert!(err.to_string().contains("keeps event ids for 30 s"), "{err}");
    let c = consumer_on(minute.clone()).await;
    let work = handler::<idem_sqlite::SqliteStore, _>(|_tx, _e| Box::pin(async { Ok(()) }));
    InboxConsumer::start(
        broker.js.clone(),
        c,
        inbox(120),
        options(3, vec![Duration::from_secs(1)]),
        work,
    )
    .await
    .expect("max_age within the TTL, and longer than the delivery schedule");

    // Retry delays past it are refused (a server-side backoff counts the
    // same way, where the server accepts one with an unlimited
    // max_deliver; 2.9 does not), and an empty list counts as the 1 s it
    // waits.
    let cases = [
        (
            options(2, vec![Duration::from_secs(45)]),
            "retry delays past max_age are refused",
            "90 s",
        ),
        (
            options(61, vec![]),
            "61 deliveries of at least 1 s each outlast a 60 s max_age",
            "61 s",
        ),
    ];
    for (options, why, named) in cases {
        minute.delete_consumer("c").await.unwrap();
        let c = consumer_on(minute.clone()).await;
        let err = broker.refused(c, inbox(120), options, why).await;
        assert!(err.to_string().contains(named), "{err}");
    }

    for name in ["FOREVER", "MINUTE"] {
        let _ = broker.js.delete_stream(format!("{name}_{tag}")).await;
    }
    broker.cleanup().await;
}

/// A dead-letter subject that no stream captures could never keep a dead
/// letter (every permanent failure would loop), and one in the consumer's
/// own stream would be delivered to it or aged out: refused at start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn start_refuses_a_dead_letter_subject_no_stream_captures() {
    let (tag, broker, store) = sqlite_broker(Duration::from_secs(120)).await;
    let mut options = ConsumerOptions::new("h");
    options.dead_letter_subject = format!("nowhere_{tag}.dead");
    let consumer = broker.consumer("h", Duration::from_secs(5)).await;
    let err = broker
        .refused(consumer, Inbox::new(TxEngine::new(store.clone())), options, "refused")
        .await;
    let ConsumerError::Config(message) = err else {
        panic!("{err:?}")
    };
    assert!(message.contains("no stream captures"), "{message}");
    // Nor may the dead letters land in the consumer's own stream.
    let mut options = ConsumerOptions::new("h");
    options.dead_letter_subject = broker.subject("dead");
    let consumer = broker.consumer("h", Duration::from_secs(5)).await;
    let err = broker
        .refused(consumer, Inbox::new(TxEngine::new(store)), options, "refused")
        .await;
    assert!(err.to_string().contains("own stream"), "{err}");
    // In the own stream but outside the consumer's filter: not delivered
    // to the handler, but deleted by the max_age that bounds redeliveries,
    // while a dead letter must be kept until it is handled: refused.
    let filtered = broker
        .events
        .create_consumer(pull::Config {
            durable_name: Some("filtered".into()),
            ack_policy: jetstream::consumer::AckPolicy::Explicit,
            max_deliver: -1,
            filter_subject: broker.subject("orders"),
            ..Default::default()
        })
        .await
        .unwrap();
    let mut options = ConsumerOptions::new("filtered");
    options.dead_letter_subject = broker.subject("dead");
    let inbox = Inbox::new(TxEngine::new(open_sqlite(&tag).await.0));
    let err = broker
        .refused(filtered, inbox, options, "dead letters in a stream with max_age")
        .await;
    assert!(
        err.to_string().contains("max_age") && err.to_string().contains("stream of their own"),
        "{err}"
    );
    broker.cleanup().await;
}

/// `max_deliveries` counts the server's deliveries, but a copy delivered
/// while another delivery is running the handler ran nothing: it is
/// delivered again later and never makes a dead letter, even at the bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_copy_that_finds_its_event_in_flight_never_makes_a_dead_letter() {
    let tag = tag();
    let broker = Broker::new(&tag, Duration::from_secs(120)).await;
    let (store, _outbox, _pool) = open_postgres(&tag).await;
    store.migrate().await.unwrap();
    let id = format!("evt-{tag}");
    broker.publish_copy(&id, &id, None).await;
    // The server delivers a copy after 1 s without news (no progress acks);
    // the handler takes 3 s, and a twin is answered "in flight" at once.
    let consumer = broker.consumer("slow", Duration::from_secs(1)).await;
    let mut options = ConsumerOptions::new("slow");
    options.dead_letter_subject = format!("{}.slow", broker.dead_subject);
    options.max_deliveries = 2;
    options.retry_delays = vec![Duration::from_millis(200)];
    options.progress_every = Some(Duration::from_secs(600));
    options.concurrency = 4;
    let inbox = Inbox::new(TxEngine::new(store.clone())).with_policy(
        idem_core::Policy::default()
            .with_ttl_secs(idem_inbox::DEFAULT_TTL_SECS)
            .with_in_flight(idem_core::InFlight::Reject),
    );
    let runs = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let seen = runs.clone();
    let work = handler::<idem_postgres::PgStore, _>(move |_tx, _event| {
        seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Box::pin(async move {
            tokio::time::sleep(Duration::from_secs(3)).await;
            Ok(())
        })
    });
    let running = run_consumer(
        InboxConsumer::start(broker.js.clone(), consumer, inbox, options, work)
            .await
            .expect("start"),
    );
    tokio::time::sleep(Duration::from_millis(3_500)).await;
    eventually("acknowledged", || broker.settled("slow")).await;
    running.stop().await;
    assert!(
        broker.deliveries("slow").await >= 2,
        "a copy came while the handler ran"
    );
    assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 1);
    assert!(
        broker.stored(&broker.dead_stream, "Idem-Event-Id").await.is_empty(),
        "no dead letter for an applied event"
    );
    broker.cleanup().await;
}

/// Takes every unsent row of `outbox` (`rows` of them) in one batch and
/// marks them all sent.
async fn send_all_in_one_batch(outbox: &impl OutboxStore, rows: usize) {
    let batch = outbox.take(rows + 1_000).await.unwrap();
    assert_eq!(batch.messages().len(), rows);
    let sent: Vec<i64> = batch.messages().iter().map(|m| m.seq).collect();
    batch
        .finish(
            sent,
            idem_core::RetryBackoff {
                min_ms: 100,
                max_ms: 1_000,
            },
        )
        .await
        .expect("every row marked sent");
    assert_eq!(outbox.lag().await.unwrap().unsent, 0);
}

/// A relay batch larger than the engine takes bound values in one statement
/// (65,535 on MySQL/MariaDB, 32,766 on SQLite) is still marked sent: the
/// marks go in bounded statements, so rows are not republished every pass.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_batch_over_the_engines_bound_values_is_marked_sent() {
    const ROWS: usize = 66_000;
    let tag = tag();
    let (_store, outbox, pool) = open_mysql(&tag).await;
    outbox.migrate().await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO outbox_{tag} (event_id, subject, payload, created_at_ms) \
         SELECT CONCAT('e', seq), 'x.y', '{{}}', 0 FROM seq_1_to_{ROWS}"
    )))
    .execute(&pool)
    .await
    .expect("fill the MariaDB outbox (sequence engine)");
    send_all_in_one_batch(&outbox, ROWS).await;
    let _ = sqlx::query(sqlx::AssertSqlSafe(format!("DROP TABLE outbox_{tag}")))
        .execute(&pool)
        .await;

    let (_store, outbox, pool) = open_sqlite(&tag).await;
    outbox.migrate().await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 40000) \
         INSERT INTO outbox_{tag} (event_id, subject, payload, created_at_ms) SELECT 'e' || i, 'x.y', X'7B7D', 0 FROM n"
    )))
    .execute(&pool)
    .await
    .expect("fill the SQLite outbox");
    send_all_in_one_batch(&outbox, 40_000).await;
}

#[test]
fn event_ids_and_subjects_are_validated() {
    assert!(OutboxEvent::with_id(IdempotencyKey::new("a b").unwrap(), "x.y", vec![]).is_ok());
    assert!(OutboxEvent::with_id(IdempotencyKey::new(" a").unwrap(), "x.y", vec![]).is_err());
    assert!(OutboxEvent::with_id(IdempotencyKey::new("a ").unwrap(), "x.y", vec![]).is_err());
    assert!(OutboxEvent::new("x..y", vec![]).is_err());
    assert!(OutboxEvent::new("x.>", vec![]).is_err());
    assert!(OutboxEvent::new("x", vec![0; idem_core::MAX_OUTBOX_PAYLOAD + 1]).is_err());
}
