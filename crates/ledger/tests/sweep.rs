//! The server sweeps every keyed table it writes — request keys, webhook
//! and projection inboxes, job runs, payout leases — on every engine:
//! expired rows go, live ones stay; and it purges the multi-step operations
//! that ended and expired, never one still running, held or compensating.

mod common;

use std::time::{Duration, Instant};

use common::*;
use idem_core::multistep::{HoldKind, MultiStep, MultiStepStore, NewMultiStep};
use idem_core::{
    Clock, Fingerprint, IdempotencyKey, KeyAdmin, ManualClock, Operation, Policy, Scope, Tenant, TxEngine,
};
use ledger::db::LedgerDb;

const HANDLER: &str = "sweep-test";

const DAY_MS: i64 = 86_400_000;

/// The operations seeded, by key, and whether the sweeper may delete each:
/// only the final ones past their expiry. The others' times are ten days
/// old too.
const OPERATIONS: [(&str, bool); 6] = [
    ("completed-long-ago", true),
    ("compensated-long-ago", true),
    ("completed-now", false),
    ("running-long-ago", false),
    ("held-long-ago", false),
    ("compensating-long-ago", false),
];

fn operation_scope(tag: &str) -> Scope {
    Scope::parse(tag, "POST /v1/withdrawals").unwrap()
}

/// Writes the [`OPERATIONS`] as runs would have left them, each kept a
/// day once ended. Their definition is one no completer knows, so none
/// runs them.
async fn seed_operations<D: LedgerDb>(db: &D, tag: &str) {
    let steps = db.multi_steps();
    let now = idem_core::SystemClock.now_ms();
    let long_ago = now - 10 * DAY_MS;
    for (key, _) in OPERATIONS {
        let scope = operation_scope(tag);
        let new = NewMultiStep {
            fingerprint: Fingerprint::of_bytes(scope.operation(), b"{}"),
            scope,
            key: IdempotencyKey::new(key).unwrap(),
            definition: "sweep-test@1".into(),
            input: b"{}".to_vec(),
            ttl_ms: DAY_MS,
        };
        let at = if key == "completed-now" { now } else { long_ago };
        let row = MultiStep::created(&new, 1, at, 30_000).unwrap();
        let mut tx = db.begin().await.unwrap();
        let id = MultiStepStore::<D>::insert_in(&steps, &mut tx, &row)
            .await
            .unwrap()
            .expect("a new operation");
        db.commit(tx).await.unwrap();
        let mut row = MultiStepStore::<D>::get(&steps, id).await.unwrap().unwrap();
        let failed = serde_json::json!({ "declined": true });
        match key {
            "completed-long-ago" | "completed-now" => row.finish(1, b"{}".to_vec(), at + 1).unwrap(),
            "compensated-long-ago" => {
                row.fail(1, failed, at + 1).unwrap();
                row.finish(1, b"{}".to_vec(), at + 2).unwrap();
            }
            "held-long-ago" => row.hold(1, HoldKind::Failed, "broken", at + 1).unwrap(),
            "compensating-long-ago" => row.fail(1, failed, at + 1).unwrap(),
            _ => {}
        }
        if !row.state.is_final() {
            row.expires_at_ms = Some(long_ago);
        }
        MultiStepStore::<D>::write(&steps, &row).await.unwrap();
    }
}

/// Which of the seeded operations are still stored.
async fn operations_left<D: LedgerDb>(db: &D, tag: &str) -> Vec<(&'static str, bool, bool)> {
    let (steps, scope) = (db.multi_steps(), operation_scope(tag));
    let mut out = Vec::new();
    for (key, deletable) in OPERATIONS {
        let found = MultiStepStore::<D>::find(&steps, &scope, &IdempotencyKey::new(key).unwrap())
            .await
            .unwrap();
        out.push((key, deletable, found.is_some()));
    }
    out
}

/// Writes an expired row (claimed ten days ago, kept a day) and a live one
/// in each table.
async fn seed<D: LedgerDb + KeyAdmin>(db: &D, tag: &str) {
    let old = ManualClock::new(idem_core::SystemClock.now_ms() - 10 * 86_400_000);
    for table in ledger::sweeper::tables() {
        for (clock, key) in [
            (
                std::sync::Arc::new(old.clone()) as idem_core::SharedClock,
                format!("{tag}-old"),
            ),
            (idem_core::system_clock(), format!("{tag}-live")),
        ] {
            let inbox = idem_inbox::Inbox::new(TxEngine::new(db.keyed(table.clone())).with_clock(clock))
                .with_tenant(Tenant::new(tag).unwrap())
                .with_policy(Policy::default().with_ttl_secs(86_400));
            let applied = inbox
                .process(HANDLER, &key, b"", |_tx| {
                    Box::pin(async { Ok::<_, idem_core::Error>(()) })
                })
                .await
                .unwrap_or_else(|e| panic!("seed {table}: {e}"));
            assert!(applied.is_applied());
        }
    }
}

/// Which of the seeded keys are still stored, per table.
async fn left<D: LedgerDb + KeyAdmin>(db: &D, tag: &str) -> Vec<(String, bool, bool)> {
    let scope = Scope::new(Tenant::new(tag).unwrap(), Operation::new(HANDLER).unwrap());
    let now = idem_core::SystemClock.now_ms();
    let mut out = Vec::new();
    for table in ledger::sweeper::tables() {
        let store = db.keyed(table.clone());
        let has = |key: String| {
            let (store, scope) = (&store, &scope);
            async move {
                store
                    .find_key(scope, &IdempotencyKey::new(key).unwrap(), now)
                    .await
                    .unwrap()
                    .is_some()
            }
        };
        out.push((
            table.as_str().to_owned(),
            has(format!("{tag}-old")).await,
            has(format!("{tag}-live")).await,
        ));
    }
    out
}

/// Seeds the rows and checks that both are stored in every table, so that
/// their absence later can only be the sweeper's doing; and the
/// operations.
async fn seed_and_read_back<D: LedgerDb + KeyAdmin>(db: &D, tag: &str) {
    seed(db, tag).await;
    let before = left(db, tag).await;
    assert!(before.iter().all(|(_, old, live)| *old && *live), "{before:?}");
    seed_operations(db, tag).await;
    let before = operations_left(db, tag).await;
    assert!(before.iter().all(|(_, _, there)| *there), "{before:?}");
}

/// Waits until the expired rows are gone from every table, the live ones
/// kept throughout.
async fn wait_swept<D: LedgerDb + KeyAdmin>(db: &D, tag: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let now = left(db, tag).await;
        assert!(now.iter().all(|(_, _, live)| *live), "live rows are kept: {now:?}");
        let ops = operations_left(db, tag).await;
        assert!(
            ops.iter().all(|(_, deletable, there)| *deletable || *there),
            "operations not final or not expired are kept: {ops:?}"
        );
        if now.iter().all(|(_, old, _)| !*old) && ops.iter().all(|(_, deletable, there)| !(*deletable && *there)) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "expired rows left after 30 s: {now:?} {ops:?}"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

async fn the_server_sweeps_every_keyed_table(engine: Engine) {
    let url = database_url(engine);
    let store = connect(&url).await;
    let tag = format!("sw{}", &uuid::Uuid::now_v7().simple().to_string()[20..]);
    // Seeded and read back before the server starts: it sweeps every
    // second, so a read after its start could find an expired row already
    // gone, however quickly it came.
    match &store {
        ledger::Store::Postgres(db) => seed_and_read_back(db, &tag).await,
        ledger::Store::MySql(db) => seed_and_read_back(db, &tag).await,
        ledger::Store::Sqlite(db) => seed_and_read_back(db, &tag).await,
    }
    let ledger = Instance::start_with(&url, &["--sweep-every-secs", "1"]);
    match &store {
        ledger::Store::Postgres(db) => wait_swept(db, &tag).await,
        ledger::Store::MySql(db) => wait_swept(db, &tag).await,
        ledger::Store::Sqlite(db) => wait_swept(db, &tag).await,
    }
    drop(ledger);
    remove_database_files(engine, &url);
}

idem_conformance::cases!(the_server_sweeps_every_keyed_table, 4 => {
    sqlite(Engine::Sqlite);
    postgres(Engine::Postgres);
    mysql(Engine::Mysql);
});
