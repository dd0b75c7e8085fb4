//! Once the attacks stop: every payout settled, every dead letter redriven
//! (asking the vendor first), and what the ledger, the dead letters and the
//! vendor hold read back for the judge.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use idem_core::{DeadLetterFilter, DeadLetterState, DeadLetterStore};
use tokio::sync::Mutex;

use super::judge::{PayoutRows, judge};
use super::{
    PayoutCounts, PayoutFaults, VENDOR_HORIZON_MARGIN_SECS, VENDOR_KEY_HORIZON_SECS, Vendor, VendorLedger, close,
};
use crate::Error;
use crate::db::Database;
use crate::workload::{Answer, Outcome};

/// Stops the vendor's faults, lets the workers settle every requested
/// payout, redrives every dead letter against the fault-free vendor, lets
/// the workers reconcile them, then checks; answers what it saw.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn settle_and_check(
    database: &Database,
    vendor: &Vendor,
    idem: &Path,
    api: &str,
    token: &str,
    outcome: &Outcome,
    within: Duration,
    faults: &Mutex<PayoutFaults>,
    violations: &mut Vec<String>,
) -> Result<PayoutCounts, Error> {
    let started = tokio::time::Instant::now();
    let deadline = started + within;
    let tenant = ledger::tenant_for_token(token).as_str().to_owned();
    // While it refuses connections this fails; the call after the wait
    // clears the faults.
    let _ = vendor.set(&fake_vendor::Faults::default()).await;
    vendor.wait_up(Duration::from_secs(30)).await?;
    vendor.set(&fake_vendor::Faults::default()).await?;

    // The workers pay (or dead-letter) every requested payout.
    while database.payouts(&tenant).await?.values().any(|(_, s)| s == "requested") {
        if tokio::time::Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }

    // The held outage's dead letter reached the vendor: once it is past the
    // vendor's key horizon, its redrive asks the vendor before sending.
    let outage_letter_seen_at = faults.lock().await.outage_letter_seen_at;
    if let Some(seen) = outage_letter_seen_at {
        tokio::time::sleep_until(seen + Duration::from_secs(VENDOR_KEY_HORIZON_SECS)).await;
    }

    // Every dead letter redriven, with its own key, until none is left.
    let store = ledger::Store::connect(&database.url, 4)
        .await
        .map_err(|e| Error::Service(format!("cannot open the ledger's store: {e}")))?;
    let letters = store.dead_letters();
    let client = idem_outbound::OutboundClient::new(idem_outbound::OutboundConfig {
        name: "chaos-redrive".into(),
        retry_delays: vec![
            Duration::from_millis(100),
            Duration::from_millis(300),
            Duration::from_secs(1),
        ],
        deadline: Duration::from_secs(20),
        attempt_timeout: Duration::from_secs(5),
        key_horizon: idem_outbound::KeyHorizon::new(
            Duration::from_secs(VENDOR_KEY_HORIZON_SECS),
            Duration::from_secs(VENDOR_HORIZON_MARGIN_SECS),
        ),
        ..Default::default()
    })
    .map_err(|e| Error::Service(format!("redrive client: {e}")))?;
    // The redrive asks the vendor first past its horizon, as the workers
    // do (letters held as unknown always), so nothing is paid twice.
    let lookup =
        ledger::payouts::VendorLookup::new(&vendor.url).map_err(|e| Error::Service(format!("vendor lookup: {e}")))?;
    let client = client.with_reconcile(Arc::new(lookup));
    let redriver =
        idem_outbound::Redriver::new(client, letters.clone()).with_answer_check(ledger::payouts::answer_check());
    let of_state = |state| DeadLetterFilter {
        tenant: Some(tenant.clone()),
        operation: Some(ledger::payouts::PAYOUT_OPERATION.to_owned()),
        state: Some(state),
        limit: idem_core::MAX_DEAD_LETTER_PAGE,
        ..Default::default()
    };
    // `idem dlq redrive` killed mid-send; no refund of what it paid.
    let redrive_kills = crate::dlqkill::run(
        &crate::dlqkill::Target {
            idem,
            store_url: &database.url,
            api,
            token,
            tenant: &tenant,
        },
        vendor,
        &letters,
        violations,
    )
    .await?;
    let held_unknown = letters
        .list(&of_state(DeadLetterState::Unknown))
        .await
        .map_err(|e| Error::Service(format!("dead letters: {e}")))?
        .len() as u64;
    let mut redriven = 0u64;
    for state in [
        DeadLetterState::Redriving,
        DeadLetterState::Unknown,
        DeadLetterState::Dead,
    ] {
        let selection = of_state(state);
        loop {
            let left = letters
                .list(&DeadLetterFilter {
                    limit: 1,
                    ..selection.clone()
                })
                .await
                .map_err(|e| Error::Service(format!("dead letters: {e}")))?;
            if left.is_empty() || tokio::time::Instant::now() > deadline {
                break;
            }
            let report = redriver
                .redrive(
                    &selection,
                    idem_outbound::RedriveOptions {
                        max: 1_000_000,
                        per_second: idem_outbound::MAX_REDRIVES_PER_SECOND,
                    },
                )
                .await
                .map_err(|e| Error::Service(format!("redrive: {e}")))?;
            redriven += u64::from(report.resolved);
        }
    }

    // The workers mark each resolved dead letter's payout paid.
    while database
        .payouts(&tenant)
        .await?
        .values()
        .any(|(_, s)| s == "dead_lettered" || s == "unknown")
    {
        if tokio::time::Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let settle_secs = started.elapsed().as_secs_f64();

    let mut rows = PayoutRows {
        payouts: database.payouts(&tenant).await?,
        dead_letters: Vec::new(),
    };
    let mut page = DeadLetterFilter {
        tenant: Some(tenant.clone()),
        operation: Some(ledger::payouts::PAYOUT_OPERATION.to_owned()),
        limit: idem_core::MAX_DEAD_LETTER_PAGE,
        ..Default::default()
    };
    loop {
        let got = letters
            .list(&page)
            .await
            .map_err(|e| Error::Service(format!("dead letters: {e}")))?;
        let Some(last) = got.last() else { break };
        page.after_id = Some(last.id);
        let full = got.len() as u32 == page.limit;
        rows.dead_letters
            .extend(got.into_iter().map(|l| (l.key.as_str().to_owned(), l.state)));
        if !full {
            break;
        }
    }
    drop((redriver, letters));
    close(&store).await;
    let at_vendor: VendorLedger = vendor.get_json("/v1/ledger").await?;
    let stats: serde_json::Value = vendor.get_json("/_stats").await?;
    if stats["mismatched"].as_u64().unwrap_or(0) != 0 {
        violations.push(format!(
            "payouts: the vendor saw a payout key reused with another body: {stats}"
        ));
    }
    {
        let mut f = faults.lock().await;
        f.vendor_dropped_after_paying = stats["dropped"].as_u64().unwrap_or(0);
        f.vendor_500s = stats["errors_500"].as_u64().unwrap_or(0);
        f.vendor_429s = stats["rate_limited"].as_u64().unwrap_or(0);
    }

    let mut counts = PayoutCounts::default();
    let mut acknowledged = Vec::new();
    for op in outcome.ops.iter().filter(|op| op.kind == "payout") {
        match op.answer {
            Answer::Applied => {
                counts.acknowledged += 1;
                let id = op
                    .bodies
                    .first()
                    .and_then(|b| serde_json::from_slice::<serde_json::Value>(b).ok())
                    .and_then(|v| v["id"].as_str().map(str::to_owned));
                match id {
                    Some(id) => acknowledged.push((id, op.amount)),
                    None => violations.push(format!("payout of {}: acknowledged without an id", op.amount)),
                }
            }
            Answer::Rejected => counts.rejected += 1,
            Answer::Unknown => counts.unknown += 1,
        }
    }
    judge(&rows, &at_vendor, &acknowledged, violations);
    counts.committed = rows.payouts.len() as u64;
    counts.paid = rows.payouts.values().filter(|(_, s)| s == "paid").count() as u64;
    counts.cancelled = rows.payouts.values().filter(|(_, s)| s == "cancelled").count() as u64;
    counts.dead_lettered = rows.dead_letters.len() as u64;
    counts.redriven = redriven;
    counts.vendor_payouts = at_vendor.payouts;
    counts.vendor_keys = at_vendor.keys.len() as u64;
    counts.vendor_total = at_vendor.total;
    counts.vendor_replays = stats["replayed"].as_u64().unwrap_or(0);
    counts.vendor_references = at_vendor.references.len() as u64;
    counts.vendor_keys_forgotten = stats["forgotten"].as_u64().unwrap_or(0);
    counts.vendor_lookups = stats["lookups"].as_u64().unwrap_or(0);
    counts.vendor_in_use = stats["in_use"].as_u64().unwrap_or(0);
    counts.held_unknown = held_unknown;
    counts.redrive_kills = redrive_kills;
    counts.settle_secs = settle_secs;
    Ok(counts)
}
