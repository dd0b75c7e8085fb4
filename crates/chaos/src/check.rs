//! The history checker: run once the service is quiet.

use std::collections::HashMap;
use std::time::Duration;

use crate::db::Database;
use crate::workload::{Answer, Outcome};
use crate::{Config, Error};

/// Checks every property and appends what fails to `violations`; answers
/// the service's own audit.
pub(crate) async fn history(
    _config: &Config,
    database: &Database,
    direct: &str,
    token: &str,
    outcome: &Outcome,
    violations: &mut Vec<String>,
) -> Result<serde_json::Value, Error> {
    // The service's own audit.
    let http = ledger::http_builder().timeout(Duration::from_secs(30)).build()?;
    let audit: serde_json::Value = {
        let mut tries = 0;
        loop {
            tries += 1;
            match http.get(format!("{direct}/v1/audit")).bearer_auth(token).send().await {
                Ok(r) if r.status().is_success() => {
                    let bytes = r.bytes().await?;
                    break serde_json::from_slice(&bytes)
                        .map_err(|e| Error::Service(format!("audit is not JSON: {e}")))?;
                }
                _ if tries < 50 => tokio::time::sleep(Duration::from_millis(200)).await,
                Ok(r) => return Err(Error::Service(format!("audit answered {}", r.status()))),
                Err(e) => return Err(e.into()),
            }
        }
    };
    if audit["conserved"] != true {
        violations.push(format!("audit: not conserved: {audit}"));
    }
    if audit["negative_balances"] != 0 {
        violations.push(format!("audit: negative balances: {audit}"));
    }

    // The stored rows, read directly.
    let tenant = ledger::tenant_for_token(token);
    let stored = database.stored(tenant.as_str()).await?;
    let balances: i128 = stored.accounts.iter().map(|(_, b)| i128::from(*b)).sum();
    let mut per_account: HashMap<&str, i128> = HashMap::new();
    for (account, delta) in &stored.entries {
        *per_account.entry(account.as_str()).or_default() += i128::from(*delta);
    }
    let mut top_ups = 0i128;
    let mut payouts = 0i128;
    // Cancelled payouts (the harness cancels some it knows the vendor
    // never paid): their debit reversed.
    let mut reversals = 0i128;
    // Withdrawals (the ledger's audit counts them as money leaving), and the
    // credit-backs of declined ones.
    let mut withdrawals = 0i128;
    let mut credited_back = 0i128;
    let mut journal: HashMap<(&str, i64), u64> = HashMap::new();
    for (kind, amount) in &stored.journal {
        match kind.as_str() {
            "top_up" | "webhook_top_up" => top_ups += i128::from(*amount),
            "payout" => payouts += i128::from(*amount),
            "payout_reversal" => reversals += i128::from(*amount),
            "withdrawal" => withdrawals += i128::from(*amount),
            "withdrawal_reversal" => credited_back += i128::from(*amount),
            _ => {}
        }
        *journal.entry((kind.as_str(), *amount)).or_default() += 1;
    }
    if balances != top_ups - payouts + reversals - withdrawals + credited_back {
        violations.push(format!(
            "rows: balances {balances} != top-ups {top_ups} - payouts {payouts} + reversals {reversals} \
             - withdrawals {withdrawals} + credit-backs {credited_back}"
        ));
    }
    for (id, balance) in &stored.accounts {
        if *balance < 0 {
            violations.push(format!("rows: account {id} is negative ({balance})"));
        }
        let from_entries = per_account.get(id.as_str()).copied().unwrap_or(0);
        if from_entries != i128::from(*balance) {
            violations.push(format!(
                "rows: account {id} holds {balance} but its entries sum to {from_entries}"
            ));
        }
    }
    let world = per_account.get(ledger::db::WORLD).copied().unwrap_or(0);
    if world + balances != 0 {
        violations.push(format!(
            "rows: entries do not balance (world {world}, accounts {balances})"
        ));
    }

    // Every operation applied as its client was told, and never twice.
    let mut expected: HashMap<(&str, i64), &crate::workload::Op> = HashMap::new();
    for op in &outcome.ops {
        expected.insert((op.kind, op.amount), op);
        let applied = journal.get(&(op.kind, op.amount)).copied().unwrap_or(0);
        let ok = match op.answer {
            Answer::Applied => applied == 1,
            Answer::Rejected => applied == 0,
            Answer::Unknown => applied <= 1,
        };
        if !ok {
            violations.push(format!(
                "{} of {}: acknowledged {:?}, applied {applied} time(s)",
                op.kind, op.amount, op.answer
            ));
        }
        if let Some(first) = op.bodies.first()
            && op.bodies.iter().any(|b| b != first)
        {
            violations.push(format!("{} of {}: responses for one key differ", op.kind, op.amount));
        }
    }
    for ((kind, amount), n) in &journal {
        if *kind == "payout_reversal" {
            // A payout reversed at most once, and only one that was made.
            let made = journal.get(&("payout", *amount)).copied().unwrap_or(0);
            if *n > made {
                violations.push(format!(
                    "journal: {n} reversal(s) of payouts of {amount}, but {made} such payout(s)"
                ));
            }
            continue;
        }
        if !expected.contains_key(&(*kind, *amount)) {
            violations.push(format!("journal: {n} row(s) of {kind} {amount} match no operation"));
        }
    }
    for probe in &outcome.probes {
        for kind in ["top_up", "transfer", "payout"] {
            if journal.contains_key(&(kind, *probe)) {
                violations.push(format!("a key reused with another body was applied ({kind} {probe})"));
            }
        }
    }
    if stored.in_progress != 0 {
        violations.push(format!(
            "{} claim(s) left in progress after quiescence",
            stored.in_progress
        ));
    }
    Ok(audit)
}
