//! The server sweeps every keyed table it writes — request keys, webhook
//! and projection inboxes, job runs, payout leases — on every engine:
//! expired rows go, live ones stay.

mod common;

use std::time::{Duration, Instant};

use common::*;
use idem_core::{Clock, IdempotencyKey, KeyAdmin, ManualClock, Operation, Policy, Scope, Tenant, TxEngine};
use ledger::db::LedgerDb;

const HANDLER: &str = "sweep-test";

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
/// their absence later can only be the sweeper's doing.
async fn seed_and_read_back<D: LedgerDb + KeyAdmin>(db: &D, tag: &str) {
    seed(db, tag).await;
    let before = left(db, tag).await;
    assert!(before.iter().all(|(_, old, live)| *old && *live), "{before:?}");
}

/// Waits until the expired rows are gone from every table, the live ones
/// kept throughout.
async fn wait_swept<D: LedgerDb + KeyAdmin>(db: &D, tag: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let now = left(db, tag).await;
        assert!(now.iter().all(|(_, _, live)| *live), "live rows are kept: {now:?}");
        if now.iter().all(|(_, old, _)| !*old) {
            return;
        }
        assert!(Instant::now() < deadline, "expired rows left after 30 s: {now:?}");
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
    if engine == Engine::Sqlite {
        for suffix in ["", "-wal", "-shm", "-idem.lock"] {
            let _ = std::fs::remove_file(format!("{url}{suffix}"));
        }
    }
}

idem_conformance::cases!(the_server_sweeps_every_keyed_table, 4 => {
    sqlite(Engine::Sqlite);
    postgres(Engine::Postgres);
    mysql(Engine::Mysql);
});
