//! The dead-letter conformance suite against MariaDB or MySQL, and
//! recording inside the caller's transaction.
//!
//! The server comes from `IDEM_TEST_MYSQL_URL` (default
//! `mysql://root@127.0.0.1:3306/test`); an unreachable server fails every
//! test with a message naming the URL, it never skips them.

mod common;

use std::time::Duration;

use common::{ISOLATED_PREFIX, Isolation, connect, connect_at};
use idem_conformance::sql_deadletters::{self, SqlLetters, letter};
use idem_conformance::{DeadLetterSubject, deadletter_conformance};
use idem_core::{BoxFuture, DeadLetterStore, TableName};
use idem_mysql::MySqlDeadLetters;

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

idem_conformance::sql_letters!(MySql, MySqlDeadLetters, sqlx::MySql, new_pool: |_engine| connect().await);

/// A dead letter recorded in the caller's transaction commits with the business row, and vanishes with it on rollback.
#[tokio::test]
async fn record_in_commits_and_rolls_back_with_the_transaction() {
    let pool = connect().await;
    let table = isolated_name();
    let letters = MySqlDeadLetters::with_table(pool.clone(), table.clone());
    letters.migrate().await.unwrap();
    let payouts = format!("{table}_p");
    let tenant = format!("tenant-{}", uuid::Uuid::new_v4());
    sql_deadletters::record_in_follows_the_transaction(
        &MySql { pool },
        &letters,
        &payouts,
        format!("CREATE TABLE {payouts} (name VARCHAR(32) NOT NULL) ENGINE=InnoDB"),
        &[&payouts, table.as_str()],
        |key| letter(&tenant, key),
    )
    .await;
}

/// Migrating twice, and from several pools at once, is harmless; the pending list names the DDL until the table exists.
#[tokio::test]
async fn migrate_is_idempotent_and_listed_until_applied() {
    let engine = MySql { pool: connect().await };
    let table = isolated_name();
    sql_deadletters::migrate_is_idempotent_and_listed_until_applied(&engine, table.as_str()).await;
    engine.execute(format!("DROP TABLE {table}")).await;
}

/// A table of the first schema version (no first reach or verdicts, a 64 KiB answer column) is upgraded in place, rows kept; concurrent upgrades are harmless, and a whole 64 KiB answer fits after.
#[tokio::test]
async fn a_version_1_table_is_upgraded_with_its_rows() {
    let engine = MySql { pool: connect().await };
    let table = isolated_name();
    let t = table.as_str();
    engine
        .execute(format!(
            "CREATE TABLE {t} (id BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY, tenant VARBINARY(255) NOT NULL, \
             operation VARBINARY(255) NOT NULL, idem_key VARBINARY(255) NOT NULL, method VARBINARY(32) NOT NULL, \
             url VARBINARY(2048) NOT NULL, headers MEDIUMBLOB NOT NULL, body MEDIUMBLOB NOT NULL, attempts BIGINT NOT NULL, \
             last_error BLOB NOT NULL, state VARBINARY(16) NOT NULL, redrives BIGINT NOT NULL DEFAULT 0, \
             created_at_ms BIGINT NOT NULL, updated_at_ms BIGINT NOT NULL, redrive_until_ms BIGINT NULL, \
             response_status INT NULL, response_body BLOB NULL, UNIQUE KEY scope_key (tenant, operation, idem_key), \
             KEY state_idx (state, id)) ENGINE=InnoDB"
        ))
        .await;
    engine
        .execute(format!(
            "INSERT INTO {t} (id, tenant, operation, idem_key, method, url, headers, body, attempts, last_error, state, \
             created_at_ms, updated_at_ms) VALUES (41, 't', 'payout', 'old', 'POST', 'http://v/v1/payouts', '[]', '{{}}', 3, \
             'timeout', 'dead', 1, 1)"
        ))
        .await;
    let letters = sql_deadletters::version_1_table_is_upgraded(&engine, t, 41).await;
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
    let engine = MySql { pool: connect().await };
    let table = isolated_name();
    sql_deadletters::version_2_table_is_upgraded(&engine, table.as_str(), "'{}'", "'timeout'", letter("t", "new"))
        .await;
}
