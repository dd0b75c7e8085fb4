//! The judge of a withdrawals run: what the database, the vendors and the
//! clients say, against what exactly-once means for a withdrawal.
//!
//! 1. Each withdrawal (found by its destination, unique to it) is debited
//!    at most once: one row of `ledger_withdrawals`, one `withdrawal`
//!    journal row; none when it asked for more than the account holds.
//! 2. Each vendor effect happens at most once: the FX vendor books one
//!    quote per withdrawal, the payout vendor pays one payout per
//!    withdrawal, and neither knows a reference the ledger never debited.
//! 3. A paid withdrawal was paid at the vendor; a declined one was not,
//!    and was credited back exactly once (a `withdrawal_reversal` row).
//! 4. Every operation is final (completed or compensated): none running,
//!    compensating or held after the operator's pass, and each agrees with
//!    its withdrawal (completed: paid; compensated: declined).
//! 5. Every answer a client got is what the withdrawal became, and a last
//!    retry of its key answers the same bytes, marked replayed.
//! 6. The service's audit is conserved, with no negative balance.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use super::WithdrawalCounts;
use super::clients::{Seen, Workload, client, same_answer, send};
use crate::Error;
use crate::db::Database;

/// Reads the vendor's ledger at `path`.
async fn vendor_ledger(vendor_url: &str, path: &str) -> Result<serde_json::Value, Error> {
    let http = ledger::http_builder().timeout(Duration::from_secs(10)).build()?;
    let body = http.get(format!("{vendor_url}{path}")).send().await?.bytes().await?;
    serde_json::from_slice(&body).map_err(|e| Error::Service(format!("{path}: {e}")))
}

fn strings(v: &serde_json::Value) -> BTreeSet<String> {
    v.as_array()
        .map(|a| a.iter().filter_map(|s| s.as_str().map(str::to_owned)).collect())
        .unwrap_or_default()
}

/// Checks the run; the service's audit.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn check(
    database: &Database,
    vendor_url: &str,
    vendor: &Arc<fake_vendor::Vendor>,
    direct: &str,
    token: &str,
    workload: &Workload,
    counts: &mut WithdrawalCounts,
    violations: &mut Vec<String>,
) -> Result<serde_json::Value, Error> {
    let rows = database.withdrawals().await?;
    let journal = database.withdrawal_journal().await?;
    let operations: BTreeMap<String, String> = database.operations().await?.into_iter().collect();
    let quotes = vendor_ledger(vendor_url, "/v1/quotes/ledger").await?;
    let payouts = vendor_ledger(vendor_url, "/v1/ledger").await?;

    // 1. Debited at most once.
    let mut by_destination: BTreeMap<&str, Vec<&(String, String, String)>> = BTreeMap::new();
    for row in &rows {
        by_destination.entry(row.1.as_str()).or_default().push(row);
    }
    counts.debited = rows.len() as u64;
    for row in &rows {
        *counts.by_state.entry(row.2.clone()).or_default() += 1;
    }
    let debits: BTreeSet<&str> = journal
        .iter()
        .filter(|(_, kind)| kind == "withdrawal")
        .map(|(id, _)| id.as_str())
        .collect();
    let reversals: BTreeSet<&str> = journal
        .iter()
        .filter(|(_, kind)| kind == "withdrawal_reversal")
        .filter_map(|(id, _)| id.strip_suffix(":reversal"))
        .collect();
    for (destination, found) in &by_destination {
        if found.len() > 1 {
            violations.push(format!("withdrawal to {destination}: debited {} times", found.len()));
        }
    }
    for (id, destination, _) in &rows {
        if !debits.contains(id.as_str()) {
            violations.push(format!("withdrawal {id} ({destination}): no debit in the journal"));
        }
    }

    // 2. Each vendor effect at most once, and only for debited withdrawals.
    let ids: BTreeSet<&str> = rows.iter().map(|r| r.0.as_str()).collect();
    counts.quotes_booked = quotes["quotes"].as_u64().unwrap_or(0);
    counts.quotes_cancelled = quotes["cancelled"].as_u64().unwrap_or(0);
    counts.payouts_made = payouts["payouts"].as_u64().unwrap_or(0);
    let quoted = strings(&quotes["references"]);
    let paid = strings(&payouts["references"]);
    if counts.quotes_booked > quoted.len() as u64 {
        violations.push(format!(
            "fx vendor: {} quotes booked for {} withdrawals",
            counts.quotes_booked,
            quoted.len()
        ));
    }
    if counts.payouts_made > paid.len() as u64 {
        violations.push(format!(
            "payout vendor: {} payouts made for {} withdrawals",
            counts.payouts_made,
            paid.len()
        ));
    }
    for reference in quoted.iter().chain(paid.iter()) {
        if !ids.contains(reference.as_str()) {
            violations.push(format!("a vendor knows {reference}, which the ledger never debited"));
        }
    }
    if vendor.quotes_in_process() > 0 || vendor.in_process() > 0 {
        violations.push("the vendors still process requests after the run".to_owned());
    }

    // 3. Paid exactly when paid; credited back exactly when declined.
    for (id, destination, state) in &rows {
        let (at_vendor, reversed) = (paid.contains(id), reversals.contains(id.as_str()));
        match state.as_str() {
            "paid" if !at_vendor => violations.push(format!(
                "withdrawal {id} ({destination}) is paid, the vendor paid nothing"
            )),
            "paid" if reversed => violations.push(format!("withdrawal {id} ({destination}) is paid and credited back")),
            "declined" if at_vendor => violations.push(format!(
                "withdrawal {id} ({destination}) is declined, the vendor paid it"
            )),
            "declined" if !reversed => violations.push(format!(
                "withdrawal {id} ({destination}) is declined, never credited back"
            )),
            "paid" | "declined" => {}
            other => violations.push(format!("withdrawal {id} ({destination}) ended {other}")),
        }
    }

    // 4. Every operation final, and as its withdrawal.
    let mut state_of: BTreeMap<&str, &str> = BTreeMap::new();
    for (_, destination, state) in &rows {
        state_of.insert(destination.as_str(), state.as_str());
    }
    for asked in &workload.asked {
        let operation = operations.get(&asked.key).map(String::as_str);
        let withdrawal = state_of.get(asked.destination.as_str()).copied();
        let ok = match (operation, withdrawal) {
            (Some("completed"), Some("paid")) => !asked.closed,
            (Some("compensated"), Some("declined")) => true,
            // Short of funds: refused by its first step, nothing recorded.
            (None, None) => true,
            _ => false,
        };
        if !ok {
            violations.push(format!(
                "withdrawal {} to {}: operation {operation:?}, withdrawal {withdrawal:?}",
                asked.key, asked.destination
            ));
        }
        if asked.too_much && withdrawal.is_some() {
            violations.push(format!("withdrawal {}: debited beyond the balance", asked.key));
        }
    }

    // 5. What the clients got, and its replay.
    let replayer = client(token, 7)?;
    for asked in &workload.asked {
        let withdrawal = state_of.get(asked.destination.as_str()).copied();
        let first = match &asked.seen {
            Seen::Paid(body) if withdrawal == Some("paid") => body,
            Seen::Declined(body) if withdrawal != Some("paid") => body,
            Seen::Paid(_) | Seen::Declined(_) => {
                violations.push(format!(
                    "withdrawal {}: its client's answer says otherwise than the ledger ({withdrawal:?})",
                    asked.key
                ));
                continue;
            }
            Seen::Held | Seen::Unanswered => continue,
        };
        match send(&replayer, direct, "/v1/withdrawals", &asked.key, &asked.body).await {
            Ok((_, body, true)) if &body == first => counts.replays_checked += 1,
            // Refused by its first step: the key stays unused, so a retry
            // runs again and is refused again, for the same reason (with the
            // balance of now).
            Ok((422, body, false)) if withdrawal.is_none() && same_answer(&body, first) => counts.replays_checked += 1,
            Ok((status, body, replayed)) => violations.push(format!(
                "withdrawal {}: replayed {status} (marked {replayed}) differs from the first answer: {}",
                asked.key,
                String::from_utf8_lossy(&body)
            )),
            Err(e) => violations.push(format!("withdrawal {}: its last retry failed: {e:?}", asked.key)),
        }
    }
    for (state, n) in &counts.states {
        if !matches!(state.as_str(), "completed" | "compensated") && *n > 0 {
            violations.push(format!("{n} operation(s) {state} at the end"));
        }
    }

    // 6. The audit.
    let http = ledger::http_builder().timeout(Duration::from_secs(10)).build()?;
    let body = http
        .get(format!("{direct}/v1/audit"))
        .bearer_auth(token)
        .send()
        .await?
        .bytes()
        .await?;
    let audit: serde_json::Value =
        serde_json::from_slice(&body).map_err(|e| Error::Service(format!("audit is not JSON: {e}")))?;
    if audit["conserved"] != true {
        violations.push(format!("audit: not conserved: {audit}"));
    }
    if audit["negative_balances"] != 0 {
        violations.push(format!("audit: negative balances: {audit}"));
    }
    Ok(audit)
}
