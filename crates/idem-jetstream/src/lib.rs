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
//!   At start the consumer checks that its settings, the stream's
//!   duplicate window and the inbox's key TTL cover the redelivery horizon.

mod consumer;
mod publisher;

pub use consumer::{ConsumerError, ConsumerOptions, Event, HandlerError, InboxConsumer, MSG_ID, handler};
pub use publisher::JetStreamPublisher;

pub use async_nats;
