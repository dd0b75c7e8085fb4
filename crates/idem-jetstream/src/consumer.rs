//! A JetStream pull consumer that applies each message through an inbox.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::consumer::PullConsumer;
use async_nats::jetstream::context::Context;
use async_nats::jetstream::message::AckKind;
use async_nats::jetstream::message::PublishMessage as Publish;
use bytes::Bytes;
use futures_util::StreamExt;
use idem_core::{BoxFuture, Contention, TxBackend};
use idem_inbox::{Delivery, Inbox};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

/// The header that carries the event id (set by the outbox relay).
pub const MSG_ID: &str = "Nats-Msg-Id";

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
            Self::Retry(_) => false,
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
    /// letter.
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
    Retried,
    DeadLettered,
}

impl Handled {
    fn label(self) -> &'static str {
        match self {
            Handled::Applied => "applied",
            Handled::Duplicate => "duplicate",
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
    ///   stored must come back rather than be dropped;
    /// - the dead-letter subject must be one a message can be published to;
    /// - the inbox's key TTL must cover the redelivery horizon,
    ///   `max_deliveries × (ack_wait + the longest retry delay)`, plus the
    ///   stream's duplicate window (a relay may publish a copy up to that
    ///   long after the first).
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
        let duplicate_window = stream
            .info()
            .await
            .map_err(|e| ConsumerError::Nats(e.to_string()))?
            .config
            .duplicate_window;
        let longest_delay = options.retry_delays.iter().max().copied().unwrap_or_default();
        let per_delivery = config.ack_wait + longest_delay;
        let horizon = per_delivery
            .saturating_mul(u32::try_from(options.max_deliveries).unwrap_or(u32::MAX))
            .saturating_add(duplicate_window);
        let ttl = Duration::from_secs(inbox.ttl_secs());
        if ttl < horizon {
            return Err(ConsumerError::Config(format!(
                "the inbox keeps event ids for {} s, but a message can be delivered again up to {} s later \
                 ({} deliveries × (ack_wait {} s + retry delay {} s) + duplicate window {} s): \
                 raise the inbox TTL or lower the bounds",
                ttl.as_secs(),
                horizon.as_secs(),
                options.max_deliveries,
                config.ack_wait.as_secs(),
                longest_delay.as_secs(),
                duplicate_window.as_secs()
            )));
        }
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
        let id = message
            .headers
            .as_ref()
            .and_then(|h| h.get(MSG_ID))
            .map(|v| v.as_str().to_owned());
        let outcome = match id {
            None => Err(HandlerError::reject(format!("the message has no {MSG_ID} header"))),
            Some(id) => {
                let event = Arc::new(Event {
                    id,
                    subject: message.subject.to_string(),
                    payload: message.payload.clone(),
                    delivered,
                });
                self.apply(&message, event).await
            }
        };
        let handled = match outcome {
            Ok(Delivery::Applied(())) => self.ack(&message, AckKind::Ack, Handled::Applied).await,
            Ok(Delivery::Duplicate(())) => self.ack(&message, AckKind::Ack, Handled::Duplicate).await,
            Err(e) if !e.is_permanent() && delivered < self.options.max_deliveries => {
                let delay = self.options.retry_delay(delivered);
                tracing::warn!(handler, delivered, error = %e, delay_ms = delay.as_millis() as u64, "handler failed; redelivering later");
                self.ack(&message, AckKind::Nak(Some(delay)), Handled::Retried).await
            }
            Err(e) => self.dead_letter(&message, delivered, &e).await,
        };
        metrics::counter!("idem_consumer_messages_total", "handler" => self.options.handler.clone(), "outcome" => handled.label())
            .increment(1);
    }

    /// Runs the handler through the inbox while a ticker tells the server
    /// the message is still being worked on.
    async fn apply(
        &self,
        message: &async_nats::jetstream::Message,
        event: Arc<Event>,
    ) -> Result<Delivery<()>, HandlerError> {
        let (id, payload) = (event.id.clone(), event.payload.clone());
        let work = self
            .inbox
            .process(&self.options.handler, &id, &payload, |tx: &mut B::Tx| {
                (self.handler)(tx, event.clone())
            });
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
    async fn dead_letter(
        &self,
        message: &async_nats::jetstream::Message,
        delivered: i64,
        error: &HandlerError,
    ) -> Handled {
        let mut headers = HeaderMap::new();
        let original_id = message
            .headers
            .as_ref()
            .and_then(|h| h.get(MSG_ID))
            .map(|v| v.as_str().to_owned());
        if let Some(id) = &original_id {
            headers.insert("Idem-Event-Id", id.as_str());
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
        let mut publish = Publish::build().headers(headers).payload(message.payload.clone());
        if let Some(id) = &original_id {
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
                // Close the event in the inbox, so that if the termination
                // below is lost and the message comes back, the handler does
                // not run after its dead letter was kept (best effort: with
                // the database down, the termination alone stands).
                if let Some(id) = &original_id {
                    let closed = self
                        .inbox
                        .process(&self.options.handler, id, &message.payload, |_tx: &mut B::Tx| {
                            Box::pin(async { Ok::<(), HandlerError>(()) })
                        })
                        .await;
                    if let Err(e) = closed {
                        tracing::debug!(error = %e, "dead letter not closed in the inbox");
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
