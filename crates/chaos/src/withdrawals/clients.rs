//! The withdrawals' clients: accounts topped up, then withdrawals, each
//! under one key for every retry (`idem-client`), some sent by several
//! clients at once, some to closed destinations (declined by the payout
//! vendor, so credited back), some for more than the account holds.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Mutex;

use super::{ClientCounts, WithdrawalsConfig};
use crate::Error;
use crate::rng::Rng;
use crate::service::Service;

/// Accounts the withdrawals draw on.
const ACCOUNTS: usize = 4;
/// Each account's top-up: enough for every withdrawal but the too-large ones.
const TOP_UP: i64 = 1_000_000_000;
/// A withdrawal larger than any account.
const TOO_MUCH: i64 = 10_000_000_000;
/// How long a client keeps retrying one withdrawal.
const DEADLINE: Duration = Duration::from_secs(90);

/// How a withdrawal's client saw it end.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Seen {
    /// 201, with the body.
    Paid(Vec<u8>),
    /// 422, with the body.
    Declined(Vec<u8>),
    /// 409: held on an unknown outcome.
    Held,
    /// Nothing definite.
    Unanswered,
}

/// One withdrawal as the workload asked for it.
#[derive(Debug, Clone)]
pub(crate) struct Asked {
    /// Its idempotency key.
    pub(crate) key: String,
    /// Its body, as sent.
    pub(crate) body: String,
    /// Its destination: unique to it, so its rows and vendor effects are
    /// found by it whatever ids its runs made.
    pub(crate) destination: String,
    /// Whether the payout vendor declines it (a closed destination).
    pub(crate) closed: bool,
    /// Whether it asks for more than the account holds.
    pub(crate) too_much: bool,
    /// How it ended for its client(s).
    pub(crate) seen: Seen,
}

/// What the workload did.
#[derive(Debug, Clone, Default)]
pub(crate) struct Workload {
    pub(crate) counts: ClientCounts,
    pub(crate) asked: Vec<Asked>,
    pub(crate) violations: Vec<String>,
}

/// A client that retries one key until a definite answer.
pub(crate) fn client(token: &str, seed: u64) -> Result<idem_client::Client, Error> {
    let http = ledger::http_builder()
        .pool_max_idle_per_host(0)
        .timeout(Duration::from_secs(30))
        .build()?;
    idem_client::Client::builder()
        .http(http)
        .bearer(token)
        .deadline(DEADLINE)
        .attempt_timeout(Duration::from_secs(30))
        .backoff(Duration::from_millis(50), Duration::from_millis(1_000))
        .max_retry_after(Duration::from_secs(1))
        .jitter_seed(seed)
        .build()
        .map_err(|e| Error::Service(format!("the withdrawals' client: {e}")))
}

/// Whether two answers to one key agree. A recorded outcome is answered
/// byte for byte the same to every client. A refusal of the ledger's rules
/// by the first step (insufficient funds, say) records nothing: each call
/// is refused afresh, and its detail says the balance as that call read it,
/// which other withdrawals may have changed in between; such refusals agree
/// when their problem types do.
pub(crate) fn same_answer(a: &[u8], b: &[u8]) -> bool {
    if a == b {
        return true;
    }
    let refusal = |body: &[u8]| {
        serde_json::from_slice::<serde_json::Value>(body)
            .ok()
            .and_then(|v| v["type"].as_str().map(str::to_owned))
            .filter(|t| {
                ledger::api::REFUSAL_SLUGS
                    .iter()
                    .any(|slug| t.ends_with(&format!("/{slug}")))
            })
    };
    matches!((refusal(a), refusal(b)), (Some(x), Some(y)) if x == y)
}

/// Sends `body` to `path` under `key` until a definite answer.
pub(crate) async fn send(
    client: &idem_client::Client,
    base: &str,
    path: &str,
    key: &str,
    body: &str,
) -> Result<(u16, Vec<u8>, bool), Option<String>> {
    let op = idem_client::Operation::post(&format!("{base}{path}"))
        .key(idem_client::Key::new(key).map_err(|e| Some(e.to_string()))?)
        .header("content-type", "application/json")
        .body(body.to_owned())
        .build()
        .map_err(|e| Some(e.to_string()))?;
    match client.send(&op).await {
        Ok(r) => Ok((r.status().as_u16(), r.body().to_vec(), r.replayed())),
        Err(idem_client::Error::Rejected(r)) => Ok((r.status().as_u16(), r.body().to_vec(), r.replayed())),
        Err(e) if e.is_outcome_unknown() => Err(None),
        Err(e) => Err(Some(e.to_string())),
    }
}

/// Sends `body` to `path` under a key of its own until it is created (201):
/// answers what was created; anything else fails `what`.
async fn create(
    client: &idem_client::Client,
    base: &str,
    path: &str,
    body: &str,
    what: &str,
) -> Result<Vec<u8>, Error> {
    let key = uuid::Uuid::now_v7().to_string();
    let (status, created, _) = send(client, base, path, &key, body)
        .await
        .map_err(|e| Error::Service(format!("{what}: {e:?}")))?;
    if status != 201 {
        return Err(Error::Service(format!("{what}: {status}")));
    }
    Ok(created)
}

/// Creates the accounts, tops them up, then runs the withdrawals.
pub(crate) async fn run(
    config: &WithdrawalsConfig,
    base: &str,
    token: &str,
    mut rng: Rng,
    service: &Arc<Service>,
) -> Result<Workload, Error> {
    service.wait_healthy(Duration::from_secs(60)).await?;
    let setup = client(token, rng.next_u64())?;
    let mut accounts = Vec::new();
    for a in 0..ACCOUNTS {
        let body = format!("{{\"name\":\"w-{a}\"}}");
        let created = create(&setup, base, "/v1/accounts", &body, "create an account").await?;
        let v: serde_json::Value = serde_json::from_slice(&created).map_err(|e| Error::Service(e.to_string()))?;
        let id = v["id"].as_str().unwrap_or_default().to_owned();
        let body = format!("{{\"account_id\":\"{id}\",\"amount\":{TOP_UP}}}");
        create(&setup, base, "/v1/top-ups", &body, "top up").await?;
        accounts.push(id);
    }

    // The plan is drawn before anything runs: one seed, one schedule.
    let plan: Vec<(Asked, usize)> = (0..config.withdrawals)
        .map(|i| {
            let closed = rng.chance(0.1);
            let too_much = !closed && rng.chance(0.05);
            let destination = if closed {
                format!("{}w{i}", fake_vendor::CLOSED_DESTINATION_PREFIX)
            } else {
                format!("acct-w{i}")
            };
            let account = &accounts[rng.range(0, ACCOUNTS as u64) as usize];
            let amount = if too_much { TOO_MUCH } else { 100 + i as i64 };
            let (currency, payout) = [("USD", "EUR"), ("EUR", "USD"), ("GBP", "EUR")][rng.range(0, 3) as usize];
            let body = format!(
                "{{\"account\":\"{account}\",\"amount\":{amount},\"currency\":\"{currency}\",\
                 \"payout_currency\":\"{payout}\",\"destination\":\"{destination}\"}}"
            );
            let twins = if rng.chance(0.1) { 3 } else { 1 };
            let asked = Asked {
                key: uuid::Uuid::now_v7().to_string(),
                body,
                destination,
                closed,
                too_much,
                seen: Seen::Unanswered,
            };
            (asked, twins)
        })
        .collect();

    let queue = Arc::new(Mutex::new(plan.into_iter().enumerate().collect::<Vec<_>>()));
    let done = Arc::new(Mutex::new(Vec::new()));
    let violations = Arc::new(Mutex::new(Vec::new()));
    let refusals_read_afresh = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let mut tasks = Vec::new();
    for c in 0..config.clients {
        let (queue, done, violations, refusals_read_afresh) = (
            queue.clone(),
            done.clone(),
            violations.clone(),
            refusals_read_afresh.clone(),
        );
        let client = Arc::new(client(token, rng.next_u64() ^ c as u64)?);
        let base = base.to_owned();
        tasks.push(tokio::spawn(async move {
            loop {
                let Some((i, (mut asked, twins))) = queue.lock().await.pop() else {
                    break;
                };
                let sends = (0..twins).map(|_| {
                    let (client, base, key, body) =
                        (client.clone(), base.clone(), asked.key.clone(), asked.body.clone());
                    tokio::spawn(async move { send(&client, &base, "/v1/withdrawals", &key, &body).await })
                });
                let sends: Vec<_> = sends.collect();
                let mut seen = Seen::Unanswered;
                for s in sends {
                    let answer = match s.await {
                        Ok(a) => a,
                        Err(e) => Err(Some(e.to_string())),
                    };
                    let this = match answer {
                        Ok((201, body, _)) => Seen::Paid(body),
                        Ok((422, body, _)) => Seen::Declined(body),
                        Ok((409, _, _)) | Err(None) => Seen::Held,
                        Ok((status, body, _)) => {
                            violations.lock().await.push(format!(
                                "withdrawal {}: unexpected status {status}: {}",
                                asked.key,
                                String::from_utf8_lossy(&body)
                            ));
                            Seen::Unanswered
                        }
                        Err(Some(_)) => Seen::Unanswered,
                    };
                    match (&seen, &this) {
                        (Seen::Paid(a), Seen::Paid(b)) | (Seen::Declined(a), Seen::Declined(b))
                            if !same_answer(a, b) =>
                        {
                            violations.lock().await.push(format!(
                                "withdrawal {}: twins got different answers: {} against {}",
                                asked.key,
                                String::from_utf8_lossy(a),
                                String::from_utf8_lossy(b)
                            ));
                        }
                        (Seen::Paid(_), Seen::Declined(_)) | (Seen::Declined(_), Seen::Paid(_)) => {
                            violations
                                .lock()
                                .await
                                .push(format!("withdrawal {}: one twin was paid, another declined", asked.key));
                        }
                        (Seen::Declined(a), Seen::Declined(b)) if a != b => {
                            refusals_read_afresh.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        }
                        _ => {}
                    }
                    if matches!(seen, Seen::Unanswered | Seen::Held) {
                        seen = this;
                    }
                }
                asked.seen = seen;
                done.lock().await.push((i, asked, twins > 1));
            }
        }));
    }
    for t in tasks {
        t.await
            .map_err(|e| Error::Service(format!("a withdrawals client: {e}")))?;
    }
    let mut done = std::mem::take(&mut *done.lock().await);
    done.sort_by_key(|(i, _, _)| *i);
    let mut counts = ClientCounts {
        refusals_read_afresh: refusals_read_afresh.load(std::sync::atomic::Ordering::Relaxed),
        ..ClientCounts::default()
    };
    for (_, asked, burst) in &done {
        counts.requested += 1;
        counts.bursts += u64::from(*burst);
        match asked.seen {
            Seen::Paid(_) => counts.paid += 1,
            Seen::Declined(_) => counts.declined += 1,
            Seen::Held => counts.held += 1,
            Seen::Unanswered => counts.unanswered += 1,
        }
    }
    let violations = std::mem::take(&mut *violations.lock().await);
    Ok(Workload {
        counts,
        asked: done.into_iter().map(|(_, a, _)| a).collect(),
        violations,
    })
}

#[cfg(test)]
mod tests {
    use super::same_answer;

    #[test]
    fn refusals_agree_by_type_and_recorded_outcomes_byte_for_byte() {
        let refused = |balance: u64| {
            format!(
                r#"{{"type":"https://idem.dev/problems/insufficient-funds","status":422,"detail":"insufficient funds: balance {balance}, requested 10000000000"}}"#
            )
        };
        assert!(same_answer(refused(10).as_bytes(), refused(10).as_bytes()));
        assert!(same_answer(refused(10).as_bytes(), refused(7).as_bytes()));
        let declined = |reason: &str| {
            format!(r#"{{"type":"https://idem.dev/problems/withdrawal-declined","status":422,"reason":"{reason}"}}"#)
        };
        assert!(same_answer(
            declined("closed").as_bytes(),
            declined("closed").as_bytes()
        ));
        assert!(!same_answer(
            declined("closed").as_bytes(),
            declined("limit").as_bytes()
        ));
        assert!(!same_answer(refused(10).as_bytes(), declined("closed").as_bytes()));
        assert!(!same_answer(
            br#"{"id":"w1","quote_id":"q1"}"#,
            br#"{"id":"w1","quote_id":"q2"}"#
        ));
    }
}
