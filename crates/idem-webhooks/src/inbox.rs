//! Verification plus deduplication: a verified webhook applied once per
//! event id, in one transaction with the handler's writes.

use http::HeaderMap;
use idem_core::{BoxFuture, Contention, Tenant, TxBackend};
use idem_inbox::{Delivery, Inbox};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::{Verifier, WebhookError};

/// A webhook whose signature and timestamp were verified, with everything
/// it is applied under: the tenant it is for, the verified body and the
/// event id it is deduplicated on. Only [`WebhookInbox::verify`] makes one,
/// and [`WebhookInbox::apply`] takes nothing else, so a body or an event id
/// other than the verified ones cannot be applied.
#[derive(Debug)]
pub struct Verified<'a> {
    tenant: Tenant,
    webhook_id: &'a str,
    event_id: String,
    body: &'a [u8],
}

impl<'a> Verified<'a> {
    /// The `webhook-id` header: the same on each of the provider's retries.
    pub fn webhook_id(&self) -> &'a str {
        self.webhook_id
    }

    /// The tenant the webhook is applied for.
    pub fn tenant(&self) -> &Tenant {
        &self.tenant
    }

    /// The event id it is deduplicated on: the `webhook-id`, unless
    /// [`keyed_by`](Self::keyed_by) read another from the body.
    pub fn event_id(&self) -> &str {
        &self.event_id
    }

    /// The verified raw body.
    pub fn body(&self) -> &'a [u8] {
        self.body
    }

    /// Deduplicates on the provider's event id as `read` finds it in the
    /// verified body (for providers whose `webhook-id` changes across
    /// retries of one event), instead of on the `webhook-id`.
    pub fn keyed_by<E>(self, read: impl FnOnce(&[u8]) -> Result<String, E>) -> Result<Self, E> {
        let event_id = read(self.body)?;
        Ok(Self { event_id, ..self })
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
/// per (tenant, event id) through an [`Inbox`] (give its store a table of
/// its own, apart from request keys). Every webhook is verified for a
/// tenant — the account or customer it is for, or one fixed tenant in a
/// single-tenant service — and its event id is scoped to that tenant before
/// it is looked up, so two tenants' webhooks with the same id are two
/// events.
///
/// ```no_run
/// # async fn demo(store: idem_sqlite::SqliteStore, headers: http::HeaderMap, body: Vec<u8>) {
/// use idem_webhooks::{ReceiveError, Verifier, WebhookInbox};
/// let inbox = idem_inbox::Inbox::new(idem_core::TxEngine::new(store));
/// let webhooks = WebhookInbox::new(Verifier::new(["whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"]).unwrap(), inbox, "payments");
/// let tenant = idem_core::Tenant::new("acme").unwrap();
/// let now = 1_732_450_000;
/// match webhooks
///     .receive(&tenant, &headers, &body, now, |tx| Box::pin(async move { Ok::<_, idem_core::Error>(()) }))
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

    /// Verifies the headers and the raw body at `now_secs`, for `tenant`.
    pub fn verify<'a>(
        &self,
        tenant: &Tenant,
        headers: &'a HeaderMap,
        body: &'a [u8],
        now_secs: i64,
    ) -> Result<Verified<'a>, WebhookError> {
        let webhook_id = self.verifier.verify_headers(headers, body, now_secs)?;
        Ok(Verified {
            tenant: tenant.clone(),
            webhook_id,
            event_id: webhook_id.to_owned(),
            body,
        })
    }

    /// Applies a verified webhook once per (tenant, event id): `work`'s
    /// writes, the claim and the recorded outcome commit together; a
    /// redelivery answers the recorded outcome without running `work`, and
    /// the same event id with another body is [`idem_core::Error::Mismatch`].
    pub async fn apply<T, E, F>(&self, verified: &Verified<'_>, work: F) -> Result<Delivery<T>, E>
    where
        F: for<'c> FnMut(&'c mut B::Tx) -> BoxFuture<'c, Result<T, E>>,
        T: Serialize + DeserializeOwned,
        E: From<idem_core::Error> + Contention,
    {
        let call = self
            .inbox
            .call_in(&verified.tenant, &self.handler, &verified.event_id, verified.body)?;
        self.inbox.process_call(&call, work).await
    }

    /// Verifies for `tenant`, then applies once per (tenant, `webhook-id`).
    pub async fn receive<T, E, F>(
        &self,
        tenant: &Tenant,
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
        let verified = self
            .verify(tenant, headers, body, now_secs)
            .map_err(ReceiveError::Refused)?;
        self.apply(&verified, work).await.map_err(ReceiveError::Handler)
    }
}
