//! The attacks on the vendor: its faults changed every few seconds, outages
//! longer than the workers' retries, and the two windows held until their
//! effect is seen (answers dropped after paying, an outage that
//! dead-letters a payout).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use idem_core::{DeadLetterFilter, DeadLetterStore};
use tokio::sync::Mutex;

use super::{PayoutFaults, Vendor, close};
use crate::Error;
use crate::progress::Progress;
use crate::rng::Rng;

/// The vendor's faults throughout the run.
pub(super) const BASE_FAULTS: fake_vendor::Faults = fake_vendor::Faults {
    apply_then_drop: 0.1,
    error_500: 0.1,
    rate_limit_429: 0.05,
    retry_after_secs: 1,
    slow_ms: 0,
    refuse_ms: 0,
    lookup_error_500: 0.0,
};

/// Where in the workload the held windows open (fractions of its
/// operations): first every answer dropped after paying, then an outage.
const DROP_WINDOW_AT: f64 = 1.0 / 6.0;
const OUTAGE_WINDOW_AT: f64 = 1.0 / 3.0;

/// How long past `calm` the held outage still waits for its dead letter: past
/// a breaker's open period (30 s), so a call deferred by a breaker opened just
/// before the outage comes back and is throttled to a dead letter.
const OUTAGE_PAST_CALM: Duration = Duration::from_secs(45);

/// What the held windows of [`attack_vendor`] need: the workload's
/// progress (they open at fixed fractions of it), and the ledger's database
/// and tenant (the outage is held until they show a dead letter).
pub(crate) struct HeldWindows {
    pub(crate) progress: Arc<Progress>,
    pub(crate) database_url: String,
    pub(crate) tenant: String,
}

/// Changes the vendor's faults every 1–3 s until `calm`: answers dropped
/// after paying (10 %), 500s (10 %), 429s with `Retry-After: 1` (5 %),
/// often a window of slow answers, and 3–6 s in then every 60–120 s an
/// outage longer than the workers' retries: new connections refused for
/// 1.5–3 s, and every request answered 500 until 1–3 s later (their calls
/// are dead-lettered, or deferred once a worker's circuit breaker opens).
///
/// The faults whose effects the run promises are not left to chance: at a
/// sixth of the workload every answer is dropped after paying until one
/// dropped payment was replayed, and at a third every call is throttled
/// until a payout called in that outage was dead-lettered. Outages are held:
/// no other attack changes the vendor's faults while one is on.
pub(crate) async fn attack_vendor(
    vendor: Arc<Vendor>,
    calm: Arc<AtomicBool>,
    mut rng: Rng,
    faults: Arc<Mutex<PayoutFaults>>,
    windows: HeldWindows,
) {
    let base = BASE_FAULTS;
    if let Err(e) = vendor.release(&base).await {
        eprintln!("chaos: {e}");
    }
    let (mut dropped_held, mut outage_held) = (false, false);
    let mut next_refusal = tokio::time::Instant::now() + Duration::from_millis(rng.range(3_000, 6_000));
    while !calm.load(Ordering::SeqCst) {
        let next_change = tokio::time::Instant::now() + Duration::from_millis(rng.range(1_000, 3_000));
        while tokio::time::Instant::now() < next_change && !calm.load(Ordering::SeqCst) {
            if !dropped_held && windows.progress.reached(DROP_WINDOW_AT) {
                dropped_held = true;
                hold_drop_window(&vendor, &calm, &faults).await;
            }
            if !outage_held && windows.progress.reached(OUTAGE_WINDOW_AT) {
                outage_held = true;
                hold_outage(&vendor, &calm, &faults, &windows).await;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        if calm.load(Ordering::SeqCst) {
            break;
        }
        let mut f = base.clone();
        let slow = rng.chance(0.3);
        if slow {
            f.slow_ms = rng.range(200, 1_500);
        }
        let refuse = tokio::time::Instant::now() >= next_refusal;
        let set = if refuse {
            // New connections are refused; the workers' kept-alive ones
            // get 500s, until well past their retries.
            f.refuse_ms = rng.range(1_500, 3_000);
            f.error_500 = 1.0;
            next_refusal = tokio::time::Instant::now() + Duration::from_millis(rng.range(60_000, 120_000));
            vendor.hold(&f).await
        } else {
            vendor.release(&f).await
        };
        match set {
            Ok(()) => {
                let mut c = faults.lock().await;
                c.vendor_slow_windows += u64::from(slow);
                c.vendor_refuse_windows += u64::from(refuse);
            }
            Err(e) => eprintln!("chaos: {e}"),
        }
        if refuse {
            tokio::time::sleep(Duration::from_millis(f.refuse_ms)).await;
        }
    }
}

/// Holds `faults`, trying again until the vendor takes them (it may be
/// refusing connections); answers false if `calm` came first.
async fn hold_until_set(vendor: &Vendor, faults: &fake_vendor::Faults, calm: &AtomicBool) -> bool {
    loop {
        match vendor.hold(faults).await {
            Ok(()) => return true,
            Err(e) if calm.load(Ordering::SeqCst) => {
                eprintln!("chaos: a held window was not opened: {e}");
                return false;
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

/// Drops every answer after paying until the vendor has dropped one more
/// and replayed one more payment (the worker's retry with the same key),
/// or `calm`.
async fn hold_drop_window(vendor: &Vendor, calm: &AtomicBool, faults: &Mutex<PayoutFaults>) {
    let dropping = fake_vendor::Faults {
        apply_then_drop: 1.0,
        ..Default::default()
    };
    if !hold_until_set(vendor, &dropping, calm).await {
        return;
    }
    faults.lock().await.vendor_held_drop_windows += 1;
    let counts = |stats: &serde_json::Value| {
        (
            stats["dropped"].as_u64().unwrap_or(0),
            stats["replayed"].as_u64().unwrap_or(0),
        )
    };
    let mut before = None;
    while !calm.load(Ordering::SeqCst) {
        if let Ok(stats) = vendor.get_json::<serde_json::Value>("/_stats").await {
            let (dropped, replayed) = counts(&stats);
            match before {
                None => before = Some((dropped, replayed)),
                Some((d, r)) if dropped > d && replayed > r => break,
                Some(_) => {}
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    if let Err(e) = vendor.release(&BASE_FAULTS).await {
        eprintln!("chaos: {e}");
    }
}

/// Throttles every call (429 with `Retry-After: 0`) until a payout called in
/// this outage has been dead-lettered after reaching the vendor: the
/// workers' retries run out within a second. A 429 is neutral for the
/// workers' circuit breakers, so the letter comes by construction; 500s
/// would open them, and a call refused by an open breaker is deferred, never
/// dead-lettered. The outage is held past `calm` until the letter comes (a
/// breaker opened before it lets a call through within its open period),
/// but at most [`OUTAGE_PAST_CALM`].
async fn hold_outage(vendor: &Vendor, calm: &AtomicBool, faults: &Mutex<PayoutFaults>, windows: &HeldWindows) {
    let store = match ledger::Store::connect(&windows.database_url, 2).await {
        Ok(store) => store,
        Err(e) => {
            eprintln!("chaos: the outage cannot watch the ledger's store: {e}");
            return;
        }
    };
    let letters = store.dead_letters();
    let failing = fake_vendor::Faults {
        apply_then_drop: 0.0,
        error_500: 0.0,
        rate_limit_429: 1.0,
        retry_after_secs: 0,
        ..BASE_FAULTS
    };
    if !hold_until_set(vendor, &failing, calm).await {
        close(&store).await;
        return;
    }
    faults.lock().await.vendor_held_outages += 1;
    let before = loop {
        match reached_letters(&letters, &windows.tenant).await {
            Ok(n) => break n,
            // Database sessions are killed now and then: ask again.
            Err(_) if !calm.load(Ordering::SeqCst) => tokio::time::sleep(Duration::from_millis(100)).await,
            Err(e) => {
                eprintln!("chaos: {e}");
                break u64::MAX;
            }
        }
    };
    let mut calm_since = None;
    loop {
        if reached_letters(&letters, &windows.tenant)
            .await
            .is_ok_and(|n| n > before)
        {
            faults.lock().await.outage_letter_seen_at = Some(tokio::time::Instant::now());
            break;
        }
        if calm.load(Ordering::SeqCst) {
            let since = *calm_since.get_or_insert_with(tokio::time::Instant::now);
            if since.elapsed() >= OUTAGE_PAST_CALM {
                eprintln!("chaos: the held outage saw no dead letter");
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    if let Err(e) = vendor.release(&BASE_FAULTS).await {
        eprintln!("chaos: {e}");
    }
    drop(letters);
    close(&store).await;
}

/// The tenant's payout dead letters whose call reached the vendor.
async fn reached_letters(letters: &ledger::DeadLetters, tenant: &str) -> Result<u64, Error> {
    let mut page = DeadLetterFilter {
        tenant: Some(tenant.to_owned()),
        operation: Some(ledger::payouts::PAYOUT_OPERATION.to_owned()),
        limit: idem_core::MAX_DEAD_LETTER_PAGE,
        ..Default::default()
    };
    let mut reached = 0;
    loop {
        let got = letters
            .list(&page)
            .await
            .map_err(|e| Error::Service(format!("dead letters: {e}")))?;
        reached += got.iter().filter(|l| l.first_reached_at_ms.is_some()).count() as u64;
        let Some(last) = got.last() else { break };
        page.after_id = Some(last.id);
        if (got.len() as u32) < page.limit {
            break;
        }
    }
    Ok(reached)
}
