//! Payouts under attack: a fake vendor of the harness's own (in this
//! process, on a free loopback port) that **forgets idempotency keys after
//! a short horizon** ([`VENDOR_KEY_HORIZON_SECS`]: the same request then
//! pays again), drops answers after paying, fails, rate-limits, slows down
//! and refuses connections; two `ledger payouts` worker processes killed
//! with `kill -9` and paused past their lease — and so past the vendor's
//! horizon — whose takeovers must ask the vendor (a lookup by reference)
//! instead of sending again; and, once all is quiet, every dead letter
//! redriven (asking the vendor first) and the set checks: each committed
//! payout paid exactly once at the vendor, none lost, nothing paid that no
//! transaction committed.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use idem_core::{DeadLetterFilter, DeadLetterState, DeadLetterStore};
use serde::Serialize;
use tokio::sync::Mutex;

use crate::Error;
use crate::db::Database;
use crate::progress::Progress;
use crate::rng::Rng;
use crate::service::Service;
use crate::workload::{Answer, Outcome};

/// The lease of a payout being paid, in seconds (short, so pauses and kills
/// hand payouts over within the run).
pub const LEASE_SECS: u64 = 3;
/// The payout workers' retry schedule (short, so dead letters happen within
/// the run).
const RETRY_DELAYS_MS: &str = "50,100,200,400";
/// How long the fake vendor remembers a key, in seconds: shorter than a
/// pause of a worker (twice its lease), so takeovers cross it.
pub const VENDOR_KEY_HORIZON_SECS: u64 = 3;
/// What the workers trust of it: a key younger than 3 − 1 seconds.
const VENDOR_HORIZON_MARGIN_SECS: u64 = 1;

/// Payout faults that really happened.
#[derive(Debug, Clone, Default, Serialize)]
pub struct PayoutFaults {
    /// Payout workers killed with `kill -9` (each is restarted).
    pub worker_kills: u64,
    /// Payout workers stopped (SIGSTOP) for at least twice their lease, then
    /// continued.
    pub worker_pauses_past_lease: u64,
    /// Payout worker restarts.
    pub worker_restarts: u64,
    /// Answers the vendor dropped after paying (`apply_then_drop`).
    pub vendor_dropped_after_paying: u64,
    /// Injected 500s (nothing paid).
    pub vendor_500s: u64,
    /// Injected 429s with `Retry-After` (nothing paid).
    pub vendor_429s: u64,
    /// Windows in which the vendor answered late (`slow_ms`).
    pub vendor_slow_windows: u64,
    /// Outages: windows in which the vendor refused new connections
    /// (`refuse_ms`) and answered 500 on kept-alive ones.
    pub vendor_refuse_windows: u64,
    /// Windows in which the vendor dropped every answer after paying, held
    /// until a dropped payment was replayed (one per run, at a sixth of
    /// the workload).
    pub vendor_held_drop_windows: u64,
    /// Outages in which the vendor answered every call 500, held until a
    /// payout called in it was dead-lettered (one per run, at a third of
    /// the workload).
    pub vendor_held_outages: u64,
    /// When the held outage saw its dead letter: the final redrive waits
    /// until that letter is past the vendor's key horizon, so it asks the
    /// vendor before sending.
    #[serde(skip)]
    pub(crate) outage_letter_seen_at: Option<tokio::time::Instant>,
}

/// What the payout checks saw.
#[derive(Debug, Clone, Default, Serialize)]
pub struct PayoutCounts {
    /// Payout requests the workload got a 201 for.
    pub acknowledged: u64,
    /// Payout requests declined (422 insufficient funds).
    pub rejected: u64,
    /// Payout requests without a definite answer.
    pub unknown: u64,
    /// Payouts the ledger committed (rows of `ledger_payouts`).
    pub committed: u64,
    /// Committed payouts `paid` at the end.
    pub paid: u64,
    /// Payouts dead-lettered during the run (dead letters recorded).
    pub dead_lettered: u64,
    /// Dead letters the final redrive resolved.
    pub redriven: u64,
    /// Payouts the vendor made (its `payouts` count).
    pub vendor_payouts: u64,
    /// Distinct keys the vendor paid.
    pub vendor_keys: u64,
    /// The vendor's total.
    pub vendor_total: u64,
    /// Answers the vendor replayed for a key it had paid.
    pub vendor_replays: u64,
    /// Distinct payout references the vendor paid.
    pub vendor_references: u64,
    /// Keys the vendor had forgotten when they came again (each such send
    /// would pay again: with the fix, none comes).
    pub vendor_keys_forgotten: u64,
    /// Lookups by reference the vendor answered (reconciles before a
    /// re-send past its horizon).
    pub vendor_lookups: u64,
    /// 409 `idempotency_key_in_use` answers (a re-send overtaking a slow
    /// first call).
    pub vendor_in_use: u64,
    /// Payouts whose outcome was held as unknown at some point (dead
    /// letters in state `unknown` before the final redrive).
    pub held_unknown: u64,
    /// Payouts cancelled (their amount refunded): only ever ones the vendor
    /// never paid.
    pub cancelled: u64,
    /// `idem dlq redrive` killed mid-send, and the cancels that followed.
    pub redrive_kills: crate::dlqkill::RedriveKills,
    /// Seconds from the end of the faults until every payout was settled,
    /// redriven and reconciled.
    pub settle_secs: f64,
}

/// The harness's fake vendor, served in this process.
pub(crate) struct Vendor {
    /// Its base URL.
    pub(crate) url: String,
    http: reqwest::Client,
    stop: std::sync::Mutex<Option<tokio::sync::oneshot::Sender<()>>>,
    /// Whether a window of [`attack_vendor`]'s is held: while it is, the
    /// other attacks leave the vendor's faults alone.
    held: Mutex<bool>,
    /// The vendor itself (what it is working on right now).
    pub(crate) inner: Arc<fake_vendor::Vendor>,
}

/// The vendor's own ledger (`GET /v1/ledger`).
#[derive(Debug, Clone, Default, serde::Deserialize)]
pub(crate) struct VendorLedger {
    pub(crate) payouts: u64,
    pub(crate) total: u64,
    pub(crate) keys: Vec<String>,
    /// The distinct references it paid (a reference paid twice shows as
    /// fewer references than payouts, even under another key).
    #[serde(default)]
    pub(crate) references: Vec<String>,
}

impl Vendor {
    pub(crate) async fn start(port: u16) -> Result<Arc<Self>, Error> {
        quiet_dropped_answers();
        let addr: std::net::SocketAddr = ([127, 0, 0, 1], port).into();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let vendor = Arc::new(fake_vendor::Vendor::new(fake_vendor::Options {
            key_horizon: Duration::from_secs(VENDOR_KEY_HORIZON_SECS),
            idempotency: true,
        }));
        let inner = vendor.clone();
        tokio::spawn(async move {
            let shutdown = async move {
                let _ = stopped.await;
            };
            if let Err(e) = fake_vendor::serve(addr, vendor, shutdown).await {
                eprintln!("chaos: the fake vendor stopped: {e}");
            }
        });
        let me = Arc::new(Self {
            url: format!("http://{addr}"),
            http: ledger::http_builder().timeout(Duration::from_secs(10)).build()?,
            stop: std::sync::Mutex::new(Some(stop)),
            held: Mutex::new(false),
            inner,
        });
        me.wait_up(Duration::from_secs(20)).await?;
        Ok(me)
    }

    /// Waits until the vendor accepts connections (after a refusal window).
    async fn wait_up(&self, within: Duration) -> Result<(), Error> {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            if let Ok(r) = self.http.get(format!("{}/_stats", self.url)).send().await
                && r.status().is_success()
            {
                return Ok(());
            }
            if tokio::time::Instant::now() > deadline {
                return Err(Error::Service(format!(
                    "the fake vendor at {} does not answer",
                    self.url
                )));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Sets the vendor's faults.
    pub(crate) async fn set(&self, faults: &fake_vendor::Faults) -> Result<(), Error> {
        let r = self
            .http
            .put(format!("{}/_faults", self.url))
            .header("content-type", "application/json")
            .body(serde_json::to_vec(faults).map_err(|e| Error::Service(e.to_string()))?)
            .send()
            .await?;
        if !r.status().is_success() {
            return Err(Error::Service(format!("the vendor refused faults: {}", r.status())));
        }
        Ok(())
    }

    /// Sets the vendor's faults unless a window is held; answers whether
    /// it did.
    async fn change(&self, faults: &fake_vendor::Faults) -> Result<bool, Error> {
        let held = self.held.lock().await;
        if *held {
            return Ok(false);
        }
        self.set(faults).await?;
        Ok(true)
    }

    /// Sets faults that only [`Vendor::release`] changes.
    async fn hold(&self, faults: &fake_vendor::Faults) -> Result<(), Error> {
        let mut held = self.held.lock().await;
        self.set(faults).await?;
        *held = true;
        Ok(())
    }

    /// Sets faults that the other attacks may change again.
    async fn release(&self, faults: &fake_vendor::Faults) -> Result<(), Error> {
        let mut held = self.held.lock().await;
        self.set(faults).await?;
        *held = false;
        Ok(())
    }

    pub(crate) async fn get_json<T: serde::de::DeserializeOwned>(&self, path: &str) -> Result<T, Error> {
        let bytes = self
            .http
            .get(format!("{}{path}", self.url))
            .send()
            .await?
            .error_for_status()?
            .bytes()
            .await?;
        serde_json::from_slice(&bytes).map_err(|e| Error::Service(format!("vendor {path}: {e}")))
    }

    pub(crate) fn stop(&self) {
        if let Some(stop) = self.stop.lock().ok().and_then(|mut s| s.take()) {
            let _ = stop.send(());
        }
    }
}

/// The vendor's `apply_then_drop` fault ends its connection's task with a
/// panic on purpose: keep those out of the output (every other panic is
/// reported as before).
fn quiet_dropped_answers() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let payload = info.payload();
            let message = payload
                .downcast_ref::<&str>()
                .copied()
                .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
                .unwrap_or("");
            if !message.starts_with("fake vendor:") {
                previous(info);
            }
        }));
    });
}

/// Starts two `ledger payouts` processes against `vendor_url`.
pub(crate) async fn start_workers(
    bin: &Path,
    database_url: &str,
    vendor_url: &str,
    log: &Path,
    env: &[(String, String)],
) -> Result<Vec<Arc<Service>>, Error> {
    let mut workers = Vec::new();
    for i in 0..2 {
        workers.push(
            Service::start_worker(
                bin,
                database_url,
                vec![
                    "payouts".into(),
                    "--vendor-url".into(),
                    vendor_url.into(),
                    "--payout-lease-secs".into(),
                    LEASE_SECS.to_string(),
                    "--payout-retry-delays-ms".into(),
                    RETRY_DELAYS_MS.into(),
                    "--payout-deadline-secs".into(),
                    "10".into(),
                    "--payout-concurrency".into(),
                    "8".into(),
                    "--vendor-key-horizon-secs".into(),
                    VENDOR_KEY_HORIZON_SECS.to_string(),
                    "--vendor-horizon-margin-secs".into(),
                    VENDOR_HORIZON_MARGIN_SECS.to_string(),
                ],
                env.to_vec(),
                log.with_extension(format!("payouts{i}.log")),
            )
            .await?,
        );
    }
    Ok(workers)
}

/// Kills a payout worker every 0.8–2.5 s and, every 6–12 s, stops one for
/// twice its lease or more, until `calm`. Each stop comes half a second into
/// a window of slow vendor answers, so the stopped worker most likely holds
/// payouts mid-call: the other worker takes them over once the lease runs
/// out and pays them with the same key (the vendor replays). Every run has
/// at least one kill and one stop: the first of each is made even if the
/// workload ended before it.
pub(crate) async fn attack_workers(
    workers: Vec<Arc<Service>>,
    vendor: Arc<Vendor>,
    calm: Arc<AtomicBool>,
    mut rng: Rng,
    faults: Arc<Mutex<PayoutFaults>>,
) {
    let paused: Arc<Vec<AtomicBool>> = Arc::new(workers.iter().map(|_| AtomicBool::new(false)).collect());
    let pauses = {
        let (workers, calm, paused, faults, mut rng) = (
            workers.clone(),
            calm.clone(),
            paused.clone(),
            faults.clone(),
            rng.fork(1),
        );
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(rng.range(1_000, 3_000))).await;
            let (mut made, mut tries_past_calm) = (0u64, 0u32);
            while !calm.load(Ordering::SeqCst) || (made == 0 && tries_past_calm < 50) {
                tries_past_calm += u32::from(calm.load(Ordering::SeqCst));
                let i = rng.range(0, workers.len() as u64) as usize;
                let d = Duration::from_millis(LEASE_SECS * 2_000 + rng.range(0, 1_000));
                let slow = fake_vendor::Faults {
                    slow_ms: rng.range(1_000, 2_000),
                    ..BASE_FAULTS
                };
                // During a held window the vendor's faults stay as they are.
                if let Ok(true) = vendor.change(&slow).await {
                    faults.lock().await.vendor_slow_windows += 1;
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
                paused[i].store(true, Ordering::SeqCst);
                let stopped = workers[i].pause(d).await;
                paused[i].store(false, Ordering::SeqCst);
                if !stopped {
                    // Between a kill and its restart there is no process to
                    // stop: try again.
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
                faults.lock().await.worker_pauses_past_lease += 1;
                made += 1;
                tokio::time::sleep(Duration::from_millis(rng.range(6_000, 12_000))).await;
            }
        })
    };
    // Past `calm`, a bounded number of tries (a worker that cannot be
    // started again does not hold the run up).
    let (mut killed, mut tries_past_calm) = (0u64, 0u32);
    let go_on = |killed: u64, tries: u32| !calm.load(Ordering::SeqCst) || (killed == 0 && tries < 50);
    while go_on(killed, tries_past_calm) {
        tokio::time::sleep(Duration::from_millis(rng.range(800, 2_500))).await;
        tries_past_calm += u32::from(calm.load(Ordering::SeqCst));
        if !go_on(killed, tries_past_calm) {
            break;
        }
        let i = rng.range(0, workers.len() as u64) as usize;
        // A stopped worker is left stopped: its pause must outlast its lease.
        if !paused[i].load(Ordering::SeqCst) && workers[i].kill() {
            faults.lock().await.worker_kills += 1;
            killed += 1;
        }
    }
    let _ = pauses.await;
}

/// The vendor's faults throughout the run.
const BASE_FAULTS: fake_vendor::Faults = fake_vendor::Faults {
    apply_then_drop: 0.1,
    error_500: 0.1,
    rate_limit_429: 0.05,
    retry_after_secs: 1,
    slow_ms: 0,
    refuse_ms: 0,
};

/// Where in the workload the held windows open (fractions of its
/// operations): first every answer dropped after paying, then an outage.
const DROP_WINDOW_AT: f64 = 1.0 / 6.0;
const OUTAGE_WINDOW_AT: f64 = 1.0 / 3.0;

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
/// are dead-lettered, and their circuit breaker opens for a while).
///
/// The faults whose effects the run promises are not left to chance: at a
/// sixth of the workload every answer is dropped after paying until one
/// dropped payment was replayed, and at a third every call is answered 500
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

/// Answers every call 500 until a payout called in this outage has been
/// dead-lettered after reaching the vendor (the workers' retries run out
/// within a second), or `calm`.
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
        error_500: 1.0,
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
    while !calm.load(Ordering::SeqCst) {
        if reached_letters(&letters, &windows.tenant)
            .await
            .is_ok_and(|n| n > before)
        {
            faults.lock().await.outage_letter_seen_at = Some(tokio::time::Instant::now());
            break;
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

/// Closes the store's connections now, not at the pool's idle timeout: no
/// session of the harness outlives the run's database.
async fn close(store: &ledger::Store) {
    let closed = async {
        match store {
            ledger::Store::Postgres(s) => s.pool().close().await,
            ledger::Store::MySql(s) => s.pool().close().await,
            ledger::Store::Sqlite(s) => s.pool().close().await,
        }
    };
    if tokio::time::timeout(Duration::from_secs(10), closed).await.is_err() {
        eprintln!("chaos: the payout checks' connections did not close within 10 s");
    }
}

/// The payout rows read back.
#[derive(Debug, Clone, Default)]
pub(crate) struct PayoutRows {
    /// Per payout id: its amount and state.
    pub(crate) payouts: BTreeMap<String, (i64, String)>,
    /// Per dead letter of a payout: its key (the payout id) and state.
    pub(crate) dead_letters: Vec<(String, DeadLetterState)>,
}

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

/// The payout properties over what was read back: every committed payout
/// paid, none requested or left dead-lettered (every dead letter was
/// redriven); the vendor's keys exactly the paid payouts' ids, each paid
/// once, for the paid amounts; every acknowledged payout committed with its
/// amount; every dead letter of a committed payout, and resolved.
pub(crate) fn judge(
    rows: &PayoutRows,
    vendor: &VendorLedger,
    acknowledged: &[(String, i64)],
    violations: &mut Vec<String>,
) {
    let committed: BTreeSet<&str> = rows.payouts.keys().map(String::as_str).collect();
    let paid: BTreeSet<&str> = rows
        .payouts
        .iter()
        .filter(|(_, (_, s))| s == "paid")
        .map(|(id, _)| id.as_str())
        .collect();
    let keys: BTreeSet<&str> = vendor.keys.iter().map(String::as_str).collect();

    let mut by_state: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for (id, (_, state)) in &rows.payouts {
        match state.as_str() {
            "paid" => {}
            // A cancel refunds the amount: right only if the vendor never paid.
            "cancelled" if keys.contains(id.as_str()) => violations.push(format!(
                "payouts: payout {id} was cancelled (its amount refunded) but the vendor paid it"
            )),
            "cancelled" => {}
            _ => by_state.entry(state.as_str()).or_default().push(id.as_str()),
        }
    }
    for (state, ids) in &by_state {
        violations.push(format!(
            "payouts: {} committed payout(s) lost: left {state} after the redrive, e.g. {:?}",
            ids.len(),
            &ids[..ids.len().min(5)]
        ));
    }
    let unpaid: Vec<_> = paid.difference(&keys).collect();
    if !unpaid.is_empty() {
        violations.push(format!(
            "payouts: {} payout(s) marked paid that the vendor never paid, e.g. {:?}",
            unpaid.len(),
            &unpaid[..unpaid.len().min(5)]
        ));
    }
    let phantom: Vec<_> = keys.difference(&committed).collect();
    if !phantom.is_empty() {
        violations.push(format!(
            "payouts: the vendor paid {} key(s) of no committed payout, e.g. {:?}",
            phantom.len(),
            &phantom[..phantom.len().min(5)]
        ));
    }
    let not_marked: Vec<_> = keys.intersection(&committed).filter(|k| !paid.contains(*k)).collect();
    if !not_marked.is_empty() {
        violations.push(format!(
            "payouts: the vendor paid {} payout(s) the ledger does not record as paid, e.g. {:?}",
            not_marked.len(),
            &not_marked[..not_marked.len().min(5)]
        ));
    }
    if vendor.payouts != vendor.keys.len() as u64 {
        violations.push(format!(
            "payouts: the vendor paid {} time(s) for {} distinct key(s): a payout paid twice",
            vendor.payouts,
            vendor.keys.len()
        ));
    }
    // A key the vendor forgot pays again under the same key; a reference
    // paid twice is caught whatever the key.
    if vendor.payouts != vendor.references.len() as u64 {
        violations.push(format!(
            "payouts: the vendor paid {} time(s) for {} distinct reference(s): a payout paid twice",
            vendor.payouts,
            vendor.references.len()
        ));
    }
    let paid_total: i128 = rows
        .payouts
        .values()
        .filter(|(_, s)| s == "paid")
        .map(|(amount, _)| i128::from(*amount))
        .sum();
    if i128::from(vendor.total) != paid_total {
        violations.push(format!(
            "payouts: the vendor paid {} in total but the paid payouts sum to {paid_total}",
            vendor.total
        ));
    }
    for (id, amount) in acknowledged {
        match rows.payouts.get(id) {
            None => violations.push(format!(
                "payouts: acknowledged payout {id} ({amount}) was never committed"
            )),
            Some((stored, _)) if stored != amount => violations.push(format!(
                "payouts: acknowledged payout {id} of {amount} is stored with {stored}"
            )),
            Some(_) => {}
        }
    }
    for (key, state) in &rows.dead_letters {
        if !committed.contains(key.as_str()) {
            violations.push(format!("payouts: a dead letter of no committed payout ({key})"));
        }
        if !matches!(state, DeadLetterState::Resolved | DeadLetterState::Cancelled) {
            violations.push(format!(
                "payouts: the dead letter of payout {key} is left {}",
                state.as_str()
            ));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows() -> PayoutRows {
        PayoutRows {
            payouts: [
                ("a".to_owned(), (10, "paid".to_owned())),
                ("b".to_owned(), (20, "paid".to_owned())),
            ]
            .into_iter()
            .collect(),
            dead_letters: vec![("b".to_owned(), DeadLetterState::Resolved)],
        }
    }

    fn vendor(payouts: u64, total: u64, keys: &[&str]) -> VendorLedger {
        VendorLedger {
            payouts,
            total,
            keys: keys.iter().map(|k| (*k).to_owned()).collect(),
            references: keys.iter().map(|k| (*k).to_owned()).collect(),
        }
    }

    fn acked() -> Vec<(String, i64)> {
        vec![("a".to_owned(), 10)]
    }

    /// The checker passes a clean history and fails each kind of violation:
    /// a payout paid twice, a lost payout, a payout of no committed
    /// transaction, a wrong amount.
    #[test]
    fn the_payout_checker_can_fail() {
        let mut v = Vec::new();
        judge(&rows(), &vendor(2, 30, &["a", "b"]), &acked(), &mut v);
        assert!(v.is_empty(), "a clean history: {v:?}");

        let with_state = |id: &str, state: &str| {
            let mut r = rows();
            r.payouts.get_mut(id).unwrap().1 = state.to_owned();
            r
        };
        // A payout the vendor never paid may be cancelled (refunded).
        let mut v = Vec::new();
        judge(&with_state("b", "cancelled"), &vendor(1, 10, &["a"]), &acked(), &mut v);
        assert!(v.is_empty(), "a cancelled unpaid payout: {v:?}");

        type Case = (&'static str, PayoutRows, VendorLedger, Vec<(String, i64)>);
        let cases: Vec<Case> = vec![
            // One key paid twice (a vendor without deduplication).
            ("paid twice", rows(), vendor(3, 50, &["a", "b"]), acked()),
            // A reference paid twice under two keys.
            (
                "distinct reference(s)",
                rows(),
                VendorLedger {
                    references: vec!["a".into()],
                    ..vendor(2, 30, &["a", "b"])
                },
                acked(),
            ),
            // A second payment under another key: a key of no payout.
            (
                "of no committed payout",
                rows(),
                vendor(3, 40, &["a", "b", "x"]),
                acked(),
            ),
            ("sum to 30", rows(), vendor(3, 40, &["a", "b", "x"]), acked()),
            // Lost: never paid, left requested or dead-lettered.
            (
                "left requested",
                with_state("b", "requested"),
                vendor(1, 10, &["a"]),
                acked(),
            ),
            (
                "left dead_lettered",
                with_state("b", "dead_lettered"),
                vendor(1, 10, &["a"]),
                acked(),
            ),
            ("the vendor never paid", rows(), vendor(1, 10, &["a"]), acked()),
            // Refunded although the vendor paid it.
            (
                "but the vendor paid it",
                with_state("b", "cancelled"),
                vendor(2, 30, &["a", "b"]),
                acked(),
            ),
            // Paid at the vendor but not recorded as paid.
            (
                "does not record as paid",
                with_state("b", "dead_lettered"),
                vendor(2, 30, &["a", "b"]),
                acked(),
            ),
            // Acknowledged, then gone or changed.
            (
                "never committed",
                rows(),
                vendor(2, 30, &["a", "b"]),
                vec![("z".to_owned(), 5)],
            ),
            (
                "is stored with",
                rows(),
                vendor(2, 30, &["a", "b"]),
                vec![("a".to_owned(), 11)],
            ),
            (
                "is left dead",
                PayoutRows {
                    dead_letters: vec![("b".to_owned(), DeadLetterState::Dead)],
                    ..rows()
                },
                vendor(2, 30, &["a", "b"]),
                acked(),
            ),
            (
                "a dead letter of no committed payout",
                PayoutRows {
                    dead_letters: vec![("q".to_owned(), DeadLetterState::Resolved)],
                    ..rows()
                },
                vendor(2, 30, &["a", "b"]),
                acked(),
            ),
        ];
        for (expected, rows, vendor, acked) in cases {
            let mut v = Vec::new();
            judge(&rows, &vendor, &acked, &mut v);
            assert!(v.iter().any(|m| m.contains(expected)), "{expected}: {v:?}");
        }
    }
}
