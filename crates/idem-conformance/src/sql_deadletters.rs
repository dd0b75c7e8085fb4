//! Tests of a SQL dead-letter table that the behavioural suite cannot say
//! without SQL: migrations and upgrades of older tables, and recording
//! inside the caller's transaction.
//!
//! A SQL store crate expands [`sql_letters!`](crate::sql_letters) in its
//! tests, which defines a small engine type implementing [`SqlLetters`],
//! seeds whatever is engine-specific (an old table's DDL, literals), and
//! calls these helpers for the part every engine shares.

use std::time::Duration;

use idem_core::{
    BoxFuture, DeadLetterState, DeadLetterStore, IdempotencyKey, NewDeadLetter, OutboundRequest, PendingMigration,
    Result, Scope, SentUnder,
};

/// A SQL engine's dead-letter store, as these tests drive it. Implemented by
/// [`sql_letters!`](crate::sql_letters).
pub trait SqlLetters: Send + Sync + 'static {
    /// The store.
    type Store: DeadLetterStore;

    /// The store on `table`, through this engine's pool.
    fn on(&self, table: &str) -> Self::Store;
    /// The store on `table` through a pool of its own, as another process
    /// would reach it.
    fn on_new_pool(&self, table: &str) -> BoxFuture<'_, Self::Store>;
    /// Creates or upgrades `store`'s table.
    fn migrate(store: &Self::Store) -> BoxFuture<'_, Result<()>>;
    /// What [`migrate`](Self::migrate) would run on `store`'s table.
    fn pending_migrations(store: &Self::Store) -> BoxFuture<'_, Result<Vec<PendingMigration>>>;
    /// Runs one statement; panics if it fails.
    fn execute(&self, sql: String) -> BoxFuture<'_, ()>;
    /// In one transaction, inserts the business row `name` into `payouts`
    /// and records `letter` in `store`, then commits it (or rolls it back
    /// unless `commit`). Answers the letter's id.
    fn record_with_row<'a>(
        &'a self,
        store: &'a Self::Store,
        payouts: &'a str,
        name: &'a str,
        letter: &'a NewDeadLetter,
        commit: bool,
    ) -> BoxFuture<'a, i64>;
    /// The names in the business table `payouts`.
    fn names(&self, payouts: &str) -> BoxFuture<'_, Vec<String>>;
}

/// Defines `$engine`, a struct with one field `pool: sqlx::Pool<$db>`, and
/// implements [`SqlLetters`](crate::sql_deadletters::SqlLetters) for it with
/// the store type `$store` (which has `with_table`, `migrate`,
/// `pending_migrations` and `record_in`). `new_pool: |engine| expr` opens
/// another pool on the same database (`expr` may `.await`).
///
/// It expands to code naming `sqlx` and `idem_core`, so the expanding crate
/// depends on both.
#[macro_export]
macro_rules! sql_letters {
    ($engine:ident, $store:ty, $db:ty, new_pool: |$this:ident| $new_pool:expr) => {
        /// The engine-specific parts of the SQL dead-letter tests.
        #[derive(Clone)]
        struct $engine {
            pool: ::sqlx::Pool<$db>,
        }

        impl $crate::sql_deadletters::SqlLetters for $engine {
            type Store = $store;

            fn on(&self, table: &str) -> $store {
                <$store>::with_table(self.pool.clone(), ::idem_core::TableName::new(table).unwrap())
            }

            fn on_new_pool(&self, table: &str) -> ::idem_core::BoxFuture<'_, $store> {
                let table = ::idem_core::TableName::new(table).unwrap();
                Box::pin(async move {
                    let $this = self;
                    <$store>::with_table($new_pool, table)
                })
            }

            fn migrate(store: &$store) -> ::idem_core::BoxFuture<'_, ::idem_core::Result<()>> {
                Box::pin(store.migrate())
            }

            fn pending_migrations(
                store: &$store,
            ) -> ::idem_core::BoxFuture<'_, ::idem_core::Result<Vec<::idem_core::PendingMigration>>> {
                Box::pin(store.pending_migrations())
            }

            fn execute(&self, sql: String) -> ::idem_core::BoxFuture<'_, ()> {
                Box::pin(async move {
                    ::sqlx::query(::sqlx::AssertSqlSafe(sql))
                        .execute(&self.pool)
                        .await
                        .unwrap();
                })
            }

            fn record_with_row<'a>(
                &'a self,
                store: &'a $store,
                payouts: &'a str,
                name: &'a str,
                letter: &'a ::idem_core::NewDeadLetter,
                commit: bool,
            ) -> ::idem_core::BoxFuture<'a, i64> {
                Box::pin(async move {
                    let mut tx = self.pool.begin().await.unwrap();
                    ::sqlx::query(::sqlx::AssertSqlSafe(format!(
                        "INSERT INTO {payouts} (name) VALUES ('{name}')"
                    )))
                    .execute(&mut *tx)
                    .await
                    .unwrap();
                    let id = store.record_in(&mut tx, letter).await.unwrap();
                    if commit {
                        tx.commit().await.unwrap();
                    } else {
                        tx.rollback().await.unwrap();
                    }
                    id
                })
            }

            fn names(&self, payouts: &str) -> ::idem_core::BoxFuture<'_, Vec<String>> {
                let sql = format!("SELECT name FROM {payouts}");
                Box::pin(async move {
                    ::sqlx::query_scalar(::sqlx::AssertSqlSafe(sql))
                        .fetch_all(&self.pool)
                        .await
                        .unwrap()
                })
            }
        }
    };
}

/// The letter these tests record: `tenant`'s payout `key`, dead after two
/// attempts that timed out.
pub fn letter(tenant: &str, key: &str) -> NewDeadLetter {
    NewDeadLetter::new(
        Scope::parse(tenant, "payout").unwrap(),
        IdempotencyKey::new(key).unwrap(),
        OutboundRequest::new("POST", "http://vendor/v1/payouts", vec![], b"{}".to_vec()).unwrap(),
        2,
        "timeout",
    )
}

/// Migrates `table` from `racers` pools of their own at once; every one
/// must succeed (`expect` says what).
async fn race_migrations<E: SqlLetters>(engine: &E, table: &str, racers: usize, expect: &str) {
    let mut spawned = Vec::new();
    for _ in 0..racers {
        let letters = engine.on_new_pool(table).await;
        spawned.push(tokio::spawn(async move { E::migrate(&letters).await }));
    }
    for racer in spawned {
        racer.await.unwrap().expect(expect);
    }
}

/// A dead letter recorded in the caller's transaction commits with the
/// business row, and vanishes with it on rollback. Creates the business
/// table `payouts` by `create_payouts`, records letters `letter("kept")`
/// and `letter("dropped")` in `store`, and drops the tables `drops` before
/// asserting.
pub async fn record_in_follows_the_transaction<E: SqlLetters>(
    engine: &E,
    store: &E::Store,
    payouts: &str,
    create_payouts: String,
    drops: &[&str],
    letter: impl Fn(&str) -> NewDeadLetter,
) {
    engine.execute(create_payouts).await;
    let kept = engine
        .record_with_row(store, payouts, "kept", &letter("kept"), true)
        .await;
    let dropped = engine
        .record_with_row(store, payouts, "dropped", &letter("dropped"), false)
        .await;

    let names = engine.names(payouts).await;
    let found = store.get(kept).await.unwrap();
    let gone = letter("dropped");
    let dropped_by_id = store.get(dropped).await.unwrap();
    let dropped_by_key = store.find(&gone.scope, &gone.key).await.unwrap();
    for table in drops {
        engine.execute(format!("DROP TABLE {table}")).await;
    }
    assert_eq!(names, vec!["kept".to_owned()]);
    let found = found.expect("committed with the transaction");
    assert_eq!(found.key.as_str(), "kept");
    assert!(dropped_by_id.is_none(), "rolled back");
    assert!(dropped_by_key.is_none(), "rolled back");
}

/// Migrating twice, and from four pools at once, is harmless; the pending
/// list names the DDL until `table` exists.
pub async fn migrate_is_idempotent_and_listed_until_applied<E: SqlLetters>(engine: &E, table: &str) {
    let letters = engine.on(table);
    let pending = E::pending_migrations(&letters).await.unwrap();
    assert_eq!(pending.len(), 1);
    assert!(pending[0].statements[0].contains(&format!("CREATE TABLE IF NOT EXISTS {table}")));
    race_migrations(engine, table, 4, "concurrent migrations all succeed").await;
    assert!(E::pending_migrations(&letters).await.unwrap().is_empty());
    let id = letters.record(&letter("t", "k")).await.unwrap();
    E::migrate(&letters).await.unwrap();
    assert!(
        letters.get(id).await.unwrap().is_some(),
        "migrating again keeps the rows"
    );
}

/// `table`, seeded by the caller as a table of the first schema version
/// holding letter `old_id` (tenant `t`, dead after 3 attempts), is upgraded
/// by three pools at once, the row kept; a letter of an outcome unknown is
/// accepted after. Answers the store on `table`.
pub async fn version_1_table_is_upgraded<E: SqlLetters>(engine: &E, table: &str, old_id: i64) -> E::Store {
    let letters = engine.on(table);
    assert_eq!(E::pending_migrations(&letters).await.unwrap()[0].version, 2);
    race_migrations(engine, table, 3, "concurrent upgrades all succeed").await;
    assert!(E::pending_migrations(&letters).await.unwrap().is_empty());
    let old = letters.get(old_id).await.unwrap().expect("the row survives");
    assert_eq!(
        (old.state, old.attempts, old.first_reached_at_ms),
        (DeadLetterState::Dead, 3, None)
    );
    let id = letters.record(&letter("t", "new").outcome_unknown()).await.unwrap();
    assert_eq!(letters.get(id).await.unwrap().unwrap().state, DeadLetterState::Unknown);
    letters
}

/// A table of schema version 2 (no send terms) is upgraded in place: its
/// rows kept without terms, and letters recorded after keep theirs. Makes
/// `table` of the latest version, drops the send terms' columns and inserts
/// an old row with the engine's literals `body` and `last_error`; records
/// `new` after the upgrade.
pub async fn version_2_table_is_upgraded<E: SqlLetters>(
    engine: &E,
    table: &str,
    body: &str,
    last_error: &str,
    new: NewDeadLetter,
) {
    let letters = engine.on(table);
    E::migrate(&letters).await.unwrap();
    for column in ["key_horizon_ms", "horizon_margin_ms", "settle_ms"] {
        engine
            .execute(format!("ALTER TABLE {table} DROP COLUMN {column}"))
            .await;
    }
    engine
        .execute(format!(
            "INSERT INTO {table} (tenant, operation, idem_key, method, url, headers, body, attempts, last_error, \
             state, created_at_ms, updated_at_ms, first_reached_at_ms) VALUES ('t', 'payout', 'old', 'POST', \
             'http://v/v1/payouts', '[]', {body}, 3, {last_error}, 'dead', 1, 1, 1)"
        ))
        .await;
    let pending = E::pending_migrations(&letters).await.unwrap();
    assert_eq!(
        pending.iter().map(|m| m.version).collect::<Vec<_>>(),
        vec![3],
        "{pending:?}"
    );
    E::migrate(&letters).await.unwrap();
    assert!(E::pending_migrations(&letters).await.unwrap().is_empty());
    let scope = Scope::parse("t", "payout").unwrap();
    let old = letters
        .find(&scope, &IdempotencyKey::new("old").unwrap())
        .await
        .unwrap()
        .expect("the row survives");
    assert_eq!(
        (old.attempts, old.first_reached_at_ms, old.sent_under),
        (3, Some(1), None)
    );
    let terms = SentUnder {
        key_horizon: Duration::ZERO,
        horizon_margin: Duration::ZERO,
        settle: Duration::from_secs(35),
    };
    let id = letters.record(&new.sent_under(terms)).await.unwrap();
    assert_eq!(letters.get(id).await.unwrap().unwrap().sent_under, Some(terms));
}
