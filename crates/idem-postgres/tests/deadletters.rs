//! The dead-letter conformance suite against PostgreSQL, and recording
//! inside the caller's transaction.
//!
//! The database comes from `IDEM_TEST_POSTGRES_URL` (default
//! `postgres://postgres@127.0.0.1:5432/test`); the tests fail, never skip, when
//! it is unreachable.

mod common;

use std::time::Duration;

use common::{Isolation, database_url, isolated_table, open_pool, open_pool_at};
use idem_conformance::{DeadLetterSubject, deadletter_conformance};
use idem_core::{
    BoxFuture, DeadLetterState, DeadLetterStore, IdempotencyKey, NewDeadLetter, OutboundRequest, Scope, SentUnder,
    TableName,
};
use idem_postgres::{PgDeadLetters, store_error};

/// The dead-letter table most tests share; they use unique tenants, so they
/// never see each other's letters.
const SHARED_TABLE: &str = "idem_conformance_dead_letters";

#[derive(Clone)]
struct PgLetters {
    letters: PgDeadLetters,
    url: String,
    isolation: Isolation,
}

impl PgLetters {
    async fn connect(isolation: Isolation, table: &str) -> Self {
        let url = database_url();
        let pool = open_pool_at(&url, isolation).await;
        let letters = PgDeadLetters::with_table(pool, TableName::new(table).unwrap());
        // Every test of a module migrates the same table at once.
        letters.migrate().await.expect("migrate the shared dead-letter table");
        Self {
            letters,
            url,
            isolation,
        }
    }
}

impl DeadLetterSubject for PgLetters {
    type Store = PgDeadLetters;

    fn store(&self) -> PgDeadLetters {
        self.letters.clone()
    }

    fn another(&self) -> BoxFuture<'_, PgDeadLetters> {
        Box::pin(async move {
            let pool = open_pool_at(&self.url, self.isolation).await;
            PgDeadLetters::with_table(pool, self.letters.table().clone())
        })
    }

    fn isolated(&self) -> BoxFuture<'_, Self> {
        Box::pin(async move {
            let table = isolated_table(self.letters.pool()).await;
            let letters = PgDeadLetters::with_table(self.letters.pool().clone(), table);
            letters.migrate().await.expect("migrate an isolated dead-letter table");
            Self {
                letters,
                url: self.url.clone(),
                isolation: self.isolation,
            }
        })
    }

    fn elapse(&self, ms: u64) -> BoxFuture<'_, ()> {
        // The store reads PostgreSQL's clock, which only real time moves.
        Box::pin(tokio::time::sleep(Duration::from_millis(ms)))
    }
}

deadletter_conformance!(
    postgres_deadletters,
    PgLetters::connect(Isolation::ReadCommitted, SHARED_TABLE)
);
// Redrives taken concurrently answer `None`, not a serialisation failure,
// on connections whose default level is SERIALIZABLE.
deadletter_conformance!(
    postgres_deadletters_serializable,
    PgLetters::connect(Isolation::Serializable, SHARED_TABLE)
);

fn letter(tenant: &str, key: &str) -> NewDeadLetter {
    NewDeadLetter::new(
        Scope::parse(tenant, "payout").unwrap(),
        IdempotencyKey::new(key).unwrap(),
        OutboundRequest::new("POST", "http://vendor/v1/payouts", vec![], b"{}".to_vec()).unwrap(),
        2,
        "timeout",
    )
}

/// A dead letter recorded in the caller's transaction commits with the business row, and vanishes with it on rollback.
#[tokio::test]
async fn record_in_commits_and_rolls_back_with_the_transaction() {
    let pool = open_pool(&database_url()).await;
    let table = isolated_table(&pool).await;
    let letters = PgDeadLetters::with_table(pool.clone(), table.clone());
    letters.migrate().await.unwrap();
    let payouts = format!("{table}_payouts");
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE {payouts} (name TEXT NOT NULL)"
    )))
    .execute(&pool)
    .await
    .unwrap();
    let tenant = format!("tenant-{}", uuid::Uuid::new_v4());

    let mut tx = pool.begin().await.map_err(store_error).unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO {payouts} (name) VALUES ('kept')"
    )))
    .execute(&mut *tx)
    .await
    .unwrap();
    let kept = letters.record_in(&mut tx, &letter(&tenant, "kept")).await.unwrap();
    tx.commit().await.unwrap();

    let mut tx = pool.begin().await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO {payouts} (name) VALUES ('dropped')"
    )))
    .execute(&mut *tx)
    .await
    .unwrap();
    let dropped = letters.record_in(&mut tx, &letter(&tenant, "dropped")).await.unwrap();
    tx.rollback().await.unwrap();

    let names: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!("SELECT name FROM {payouts}")))
        .fetch_all(&pool)
        .await
        .unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!("DROP TABLE {payouts}")))
        .execute(&pool)
        .await
        .unwrap();
    assert_eq!(names, vec!["kept".to_owned()]);
    let found = letters
        .get(kept)
        .await
        .unwrap()
        .expect("committed with the transaction");
    assert_eq!(found.key.as_str(), "kept");
    assert!(letters.get(dropped).await.unwrap().is_none(), "rolled back");
    let gone = letter(&tenant, "dropped");
    assert!(letters.find(&gone.scope, &gone.key).await.unwrap().is_none());
}

/// Migrating twice, and from several pools at once, is harmless; the pending list names the DDL until the table exists.
#[tokio::test]
async fn migrate_is_idempotent_and_listed_until_applied() {
    let pool = open_pool(&database_url()).await;
    let table = isolated_table(&pool).await;
    let letters = PgDeadLetters::with_table(pool.clone(), table.clone());
    let pending = letters.pending_migrations().await.unwrap();
    assert_eq!(pending.len(), 1);
    assert!(pending[0].statements[0].contains(&format!("CREATE TABLE IF NOT EXISTS {table}")));
    let mut racers = Vec::new();
    for _ in 0..4 {
        let letters = PgDeadLetters::with_table(open_pool(&database_url()).await, table.clone());
        racers.push(tokio::spawn(async move { letters.migrate().await }));
    }
    for racer in racers {
        racer.await.unwrap().expect("concurrent migrations all succeed");
    }
    assert!(letters.pending_migrations().await.unwrap().is_empty());
    let id = letters.record(&letter("t", "k")).await.unwrap();
    letters.migrate().await.unwrap();
    assert!(
        letters.get(id).await.unwrap().is_some(),
        "migrating again keeps the rows"
    );
}

/// A table of the first schema version (an unnamed three-state check, no first reach or verdicts) is upgraded in place, rows kept, the new states accepted after; concurrent upgrades are harmless.
#[tokio::test]
async fn a_version_1_table_is_upgraded_with_its_rows() {
    let pool = open_pool(&database_url()).await;
    let table = isolated_table(&pool).await;
    let t = table.as_str();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE {t} (id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY, tenant TEXT COLLATE \"C\" NOT NULL, \
         operation TEXT COLLATE \"C\" NOT NULL, idem_key TEXT COLLATE \"C\" NOT NULL, method TEXT NOT NULL, \
         url TEXT NOT NULL, headers TEXT NOT NULL, body BYTEA NOT NULL, attempts BIGINT NOT NULL, \
         last_error BYTEA NOT NULL, state TEXT COLLATE \"C\" NOT NULL CHECK (state IN ('dead', 'redriving', 'resolved')), \
         redrives BIGINT NOT NULL DEFAULT 0, created_at_ms BIGINT NOT NULL, updated_at_ms BIGINT NOT NULL, \
         redrive_until_ms BIGINT NULL, response_status INTEGER NULL, response_body BYTEA NULL, \
         UNIQUE (tenant, operation, idem_key))"
    )))
    .execute(&pool)
    .await
    .unwrap();
    let old_id: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "INSERT INTO {t} (tenant, operation, idem_key, method, url, headers, body, attempts, last_error, state, \
         created_at_ms, updated_at_ms) VALUES ('t', 'payout', 'old', 'POST', 'http://v/v1/payouts', '[]', '\\x7b7d', \
         3, 'timeout'::bytea, 'dead', 1, 1) RETURNING id"
    )))
    .fetch_one(&pool)
    .await
    .unwrap();
    let letters = PgDeadLetters::with_table(pool.clone(), table.clone());
    assert_eq!(letters.pending_migrations().await.unwrap()[0].version, 2);
    let mut racers = Vec::new();
    for _ in 0..3 {
        let letters = PgDeadLetters::with_table(open_pool(&database_url()).await, table.clone());
        racers.push(tokio::spawn(async move { letters.migrate().await }));
    }
    for racer in racers {
        racer.await.unwrap().expect("concurrent upgrades all succeed");
    }
    assert!(letters.pending_migrations().await.unwrap().is_empty());
    let old = letters.get(old_id).await.unwrap().expect("the row survives");
    assert_eq!(
        (old.state, old.attempts, old.first_reached_at_ms),
        (DeadLetterState::Dead, 3, None)
    );
    let id = letters.record(&letter("t", "new").outcome_unknown()).await.unwrap();
    assert_eq!(letters.get(id).await.unwrap().unwrap().state, DeadLetterState::Unknown);
}

/// A table of schema version 2 (no send terms) is upgraded in place: its rows kept without terms, and letters recorded after keep theirs.
#[tokio::test]
async fn a_version_2_table_is_upgraded_with_its_rows() {
    let pool = open_pool(&database_url()).await;
    let table = isolated_table(&pool).await;
    let t = table.as_str();
    let letters = PgDeadLetters::with_table(pool.clone(), table.clone());
    letters.migrate().await.unwrap();
    for column in ["key_horizon_ms", "horizon_margin_ms", "settle_ms"] {
        sqlx::query(sqlx::AssertSqlSafe(format!("ALTER TABLE {t} DROP COLUMN {column}")))
            .execute(&pool)
            .await
            .unwrap();
    }
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO {t} (tenant, operation, idem_key, method, url, headers, body, attempts, last_error, state, \
         created_at_ms, updated_at_ms, first_reached_at_ms) VALUES ('t', 'payout', 'old', 'POST', \
         'http://v/v1/payouts', '[]', '\\x7b7d', 3, 'timeout'::bytea, 'dead', 1, 1, 1)"
    )))
    .execute(&pool)
    .await
    .unwrap();
    let pending = letters.pending_migrations().await.unwrap();
    assert_eq!(
        pending.iter().map(|m| m.version).collect::<Vec<_>>(),
        vec![3],
        "{pending:?}"
    );
    letters.migrate().await.unwrap();
    assert!(letters.pending_migrations().await.unwrap().is_empty());
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
    let id = letters.record(&letter("t", "new").sent_under(terms)).await.unwrap();
    assert_eq!(letters.get(id).await.unwrap().unwrap().sent_under, Some(terms));
}
