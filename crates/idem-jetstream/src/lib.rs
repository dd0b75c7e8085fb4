//! NATS JetStream for idem.
//!
//! The guide, with examples: `docs/events.md` in the repository.
//!
//! - [`JetStreamPublisher`]: the outbox relay's publisher. Each message is
//!   published with `Nats-Msg-Id` = its event id, so the stream drops a
//!   second copy within its duplicate window, and counts as sent only once
//!   the server's PubAck confirms it is stored.
//! - [`InboxConsumer`]: a pull consumer that runs an inbox handler for each
//!   message (one database transaction claims (handler, event id), applies
//!   the handler's writes and records the outcome) and acknowledges only
//!   after that commit, waiting for the server to confirm the ack. A
//!   redelivery finds the recorded outcome and is acknowledged without
//!   running the handler. Transient failures are negatively acknowledged
//!   with a delay; after a bounded number of deliveries, or at once for a
//!   message that can never succeed, the message is published to a
//!   dead-letter subject and terminated. Long handlers send progress acks.
//!   A panicking handler is a failing one. At start the consumer checks
//!   that the stream's `max_age` bounds the redelivery horizon within the
//!   inbox's key TTL, that no limit of the stream evicts a message waiting
//!   for its retry, that a stream captures its dead letters and keeps them
//!   until they are handled, and that a dead letter always fits
//!   ([`DEAD_LETTER_HEADROOM`]).
//! - [`dead_letters`] and [`redrive()`]: a dead-lettered event is recorded
//!   as such in the inbox before its dead letter is published (an ordinary
//!   redelivery still runs nothing); a redrive publishes it again for its
//!   handler alone, which runs it at most once, under its redrive key.

mod checks;
mod consumer;
mod error;
mod publisher;
mod redrive;

pub use checks::DEAD_LETTER_HEADROOM;
pub use consumer::{
    ConsumerOptions, DeadLettered, EVENT_ID, Event, InboxConsumer, MSG_ID, REDRIVE, REDRIVE_KEY_TTL_SECS, Recorded,
    handler,
};
pub use error::{ConsumerError, HandlerError};
pub use publisher::JetStreamPublisher;
pub use redrive::{DeadLetterFilter, RedriveOptions, RedriveReport, StoredDeadLetter, dead_letters, redrive};

pub use async_nats;
