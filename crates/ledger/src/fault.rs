//! Fault injection for the reliability harness (feature `fault-injection`).
//!
//! Environment:
//! - `LEDGER_FAULTS=after_claim=0.01,before_commit=0.01,after_commit=0.01`:
//!   the probability of stopping at each named point of idem's HTTP layer.
//!   At a chosen point the process prints `IDEM_FAULT point=<name>` on
//!   stderr and freezes, so the harness can `kill -9` it exactly there (it
//!   aborts by itself after 30 s if nobody does).
//! - `LEDGER_STEP_FAULTS=debit:after_step_commit=1,payout:after_answer=0.5`:
//!   the probability of stopping at each named point of a withdrawal's
//!   steps (`idem_steps::fault`): a local step written and not committed
//!   (`before_step_commit`), a step recorded (`after_step_commit`), an
//!   external step marked sent and not sent (`after_sent_mark`), answered
//!   and not recorded (`after_answer`). The process prints
//!   `IDEM_FAULT point=<point> step=<step>` on stderr and freezes, as above.
//! - `LEDGER_BREAK_RECOVERY_POINTS=1`: a withdrawal taken over forgets its
//!   journal and its sent mark and runs from its first step, so the harness
//!   can prove its checker sees the double debits and bookings recovery
//!   points prevent.
//! - `LEDGER_FAULT_SEED=<u64>`: seeds the choice.
//! - `LEDGER_BREAK_IDEMPOTENCY=1`: switches the idempotency claim off, so the
//!   harness can prove its checker sees double applications.
//! - `LEDGER_PROJECTION_PANIC=<p>`: the statement projection's handler
//!   panics with probability `p` per run (seeded by `LEDGER_FAULT_SEED`
//!   mixed with the process id and start time, so each restarted projector
//!   draws its own rolls),
//!   and its deliveries are bounded at 2, 100 ms apart, so panics become
//!   dead letters the harness redrives.

use std::io::Write;
use std::sync::Mutex;
use std::time::Duration;

use idem_http::fault::{self, Point};
use idem_steps::fault::Point as StepPoint;

/// A small deterministic generator (SplitMix64).
struct SplitMix(u64);

impl SplitMix {
    fn next_f64(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64
    }

    /// The next roll of `rng`: 1.0 (never below any odds) if a holder of
    /// the lock panicked.
    fn roll(rng: &Mutex<SplitMix>) -> f64 {
        rng.lock().map(|mut r| r.next_f64()).unwrap_or(1.0)
    }
}

/// `LEDGER_FAULT_SEED`, 0 when unset or unreadable.
fn fault_seed() -> u64 {
    std::env::var("LEDGER_FAULT_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

/// One `<at>=<p>` entry of a list of fault odds.
struct Entry<'a> {
    /// The entry as written.
    part: &'a str,
    /// Where: the text before `=`.
    at: &'a str,
    /// The probability, in [0, 1].
    p: f64,
}

/// The entries of the comma-separated `spec` of the variable `var`, each
/// read when its turn comes.
fn entries<'a>(var: &'a str, spec: &'a str) -> impl Iterator<Item = Result<Entry<'a>, String>> {
    spec.split(',').filter(|p| !p.trim().is_empty()).map(move |part| {
        let (at, p) = part
            .split_once('=')
            .ok_or_else(|| format!("bad {var} entry {part:?}"))?;
        let p: f64 = p.trim().parse().map_err(|_| format!("bad probability in {part:?}"))?;
        if !(0.0..=1.0).contains(&p) {
            return Err(format!("probability out of range in {part:?}"));
        }
        Ok(Entry { part, at, p })
    })
}

/// Prints `IDEM_FAULT <at>` on stderr and freezes here until the harness
/// kills the process with SIGKILL (it aborts by itself after 30 s).
fn stop_here(at: std::fmt::Arguments<'_>) -> ! {
    let mut err = std::io::stderr().lock();
    let _ = writeln!(err, "IDEM_FAULT {at}");
    let _ = err.flush();
    drop(err);
    std::thread::sleep(Duration::from_secs(30));
    std::process::abort();
}

/// The local steps of a withdrawal (forward and compensating).
const LOCAL_STEPS: [&str; 3] = ["debit", "settle", "credit-back"];
/// Its external steps.
const EXTERNAL_STEPS: [&str; 3] = ["fx-quote", "payout", "release-quote"];

/// Whether `LEDGER_STEP_FAULTS` may name `point` of `step`: a local step
/// written and not committed (`before_step_commit`) or committed
/// (`after_step_commit`); an external step marked sent and not sent
/// (`after_sent_mark`), answered and not recorded (`after_answer`), or
/// recorded (`after_step_commit`).
fn is_step_point(step: &str, point: StepPoint) -> bool {
    match point {
        StepPoint::BeforeStepCommit => LOCAL_STEPS.contains(&step),
        StepPoint::AfterStepCommit => LOCAL_STEPS.contains(&step) || EXTERNAL_STEPS.contains(&step),
        StepPoint::AfterSentMark | StepPoint::AfterAnswer => EXTERNAL_STEPS.contains(&step),
    }
}

/// The odds of stopping at each point of each step.
type StepOdds = Vec<((String, StepPoint), f64)>;

/// Parses `LEDGER_STEP_FAULTS` (see the module).
fn step_odds(spec: &str) -> Result<StepOdds, String> {
    let mut odds = Vec::new();
    for entry in entries("LEDGER_STEP_FAULTS", spec) {
        let Entry { part, at, p } = entry?;
        let (step, point) = at
            .trim()
            .split_once(':')
            .ok_or_else(|| format!("LEDGER_STEP_FAULTS entry {part:?} is not <step>:<point>=<p>"))?;
        match StepPoint::parse(point) {
            Some(pt) if is_step_point(step, pt) => odds.push(((step.to_owned(), pt), p)),
            _ => return Err(format!("unknown step fault point {step}:{point}")),
        }
    }
    Ok(odds)
}

/// Arms the engine's fault points with `odds`: at a chosen one the process
/// prints `IDEM_FAULT point=<point> step=<step>` and freezes until the
/// harness kills it (it aborts by itself after 30 s).
fn arm_steps(odds: StepOdds, seed: u64) {
    let rng = Mutex::new(SplitMix(seed ^ 0x57E9));
    idem_steps::fault::set_hook(move |point, step| {
        let Some(p) = odds
            .iter()
            .find(|((s, pt), _)| s == step && *pt == point)
            .map(|(_, p)| *p)
        else {
            return;
        };
        if SplitMix::roll(&rng) < p {
            stop_here(format_args!("point={} step={step}", point.name()));
        }
    });
}

/// Reads the environment and installs the hook and the switch.
pub fn install_from_env() -> Result<(), String> {
    if std::env::var("LEDGER_BREAK_RECOVERY_POINTS").is_ok_and(|v| v == "1") {
        idem_steps::fault::set_skip_recovery_points(true);
        tracing::warn!("LEDGER_BREAK_RECOVERY_POINTS=1: a withdrawal taken over runs from its first step");
    }
    if let Ok(spec) = std::env::var("LEDGER_STEP_FAULTS") {
        let odds = step_odds(&spec)?;
        let seed = fault_seed();
        arm_steps(odds, seed);
        tracing::warn!(faults = %spec, seed, "step fault points armed");
    }
    if std::env::var("LEDGER_BREAK_IDEMPOTENCY").is_ok_and(|v| v == "1") {
        fault::set_bypass(true);
        tracing::warn!("LEDGER_BREAK_IDEMPOTENCY=1: the idempotency claim is switched off");
    }
    let Ok(spec) = std::env::var("LEDGER_FAULTS") else {
        return Ok(());
    };
    let mut odds = [0.0f64; 3];
    for entry in entries("LEDGER_FAULTS", &spec) {
        let Entry { at: name, p, .. } = entry?;
        let i = Point::ALL
            .iter()
            .position(|pt| pt.name() == name.trim())
            .ok_or_else(|| format!("unknown fault point {name:?}"))?;
        odds[i] = p;
    }
    let seed = fault_seed();
    let rng = Mutex::new(SplitMix(seed));
    fault::set_hook(move |point| {
        let i = Point::ALL.iter().position(|p| *p == point).unwrap_or(0);
        if SplitMix::roll(&rng) < odds[i] {
            stop_here(format_args!("point={}", point.name()));
        }
    });
    tracing::warn!(faults = %spec, seed, "fault points armed");
    Ok(())
}

/// The projection's panic odds and their generator, read once.
fn projection_odds() -> &'static Option<(f64, Mutex<SplitMix>)> {
    static ODDS: std::sync::OnceLock<Option<(f64, Mutex<SplitMix>)>> = std::sync::OnceLock::new();
    ODDS.get_or_init(|| {
        let p: f64 = std::env::var("LEDGER_PROJECTION_PANIC").ok()?.trim().parse().ok()?;
        let seed = fault_seed();
        // Every process draws its own rolls: projectors are killed and
        // restarted often, and processes that all replayed the seed's first
        // rolls would see the same few panics (or none) in every life.
        let own = u64::from(std::process::id()).rotate_left(32)
            ^ std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64);
        (0.0..=1.0)
            .contains(&p)
            .then(|| (p, Mutex::new(SplitMix(seed ^ 0x5EED ^ own))))
    })
}

/// Shortens the projection's delivery schedule when panics are injected.
pub fn projection_options(options: &mut idem_jetstream::ConsumerOptions) {
    if projection_odds().is_some() {
        options.max_deliveries = 2;
        options.retry_delays = vec![Duration::from_millis(100)];
    }
}

/// Panics, with the configured odds, in the projection's handler.
pub fn projection_panic() {
    if let Some((p, rng)) = projection_odds()
        && SplitMix::roll(rng) < *p
    {
        panic!("injected projection panic");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Step faults name known points only, with probabilities in [0, 1].
    #[test]
    fn step_faults_name_known_points() {
        let odds = step_odds("debit:before_step_commit=1, payout:after_answer=0.5").unwrap();
        assert_eq!(odds.len(), 2);
        assert_eq!(odds[1], (("payout".to_owned(), StepPoint::AfterAnswer), 0.5));
        for bad in [
            "debit=1",
            "debit:after_answer=1",
            "debit:after_sent_mark=1",
            "payout:before_step_commit=1",
            "nope:after_step_commit=1",
            "debit:after_step_commit=2",
            "debit:after_commit=1",
            "x",
        ] {
            assert!(step_odds(bad).is_err(), "{bad}");
        }
    }
}
