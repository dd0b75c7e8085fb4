//! The relay loop on paused time, with an in-memory outbox and a scripted
//! broker: rows the broker refuses (no stream captures their subject) wait
//! on their own schedule and never hold up the rows behind them, while an
//! unavailable broker pauses the relay.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem_core::{BoxFuture, OutboxBatch, OutboxLag, OutboxMessage, OutboxStore, RetryBackoff};
use idem_outbox::{PublishError, Publisher, Relay, RelayOptions};
use tokio::time::Instant;

#[derive(Debug)]
struct Row {
    message: OutboxMessage,
    sent: bool,
    next_at: Instant,
}

/// Unsent rows in insertion order, each with its own retry time.
#[derive(Clone, Default)]
struct Outbox {
    rows: Arc<Mutex<Vec<Row>>>,
    oldest_unsent_age_ms: Arc<Mutex<Option<i64>>>,
}

impl Outbox {
    fn enqueue(&self, subject: &str) -> i64 {
        let mut rows = self.rows.lock().unwrap();
        let seq = rows.len() as i64 + 1;
        rows.push(Row {
            message: OutboxMessage {
                seq,
                id: format!("e{seq}"),
                subject: subject.to_owned(),
                payload: b"{}".to_vec(),
                created_at_ms: 0,
                attempts: 0,
            },
            sent: false,
            next_at: Instant::now(),
        });
        seq
    }

    fn sent(&self, seq: i64) -> bool {
        self.rows.lock().unwrap()[(seq - 1) as usize].sent
    }
}

struct Batch {
    rows: Arc<Mutex<Vec<Row>>>,
    messages: Vec<OutboxMessage>,
}

impl OutboxBatch for Batch {
    fn messages(&self) -> &[OutboxMessage] {
        &self.messages
    }

    fn finish(self, sent: Vec<i64>, backoff: RetryBackoff) -> BoxFuture<'static, idem_core::Result<()>> {
        let mut rows = self.rows.lock().unwrap();
        for m in &self.messages {
            let row = &mut rows[(m.seq - 1) as usize];
            if sent.contains(&m.seq) {
                row.sent = true;
            } else {
                row.message.attempts += 1;
                let wait = backoff
                    .min_ms
                    .saturating_mul(1 << row.message.attempts.min(20))
                    .min(backoff.max_ms);
                row.next_at = Instant::now() + Duration::from_millis(wait as u64);
            }
        }
        Box::pin(async { Ok(()) })
    }
}

impl OutboxStore for Outbox {
    type Batch = Batch;

    fn take(&self, limit: usize) -> BoxFuture<'_, idem_core::Result<Batch>> {
        let now = Instant::now();
        let messages = self
            .rows
            .lock()
            .unwrap()
            .iter()
            .filter(|r| !r.sent && r.next_at <= now)
            .take(limit)
            .map(|r| r.message.clone())
            .collect();
        let rows = self.rows.clone();
        Box::pin(async move { Ok(Batch { rows, messages }) })
    }

    fn lag(&self) -> BoxFuture<'_, idem_core::Result<OutboxLag>> {
        let lag = OutboxLag {
            unsent: self.rows.lock().unwrap().iter().filter(|r| !r.sent).count() as u64,
            oldest_unsent_age_ms: *self.oldest_unsent_age_ms.lock().unwrap(),
        };
        Box::pin(async move { Ok(lag) })
    }

    fn purge_sent(&self, _older_than_ms: i64, _limit: u32) -> BoxFuture<'_, idem_core::Result<u64>> {
        Box::pin(async { Ok(0) })
    }
}

/// Confirms `routable.*`, refuses any other subject, or is down.
#[derive(Clone, Default)]
struct Broker {
    down: bool,
    batches: Arc<Mutex<usize>>,
}

impl Publisher for Broker {
    fn publish<'a>(&'a self, messages: &'a [OutboxMessage]) -> BoxFuture<'a, Vec<Result<(), PublishError>>> {
        *self.batches.lock().unwrap() += 1;
        let results = messages
            .iter()
            .map(|m| {
                if self.down {
                    Err(PublishError::unavailable("not connected"))
                } else if m.subject.starts_with("routable.") {
                    Ok(())
                } else {
                    Err(PublishError::refused("no stream captures the subject"))
                }
            })
            .collect();
        Box::pin(async move { results })
    }
}

/// A relay running in the background until stopped.
struct Running {
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<()>,
}

impl Running {
    fn start(relay: Relay<Outbox, Broker>) -> Self {
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            relay
                .run(async {
                    let _ = stopped.await;
                })
                .await
        });
        Self { stop, task }
    }

    fn is_finished(&self) -> bool {
        self.task.is_finished()
    }

    /// Stops the relay; answers how its task ended.
    async fn stop(self) -> Result<(), tokio::task::JoinError> {
        let _ = self.stop.send(());
        self.task.await
    }
}

fn options() -> RelayOptions {
    RelayOptions {
        batch_size: 100,
        idle_wait: Duration::from_millis(20),
        backoff_min: Duration::from_millis(100),
        backoff_max: Duration::from_secs(60),
        ..RelayOptions::default()
    }
}

#[tokio::test(start_paused = true)]
async fn refused_rows_never_hold_up_the_rows_behind_them() {
    let outbox = Outbox::default();
    for _ in 0..1_000 {
        outbox.enqueue("unroutable.x");
    }
    let last = outbox.enqueue("routable.x");
    let relay = Relay::new(outbox.clone(), Broker::default(), options());
    let started = Instant::now();
    let running = Running::start(relay);
    while !outbox.sent(last) {
        tokio::time::sleep(Duration::from_millis(1)).await;
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "the routable row was never published"
        );
    }
    // Ten batches of refused rows, one after another, with no pause: on
    // paused time, the routable row went out before the first refused row
    // was even due again (100 ms).
    assert!(
        started.elapsed() < Duration::from_millis(100),
        "a backlog of refused rows paused the relay for {:?}",
        started.elapsed()
    );
    running.stop().await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn an_unavailable_broker_pauses_the_relay() {
    let outbox = Outbox::default();
    for _ in 0..1_000 {
        outbox.enqueue("routable.x");
    }
    let broker = Broker {
        down: true,
        ..Broker::default()
    };
    let batches = broker.batches.clone();
    let relay = Relay::new(outbox.clone(), broker, options());
    let running = Running::start(relay);
    tokio::time::sleep(Duration::from_secs(10)).await;
    running.stop().await.unwrap();
    // Exponential pauses from 100 ms: about seven batches in ten seconds,
    // not one per due row.
    let batches = *batches.lock().unwrap();
    assert!((2..=12).contains(&batches), "{batches} batches in 10 s of outage");
    assert!(!outbox.sent(1));
}

/// A relay that starts with rows unsent for longer than the consumers'
/// inbox horizon says so; younger rows, or no horizon set, say nothing.
#[tokio::test]
async fn rows_unsent_past_the_inbox_horizon_are_reported_at_start() {
    let outbox = Outbox::default();
    outbox.enqueue("routable.a");
    *outbox.oldest_unsent_age_ms.lock().unwrap() = Some(2 * 86_400_000);
    let horizon = RelayOptions {
        stale_unsent_after: Some(Duration::from_secs(86_400)),
        ..options()
    };
    let relay = Relay::new(outbox.clone(), Broker::default(), horizon.clone());
    let lag = relay.check_stale().await.unwrap().expect("reported");
    assert_eq!(lag.unsent, 1);
    assert_eq!(
        Relay::new(outbox.clone(), Broker::default(), options())
            .check_stale()
            .await
            .unwrap(),
        None
    );
    *outbox.oldest_unsent_age_ms.lock().unwrap() = Some(3_600_000);
    assert_eq!(
        Relay::new(outbox, Broker::default(), horizon)
            .check_stale()
            .await
            .unwrap(),
        None
    );
}

#[tokio::test(start_paused = true)]
async fn a_housekeeping_interval_beyond_any_instant_still_relays() {
    let outbox = Outbox::default();
    let last = outbox.enqueue("routable.x");
    let options = RelayOptions {
        housekeeping_every: Duration::MAX,
        ..options()
    };
    let relay = Relay::new(outbox.clone(), Broker::default(), options);
    let running = Running::start(relay);
    let started = Instant::now();
    while !outbox.sent(last) && !running.is_finished() {
        tokio::time::sleep(Duration::from_millis(1)).await;
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the row was never published"
        );
    }
    running
        .stop()
        .await
        .expect("the relay runs with any housekeeping interval");
    assert!(outbox.sent(last));
}
