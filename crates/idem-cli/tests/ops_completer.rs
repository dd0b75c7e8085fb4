//! The operator's commands and the service's completer together, on a
//! SQLite file: an operation whose payout answer was lost is held on an
//! unknown outcome, `idem ops mark --applied` gives the vendor's record,
//! and the completer finishes it from that record, paying nothing again;
//! an operation held failed is cancelled with `idem ops cancel`, and the
//! completer runs its compensation once. Every effect is counted.

mod support;

#[path = "../examples/stuck_operations/shop.rs"]
mod shop;

use idem_core::Scope;
use idem_core::multistep::{HoldKind, MultiStepState, MultiStepStore};
use idem_gateway::AnyLease;
use idem_sqlite::{SqliteMultiSteps, SqliteStore};
use idem_steps::{Finished, Registry, StepsEngine};
use shop::{Withdrawal, count, create_tables, withdrawal};
use support::{idem_out as idem, tag};

/// The account movements of `kind` (`debit`, `credit`).
async fn effects(pool: &sqlx::SqlitePool, kind: &str) -> i64 {
    count(
        pool,
        &format!("SELECT COUNT(*) FROM shop_movements WHERE kind = '{kind}'"),
    )
    .await
}

/// The payouts the vendor made (its answers were all lost).
async fn paid(pool: &sqlx::SqlitePool) -> i64 {
    count(pool, "SELECT COUNT(*) FROM vendor_payouts").await
}

/// One id of an operation `idem ops list <filters>` lists.
fn only_listed(url: &str, filters: &[&str]) -> i64 {
    let mut args = vec!["ops", "list", "--store", url, "--json"];
    args.extend_from_slice(filters);
    let (code, v, out) = idem(&args);
    assert_eq!(code, 0, "{out}");
    let listed = v.as_array().unwrap_or_else(|| panic!("{out}"));
    assert_eq!(listed.len(), 1, "{out}");
    listed[0]["id"].as_i64().unwrap()
}

/// A held payout marked applied by the operator is finished by the completer from the vendor's record, paid once; a failed one cancelled by the operator is compensated once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn marked_and_cancelled_operations_are_finished_by_the_completer_once() {
    let url = std::env::temp_dir()
        .join(format!("idem-cli-ops-completer-{}.db", tag()))
        .display()
        .to_string();
    let (code, _, out) = idem(&["migrate", "--store", &url, "--operations"]);
    assert_eq!(code, 0, "{out}");
    let AnyLease::Sqlite(store) = AnyLease::open(&url).await.unwrap() else {
        unreachable!()
    };
    let pool = store.pool().clone();
    create_tables(&pool).await.unwrap();
    let steps = SqliteMultiSteps::new(pool.clone());
    let engine = StepsEngine::new(store.clone(), steps.clone());
    let op = Withdrawal { pool: pool.clone() };
    let registry = Registry::new().with(Withdrawal { pool: pool.clone() });
    let scope = Scope::parse("ops-e2e", "POST /v1/withdrawals").unwrap();
    let call = |key: &str, amount: i64| withdrawal(&scope, key, amount).unwrap();

    // The vendor pays, its answer is lost: held on an unknown outcome.
    let lost = call("w-lost", 100);
    let first = engine.execute(&op, &lost, &100).await.unwrap();
    assert_eq!(first, Finished::Held(HoldKind::Unknown));
    assert_eq!((paid(&pool).await, effects(&pool, "debit").await), (1, 1));
    // Nothing finishes it on its own: not the completer, not a retry.
    assert_eq!(engine.complete_due(&registry, 10).await.unwrap().taken, 0);
    assert_eq!(
        engine.execute(&op, &lost, &100).await.unwrap(),
        Finished::Held(HoldKind::Unknown)
    );
    // The operator finds it, checks the vendor, and gives its record.
    let id = only_listed(&url, &["--state", "held", "--step", "payout"]);
    let record = support::temp("ops", "po.json");
    std::fs::write(&record, r#"{"id":"po_42","amount":100}"#).unwrap();
    let (code, _, out) = idem(&[
        "ops",
        "mark",
        &id.to_string(),
        "--store",
        &url,
        "--applied",
        "--status",
        "201",
        "--body-file",
        &record,
        "--note",
        "paid on the vendor's dashboard",
        "--by",
        "alice",
    ]);
    assert_eq!(code, 0, "{out}");
    let pass = engine.complete_due(&registry, 10).await.unwrap();
    assert_eq!((pass.taken, pass.completed), (1, 1), "{pass:?}");
    assert_eq!(
        (paid(&pool).await, effects(&pool, "debit").await),
        (1, 1),
        "paid once, debited once"
    );
    let row = MultiStepStore::<SqliteStore>::get(&steps, id).await.unwrap().unwrap();
    assert_eq!(row.state, MultiStepState::Completed);
    assert_eq!(row.response.as_deref(), Some(&br#""po_42""#[..]));
    let again = engine.execute(&op, &lost, &100).await.unwrap();
    assert_eq!(
        again,
        Finished::Completed {
            output: "po_42".into(),
            replayed: true
        }
    );
    assert_eq!(engine.complete_due(&registry, 10).await.unwrap().taken, 0);

    // Over the limit: held failed after the debit, with no send open.
    let over = call("w-over", 5_000);
    let first = engine.execute(&op, &over, &5_000).await.unwrap();
    assert_eq!(first, Finished::Held(HoldKind::Failed));
    let id = only_listed(
        &url,
        &["--state", "held", "--tenant", "ops-e2e", "--recovery-point", "1"],
    );
    let (code, _, out) = idem(&[
        "ops",
        "cancel",
        &id.to_string(),
        "--store",
        &url,
        "--reason",
        "over the daily limit",
    ]);
    assert_eq!(code, 0, "{out}");
    let pass = engine.complete_due(&registry, 10).await.unwrap();
    assert_eq!((pass.taken, pass.compensated), (1, 1), "{pass:?}");
    assert_eq!(engine.complete_due(&registry, 10).await.unwrap().taken, 0);
    assert_eq!(
        (effects(&pool, "debit").await, effects(&pool, "credit").await),
        (2, 1),
        "credited back once"
    );
    assert_eq!(paid(&pool).await, 1, "nothing paid for it");
    let again = engine.execute(&op, &over, &5_000).await.unwrap();
    assert_eq!(
        again,
        Finished::Compensated {
            failure: serde_json::json!({ "cancelled": "over the daily limit" }),
            replayed: true
        }
    );
    let (code, v, out) = idem(&["ops", "show", &id.to_string(), "--store", &url, "--json"]);
    assert_eq!(code, 0, "{out}");
    let journal: Vec<(&str, bool)> = v["journal"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| (e["name"].as_str().unwrap(), e["compensation"].as_bool().unwrap()))
        .collect();
    assert_eq!(journal, [("debit", false), ("credit-back", true)], "{v}");
    let _ = std::fs::remove_file(&record);
    for suffix in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{url}{suffix}"));
    }
}
