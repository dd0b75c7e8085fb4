//! `idem sweep` and `idem stats` on an inbox (or webhook, or job) table on
//! PostgreSQL and MariaDB: expired rows are swept and live ones kept, the
//! keys table is left alone; a table name that is not an identifier is
//! refused (exit 2), and a table that exists but is not an idem table is
//! refused (exit 3) before any query touches it.

mod support;

use idem_core::LeaseStore;
use support::{Run, mysql_url, postgres_url, tag};

fn idem(args: &[&str]) -> Run {
    support::idem_run(args, &[])
}

/// `live` rows kept a day and `expired` rows claimed an hour ago, kept a minute.
async fn seed<S: LeaseStore + Clone>(store: S, tenant: &str, live: usize, expired: usize) {
    for (ttl_secs, count, ago_ms) in [(60u64, expired, 3_600_000i64), (86_400, live, 0)] {
        support::completed_keys(&store, tenant, "inbox-handler", count, ttl_secs, ago_ms).await;
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

/// The tables' names for `tag`: an inbox and a plain table.
fn tables(tag: &str) -> (String, String) {
    (format!("inbox_{tag}"), format!("plain_{tag}"))
}

/// With `store` on the inbox table of [`tables`] (migrated), over the server
/// at `url`: seeds the inbox, creates the plain table with one row, runs
/// the commands, checks the plain table is untouched, and drops both.
/// `execute` runs a statement, `count` answers a `COUNT(*)`.
async fn inbox_table<S: LeaseStore + Clone>(
    url: &str,
    store: S,
    tag: &str,
    execute: impl AsyncFn(String),
    count: impl AsyncFn(String) -> i64,
) {
    let (inbox, plain) = tables(tag);
    seed(store, &format!("t{tag}"), 2, 5).await;
    execute(format!("CREATE TABLE {plain} (expires_at_ms BIGINT NOT NULL)")).await;
    execute(format!("INSERT INTO {plain} VALUES (0)")).await;
    let (u, i, p) = (url.to_owned(), inbox.clone(), plain.clone());
    tokio::task::spawn_blocking(move || sweeps_an_inbox_table_and_refuses_other_tables(&u, &i, &p))
        .await
        .unwrap();
    let n = count(format!("SELECT COUNT(*) FROM {plain}")).await;
    assert_eq!(n, 1, "the plain table is untouched");
    for t in [&inbox, &plain] {
        execute(format!("DROP TABLE {t}")).await;
    }
}

/// [`inbox_table`] on a server of `$pool`, reached at `$url`, with the
/// store `$store` (named `$engine` in the failure to connect).
macro_rules! inbox_table_on {
    ($pool:ty, $store:ty, $url:expr, $engine:literal) => {{
        let url = $url;
        let pool = <$pool>::connect(&url)
            .await
            .unwrap_or_else(|e| panic!("cannot reach {} at {url}: {e}", $engine));
        let tag = tag();
        let store = <$store>::new(pool.clone()).with_table(idem_core::TableName::new(&tables(&tag).0).unwrap());
        store.migrate().await.unwrap();
        let execute = async |sql: String| {
            sqlx::query(sqlx::AssertSqlSafe(sql)).execute(&pool).await.unwrap();
        };
        let count = async |sql: String| -> i64 {
            sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
                .fetch_one(&pool)
                .await
                .unwrap()
        };
        inbox_table(&url, store, &tag, execute, count).await;
    }};
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_inbox_table() {
    inbox_table_on!(sqlx::PgPool, idem_postgres::PgStore, postgres_url(), "PostgreSQL");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_inbox_table() {
    inbox_table_on!(sqlx::MySqlPool, idem_mysql::MySqlStore, mysql_url(), "MariaDB");
}
