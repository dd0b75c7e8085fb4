//! Once the attacks stop: waiting for the completers to bring every
//! operation to its end or a hold, and the operator's pass over the held
//! ones with `idem ops`, each settled from the vendors' truth: a send the
//! vendor applied is marked applied with the vendor's record of it, one it
//! did not (once the send has settled) not applied; an operation held for
//! another reason is resumed.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use super::clients::Workload;
use crate::Error;
use crate::db::Database;

/// The operations by state, once none is running or compensating (or
/// `within` has passed).
pub(crate) async fn settle_down(database: &Database, within: Duration) -> Result<BTreeMap<String, u64>, Error> {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let states = database.operation_states().await?;
        let busy = states.get("running").copied().unwrap_or(0) + states.get("compensating").copied().unwrap_or(0);
        if busy == 0 || tokio::time::Instant::now() >= deadline {
            return Ok(states);
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Runs `idem ops <args> --store <url> --json`; its JSON answer.
async fn idem_ops(idem: &Path, store: &str, args: &[&str]) -> Result<serde_json::Value, String> {
    let out = tokio::process::Command::new(idem)
        .arg("ops")
        .args(args)
        .args(["--store", store, "--json"])
        .env("IDEM_OPERATOR", "chaos-operator")
        .output()
        .await
        .map_err(|e| format!("idem ops: {e}"))?;
    let answer: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or(serde_json::Value::Null);
    if out.status.success() {
        Ok(answer)
    } else {
        Err(format!(
            "idem ops {}: exit {:?}: {} {}",
            args.join(" "),
            out.status.code(),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

/// What the vendor knows of the send of `step` for the withdrawal
/// `reference`: its record when it applied it, `None` when it did not.
async fn vendor_truth(vendor_url: &str, step: &str, reference: &str) -> Result<Option<serde_json::Value>, String> {
    let path = match step {
        "fx-quote" => "/v1/quotes",
        "payout" => "/v1/payouts",
        other => return Err(format!("no lookup for step {other:?}")),
    };
    let http = ledger::http_builder()
        .timeout(Duration::from_secs(10))
        .build()
        .map_err(|e| e.to_string())?;
    // A reference is a UUID: nothing in it needs escaping.
    let body = http
        .get(format!("{vendor_url}{path}?reference={reference}"))
        .send()
        .await
        .map_err(|e| e.to_string())?
        .bytes()
        .await
        .map_err(|e| e.to_string())?;
    let answer: serde_json::Value = serde_json::from_slice(&body).map_err(|e| e.to_string())?;
    let data = answer["data"].as_array().cloned().unwrap_or_default();
    if data.iter().any(|d| d["status"] == "processing") {
        return Err(format!("{step} of {reference} is still being processed"));
    }
    Ok(data.into_iter().next())
}

/// The longest the operator waits for an open send to settle.
const MAX_SETTLE_WAIT: Duration = Duration::from_secs(120);

/// When the open send of the operation `shown` (`idem ops show`) has
/// settled, in ms since the epoch: its latest send's time plus the settle
/// time it was sent under, as `mark --not-applied` checks it.
fn settled_at_ms(shown: &serde_json::Value) -> i64 {
    let open = &shown["open"];
    let last_sent_at_ms = open["last_sent_at_ms"].as_i64().unwrap_or(0);
    let settle_ms = (open["sent_under"]["settle_secs"].as_f64().unwrap_or(0.0) * 1_000.0).ceil() as i64;
    last_sent_at_ms.saturating_add(settle_ms)
}

/// The wall clock, in ms since the epoch (the service's and the CLI's).
fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// Waits until a little past `at_ms` (the CLI reads its own clock), at most
/// [`MAX_SETTLE_WAIT`].
async fn wait_until(at_ms: i64) {
    let wait_ms = at_ms.saturating_sub(now_ms());
    if wait_ms > 0 {
        tokio::time::sleep(Duration::from_millis(wait_ms.unsigned_abs() + 50).min(MAX_SETTLE_WAIT)).await;
    }
}

/// Settles every held operation; the verdicts given, by kind.
pub(crate) async fn pass(
    database: &Database,
    idem: &Path,
    vendor_url: &str,
    workload: &Workload,
    violations: &mut Vec<String>,
) -> Result<BTreeMap<String, u64>, Error> {
    let mut verdicts = BTreeMap::new();
    let by_key: BTreeMap<&str, &str> = workload
        .asked
        .iter()
        .map(|a| (a.key.as_str(), a.destination.as_str()))
        .collect();
    for (id, key) in database.held_operations().await? {
        let id_arg = id.to_string();
        let shown = match idem_ops(idem, &database.url, &["show", &id_arg]).await {
            Ok(v) => v,
            Err(e) => {
                violations.push(format!("operator: {e}"));
                continue;
            }
        };
        let kind = shown["hold"]["kind"].as_str().unwrap_or("").to_owned();
        let verdict = if kind == "unknown" {
            let step = shown["open_step"].as_str().unwrap_or("").to_owned();
            let Some(destination) = by_key.get(key.as_str()) else {
                violations.push(format!("operator: operation {id} has a key no client sent"));
                continue;
            };
            let Some(reference) = database.withdrawal_of(destination).await? else {
                violations.push(format!("operator: operation {id} is held at {step} with no withdrawal"));
                continue;
            };
            // A "not applied" is trusted once the last send has settled: a
            // vendor's "no record" counts only when it was asked after that
            // moment (a send still on its way may yet arrive); one asked
            // before waits for it and asks again.
            let settled_at_ms = settled_at_ms(&shown);
            let mut outcome = Err(String::new());
            for _ in 0..40 {
                let asked_at_ms = now_ms();
                let mut truth = vendor_truth(vendor_url, &step, &reference).await;
                if matches!(truth, Ok(None)) && asked_at_ms < settled_at_ms {
                    wait_until(settled_at_ms).await;
                    truth = vendor_truth(vendor_url, &step, &reference).await;
                }
                outcome = match truth {
                    Ok(Some(record)) => {
                        let file = std::env::temp_dir().join(format!("chaos-verdict-{id}-{}.json", std::process::id()));
                        std::fs::write(&file, record.to_string())?;
                        let path = file.display().to_string();
                        let r = idem_ops(
                            idem,
                            &database.url,
                            &["mark", &id_arg, "--applied", "--body-file", &path],
                        )
                        .await
                        .map(|_| "applied");
                        let _ = std::fs::remove_file(&file);
                        r
                    }
                    Ok(None) => idem_ops(idem, &database.url, &["mark", &id_arg, "--not-applied"])
                        .await
                        .map(|_| "not_applied"),
                    Err(e) => Err(e),
                };
                if outcome.is_ok() {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            outcome
        } else {
            idem_ops(idem, &database.url, &["resume", &id_arg])
                .await
                .map(|_| "resumed")
        };
        match verdict {
            Ok(v) => *verdicts.entry(format!("{kind}:{v}")).or_default() += 1,
            Err(e) => violations.push(format!("operator: operation {id} ({kind}): {e}")),
        }
    }
    Ok(verdicts)
}
