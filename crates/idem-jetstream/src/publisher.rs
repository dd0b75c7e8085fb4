//! The outbox relay's JetStream publisher.

use std::collections::HashMap;
use std::time::Duration;

use async_nats::jetstream::context::Context;
use async_nats::jetstream::context::{GetStreamByNameErrorKind, PublishErrorKind};
use async_nats::jetstream::message::PublishMessage as Publish;
use idem_core::{BoxFuture, OutboxMessage};
use idem_outbox::{PublishError, Publisher};

/// Publishes outbox rows to JetStream with `Nats-Msg-Id` = event id and
/// waits for each PubAck.
///
/// A batch is sent in order on one connection without waiting between
/// messages; then every acknowledgement is awaited (bounded by
/// [`with_ack_timeout`](Self::with_ack_timeout)). A message whose
/// acknowledgement does not come is reported failed and stays unsent; if
/// the server did store it, the next publish of the same id is dropped as a
/// duplicate within the stream's window.
#[derive(Debug, Clone)]
pub struct JetStreamPublisher {
    js: Context,
    ack_timeout: Duration,
}

impl JetStreamPublisher {
    /// A publisher on a JetStream context.
    pub fn new(js: Context) -> Self {
        Self {
            js,
            ack_timeout: Duration::from_secs(5),
        }
    }

    /// How long one batch waits for its acknowledgements (default 5 s).
    pub fn with_ack_timeout(mut self, timeout: Duration) -> Self {
        self.ack_timeout = timeout;
        self
    }
}

impl JetStreamPublisher {
    /// Whether a stream captures `subject`, asked after a publish answered
    /// "no stream": a stream electing its leader (or whose only server is
    /// down) answers a publish so too, and that is the broker unavailable,
    /// not the row refused. Only a definite "no stream captures it" is
    /// `false`; a lookup that fails (the metadata leader electing too) is
    /// taken for `true`, so the relay waits rather than refuse rows. The
    /// lookup is bounded by the batch's `deadline`; one that does not answer
    /// by then is taken for `true` too.
    async fn stream_captures(&self, subject: &str, deadline: tokio::time::Instant) -> bool {
        match tokio::time::timeout_at(deadline, self.js.stream_by_subject(subject)).await {
            Ok(Ok(_)) | Err(_) => true,
            Ok(Err(e)) => e.kind() != GetStreamByNameErrorKind::NotFound,
        }
    }
}

impl Publisher for JetStreamPublisher {
    fn publish<'a>(&'a self, messages: &'a [OutboxMessage]) -> BoxFuture<'a, Vec<Result<(), PublishError>>> {
        Box::pin(async move {
            let mut pending = Vec::with_capacity(messages.len());
            for m in messages {
                let publish = Publish::build()
                    .message_id(m.id.as_str())
                    .payload(bytes::Bytes::copy_from_slice(&m.payload));
                pending.push(self.js.send_publish(m.subject.clone(), publish).await);
            }
            let deadline = tokio::time::Instant::now() + self.ack_timeout;
            let mut results = Vec::with_capacity(messages.len());
            let mut captured: HashMap<&str, bool> = HashMap::new();
            for (m, sent) in messages.iter().zip(pending) {
                results.push(match sent {
                    Err(e) => Err(PublishError::unavailable(format!("publish: {e}"))),
                    Ok(ack) => match tokio::time::timeout_at(deadline, ack.into_future()).await {
                        Ok(Ok(_)) => Ok(()),
                        Ok(Err(e)) if e.kind() == PublishErrorKind::StreamNotFound => {
                            let subject = m.subject.as_str();
                            let captured = match captured.get(subject) {
                                Some(known) => *known,
                                None => {
                                    let known = self.stream_captures(subject, deadline).await;
                                    captured.insert(subject, known);
                                    known
                                }
                            };
                            if captured {
                                Err(PublishError::unavailable(format!(
                                    "acknowledgement: {e} (a stream captures {subject:?}: it has no leader now)"
                                )))
                            } else {
                                // No stream captures the subject: this row's
                                // problem, not the broker's.
                                Err(PublishError::refused(format!("acknowledgement: {e}")))
                            }
                        }
                        Ok(Err(e)) => Err(PublishError::unavailable(format!("acknowledgement: {e}"))),
                        Err(_) => Err(PublishError::unavailable("no acknowledgement within the timeout")),
                    },
                });
            }
            results
        })
    }
}
