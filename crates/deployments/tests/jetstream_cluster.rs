//! idem's outbox relay and inbox consumer on a three-node NATS JetStream
//! cluster, with a node killed (SIGKILL) mid-publish and mid-consume and
//! started again on its store: with three replicas every committed event is
//! stored once and applied once. The contrast: a stream with one replica
//! stops while its node is down, and loses what it held if it kept it in
//! memory; and what three replicas cost.
//!
//! Each test starts its own cluster ([`NatsCluster`]) and keeps its outbox,
//! inbox and business rows in an SQLite file of its own. The number of
//! events is `DEPLOY_JS_EVENTS` (default 2000); the R1 stream's node stays
//! down `DEPLOY_JS_R1_DOWN_MS` (default 3000) past the PubAck timeout; the
//! durable consumer's `max_expires` is `DEPLOY_JS_PULL_EXPIRES_MS` (default
//! none):
//!
//! ```text
//! cargo test -p deployments --test jetstream_cluster -- --nocapture
//! DEPLOY_JS_EVENTS=20000 cargo test -p deployments --test jetstream_cluster -- --nocapture
//! ```

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use deployments::jetstream::NatsCluster;
use deployments::process::Scratch;
use idem_conformance::Running;
use idem_core::{BoxFuture, OutboxEvent, OutboxMessage, OutboxStore, TableName, TxEngine};
use idem_inbox::Inbox;
use idem_jetstream::async_nats::{self, jetstream};
use idem_jetstream::{ConsumerOptions, HandlerError, InboxConsumer, JetStreamPublisher};
use idem_outbox::{PublishError, Publisher, Relay, RelayOptions};
use idem_sqlite::{SqliteOutbox, SqliteStore};
use jetstream::consumer::{AckPolicy, PullConsumer, pull};
use jetstream::stream::{self, StorageType};

/// The events stream (subjects `events.>`).
const EVENTS: &str = "EVENTS";
/// The dead-letter stream the consumer requires (subjects `dead.>`).
const DEAD: &str = "DEAD";
/// Events per transaction when they are enqueued.
const PER_TRANSACTION: usize = 20;
/// Rows a relay takes per pass.
const RELAY_BATCH: usize = 50;
/// How long the relay's publisher waits for a batch's PubAcks.
const ACK_TIMEOUT: Duration = Duration::from_secs(2);
/// Messages the consumer handles at once (and so at most pulls ahead).
const CONCURRENCY: usize = 8;

/// One cluster at a time: elections and catch-up on a two-core machine are
/// what is measured, not three clusters competing for the processors.
static ONE_CLUSTER_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// How long a phase over `n` events may take: a minute, and more for a
/// longer run.
fn patience(n: usize) -> Duration {
    Duration::from_secs(60) + Duration::from_millis(5 * n as u64)
}

/// The consumer's `max_expires` (`DEPLOY_JS_PULL_EXPIRES_MS`; default
/// none, so the inbox consumer's own 30 s).
fn pull_expires() -> Duration {
    std::env::var("DEPLOY_JS_PULL_EXPIRES_MS")
        .ok()
        .and_then(|v| v.parse().ok())
        .map_or(Duration::ZERO, Duration::from_millis)
}

/// Events per test (`DEPLOY_JS_EVENTS`).
fn events() -> usize {
    std::env::var("DEPLOY_JS_EVENTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2_000)
}

/// The relay's publishes through a broker connection that fails over,
/// with the outcome of every message counted.
#[derive(Clone)]
struct CountingPublisher {
    inner: JetStreamPublisher,
    counts: Arc<PublishCounts>,
}

/// What became of the messages a [`CountingPublisher`] sent.
#[derive(Default)]
struct PublishCounts {
    /// Stored: the PubAck came.
    confirmed: AtomicU64,
    /// Not confirmed: the broker was unreachable, did not answer in time, or
    /// answered "no stream" for a stream that has no leader at that moment.
    unavailable: AtomicU64,
    /// Not confirmed: no stream captures the subject.
    refused: AtomicU64,
}

impl PublishCounts {
    fn failed(&self) -> u64 {
        self.unavailable.load(Ordering::SeqCst) + self.refused.load(Ordering::SeqCst)
    }
}

impl Publisher for CountingPublisher {
    fn publish<'a>(&'a self, messages: &'a [OutboxMessage]) -> BoxFuture<'a, Vec<Result<(), PublishError>>> {
        Box::pin(async move {
            let results = self.inner.publish(messages).await;
            for r in &results {
                let counter = match r {
                    Ok(()) => &self.counts.confirmed,
                    Err(e) if e.is_refused() => &self.counts.refused,
                    Err(_) => &self.counts.unavailable,
                };
                counter.fetch_add(1, Ordering::SeqCst);
            }
            results
        })
    }
}

/// The counters idem's crates report, by name and labels, for the whole
/// test binary (each test's handler has a name of its own).
#[derive(Default)]
struct Counters(Mutex<BTreeMap<String, Arc<AtomicU64>>>);

/// A counter's name with its labels, sorted: `name{k=v,…}`.
fn counter_key(name: &str, labels: &[(&str, &str)]) -> String {
    let mut labels: Vec<String> = labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
    labels.sort();
    format!("{name}{{{}}}", labels.join(","))
}

impl metrics::Recorder for Counters {
    fn describe_counter(&self, _: metrics::KeyName, _: Option<metrics::Unit>, _: metrics::SharedString) {}
    fn describe_gauge(&self, _: metrics::KeyName, _: Option<metrics::Unit>, _: metrics::SharedString) {}
    fn describe_histogram(&self, _: metrics::KeyName, _: Option<metrics::Unit>, _: metrics::SharedString) {}

    fn register_counter(&self, key: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Counter {
        let labels: Vec<(&str, &str)> = key.labels().map(|l| (l.key(), l.value())).collect();
        let key = counter_key(key.name(), &labels);
        metrics::Counter::from_arc(self.0.lock().unwrap().entry(key).or_default().clone())
    }

    fn register_gauge(&self, _: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Gauge {
        metrics::Gauge::noop()
    }

    fn register_histogram(&self, _: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Histogram {
        metrics::Histogram::noop()
    }
}

/// The binary's recorder, installed once.
fn counters() -> &'static Counters {
    static COUNTERS: OnceLock<&'static Counters> = OnceLock::new();
    COUNTERS.get_or_init(|| {
        let counters: &'static Counters = Box::leak(Box::default());
        metrics::set_global_recorder(counters).expect("no other metrics recorder in this test binary");
        counters
    })
}

/// The value of the counter `name` with `labels` (0 if never counted).
fn counted(name: &str, labels: &[(&str, &str)]) -> u64 {
    counters()
        .0
        .lock()
        .unwrap()
        .get(&counter_key(name, labels))
        .map_or(0, |c| c.load(Ordering::SeqCst))
}

/// A stream named `name` that captures the subjects under its name in
/// lower case (`EVENTS`: `events.>`), with `replicas` replicas in
/// `storage` and a two-minute duplicate window.
fn stream_config(name: &str, storage: StorageType, replicas: usize) -> stream::Config {
    stream::Config {
        name: name.into(),
        subjects: vec![format!("{}.>", name.to_lowercase())],
        storage,
        num_replicas: replicas,
        duplicate_window: Duration::from_secs(120),
        ..Default::default()
    }
}

/// A client of the cluster connected to `first` (it keeps the order of
/// its servers), failing over to the other nodes; counts its disconnections.
async fn client_from(cluster: &NatsCluster, first: usize, disconnects: Arc<AtomicU64>) -> async_nats::Client {
    let urls = cluster.urls_from(first);
    let client = async_nats::ConnectOptions::new()
        .retain_servers_order()
        .event_callback(move |event| {
            let disconnects = disconnects.clone();
            async move {
                if matches!(event, async_nats::Event::Disconnected) {
                    disconnects.fetch_add(1, Ordering::SeqCst);
                }
            }
        })
        .connect(urls.as_slice())
        .await
        .unwrap_or_else(|e| panic!("connect to the cluster at {urls:?}: {e}"));
    assert_eq!(
        client.server_info().server_name,
        cluster.name(first),
        "the client is connected to the node to be killed"
    );
    client
}

/// A cluster, its streams, and an SQLite file with the outbox, the inbox
/// and a business table; the only one of the test binary while it lives.
struct Deployment {
    cluster: NatsCluster,
    admin: jetstream::Context,
    store: SqliteStore,
    outbox: SqliteOutbox,
    pool: sqlx::SqlitePool,
    /// When its turn came: the test's time counts from here.
    started: Instant,
    _db: Scratch,
    /// Dropped last, once the cluster has stopped.
    _one: tokio::sync::MutexGuard<'static, ()>,
}

impl Deployment {
    /// Waits for its turn, then starts a cluster with the events stream at
    /// `replicas` replicas in `storage`, and the dead-letter stream at the
    /// same replicas.
    async fn start(replicas: usize, storage: StorageType) -> Self {
        let one = ONE_CLUSTER_AT_A_TIME.lock().await;
        let started = Instant::now();
        let cluster = NatsCluster::start().await.unwrap_or_else(|e| panic!("{e}"));
        let admin = async_nats::connect(cluster.urls().as_slice())
            .await
            .expect("connect to the cluster");
        let admin = jetstream::new(admin);
        let largest = admin.client().server_info().max_payload - idem_jetstream::DEAD_LETTER_HEADROOM;
        admin
            .create_stream(stream::Config {
                // Within the inbox's TTL: only max_age bounds a redelivery.
                max_age: Duration::from_secs(3_600),
                max_message_size: i32::try_from(largest).expect("fits an i32"),
                ..stream_config(EVENTS, storage, replicas)
            })
            .await
            .expect("create the events stream");
        admin
            .create_stream(stream_config(DEAD, storage, replicas))
            .await
            .expect("create the dead-letter stream");

        let db = Scratch::new("jetstream-db").expect("a scratch directory");
        let store = SqliteStore::open(db.path().join("idem.db"))
            .await
            .expect("open the SQLite file")
            .with_table(TableName::new("inbox").unwrap());
        store.migrate().await.expect("migrate the inbox");
        let pool = store.pool().clone();
        // The lease outlasts a batch's publish (the relay's publish timeout).
        let outbox = SqliteOutbox::with_table(pool.clone(), TableName::new("outbox").unwrap())
            .with_lease(Duration::from_secs(15));
        outbox.migrate().await.expect("migrate the outbox");
        sqlx::query("CREATE TABLE applied (event_id TEXT NOT NULL, delivered INTEGER NOT NULL)")
            .execute(&pool)
            .await
            .expect("create the business table");
        Self {
            cluster,
            admin,
            store,
            outbox,
            pool,
            started,
            _db: db,
            _one: one,
        }
    }

    /// Enqueues `n` events to `subject` in transactions of
    /// [`PER_TRANSACTION`], every tenth transaction rolled back: answers the
    /// committed ids and the rolled-back ones.
    async fn enqueue(&self, subject: &str, n: usize) -> (BTreeSet<String>, BTreeSet<String>) {
        let (mut committed, mut rolled_back) = (BTreeSet::new(), BTreeSet::new());
        let mut t = 0;
        while committed.len() < n {
            t += 1;
            let commit = t % 10 != 0;
            let mut tx = self.pool.begin().await.expect("begin");
            let mut ids = Vec::new();
            for _ in 0..PER_TRANSACTION.min(n - committed.len()) {
                let event = OutboxEvent::new(subject, br#"{"amount":5}"#.to_vec()).expect("an event");
                self.outbox.enqueue(&mut tx, &event).await.expect("enqueue");
                ids.push(event.id().to_owned());
            }
            if commit {
                tx.commit().await.expect("commit");
                committed.extend(ids);
            } else {
                tx.rollback().await.expect("roll back");
                rolled_back.extend(ids);
            }
        }
        (committed, rolled_back)
    }

    async fn unsent(&self) -> u64 {
        self.outbox.lag().await.expect("outbox lag").unsent
    }

    /// The cluster node leading `stream`, once it has a leader.
    async fn stream_leader(&self, stream: &str) -> usize {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Ok(mut s) = self.admin.get_stream(stream).await
                && let Ok(info) = s.info().await
                && let Some(leader) = info.cluster.as_ref().and_then(|c| c.leader.as_deref())
                && let Some(node) = self.cluster.node_named(leader)
            {
                return node;
            }
            assert!(Instant::now() < deadline, "the stream {stream} has no leader");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Messages in `stream` now, as its leader counts them, once it has
    /// one. While a stream has no leader, the meta leader answers its info
    /// request with the configuration and an empty state (0 messages),
    /// which is no count at all.
    async fn messages(&self, stream: &str) -> u64 {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Ok(mut s) = self.admin.get_stream(stream).await
                && let Ok(info) = s.info().await
                && info
                    .cluster
                    .as_ref()
                    .and_then(|c| c.leader.as_deref())
                    .is_some_and(|l| !l.is_empty())
            {
                return info.state.messages;
            }
            assert!(Instant::now() < deadline, "the stream {stream} has no leader");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Every message of the events stream, as the event ids it carries.
    async fn stored_ids(&self) -> Vec<String> {
        let mut s = self.admin.get_stream(EVENTS).await.expect("the stream");
        let state = s.info().await.expect("stream info").state.clone();
        let mut ids = Vec::new();
        if state.messages == 0 {
            return ids;
        }
        for seq in state.first_sequence..=state.last_sequence {
            let m = s
                .get_raw_message(seq)
                .await
                .unwrap_or_else(|e| panic!("message {seq} of the stream: {e}"));
            let id = m.headers.get("Nats-Msg-Id").map(|v| v.as_str().to_owned());
            ids.push(id.unwrap_or_else(|| panic!("message {seq} has no Nats-Msg-Id")));
        }
        ids
    }

    /// Waits until every node's replica of `stream` in `nodes` holds `n`
    /// messages: a restarted node has caught up.
    async fn replicas_hold(&self, stream: &str, n: u64, nodes: &[usize]) {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let mut held = Vec::new();
            for &node in nodes {
                held.push(self.cluster.stream_messages(node, stream).await);
            }
            if held.iter().all(|h| *h == Some(n)) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the replicas of {stream} do not all hold {n} messages: {held:?}"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Starts a relay of the outbox through `client`.
    fn relay(&self, client: async_nats::Client, name: &str) -> (Running, Arc<PublishCounts>) {
        let counts = Arc::new(PublishCounts::default());
        let publisher = CountingPublisher {
            inner: JetStreamPublisher::new(jetstream::new(client)).with_ack_timeout(ACK_TIMEOUT),
            counts: counts.clone(),
        };
        let relay = Relay::new(
            self.outbox.clone(),
            publisher,
            RelayOptions {
                name: name.into(),
                batch_size: RELAY_BATCH,
                idle_wait: Duration::from_millis(20),
                backoff_min: Duration::from_millis(100),
                backoff_max: Duration::from_secs(1),
                publish_timeout: Duration::from_secs(5),
                ..Default::default()
            },
        );
        (Running::spawn(move |stop| async move { relay.run(stop).await }), counts)
    }

    /// Publishes everything unsent with a relay on a client of all nodes.
    async fn publish_all(&self) {
        let client = async_nats::connect(self.cluster.urls().as_slice())
            .await
            .expect("connect to the cluster");
        let (relay, _) = self.relay(client, "setup");
        let n = usize::try_from(self.unsent().await).expect("a count that fits");
        wait_for("every event is published", patience(n), || async {
            self.unsent().await == 0
        })
        .await;
        relay.stop().await;
    }

    /// Kills `node` once a quarter of the work is done (the events of
    /// `total` that `done` counts as `work`: "published", "applied"), with
    /// some still to do, and waits until it has gone on by another quarter
    /// through the other nodes, or finished. Progress counts past
    /// `in_hand`, the work under way at the kill that ends without the
    /// cluster.
    async fn kill_mid_work<F>(&mut self, node: usize, work: &'static str, total: u64, in_hand: u64, done: F) -> Outage
    where
        F: for<'a> Fn(&'a Self) -> BoxFuture<'a, u64>,
    {
        let within = patience(usize::try_from(total).expect("a count that fits"));
        let quarter = total / 4;
        wait_for(&format!("a quarter is {work}"), within, || async {
            done(self).await >= quarter
        })
        .await;
        self.cluster.kill(node);
        let killed_at = Instant::now();
        let at_kill = done(self).await;
        assert!(at_kill < total, "the node died with events still to be {work}");
        let first_progress = OnceLock::new();
        let through_the_others = format!("events are {work} through the other nodes");
        wait_for(&through_the_others, within, || {
            let (first_progress, now) = (&first_progress, done(self));
            async move {
                let now = now.await;
                if now > at_kill + in_hand {
                    let _ = first_progress.set(killed_at.elapsed());
                }
                now >= total || now >= at_kill + quarter
            }
        })
        .await;
        Outage {
            node,
            work,
            killed_at,
            at_kill,
            first_progress: first_progress.get().copied(),
            while_down: done(self).await - at_kill,
            down_for: Duration::ZERO,
        }
    }

    /// Rows of the business table per event id.
    async fn applied(&self) -> BTreeMap<String, i64> {
        sqlx::query_as::<_, (String, i64)>("SELECT event_id, COUNT(*) FROM applied GROUP BY event_id")
            .fetch_all(&self.pool)
            .await
            .expect("count the business rows")
            .into_iter()
            .collect()
    }
}

/// A node killed while work went on through the others.
struct Outage {
    node: usize,
    /// What the work does to an event ("published", "applied").
    work: &'static str,
    killed_at: Instant,
    /// Work done when the node died.
    at_kill: u64,
    /// How long after the kill the work first went on past what was in
    /// hand.
    first_progress: Option<Duration>,
    /// Work done from the kill until it had gone on by a quarter.
    while_down: u64,
    /// From the kill until the node was started again.
    down_for: Duration,
}

impl Outage {
    /// Starts the node again, which ends the outage.
    async fn end(&mut self, cluster: &mut NatsCluster) {
        cluster.restart(self.node).await.unwrap_or_else(|e| panic!("{e}"));
        self.down_for = self.killed_at.elapsed();
    }

    /// The outage's rows of a test's report.
    fn print(&self) {
        let first = self.first_progress.map_or(0, |t| t.as_millis());
        println!(
            "  {:<38}{first} ms",
            format!("first event {} after the kill", self.work)
        );
        println!(
            "  {:<38}{}",
            format!("{} while the node was down", self.work),
            self.while_down
        );
        println!("  {:<38}{} ms", "node down for", self.down_for.as_millis());
    }
}

/// The durable consumer `handler` of the events stream, through `js`.
async fn events_consumer(js: &jetstream::Context, handler: &str) -> PullConsumer {
    js.get_stream(EVENTS)
        .await
        .expect("the stream")
        .get_consumer(handler)
        .await
        .expect("the consumer")
}

/// Waits for `check`, failing with `what` after `within`.
async fn wait_for<F, Fut>(what: &str, within: Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + within;
    while !check().await {
        assert!(
            Instant::now() < deadline,
            "timed out after {within:?} waiting until {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The relay keeps publishing through the other nodes when the node it is
/// connected to, which also leads the R3 stream, is killed mid-publish: the
/// stream then holds each committed event exactly once, on every replica.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r3_stream_holds_every_committed_event_once_after_its_leader_dies_mid_publish() {
    let n = events();
    let mut d = Deployment::start(3, StorageType::File).await;
    let (committed, rolled_back) = d.enqueue("events.created", n).await;

    // The relay's connection and the stream's leader are on one node, so
    // one kill takes both away.
    let leader = d.stream_leader(EVENTS).await;
    let disconnects = Arc::new(AtomicU64::new(0));
    let client = client_from(&d.cluster, leader, disconnects.clone()).await;
    let (relay, counts) = d.relay(client.clone(), "r3-publish");

    // While the node is down the relay goes on through the other two. A
    // batch acknowledged just before the kill is marked sent just after it:
    // progress is more than one batch.
    let mut outage = d
        .kill_mid_work(leader, "published", n as u64, RELAY_BATCH as u64, |d| {
            Box::pin(async move { n as u64 - d.unsent().await })
        })
        .await;
    let failed_while_down = counts.failed();
    outage.end(&mut d.cluster).await;

    wait_for("every event is published", patience(n), || async {
        d.unsent().await == 0
    })
    .await;
    relay.stop().await;
    let new_leader = d.stream_leader(EVENTS).await;
    d.replicas_hold(EVENTS, committed.len() as u64, &[0, 1, 2]).await;

    let ids = d.stored_ids().await;
    let stored: BTreeSet<String> = ids.iter().cloned().collect();
    let duplicates = ids.len() - stored.len();
    let missing = committed.difference(&stored).count();
    println!();
    println!(
        "JetStream R3, file storage: relay's node and stream leader ({}) killed mid-publish",
        d.cluster.name(leader)
    );
    println!("  events committed                      {}", committed.len());
    println!("  events rolled back                    {}", rolled_back.len());
    println!("  unsent when the node died             {}", n as u64 - outage.at_kill);
    outage.print();
    println!(
        "  publish attempts not confirmed        {} (while down: {failed_while_down})",
        counts.failed()
    );
    println!(
        "    no answer in time / connection      {}",
        counts.unavailable.load(Ordering::SeqCst)
    );
    println!(
        "    refused (no stream captures it)     {}",
        counts.refused.load(Ordering::SeqCst)
    );
    println!(
        "  publishes confirmed                   {}",
        counts.confirmed.load(Ordering::SeqCst)
    );
    println!(
        "  client disconnections                 {}",
        disconnects.load(Ordering::SeqCst)
    );
    println!("  stream leader after                   {}", d.cluster.name(new_leader));
    println!("  messages in the stream                {}", ids.len());
    println!("  duplicates in the stream              {duplicates}");
    println!("  committed events missing              {missing}");
    println!(
        "  time                                  {} ms",
        d.started.elapsed().as_millis()
    );

    assert!(
        counts.failed() > 0,
        "publishes failed when the node died, and were retried"
    );
    assert!(
        disconnects.load(Ordering::SeqCst) >= 1,
        "the relay's connection was lost"
    );
    assert_ne!(
        client.server_info().server_name,
        d.cluster.name(leader),
        "the relay failed over"
    );
    assert!(outage.while_down > 0, "the relay published while the node was down");
    assert_eq!(
        counts.refused.load(Ordering::SeqCst),
        0,
        "a stream electing its leader is the broker unavailable, never a row refused"
    );
    assert_eq!(duplicates, 0, "no event is stored twice");
    assert_eq!(stored, committed, "the stream holds exactly the committed events");
    assert!(stored.is_disjoint(&rolled_back));
}

/// The inbox consumer applies every event exactly once when the node that
/// leads its R3 consumer (and holds its connection) is killed mid-consume:
/// redelivered messages find their recorded outcome and run nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r3_consumer_applies_every_event_once_after_its_leader_dies_mid_consume() {
    let n = events();
    let mut d = Deployment::start(3, StorageType::File).await;
    let (committed, _) = d.enqueue("events.created", n).await;
    d.publish_all().await;

    let handler = "r3-projection";
    let stream = d.admin.get_stream(EVENTS).await.expect("the stream");
    let mut consumer: PullConsumer = stream
        .get_or_create_consumer(
            handler,
            pull::Config {
                durable_name: Some(handler.into()),
                ack_policy: AckPolicy::Explicit,
                ack_wait: Duration::from_secs(5),
                max_deliver: -1,
                // The consumer's pulls expire after 30 s at most, with an
                // idle heartbeat of a sixth of that; a shorter bound here
                // shortens both.
                max_expires: pull_expires(),
                ..Default::default()
            },
        )
        .await
        .expect("create the consumer");
    let info = consumer.info().await.expect("consumer info");
    let leader_name = info
        .cluster
        .as_ref()
        .and_then(|c| c.leader.clone())
        .expect("a consumer leader");
    let leader = d.cluster.node_named(&leader_name).expect("a node of the cluster");

    // The consumer's connection and its leader are on one node.
    let disconnects = Arc::new(AtomicU64::new(0));
    let client = client_from(&d.cluster, leader, disconnects.clone()).await;
    let js = jetstream::new(client.clone());
    let consumer = events_consumer(&js, handler).await;
    let runs = Arc::new(AtomicU64::new(0));
    let redelivered_runs = Arc::new(AtomicU64::new(0));
    let work = {
        let (runs, redelivered_runs) = (runs.clone(), redelivered_runs.clone());
        idem_jetstream::handler::<SqliteStore, _>(move |tx, event| {
            let (runs, redelivered_runs) = (runs.clone(), redelivered_runs.clone());
            Box::pin(async move {
                runs.fetch_add(1, Ordering::SeqCst);
                if event.delivered > 1 {
                    redelivered_runs.fetch_add(1, Ordering::SeqCst);
                }
                // The business row commits with the inbox's record.
                sqlx::query("INSERT INTO applied (event_id, delivered) VALUES (?1, ?2)")
                    .bind(&event.id)
                    .bind(event.delivered)
                    .execute(&mut **tx)
                    .await
                    .map_err(HandlerError::retry)?;
                Ok(())
            })
        })
    };
    let mut options = ConsumerOptions::new(handler);
    options.concurrency = CONCURRENCY;
    options.dead_letter_subject = format!("dead.{handler}");
    counters();
    let inbox = Inbox::new(TxEngine::new(d.store.clone()));
    let consumer = InboxConsumer::start(js, consumer, inbox, options, work)
        .await
        .expect("start the consumer");
    let running = Running::spawn(move |stop| async move { consumer.run(stop).await });

    // Messages in hand or in the client's buffer at the kill run without
    // the cluster: progress is more than those.
    let mut outage = d
        .kill_mid_work(leader, "applied", n as u64, 2 * CONCURRENCY as u64, |_| {
            let now = runs.load(Ordering::SeqCst);
            Box::pin(async move { now })
        })
        .await;
    outage.end(&mut d.cluster).await;

    wait_for(
        "every event is applied and acknowledged",
        patience(n) + Duration::from_secs(30),
        || async {
            if d.applied().await.len() < committed.len() {
                return false;
            }
            let mut c = events_consumer(&d.admin, handler).await;
            c.info()
                .await
                .is_ok_and(|i| i.num_pending == 0 && i.num_ack_pending == 0)
        },
    )
    .await;
    running.stop().await;

    let applied = d.applied().await;
    let twice = applied.values().filter(|&&c| c > 1).count();
    let applied_ids: BTreeSet<String> = applied.keys().cloned().collect();
    let outcome = |o: &str| counted("idem_consumer_messages_total", &[("handler", handler), ("outcome", o)]);
    let duplicates = outcome("duplicate");
    let retried = outcome("retried");
    let ack_failures = counted("idem_consumer_ack_failures_total", &[("handler", handler)]);
    let redelivered = redelivered_runs.load(Ordering::SeqCst);
    let mut c = events_consumer(&d.admin, handler).await;
    let deliveries = c.info().await.expect("consumer info").delivered.consumer_sequence;
    println!();
    println!("JetStream R3, file storage: consumer leader and its connection ({leader_name}) killed mid-consume");
    println!("  events committed and published        {}", committed.len());
    println!("  applied when the node died            {}", outage.at_kill);
    outage.print();
    println!(
        "  client disconnections                 {}",
        disconnects.load(Ordering::SeqCst)
    );
    println!("  deliveries (server's count)           {deliveries}");
    println!("  redeliveries answered by the inbox    {duplicates}");
    println!("  redeliveries that ran the handler     {redelivered} (their first run did not commit)");
    println!("  negative acks (in flight / retried)   {retried}");
    println!("  acks not confirmed                    {ack_failures}");
    println!(
        "  handler runs                          {}",
        runs.load(Ordering::SeqCst)
    );
    println!("  events applied                        {}", applied.len());
    println!("  applied twice                         {twice}");
    println!(
        "  time                                  {} ms",
        d.started.elapsed().as_millis()
    );

    assert!(
        disconnects.load(Ordering::SeqCst) >= 1,
        "the consumer's connection was lost"
    );
    assert!(
        outage.while_down > 0,
        "the consumer applied events while the node was down"
    );
    assert!(
        duplicates + redelivered > 0,
        "messages were redelivered after the kill (the attack reached the consumer)"
    );
    assert_eq!(twice, 0, "no event applied twice");
    assert_eq!(applied_ids, committed, "every committed event applied");
}

/// What confirmed publishing costs on a stream of its own with `replicas`
/// replicas in `storage`: messages per second through the relay's publisher
/// in batches of [`RELAY_BATCH`], and the median time of one publish
/// awaited alone (500 of them).
async fn publish_cost(d: &Deployment, replicas: usize, storage: StorageType, n: usize) -> (f64, Duration) {
    let name = format!("COST_R{replicas}_{storage:?}").to_uppercase();
    let subject = name.to_lowercase();
    d.admin
        .create_stream(stream_config(&name, storage, replicas))
        .await
        .expect("create a stream to measure");
    let publisher = JetStreamPublisher::new(d.admin.clone()).with_ack_timeout(Duration::from_secs(10));
    let messages: Vec<OutboxMessage> = (0..n)
        .map(|i| OutboxMessage {
            seq: i as i64,
            id: format!("{subject}-{i}"),
            subject: format!("{subject}.created"),
            payload: br#"{"amount":5}"#.to_vec(),
            created_at_ms: 0,
            attempts: 0,
        })
        .collect();
    let started = Instant::now();
    for batch in messages.chunks(RELAY_BATCH) {
        let results = publisher.publish(batch).await;
        assert!(results.iter().all(Result::is_ok), "{name}: {results:?}");
    }
    let rate = n as f64 / started.elapsed().as_secs_f64();
    let mut one = Vec::new();
    for m in messages.iter().take(500) {
        let alone = OutboxMessage {
            id: format!("{}-alone", m.id),
            ..m.clone()
        };
        let started = Instant::now();
        let results = publisher.publish(std::slice::from_ref(&alone)).await;
        one.push(started.elapsed());
        assert!(results.iter().all(Result::is_ok), "{name}: {results:?}");
    }
    one.sort();
    let _ = d.admin.delete_stream(&name).await;
    (rate, one[one.len() / 2])
}

/// The contrast: a stream with one replica has no other node to fail over
/// to. On file storage it stops taking events while its node is down (the
/// outbox keeps them and the relay publishes them after the restart, so
/// nothing is lost to a process kill); in memory, what it held is gone with
/// the process, although the relay had its PubAcks and marked it sent,
/// while a memory stream with three replicas keeps everything.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r1_streams_stop_while_their_node_is_down_and_lose_what_they_held_in_memory() {
    let n = events();
    let down = Duration::from_millis(
        std::env::var("DEPLOY_JS_R1_DOWN_MS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(3_000),
    );
    let mut d = Deployment::start(1, StorageType::File).await;

    // What replication costs, undisturbed.
    let mut costs = Vec::new();
    for (replicas, storage) in [
        (1, StorageType::File),
        (3, StorageType::File),
        (1, StorageType::Memory),
        (3, StorageType::Memory),
    ] {
        costs.push((replicas, storage, publish_cost(&d, replicas, storage, n).await));
    }

    // File storage, one replica: the relay's connection and the stream on
    // one node, killed mid-publish as above.
    let (committed, _) = d.enqueue("events.created", n).await;
    let host = d.stream_leader(EVENTS).await;
    let disconnects = Arc::new(AtomicU64::new(0));
    let client = client_from(&d.cluster, host, disconnects.clone()).await;
    let (relay, counts) = d.relay(client, "r1-publish");
    let quarter = (n / 4) as u64;
    wait_for("a quarter is published", patience(n), || async {
        d.unsent().await <= n as u64 - quarter
    })
    .await;
    d.cluster.kill(host);
    // A batch in flight at the kill ends within the ack timeout, the PubAcks
    // that came before the kill marked sent: count from then.
    tokio::time::sleep(ACK_TIMEOUT + Duration::from_millis(500)).await;
    let unsent_at_kill = d.unsent().await;
    assert!(unsent_at_kill > 0, "the node died with events still to publish");
    tokio::time::sleep(down).await;
    let published_while_down = unsent_at_kill - d.unsent().await;
    let failed_while_down = counts.failed();
    let restarted_at = Instant::now();
    d.cluster.restart(host).await.unwrap_or_else(|e| panic!("{e}"));
    wait_for("every event is published", patience(n), || async {
        d.unsent().await == 0
    })
    .await;
    let caught_up = restarted_at.elapsed();
    relay.stop().await;
    let ids = d.stored_ids().await;
    let stored: BTreeSet<String> = ids.iter().cloned().collect();
    let duplicates = ids.len() - stored.len();
    let missing = committed.difference(&stored).count();

    // Memory storage, one replica and three: every event published and
    // marked sent, then the one replica's node killed and restarted.
    for (name, replicas) in [("MEM1", 1), ("MEM3", 3)] {
        d.admin
            .create_stream(stream_config(name, StorageType::Memory, replicas))
            .await
            .expect("create a memory stream");
        d.enqueue(&format!("{}.created", name.to_lowercase()), n).await;
    }
    d.publish_all().await;
    let (mem1_before, mem3_before) = (d.messages("MEM1").await, d.messages("MEM3").await);
    let mem1_host = d.stream_leader("MEM1").await;
    d.cluster.kill(mem1_host);
    d.cluster.restart(mem1_host).await.unwrap_or_else(|e| panic!("{e}"));
    let (mem1_after, mem3_after) = (d.messages("MEM1").await, d.messages("MEM3").await);
    // The restarted node's replica, empty at its start, is filled again
    // from the two others.
    d.replicas_hold("MEM3", n as u64, &[0, 1, 2]).await;
    let unsent_after = d.unsent().await;

    println!();
    println!("Confirmed publishes, undisturbed ({n} messages in batches of {RELAY_BATCH}; 500 alone)");
    for (replicas, storage, (rate, one)) in &costs {
        println!(
            "  R{replicas} {:<8} {rate:>8.0} msg/s   one publish (median) {:.2} ms",
            format!("{storage:?}"),
            one.as_secs_f64() * 1000.0
        );
    }
    println!(
        "JetStream R1, file storage: the stream's node and the relay's ({}) killed mid-publish",
        d.cluster.name(host)
    );
    println!("  events committed                      {}", committed.len());
    println!("  unsent once in-flight batches ended   {unsent_at_kill}");
    println!(
        "  node down for                         {} ms (counted over the last {} ms)",
        (down + ACK_TIMEOUT + Duration::from_millis(500)).as_millis(),
        down.as_millis()
    );
    println!("  published while the node was down    {published_while_down}");
    println!(
        "  publish attempts not confirmed        {} (while down: {failed_while_down})",
        counts.failed()
    );
    println!("  restart until all published           {} ms", caught_up.as_millis());
    println!("  messages in the stream                {}", ids.len());
    println!("  duplicates in the stream              {duplicates}");
    println!("  committed events missing              {missing}");
    println!(
        "JetStream memory storage: every event confirmed, then the R1 stream's node ({}) killed and restarted",
        d.cluster.name(mem1_host)
    );
    println!(
        "  R1 stream: messages before / after    {mem1_before} / {mem1_after} (lost {})",
        mem1_before - mem1_after
    );
    println!(
        "  R3 stream: messages before / after    {mem3_before} / {mem3_after} (lost {})",
        mem3_before - mem3_after
    );
    println!("  outbox rows unsent (to publish again) {unsent_after}");
    println!(
        "  time                                  {} ms",
        d.started.elapsed().as_millis()
    );

    assert_eq!(
        published_while_down, 0,
        "nothing is published while the only replica is down"
    );
    assert!(failed_while_down > 0, "the relay kept trying while the stream was down");
    assert_eq!(duplicates, 0, "no event is stored twice");
    assert_eq!(stored, committed, "a process kill loses nothing from a file stream");
    assert_eq!(mem1_before, n as u64);
    assert_eq!(
        mem1_after, 0,
        "a memory stream's only replica loses everything with its process"
    );
    assert_eq!(
        unsent_after, 0,
        "the outbox had marked every lost event sent: nothing publishes them again"
    );
    assert_eq!(
        (mem3_before, mem3_after),
        (n as u64, n as u64),
        "three memory replicas survive one kill"
    );
}
