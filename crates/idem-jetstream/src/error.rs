//! The errors of a consumer and of its handlers.

use idem_core::Contention;

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

    pub(crate) fn is_permanent(&self) -> bool {
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
    pub(crate) fn is_in_flight(&self) -> bool {
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
    /// [`InboxConsumer::start`](crate::InboxConsumer::start)).
    #[error("consumer configuration: {0}")]
    Config(String),
    /// The server did not answer.
    #[error("jetstream: {0}")]
    Nats(String),
}
