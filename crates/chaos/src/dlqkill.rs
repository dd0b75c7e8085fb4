//! `idem dlq redrive` killed mid-send, and the refund that must then never
//! happen.
//!
//! Once the workload is quiet, the harness takes dead-lettered payouts the
//! vendor has no payment for (those no send of which reached it first, then
//! those it answered without paying) and does what an operator would: records the vendor's "not applied"
//! (`idem dlq resolve --not-applied`), which would let the service cancel
//! the payout and refund its amount. Then, for up to two of them, it starts
//! `idem dlq redrive --id N` against a slow vendor and kills it (SIGKILL)
//! once the vendor is working on its send: the vendor pays, the redrive
//! never records it. The service must now refuse to cancel the payout
//! (`POST /v1/payouts/{id}/cancel` answers 409), because the redrive's take
//! marked a send that may have reached the vendor; the final redrive then
//! settles it as paid. One more such payout, not redriven, is cancelled as
//! the control: the same request succeeds when nothing was sent, so the
//! refusal above is the mark's doing.

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use idem_core::{DeadLetterFilter, DeadLetterState, DeadLetterStore};
use serde::Serialize;

use crate::Error;
use crate::payouts::{VENDOR_KEY_HORIZON_SECS, Vendor, VendorLedger};

/// How long a killed redrive holds its letter (`--hold-secs`).
pub(crate) const HOLD_SECS: u64 = 3;

/// What the phase did.
#[derive(Debug, Clone, Default, Serialize)]
pub struct RedriveKills {
    /// `idem dlq redrive` processes killed (SIGKILL) while the vendor
    /// worked on their send.
    pub killed: u64,
    /// Of those, sends the vendor paid after the kill.
    pub paid_after_kill: u64,
    /// Cancels (refunds) of those payouts the service refused.
    pub cancels_refused: u64,
    /// Cancels of a payout nothing was sent for (the control), made.
    pub control_cancels: u64,
}

/// Where the phase works.
pub(crate) struct Target<'a> {
    pub(crate) idem: &'a Path,
    pub(crate) store_url: &'a str,
    pub(crate) api: &'a str,
    pub(crate) token: &'a str,
    pub(crate) tenant: &'a str,
}

/// Runs the phase on `letters` (the ledger's dead letters); answers what
/// it did. A cancel the service made of a payout the vendor paid is a
/// violation.
pub(crate) async fn run(
    target: &Target<'_>,
    vendor: &Vendor,
    letters: &ledger::DeadLetters,
    violations: &mut Vec<String>,
) -> Result<RedriveKills, Error> {
    let mut done = RedriveKills::default();
    let paid: VendorLedger = vendor.get_json("/v1/ledger").await?;
    let paid: BTreeSet<String> = paid.keys.into_iter().collect();
    let (unreached, reached): (Vec<_>, Vec<_>) = letters
        .list(&DeadLetterFilter {
            tenant: Some(target.tenant.to_owned()),
            operation: Some(ledger::payouts::PAYOUT_OPERATION.to_owned()),
            state: Some(DeadLetterState::Dead),
            limit: idem_core::MAX_DEAD_LETTER_PAGE,
            ..Default::default()
        })
        .await
        .map_err(|e| Error::Service(format!("dead letters: {e}")))?
        .into_iter()
        .filter(|l| !paid.contains(l.key.as_str()))
        .partition(|l| l.first_reached_at_ms.is_none());
    // Letters no send of which reached the vendor first; then those whose
    // sends it answered without paying (a 500), all but one: the final
    // redrive must still find a reached letter to look up past the
    // vendor's horizon.
    let spare = reached.len().saturating_sub(1);
    let candidates: Vec<(i64, String)> = unreached
        .into_iter()
        .chain(reached.into_iter().take(spare))
        .map(|l| (l.id, l.key.as_str().to_owned()))
        .take(3)
        .collect();
    let http = ledger::http_builder().timeout(Duration::from_secs(10)).build()?;
    // With two or more, the last is the control.
    let control = candidates.get(1).and(candidates.last()).cloned();
    let killed = &candidates[..candidates.len() - usize::from(control.is_some())];
    for (id, payout) in killed {
        resolve_not_applied(target, *id).await?;
        if !killed_mid_send(target, vendor, *id).await? {
            continue;
        }
        done.killed += 1;
        let vendor_paid = wait_paid(vendor, payout).await?;
        done.paid_after_kill += u64::from(vendor_paid);
        vendor.set(&fake_vendor::Faults::default()).await?;
        if cancel(&http, target, payout).await? {
            if vendor_paid {
                violations.push(format!(
                    "payouts: payout {payout} was cancelled (its amount refunded) after a killed redrive's send paid it"
                ));
            }
        } else {
            done.cancels_refused += 1;
        }
    }
    if let Some((id, payout)) = control {
        // Nothing sent since the verdict: it cancels.
        resolve_not_applied(target, id).await?;
        if cancel(&http, target, &payout).await? {
            done.control_cancels += 1;
        }
    }
    if done.killed > 0 {
        // The killed redrives' holds run out; the final redrive takes them.
        tokio::time::sleep(Duration::from_secs(HOLD_SECS) + Duration::from_millis(500)).await;
    }
    Ok(done)
}

/// `idem dlq resolve --not-applied`, as an operator who checked the vendor.
async fn resolve_not_applied(target: &Target<'_>, id: i64) -> Result<(), Error> {
    let out = tokio::process::Command::new(target.idem)
        .args(["dlq", "resolve", "--store", target.store_url, "--id", &id.to_string()])
        .args([
            "--not-applied",
            "--note",
            "chaos: the vendor has no payment for this key",
        ])
        .stdin(Stdio::null())
        .output()
        .await?;
    if !out.status.success() {
        return Err(Error::Service(format!(
            "idem dlq resolve --id {id}: {}",
            String::from_utf8_lossy(&out.stderr)
        )));
    }
    Ok(())
}

/// Starts `idem dlq redrive --id` against a slow vendor and kills it once
/// the vendor works on its send; answers whether it got that far.
async fn killed_mid_send(target: &Target<'_>, vendor: &Vendor, id: i64) -> Result<bool, Error> {
    vendor
        .set(&fake_vendor::Faults {
            slow_ms: 1_500,
            ..fake_vendor::Faults::default()
        })
        .await?;
    let mut redrive = tokio::process::Command::new(target.idem)
        .args(["dlq", "redrive", "--store", target.store_url, "--id", &id.to_string()])
        .args(["--key-horizon-secs", &VENDOR_KEY_HORIZON_SECS.to_string()])
        .args(["--horizon-margin-secs", "1", "--deadline-secs", &HOLD_SECS.to_string()])
        .args(["--hold-secs", &HOLD_SECS.to_string()])
        .args([
            "--answer-field",
            "id",
            "--answer-echo",
            "amount",
            "--answer-echo",
            "reference",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let mut reached = false;
    while tokio::time::Instant::now() < deadline {
        if vendor.inner.in_process() > 0 {
            reached = true;
            break;
        }
        if redrive.try_wait()?.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let _ = redrive.start_kill();
    let _ = redrive.wait().await;
    if !reached {
        vendor.set(&fake_vendor::Faults::default()).await?;
        eprintln!("chaos: the redrive of dead letter {id} ended before its send reached the vendor");
    }
    Ok(reached)
}

/// Waits (a few seconds at most) until the vendor has paid `payout`.
async fn wait_paid(vendor: &Vendor, payout: &str) -> Result<bool, Error> {
    for _ in 0..100 {
        let ledger: VendorLedger = vendor.get_json("/v1/ledger").await?;
        if ledger.keys.iter().any(|k| k == payout) {
            return Ok(true);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(false)
}

/// `POST /v1/payouts/{id}/cancel` with one key, retried while the service
/// fails (its store fails on purpose too); answers whether it cancelled.
async fn cancel(http: &reqwest::Client, target: &Target<'_>, payout: &str) -> Result<bool, Error> {
    let key = uuid::Uuid::now_v7().to_string();
    for _ in 0..50 {
        let sent = http
            .post(format!("{}/v1/payouts/{payout}/cancel", target.api))
            .bearer_auth(target.token)
            .header("idempotency-key", &key)
            .send()
            .await;
        match sent {
            Ok(r) if r.status().is_success() => return Ok(true),
            Ok(r) if r.status().is_client_error() => {
                // The key still in flight (a try cut short): ask again.
                // Any other refusal is final.
                let body = r.text().await.unwrap_or_default();
                if !body.contains("idempotency-key-in-flight") {
                    return Ok(false);
                }
            }
            // The service or its store failed: the same key again.
            _ => {}
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Err(Error::Service(format!(
        "cancelling payout {payout}: no answer after 50 tries"
    )))
}
