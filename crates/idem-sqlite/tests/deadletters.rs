//! The dead-letter conformance suite against SQLite, one database file per
//! test, and recording inside the caller's transaction.

mod common;

use common::TempDb;

use std::sync::Arc;
use std::time::Duration;

use idem_conformance::sql_deadletters;
use idem_conformance::{DeadLetterSubject, deadletter_conformance};
use idem_core::{BoxFuture, DeadLetterState, DeadLetterStore, NewDeadLetter, TableName};
use idem_sqlite::{SqliteDeadLetters, SqliteStore};

#[derive(Clone)]
struct SqliteLetters {
    letters: SqliteDeadLetters,
    db: Arc<TempDb>,
}

impl SqliteLetters {
    async fn new() -> Self {
        let db = Arc::new(TempDb::new("deadletters"));
        let letters = SqliteDeadLetters::new(db.open().await.pool().clone());
        letters.migrate().await.expect("migrate the dead-letter table");
        Self { letters, db }
    }

    /// The engine's part of the SQL dead-letter tests, on this database.
    fn engine(&self) -> Sqlite {
        Sqlite {
            pool: self.letters.pool().clone(),
        }
    }
}

impl DeadLetterSubject for SqliteLetters {
    type Store = SqliteDeadLetters;

    fn store(&self) -> SqliteDeadLetters {
        self.letters.clone()
    }

    fn another(&self) -> BoxFuture<'_, SqliteDeadLetters> {
        Box::pin(async move {
            let store = self.db.open().await;
            SqliteDeadLetters::with_table(store.pool().clone(), self.letters.table().clone())
        })
    }

    fn isolated(&self) -> BoxFuture<'_, Self> {
        Box::pin(SqliteLetters::new())
    }

    fn elapse(&self, ms: u64) -> BoxFuture<'_, ()> {
        // The store reads SQLite's clock, which only real time moves.
        Box::pin(tokio::time::sleep(Duration::from_millis(ms)))
    }
}

deadletter_conformance!(sqlite_deadletters, SqliteLetters::new());

idem_conformance::sql_letters!(Sqlite, SqliteDeadLetters, sqlx::Sqlite, new_pool: |engine| {
    let path = engine.pool.connect_options().get_filename().to_owned();
    SqliteStore::open(&path).await.expect("open the test database again").pool().clone()
});

/// The letter these tests record: `key` of the tenant `tenant`.
fn letter(key: &str) -> NewDeadLetter {
    sql_deadletters::letter("tenant", key)
}

/// A dead letter recorded in the caller's transaction commits with the business row, and vanishes with it on rollback.
#[tokio::test]
async fn record_in_commits_and_rolls_back_with_the_transaction() {
    let s = SqliteLetters::new().await;
    let engine = s.engine();
    sql_deadletters::record_in_follows_the_transaction(
        &engine,
        &s.letters,
        "payouts",
        "CREATE TABLE payouts (name TEXT NOT NULL)".to_owned(),
        &[],
        letter,
    )
    .await;
}

/// Migrating twice is harmless, and the pending list names the table's DDL until it exists.
#[tokio::test]
async fn migrate_is_idempotent_and_listed_until_applied() {
    let s = SqliteLetters::new().await;
    let fresh = SqliteDeadLetters::with_table(
        s.letters.pool().clone(),
        TableName::new("idem_dead_letters_other").unwrap(),
    );
    let pending = fresh.pending_migrations().await.unwrap();
    assert_eq!(pending.len(), 1);
    assert!(pending[0].statements[0].contains("CREATE TABLE IF NOT EXISTS idem_dead_letters_other"));
    fresh.migrate().await.unwrap();
    fresh.migrate().await.unwrap();
    assert!(fresh.pending_migrations().await.unwrap().is_empty());
    let id = fresh.record(&letter("k")).await.unwrap();
    fresh.migrate().await.unwrap();
    assert!(fresh.get(id).await.unwrap().is_some(), "migrating again keeps the rows");
}

/// A table of the first schema version (three states, no first reach or verdicts) is upgraded in place: rows, ids and the id sequence kept, the new states accepted after.
#[tokio::test]
async fn a_version_1_table_is_upgraded_with_its_rows() {
    let s = SqliteLetters::new().await;
    let pool = s.letters.pool().clone();
    let t = "idem_dead_letters_v1";
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE {t} (id INTEGER PRIMARY KEY AUTOINCREMENT, tenant TEXT NOT NULL, operation TEXT NOT NULL, \
         idem_key TEXT NOT NULL, method TEXT NOT NULL, url TEXT NOT NULL, headers TEXT NOT NULL, body BLOB NOT NULL, \
         attempts INTEGER NOT NULL, last_error TEXT NOT NULL, \
         state TEXT NOT NULL CHECK (state IN ('dead', 'redriving', 'resolved')), redrives INTEGER NOT NULL DEFAULT 0, \
         created_at_ms INTEGER NOT NULL, updated_at_ms INTEGER NOT NULL, redrive_until_ms INTEGER NULL, \
         response_status INTEGER NULL, response_body BLOB NULL, UNIQUE (tenant, operation, idem_key))"
    )))
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO {t} (id, tenant, operation, idem_key, method, url, headers, body, attempts, last_error, state, \
         redrives, created_at_ms, updated_at_ms) VALUES (41, 'tenant', 'payout', 'old', 'POST', 'http://v/v1/payouts', \
         '[[\"authorization\",\"Bearer leaked\"],[\"content-type\",\"application/json\"]]', X'7B7D', 3, 'timeout', 'dead', 0, 1, 1)"
    )))
    .execute(&pool)
    .await
    .unwrap();
    let letters = SqliteDeadLetters::with_table(pool.clone(), TableName::new(t).unwrap());
    let pending = letters.pending_migrations().await.unwrap();
    assert_eq!(pending.len(), 1);
    assert_eq!(pending[0].version, 3, "the rebuild makes the latest table");
    letters.migrate().await.unwrap();
    assert!(letters.pending_migrations().await.unwrap().is_empty());
    let old = letters.get(41).await.unwrap().expect("the row survives");
    assert_eq!(
        (old.state, old.attempts, old.first_reached_at_ms),
        (DeadLetterState::Dead, 3, None)
    );
    assert_eq!(
        old.request.headers(),
        &[("content-type".to_owned(), "application/json".to_owned())],
        "a credential stored by an older version is neither shown nor sent"
    );
    let id = letters.record(&letter("new").outcome_unknown()).await.unwrap();
    assert!(id > 41, "the id sequence goes on");
    assert_eq!(letters.get(id).await.unwrap().unwrap().state, DeadLetterState::Unknown);
    letters.migrate().await.unwrap();
    assert_eq!(
        letters.get(41).await.unwrap(),
        Some(old),
        "migrating again changes nothing"
    );
}

/// A table of schema version 2 (no send terms) is upgraded in place: its rows kept without terms, and letters recorded after keep theirs.
#[tokio::test]
async fn a_version_2_table_is_upgraded_with_its_rows() {
    let s = SqliteLetters::new().await;
    let engine = s.engine();
    sql_deadletters::version_2_table_is_upgraded(
        &engine,
        "idem_dead_letters_v2",
        "X'7B7D'",
        "'timeout'",
        letter("new"),
    )
    .await;
}
