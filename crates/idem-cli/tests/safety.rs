//! The `idem` binary refuses what cannot work and changes nothing it was not
//! asked to: read-only commands never create a database or a table, store
//! URLs that can never work are refused at start, empty filters are
//! refused, credentials never reach the output, `keys show` finds its key
//! exactly, `--json` runs print JSON errors, and `sweep`/`stats` work on the
//! other tables that share the keys table's schema (an inbox).

mod support;

use std::path::{Path, PathBuf};

use idem_core::TableName;
use support::{Run, Sql, keys_command, mysql_url, postgres_url, tag};

fn idem(args: &[&str]) -> Run {
    support::idem_run(args, &["IDEM_STORE"])
}

fn temp_db() -> PathBuf {
    std::env::temp_dir().join(format!("idem-cli-safety-{}.db", tag()))
}

/// A SQLite file of the test's own, migrated: its path, and that as text.
fn migrated_db() -> (PathBuf, String) {
    let path = temp_db();
    let p = path.display().to_string();
    let run = idem(&["migrate", "--store", &p]);
    assert_eq!(run.code, 0, "{}", run.all());
    (path, p)
}

fn remove_db(path: &Path) {
    for suffix in ["", "-wal", "-shm", "-idem.lock"] {
        let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
    }
}

/// Every command that only reads (or deletes rows) on a mistyped SQLite path
/// fails with exit 3 naming the missing file, and creates no file.
#[test]
fn read_only_commands_never_create_a_sqlite_file() {
    let path = temp_db();
    let p = path.display().to_string();
    let commands: Vec<Vec<&str>> = vec![
        vec!["stats", "--store", &p],
        vec!["sweep", "--store", &p],
        vec!["keys", "list", "--store", &p],
        keys_command("show", &p, "t", "op", "k", &[]),
        vec!["keys", "purge", "--store", &p, "--state", "expired"],
        vec!["outbox", "status", "--store", &p],
    ];
    for args in commands {
        let run = idem(&args);
        assert_eq!(run.code, 3, "{args:?}: {}", run.all());
        assert!(run.stderr.contains("no such database file"), "{args:?}: {}", run.all());
        assert!(!path.exists(), "{args:?} created {p}");
    }
    // `migrate --dry-run` says what it would create, and creates nothing either.
    let run = idem(&["migrate", "--store", &p, "--dry-run", "--json"]);
    assert_eq!(run.code, 0, "{}", run.all());
    assert_eq!(run.json()["pending"], serde_json::json!([1, 2, 3]));
    assert!(!path.exists(), "migrate --dry-run created {p}");
    // Only `migrate` creates it.
    let run = idem(&["migrate", "--store", &p]);
    assert_eq!(run.code, 0, "{}", run.all());
    assert!(path.exists());
    let run = idem(&["stats", "--store", &p, "--json"]);
    assert_eq!(run.code, 0, "{}", run.all());
    remove_db(&path);
}

/// On PostgreSQL and MariaDB, a database without the keys table makes the
/// read-only commands fail with exit 3 and the hint to migrate, and they
/// create no table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_only_commands_never_create_a_table() {
    for sql in [Sql::Postgres, Sql::MariaDb] {
        let url = sql.create_db("idem_cli_ro").await;
        let db = support::database_of(&url).to_owned();
        for args in [
            vec!["stats", "--store", url.as_str()],
            vec!["sweep", "--store", url.as_str()],
            vec!["keys", "list", "--store", url.as_str()],
            vec!["keys", "purge", "--store", url.as_str(), "--state", "expired"],
        ] {
            let run = idem(&args);
            assert_eq!(run.code, 3, "{args:?}: {}", run.all());
            assert!(
                run.stderr
                    .contains("table idem_keys does not exist; run `idem migrate`"),
                "{args:?}: {}",
                run.all()
            );
        }
        let run = idem(&["outbox", "status", "--store", &url]);
        assert_eq!(run.code, 3, "{}", run.all());
        assert!(run.stderr.contains("table idem_outbox does not exist"), "{}", run.all());
        let tables: i64 = if sql == Sql::Postgres {
            let pool = sqlx::PgPool::connect(&url).await.unwrap();
            let n = sqlx::query_scalar(
                "SELECT COUNT(*) FROM information_schema.tables WHERE table_schema NOT IN ('pg_catalog', 'information_schema')",
            )
            .fetch_one(&pool)
            .await
            .unwrap();
            pool.close().await;
            n
        } else {
            let admin = sqlx::MySqlPool::connect(&mysql_url()).await.unwrap();
            let n = sqlx::query_scalar("SELECT COUNT(*) FROM information_schema.tables WHERE table_schema = ?")
                .bind(&db)
                .fetch_one(&admin)
                .await
                .unwrap();
            admin.close().await;
            n
        };
        assert_eq!(tables, 0, "a read-only command created a table in {url}");
        sql.drop_db(&url).await;
    }
}

/// `keys show` finds its key by its exact value, even when a thousand older
/// keys of the same tenant and operation start with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_show_finds_the_exact_key_behind_a_thousand_longer_ones() {
    let (path, p) = migrated_db();
    let pool = sqlx::SqlitePool::connect(&format!("sqlite://{p}")).await.unwrap();
    let now = idem_core::Clock::now_ms(&idem_core::SystemClock);
    let mut tx = pool.begin().await.unwrap();
    for i in 0..=1000i64 {
        // The thousand longer keys are the older ones; "order-1" itself is the newest.
        let key = if i == 1000 {
            "order-1".to_owned()
        } else {
            format!("order-1{i:04}")
        };
        sqlx::query(
            "INSERT INTO idem_keys (tenant, operation, idem_key, fingerprint, status, token, payload, \
             created_at_ms, expires_at_ms) VALUES ('acme', 'POST /v1/orders', ?, ?, 1, 1, NULL, ?, ?)",
        )
        .bind(&key)
        .bind(vec![7u8; 32])
        .bind(now - 10_000 + i)
        .bind(now + 3_600_000)
        .execute(&mut *tx)
        .await
        .unwrap();
    }
    tx.commit().await.unwrap();
    pool.close().await;
    let show = keys_command("show", &p, "acme", "POST /v1/orders", "order-1", &["--json"]);
    let run = idem(&show);
    assert_eq!(run.code, 0, "{}", run.all());
    assert_eq!(run.json()["key"], "order-1");
    remove_db(&path);
}

/// No store password reaches the output of a failed command, as text or as
/// JSON, whatever the URL's form: user and password, password only, a
/// password in the query, or a URL that does not even parse.
#[test]
fn store_passwords_never_reach_the_output() {
    let secret = "s3cr3tPW";
    let urls = [
        format!("postgres://app:{secret}@127.0.0.1:1/db"),
        format!("postgresql://app:{secret}@127.0.0.1:1/db?sslmode=disable"),
        format!("mysql://root:{secret}@127.0.0.1:1/db"),
        format!("mariadb://root:{secret}@127.0.0.1:1/db"),
        format!("redis://:{secret}@127.0.0.1:1"),
        format!("redis://default:{secret}@127.0.0.1:1/0"),
        format!("rediss://app:{secret}@127.0.0.1:1"),
        format!("postgres://127.0.0.1:1/db?user=app&password={secret}"),
        format!("postgres://app:{secret}@@bad host:port/db"),
        format!("redis://:{secret}@[::1"),
        format!("ftp://app:{secret}@example.com/x"),
    ];
    // Each case in a thread of its own: an unreachable store takes a moment.
    let runs: Vec<_> = urls
        .iter()
        .flat_map(|url| [(url.clone(), false), (url.clone(), true)])
        .map(|(url, json)| {
            std::thread::spawn(move || {
                let mut args = vec!["stats", "--store", url.as_str()];
                if json {
                    args.push("--json");
                }
                (url.clone(), idem(&args))
            })
        })
        .collect();
    for run in runs {
        let (url, run) = run.join().unwrap();
        assert_ne!(run.code, 0, "{url}: {}", run.all());
        assert!(!run.all().contains(secret), "{url} leaked its password: {}", run.all());
        assert!(
            run.all().contains("***") || !url.contains('@'),
            "{url}: the URL is shown redacted: {}",
            run.all()
        );
    }
}

/// A password holding any printable character (a space, `"`, `'`, `<`,
/// `>`, a backtick, `@`, `%`…) never reaches a failed command's output, as
/// text or JSON, whether the URL is an argument or `IDEM_STORE`: the
/// command knows the password whole from where it was given.
#[test]
fn passwords_of_every_printable_character_never_reach_the_output() {
    let cases: Vec<(String, bool, bool)> = (0x20u8..=0x7e)
        .map(|c| format!("Pw{}x9", c as char))
        .enumerate()
        .map(|(i, pw)| (pw, i % 2 == 0, i % 3 == 0))
        .collect();
    // A few processes at a time: each waits on a refused connection.
    for chunk in cases.chunks(16) {
        let runs: Vec<_> = chunk
            .iter()
            .cloned()
            .map(|(password, json, from_env)| {
                std::thread::spawn(move || {
                    let url = format!("postgres://app:{password}@127.0.0.1:1/db");
                    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_idem"));
                    cmd.arg("stats");
                    if from_env {
                        cmd.env("IDEM_STORE", &url);
                    } else {
                        cmd.args(["--store", &url]);
                    }
                    if json {
                        cmd.arg("--json");
                    }
                    let out = cmd.output().unwrap();
                    let all = format!(
                        "{}{}",
                        String::from_utf8_lossy(&out.stdout),
                        String::from_utf8_lossy(&out.stderr)
                    );
                    (password, out.status.code(), all)
                })
            })
            .collect();
        for run in runs {
            let (password, code, all) = run.join().unwrap();
            assert_ne!(code, Some(0), "{password:?}: {all}");
            assert!(!all.contains(&password), "{password:?} leaked: {all}");
            assert!(all.contains("***"), "{password:?}: the URL is shown redacted: {all}");
        }
    }
}

/// Store URLs that can never work are refused with exit 2 before anything
/// runs: an empty `--store`, and SQLite without a file (every pooled
/// connection would get a private database of its own).
#[test]
fn unusable_store_urls_are_refused() {
    let no_file = ["", "  ", "sqlite://", "sqlite:"];
    let in_memory = [
        "sqlite::memory:",
        ":memory:",
        "sqlite://:memory:",
        "file::memory:?cache=shared",
    ];
    for url in no_file.into_iter().chain(in_memory) {
        for args in [vec!["migrate", "--store", url], vec!["stats", "--store", url]] {
            let run = idem(&args);
            assert_eq!(run.code, 2, "{args:?}: {}", run.all());
            assert!(
                run.stderr.contains("--store"),
                "{args:?} names the setting: {}",
                run.all()
            );
        }
    }
}

/// The gateway refuses an unusable store at start, with exit 2, instead of
/// serving with it.
#[test]
fn the_gateway_refuses_an_unusable_store() {
    for url in ["", "sqlite::memory:", "sqlite://"] {
        let (code, err) = support::gateway_exit(url, &[]);
        assert_eq!(code, Some(2), "the gateway exits at once with --store {url:?}: {err}");
        assert!(err.contains("--store"), "the refusal names the setting: {err}");
    }
}

/// An empty filter value selects nothing meaningful (an empty prefix would
/// match every key): it is refused with exit 2 and nothing is deleted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn empty_filter_values_are_refused() {
    let (path, p) = migrated_db();
    seed_sqlite(&p, None, 3, 0).await;
    for flag in ["--key-prefix", "--tenant", "--operation"] {
        for command in ["purge", "list"] {
            let mut args = vec!["keys", command, "--store", &p, flag, ""];
            if command == "purge" {
                args.push("--force");
            }
            let run = idem(&args);
            assert_eq!(run.code, 2, "{args:?}: {}", run.all());
            assert!(run.stderr.contains(flag), "{args:?} names the flag: {}", run.all());
        }
    }
    let run = idem(&["stats", "--store", &p, "--json"]);
    assert_eq!(run.json()["completed"], 3, "nothing was deleted: {}", run.all());
    remove_db(&path);
}

/// `keys resolve --applied` refuses headers that are never recorded
/// (`Set-Cookie` would be replayed to every retry; hop-by-hop headers),
/// before it opens the store.
#[test]
fn resolve_refuses_headers_that_are_never_recorded() {
    let path = temp_db();
    let p = path.display().to_string();
    let resolve_with = |header: &str| {
        let applied = ["--applied", "--status", "201", "--header", header];
        idem(&keys_command("resolve", &p, "t", "POST /v1/pay", "k", &applied))
    };
    for header in [
        "Set-Cookie: session=abc",
        "set-cookie: a=b",
        "Connection: close",
        "Transfer-Encoding: chunked",
    ] {
        let run = resolve_with(header);
        assert_eq!(run.code, 2, "{header}: {}", run.all());
        assert!(run.stderr.contains("never recorded"), "{header}: {}", run.all());
        assert!(!path.exists(), "{header}: the store was opened");
    }
    let run = resolve_with("Location: /v1/pay/1");
    assert_eq!(
        run.code,
        3,
        "an ordinary header passes, then the missing store is reported: {}",
        run.all()
    );
}

/// With `--json`, every failure prints one JSON object with the error and
/// the exit code on stdout, whatever failed: a bad argument, a bad URL, an
/// unreachable store, an absent key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_runs_print_json_errors() {
    let (path, p) = migrated_db();
    let cases: Vec<(Vec<&str>, i32)> = vec![
        (vec!["stats", "--store", "ftp://example.com/x", "--json"], 2),
        (
            vec!["stats", "--store", "postgres://postgres@127.0.0.1:1/x", "--json"],
            3,
        ),
        (vec!["keys", "purge", "--store", &p, "--json"], 2),
        (vec!["keys", "list", "--store", &p, "--limit", "zero", "--json"], 2),
        (vec!["--json", "stats"], 2),
        (keys_command("show", &p, "t", "op", "absent", &["--json"]), 1),
    ];
    for (args, code) in cases {
        let run = idem(&args);
        assert_eq!(run.code, code, "{args:?}: {}", run.all());
        let v = run.json();
        assert_eq!(v["exit_code"], code, "{args:?}: {v}");
        assert!(v["error"].as_str().is_some_and(|e| !e.is_empty()), "{args:?}: {v}");
    }
    remove_db(&path);
}

/// Completed lease-mode keys in `table` of the SQLite file at `path`:
/// `expired` of them expired an hour ago, `live` still live.
async fn seed_sqlite(path: &str, table: Option<&str>, live: usize, expired: usize) {
    let mut store = idem_sqlite::SqliteStore::open(path).await.unwrap();
    if let Some(t) = table {
        store = store.with_table(TableName::new(t).unwrap());
    }
    store.migrate().await.unwrap();
    for (ttl_secs, count, ago_ms) in [(60u64, expired, 3_600_000i64), (86_400, live, 0)] {
        support::completed_keys(&store, "cli-test", "POST /x", count, ttl_secs, ago_ms).await;
    }
    store.pool().close().await;
}

/// The completed and expired keys `idem stats --json` counts in the store
/// at `p`, with the flags `table` (a `--table`, or none).
fn completed_and_expired(p: &str, table: &[&str]) -> (Option<u64>, Option<u64>) {
    let run = idem(&[&["stats", "--store", p, "--json"], table].concat());
    assert_eq!(run.code, 0, "{}", run.all());
    let v = run.json();
    (v["completed"].as_u64(), v["expired"].as_u64())
}

/// `stats` and `sweep` take `--table`: an inbox's table shares the keys
/// table's schema and is counted and swept like it, and the keys table is
/// left alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stats_and_sweep_work_on_an_inbox_table() {
    let (path, p) = migrated_db();
    seed_sqlite(&p, None, 1, 2).await;
    seed_sqlite(&p, Some("payments_inbox"), 2, 5).await;
    let inbox = ["--table", "payments_inbox"];
    assert_eq!(completed_and_expired(&p, &inbox), (Some(2), Some(5)));
    let run = idem(&[
        "sweep",
        "--store",
        &p,
        "--table",
        "payments_inbox",
        "--batch",
        "2",
        "--pause-ms",
        "0",
        "--json",
    ]);
    assert_eq!(run.code, 0, "{}", run.all());
    let v = run.json();
    assert_eq!(
        (v["deleted"].as_u64(), v["batches"].as_u64()),
        (Some(5), Some(3)),
        "{v}"
    );
    assert_eq!(completed_and_expired(&p, &inbox), (Some(2), Some(0)));
    assert_eq!(
        completed_and_expired(&p, &[]),
        (Some(1), Some(2)),
        "the keys table is untouched"
    );
    let run = idem(&["stats", "--store", &p, "--table", "no_such_inbox"]);
    assert_eq!(run.code, 3, "{}", run.all());
    assert!(
        run.stderr.contains("table no_such_inbox does not exist"),
        "{}",
        run.all()
    );
    let run = idem(&["stats", "--store", &p, "--table", "bad name"]);
    assert_eq!(run.code, 2, "{}", run.all());
    remove_db(&path);
}

/// A table whose schema is newer than this idem knows is refused by every
/// command that reads or changes it (`stats`, `sweep`, `keys list`,
/// `migrate` and its dry run), on SQLite, PostgreSQL and MariaDB: nothing is
/// read with rules the schema has outgrown, nothing written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_newer_schema_is_refused_by_every_command() {
    let table = format!("ns_{}", tag());
    let path = temp_db();
    let sqlite = path.display().to_string();
    let stores = [sqlite.clone(), postgres_url(), mysql_url()];
    for store in &stores {
        let run = idem(&["migrate", "--store", store, "--table", &table]);
        assert_eq!(run.code, 0, "{store}: {}", run.all());
        let future =
            format!("INSERT INTO {table}_schema (version, description, applied_at_ms) VALUES (99, 'future', 0)");
        execute(store, [future]).await;
        for command in [
            vec!["stats"],
            vec!["sweep"],
            vec!["keys", "list"],
            vec!["migrate"],
            vec!["migrate", "--dry-run"],
        ] {
            let mut args = command.clone();
            args.extend(["--store", store.as_str(), "--table", table.as_str()]);
            let run = idem(&args);
            assert_ne!(run.code, 0, "{store} {command:?}: {}", run.all());
            assert!(
                run.all().contains("schema version 99, newer than"),
                "{store} {command:?}: {}",
                run.all()
            );
        }
        let drops = [format!("DROP TABLE {table}"), format!("DROP TABLE {table}_schema")];
        execute(store, drops).await;
    }
    remove_db(&path);
}

/// Runs `statements` on `store`: a PostgreSQL or MariaDB URL, or the path
/// of a SQLite file.
async fn execute<const N: usize>(store: &str, statements: [String; N]) {
    macro_rules! on {
        ($pool:expr) => {{
            let pool = $pool.await.unwrap();
            for sql in statements {
                sqlx::query(sqlx::AssertSqlSafe(sql)).execute(&pool).await.unwrap();
            }
        }};
    }
    if store.starts_with("postgres") {
        on!(sqlx::PgPool::connect(store))
    } else if store.starts_with("mysql") {
        on!(sqlx::MySqlPool::connect(store))
    } else {
        on!(sqlx::SqlitePool::connect(&format!("sqlite://{store}")))
    }
}
