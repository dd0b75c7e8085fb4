//! Verification plus deduplication: a verified webhook applied once per
//! event id, in one transaction with the handler's writes.

use http::HeaderMap;
use idem_core::{BoxFuture, Contention, TxBackend};
use idem_inbox::{Delivery, Inbox};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::{Verifier, WebhookError};

/// Proof that a webhook's signature and timestamp were verified; only
/// [`WebhookInbox::verify`] makes one.
#[derive(Debug)]
pub struct Verified<'h> {
    webhook_id: &'h str,
}

impl<'h> Verified<'h> {
    /// The `webhook-id` header: the same on each of the provider's retries.
    pub fn webhook_id(&self) -> &'h str {
        self.webhook_id
    }
}

/// Why a webhook was not applied.
#[derive(Debug, thiserror::Error)]
pub enum ReceiveError<E> {
    /// Refused before anything was read or written: bad signature, stale
    /// timestamp, missing headers.
    #[error(transparent)]
    Refused(WebhookError),
    /// The handler (or the inbox) failed; nothing of it committed.
    #[error(transparent)]
    Handler(E),
}

/// A provider's webhooks, verified per Standard Webhooks and applied once
/// per event id through an [`Inbox`] (give its store a table of its own,
/// apart from request keys).
///
/// ```no_run
/// # async fn demo(store: idem_sqlite::SqliteStore, headers: http::HeaderMap, body: Vec<u8>) {
/// use idem_webhooks::{ReceiveError, Verifier, WebhookInbox};
/// let inbox = idem_inbox::Inbox::new(idem_core::TxEngine::new(store));
/// let webhooks = WebhookInbox::new(Verifier::new(["whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"]).unwrap(), inbox, "payments");
/// let now = 1_732_450_000;
/// match webhooks
///     .receive(&headers, &body, now, |tx| Box::pin(async move { Ok::<_, idem_core::Error>(()) }))
///     .await
/// {
///     Ok(delivery) => { /* 200, applied now or before */ }
///     Err(ReceiveError::Refused(e)) => { /* 400 or 401: nothing written */ }
///     Err(ReceiveError::Handler(e)) => { /* 5xx: the provider retries */ }
/// }
/// # }
/// ```
#[derive(Debug)]
pub struct WebhookInbox<B: TxBackend> {
    verifier: Verifier,
    inbox: Inbox<B>,
    handler: String,
}

impl<B: TxBackend> WebhookInbox<B> {
    /// Webhooks verified by `verifier` and applied by the inbox handler
    /// named `handler` (one per provider or webhook kind).
    pub fn new(verifier: Verifier, inbox: Inbox<B>, handler: impl Into<String>) -> Self {
        Self {
            verifier,
            inbox,
            handler: handler.into(),
        }
    }

    /// Verifies the headers and the raw body at `now_secs`.
    pub fn verify<'h>(&self, headers: &'h HeaderMap, body: &[u8], now_secs: i64) -> Result<Verified<'h>, WebhookError> {
        let webhook_id = self.verifier.verify_headers(headers, body, now_secs)?;
        Ok(Verified { webhook_id })
    }

    /// Applies a verified webhook once per `event_id` (the provider's event
    /// id, from the verified body or [`Verified::webhook_id`]): `work`'s
    /// writes, the claim and the recorded outcome commit together; a
    /// redelivery answers the recorded outcome without running `work`.
    pub async fn apply<T, E, F>(
        &self,
        _verified: &Verified<'_>,
        event_id: &str,
        body: &[u8],
        work: F,
    ) -> Result<Delivery<T>, E>
    where
        F: for<'c> FnMut(&'c mut B::Tx) -> BoxFuture<'c, Result<T, E>>,
        T: Serialize + DeserializeOwned,
        E: From<idem_core::Error> + Contention,
    {
        self.inbox.process(&self.handler, event_id, body, work).await
    }

    /// [`apply`](Self::apply) with the event id scoped to `tenant` (the
    /// account or customer the webhook is for): one tenant's event id never
    /// replays another tenant's outcome.
    pub async fn apply_for<T, E, F>(
        &self,
        tenant: &idem_core::Tenant,
        _verified: &Verified<'_>,
        event_id: &str,
        body: &[u8],
        work: F,
    ) -> Result<Delivery<T>, E>
    where
        F: for<'c> FnMut(&'c mut B::Tx) -> BoxFuture<'c, Result<T, E>>,
        T: Serialize + DeserializeOwned,
        E: From<idem_core::Error> + Contention,
    {
        self.inbox.process_in(tenant, &self.handler, event_id, body, work).await
    }

    /// Verifies, then applies once per `webhook-id`.
    pub async fn receive<T, E, F>(
        &self,
        headers: &HeaderMap,
        body: &[u8],
        now_secs: i64,
        work: F,
    ) -> Result<Delivery<T>, ReceiveError<E>>
    where
        F: for<'c> FnMut(&'c mut B::Tx) -> BoxFuture<'c, Result<T, E>>,
        T: Serialize + DeserializeOwned,
        E: From<idem_core::Error> + Contention,
    {
        let verified = self.verify(headers, body, now_secs).map_err(ReceiveError::Refused)?;
        let id = verified.webhook_id();
        self.apply(&verified, id, body, work)
            .await
            .map_err(ReceiveError::Handler)
    }
}
