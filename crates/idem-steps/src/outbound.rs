//! External steps sent through the outbound client (feature `outbound`).

use idem_core::{OutboundRequest, TxBackend};
use idem_outbound::{Earlier, OutboundClient, OutboundError};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::{Halt, Run, StepError};

/// What the other side answered an external step sent through the
/// outbound client.
#[derive(Debug, Clone, Copy)]
pub enum Answer<'a> {
    /// It applied the request: a success status and its body (or, after an
    /// operator's verdict, the answer the operator gave).
    Applied {
        /// The status.
        status: u16,
        /// The body.
        body: &'a [u8],
    },
    /// It answered with a final refusal (a 4xx other than the ones worth
    /// retrying).
    Rejected {
        /// The status.
        status: u16,
        /// The body.
        body: &'a [u8],
    },
}

impl<B: TxBackend> Run<'_, B> {
    /// Runs the external step `name` as `request` sent through `client`
    /// (see [`Run::external`]: marked sent first, one derived key for every
    /// send). An earlier send that may have reached the other side is
    /// passed on to the client, which sends again blindly only while the
    /// vendor still remembers the key, and asks its reconcile hook past
    /// that (or at once, for a vendor without keys). `decide` turns the
    /// answer into the step's output or a declared failure. What the
    /// client cannot establish holds the operation; what it asks to be
    /// called again for later defers it.
    pub async fn outbound<T, D>(
        &mut self,
        name: &str,
        client: &OutboundClient,
        request: &OutboundRequest,
        decide: D,
    ) -> Result<T, Halt>
    where
        T: Serialize + DeserializeOwned + Send,
        D: FnOnce(Answer<'_>) -> Result<T, StepError>,
    {
        let terms = client.terms_of(request);
        self.external_under(name, Some(terms), client.reconciles(), |s| async move {
            if let Some(v) = &s.verdict
                && let Some(status) = v.status
            {
                return decide(Answer::Applied { status, body: &v.body });
            }
            let earlier = Earlier {
                first_reached_at_ms: s.earlier.as_ref().map(|o| o.first_sent_at_ms),
                last_sent_at_ms: s.earlier.as_ref().map(|o| o.last_sent_at_ms),
                sent_under: s.earlier.as_ref().and_then(|o| o.sent_under),
                ..Earlier::default()
            };
            // Each attempt starts only while the run holds the operation.
            let may_send = || s.may_send();
            match client.resend_while(&s.key, request, earlier, &may_send).await {
                Ok(r) => decide(Answer::Applied {
                    status: r.status,
                    body: &r.body,
                }),
                Err(OutboundError::Rejected { status, body, .. }) => decide(Answer::Rejected { status, body: &body }),
                Err(OutboundError::RetryLater { after, last_error, .. }) => Err(StepError::Retry {
                    why: last_error,
                    after_ms: i64::try_from(after.as_millis()).unwrap_or(i64::MAX),
                }),
                // The retries ran out: the next run sends again with the
                // same key, knowing (from the operation's sent mark) that an
                // earlier send may have arrived.
                Err(e @ (OutboundError::Exhausted { .. } | OutboundError::Stopped { .. })) => Err(StepError::Retry {
                    why: e.to_string(),
                    after_ms: 1_000,
                }),
                Err(OutboundError::Unknown { reason, .. }) => Err(StepError::Unknown(reason)),
                Err(e) => Err(StepError::Fatal(e.to_string())),
            }
        })
        .await
    }
}
