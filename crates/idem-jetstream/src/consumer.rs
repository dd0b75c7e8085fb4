//! A JetStream pull consumer that applies each message through an inbox.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::consumer::PullConsumer;
use async_nats::jetstream::context::Context;
use async_nats::jetstream::message::AckKind;
use async_nats::jetstream::message::PublishMessage as Publish;
use bytes::Bytes;
use futures_util::{FutureExt, StreamExt};
use idem_core::{BoxFuture, Tenant, TxBackend};
use idem_inbox::{Delivery, Inbox};
use serde::{Deserialize, Serialize};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use crate::checks;
use crate::error::{ConsumerError, HandlerError};

/// The header that carries the event id (set by the outbox relay).
pub const MSG_ID: &str = "Nats-Msg-Id";
/// On a dead letter and on a redriven copy: the original event id.
pub const EVENT_ID: &str = "Idem-Event-Id";
/// On a redriven copy: the one handler that is to run it again (every other
/// consumer of the subject acknowledges it without running anything).
pub const REDRIVE: &str = "Idem-Redrive";

/// What the consumer records in the inbox for an event: `None` (JSON
/// `null`) when the handler's writes committed, `Some` when the event was
/// kept as a dead letter instead (recorded before the dead letter is
/// published). Either way an ordinary redelivery does not run the handler;
/// only a redrive ([`redrive`](crate::redrive())) runs a dead-lettered
/// event, once, under its redrive key.
pub type Recorded = Option<DeadLettered>;

/// How long a redrive key's record is kept: ten years, the longest TTL the
/// core allows, whatever the inbox's own TTL. A dead letter is kept until it
/// is handled, so a redriven copy of it can come at any time.
pub const REDRIVE_KEY_TTL_SECS: u64 = 10 * 365 * 86_400;

/// The inbox's record of an event kept as a dead letter: its own key is
/// closed, and the handler runs it only through a redrive.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeadLettered {
    /// Deliveries made before it was kept; 0 when a redrive closed the key
    /// (the key had no record when a redriven copy came).
    pub dead_lettered_after: i64,
    /// Why (the last failure).
    pub error: String,
}

/// One message, as the handler sees it.
#[derive(Debug, Clone)]
pub struct Event {
    /// The event id (`Nats-Msg-Id`): the inbox key.
    pub id: String,
    /// The subject it was published to.
    pub subject: String,
    /// The payload.
    pub payload: Bytes,
    /// Which delivery of the message this is (1 for the first).
    pub delivered: i64,
}

/// How an [`InboxConsumer`] runs.
#[derive(Debug, Clone)]
pub struct ConsumerOptions {
    /// The inbox handler's name: its key space, and the `handler` label of
    /// its metrics.
    pub handler: String,
    /// Deliveries after which a message that keeps failing becomes a dead
    /// letter. It counts the server's deliveries of the message (its
    /// `delivered` count), which include deliveries the handler never saw
    /// (a copy redelivered after `ack_wait` while it waited in the client's
    /// buffer, a copy that came while another ran the handler). A copy
    /// that finds the event in flight elsewhere ran nothing and never makes
    /// a dead letter: it is delivered again later. So a transient failure
    /// becomes a dead letter only after a run that failed, and a handler
    /// that keeps failing gets at most `max_deliveries` runs.
    pub max_deliveries: i64,
    /// The delay before the n-th redelivery after a transient failure (the
    /// last one repeats).
    pub retry_delays: Vec<Duration>,
    /// Messages handled at once.
    pub concurrency: usize,
    /// How often a running handler tells the server it is still working
    /// (`None`: a third of the consumer's `ack_wait`).
    pub progress_every: Option<Duration>,
    /// Where dead letters are published (a stream must capture it; the
    /// message is terminated only after the server stored its copy).
    pub dead_letter_subject: String,
    /// Messages fetched per pull request (at most `concurrency`, and at
    /// most the consumer's `max_batch`).
    pub batch: usize,
}

impl ConsumerOptions {
    /// Defaults for `handler`: 5 deliveries, delays 1 s, 5 s, 30 s, 60 s,
    /// 8 at once, dead letters to `idem.dead.<handler>`.
    pub fn new(handler: impl Into<String>) -> Self {
        let handler = handler.into();
        Self {
            dead_letter_subject: format!("idem.dead.{handler}"),
            handler,
            max_deliveries: 5,
            retry_delays: vec![
                Duration::from_secs(1),
                Duration::from_secs(5),
                Duration::from_secs(30),
                Duration::from_secs(60),
            ],
            concurrency: 8,
            progress_every: None,
            batch: 100,
        }
    }

    pub(crate) fn retry_delay(&self, delivered: i64) -> Duration {
        let i = usize::try_from(delivered.saturating_sub(1)).unwrap_or(0);
        self.retry_delays
            .get(i)
            .or(self.retry_delays.last())
            .copied()
            .unwrap_or(Duration::from_secs(1))
    }
}

/// Gives a closure the handler's signature (closures do not infer
/// higher-ranked lifetimes on their own):
///
/// ```text
/// let h = idem_jetstream::handler::<MyStore, _>(|tx, event| Box::pin(async move { Ok(()) }));
/// ```
pub fn handler<B, F>(f: F) -> F
where
    B: TxBackend,
    F: for<'c> Fn(&'c mut B::Tx, Arc<Event>) -> BoxFuture<'c, Result<(), HandlerError>> + Send + Sync + 'static,
{
    f
}

type Handler<B> =
    dyn for<'c> Fn(&'c mut <B as TxBackend>::Tx, Arc<Event>) -> BoxFuture<'c, Result<(), HandlerError>> + Send + Sync;

/// A pull consumer whose every message runs through an [`Inbox`].
pub struct InboxConsumer<B: TxBackend> {
    inner: Arc<Inner<B>>,
    consumer: PullConsumer,
}

struct Inner<B: TxBackend> {
    inbox: Inbox<B>,
    js: Context,
    options: ConsumerOptions,
    progress_every: Duration,
    pull_batch: usize,
    pull_expires: Duration,
    /// The inbox under the redrive tenant, keeping keys
    /// [`REDRIVE_KEY_TTL_SECS`].
    redrive_inbox: Inbox<B>,
    /// The largest dead letter the server and the dead-letter stream
    /// accept, headers included.
    dead_letter_bytes: usize,
    handler: Box<Handler<B>>,
}

impl<B: TxBackend> std::fmt::Debug for InboxConsumer<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InboxConsumer")
            .field("options", &self.inner.options)
            .finish_non_exhaustive()
    }
}

/// What became of one message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Handled {
    Applied,
    Duplicate,
    /// A redelivery of an event kept as a dead letter: not run again.
    DuplicateDeadLetter,
    Redriven,
    /// A redriven copy meant for another handler.
    NotMine,
    Retried,
    DeadLettered,
}

/// What running a message through the inbox came to.
#[derive(Debug)]
enum Ran {
    Done(Handled),
    /// The event's own key is closed as a dead letter: nothing ran.
    Closed(DeadLettered),
}

impl Handled {
    fn label(self) -> &'static str {
        match self {
            Handled::Applied => "applied",
            Handled::Duplicate => "duplicate",
            Handled::DuplicateDeadLetter => "duplicate_dead_letter",
            Handled::Redriven => "redriven",
            Handled::NotMine => "redrive_for_another_handler",
            Handled::Retried => "retried",
            Handled::DeadLettered => "dead_lettered",
        }
    }
}

impl<B: TxBackend + Clone> InboxConsumer<B> {
    /// Checks the settings and builds the consumer.
    ///
    /// Refuses ([`ConsumerError::Config`], naming the stream and the
    /// setting) when a redelivery could reach the handler after the inbox
    /// forgot the event, when a message could be removed before it is
    /// applied or kept as a dead letter, or when a dead letter could not be
    /// stored or kept:
    ///
    /// - the consumer must acknowledge explicitly;
    /// - its `max_deliver` must be unlimited (-1): this consumer bounds
    ///   deliveries itself, and a message whose dead letter could not be
    ///   stored must come back rather than be dropped (a server-side bound
    ///   would drop it silently, so none is safe);
    /// - the dead-letter subject must be one a message can be published to,
    ///   and a stream must capture it (otherwise no dead letter could ever
    ///   be stored and every permanent failure would loop);
    /// - the stream must remove messages by age (`max_age`), no later than
    ///   the inbox forgets their ids: a consumer killed between its commit
    ///   and its ack gets the message again whenever it next pulls, for as
    ///   long as the stream keeps it, so only `max_age` bounds when a
    ///   redelivery can come;
    /// - `max_age` must outlast the delivery schedule of a message that
    ///   keeps failing, `max_deliveries` × the longest of the consumer's ack
    ///   wait (or server-side `backoff` step) and the retry delay, so that
    ///   it becomes a dead letter before the stream drops it;
    /// - no count or size limit of the stream may evict a message waiting
    ///   for its retry: `max_messages` and `max_bytes` only under discard
    ///   policy `New` (a full stream refuses new messages, and their
    ///   publisher tries again), `max_messages_per_subject` only with
    ///   `discard_new_per_subject` too; any retention policy (`Interest` and
    ///   `WorkQueue` remove only messages acknowledged or terminated);
    /// - a dead letter lives until it is handled: the dead-letter stream
    ///   must have no `max_age`, no evicting limit (as above) and `Limits`
    ///   retention, so dead letters need a stream of their own;
    /// - a dead letter must always fit: the stream's `max_msg_size` must be
    ///   set, at most the server's `max_payload` (and the dead-letter
    ///   stream's `max_msg_size`) less
    ///   [`DEAD_LETTER_HEADROOM`](crate::DEAD_LETTER_HEADROOM).
    ///
    /// A relay that republishes an event after a crash (between the
    /// server's PubAck and marking the row sent) stores a new copy once the
    /// duplicate window has passed, and that copy lives `max_age` from then:
    /// see `RelayOptions::stale_unsent_after` in `idem-outbox`.
    ///
    /// Warns (does not refuse) when the duplicate window is under two
    /// minutes: relays that republish after a crash then create copies the
    /// stream keeps, which the inbox still drops.
    pub async fn start<H>(
        js: Context,
        mut consumer: PullConsumer,
        inbox: Inbox<B>,
        options: ConsumerOptions,
        handler: H,
    ) -> Result<Self, ConsumerError>
    where
        H: for<'c> Fn(&'c mut B::Tx, Arc<Event>) -> BoxFuture<'c, Result<(), HandlerError>> + Send + Sync + 'static,
    {
        idem_core::Operation::new(options.handler.as_str())
            .map_err(|e| ConsumerError::Config(format!("handler name: {e}")))?;
        let redrive_tenant = Tenant::new(format!("{}.redrive", inbox.tenant().as_str()))
            .map_err(|e| ConsumerError::Config(format!("the inbox tenant is too long for its redrive keys: {e}")))?;
        if options.max_deliveries < 1 || options.concurrency == 0 || options.batch == 0 {
            return Err(ConsumerError::Config(
                "max_deliveries, concurrency and batch must be at least 1".into(),
            ));
        }
        let info = consumer
            .info()
            .await
            .map_err(|e| ConsumerError::Nats(e.to_string()))?
            .clone();
        let config = &info.config;
        let checked = checks::check(&js, &info, &options, Duration::from_secs(inbox.ttl_secs())).await?;
        // The server refuses pull requests over the consumer's own limits.
        let mut pull_batch = options.batch.min(options.concurrency);
        if config.max_batch > 0 {
            pull_batch = pull_batch.min(usize::try_from(config.max_batch).unwrap_or(1));
        }
        let mut pull_expires = Duration::from_secs(30);
        if !config.max_expires.is_zero() {
            pull_expires = pull_expires.min(config.max_expires);
        }
        // The redrive keys: the inbox's policy, kept for the longest TTL the
        // core allows (see `Inner::redrive`).
        let policy = *inbox
            .call(&options.handler, "redrive", b"")
            .map_err(|e| ConsumerError::Config(format!("handler name: {e}")))?
            .policy();
        let redrive_inbox = inbox
            .clone()
            .with_tenant(redrive_tenant)
            .with_policy(policy.with_ttl_secs(REDRIVE_KEY_TTL_SECS));
        let progress_every = options
            .progress_every
            .unwrap_or(config.ack_wait / 3)
            .max(Duration::from_millis(100));
        Ok(Self {
            inner: Arc::new(Inner {
                inbox,
                js,
                options,
                progress_every,
                pull_batch,
                pull_expires,
                redrive_inbox,
                dead_letter_bytes: checked.dead_letter_bytes,
                handler: Box::new(handler),
            }),
            consumer,
        })
    }

    /// Pulls and handles messages until `shutdown` completes, then finishes
    /// the messages in hand. Reconnects (with a pause) when the server goes
    /// away.
    pub async fn run(&self, shutdown: impl Future<Output = ()>) {
        tokio::pin!(shutdown);
        let permits = Arc::new(Semaphore::new(self.inner.options.concurrency));
        let mut tasks = JoinSet::new();
        let mut pause = Duration::from_millis(100);
        'outer: loop {
            let messages = self
                .consumer
                .stream()
                // No more than can be handled at once: a message waiting in
                // the client's buffer gets no progress acks, and the server
                // would deliver it again after its ack wait.
                .max_messages_per_batch(self.inner.pull_batch)
                .heartbeat((self.inner.pull_expires / 6).max(Duration::from_millis(500)))
                .expires(self.inner.pull_expires)
                .messages()
                .await;
            let mut messages = match messages {
                Ok(m) => m,
                Err(e) => {
                    tracing::warn!(handler = %self.inner.options.handler, error = %e, pause_ms = pause.as_millis() as u64, "cannot pull; retrying");
                    tokio::select! {
                        _ = &mut shutdown => break 'outer,
                        _ = tokio::time::sleep(pause) => {}
                    }
                    pause = (pause * 2).min(Duration::from_secs(5));
                    continue;
                }
            };
            loop {
                while tasks.try_join_next().is_some() {}
                let permit = tokio::select! {
                    _ = &mut shutdown => break 'outer,
                    p = permits.clone().acquire_owned() => p.expect("the semaphore is never closed"),
                };
                let next = tokio::select! {
                    _ = &mut shutdown => break 'outer,
                    next = messages.next() => next,
                };
                match next {
                    Some(Ok(message)) => {
                        pause = Duration::from_millis(100);
                        let inner = self.inner.clone();
                        tasks.spawn(async move {
                            inner.handle(message).await;
                            drop(permit);
                        });
                    }
                    Some(Err(e)) => {
                        tracing::warn!(handler = %self.inner.options.handler, error = %e, "pull stream error");
                        if matches!(
                            e.kind(),
                            async_nats::jetstream::consumer::pull::MessagesErrorKind::MissingHeartbeat
                                | async_nats::jetstream::consumer::pull::MessagesErrorKind::ConsumerDeleted
                        ) {
                            break;
                        }
                    }
                    None => break,
                }
            }
            tokio::select! {
                _ = &mut shutdown => break 'outer,
                _ = tokio::time::sleep(pause) => {}
            }
            pause = (pause * 2).min(Duration::from_secs(5));
        }
        while tasks.join_next().await.is_some() {}
    }
}

impl<B: TxBackend + Clone> Inner<B> {
    async fn handle(&self, message: async_nats::jetstream::Message) {
        let handler = self.options.handler.as_str();
        let delivered = message.info().map(|i| i.delivered).unwrap_or(1);
        let header = |name: &str| header_of(&message, name);
        let redrive = header(REDRIVE);
        if redrive.as_deref().is_some_and(|h| h != handler) {
            let handled = self.ack(&message, AckKind::Ack, Handled::NotMine).await;
            self.count(handled);
            return;
        }
        // A redriven copy names the original event; anything else is the
        // event itself.
        let id = if redrive.is_some() {
            header(EVENT_ID)
        } else {
            header(MSG_ID)
        };
        let outcome = match id {
            None if redrive.is_some() => Err(HandlerError::reject(format!(
                "the redriven copy has no {EVENT_ID} header"
            ))),
            None => Err(HandlerError::reject(format!("the message has no {MSG_ID} header"))),
            Some(id) => {
                let event = Arc::new(Event {
                    id,
                    subject: message.subject.to_string(),
                    payload: message.payload.clone(),
                    delivered,
                });
                let work = async {
                    if redrive.is_some() {
                        self.redrive(event).await
                    } else {
                        self.apply(event).await
                    }
                };
                self.with_progress(&message, work).await
            }
        };
        let handled = match outcome {
            Ok(Ran::Done(handled)) => self.ack(&message, AckKind::Ack, handled).await,
            // The event's key was closed as dead-lettered before its dead
            // letter was published, so a redelivery of the message that
            // closed it may come because that publish failed: it publishes
            // the dead letter again (the dead-letter stream drops a copy
            // within its duplicate window) and terminates. A first delivery
            // is another copy of the event, whose dead letter the message
            // that closed the key stores; so is any copy of an event whose
            // key a redrive closed.
            Ok(Ran::Closed(mark)) if delivered > 1 && mark.dead_lettered_after > 0 => {
                self.dead_letter(&message, false, delivered, &mark).await
            }
            Ok(Ran::Closed(_)) => self.ack(&message, AckKind::Ack, Handled::DuplicateDeadLetter).await,
            // Another delivery of the event is running the handler: this one
            // ran nothing, so it does not count toward a dead letter.
            Err(e) if e.is_in_flight() => {
                let delay = self.options.retry_delay(1);
                tracing::debug!(handler, delivered, "event in flight elsewhere; redelivering later");
                self.ack(&message, AckKind::Nak(Some(delay)), Handled::Retried).await
            }
            Err(e) if !e.is_permanent() && delivered < self.options.max_deliveries => {
                let delay = self.options.retry_delay(delivered);
                tracing::warn!(handler, delivered, error = %e, delay_ms = delay.as_millis() as u64, "handler failed; redelivering later");
                self.ack(&message, AckKind::Nak(Some(delay)), Handled::Retried).await
            }
            Err(e) => {
                let mark = DeadLettered {
                    dead_lettered_after: delivered,
                    error: e.to_string().chars().filter(|c| !c.is_control()).take(500).collect(),
                };
                self.dead_letter(&message, redrive.is_some(), delivered, &mark).await
            }
        };
        self.count(handled);
    }

    fn count(&self, handled: Handled) {
        metrics::counter!("idem_consumer_messages_total", "handler" => self.options.handler.clone(), "outcome" => handled.label())
            .increment(1);
    }

    /// The handler's future for one run, with a panic (while building the
    /// future or while polling it) turned into [`HandlerError::Panicked`]:
    /// the transaction rolls back and the failure counts like any other.
    fn guarded<'c>(&self, tx: &'c mut B::Tx, event: Arc<Event>) -> BoxFuture<'c, Result<Recorded, HandlerError>> {
        match std::panic::catch_unwind(AssertUnwindSafe(|| (self.handler)(tx, event))) {
            Err(panic) => Box::pin(std::future::ready(Err(panicked(panic.as_ref())))),
            Ok(work) => Box::pin(async move {
                match AssertUnwindSafe(work).catch_unwind().await {
                    Ok(result) => result.map(|()| None),
                    Err(panic) => Err(panicked(panic.as_ref())),
                }
            }),
        }
    }

    /// Closes the event's own key as dead-lettered with `mark`, unless it
    /// has a record already: answers the record it has now.
    async fn close(&self, id: &str, payload: &[u8], mark: &DeadLettered) -> Result<Recorded, HandlerError> {
        let delivery = self
            .inbox
            .process(&self.options.handler, id, payload, |_tx: &mut B::Tx| {
                let mark = mark.clone();
                Box::pin(async move { Ok::<Recorded, HandlerError>(Some(mark)) })
            })
            .await?;
        Ok(delivery.into_inner())
    }

    /// Runs the handler through the inbox, once per event, under the
    /// event's own key.
    async fn apply(&self, event: Arc<Event>) -> Result<Ran, HandlerError> {
        let delivery = self
            .inbox
            .process(&self.options.handler, &event.id, &event.payload, |tx: &mut B::Tx| {
                self.guarded(tx, event.clone())
            })
            .await?;
        Ok(match delivery {
            Delivery::Applied(_) => Ran::Done(Handled::Applied),
            Delivery::Duplicate(None) => Ran::Done(Handled::Duplicate),
            Delivery::Duplicate(Some(mark)) => Ran::Closed(mark),
        })
    }

    /// Runs a redriven event under its redrive key (tenant `<inbox
    /// tenant>.redrive`), never under its own key, so that the handler's
    /// writes commit at most once by construction:
    ///
    /// - ordinary deliveries run only under the event's own key, redriven
    ///   copies only under its redrive key, and each key is claimed once;
    /// - the two never both run: before a dead letter is stored, and again
    ///   here before a redriven copy runs, the own key is closed as
    ///   dead-lettered (or found applied, and then the copy runs nothing).
    ///   A closed own key outlives every ordinary copy of the event (the
    ///   stream's `max_age` is within its TTL, checked at start);
    /// - the redrive key's record is kept ten years, the longest TTL the
    ///   core allows, whatever the inbox's TTL: a dead letter is kept until
    ///   it is handled, so a copy of it can be published at any time (a
    ///   redrive run again after the dead letter's deletion failed, a
    ///   second dead letter of the event, a consumer that committed a copy
    ///   and died before its ack, back after the own key's record expired),
    ///   and every such copy finds the record.
    async fn redrive(&self, event: Arc<Event>) -> Result<Ran, HandlerError> {
        let handler = self.options.handler.as_str();
        let guard = DeadLettered {
            dead_lettered_after: 0,
            error: "closed by a redrive: the event runs under its redrive key".into(),
        };
        if self.close(&event.id, &event.payload, &guard).await?.is_none() {
            return Ok(Ran::Done(Handled::Duplicate));
        }
        let delivery = self
            .redrive_inbox
            .process(handler, &event.id, &event.payload, |tx: &mut B::Tx| {
                self.guarded(tx, event.clone())
            })
            .await?;
        Ok(Ran::Done(match delivery {
            Delivery::Applied(_) => {
                tracing::info!(handler, event_id = %event.id, "dead letter redriven and applied");
                Handled::Redriven
            }
            Delivery::Duplicate(_) => Handled::Duplicate,
        }))
    }

    /// Awaits `work` while a ticker tells the server the message is still
    /// being worked on.
    async fn with_progress<T>(&self, message: &async_nats::jetstream::Message, work: impl Future<Output = T>) -> T {
        tokio::pin!(work);
        let mut ticker = tokio::time::interval(self.progress_every);
        ticker.tick().await;
        loop {
            tokio::select! {
                outcome = &mut work => return outcome,
                _ = ticker.tick() => {
                    if let Err(e) = message.ack_with(AckKind::Progress).await {
                        tracing::debug!(error = %e, "progress ack not sent");
                    }
                }
            }
        }
    }

    /// Acknowledges (or negatively acknowledges) and waits for the server's
    /// confirmation. If it does not come, the message is delivered again and
    /// the inbox answers the redelivery without running the handler.
    async fn ack(&self, message: &async_nats::jetstream::Message, kind: AckKind, handled: Handled) -> Handled {
        let result = match kind {
            AckKind::Ack => message.double_ack().await,
            other => message.ack_with(other).await,
        };
        if let Err(e) = result {
            metrics::counter!("idem_consumer_ack_failures_total", "handler" => self.options.handler.clone())
                .increment(1);
            tracing::warn!(handler = %self.options.handler, error = %e, "acknowledgement not confirmed; the message will be delivered again");
        }
        handled
    }

    /// Keeps a message that will not succeed: closes the event's own key as
    /// dead-lettered ([`DeadLettered`]) in the inbox, then publishes a copy
    /// to the dead-letter subject (with why and how many deliveries), and
    /// only once the server stored it, terminates the original. If the key
    /// cannot be closed or the copy cannot be stored, the original is
    /// delivered again later instead of being lost; its redelivery finds the
    /// key closed and publishes the copy again.
    ///
    /// The key is closed first so that a stored dead letter always means
    /// the event never ran under its own key: it can then run only through
    /// a redrive (see [`redrive`](Self::redrive)). A redriven copy that fails
    /// again leaves its redrive key unused, so its new dead letter can be
    /// redriven again.
    ///
    /// The copy always fits: its error text is cut to the room the server's
    /// and the dead-letter stream's limits leave (see
    /// [`DEAD_LETTER_HEADROOM`](crate::DEAD_LETTER_HEADROOM)).
    async fn dead_letter(
        &self,
        message: &async_nats::jetstream::Message,
        redriven: bool,
        delivered: i64,
        mark: &DeadLettered,
    ) -> Handled {
        let handler = self.options.handler.as_str();
        let header = |name: &str| header_of(message, name);
        let message_id = header(MSG_ID);
        let original_id = if redriven { header(EVENT_ID) } else { message_id.clone() };
        let delay = self.options.retry_delay(delivered);
        if let Some(id) = &original_id {
            match self.close(id, &message.payload, mark).await {
                // Another copy applied the event meanwhile: nothing to keep.
                Ok(None) => {
                    tracing::info!(handler, event_id = %id, "event applied by another delivery; no dead letter");
                    return self.ack(message, AckKind::Ack, Handled::Duplicate).await;
                }
                Ok(Some(_)) => {}
                // The event can never run under this id (not a valid key,
                // or another payload has it): there is nothing to close.
                Err(e) if e.is_permanent() => {}
                Err(e) => {
                    tracing::warn!(handler, error = %e, "the event's inbox key not closed; its dead letter is kept on a later delivery");
                    return self.ack(message, AckKind::Nak(Some(delay)), Handled::Retried).await;
                }
            }
        }
        let mut fields: Vec<(&str, String)> = Vec::new();
        // Deduplicated on the copy's own id: a redriven copy that fails
        // again is a new dead letter, not a duplicate of the first.
        if let Some(id) = &message_id {
            fields.push((MSG_ID, format!("{handler}:{id}")));
        }
        // An id longer than any inbox key is no event's: it could never run,
        // and would only take the room of the dead letter's other headers.
        if let Some(id) = original_id.as_ref().filter(|id| id.len() <= idem_core::MAX_KEY_LEN) {
            fields.push((EVENT_ID, id.clone()));
        }
        fields.push(("Idem-Handler", handler.to_owned()));
        fields.push(("Idem-Subject", message.subject.to_string()));
        fields.push(("Idem-Deliveries", mark.dead_lettered_after.to_string()));
        if redriven {
            fields.push(("Idem-Redriven", "true".into()));
        }
        let without_error = message.payload.len() + headers_len(&fields) + "Idem-Error: \r\n".len();
        let Some(room) = self.dead_letter_bytes.checked_sub(without_error) else {
            tracing::error!(
                handler,
                subject = %message.subject,
                bytes = without_error,
                limit = self.dead_letter_bytes,
                "the dead letter cannot fit the server's limits (its subject or ids are beyond the headroom); the message will be delivered again"
            );
            return self.ack(message, AckKind::Nak(Some(delay)), Handled::Retried).await;
        };
        fields.push((
            "Idem-Error",
            idem_core::cut_at_char_boundary(&mark.error, room).to_owned(),
        ));
        let mut headers = HeaderMap::new();
        for (name, value) in &fields {
            headers.insert(*name, value.as_str());
        }
        let publish = Publish::build().headers(headers).payload(message.payload.clone());
        let stored = match self
            .js
            .send_publish(self.options.dead_letter_subject.clone(), publish)
            .await
        {
            Ok(ack) => ack.await.map(|_| ()).map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        match stored {
            Ok(()) => {
                tracing::error!(handler, delivered, error = %mark.error, "message kept as a dead letter");
                if let Err(e) = message.double_ack_with(AckKind::Term).await {
                    tracing::warn!(error = %e, "termination not confirmed; the message may be delivered again");
                }
                Handled::DeadLettered
            }
            Err(e) => {
                tracing::error!(
                    handler,
                    error = %e,
                    "dead letter not stored; the message will be delivered again"
                );
                self.ack(message, AckKind::Nak(Some(delay)), Handled::Retried).await
            }
        }
    }
}

/// The bytes a header block of `fields` takes on the wire: `NATS/1.0`, one
/// `name: value` line each, and the empty line.
fn headers_len(fields: &[(&str, String)]) -> usize {
    "NATS/1.0\r\n\r\n".len()
        + fields
            .iter()
            .map(|(name, value)| name.len() + ": \r\n".len() + value.len())
            .sum::<usize>()
}

/// The value of `message`'s header `name`, if it has one.
fn header_of(message: &async_nats::jetstream::Message, name: &str) -> Option<String> {
    message
        .headers
        .as_ref()
        .and_then(|h| h.get(name))
        .map(|v| v.as_str().to_owned())
}

/// The text of a panic's payload.
fn panicked(panic: &(dyn std::any::Any + Send)) -> HandlerError {
    let text = panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a non-text payload".into());
    HandlerError::Panicked(text)
}
