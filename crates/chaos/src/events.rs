//! The events under attack: a NATS server of the harness's own (its own
//! port and store directory) restarted with `kill -9`, relay and projection
//! processes killed at random, and the set checks once all is quiet.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use serde::Serialize;
use tokio::process::{Child, Command};
use tokio::sync::Mutex;

use crate::Error;
use crate::db::Database;
use crate::rng::Rng;
use crate::service::Service;

/// The odds that one run of the projection's handler panics.
const PROJECTION_PANIC: &str = "0.12";

/// Event faults that really happened.
#[derive(Debug, Clone, Default, Serialize)]
pub struct EventFaults {
    /// NATS server restarts (`kill -9`, then started again on its store).
    pub broker_restarts: u64,
    /// Relay processes killed.
    pub relay_kills: u64,
    /// Projection processes killed.
    pub projector_kills: u64,
}

/// What the event checks saw.
#[derive(Debug, Clone, Default, Serialize)]
pub struct EventCounts {
    /// Events committed (rows of the outbox).
    pub committed: u64,
    /// Distinct events in the stream.
    pub published: u64,
    /// Messages in the stream (copies included).
    pub stream_messages: u64,
    /// Applications to the projection.
    pub applied: u64,
    /// Dead letters left at the end (after the redrives).
    pub dead_letters: u64,
    /// Dead letters redriven while waiting (an event may be dead-lettered,
    /// and redriven, more than once).
    pub redriven: u64,
    /// Of those, letters kept because the handler panicked.
    pub redriven_after_panics: u64,
    /// Seconds from the end of the faults until everything was published and applied.
    pub settle_secs: f64,
}

/// The harness's NATS server.
pub(crate) struct Nats {
    bin: String,
    port: u16,
    dir: PathBuf,
    child: Mutex<Option<Child>>,
    /// Restarts.
    pub(crate) restarts: AtomicU64,
}

impl Nats {
    /// Starts `nats-server` with JetStream on `port`, storing in `dir`.
    pub(crate) async fn start(bin: &str, port: u16, dir: &Path) -> Result<Arc<Self>, Error> {
        std::fs::create_dir_all(dir)?;
        let nats = Arc::new(Self {
            bin: bin.to_owned(),
            port,
            dir: dir.to_owned(),
            child: Mutex::new(None),
            restarts: AtomicU64::new(0),
        });
        nats.spawn().await?;
        Ok(nats)
    }

    /// The client URL.
    pub(crate) fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    async fn spawn(&self) -> Result<(), Error> {
        let child = Command::new(&self.bin)
            .args(["-a", "127.0.0.1", "-p", &self.port.to_string(), "-js", "-sd"])
            .arg(&self.dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| Error::Service(format!("cannot start {} (install nats-server): {e}", self.bin)))?;
        *self.child.lock().await = Some(child);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        while tokio::net::TcpStream::connect(("127.0.0.1", self.port)).await.is_err() {
            if tokio::time::Instant::now() > deadline {
                return Err(Error::Service(format!("nats-server did not listen on {}", self.port)));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(())
    }

    /// `kill -9`, a pause, and a start on the same store.
    pub(crate) async fn restart(&self, down: Duration) -> Result<(), Error> {
        if let Some(mut child) = self.child.lock().await.take() {
            let _ = child.start_kill();
            let _ = child.wait().await;
        }
        tokio::time::sleep(down).await;
        self.spawn().await?;
        self.restarts.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }

    /// Stops the server and removes its store.
    pub(crate) async fn stop(&self) {
        if let Some(mut child) = self.child.lock().await.take() {
            let _ = child.start_kill();
            let _ = child.wait().await;
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Relay and projection processes, supervised.
pub(crate) struct Workers {
    pub(crate) relays: Vec<Arc<Service>>,
    pub(crate) projectors: Vec<Arc<Service>>,
}

impl Workers {
    /// Starts two relays and two projectors, relay `i` on the database at
    /// `relay_urls[i]`, projector `i` on `projector_urls[i]` (one database
    /// seen through the nodes of a cluster, or the same URL).
    pub(crate) async fn start(
        bin: &Path,
        relay_urls: [&str; 2],
        projector_urls: [&str; 2],
        nats: &str,
        log: &Path,
    ) -> Result<Self, Error> {
        let mut relays = Vec::new();
        let mut projectors = Vec::new();
        for i in 0..2 {
            relays.push(
                Service::start_worker(
                    bin,
                    relay_urls[i],
                    vec!["relay".into(), "--nats-url".into(), nats.into()],
                    Vec::new(),
                    log.with_extension(format!("relay{i}.log")),
                )
                .await?,
            );
            projectors.push(
                Service::start_worker(
                    bin,
                    projector_urls[i],
                    vec![
                        "project".into(),
                        "--nats-url".into(),
                        nats.into(),
                        "--projection-ack-wait-secs".into(),
                        "5".into(),
                    ],
                    // The handler panics now and then: with two deliveries
                    // allowed, some events become dead letters, redriven
                    // while the checker waits.
                    vec![("LEDGER_PROJECTION_PANIC".into(), PROJECTION_PANIC.into())],
                    log.with_extension(format!("project{i}.log")),
                )
                .await?,
            );
        }
        Ok(Self { relays, projectors })
    }

    pub(crate) async fn stop(&self) {
        for w in self.relays.iter().chain(&self.projectors) {
            w.stop().await;
        }
    }
}

/// Kills a relay or a projector every so often, and restarts the broker,
/// until `calm`. Every run has at least one relay kill, one projector kill
/// and one broker restart: past `calm`, the attack goes on with what has
/// not happened yet until each has.
pub(crate) async fn attack(
    workers: Arc<Workers>,
    nats: Arc<Nats>,
    calm: Arc<AtomicBool>,
    mut rng: Rng,
    faults: Arc<Mutex<EventFaults>>,
) {
    let mut next_broker_restart = tokio::time::Instant::now() + Duration::from_millis(rng.range(2_000, 4_000));
    let (mut relay_killed, mut projector_killed, mut restarted) = (false, false, false);
    // Past `calm`, a bounded number of tries (a broker that cannot be
    // restarted does not hold the run up).
    let mut tries_past_calm = 0;
    loop {
        let calm_now = calm.load(Ordering::SeqCst);
        if calm_now && ((relay_killed && projector_killed && restarted) || tries_past_calm >= 50) {
            break;
        }
        tries_past_calm += u32::from(calm_now);
        tokio::time::sleep(Duration::from_millis(rng.range(300, 1_200))).await;
        let relay = if !calm_now {
            Some(rng.range(0, 2) == 0)
        } else if !relay_killed {
            Some(true)
        } else if !projector_killed {
            Some(false)
        } else {
            None
        };
        if let Some(relay) = relay {
            let pool = if relay { &workers.relays } else { &workers.projectors };
            let victim = &pool[rng.range(0, pool.len() as u64) as usize];
            if victim.kill() {
                let mut f = faults.lock().await;
                if relay {
                    f.relay_kills += 1;
                    relay_killed = true;
                } else {
                    f.projector_kills += 1;
                    projector_killed = true;
                }
            }
        }
        if tokio::time::Instant::now() >= next_broker_restart || (calm_now && !restarted) {
            let down = Duration::from_millis(rng.range(100, 1_000));
            match nats.restart(down).await {
                Ok(()) => {
                    faults.lock().await.broker_restarts += 1;
                    restarted = true;
                }
                Err(e) => eprintln!("chaos: nats restart failed: {e}"),
            }
            next_broker_restart = tokio::time::Instant::now() + Duration::from_millis(rng.range(3_000, 6_000));
        }
    }
}

/// Waits until every committed event is published and applied, then
/// checks: every committed event published at least once, nothing
/// published that was never committed (a rolled-back transaction's event),
/// every event applied to the projection exactly once, no dead letter, and
/// the projection's balances equal the ledger's.
pub(crate) async fn check(
    database: &Database,
    nats_url: &str,
    within: Duration,
    violations: &mut Vec<String>,
) -> Result<EventCounts, Error> {
    let started = tokio::time::Instant::now();
    let deadline = started + within;
    let client = async_nats::connect(nats_url)
        .await
        .map_err(|e| Error::Service(format!("cannot reach the harness's NATS: {e}")))?;
    let js = async_nats::jetstream::new(client);
    let (mut redriven, mut redriven_after_panics) = (0, 0);
    let mut state = database.events().await?;
    loop {
        let done = state.unsent == 0
            && state
                .outbox
                .iter()
                .all(|id| state.applied.get(id).copied().unwrap_or(0) >= 1);
        if done || tokio::time::Instant::now() > deadline {
            break;
        }
        // The operator's redrive: every dead letter, once its cause (an
        // injected panic) may have passed.
        let all = idem_jetstream::DeadLetterFilter {
            limit: 1_000,
            ..Default::default()
        };
        if let Ok(letters) = idem_jetstream::dead_letters(&js, "LEDGER_DEAD", &all).await
            && !letters.is_empty()
        {
            let options = idem_jetstream::RedriveOptions {
                max: 1_000,
                per_second: 1_000,
            };
            if let Ok(report) = idem_jetstream::redrive(&js, "LEDGER_DEAD", &all, options).await {
                for letter in letters.iter().filter(|l| report.redriven.contains(&l.seq)) {
                    redriven += 1;
                    redriven_after_panics += u64::from(letter.error.contains("panicked"));
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        state = database.events().await?;
    }
    let settle_secs = started.elapsed().as_secs_f64();

    let (stream_ids, stream_messages) = stored_ids(&js, "LEDGER_EVENTS", "Nats-Msg-Id").await?;
    let (dead, _) = stored_ids(&js, "LEDGER_DEAD", "Idem-Event-Id").await?;

    let applied_total = judge(&state, &stream_ids, &dead, violations);
    let committed: BTreeSet<&String> = state.outbox.iter().collect();
    let published: BTreeSet<&String> = stream_ids.iter().collect();
    Ok(EventCounts {
        committed: committed.len() as u64,
        published: published.len() as u64,
        stream_messages,
        applied: applied_total,
        dead_letters: dead.len() as u64,
        redriven,
        redriven_after_panics,
        settle_secs,
    })
}

/// The event properties over what was read back; appends what fails and
/// answers the number of applications.
pub(crate) fn judge(state: &EventState, stream_ids: &[String], dead: &[String], violations: &mut Vec<String>) -> u64 {
    let committed: BTreeSet<&String> = state.outbox.iter().collect();
    let published: BTreeSet<&String> = stream_ids.iter().collect();
    if state.unsent != 0 {
        violations.push(format!("events: {} committed event(s) never marked sent", state.unsent));
    }
    let missing: Vec<_> = committed.difference(&published).take(5).collect();
    if !missing.is_empty() {
        violations.push(format!(
            "events: {} committed event(s) never published, e.g. {missing:?}",
            committed.difference(&published).count()
        ));
    }
    let phantom: Vec<_> = published.difference(&committed).take(5).collect();
    if !phantom.is_empty() {
        violations.push(format!(
            "events: {} published event(s) of no committed transaction, e.g. {phantom:?}",
            published.difference(&committed).count()
        ));
    }
    let mut applied_total = 0;
    for id in &committed {
        let n = state.applied.get(*id).copied().unwrap_or(0);
        applied_total += n;
        if n != 1 {
            violations.push(format!("events: event {id} applied {n} time(s) to the projection"));
        }
    }
    for id in state.applied.keys() {
        if !committed.contains(id) {
            violations.push(format!(
                "events: the projection applied {id}, which no transaction committed"
            ));
        }
    }
    if !dead.is_empty() {
        violations.push(format!(
            "events: {} dead letter(s), e.g. {:?}",
            dead.len(),
            dead.first()
        ));
    }
    for (account, (balance, statement)) in &state.balances {
        if Some(*balance) != *statement {
            violations.push(format!(
                "events: account {account} holds {balance} but its statement says {statement:?}"
            ));
        }
    }
    applied_total
}

/// The ids (from `header`) of every message of a stream, and the count.
async fn stored_ids(
    js: &async_nats::jetstream::Context,
    stream: &str,
    header: &str,
) -> Result<(Vec<String>, u64), Error> {
    let mut s = match js.get_stream(stream).await {
        Ok(s) => s,
        Err(_) => return Ok((Vec::new(), 0)),
    };
    let state = s
        .info()
        .await
        .map_err(|e| Error::Service(format!("stream info: {e}")))?
        .state
        .clone();
    let mut ids = Vec::new();
    if state.messages > 0 {
        for seq in state.first_sequence..=state.last_sequence {
            let m = s
                .get_raw_message(seq)
                .await
                .map_err(|e| Error::Service(format!("stream {stream} message {seq}: {e}")))?;
            // A redriven copy carries the event it redrives in its own header.
            let header = if m.headers.get(idem_jetstream::REDRIVE).is_some() {
                idem_jetstream::EVENT_ID
            } else {
                header
            };
            ids.push(m.headers.get(header).map(|v| v.as_str().to_owned()).unwrap_or_default());
        }
    }
    Ok((ids, state.messages))
}

/// The event rows read back.
pub(crate) struct EventState {
    pub(crate) outbox: Vec<String>,
    pub(crate) unsent: i64,
    pub(crate) applied: BTreeMap<String, u64>,
    /// Per account: the ledger's balance and the statement's, if any.
    pub(crate) balances: BTreeMap<String, (i64, Option<i64>)>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state() -> EventState {
        EventState {
            outbox: vec!["a".into(), "b".into()],
            unsent: 0,
            applied: [("a".to_owned(), 1), ("b".to_owned(), 1)].into_iter().collect(),
            balances: [("t/x".to_owned(), (5, Some(5)))].into_iter().collect(),
        }
    }

    fn ids(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| (*s).to_owned()).collect()
    }

    /// The checker passes a clean history and fails each kind of violation.
    #[test]
    fn the_event_checker_can_fail() {
        let mut v = Vec::new();
        judge(&state(), &ids(&["a", "b", "b"]), &[], &mut v);
        assert!(v.is_empty(), "a copy dropped by the inbox is fine: {v:?}");

        let cases: Vec<(&str, EventState, Vec<String>, Vec<String>)> = vec![
            ("never published", state(), ids(&["a"]), vec![]),
            ("no committed transaction", state(), ids(&["a", "b", "z"]), vec![]),
            (
                "applied 2 time(s)",
                EventState {
                    applied: [("a".to_owned(), 2), ("b".to_owned(), 1)].into_iter().collect(),
                    ..state()
                },
                ids(&["a", "b"]),
                vec![],
            ),
            (
                "applied 0 time(s)",
                EventState {
                    applied: [("a".to_owned(), 1)].into_iter().collect(),
                    ..state()
                },
                ids(&["a", "b"]),
                vec![],
            ),
            ("dead letter", state(), ids(&["a", "b"]), ids(&["a"])),
            (
                "statement says",
                EventState {
                    balances: [("t/x".to_owned(), (5, Some(4)))].into_iter().collect(),
                    ..state()
                },
                ids(&["a", "b"]),
                vec![],
            ),
            (
                "never marked sent",
                EventState { unsent: 1, ..state() },
                ids(&["a", "b"]),
                vec![],
            ),
        ];
        for (expected, state, stream, dead) in cases {
            let mut v = Vec::new();
            judge(&state, &stream, &dead, &mut v);
            assert!(v.iter().any(|m| m.contains(expected)), "{expected}: {v:?}");
        }
    }
}
