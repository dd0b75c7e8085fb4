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
use idem_core::{BoxFuture, Contention, Tenant, TxBackend};
use idem_inbox::{Delivery, Inbox};
use serde::{Deserialize, Serialize};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

/// The header that carries the event id (set by the outbox relay).
pub const MSG_ID: &str = "Nats-Msg-Id";
/// On a dead letter and on a redriven copy: the original event id.
pub const EVENT_ID: &str = "Idem-Event-Id";
/// On a redriven copy: the one handler that is to run it again (every other
/// consumer of the subject acknowledges it without running anything).
pub const REDRIVE: &str = "Idem-Redrive";

/// What the consumer records in the inbox for an event: `None` (JSON
/// `null`) when the handler's writes committed, `Some` when the event was
/// kept as a dead letter instead. Either way an ordinary redelivery does not
/// run the handler; only a redrive ([`redrive`](crate::redrive())) runs a dead-lettered
/// event, once.
pub type Recorded = Option<DeadLettered>;

/// The inbox's record of an event kept as a dead letter.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeadLettered {
    /// Deliveries made before it was kept.
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

/// How a handler failed.
#[derive(Debug, thiserror::Error)]
pub enum HandlerError {
    /// It may succeed later (a dependency is down): the message is
    /// delivered again after a delay, up to the delivery bound.
    #[error("transient failure: {0}")]
    Retry(String),
    /// It can never succeed (a malformed payload): the message becomes a
    /// dead letter at once.
    #[error("permanent failure: {0}")]
    Reject(String),
    /// idem or the database failed: contention is retried inside the
    /// transaction; a mismatched redelivery (same id, other payload) is
    /// permanent; anything else is transient.
    #[error(transparent)]
    Idem(#[from] idem_core::Error),
    /// The handler panicked: a transient failure, counted toward
    /// `max_deliveries` like any other, so a handler that always panics
    /// ends as a dead letter.
    #[error("the handler panicked: {0}")]
    Panicked(String),
}

impl HandlerError {
    /// A transient failure.
    pub fn retry(e: impl std::fmt::Display) -> Self {
        Self::Retry(e.to_string())
    }

    /// A permanent failure.
    pub fn reject(e: impl std::fmt::Display) -> Self {
        Self::Reject(e.to_string())
    }

    fn is_permanent(&self) -> bool {
        match self {
            Self::Retry(_) | Self::Panicked(_) => false,
            Self::Reject(_) => true,
            Self::Idem(e) => matches!(
                e,
                idem_core::Error::Mismatch
                    | idem_core::Error::InvalidKey(_)
                    | idem_core::Error::InvalidScope(_)
                    | idem_core::Error::RecordTooLarge { .. }
            ),
        }
    }

    /// Another delivery of the same event is being handled right now: this
    /// delivery did not run the handler, so it never makes a dead letter.
    fn is_in_flight(&self) -> bool {
        matches!(self, Self::Idem(idem_core::Error::InFlight { .. }))
    }
}

impl Contention for HandlerError {
    fn is_contention(&self) -> bool {
        matches!(self, Self::Idem(e) if e.is_contention())
    }
}

/// Why a consumer could not start or stopped.
#[derive(Debug, thiserror::Error)]
pub enum ConsumerError {
    /// Its settings cannot give exactly-once effects (see
    /// [`InboxConsumer::start`]).
    #[error("consumer configuration: {0}")]
    Config(String),
    /// The server did not answer.
    #[error("jetstream: {0}")]
    Nats(String),
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

    fn retry_delay(&self, delivered: i64) -> Duration {
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
    redrive_tenant: Tenant,
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
    /// Refuses ([`ConsumerError::Config`]) when a redelivery could reach the
    /// handler after the inbox forgot the event, or when the server would
    /// stop delivering before the consumer could keep a dead letter:
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
    ///   it becomes a dead letter before the stream drops it.
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
        if config.ack_policy != async_nats::jetstream::consumer::AckPolicy::Explicit {
            return Err(ConsumerError::Config(format!(
                "consumer {:?} must use AckPolicy::Explicit (acknowledged after the commit), not {:?}",
                info.name, config.ack_policy
            )));
        }
        if config.max_deliver != -1 {
            return Err(ConsumerError::Config(format!(
                "consumer {:?} stops after {} deliveries: set its max_deliver to -1, so that a message \
                 whose dead letter could not be stored is delivered again instead of dropped (this consumer \
                 bounds deliveries itself, {} by default)",
                info.name, config.max_deliver, options.max_deliveries
            )));
        }
        idem_core::OutboxEvent::new(options.dead_letter_subject.as_str(), Vec::new()).map_err(|e| {
            ConsumerError::Config(format!("dead-letter subject {:?}: {e}", options.dead_letter_subject))
        })?;
        let dead_stream = js
            .stream_by_subject(options.dead_letter_subject.clone())
            .await
            .map_err(|e| match e.kind() {
                async_nats::jetstream::context::GetStreamByNameErrorKind::NotFound => ConsumerError::Config(format!(
                    "no stream captures the dead-letter subject {:?}: create one that does, or no dead letter \
                     could be stored and a message that cannot succeed would be delivered for ever",
                    options.dead_letter_subject
                )),
                _ => ConsumerError::Nats(e.to_string()),
            })?;
        if dead_stream == info.stream_name
            && (config.filter_subject.is_empty()
                || subject_matches(&config.filter_subject, &options.dead_letter_subject))
        {
            return Err(ConsumerError::Config(format!(
                "the dead-letter subject {:?} is in the consumer's own stream {:?} and its filter: dead letters \
                 would be delivered to the handler again",
                options.dead_letter_subject, info.stream_name
            )));
        }
        // The server refuses pull requests over the consumer's own limits.
        let mut pull_batch = options.batch.min(options.concurrency);
        if config.max_batch > 0 {
            pull_batch = pull_batch.min(usize::try_from(config.max_batch).unwrap_or(1));
        }
        let mut pull_expires = Duration::from_secs(30);
        if !config.max_expires.is_zero() {
            pull_expires = pull_expires.min(config.max_expires);
        }
        let mut stream = js
            .get_stream(&info.stream_name)
            .await
            .map_err(|e| ConsumerError::Nats(e.to_string()))?;
        let stream_config = stream
            .info()
            .await
            .map_err(|e| ConsumerError::Nats(e.to_string()))?
            .config
            .clone();
        let duplicate_window = stream_config.duplicate_window;
        let ttl = Duration::from_secs(inbox.ttl_secs());
        check_horizon(&options, config, &info.stream_name, stream_config.max_age, ttl)?;
        if duplicate_window < Duration::from_secs(120) {
            tracing::warn!(
                stream = %info.stream_name,
                duplicate_window_s = duplicate_window.as_secs(),
                "the stream's duplicate window is under two minutes: an event a relay publishes again after a \
                 crash may be stored twice (the inbox still applies it once)"
            );
        }
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
                redrive_tenant,
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
        let header = |name: &str| {
            message
                .headers
                .as_ref()
                .and_then(|h| h.get(name))
                .map(|v| v.as_str().to_owned())
        };
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
            Ok(handled) => self.ack(&message, AckKind::Ack, handled).await,
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
            Err(e) => self.dead_letter(&message, redrive.is_some(), delivered, &e).await,
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

    /// Runs the handler through the inbox, once per event.
    async fn apply(&self, event: Arc<Event>) -> Result<Handled, HandlerError> {
        let delivery = self
            .inbox
            .process(&self.options.handler, &event.id, &event.payload, |tx: &mut B::Tx| {
                self.guarded(tx, event.clone())
            })
            .await?;
        Ok(match delivery {
            Delivery::Applied(_) => Handled::Applied,
            Delivery::Duplicate(None) => Handled::Duplicate,
            Delivery::Duplicate(Some(_)) => Handled::DuplicateDeadLetter,
        })
    }

    /// Runs a redriven event: through its own inbox key when the inbox has
    /// no record of it (its dead letter could not be closed there), through
    /// the redrive key (tenant `<inbox tenant>.redrive`) when it was kept
    /// as a dead letter, and not at all when it was applied. Each key is
    /// claimed once, so however many copies are redriven, the handler's
    /// writes commit once.
    async fn redrive(&self, event: Arc<Event>) -> Result<Handled, HandlerError> {
        let handler = self.options.handler.as_str();
        let first = self
            .inbox
            .process(handler, &event.id, &event.payload, |tx: &mut B::Tx| {
                self.guarded(tx, event.clone())
            })
            .await?;
        match first {
            Delivery::Applied(_) => return Ok(Handled::Redriven),
            Delivery::Duplicate(None) => return Ok(Handled::Duplicate),
            Delivery::Duplicate(Some(_)) => {}
        }
        let delivery = self
            .inbox
            .process_in(
                &self.redrive_tenant,
                handler,
                &event.id,
                &event.payload,
                |tx: &mut B::Tx| self.guarded(tx, event.clone()),
            )
            .await?;
        Ok(match delivery {
            Delivery::Applied(_) => {
                tracing::info!(handler, event_id = %event.id, "dead letter redriven and applied");
                Handled::Redriven
            }
            Delivery::Duplicate(_) => Handled::Duplicate,
        })
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

    /// Keeps a message that will not succeed: publishes a copy to the
    /// dead-letter subject (with why and how many deliveries), and only once
    /// the server stored it, terminates the original. If the copy cannot be
    /// stored, the original is delivered again later instead of being lost.
    ///
    /// The inbox records the event as dead-lettered ([`DeadLettered`]), not
    /// as applied: a redelivery still runs nothing, and a redrive can tell
    /// the two apart. A redriven copy that fails again leaves its redrive
    /// key unused, so its new dead letter can be redriven again.
    async fn dead_letter(
        &self,
        message: &async_nats::jetstream::Message,
        redriven: bool,
        delivered: i64,
        error: &HandlerError,
    ) -> Handled {
        let mut headers = HeaderMap::new();
        let header = |name: &str| {
            message
                .headers
                .as_ref()
                .and_then(|h| h.get(name))
                .map(|v| v.as_str().to_owned())
        };
        let message_id = header(MSG_ID);
        let original_id = if redriven { header(EVENT_ID) } else { message_id.clone() };
        if let Some(id) = &original_id {
            headers.insert(EVENT_ID, id.as_str());
        }
        headers.insert("Idem-Handler", self.options.handler.as_str());
        headers.insert("Idem-Subject", message.subject.as_str());
        headers.insert("Idem-Deliveries", delivered.to_string().as_str());
        let reason: String = error
            .to_string()
            .chars()
            .filter(|c| !c.is_control())
            .take(500)
            .collect();
        headers.insert("Idem-Error", reason.as_str());
        if redriven {
            headers.insert("Idem-Redriven", "true");
        }
        let mut publish = Publish::build().headers(headers).payload(message.payload.clone());
        // Deduplicated on the copy's own id: a redriven copy that fails
        // again is a new dead letter, not a duplicate of the first.
        if let Some(id) = &message_id {
            publish = publish.message_id(format!("{}:{id}", self.options.handler));
        }
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
                tracing::error!(handler = %self.options.handler, delivered, error = %error, "message kept as a dead letter");
                // Record the event as dead-lettered in the inbox, so that if
                // the termination below is lost and the message comes back,
                // the handler does not run after its dead letter was kept
                // (best effort: with the database down, the termination
                // alone stands, and a redrive runs it through its own key).
                if let (Some(id), false) = (&original_id, redriven) {
                    let mark = DeadLettered {
                        dead_lettered_after: delivered,
                        error: reason.clone(),
                    };
                    let closed = self
                        .inbox
                        .process(&self.options.handler, id, &message.payload, |_tx: &mut B::Tx| {
                            let mark = mark.clone();
                            Box::pin(async move { Ok::<Recorded, HandlerError>(Some(mark)) })
                        })
                        .await;
                    if let Err(e) = closed {
                        tracing::debug!(error = %e, "dead letter not recorded in the inbox");
                    }
                }
                if let Err(e) = message.double_ack_with(AckKind::Term).await {
                    tracing::warn!(error = %e, "termination not confirmed; the message may be delivered again");
                }
                Handled::DeadLettered
            }
            Err(e) => {
                tracing::error!(
                    handler = %self.options.handler,
                    error = %e,
                    "dead letter not stored; the message will be delivered again"
                );
                let delay = self.options.retry_delay(delivered);
                self.ack(message, AckKind::Nak(Some(delay)), Handled::Retried).await
            }
        }
    }
}

/// Whether `subject` is one the NATS subject `filter` (`*` one token, `>`
/// the rest) selects.
fn subject_matches(filter: &str, subject: &str) -> bool {
    let mut subject = subject.split('.');
    for token in filter.split('.') {
        match (token, subject.next()) {
            (">", Some(_)) => return true,
            ("*", Some(_)) => {}
            (t, Some(s)) if t == s => {}
            _ => return false,
        }
    }
    subject.next().is_none()
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

/// Refuses an inbox that could forget an event while the stream can still
/// deliver it, and a stream that could drop a failing message before it
/// becomes a dead letter.
fn check_horizon(
    options: &ConsumerOptions,
    config: &async_nats::jetstream::consumer::Config,
    stream: &str,
    max_age: Duration,
    ttl: Duration,
) -> Result<(), ConsumerError> {
    if max_age.is_zero() {
        return Err(ConsumerError::Config(format!(
            "the stream {stream:?} keeps messages for ever (max_age unlimited), but the inbox forgets event ids \
             after {} s: a message redelivered later would run the handler again; set the stream's max_age to \
             at most the inbox TTL",
            ttl.as_secs()
        )));
    }
    if ttl < max_age {
        return Err(ConsumerError::Config(format!(
            "the inbox keeps event ids for {} s, but the stream {stream:?} can deliver a message again up to \
             {} s (its max_age) after it was stored: raise the inbox TTL or lower the stream's max_age",
            ttl.as_secs(),
            max_age.as_secs()
        )));
    }
    let schedule = delivery_schedule(options, config);
    if max_age < schedule {
        return Err(ConsumerError::Config(format!(
            "a message that keeps failing is delivered {} times over up to {} s (ack wait or backoff, and the \
             retry delays), but the stream {stream:?} drops it after {} s (max_age), before its dead letter is \
             kept: raise max_age or lower the bounds",
            options.max_deliveries,
            schedule.as_secs(),
            max_age.as_secs()
        )));
    }
    Ok(())
}

/// How long a message that keeps failing can take to reach its last
/// delivery: per delivery, the longer of the server's redelivery wait (the
/// consumer's `backoff` step for that delivery, else its `ack_wait`) and
/// the retry delay the consumer asks for.
fn delivery_schedule(options: &ConsumerOptions, config: &async_nats::jetstream::consumer::Config) -> Duration {
    let mut total = Duration::ZERO;
    for delivered in 1..=options.max_deliveries.min(10_000) {
        let i = usize::try_from(delivered - 1).unwrap_or(usize::MAX);
        let server = config
            .backoff
            .get(i)
            .or(config.backoff.last())
            .copied()
            .unwrap_or(config.ack_wait);
        total = total.saturating_add(server.max(options.retry_delay(delivered)));
    }
    total
}

#[cfg(test)]
mod tests {
    /// NATS wildcards, as the dead-letter check reads a consumer's filter.
    #[test]
    fn subjects_match_filters_with_wildcards() {
        use super::subject_matches as m;
        assert!(m("a.>", "a.b.c") && m("a.*.c", "a.b.c") && m("a.b", "a.b") && m(">", "a"));
        assert!(!m("a.>", "a") && !m("a.*", "a.b.c") && !m("a.b", "a.c") && !m("a.b.c", "a.b"));
    }
}
