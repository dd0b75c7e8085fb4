//! The dead-letter conformance suite against PostgreSQL, and recording
//! inside the caller's transaction.
//!
//! The database comes from `IDEM_TEST_POSTGRES_URL` (default
//! `postgres://postgres@127.0.0.1:5432/test`); the tests fail, never skip, when
//! it is unreachable.

mod common;

use std::time::Duration;

use common::{Isolation, database_url, isolated_table, open_pool, open_pool_at};
use idem_conformance::sql_deadletters::{self, SqlLetters, letter};
use idem_conformance::{DeadLetterSubject, deadletter_conformance};
use idem_core::{BoxFuture, TableName};
use idem_postgres::PgDeadLetters;

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

idem_conformance::sql_letters!(PgSql, PgDeadLetters, sqlx::Postgres, new_pool: |_engine| open_pool(&database_url()).await);

/// A dead letter recorded in the caller's transaction commits with the business row, and vanishes with it on rollback.
#[tokio::test]
async fn record_in_commits_and_rolls_back_with_the_transaction() {
    let pool = open_pool(&database_url()).await;
    let table = isolated_table(&pool).await;
    let letters = PgDeadLetters::with_table(pool.clone(), table.clone());
    letters.migrate().await.unwrap();
    let payouts = format!("{table}_payouts");
    let tenant = format!("tenant-{}", uuid::Uuid::new_v4());
    sql_deadletters::record_in_follows_the_transaction(
        &PgSql { pool },
        &letters,
        &payouts,
        format!("CREATE TABLE {payouts} (name TEXT NOT NULL)"),
        &[&payouts],
        |key| letter(&tenant, key),
    )
    .await;
}

/// Migrating twice, and from several pools at once, is harmless; the pending list names the DDL until the table exists.
#[tokio::test]
async fn migrate_is_idempotent_and_listed_until_applied() {
    let pool = open_pool(&database_url()).await;
    let table = isolated_table(&pool).await;
    sql_deadletters::migrate_is_idempotent_and_listed_until_applied(&PgSql { pool }, table.as_str()).await;
}

/// A table of the first schema version (an unnamed three-state check, no first reach or verdicts) is upgraded in place, rows kept, the new states accepted after; concurrent upgrades are harmless.
#[tokio::test]
async fn a_version_1_table_is_upgraded_with_its_rows() {
    let pool = open_pool(&database_url()).await;
    let table = isolated_table(&pool).await;
    let t = table.as_str();
    let engine = PgSql { pool: pool.clone() };
    engine
        .execute(format!(
            "CREATE TABLE {t} (id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY, tenant TEXT COLLATE \"C\" NOT NULL, \
             operation TEXT COLLATE \"C\" NOT NULL, idem_key TEXT COLLATE \"C\" NOT NULL, method TEXT NOT NULL, \
             url TEXT NOT NULL, headers TEXT NOT NULL, body BYTEA NOT NULL, attempts BIGINT NOT NULL, \
             last_error BYTEA NOT NULL, state TEXT COLLATE \"C\" NOT NULL CHECK (state IN ('dead', 'redriving', 'resolved')), \
             redrives BIGINT NOT NULL DEFAULT 0, created_at_ms BIGINT NOT NULL, updated_at_ms BIGINT NOT NULL, \
             redrive_until_ms BIGINT NULL, response_status INTEGER NULL, response_body BYTEA NULL, \
             UNIQUE (tenant, operation, idem_key))"
        ))
        .await;
    let old_id: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "INSERT INTO {t} (tenant, operation, idem_key, method, url, headers, body, attempts, last_error, state, \
         created_at_ms, updated_at_ms) VALUES ('t', 'payout', 'old', 'POST', 'http://v/v1/payouts', '[]', '\\x7b7d', \
         3, 'timeout'::bytea, 'dead', 1, 1) RETURNING id"
    )))
    .fetch_one(&pool)
    .await
    .unwrap();
    sql_deadletters::version_1_table_is_upgraded(&engine, t, old_id).await;
}

/// A table of schema version 2 (no send terms) is upgraded in place: its rows kept without terms, and letters recorded after keep theirs.
#[tokio::test]
async fn a_version_2_table_is_upgraded_with_its_rows() {
    let pool = open_pool(&database_url()).await;
    let table = isolated_table(&pool).await;
    sql_deadletters::version_2_table_is_upgraded(
        &PgSql { pool },
        table.as_str(),
        "'\\x7b7d'",
        "'timeout'::bytea",
        letter("t", "new"),
    )
    .await;
}
