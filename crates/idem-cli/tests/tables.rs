//! `idem sweep` and `idem stats` on an inbox (or webhook, or job) table on
//! PostgreSQL and MariaDB: expired rows are swept and live ones kept, the
//! keys table is left alone; a table name that is not an identifier is
//! refused (exit 2), and a table that exists but is not an idem table is
//! refused (exit 3) before any query touches it.

use std::process::Command;
use std::sync::Arc;

use idem_core::{Call, Clock, Fingerprint, IdempotencyKey, LeaseEngine, LeaseStore, ManualClock, Policy, Scope};

fn postgres_url() -> String {
    std::env::var("IDEM_TEST_POSTGRES_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

fn mysql_url() -> String {
    std::env::var("IDEM_TEST_MYSQL_URL").unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into())
}

fn tag() -> String {
    let t = uuid::Uuid::now_v7().simple().to_string();
    t[t.len() - 12..].to_owned()
}

struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

fn idem(args: &[&str]) -> Run {
    let out = Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(args)
        .output()
        .expect("idem runs");
    Run {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

impl Run {
    fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.stdout).unwrap_or_else(|e| panic!("{e}: {}{}", self.stdout, self.stderr))
    }
}

/// `live` rows kept a day and `expired` rows claimed an hour ago, kept a minute.
async fn seed<S: LeaseStore + Clone>(store: S, tenant: &str, live: usize, expired: usize) {
    let now = idem_core::SystemClock.now_ms();
    for (ttl_secs, count, ago_ms) in [(60u64, expired, 3_600_000i64), (86_400, live, 0)] {
        let engine = LeaseEngine::new(store.clone()).with_clock(Arc::new(ManualClock::new(now - ago_ms)));
        for _ in 0..count {
            let scope = Scope::parse(tenant, "inbox-handler").unwrap();
            let call = Call::new(
                scope.clone(),
                IdempotencyKey::generate(),
                Fingerprint::of_json(scope.operation(), b"{}").unwrap(),
            )
            .with_policy(Policy::default().with_ttl_secs(ttl_secs));
            engine
                .run(&call, |_lease| async { Ok::<_, idem_core::Error>(1u8) })
                .await
                .unwrap();
        }
    }
}

fn sweeps_an_inbox_table_and_refuses_other_tables(url: &str, inbox: &str, plain: &str) {
    let stats = |table: &str| {
        let run = idem(&["stats", "--store", url, "--table", table, "--json"]);
        assert_eq!(run.code, 0, "{}{}", run.stdout, run.stderr);
        let v = run.json();
        (v["completed"].as_u64().unwrap(), v["expired"].as_u64().unwrap())
    };
    assert_eq!(stats(inbox), (2, 5));
    let run = idem(&[
        "sweep",
        "--store",
        url,
        "--table",
        inbox,
        "--batch",
        "2",
        "--pause-ms",
        "0",
        "--json",
    ]);
    assert_eq!(run.code, 0, "{}{}", run.stdout, run.stderr);
    assert_eq!(run.json()["deleted"].as_u64(), Some(5), "{}", run.stdout);
    assert_eq!(stats(inbox), (2, 0), "the live rows stay");
    // Not an identifier: refused before any query.
    for bad in [
        format!("{inbox}; DROP TABLE {plain}"),
        format!("{inbox} --"),
        "x\"y".to_owned(),
        String::new(),
    ] {
        for command in ["sweep", "stats"] {
            let run = idem(&[command, "--store", url, "--table", &bad]);
            assert_eq!(run.code, 2, "{command} --table {bad:?}: {}{}", run.stdout, run.stderr);
            assert!(run.stderr.contains("--table"), "{}", run.stderr);
        }
    }
    // There, but not an idem table: refused, nothing touched.
    for command in ["sweep", "stats"] {
        let run = idem(&[command, "--store", url, "--table", plain]);
        assert_eq!(run.code, 3, "{command} --table {plain}: {}{}", run.stdout, run.stderr);
        assert!(run.stderr.contains(plain), "{}", run.stderr);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_inbox_table() {
    let url = postgres_url();
    let pool = sqlx::PgPool::connect(&url)
        .await
        .unwrap_or_else(|e| panic!("cannot reach PostgreSQL at {url}: {e}"));
    let tag = tag();
    let (inbox, plain) = (format!("inbox_{tag}"), format!("plain_{tag}"));
    let store = idem_postgres::PgStore::new(pool.clone()).with_table(idem_core::TableName::new(&inbox).unwrap());
    store.migrate().await.unwrap();
    seed(store, &format!("t{tag}"), 2, 5).await;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE {plain} (expires_at_ms BIGINT NOT NULL)"
    )))
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!("INSERT INTO {plain} VALUES (0)")))
        .execute(&pool)
        .await
        .unwrap();
    let (u, i, p) = (url.clone(), inbox.clone(), plain.clone());
    tokio::task::spawn_blocking(move || sweeps_an_inbox_table_and_refuses_other_tables(&u, &i, &p))
        .await
        .unwrap();
    let n: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!("SELECT COUNT(*) FROM {plain}")))
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(n, 1, "the plain table is untouched");
    for t in [&inbox, &plain] {
        sqlx::query(sqlx::AssertSqlSafe(format!("DROP TABLE {t}")))
            .execute(&pool)
            .await
            .unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_inbox_table() {
    let url = mysql_url();
    let pool = sqlx::MySqlPool::connect(&url)
        .await
        .unwrap_or_else(|e| panic!("cannot reach MariaDB at {url}: {e}"));
    let tag = tag();
    let (inbox, plain) = (format!("inbox_{tag}"), format!("plain_{tag}"));
    let store = idem_mysql::MySqlStore::new(pool.clone()).with_table(idem_core::TableName::new(&inbox).unwrap());
    store.migrate().await.unwrap();
    seed(store, &format!("t{tag}"), 2, 5).await;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE {plain} (expires_at_ms BIGINT NOT NULL)"
    )))
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!("INSERT INTO {plain} VALUES (0)")))
        .execute(&pool)
        .await
        .unwrap();
    let (u, i, p) = (url.clone(), inbox.clone(), plain.clone());
    tokio::task::spawn_blocking(move || sweeps_an_inbox_table_and_refuses_other_tables(&u, &i, &p))
        .await
        .unwrap();
    let n: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!("SELECT COUNT(*) FROM {plain}")))
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(n, 1, "the plain table is untouched");
    for t in [&inbox, &plain] {
        sqlx::query(sqlx::AssertSqlSafe(format!("DROP TABLE {t}")))
            .execute(&pool)
            .await
            .unwrap();
    }
}
