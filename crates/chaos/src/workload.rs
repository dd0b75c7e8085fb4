//! The workload: logical operations, each with one key reused on every retry
//! until a definite answer.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::sync::Mutex;

use crate::progress::Progress;
use crate::rng::Rng;
use crate::service::Service;
use crate::{Config, Counts, Error};

/// Accounts the workload moves money between.
const ACCOUNTS: usize = 6;
/// Initial top-up of account `a`: 1,000,000 + a (unique amounts identify operations).
const INITIAL: i64 = 1_000_000;
/// Workload top-up of operation `i`: 10,000,000 + i.
const TOP_UP: i64 = 10_000_000;
/// A transfer meant to be declined for insufficient funds: 10^11 + i.
const TOO_MUCH: i64 = 100_000_000_000;
/// The body of a key reused with another request: 5·10^11 + i, never applied.
pub(crate) const PROBE: i64 = 500_000_000_000;
/// How long one operation may keep retrying.
const OP_DEADLINE: Duration = Duration::from_secs(120);

/// How an operation ended for its client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Answer {
    Applied,
    Rejected,
    Unknown,
}

/// One logical operation and what its client saw.
#[derive(Debug, Clone)]
pub(crate) struct Op {
    pub(crate) kind: &'static str,
    pub(crate) amount: i64,
    pub(crate) answer: Answer,
    /// Every 201 body received for its key.
    pub(crate) bodies: Vec<Vec<u8>>,
}

pub(crate) struct Outcome {
    pub(crate) counts: Counts,
    pub(crate) ops: Vec<Op>,
    pub(crate) probes: Vec<i64>,
    pub(crate) violations: Vec<String>,
}

#[derive(Default)]
struct Tally {
    retries: AtomicU64,
    replays: AtomicU64,
    in_flight: AtomicU64,
    bursts: AtomicU64,
    probes: AtomicU64,
}

/// The workload's client: idem-client, which keeps one key for every retry
/// of an operation, with an observer that counts what the attempts got.
struct Client {
    idem: idem_client::Client,
    base: String,
    tally: Arc<Tally>,
    violations: Mutex<Vec<String>>,
}

/// A definite answer.
struct Seen {
    status: u16,
    body: Vec<u8>,
    replayed: bool,
}

impl Client {
    fn new(base: &str, token: &str, seed: u64) -> Result<Self, Error> {
        let http = ledger::http_builder()
            .pool_max_idle_per_host(0)
            .redirect(reqwest::redirect::Policy::none())
            .timeout(Duration::from_secs(20))
            .build()?;
        let tally = Arc::new(Tally::default());
        let observed = tally.clone();
        let idem = idem_client::Client::builder()
            .http(http)
            .bearer(token)
            .deadline(OP_DEADLINE)
            .attempt_timeout(Duration::from_secs(20))
            .backoff(Duration::from_millis(20), Duration::from_millis(800))
            // The ledger's in-flight 409 asks for a second; the harness
            // polls no slower than that.
            .max_retry_after(Duration::from_secs(1))
            .jitter_seed(seed)
            .on_attempt(move |event| {
                if let idem_client::AttemptOutcome::Answered(r) = &event.outcome {
                    if r.replayed() {
                        observed.replays.fetch_add(1, Ordering::Relaxed);
                    }
                    if r.status().as_u16() == 409 {
                        observed.in_flight.fetch_add(1, Ordering::Relaxed);
                    }
                }
                if matches!(event.next, idem_client::Next::RetryIn(_)) {
                    observed.retries.fetch_add(1, Ordering::Relaxed);
                }
            })
            .build()
            .map_err(|e| Error::Service(format!("the workload's client: {e}")))?;
        Ok(Self {
            idem,
            base: base.to_owned(),
            tally,
            violations: Mutex::new(Vec::new()),
        })
    }

    /// Sends until a definite answer with one key: 201 (applied), 422
    /// (declined, or the key refused for another body); idem-client retries
    /// everything else it may (network errors, 5xx, 408, 429, the in-flight
    /// 409) with the same key. `burst` > 1 sends that many copies at once,
    /// each retrying on its own. Returns the definite answer (`None` when
    /// the outcome stayed unknown) and every 201 body received.
    async fn until_definite(
        &self,
        label: &str,
        path: &str,
        key: &str,
        body: &str,
        burst: usize,
    ) -> Result<(Option<Seen>, Vec<Vec<u8>>), Error> {
        let op = idem_client::Operation::post(&format!("{}{path}", self.base))
            .key(idem_client::Key::new(key).map_err(|e| Error::Service(e.to_string()))?)
            .header("content-type", "application/json")
            .body(body.to_owned())
            .build()
            .map_err(|e| Error::Service(format!("{label}: {e}")))?;
        let sends: Vec<_> = (0..burst.max(1)).map(|_| self.idem.send(&op)).collect();
        let mut definite = None;
        let mut bodies = Vec::new();
        for result in join_all(sends).await {
            let response = match result {
                Ok(response) => response,
                Err(idem_client::Error::Rejected(response)) => *response,
                Err(e) if e.is_outcome_unknown() => continue,
                Err(e) => return Err(Error::Service(format!("{label}: the client failed: {e}"))),
            };
            let seen = Seen {
                status: response.status().as_u16(),
                body: response.body().to_vec(),
                replayed: response.replayed(),
            };
            match seen.status {
                201 => bodies.push(seen.body.clone()),
                422 => {}
                other => {
                    self.violations.lock().await.push(format!(
                        "{label}: unexpected status {other}: {}",
                        String::from_utf8_lossy(&seen.body)
                    ));
                    return Ok((None, bodies));
                }
            }
            definite = Some(seen);
        }
        Ok((definite, bodies))
    }
}

async fn join_all<F: std::future::Future>(futures: Vec<F>) -> Vec<F::Output> {
    let mut pinned: Vec<_> = futures.into_iter().map(Box::pin).collect();
    let mut results: Vec<Option<F::Output>> = (0..pinned.len()).map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (i, f) in pinned.iter_mut().enumerate() {
            if results[i].is_none() {
                match f.as_mut().poll(cx) {
                    std::task::Poll::Ready(v) => results[i] = Some(v),
                    std::task::Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            std::task::Poll::Pending
        } else {
            std::task::Poll::Ready(())
        }
    })
    .await;
    results.into_iter().map(|r| r.expect("every future finished")).collect()
}

enum Plan {
    TopUp { account: usize, amount: i64 },
    Transfer { from: usize, to: usize, amount: i64 },
    Payout { account: usize, amount: i64 },
}

pub(crate) async fn run(
    config: &Config,
    base: &str,
    token: &str,
    mut rng: Rng,
    service: &Arc<Service>,
    progress: Arc<Progress>,
) -> Result<Outcome, Error> {
    // The plan has its own stream, drawn before anything runs, so one seed
    // always gives one schedule however many retries the setup needs.
    let mut plan_rng = rng.fork(1);
    let client = Arc::new(Client::new(base, token, rng.fork(2).next_u64())?);
    service.wait_healthy(Duration::from_secs(60)).await?;

    // Setup, through the same faults: accounts and their first top-ups.
    let mut accounts = Vec::new();
    let mut ops = Vec::new();
    for a in 0..ACCOUNTS {
        let key = uuid::Uuid::now_v7().to_string();
        let (seen, _) = client
            .until_definite(
                "create account",
                "/v1/accounts",
                &key,
                &format!("{{\"name\":\"acct-{a}\"}}"),
                1,
            )
            .await?;
        let seen = seen.ok_or_else(|| Error::Service("could not create an account".into()))?;
        let v: serde_json::Value = serde_json::from_slice(&seen.body).map_err(|e| Error::Service(e.to_string()))?;
        accounts.push(v["id"].as_str().unwrap_or_default().to_owned());
        let amount = INITIAL + a as i64;
        let body = format!("{{\"account_id\":\"{}\",\"amount\":{amount}}}", accounts[a]);
        let key = uuid::Uuid::now_v7().to_string();
        let (seen, bodies) = client
            .until_definite("initial top-up", "/v1/top-ups", &key, &body, 1)
            .await?;
        let answer = match seen.map(|s| s.status) {
            Some(201) => Answer::Applied,
            _ => Answer::Unknown,
        };
        ops.push(Op {
            kind: "top_up",
            amount,
            answer,
            bodies,
        });
    }

    // The schedule is drawn from the seed before anything runs.
    let rng = &mut plan_rng;
    let plans: Vec<(Plan, bool, bool)> = (0..config.ops)
        .map(|i| {
            let i64i = i as i64;
            let plan = if config.payouts && rng.chance(0.07) {
                // A payout: debited at once, paid at the vendor by the
                // payout workers; some are declined for insufficient funds.
                let amount = if rng.chance(0.12) { TOO_MUCH + i64i } else { 1 + i64i };
                Plan::Payout {
                    account: rng.range(0, ACCOUNTS as u64) as usize,
                    amount,
                }
            } else if rng.chance(0.25) {
                Plan::TopUp {
                    account: rng.range(0, ACCOUNTS as u64) as usize,
                    amount: TOP_UP + i64i,
                }
            } else {
                let from = rng.range(0, ACCOUNTS as u64) as usize;
                let to = (from + rng.range(1, ACCOUNTS as u64) as usize) % ACCOUNTS;
                let amount = if rng.chance(0.12) { TOO_MUCH + i64i } else { 1 + i64i };
                Plan::Transfer { from, to, amount }
            };
            let burst = config.faults.bursts && rng.chance(0.03);
            let probe = rng.chance(0.02);
            (plan, burst, probe)
        })
        .collect();
    let plans = Arc::new(plans);
    let accounts = Arc::new(accounts);
    let results: Arc<Mutex<Vec<Option<Op>>>> = Arc::new(Mutex::new(vec![None; config.ops]));
    let probes = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for _ in 0..config.clients.max(1) {
        let (client, plans, accounts, progress, results, probes, service) = (
            client.clone(),
            plans.clone(),
            accounts.clone(),
            progress.clone(),
            results.clone(),
            probes.clone(),
            service.clone(),
        );
        tasks.push(tokio::spawn(async move {
            loop {
                let i = progress.take();
                let Some((plan, burst, probe)) = plans.get(i) else {
                    break;
                };
                if service.broken() {
                    break;
                }
                let (kind, amount, path, body) = match plan {
                    Plan::TopUp { account, amount } => (
                        "top_up",
                        *amount,
                        "/v1/top-ups",
                        format!("{{\"account_id\":\"{}\",\"amount\":{amount}}}", accounts[*account]),
                    ),
                    Plan::Transfer { from, to, amount } => (
                        "transfer",
                        *amount,
                        "/v1/transfers",
                        format!(
                            "{{\"from\":\"{}\",\"to\":\"{}\",\"amount\":{amount}}}",
                            accounts[*from], accounts[*to]
                        ),
                    ),
                    Plan::Payout { account, amount } => (
                        "payout",
                        *amount,
                        "/v1/payouts",
                        format!("{{\"account_id\":\"{}\",\"amount\":{amount}}}", accounts[*account]),
                    ),
                };
                let key = uuid::Uuid::now_v7().to_string();
                if *burst {
                    client.tally.bursts.fetch_add(1, Ordering::Relaxed);
                }
                let label = format!("op {i} ({kind} {amount})");
                let (seen, bodies) = client
                    .until_definite(&label, path, &key, &body, if *burst { 5 } else { 1 })
                    .await?;
                let answer = match seen.as_ref().map(|s| (s.status, s.body.as_slice())) {
                    Some((201, _)) => Answer::Applied,
                    Some((422, b)) if String::from_utf8_lossy(b).contains("insufficient-funds") => Answer::Rejected,
                    Some((status, b)) => {
                        client.violations.lock().await.push(format!(
                            "{label}: definite answer {status} is neither success nor insufficient funds: {}",
                            String::from_utf8_lossy(b)
                        ));
                        Answer::Unknown
                    }
                    None => Answer::Unknown,
                };
                if answer == Answer::Applied && *probe {
                    // Reuse the key with another body: it must be refused and never applied.
                    let probe_amount = PROBE + i as i64;
                    let other = body.replace(&format!("\"amount\":{amount}"), &format!("\"amount\":{probe_amount}"));
                    client.tally.probes.fetch_add(1, Ordering::Relaxed);
                    probes.lock().await.push(probe_amount);
                    let (seen, _) = client
                        .until_definite(&format!("probe of {label}"), path, &key, &other, 1)
                        .await?;
                    match seen {
                        Some(s)
                            if s.status == 422
                                && String::from_utf8_lossy(&s.body).contains("idempotency-key-reused") => {}
                        Some(s) => client.violations.lock().await.push(format!(
                            "{label}: a reused key with another body got {} (replayed: {}): {}",
                            s.status,
                            s.replayed,
                            String::from_utf8_lossy(&s.body)
                        )),
                        None => {}
                    }
                }
                results.lock().await[i] = Some(Op {
                    kind,
                    amount,
                    answer,
                    bodies,
                });
            }
            Ok::<(), Error>(())
        }));
    }
    for t in tasks {
        t.await
            .map_err(|e| Error::Service(format!("a client task failed: {e}")))??;
    }
    if service.broken() {
        return Err(Error::Service(
            "the ledger could not be restarted; the run was abandoned".into(),
        ));
    }
    let mut workload_ops: Vec<Op> = results.lock().await.drain(..).flatten().collect();
    let mut counts = Counts {
        ops: workload_ops.len() as u64,
        ..Counts::default()
    };
    for op in &workload_ops {
        match op.answer {
            Answer::Applied => counts.ok += 1,
            Answer::Rejected => counts.rejected += 1,
            Answer::Unknown => counts.unknown += 1,
        }
    }
    counts.retries = client.tally.retries.load(Ordering::Relaxed);
    counts.replays_seen = client.tally.replays.load(Ordering::Relaxed);
    counts.in_flight_seen = client.tally.in_flight.load(Ordering::Relaxed);
    counts.bursts = client.tally.bursts.load(Ordering::Relaxed);
    counts.mismatch_probes = client.tally.probes.load(Ordering::Relaxed);
    ops.append(&mut workload_ops);
    let violations = client.violations.lock().await.clone();
    let probes = probes.lock().await.clone();
    Ok(Outcome {
        counts,
        ops,
        probes,
        violations,
    })
}
