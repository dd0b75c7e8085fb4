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
use idem_core::{
    BoxFuture, DeadLetterState, DeadLetterStore, IdempotencyKey, NewDeadLetter, OutboundRequest, Scope, SentUnder,
    TableName,
};
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

/// A table of the first schema version (no first reach or verdicts, a 64 KiB answer column) is upgraded in place, rows kept; concurrent upgrades are harmless, and a whole 64 KiB answer fits after.
#[tokio::test]
async fn a_version_1_table_is_upgraded_with_its_rows() {
    let pool = connect().await;
    let table = isolated_name();
    let t = table.as_str();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE {t} (id BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY, tenant VARBINARY(255) NOT NULL, \
         operation VARBINARY(255) NOT NULL, idem_key VARBINARY(255) NOT NULL, method VARBINARY(32) NOT NULL, \
         url VARBINARY(2048) NOT NULL, headers MEDIUMBLOB NOT NULL, body MEDIUMBLOB NOT NULL, attempts BIGINT NOT NULL, \
         last_error BLOB NOT NULL, state VARBINARY(16) NOT NULL, redrives BIGINT NOT NULL DEFAULT 0, \
         created_at_ms BIGINT NOT NULL, updated_at_ms BIGINT NOT NULL, redrive_until_ms BIGINT NULL, \
         response_status INT NULL, response_body BLOB NULL, UNIQUE KEY scope_key (tenant, operation, idem_key), \
         KEY state_idx (state, id)) ENGINE=InnoDB"
    )))
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO {t} (id, tenant, operation, idem_key, method, url, headers, body, attempts, last_error, state, \
         created_at_ms, updated_at_ms) VALUES (41, 't', 'payout', 'old', 'POST', 'http://v/v1/payouts', '[]', '{{}}', 3, \
         'timeout', 'dead', 1, 1)"
    )))
    .execute(&pool)
    .await
    .unwrap();
    let letters = MySqlDeadLetters::with_table(pool.clone(), table.clone());
    assert_eq!(letters.pending_migrations().await.unwrap()[0].version, 2);
    let mut racers = Vec::new();
    for _ in 0..3 {
        let letters = MySqlDeadLetters::with_table(connect().await, table.clone());
        racers.push(tokio::spawn(async move { letters.migrate().await }));
    }
    for racer in racers {
        racer.await.unwrap().expect("concurrent upgrades all succeed");
    }
    assert!(letters.pending_migrations().await.unwrap().is_empty());
    let old = letters.get(41).await.unwrap().expect("the row survives");
    assert_eq!(
        (old.state, old.attempts, old.first_reached_at_ms),
        (DeadLetterState::Dead, 3, None)
    );
    let id = letters.record(&letter("t", "new").outcome_unknown()).await.unwrap();
    assert_eq!(letters.get(id).await.unwrap().unwrap().state, DeadLetterState::Unknown);
    let hold = letters.begin_redrive(41, 600_000).await.unwrap().unwrap();
    let answer = vec![b'x'; idem_core::MAX_DEAD_LETTER_RESPONSE];
    let resolved = idem_core::RedriveOutcome::Resolved {
        status: 201,
        body: answer.clone(),
        reconciled: false,
    };
    assert!(letters.finish_redrive(41, hold.token, &resolved).await.unwrap());
    assert_eq!(letters.get(41).await.unwrap().unwrap().response_body, Some(answer));
}

/// A table of schema version 2 (no send terms) is upgraded in place: its rows kept without terms, and letters recorded after keep theirs.
#[tokio::test]
async fn a_version_2_table_is_upgraded_with_its_rows() {
    let pool = connect().await;
    let table = isolated_name();
    let t = table.as_str();
    let letters = MySqlDeadLetters::with_table(pool.clone(), table.clone());
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
         'http://v/v1/payouts', '[]', '{{}}', 3, 'timeout', 'dead', 1, 1, 1)"
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
