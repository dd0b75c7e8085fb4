//! The dead-letter conformance suite against MariaDB or MySQL, and
//! recording inside the caller's transaction.
//!
//! The server comes from `IDEM_TEST_MYSQL_URL` (default
//! `mysql://root@127.0.0.1:3306/test`); an unreachable server fails every
//! test with a message naming the URL, it never skips them.

mod common;

use std::time::Duration;

use common::{ISOLATED_PREFIX, Isolation, connect, connect_at};
use idem_conformance::{DeadLetterSubject, deadletter_conformance};
use idem_core::{BoxFuture, DeadLetterStore, IdempotencyKey, NewDeadLetter, OutboundRequest, Scope, TableName};
use idem_mysql::{MySqlDeadLetters, store_error};

/// The dead-letter table most tests share; they use unique tenants, so they
/// never see each other's letters.
const SHARED_TABLE: &str = "idem_conformance_dead_letters";

/// A fresh table name; isolated tables older than an hour are dropped by
/// the other suites' set-up.
fn isolated_name() -> TableName {
    TableName::new(format!("{ISOLATED_PREFIX}{}", uuid::Uuid::new_v4().simple())).unwrap()
}

#[derive(Clone)]
struct MySqlLetters {
    letters: MySqlDeadLetters,
    isolation: Isolation,
}

impl MySqlLetters {
    async fn connect(isolation: Isolation, table: &str) -> Self {
        let letters = MySqlDeadLetters::with_table(connect_at(isolation).await, TableName::new(table).unwrap());
        // Every test of a module migrates the same table at once.
        letters.migrate().await.expect("migrate the shared dead-letter table");
        Self { letters, isolation }
    }
}

impl DeadLetterSubject for MySqlLetters {
    type Store = MySqlDeadLetters;

    fn store(&self) -> MySqlDeadLetters {
        self.letters.clone()
    }

    fn another(&self) -> BoxFuture<'_, MySqlDeadLetters> {
        Box::pin(
            async move { MySqlDeadLetters::with_table(connect_at(self.isolation).await, self.letters.table().clone()) },
        )
    }

    fn isolated(&self) -> BoxFuture<'_, Self> {
        Box::pin(async move {
            let letters = MySqlDeadLetters::with_table(self.letters.pool().clone(), isolated_name());
            letters.migrate().await.expect("migrate an isolated dead-letter table");
            Self {
                letters,
                isolation: self.isolation,
            }
        })
    }

    fn elapse(&self, ms: u64) -> BoxFuture<'_, ()> {
        // The store reads the server's clock, which only real time moves.
        Box::pin(tokio::time::sleep(Duration::from_millis(ms)))
    }
}

deadletter_conformance!(
    mysql_deadletters,
    MySqlLetters::connect(Isolation::RepeatableRead, SHARED_TABLE)
);
// Redrives taken concurrently answer `None`, not a deadlock, on connections
// whose default level is SERIALIZABLE.
deadletter_conformance!(
    mysql_deadletters_serializable,
    MySqlLetters::connect(Isolation::Serializable, SHARED_TABLE)
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
    let pool = connect().await;
    let table = isolated_name();
    let letters = MySqlDeadLetters::with_table(pool.clone(), table.clone());
    letters.migrate().await.unwrap();
    let payouts = format!("{table}_p");
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE {payouts} (name VARCHAR(32) NOT NULL) ENGINE=InnoDB"
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
    let found = letters.get(kept).await.unwrap();
    let gone = letter(&tenant, "dropped");
    let absent =
        letters.get(dropped).await.unwrap().is_none() && letters.find(&gone.scope, &gone.key).await.unwrap().is_none();
    for drop in [payouts.as_str(), table.as_str()] {
        sqlx::query(sqlx::AssertSqlSafe(format!("DROP TABLE {drop}")))
            .execute(&pool)
            .await
            .unwrap();
    }
    assert_eq!(names, vec!["kept".to_owned()]);
    assert_eq!(found.expect("committed with the transaction").key.as_str(), "kept");
    assert!(absent, "rolled back");
}

/// Migrating twice, and from several pools at once, is harmless; the pending list names the DDL until the table exists.
#[tokio::test]
async fn migrate_is_idempotent_and_listed_until_applied() {
    let pool = connect().await;
    let table = isolated_name();
    let letters = MySqlDeadLetters::with_table(pool.clone(), table.clone());
    let pending = letters.pending_migrations().await.unwrap();
    assert_eq!(pending.len(), 1);
    assert!(pending[0].statements[0].contains(&format!("CREATE TABLE IF NOT EXISTS {table}")));
    let mut racers = Vec::new();
    for _ in 0..4 {
        let letters = MySqlDeadLetters::with_table(connect().await, table.clone());
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
    sqlx::query(sqlx::AssertSqlSafe(format!("DROP TABLE {table}")))
        .execute(&pool)
        .await
        .unwrap();
}
