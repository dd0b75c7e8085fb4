//! The ledger's events, the relays that publish them to NATS JetStream, and
//! the statement projection that consumes them.
//!
//! Every mutation enqueues one event in its own transaction (outbox table
//! `ledger_outbox`), so an event exists if and only if its change committed.
//! Relays publish them to the stream `LEDGER_EVENTS` (subjects
//! `ledger.events.<type>`, `Nats-Msg-Id` = event id; another namespace,
//! `--events-namespace`, renames all of these). The projection
//! `ledger-statements` consumes them through an inbox (table
//! `ledger_projection_inbox`) and keeps a per-account statement
//! (`ledger_statements`) that `GET /v1/accounts/{id}/statement` serves.
//!
//! # Event schema (version 1)
//!
//! Every event is a JSON object:
//!
//! ```json
//! {"id": "0193…", "type": "top_up.created", "version": 1, "tenant": "t_…",
//!  "occurred_at_ms": 1732450000000, "data": {…}}
//! ```
//!
//! | `type` | `data` |
//! |---|---|
//! | `account.created` | `{"account_id", "name"}` |
//! | `top_up.created` | `{"journal_id", "account_id", "amount"}` |
//! | `transfer.created` | `{"journal_id", "from", "to", "amount"}` |
//! | `webhook_top_up.created` | `{"journal_id", "event_id", "account_id", "amount"}` (`event_id`: the provider's) |
//! | `payout.requested` | `{"payout_id", "account_id", "amount"}` (debited now) |
//! | `payout.paid` | `{"payout_id", "account_id", "amount", "vendor_payout_id"}` |
//! | `payout.dead_lettered` | `{"payout_id", "account_id", "amount", "error"}` (the debit stands until a redrive pays it) |
//! | `payout.outcome_unknown` | `{"payout_id", "account_id", "amount", "error"}` (held for an operator; the debit stands) |
//! | `payout.cancelled` | `{"payout_id", "account_id", "amount"}` (the vendor did not pay it: the debit is reversed) |
//! | `withdrawal.requested` | `{"withdrawal_id", "account_id", "amount"}` (debited now) |
//! | `withdrawal.paid` | `{"withdrawal_id", "account_id", "amount", "vendor_payout_id"}` |
//! | `withdrawal.declined` | `{"withdrawal_id", "account_id", "amount", "reason"}` (a vendor declined it: the debit is credited back) |
//!
//! A consumer must refuse a `version` it does not know (the projection keeps
//! such an event as a dead letter). A new field is added without a new
//! version; a change of meaning is a new version.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, consumer::pull, stream};
use idem_core::{OutboxEvent, SharedClock, StoreErrorKind, TableName, TxEngine};
use idem_inbox::Inbox;
use idem_jetstream::async_nats;
use idem_jetstream::{ConsumerError, ConsumerOptions, Event, HandlerError, InboxConsumer, JetStreamPublisher};
use idem_outbox::{Relay, RelayOptions};
use serde::{Deserialize, Serialize};

use crate::StartError;
use crate::db::{LedgerDb, LedgerTx, PROJECTION_INBOX_TABLE, StatementChange};

/// The version of the event schema this ledger writes and reads.
pub const SCHEMA_VERSION: u32 = 1;
/// The default namespace: stream `LEDGER_EVENTS`, subjects
/// `ledger.events.<type>`, consumer `ledger-statements`, dead letters on
/// `ledger.dead.>` (stream `LEDGER_DEAD`).
pub const DEFAULT_NAMESPACE: &str = "ledger";
/// The projection's inbox handler name.
pub const PROJECTION: &str = "ledger-statements";
/// How long the events stream keeps a message: a day under the projection
/// inbox's seven-day TTL, so a redelivery always finds its event id, and a
/// relay that starts with rows unsent for longer than that day says so. The
/// dead-letter stream keeps its messages until they are handled (no
/// `max_age`).
pub const STREAM_MAX_AGE: Duration = Duration::from_secs(6 * 86_400);

/// The names of one ledger deployment's streams, subjects and consumers,
/// so several deployments can share one NATS server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Namespace(String);

impl Namespace {
    /// A namespace of 1 to 32 lower-case ASCII letters, digits or `_`.
    pub fn new(name: &str) -> Result<Self, StartError> {
        let ok = !name.is_empty()
            && name.len() <= 32
            && name
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
        if ok {
            Ok(Self(name.to_owned()))
        } else {
            Err(StartError::Config(format!(
                "events namespace {name:?} must be 1 to 32 of [a-z0-9_]"
            )))
        }
    }

    /// The events stream.
    pub fn stream(&self) -> String {
        format!("{}_EVENTS", self.0.to_ascii_uppercase())
    }

    /// The dead-letter stream.
    pub fn dead_stream(&self) -> String {
        format!("{}_DEAD", self.0.to_ascii_uppercase())
    }

    /// The subject prefix of events (`<ns>.events`).
    pub fn subjects(&self) -> String {
        format!("{}.events", self.0)
    }

    /// The projection's durable consumer.
    pub fn consumer(&self) -> String {
        format!("{}-statements", self.0)
    }

    /// The projection's dead-letter subject.
    pub fn dead_subject(&self) -> String {
        format!("{}.dead.statements", self.0)
    }
}

impl Default for Namespace {
    fn default() -> Self {
        Self(DEFAULT_NAMESPACE.into())
    }
}

/// An event as published.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Envelope {
    /// The event id (also `Nats-Msg-Id` and the consumers' inbox key).
    pub id: String,
    /// What happened.
    #[serde(rename = "type")]
    pub kind: String,
    /// The schema version.
    pub version: u32,
    /// The tenant it happened to.
    pub tenant: String,
    /// When, in ms since the epoch.
    pub occurred_at_ms: i64,
    /// The type's fields.
    pub data: serde_json::Value,
}

#[derive(Debug, Deserialize)]
struct AccountData {
    account_id: String,
}

#[derive(Debug, Deserialize)]
struct CreditData {
    account_id: String,
    amount: i64,
}

#[derive(Debug, Deserialize)]
struct PayoutData {
    #[allow(dead_code)]
    payout_id: String,
}

#[derive(Debug, Deserialize)]
struct WithdrawalData {
    #[allow(dead_code)]
    withdrawal_id: String,
}

#[derive(Debug, Deserialize)]
struct TransferData {
    from: String,
    to: String,
    amount: i64,
}

impl Envelope {
    /// A new event of `kind` with `data`, ready to enqueue.
    pub fn new(kind: &str, tenant: &str, occurred_at_ms: i64, data: serde_json::Value) -> Self {
        Self {
            id: uuid::Uuid::now_v7().to_string(),
            kind: kind.to_owned(),
            version: SCHEMA_VERSION,
            tenant: tenant.to_owned(),
            occurred_at_ms,
            data,
        }
    }

    /// The outbox row of this event, published under `ns`.
    pub fn to_outbox_in(&self, ns: &Namespace) -> Result<OutboxEvent, idem_core::Error> {
        let payload = serde_json::to_vec(self).map_err(|e| idem_core::Error::Encode(e.to_string()))?;
        OutboxEvent::with_id(
            idem_core::IdempotencyKey::new(self.id.as_str())?,
            format!("{}.{}", ns.subjects(), self.kind),
            payload,
        )
    }

    /// The outbox row of this event, in the default namespace.
    pub fn to_outbox(&self) -> Result<OutboxEvent, idem_core::Error> {
        let payload = serde_json::to_vec(self).map_err(|e| idem_core::Error::Encode(e.to_string()))?;
        OutboxEvent::with_id(
            idem_core::IdempotencyKey::new(self.id.as_str())?,
            format!("{DEFAULT_NAMESPACE}.events.{}", self.kind),
            payload,
        )
    }

    /// What the event changes in the statement projection.
    pub fn statement_changes(&self) -> Result<Vec<StatementChange>, String> {
        if self.version != SCHEMA_VERSION {
            return Err(format!("unknown event version {}", self.version));
        }
        let data = self.data.clone();
        let bad = |e: serde_json::Error| format!("malformed {} event: {e}", self.kind);
        let change = |account_id: String, credit: i64, debit: i64| StatementChange {
            account_id,
            credit,
            debit,
        };
        Ok(match self.kind.as_str() {
            "account.created" => {
                let d: AccountData = serde_json::from_value(data).map_err(bad)?;
                vec![change(d.account_id, 0, 0)]
            }
            "top_up.created" | "webhook_top_up.created" => {
                let d: CreditData = serde_json::from_value(data).map_err(bad)?;
                vec![change(d.account_id, d.amount, 0)]
            }
            "transfer.created" => {
                let d: TransferData = serde_json::from_value(data).map_err(bad)?;
                vec![change(d.from, 0, d.amount), change(d.to, d.amount, 0)]
            }
            // The debit happens when the payout is requested; what the
            // vendor does later moves no money on the statement.
            "payout.requested" => {
                let d: CreditData = serde_json::from_value(data).map_err(bad)?;
                vec![change(d.account_id, 0, d.amount)]
            }
            "payout.paid" | "payout.dead_lettered" | "payout.outcome_unknown" => {
                let _: PayoutData = serde_json::from_value(data).map_err(bad)?;
                vec![]
            }
            // The reversal of a cancelled payout gives the amount back.
            "payout.cancelled" => {
                let d: CreditData = serde_json::from_value(data).map_err(bad)?;
                vec![change(d.account_id, d.amount, 0)]
            }
            // A withdrawal debits when it is requested, and its credit-back
            // gives the amount back; being paid moves no money.
            "withdrawal.requested" => {
                let d: CreditData = serde_json::from_value(data).map_err(bad)?;
                vec![change(d.account_id, 0, d.amount)]
            }
            "withdrawal.paid" => {
                let _: WithdrawalData = serde_json::from_value(data).map_err(bad)?;
                vec![]
            }
            "withdrawal.declined" => {
                let d: CreditData = serde_json::from_value(data).map_err(bad)?;
                vec![change(d.account_id, d.amount, 0)]
            }
            other => return Err(format!("unknown event type {other:?}")),
        })
    }
}

/// Where and how the events run.
#[derive(Debug, Clone)]
pub struct EventsConfig {
    /// The NATS server.
    pub nats_url: String,
    /// The CA certificates (PEM) a TLS NATS server must be signed by, in
    /// place of the platform's roots; TLS is then required.
    pub ca_file: Option<std::path::PathBuf>,
    /// Relays in this process.
    pub relays: usize,
    /// Projection consumers in this process.
    pub projectors: usize,
    /// The names of streams, subjects and consumers.
    pub namespace: Namespace,
    /// How long the server waits for the projection's acknowledgement
    /// before it delivers a message again (a killed projector's messages
    /// come back after this).
    pub ack_wait: Duration,
}

/// Connects to NATS (`nats://`, or `tls://` and any URL with `ca_file`:
/// TLS verified against the platform's roots or only `ca_file`'s
/// certificates) and makes sure the streams exist with the settings the
/// projection's start checks ask for ([`stream_configs`]). A server that is
/// not there yet is waited for; one whose TLS handshake fails is an error
/// at once ([`StartError::Handshake`]), never retried.
pub async fn connect(url: &str, ca_file: Option<&Path>, ns: &Namespace) -> Result<jetstream::Context, StartError> {
    let options = || -> Result<async_nats::ConnectOptions, StartError> {
        let options = async_nats::ConnectOptions::new().connection_timeout(Duration::from_secs(5));
        // A server that asks for TLS gets it on any URL: the roots are set
        // whatever the scheme.
        let tls = idem_tls::Roots::ca_file(ca_file)
            .client_config()
            .map_err(|e| StartError::Config(format!("--nats-ca: {e}")))?;
        Ok(options.tls_client_config(tls).require_tls(ca_file.is_some()))
    };
    // One attempt first: a refused handshake is a configuration to fix,
    // not a server to wait for.
    let client = match options()?.connect(url).await {
        Ok(client) => client,
        Err(e) if e.kind() == async_nats::ConnectErrorKind::Tls || idem_tls::handshake_failure(&e).is_some() => {
            let why = idem_tls::handshake_failure(&e).unwrap_or_else(|| format!("TLS failed: {e}"));
            return Err(StartError::Handshake(format!("NATS {url}: {why}")));
        }
        Err(_) => options()?
            .retry_on_initial_connect()
            .connect(url)
            .await
            .map_err(|e| StartError::Config(format!("cannot connect to NATS at {url}: {e}")))?,
    };
    let js = jetstream::new(client);
    // Retried: a NATS server that is starting answers "no responders" for
    // a moment, and a client still connecting knows no max_payload yet.
    let mut attempt = 0;
    let mut retry = |e: String| {
        attempt += 1;
        if attempt > 50 {
            return Err(StartError::Config(e));
        }
        tracing::debug!(error = %e, "stream not ready; retrying");
        Ok(())
    };
    let max_payload = loop {
        match js.client().server_info().max_payload {
            0 => retry("the NATS server has not told its max_payload".into())?,
            max_payload => break max_payload,
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    for config in stream_configs(ns, max_payload) {
        let name = config.name.clone();
        loop {
            match js.get_or_create_stream(config.clone()).await {
                Ok(stream) => {
                    if let Some(updated) = brought_in_line(&stream.cached_info().config, &config) {
                        js.update_stream(&updated)
                            .await
                            .map_err(|e| StartError::Config(format!("cannot update the stream {name}: {e}")))?;
                        tracing::info!(
                            stream = %name,
                            max_age_s = updated.max_age.as_secs(),
                            max_msg_size = updated.max_message_size,
                            "stream settings brought in line with what the projection needs"
                        );
                    }
                    break;
                }
                Err(e) => retry(format!("cannot create the stream {name}: {e}"))?,
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    Ok(js)
}

/// The streams of `ns` as the ledger creates them, on a server whose
/// `max_payload` is `max_payload`:
///
/// - the events stream keeps a message [`STREAM_MAX_AGE`], and takes
///   messages of at most `max_payload` less
///   [`idem_jetstream::DEAD_LETTER_HEADROOM`], so that any of them fits in
///   a dead letter (every outbox event does: its payload is at most
///   [`idem_core::MAX_OUTBOX_PAYLOAD`], 8 KiB under NATS's default);
/// - the dead-letter stream keeps a dead letter until it is redriven or
///   resolved: no `max_age` and no limit.
pub fn stream_configs(ns: &Namespace, max_payload: usize) -> [stream::Config; 2] {
    let largest = max_payload.saturating_sub(idem_jetstream::DEAD_LETTER_HEADROOM);
    [
        stream::Config {
            name: ns.stream(),
            subjects: vec![format!("{}.>", ns.subjects())],
            duplicate_window: Duration::from_secs(120),
            storage: stream::StorageType::File,
            max_age: STREAM_MAX_AGE,
            max_message_size: i32::try_from(largest).unwrap_or(i32::MAX),
            ..Default::default()
        },
        stream::Config {
            name: ns.dead_stream(),
            subjects: vec![ns.dead_subject()],
            duplicate_window: Duration::from_secs(120),
            storage: stream::StorageType::File,
            ..Default::default()
        },
    ]
}

/// The settings an existing stream of the ledger's needs changed to be
/// `wanted`'s, as earlier versions created them: the dead letters kept six
/// days (now until they are handled), events of any size (now at most
/// `wanted`'s `max_msg_size`). Other settings are the operator's.
fn brought_in_line(current: &stream::Config, wanted: &stream::Config) -> Option<stream::Config> {
    let mut updated = current.clone();
    if wanted.max_age.is_zero() {
        updated.max_age = Duration::ZERO;
    }
    if wanted.max_message_size > 0
        && (current.max_message_size <= 0 || current.max_message_size > wanted.max_message_size)
    {
        updated.max_message_size = wanted.max_message_size;
    }
    (updated != *current).then_some(updated)
}

/// Where a mutation's event goes: the ledger's outbox on one store, and the
/// namespace the event is published under.
pub struct EventOutbox<D: LedgerDb> {
    outbox: D::Outbox,
    namespace: Namespace,
}

impl<D: LedgerDb> Clone for EventOutbox<D> {
    fn clone(&self) -> Self {
        Self {
            outbox: self.outbox.clone(),
            namespace: self.namespace.clone(),
        }
    }
}

impl<D: LedgerDb> std::fmt::Debug for EventOutbox<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventOutbox")
            .field("outbox", &self.outbox)
            .field("namespace", &self.namespace)
            .finish()
    }
}

impl<D: LedgerDb> EventOutbox<D> {
    /// The outbox of `db` ([`OUTBOX_TABLE`](crate::db::OUTBOX_TABLE)), its
    /// events named in `namespace`.
    pub fn new(db: &D, namespace: Namespace) -> Self {
        Self {
            outbox: db.outbox(),
            namespace,
        }
    }

    /// Enqueues a version-1 event of `kind` in the open transaction: it is
    /// published if and only if the transaction commits.
    pub async fn enqueue(
        &self,
        tx: &mut D::Tx,
        kind: &str,
        tenant: &str,
        now_ms: i64,
        data: serde_json::Value,
    ) -> Result<(), crate::db::DbError> {
        let event = Envelope::new(kind, tenant, now_ms, data).to_outbox_in(&self.namespace)?;
        D::enqueue(&self.outbox, tx, &event).await
    }
}

/// A relay of the ledger's outbox.
pub fn relay<D: LedgerDb>(db: &D, js: &jetstream::Context) -> Relay<D::Outbox, JetStreamPublisher> {
    Relay::new(
        db.outbox(),
        JetStreamPublisher::new(js.clone()),
        RelayOptions {
            name: "ledger".into(),
            idle_wait: Duration::from_millis(20),
            stale_unsent_after: Some(Duration::from_secs(idem_inbox::DEFAULT_TTL_SECS).saturating_sub(STREAM_MAX_AGE)),
            ..Default::default()
        },
    )
}

/// What the `/healthz` endpoint reports of the events: the settings
/// refused at start (each stops its component for good, unlike NATS being
/// down, which is retried).
#[derive(Debug, Clone, Default)]
pub struct EventsHealth(Arc<std::sync::Mutex<Vec<String>>>);

impl EventsHealth {
    /// Records a refused setting of `component`: logged as an error,
    /// counted in `ledger_events_config_refused_total`, and shown by
    /// `/healthz` until the process restarts.
    pub fn refuse(&self, component: &str, why: &str) {
        tracing::error!(component, error = %why, "events configuration refused; this component does not run until it is fixed and the process restarted");
        metrics::counter!("ledger_events_config_refused_total", "component" => component.to_owned()).increment(1);
        let mut refused = self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let entry = format!("{component}: {why}");
        if !refused.contains(&entry) {
            refused.push(entry);
        }
    }

    /// The refusals so far.
    pub fn refused(&self) -> Vec<String> {
        self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }
}

/// The statement projection's durable consumer, with `ack_wait` in force:
/// an existing consumer's configuration is updated to it, and refused if
/// the server keeps another.
async fn projection_consumer(
    js: &jetstream::Context,
    ns: &Namespace,
    ack_wait: Duration,
) -> Result<jetstream::consumer::PullConsumer, ConsumerError> {
    let stream = js
        .get_stream(ns.stream())
        .await
        .map_err(|e| ConsumerError::Nats(format!("the stream {}: {e}", ns.stream())))?;
    let config = pull::Config {
        durable_name: Some(ns.consumer()),
        ack_policy: jetstream::consumer::AckPolicy::Explicit,
        ack_wait,
        max_deliver: -1,
        ..Default::default()
    };
    let mut consumer = match stream.get_consumer::<pull::Config>(&ns.consumer()).await {
        Err(_) => stream
            .get_or_create_consumer(&ns.consumer(), config)
            .await
            .map_err(|e| ConsumerError::Nats(format!("the consumer {}: {e}", ns.consumer())))?,
        Ok(mut existing) => {
            let current = existing
                .info()
                .await
                .map_err(|e| ConsumerError::Nats(e.to_string()))?
                .config
                .clone();
            if current.ack_wait == ack_wait {
                existing
            } else {
                // Editable on the server: the same durable with the new wait.
                let updated = jetstream::consumer::Config {
                    ack_wait,
                    ..current.clone()
                };
                stream.create_consumer(updated).await.map_err(|e| {
                    ConsumerError::Config(format!(
                        "the consumer {} has ack_wait {} s and the server refused to change it to {} s \
                         (--projection-ack-wait-secs): {e}",
                        ns.consumer(),
                        current.ack_wait.as_secs(),
                        ack_wait.as_secs()
                    ))
                })?;
                tracing::info!(
                    consumer = %ns.consumer(),
                    from_s = current.ack_wait.as_secs(),
                    to_s = ack_wait.as_secs(),
                    "projection consumer's ack_wait updated"
                );
                stream
                    .get_consumer::<pull::Config>(&ns.consumer())
                    .await
                    .map_err(|e| ConsumerError::Nats(format!("the consumer {}: {e}", ns.consumer())))?
            }
        }
    };
    let in_force = consumer
        .info()
        .await
        .map_err(|e| ConsumerError::Nats(e.to_string()))?
        .config
        .ack_wait;
    if in_force != ack_wait {
        return Err(ConsumerError::Config(format!(
            "the consumer {} keeps ack_wait {} s, not the {} s asked (--projection-ack-wait-secs)",
            ns.consumer(),
            in_force.as_secs(),
            ack_wait.as_secs()
        )));
    }
    Ok(consumer)
}

/// The statement projection's consumer.
///
/// [`ConsumerError::Config`]: a setting is refused (retrying cannot help);
/// [`ConsumerError::Nats`]: the server did not answer.
pub async fn projector<D: LedgerDb>(
    db: &D,
    clock: SharedClock,
    js: &jetstream::Context,
    ns: &Namespace,
    ack_wait: Duration,
) -> Result<InboxConsumer<D>, ConsumerError> {
    let consumer = projection_consumer(js, ns, ack_wait).await?;
    let store = db.keyed(TableName::new(PROJECTION_INBOX_TABLE).map_err(|e| ConsumerError::Config(e.to_string()))?);
    let inbox = Inbox::new(TxEngine::new(store).with_clock(clock.clone()));
    let mut options = ConsumerOptions::new(PROJECTION);
    options.dead_letter_subject = ns.dead_subject();
    #[cfg(feature = "fault-injection")]
    crate::fault::projection_options(&mut options);
    let handler = idem_jetstream::handler::<D, _>(move |tx, event: Arc<Event>| {
        let clock = clock.clone();
        #[cfg(feature = "fault-injection")]
        crate::fault::projection_panic();
        Box::pin(async move {
            let envelope: Envelope = serde_json::from_slice(&event.payload)
                .map_err(|e| HandlerError::reject(format!("not an event: {e}")))?;
            if envelope.id != event.id {
                return Err(HandlerError::reject("the payload's id differs from Nats-Msg-Id"));
            }
            let changes = envelope.statement_changes().map_err(HandlerError::reject)?;
            tx.apply_statement(
                &envelope.tenant,
                &envelope.id,
                &changes,
                envelope.occurred_at_ms,
                clock.now_ms(),
            )
            .await
            .map_err(|e| {
                if idem_core::Contention::is_contention(&e) {
                    HandlerError::Idem(idem_core::Error::store(StoreErrorKind::Deadlock, e.to_string()))
                } else {
                    HandlerError::retry(e)
                }
            })
        })
    });
    InboxConsumer::start(js.clone(), consumer, inbox, options, handler).await
}

/// Runs `config.relays` relays and `config.projectors` projection consumers
/// until `shutdown` flips. While NATS cannot be reached, it keeps trying
/// (and says so), so events are published once the broker is back. The
/// relays start as soon as NATS answers, whatever becomes of the
/// projection; a projection setting that is refused is reported through
/// `health` (log, metric, `/healthz`) and stops only the projection.
pub async fn run<D: LedgerDb>(
    db: D,
    clock: SharedClock,
    config: EventsConfig,
    mut shutdown: tokio::sync::watch::Receiver<bool>,
    health: EventsHealth,
) -> Result<(), StartError> {
    let mut pause = Duration::from_millis(500);
    let js = loop {
        match connect(&config.nats_url, config.ca_file.as_deref(), &config.namespace).await {
            Ok(js) => break js,
            // A refused handshake is a configuration to fix, not a server to wait for.
            Err(e @ StartError::Handshake(_)) => return Err(e),
            Err(e) if !matches!(shutdown.has_changed(), Ok(true)) => {
                tracing::warn!(error = %e, retry_in_ms = pause.as_millis() as u64, "events not started; retrying");
                tokio::select! {
                    _ = shutdown.wait_for(|s| *s) => return Ok(()),
                    _ = tokio::time::sleep(pause) => {}
                }
                pause = (pause * 2).min(Duration::from_secs(10));
            }
            Err(e) => return Err(e),
        }
    };
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..config.relays {
        let relay = relay(&db, &js);
        let mut stop = shutdown.clone();
        tasks.spawn(async move {
            relay
                .run(async move {
                    let _ = stop.wait_for(|s| *s).await;
                })
                .await
        });
    }
    for _ in 0..config.projectors {
        let (db, clock, js, config, health) = (db.clone(), clock.clone(), js.clone(), config.clone(), health.clone());
        let mut stop = shutdown.clone();
        tasks.spawn(async move {
            let mut pause = Duration::from_millis(500);
            let consumer = loop {
                match projector(&db, clock.clone(), &js, &config.namespace, config.ack_wait).await {
                    Ok(consumer) => break consumer,
                    Err(ConsumerError::Config(why)) => {
                        health.refuse("projection", &why);
                        return;
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, retry_in_ms = pause.as_millis() as u64, "projection not started; retrying");
                        tokio::select! {
                            _ = stop.wait_for(|s| *s) => return,
                            _ = tokio::time::sleep(pause) => {}
                        }
                        pause = (pause * 2).min(Duration::from_secs(10));
                    }
                }
            };
            consumer
                .run(async move {
                    let _ = stop.wait_for(|s| *s).await;
                })
                .await
        });
    }
    tracing::info!(relays = config.relays, projectors = config.projectors, nats = %config.nats_url, "events running");
    let _ = shutdown.wait_for(|s| *s).await;
    while tasks.join_next().await.is_some() {}
    Ok(())
}
