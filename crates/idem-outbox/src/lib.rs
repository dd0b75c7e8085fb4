//! The transactional outbox relay.
//!
//! The guide, with examples: `docs/events.md` in the repository.
//!
//! A service enqueues an event in the same database transaction as the
//! business change it announces (`PgOutbox::enqueue`, `MySqlOutbox::enqueue`,
//! `SqliteOutbox::enqueue`), so the event exists if and only if the change
//! committed. A [`Relay`] takes unsent rows, hands them to a [`Publisher`]
//! (NATS JetStream in `idem-jetstream`), waits for the broker to confirm each
//! one, and only then marks it sent.
//!
//! - **At least once.** A relay that dies between the broker's confirmation
//!   and marking the row sent publishes it again on the next pass: the
//!   broker deduplicates by event id (`Nats-Msg-Id`) within its window, and
//!   consumers deduplicate through their inbox.
//! - **Several relays in parallel** never take the same row: the stores take
//!   rows with `FOR UPDATE SKIP LOCKED` (PostgreSQL, MySQL/MariaDB) or by a
//!   lease with a token (SQLite).
//! - **No row is skipped.** No relay keeps a high-water mark: every pass
//!   looks at every unsent row, so a row whose transaction began first and
//!   committed last is published on the first pass after its commit.
//! - **Backoff** on broker or database errors (exponential with jitter, from
//!   [`backon`]); **retention** of sent rows (deleted in bounded batches
//!   after [`RelayOptions::retention`]); **lag metrics**: the number of
//!   unsent rows and the age of the oldest.
//!
//! ```no_run
//! # async fn demo(outbox: impl idem_core::OutboxStore, publisher: impl idem_outbox::Publisher) {
//! use idem_outbox::{Relay, RelayOptions};
//! // `outbox`: a PgOutbox, MySqlOutbox or SqliteOutbox; `publisher`: a JetStreamPublisher.
//! let relay = Relay::new(outbox, publisher, RelayOptions::default());
//! relay.run(std::future::pending::<()>()).await;   // until a shutdown future completes
//! # }
//! ```
//!
//! Metrics (label `outbox`, the relay's configured name):
//! `idem_outbox_published_total`, `idem_outbox_publish_failures_total`,
//! `idem_outbox_purged_total`, `idem_outbox_stale_unsent_at_start_total`
//! (counters), `idem_outbox_unsent` and
//! `idem_outbox_oldest_unsent_age_seconds` (gauges).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBuilder};
use idem_core::{BoxFuture, OutboxBatch, OutboxLag, OutboxMessage, OutboxStore, RetryBackoff};
use tokio::sync::Notify;
use tokio::time::Instant;

pub use idem_core::OutboxEvent;

/// Why the broker did not confirm one message.
///
/// A message the broker *refused* (no stream captures its subject) is tried
/// again on its row's own schedule and never pauses the relay, so a backlog
/// of unroutable rows cannot hold up the rows behind it. A broker that is
/// *unavailable* (not connected, no answer in time) pauses the relay when
/// nothing of a batch got through.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct PublishError {
    message: String,
    refused: bool,
}

impl PublishError {
    /// The broker answered and refused this message.
    pub fn refused(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            refused: true,
        }
    }

    /// The broker could not be reached or did not answer in time.
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            refused: false,
        }
    }

    /// Whether the broker refused the message (rather than being unavailable).
    pub fn is_refused(&self) -> bool {
        self.refused
    }
}

/// Sends messages to a broker.
pub trait Publisher: Send + Sync + 'static {
    /// Publishes `messages` in order and answers, for each, whether the
    /// broker confirmed it (stored it durably). A message is marked sent
    /// only on `Ok`.
    fn publish<'a>(&'a self, messages: &'a [OutboxMessage]) -> BoxFuture<'a, Vec<Result<(), PublishError>>>;
}

/// How a relay runs.
#[derive(Debug, Clone)]
pub struct RelayOptions {
    /// The `outbox` label of its metrics (one per outbox; keep the set small).
    pub name: String,
    /// Rows taken per pass.
    pub batch_size: usize,
    /// How long an idle relay waits before it looks again (a
    /// [`Relay::waker`] notification ends the wait early).
    pub idle_wait: Duration,
    /// The first and the longest pause after an error (exponential, with
    /// jitter, reset by a pass without errors); also the bounds of each
    /// unconfirmed row's own retry schedule, so a row that keeps failing
    /// never holds up the rows behind it.
    pub backoff_min: Duration,
    /// See [`backoff_min`](Self::backoff_min).
    pub backoff_max: Duration,
    /// How long sent rows are kept; `None` keeps them.
    pub retention: Option<Duration>,
    /// Rows deleted per retention batch.
    pub purge_batch: u32,
    /// How often retention and the lag gauges run.
    pub housekeeping_every: Duration,
    /// The longest one batch may take to publish; what is unconfirmed then
    /// counts as failed. Keep it shorter than a SQLite outbox's relay lease.
    pub publish_timeout: Duration,
    /// Rows unsent for longer than this are reported when the relay starts
    /// (an error log and `idem_outbox_stale_unsent_at_start_total`): a row
    /// the broker stored before a crash and that was not marked sent is
    /// published again, as a new copy once the broker's duplicate window
    /// has passed, which consumers may receive for as long as the stream
    /// keeps it. Set it to the consumers' inbox TTL minus the stream's
    /// `max_age`: an older row can reach a consumer after its inbox forgot
    /// the event. `None`: no check.
    pub stale_unsent_after: Option<Duration>,
}

impl Default for RelayOptions {
    fn default() -> Self {
        Self {
            name: "default".into(),
            batch_size: 100,
            idle_wait: Duration::from_millis(50),
            backoff_min: Duration::from_millis(100),
            backoff_max: Duration::from_secs(10),
            retention: Some(Duration::from_secs(7 * 86_400)),
            purge_batch: 1_000,
            housekeeping_every: Duration::from_secs(5),
            publish_timeout: Duration::from_secs(10),
            stale_unsent_after: None,
        }
    }
}

/// What one pass did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PassReport {
    /// Rows taken.
    pub taken: usize,
    /// Rows the broker confirmed and that were marked sent.
    pub published: usize,
    /// Rows the broker did not confirm (taken again on a later pass).
    pub failed: usize,
    /// Of those, rows not confirmed because the broker was unavailable.
    pub unavailable: usize,
}

/// Why a pass failed as a whole.
#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    /// The database failed (taking rows or marking them sent).
    #[error("outbox store: {0}")]
    Store(#[from] idem_core::Error),
}

/// Publishes an outbox's rows.
pub struct Relay<S, P> {
    store: S,
    publisher: Arc<P>,
    options: RelayOptions,
    wake: Arc<Notify>,
}

impl<S: OutboxStore, P: Publisher> Relay<S, P> {
    /// A relay of `store`'s rows through `publisher`.
    pub fn new(store: S, publisher: P, options: RelayOptions) -> Self {
        Self {
            store,
            publisher: Arc::new(publisher),
            options,
            wake: Arc::new(Notify::new()),
        }
    }

    /// A handle that ends an idle wait: call `notify_one()` after committing
    /// a transaction that enqueued events, to publish them without waiting
    /// for the next poll.
    pub fn waker(&self) -> Arc<Notify> {
        self.wake.clone()
    }

    /// The store.
    pub fn store(&self) -> &S {
        &self.store
    }

    /// One pass: take a batch, publish it, mark what the broker confirmed.
    pub async fn pass(&self) -> Result<PassReport, RelayError> {
        let batch = self.store.take(self.options.batch_size.max(1)).await?;
        let taken = batch.messages().len();
        if taken == 0 {
            batch.finish(Vec::new(), self.retry_backoff()).await?;
            return Ok(PassReport::default());
        }
        // Nothing confirmed within the timeout counts as failed.
        let results = tokio::time::timeout(self.options.publish_timeout, self.publisher.publish(batch.messages()))
            .await
            .unwrap_or_default();
        let mut sent = Vec::with_capacity(taken);
        let (mut failed, mut unavailable) = (0, 0);
        for (i, message) in batch.messages().iter().enumerate() {
            match results.get(i) {
                Some(Ok(())) => sent.push(message.seq),
                Some(Err(e)) => {
                    failed += 1;
                    unavailable += usize::from(!e.is_refused());
                    tracing::debug!(event_id = %message.id, error = %e, "publish not confirmed");
                }
                None => {
                    failed += 1;
                    unavailable += 1;
                }
            }
        }
        let published = sent.len();
        batch.finish(sent, self.retry_backoff()).await?;
        let label = [("outbox", self.options.name.clone())];
        metrics::counter!("idem_outbox_published_total", &label).increment(published as u64);
        if failed > 0 {
            metrics::counter!("idem_outbox_publish_failures_total", &label).increment(failed as u64);
        }
        Ok(PassReport {
            taken,
            published,
            failed,
            unavailable,
        })
    }

    /// Measures the lag and sets the gauges.
    pub async fn lag(&self) -> Result<OutboxLag, RelayError> {
        let lag = self.store.lag().await?;
        let label = [("outbox", self.options.name.clone())];
        metrics::gauge!("idem_outbox_unsent", &label).set(lag.unsent as f64);
        metrics::gauge!("idem_outbox_oldest_unsent_age_seconds", &label)
            .set(lag.oldest_unsent_age_ms.unwrap_or(0) as f64 / 1000.0);
        Ok(lag)
    }

    /// Whether the outbox holds rows unsent for longer than
    /// [`RelayOptions::stale_unsent_after`]: if so, says so loudly (an error
    /// log, `idem_outbox_stale_unsent_at_start_total`) and answers the lag.
    /// [`run`](Self::run) checks once at start.
    pub async fn check_stale(&self) -> Result<Option<OutboxLag>, RelayError> {
        let Some(limit) = self.options.stale_unsent_after else {
            return Ok(None);
        };
        let lag = self.store.lag().await?;
        let age_ms = lag.oldest_unsent_age_ms.unwrap_or(0);
        if u128::try_from(age_ms).unwrap_or(0) <= limit.as_millis() {
            return Ok(None);
        }
        metrics::counter!("idem_outbox_stale_unsent_at_start_total", "outbox" => self.options.name.clone())
            .increment(1);
        tracing::error!(
            outbox = %self.options.name,
            unsent = lag.unsent,
            oldest_unsent_age_s = age_ms / 1000,
            limit_s = limit.as_secs(),
            "unsent rows older than the consumers' inbox horizon: one that was published before a crash may now \
             reach a consumer that has forgotten it, and be applied twice; check the consumers before relaying"
        );
        Ok(Some(lag))
    }

    /// Deletes sent rows past the retention, in bounded batches; answers how
    /// many.
    pub async fn purge(&self) -> Result<u64, RelayError> {
        let Some(retention) = self.options.retention else {
            return Ok(0);
        };
        let older_than = i64::try_from(retention.as_millis()).unwrap_or(i64::MAX);
        let mut total = 0;
        // At most a few batches per round, so retention never starves publishing.
        for _ in 0..10 {
            let n = self.store.purge_sent(older_than, self.options.purge_batch).await?;
            total += n;
            if n < u64::from(self.options.purge_batch) {
                break;
            }
        }
        if total > 0 {
            metrics::counter!("idem_outbox_purged_total", "outbox" => self.options.name.clone()).increment(total);
        }
        Ok(total)
    }

    /// When a row the broker did not confirm is tried again.
    fn retry_backoff(&self) -> RetryBackoff {
        RetryBackoff {
            min_ms: i64::try_from(self.options.backoff_min.as_millis()).unwrap_or(i64::MAX),
            max_ms: i64::try_from(self.options.backoff_max.as_millis()).unwrap_or(i64::MAX),
        }
    }

    fn backoff(&self) -> impl Iterator<Item = Duration> + use<S, P> {
        ExponentialBuilder::default()
            .with_min_delay(self.options.backoff_min)
            .with_max_delay(self.options.backoff_max)
            .with_jitter()
            .without_max_times()
            .build()
    }

    /// Runs passes until `shutdown` completes: publishes while there are
    /// rows, waits [`RelayOptions::idle_wait`] (or a wake) when there are
    /// none, backs off on errors, and keeps the lag gauges and retention
    /// going. A pass in progress when `shutdown` completes is finished.
    pub async fn run(&self, shutdown: impl Future<Output = ()>) {
        tokio::pin!(shutdown);
        let mut backoff = self.backoff();
        // `None`: the next housekeeping is further away than any instant.
        let mut next_housekeeping = Some(Instant::now());
        if let Err(e) = self.check_stale().await {
            tracing::warn!(error = %e, "the age of unsent rows was not checked");
        }
        loop {
            if next_housekeeping.is_some_and(|at| Instant::now() >= at) {
                next_housekeeping = Instant::now().checked_add(self.options.housekeeping_every);
                if let Err(e) = self.lag().await {
                    tracing::warn!(error = %e, "outbox lag not measured");
                }
                if let Err(e) = self.purge().await {
                    tracing::warn!(error = %e, "outbox retention failed");
                }
            }
            let pause = match self.pass().await {
                // Each unconfirmed row has its own retry time; the relay
                // itself pauses only when nothing at all got through and the
                // broker was unavailable (refused rows wait on their own).
                Ok(report) if report.unavailable > 0 && report.published == 0 => {
                    let pause = backoff.next().unwrap_or(self.options.backoff_max);
                    tracing::warn!(
                        failed = report.failed,
                        published = report.published,
                        pause_ms = pause.as_millis() as u64,
                        "the broker did not confirm every message; backing off"
                    );
                    Some(pause)
                }
                Ok(report) if report.taken == 0 => {
                    backoff = self.backoff();
                    None
                }
                Ok(_) => {
                    backoff = self.backoff();
                    // More rows may be waiting: go again at once.
                    if futures_ready(&mut shutdown).await {
                        return;
                    }
                    continue;
                }
                Err(e) => {
                    let pause = backoff.next().unwrap_or(self.options.backoff_max);
                    tracing::warn!(error = %e, pause_ms = pause.as_millis() as u64, "outbox pass failed; backing off");
                    Some(pause)
                }
            };
            let wait = pause.unwrap_or(self.options.idle_wait);
            tokio::select! {
                _ = &mut shutdown => return,
                _ = tokio::time::sleep(wait) => {}
                _ = self.wake.notified(), if pause.is_none() => {}
            }
        }
    }
}

/// Whether `shutdown` has completed, without waiting for it.
async fn futures_ready(shutdown: &mut std::pin::Pin<&mut impl Future<Output = ()>>) -> bool {
    tokio::select! {
        biased;
        _ = shutdown.as_mut() => true,
        _ = std::future::ready(()) => false,
    }
}

impl<S: std::fmt::Debug, P> std::fmt::Debug for Relay<S, P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Relay")
            .field("store", &self.store)
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}
