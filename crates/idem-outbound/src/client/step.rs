//! One step of a call: the reconcile its state asks for (a re-send past the
//! vendor's key horizon, or an outcome held as unknown), the caller's guard,
//! then one attempt.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use idem_core::{IdempotencyKey, OutboundRequest};
use reqwest::header::HeaderMap;

use super::drive::CallState;
use super::failure::Failure;
use super::{OutboundClient, OutboundResponse};
use crate::error::Result;
use crate::reconcile::{KeyHorizon, Reconciled};

impl OutboundClient {
    /// One step of a call: the reconcile its state asks for, then (unless
    /// that settled it) one attempt; records in `state` whether the attempt
    /// may have reached the vendor.
    pub(super) async fn step(
        &self,
        key: &IdempotencyKey,
        request: &OutboundRequest,
        prepared: &reqwest::Request,
        (host, host_label, horizon, settle): (&Arc<str>, &str, KeyHorizon, Duration),
        (state, must_reconcile, past_horizon_override, may_send): (
            &Mutex<CallState>,
            &AtomicBool,
            bool,
            &(dyn Fn() -> std::result::Result<(), String> + Send + Sync),
        ),
        timeout: Duration,
    ) -> Result<OutboundResponse, Failure> {
        let now = self.inner.clock.now_ms();
        let reached = state.lock().unwrap_or_else(PoisonError::into_inner).reached_at_ms;
        let forced = must_reconcile.load(Ordering::SeqCst);
        let remembered = reached.is_some_and(|at| horizon.remembers(at, now));
        let ask = (forced || (reached.is_some() && !remembered)) && !past_horizon_override;
        if ask {
            let labels = &self.inner.labels;
            let Some(hook) = &self.inner.reconcile else {
                labels.reconcile("held");
                return Err(Failure::Held(match (forced, reached) {
                    (true, _) => {
                        "its outcome is held as unknown, and there is no reconcile hook to ask the vendor".into()
                    }
                    (false, Some(at)) => format!(
                        "a send that may have reached the vendor started {} s ago, past the vendor's key horizon \
                         ({} s less a margin of {} s), and there is no reconcile hook to ask the vendor",
                        now.saturating_sub(at) / 1000,
                        horizon.horizon.as_secs(),
                        horizon.margin.as_secs()
                    ),
                    (false, None) => "no reconcile hook".into(),
                }));
            };
            match tokio::time::timeout(timeout, hook.reconcile(key, request, timeout)).await {
                Err(_) => {
                    labels.reconcile("error");
                    return Err(Failure::ReconcileFailed(format!(
                        "no answer within {} ms",
                        timeout.as_millis()
                    )));
                }
                Ok(Err(e)) => {
                    labels.reconcile("error");
                    return Err(Failure::ReconcileFailed(e));
                }
                Ok(Ok(Reconciled::Applied { status, body })) => {
                    labels.reconcile("applied");
                    tracing::info!(key = %key, "the vendor had applied it: its record stands, nothing is sent");
                    return Ok(OutboundResponse {
                        status,
                        headers: HeaderMap::new(),
                        body,
                        body_truncated: false,
                        attempts: 0,
                        reconciled: true,
                    });
                }
                Ok(Ok(Reconciled::InFlight)) => {
                    labels.reconcile("in_flight");
                    return Err(Failure::VendorBusy);
                }
                Ok(Ok(Reconciled::Unknown(why))) => {
                    labels.reconcile("unknown");
                    return Err(Failure::Held(format!(
                        "the vendor cannot say whether it applied it: {why}"
                    )));
                }
                Ok(Ok(Reconciled::NotApplied)) => {
                    // A vendor may still be working on a send whose caller gave
                    // up (an attempt that timed out), and its lookup says "not
                    // found" until it commits: the answer is trusted only once
                    // the last send has settled (by default its attempt
                    // timeout and a margin after it started).
                    let last_sent = state.lock().unwrap_or_else(PoisonError::into_inner).last_sent_at_ms;
                    let settle_ms = i64::try_from(settle.as_millis()).unwrap_or(i64::MAX);
                    if last_sent.is_some_and(|at| now < at.saturating_add(settle_ms)) {
                        labels.reconcile("not_settled");
                        tracing::info!(
                            key = %key,
                            "the vendor has no record of it yet, but its last send may still be in flight; asking again later"
                        );
                        return Err(Failure::VendorBusy);
                    }
                    labels.reconcile("not_applied");
                    must_reconcile.store(false, Ordering::SeqCst);
                    let mut s = state.lock().unwrap_or_else(PoisonError::into_inner);
                    s.reached_at_ms = None;
                    s.not_applied_at_ms = Some(now);
                }
            }
        }
        // Asked last, right before the send: a reconcile may have taken a
        // while.
        if let Err(reason) = may_send() {
            self.inner.labels.attempt(host_label, "stopped");
            return Err(Failure::Stopped(reason));
        }
        let started = self.inner.clock.now_ms();
        let result = self.attempt(prepared, host, host_label, timeout).await;
        if let Err(failure) = &result
            && failure.may_have_reached()
        {
            let mut s = state.lock().unwrap_or_else(PoisonError::into_inner);
            s.reached_at_ms.get_or_insert(started);
            s.last_sent_at_ms = Some(s.last_sent_at_ms.map_or(started, |at| at.max(started)));
            s.not_applied_at_ms = None;
        }
        result
    }
}
