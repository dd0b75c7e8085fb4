//! The checks [`InboxConsumer::start`](crate::InboxConsumer::start) runs on
//! the consumer, its stream and the dead-letter stream before it pulls
//! anything.
//!
//! Each refuses a setting under which a message could be applied twice, or
//! lost without being applied nor kept as a dead letter:
//!
//! - the consumer acknowledges explicitly and lets this consumer bound
//!   deliveries (`max_deliver` unlimited);
//! - a stream captures the dead-letter subject, and the consumer is not
//!   delivered its own dead letters;
//! - the stream's `max_age` is within the inbox TTL and outlasts the
//!   delivery schedule ([`check_horizon`]);
//! - no count or size limit of the stream evicts a message waiting for its
//!   retry ([`check_evictions`]): under discard policy `Old`,
//!   `max_messages` and `max_bytes` remove the oldest messages, and
//!   `max_messages_per_subject` does under either policy unless
//!   `discard_new_per_subject` is set with `New`. Discard `New` refuses new
//!   messages instead, which is safe for the consumer: the publisher sees
//!   the refusal and tries again (the outbox relay does). Retention
//!   `Interest` and `WorkQueue` remove only messages acknowledged (or
//!   terminated), which this consumer does after the commit or after the
//!   dead letter is stored, so every retention policy is accepted;
//! - a dead letter lives until it is redriven or resolved
//!   ([`check_dead_letter_stream`]): its stream has no `max_age`, no limit
//!   that evicts, and `Limits` retention (`Interest` drops a message no
//!   consumer is interested in, `WorkQueue` removes it once any consumer
//!   acknowledges it);
//! - a dead letter always fits ([`check_sizes`]): the dead-letter copy
//!   carries up to [`DEAD_LETTER_HEADROOM`] bytes of headers more than its
//!   event, so the stream's `max_msg_size` must leave that much under the
//!   server's `max_payload` and the dead-letter stream's `max_msg_size`.
//!
//! Deletions someone asks for (a purge, a rollup, deleting a message) are
//! not limits and are not checked.

use std::time::Duration;

use async_nats::jetstream::consumer::Config as ConsumerConfig;
use async_nats::jetstream::consumer::Info as ConsumerInfo;
use async_nats::jetstream::context::Context;
use async_nats::jetstream::stream::{Config as StreamConfig, DiscardPolicy, RetentionPolicy};

use crate::consumer::ConsumerOptions;
use crate::error::ConsumerError;

/// How many bytes of headers a dead letter may carry beyond its event's:
/// the handler's name twice, the event id once more, the subject, the
/// delivery count, the error and the redrive flag. The error text is cut to
/// what room remains, so a dead letter always fits when the handler name
/// and the event id are at most 255 bytes (the longest the inbox accepts)
/// and the subject at most 3 KiB. A stream's `max_msg_size` must leave this
/// much under the limit of the dead letter (the server's `max_payload`, and
/// the dead-letter stream's own `max_msg_size`): with NATS's default 1 MiB,
/// `max_msg_size` at most 1 MiB − 4 KiB, which every outbox event fits
/// (`idem_core::MAX_OUTBOX_PAYLOAD`, 1 MiB − 8 KiB, plus the relay's
/// `Nats-Msg-Id`).
pub const DEAD_LETTER_HEADROOM: usize = 4096;

/// What the checks learned that the consumer keeps.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Checked {
    /// The largest dead letter (headers and payload) the server and the
    /// dead-letter stream accept, in bytes.
    pub(crate) dead_letter_bytes: usize,
}

/// Runs every check (see the module's documentation) on the consumer
/// described by `info`.
pub(crate) async fn check(
    js: &Context,
    info: &ConsumerInfo,
    options: &ConsumerOptions,
    ttl: Duration,
) -> Result<Checked, ConsumerError> {
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
    idem_core::OutboxEvent::new(options.dead_letter_subject.as_str(), Vec::new())
        .map_err(|e| ConsumerError::Config(format!("dead-letter subject {:?}: {e}", options.dead_letter_subject)))?;
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
        && (config.filter_subject.is_empty() || subject_matches(&config.filter_subject, &options.dead_letter_subject))
    {
        return Err(ConsumerError::Config(format!(
            "the dead-letter subject {:?} is in the consumer's own stream {:?} and its filter: dead letters \
             would be delivered to the handler again",
            options.dead_letter_subject, info.stream_name
        )));
    }
    let events = stream_config(js, &info.stream_name).await?;
    let dead = if dead_stream == info.stream_name {
        events.clone()
    } else {
        stream_config(js, &dead_stream).await?
    };
    check_horizon(options, config, &info.stream_name, events.max_age, ttl)?;
    check_evictions(
        &events,
        "stream",
        "a message waiting for its retry",
        "never applied nor kept as a dead letter",
    )?;
    check_dead_letter_stream(&dead, dead_stream == info.stream_name)?;
    let max_payload = js.client().server_info().max_payload;
    if max_payload == 0 {
        return Err(ConsumerError::Nats(
            "the server has not told its max_payload yet".into(),
        ));
    }
    let dead_letter_bytes = check_sizes(&events, &dead, max_payload)?;
    if events.duplicate_window < Duration::from_secs(120) {
        tracing::warn!(
            stream = %info.stream_name,
            duplicate_window_s = events.duplicate_window.as_secs(),
            "the stream's duplicate window is under two minutes: an event a relay publishes again after a \
             crash may be stored twice (the inbox still applies it once)"
        );
    }
    Ok(Checked { dead_letter_bytes })
}

async fn stream_config(js: &Context, name: &str) -> Result<StreamConfig, ConsumerError> {
    let mut stream = js
        .get_stream(name)
        .await
        .map_err(|e| ConsumerError::Nats(format!("the stream {name:?}: {e}")))?;
    Ok(stream
        .info()
        .await
        .map_err(|e| ConsumerError::Nats(format!("the stream {name:?}: {e}")))?
        .config
        .clone())
}

/// Refuses an inbox that could forget an event while the stream can still
/// deliver it, and a stream that could drop a failing message before it
/// becomes a dead letter.
///
/// Only `max_age` bounds when a message can come back: a consumer killed
/// between its commit and its ack gets it whenever it next pulls, for as
/// long as the stream keeps it.
fn check_horizon(
    options: &ConsumerOptions,
    config: &ConsumerConfig,
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
fn delivery_schedule(options: &ConsumerOptions, config: &ConsumerConfig) -> Duration {
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

/// Refuses a count or size limit under which the server removes a stored
/// message to make room for a new one. `what` is the kind of stream named
/// in the error, `victim` the message that could go, `loss` what becomes
/// of it.
fn check_evictions(config: &StreamConfig, what: &str, victim: &str, loss: &str) -> Result<(), ConsumerError> {
    let name = &config.name;
    let fix = "set its discard policy to New (a full stream then refuses new messages, which their \
               publisher retries) or remove the limit";
    if config.discard == DiscardPolicy::Old {
        for (setting, limit) in [("max_messages", config.max_messages), ("max_bytes", config.max_bytes)] {
            if limit > 0 {
                return Err(ConsumerError::Config(format!(
                    "the {what} {name:?} removes its oldest messages beyond its {setting} ({limit}) under \
                     discard policy Old: {victim} could be removed, {loss}; {fix}"
                )));
            }
        }
    }
    let per_subject = config.max_messages_per_subject;
    if per_subject > 0 && !(config.discard == DiscardPolicy::New && config.discard_new_per_subject) {
        return Err(ConsumerError::Config(format!(
            "the {what} {name:?} removes the oldest messages of a subject beyond its max_messages_per_subject \
             ({per_subject}): {victim} could be removed, {loss}; set discard policy New with \
             discard_new_per_subject (a subject at its limit then refuses new messages) or remove the limit"
        )));
    }
    Ok(())
}

/// Refuses a dead-letter stream that removes a dead letter before it is
/// redriven or resolved. `shared`: the dead letters are in the consumer's
/// own stream.
fn check_dead_letter_stream(config: &StreamConfig, shared: bool) -> Result<(), ConsumerError> {
    let name = &config.name;
    if !config.max_age.is_zero() {
        let fix = if shared {
            "the dead letters share the consumer's stream, whose max_age bounds redeliveries: give them a \
             stream of their own without max_age"
        } else {
            "set its max_age to 0 (unlimited)"
        };
        return Err(ConsumerError::Config(format!(
            "the dead-letter stream {name:?} deletes dead letters {} s after they are stored (max_age), but a \
             dead letter must be kept until it is redriven or resolved; {fix}",
            config.max_age.as_secs()
        )));
    }
    match config.retention {
        RetentionPolicy::Limits => {}
        RetentionPolicy::Interest => {
            return Err(ConsumerError::Config(format!(
                "the dead-letter stream {name:?} uses Interest retention: a dead letter no consumer is \
                 interested in is dropped at once, and one is removed once its consumers acknowledge it; use \
                 Limits retention"
            )));
        }
        RetentionPolicy::WorkQueue => {
            return Err(ConsumerError::Config(format!(
                "the dead-letter stream {name:?} uses WorkQueue retention: a dead letter is removed as soon as \
                 a consumer acknowledges it, not when it is redriven or resolved; use Limits retention"
            )));
        }
    }
    check_evictions(
        config,
        "dead-letter stream",
        "a dead letter",
        "before it is redriven or resolved",
    )
}

/// Refuses a stream that accepts a message too large for its dead letter,
/// and answers the largest dead letter that can be stored.
fn check_sizes(events: &StreamConfig, dead: &StreamConfig, max_payload: usize) -> Result<usize, ConsumerError> {
    let dead_max = usize::try_from(dead.max_message_size).ok().filter(|&m| m > 0);
    let limit = dead_max.map_or(max_payload, |m| m.min(max_payload));
    let bound = match dead_max {
        Some(m) if m < max_payload => format!("the dead-letter stream {:?}'s max_msg_size", dead.name),
        _ => "the server's max_payload".to_owned(),
    };
    let Some(largest) = limit.checked_sub(DEAD_LETTER_HEADROOM).filter(|&l| l > 0) else {
        return Err(ConsumerError::Config(format!(
            "a dead letter must fit in {limit} bytes ({bound}), which leaves no room for an event beside the \
             {DEAD_LETTER_HEADROOM} bytes of headers a dead letter adds; raise it"
        )));
    };
    let name = &events.name;
    match usize::try_from(events.max_message_size).ok().filter(|&m| m > 0) {
        None => Err(ConsumerError::Config(format!(
            "the stream {name:?} accepts messages as large as the server allows (max_msg_size unlimited), but \
             a dead letter carries up to {DEAD_LETTER_HEADROOM} bytes of headers more than its event and must \
             fit in {limit} bytes ({bound}): a message near that size could never be kept as a dead letter; \
             set the stream's max_msg_size to at most {largest}"
        ))),
        Some(size) if size > largest => Err(ConsumerError::Config(format!(
            "the stream {name:?} accepts messages of up to {size} bytes (max_msg_size), but a dead letter \
             carries up to {DEAD_LETTER_HEADROOM} bytes of headers more than its event and must fit in {limit} \
             bytes ({bound}): set the stream's max_msg_size to at most {largest}"
        ))),
        Some(_) => Ok(limit),
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

#[cfg(test)]
mod tests {
    use super::*;

    /// NATS wildcards, as the dead-letter check reads a consumer's filter.
    #[test]
    fn subjects_match_filters_with_wildcards() {
        use super::subject_matches as m;
        assert!(m("a.>", "a.b.c") && m("a.*.c", "a.b.c") && m("a.b", "a.b") && m(">", "a"));
        assert!(!m("a.>", "a") && !m("a.*", "a.b.c") && !m("a.b", "a.c") && !m("a.b.c", "a.b"));
    }

    /// Under discard Old every count and size limit evicts; under New only
    /// the per-subject one does, unless it is per subject too.
    #[test]
    fn evicting_limits_are_named() {
        let check = |config: StreamConfig| {
            check_evictions(&config, "stream", "m", "lost")
                .err()
                .map(|e| e.to_string())
        };
        let base = StreamConfig {
            name: "S".into(),
            ..Default::default()
        };
        assert_eq!(check(base.clone()), None);
        for (config, setting) in [
            (
                StreamConfig {
                    max_messages: 10,
                    ..base.clone()
                },
                "max_messages (10)",
            ),
            (
                StreamConfig {
                    max_bytes: 1 << 20,
                    ..base.clone()
                },
                "max_bytes (1048576)",
            ),
            (
                StreamConfig {
                    max_messages_per_subject: 1,
                    discard: DiscardPolicy::New,
                    ..base.clone()
                },
                "max_messages_per_subject (1)",
            ),
        ] {
            let err = check(config).expect("refused");
            assert!(err.contains(setting) && err.contains("\"S\""), "{err}");
        }
        for config in [
            StreamConfig {
                max_messages: 10,
                max_bytes: 1 << 20,
                discard: DiscardPolicy::New,
                ..base.clone()
            },
            StreamConfig {
                max_messages_per_subject: 1,
                discard: DiscardPolicy::New,
                discard_new_per_subject: true,
                ..base.clone()
            },
        ] {
            assert_eq!(check(config), None);
        }
    }
}
