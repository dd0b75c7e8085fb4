//! The calls: a first send, a re-send knowing what earlier sends may have
//! done, one guarded by the caller, and the terms each is made under.

use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};

use idem_core::{IdempotencyKey, OutboundRequest, SentUnder};
use tracing::Instrument;

use super::drive::{CallState, drive};
use super::target::host_of;
use super::{Earlier, OutboundClient, OutboundResponse};
use crate::error::{OutboundError, Result};
use crate::reconcile::KeyHorizon;

impl OutboundClient {
    /// Sends `request` with `key` in the key header, retrying by the
    /// configuration until a success, a final rejection, or the end of the
    /// schedule or the deadline; every attempt carries the same key. A
    /// first send: nothing of this call can have reached the vendor before.
    pub async fn send(&self, key: &IdempotencyKey, request: &OutboundRequest) -> Result<OutboundResponse> {
        self.resend(key, request, Earlier::default()).await
    }

    /// Sends `request` again with `key`, knowing what `earlier` sends of the
    /// call may have done. While the first send that may have reached the
    /// vendor is within the target's key horizon, attempts are sent blindly
    /// (the vendor answers a key it remembers with its recorded result).
    /// Past it, for a vendor without keys, or with `must_reconcile`, the
    /// vendor is asked first through the reconcile hook: applied → its
    /// answer is returned (`reconciled`) and nothing is sent; not applied →
    /// sent; in flight → asked again after the next wait; unknown, or no
    /// hook → [`OutboundError::Unknown`], nothing sent. Within one call,
    /// each retry after an attempt that may have reached the vendor is
    /// judged the same way.
    pub async fn resend(
        &self,
        key: &IdempotencyKey,
        request: &OutboundRequest,
        earlier: Earlier,
    ) -> Result<OutboundResponse> {
        self.resend_while(key, request, earlier, &|| Ok(())).await
    }

    /// [`resend`](Self::resend), asking `may_send` right before each attempt
    /// (after any reconcile): `Err(reason)` ends the call at once with
    /// [`OutboundError::Stopped`], nothing more sent. A lease holder passes
    /// a check of its lease, so a holder that was paused past its lease
    /// (and whose call another holder has since taken over, asked about and
    /// sent) never sends again on its own, even to a vendor that has by then
    /// forgotten the key.
    pub async fn resend_while(
        &self,
        key: &IdempotencyKey,
        request: &OutboundRequest,
        earlier: Earlier,
        may_send: &(dyn Fn() -> std::result::Result<(), String> + Send + Sync),
    ) -> Result<OutboundResponse> {
        let prepared = self.prepare(key, request)?;
        let host: Arc<str> = host_of(prepared.url())?.into();
        let host_label = self.inner.labels.host(&host);
        let terms = self.terms_for(&host, earlier.sent_under);
        let horizon = KeyHorizon::new(terms.key_horizon, terms.horizon_margin);
        let span = tracing::info_span!(
            "outbound_call",
            key = %key,
            method = %request.method(),
            host = %host,
            attempts = tracing::field::Empty,
        );
        let state = Mutex::new(CallState {
            reached_at_ms: earlier.first_reached_at_ms,
            last_sent_at_ms: earlier.first_reached_at_ms.max(earlier.last_sent_at_ms),
            not_applied_at_ms: None,
        });
        let must_reconcile = AtomicBool::new(earlier.must_reconcile);
        async {
            let labels = &self.inner.labels;
            let result = drive(&self.inner.config, labels, &host_label, &state, |timeout| {
                self.step(
                    key,
                    request,
                    &prepared,
                    (&host, &host_label, horizon, terms.settle),
                    (&state, &must_reconcile, earlier.past_horizon_override, may_send),
                    timeout,
                )
            })
            .await;
            let (label, attempts) = match &result {
                Ok(r) if r.reconciled => ("reconciled", r.attempts),
                Ok(r) => ("success", r.attempts),
                Err(e @ OutboundError::Rejected { .. }) => ("rejected", e.attempts()),
                Err(e @ OutboundError::Unknown { .. }) => ("unknown", e.attempts()),
                Err(e @ OutboundError::Stopped { .. }) => ("stopped", e.attempts()),
                Err(e @ OutboundError::RetryLater { .. }) => ("retry_later", e.attempts()),
                Err(e) => ("exhausted", e.attempts()),
            };
            labels.call(&host_label, label);
            tracing::Span::current().record("attempts", attempts);
            match &result {
                Ok(r) => tracing::debug!(status = r.status, reconciled = r.reconciled, "outbound call succeeded"),
                Err(e) => tracing::warn!(error = %e, "outbound call failed"),
            }
            result.map_err(|e| e.sent_under_terms(terms))
        }
        .instrument(span)
        .await
    }

    /// The terms a send of `request` is made under (its target's key
    /// horizon and this client's settle time), to keep with a dead letter
    /// the caller writes itself.
    pub fn terms_of(&self, request: &OutboundRequest) -> SentUnder {
        let host = reqwest::Url::parse(request.url())
            .ok()
            .and_then(|url| host_of(&url).ok())
            .unwrap_or_default();
        self.terms_for(&host, None)
    }

    /// The terms a send to `host` is made under: the target's key horizon
    /// and this client's settle time, made strict by `earlier` terms.
    fn terms_for(&self, host: &str, earlier: Option<SentUnder>) -> SentUnder {
        let horizon = self.inner.config.horizon_of(host);
        let own = SentUnder {
            key_horizon: horizon.horizon,
            horizon_margin: horizon.margin,
            settle: self.inner.config.settle_after_send(),
        };
        earlier.map_or(own, |t| own.strictest(t))
    }
}
