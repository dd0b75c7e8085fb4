//! The payout properties, judged over what was read back: each committed
//! payout paid exactly once at the vendor, none lost, nothing paid that no
//! transaction committed, nothing refunded that the vendor paid.

use std::collections::{BTreeMap, BTreeSet};

use idem_core::DeadLetterState;

use super::VendorLedger;

/// The payout rows read back.
#[derive(Debug, Clone, Default)]
pub(crate) struct PayoutRows {
    /// Per payout id: its amount and state.
    pub(crate) payouts: BTreeMap<String, (i64, String)>,
    /// Per dead letter of a payout: its key (the payout id) and state.
    pub(crate) dead_letters: Vec<(String, DeadLetterState)>,
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
        violations.extend(some(ids, |n| {
            format!("{n} committed payout(s) lost: left {state} after the redrive")
        }));
    }
    let unpaid: Vec<_> = paid.difference(&keys).collect();
    violations.extend(some(&unpaid, |n| {
        format!("{n} payout(s) marked paid that the vendor never paid")
    }));
    let phantom: Vec<_> = keys.difference(&committed).collect();
    violations.extend(some(&phantom, |n| {
        format!("the vendor paid {n} key(s) of no committed payout")
    }));
    let not_marked: Vec<_> = keys.intersection(&committed).filter(|k| !paid.contains(*k)).collect();
    violations.extend(some(&not_marked, |n| {
        format!("the vendor paid {n} payout(s) the ledger does not record as paid")
    }));
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

/// The violation that `found` is, unless it is empty: `what` says it of
/// their number, and the first five are named.
fn some<T: std::fmt::Debug>(found: &[T], what: impl FnOnce(usize) -> String) -> Option<String> {
    (!found.is_empty()).then(|| {
        format!(
            "payouts: {}, e.g. {:?}",
            what(found.len()),
            &found[..found.len().min(5)]
        )
    })
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
        let with_dead_letter = |key: &str, state: DeadLetterState| PayoutRows {
            dead_letters: vec![(key.to_owned(), state)],
            ..rows()
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
                with_dead_letter("b", DeadLetterState::Dead),
                vendor(2, 30, &["a", "b"]),
                acked(),
            ),
            (
                "a dead letter of no committed payout",
                with_dead_letter("q", DeadLetterState::Resolved),
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
