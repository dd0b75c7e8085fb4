//! Dead letters kept by [`InboxConsumer`](crate::InboxConsumer)s: listed,
//! and redriven once their cause is fixed.
//!
//! A redrive publishes a copy of the dead letter to the event's original
//! subject with [`REDRIVE`] = the handler that kept it and [`EVENT_ID`] =
//! the event id. Only that handler's consumer runs it (any other consumer
//! of the subject acknowledges it untouched), and through the inbox, under
//! the event's redrive key only: the consumer first closes the event's own
//! key (or finds it applied, and then runs nothing), so ordinary deliveries
//! and redriven copies never both run, and the redrive key is claimed once.
//! Its record is kept for [`REDRIVE_KEY_TTL_SECS`] (ten years), not the
//! inbox's TTL, because a dead letter has no horizon: once the server
//! stored the copy, the dead letter is deleted from its stream, and a
//! redrive interrupted before that, or whose delete failed, publishes
//! another copy whenever it runs again, which that record drops.

use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::ErrorCode;
use async_nats::jetstream::context::Context;
use async_nats::jetstream::message::PublishMessage as Publish;
use async_nats::jetstream::stream::LastRawMessageErrorKind;
use bytes::Bytes;

#[cfg(doc)]
use crate::consumer::REDRIVE_KEY_TTL_SECS;
use crate::consumer::{EVENT_ID, REDRIVE};
use crate::error::ConsumerError;

/// One dead letter in a dead-letter stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredDeadLetter {
    /// Its sequence in the dead-letter stream.
    pub seq: u64,
    /// The handler that kept it (`Idem-Handler`).
    pub handler: Option<String>,
    /// The event id (`Idem-Event-Id`).
    pub event_id: Option<String>,
    /// The event's original subject (`Idem-Subject`).
    pub subject: Option<String>,
    /// Deliveries made before it was kept (`Idem-Deliveries`).
    pub deliveries: Option<i64>,
    /// Why (`Idem-Error`).
    pub error: String,
    /// Whether it is a redriven copy that failed again.
    pub redriven: bool,
    /// When the server stored it, in ms since the epoch.
    pub stored_at_ms: i64,
    /// The event's payload.
    pub payload: Bytes,
}

/// Which dead letters a call selects.
#[derive(Debug, Clone, Default)]
pub struct DeadLetterFilter {
    /// Only those kept by this handler.
    pub handler: Option<String>,
    /// Only this event.
    pub event_id: Option<String>,
    /// Only sequences greater than this (the last of the previous page).
    pub after_seq: Option<u64>,
    /// At most this many (at least 1).
    pub limit: usize,
}

impl DeadLetterFilter {
    fn matches(&self, letter: &StoredDeadLetter) -> bool {
        self.handler.as_ref().is_none_or(|h| letter.handler.as_ref() == Some(h))
            && self
                .event_id
                .as_ref()
                .is_none_or(|e| letter.event_id.as_ref() == Some(e))
    }
}

/// The dead letters of `stream` that `filter` selects, oldest first.
pub async fn dead_letters(
    js: &Context,
    stream: &str,
    filter: &DeadLetterFilter,
) -> Result<Vec<StoredDeadLetter>, ConsumerError> {
    if filter.limit == 0 {
        return Err(ConsumerError::Config("the limit must be at least 1".into()));
    }
    let mut s = js
        .get_stream(stream)
        .await
        .map_err(|e| ConsumerError::Config(format!("the dead-letter stream {stream:?}: {e}")))?;
    let state = s
        .info()
        .await
        .map_err(|e| ConsumerError::Nats(e.to_string()))?
        .state
        .clone();
    let mut out = Vec::new();
    if state.messages == 0 {
        return Ok(out);
    }
    let first = filter
        .after_seq
        .map_or(state.first_sequence, |a| a.saturating_add(1).max(state.first_sequence));
    for seq in first..=state.last_sequence {
        if out.len() >= filter.limit {
            break;
        }
        let message = match s.get_raw_message(seq).await {
            Ok(m) => m,
            Err(e) => match e.kind() {
                LastRawMessageErrorKind::NoMessageFound => continue,
                LastRawMessageErrorKind::JetStream(j) if j.error_code() == ErrorCode::NO_MESSAGE_FOUND => continue,
                _ => return Err(ConsumerError::Nats(format!("dead letter {seq}: {e}"))),
            },
        };
        let header = |name: &str| message.headers.get(name).map(|v| v.as_str().to_owned());
        let letter = StoredDeadLetter {
            seq,
            handler: header("Idem-Handler"),
            event_id: header(EVENT_ID),
            subject: header("Idem-Subject"),
            deliveries: header("Idem-Deliveries").and_then(|d| d.parse().ok()),
            error: header("Idem-Error").unwrap_or_default(),
            redriven: header("Idem-Redriven").is_some(),
            stored_at_ms: i64::try_from(message.time.unix_timestamp_nanos() / 1_000_000).unwrap_or(0),
            payload: message.payload.clone(),
        };
        if filter.matches(&letter) {
            out.push(letter);
        }
    }
    Ok(out)
}

/// How a redrive runs.
#[derive(Debug, Clone, Copy)]
pub struct RedriveOptions {
    /// At most this many dead letters redriven (at least 1).
    pub max: usize,
    /// At most this many copies published per second (at least 1).
    pub per_second: u32,
}

/// What a redrive did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RedriveReport {
    /// Sequences of the dead letters whose copy the server stored (and
    /// which were then deleted from the dead-letter stream).
    pub redriven: Vec<u64>,
    /// Dead letters left in place, with why.
    pub failed: Vec<(u64, String)>,
}

/// Publishes a copy of each selected dead letter (at most `options.max`,
/// paced at `options.per_second`) to its original subject, for its handler
/// only, and deletes it from `stream` once the copy is stored. A dead
/// letter without its handler, event id or subject cannot be redriven and
/// stays. A dead letter whose delete failed is reported and stays too; a
/// later redrive of it publishes another copy, which the handler's redrive
/// key drops (the event is applied at most once).
///
/// The copy carries two headers more than the event (its handler and event
/// id): an event within a few hundred bytes of its stream's `max_msg_size`
/// is refused there and stays a dead letter until that limit is raised.
pub async fn redrive(
    js: &Context,
    stream: &str,
    filter: &DeadLetterFilter,
    options: RedriveOptions,
) -> Result<RedriveReport, ConsumerError> {
    if options.max == 0 || options.per_second == 0 {
        return Err(ConsumerError::Config("max and per_second must be at least 1".into()));
    }
    let filter = DeadLetterFilter {
        limit: filter.limit.min(options.max).max(1),
        ..filter.clone()
    };
    let letters = dead_letters(js, stream, &filter).await?;
    let s = js
        .get_stream(stream)
        .await
        .map_err(|e| ConsumerError::Nats(e.to_string()))?;
    let pace = Duration::from_secs(1) / options.per_second;
    let mut report = RedriveReport::default();
    for (i, letter) in letters.into_iter().enumerate() {
        if i > 0 {
            tokio::time::sleep(pace).await;
        }
        let (Some(handler), Some(event_id), Some(subject)) = (&letter.handler, &letter.event_id, &letter.subject)
        else {
            report.failed.push((
                letter.seq,
                "not a consumer's dead letter: no Idem-Handler, Idem-Event-Id or Idem-Subject".into(),
            ));
            continue;
        };
        let mut headers = HeaderMap::new();
        headers.insert(REDRIVE, handler.as_str());
        headers.insert(EVENT_ID, event_id.as_str());
        let publish = Publish::build()
            .headers(headers)
            .payload(letter.payload.clone())
            .message_id(format!("redrive:{handler}:{event_id}:{}:{}", stream, letter.seq));
        let stored = match js.send_publish(subject.clone(), publish).await {
            Ok(ack) => ack.await.map(|_| ()).map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        if let Err(e) = stored {
            report
                .failed
                .push((letter.seq, format!("copy not stored on {subject}: {e}")));
            continue;
        }
        match s.delete_message(letter.seq).await {
            Ok(_) => report.redriven.push(letter.seq),
            Err(e) => report.failed.push((
                letter.seq,
                format!(
                    "copy stored, but the dead letter was not deleted (a second redrive of it applies nothing): {e}"
                ),
            )),
        }
        metrics::counter!("idem_consumer_dead_letters_redriven_total", "handler" => handler.clone()).increment(1);
    }
    Ok(report)
}
