//! The `idem` operator commands against each store they support: migrate,
//! stats, sweep (bounded batches), outbox status, `--json`, and the exit
//! codes for a bad URL (2) and an unreachable store (3). PostgreSQL and
//! MariaDB get a database of their own; Redis a server of its own.

#[path = "../../idem-redis/tests/support/servers.rs"]
mod servers;
mod support;

use idem_core::OutboxEvent;
use idem_gateway::AnyLease;
use support::{idem_out as idem, keys_command, refused};

/// Five keys that expired an hour ago and two live ones, all completed.
async fn seed(url: &str) {
    let store = AnyLease::connect(url).await.expect("connect");
    for (ttl_secs, count, ago_ms) in [(60u64, 5, 3_600_000i64), (86_400, 2, 0)] {
        support::completed_keys(&store, "cli-test", "POST /x", count, ttl_secs, ago_ms).await;
    }
    // Redis indexes claims off their path; the commands below run in another
    // process, which sees only what is indexed.
    if let AnyLease::Redis(redis) = &store {
        redis.flush_index().await;
    }
}

async fn operator_commands(url: &str, outbox: bool) {
    let (code, json, out) = idem(&["migrate", "--store", url, "--dry-run", "--show-sql", "--json"]);
    assert_eq!(code, 0, "{out}");
    assert_eq!(json["applied"], false);
    if outbox {
        // A SQL store: every version from 1 is pending, and nothing was created.
        assert_eq!(json["pending"][0], 1, "{json}");
        assert!(json["sql"][0].as_str().unwrap().contains("CREATE TABLE"), "{json}");
        let (code, json, out) = idem(&["migrate", "--store", url, "--dry-run", "--json"]);
        assert_eq!(
            (code, &json["pending"][0]),
            (0, &serde_json::json!(1)),
            "still pending: {out}"
        );
    } else {
        assert_eq!(json["pending"], serde_json::json!([]), "Redis has no schema");
    }
    let (code, json, out) = idem(&["migrate", "--store", url, "--json"]);
    assert_eq!(code, 0, "{out}");
    assert_eq!(json["applied"], true);
    let (_, json, _) = idem(&["migrate", "--store", url, "--dry-run", "--json"]);
    assert_eq!(json["pending"], serde_json::json!([]), "current after the migration");
    seed(url).await;
    let (code, json, out) = idem(&["stats", "--store", url, "--json"]);
    assert_eq!(code, 0, "{out}");
    assert_eq!(
        (json["expired"].as_u64(), json["completed"].as_u64()),
        (Some(5), Some(2)),
        "{json}"
    );
    for busy in ["0", "101"] {
        let (code, _, out) = idem(&["sweep", "--store", url, "--busy-percent", busy, "--json"]);
        assert_eq!(code, 2, "--busy-percent {busy} is bad input: {out}");
    }
    let (_, json, _) = idem(&["stats", "--store", url, "--json"]);
    assert_eq!(
        json["expired"].as_u64(),
        Some(5),
        "a refused sweep deleted nothing: {json}"
    );
    let (code, json, out) = idem(&[
        "sweep",
        "--store",
        url,
        "--batch",
        "2",
        "--pause-ms",
        "0",
        "--busy-percent",
        "50",
        "--json",
    ]);
    assert_eq!(code, 0, "{out}");
    assert_eq!(
        (json["deleted"].as_u64(), json["batches"].as_u64()),
        (Some(5), Some(3)),
        "{json}"
    );
    let (_, json, _) = idem(&["stats", "--store", url, "--json"]);
    assert_eq!(
        (json["expired"].as_u64(), json["completed"].as_u64()),
        (Some(0), Some(2)),
        "{json}"
    );
    let (code, text, _) = idem(&["stats", "--store", url]);
    assert_eq!(code, 0);
    assert_eq!(text, serde_json::Value::Null, "plain text without --json");

    // keys list / show / purge.
    let (code, json, out) = idem(&["keys", "list", "--store", url, "--state", "completed", "--json"]);
    assert_eq!(code, 0, "{out}");
    let listed = json.as_array().expect("an array").clone();
    assert_eq!(listed.len(), 2, "{json}");
    assert!(
        listed
            .iter()
            .all(|k| k["state"] == "completed" && k["tenant"] == "cli-test" && k["operation"] == "POST /x")
    );
    let (_, json, _) = idem(&["keys", "list", "--store", url, "--tenant", "nobody", "--json"]);
    assert_eq!(json, serde_json::json!([]));
    let key = listed[0]["key"].as_str().unwrap().to_owned();
    let (_, json, _) = idem(&[
        "keys",
        "list",
        "--store",
        url,
        "--key-prefix",
        &key[..key.len() - 1],
        "--json",
    ]);
    assert_eq!(json.as_array().map(Vec::len), Some(1), "{json}");
    let (code, json, out) = idem(&keys_command("show", url, "cli-test", "POST /x", &key, &["--json"]));
    assert_eq!(code, 0, "{out}");
    assert_eq!(json["key"], key.as_str());
    assert_eq!(json["state"], "completed");
    let (code, _, _) = idem(&keys_command("show", url, "cli-test", "POST /x", "absent", &[]));
    assert_eq!(code, 1);
    let (code, _, out) = idem(&["keys", "purge", "--store", url, "--tenant", "cli-test"]);
    assert_eq!(code, 2, "keys in progress need --force: {out}");
    let (code, _, out) = idem(&["keys", "purge", "--store", url]);
    assert_eq!(code, 2, "a filter is required: {out}");
    let (code, json, out) = idem(&[
        "keys",
        "purge",
        "--store",
        url,
        "--state",
        "completed",
        "--limit",
        "1",
        "--json",
    ]);
    assert_eq!(code, 0, "{out}");
    assert_eq!(json["deleted"], 1, "bounded by --limit");
    let (_, json, _) = idem(&[
        "keys",
        "purge",
        "--store",
        url,
        "--tenant",
        "cli-test",
        "--state",
        "completed",
        "--json",
    ]);
    assert_eq!(json["deleted"], 1);
    let (_, json, _) = idem(&["stats", "--store", url, "--json"]);
    assert_eq!(json["completed"].as_u64(), Some(0), "{json}");

    let (code, json, out) = idem(&["outbox", "status", "--store", url, "--json"]);
    if outbox {
        assert_eq!(code, 3, "no outbox table yet: {out}");
        assert_eq!(json["exit_code"], 3, "{out}");
        let store = AnyLease::connect(url).await.unwrap();
        let event = OutboxEvent::new("cli.test", b"{}".to_vec()).unwrap();
        // One event in the engine's outbox table, committed.
        macro_rules! enqueue {
            ($outbox:ty, $s:expr) => {{
                let o = <$outbox>::new($s.pool().clone());
                o.migrate().await.unwrap();
                let mut tx = $s.pool().begin().await.unwrap();
                o.enqueue(&mut tx, &event).await.unwrap();
                tx.commit().await.unwrap();
            }};
        }
        match &store {
            AnyLease::Sqlite(s) => enqueue!(idem_sqlite::SqliteOutbox, s),
            AnyLease::Postgres(s) => enqueue!(idem_postgres::PgOutbox, s),
            AnyLease::MySql(s) => enqueue!(idem_mysql::MySqlOutbox, s),
            AnyLease::Redis(_) => unreachable!(),
        }
        let (code, json, out) = idem(&["outbox", "status", "--store", url, "--json"]);
        assert_eq!(code, 0, "{out}");
        assert_eq!(json["unsent"], 1, "{json}");
    } else {
        assert_eq!(code, 2, "Redis keeps no outbox: {out}");
        assert_eq!(json["exit_code"], 2, "a JSON error: {out}");
    }
}

support::on_each_sql_store!("idem_cli", async |url| operator_commands(url, true).await);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_redis() {
    let server = servers::RedisServer::start(&["--appendonly", "yes", "--maxmemory-policy", "noeviction"]);
    operator_commands(&server.url(), false).await;
}

#[test]
fn a_bad_url_is_2_and_an_unreachable_store_is_3() {
    refused(&["stats", "--store", "ftp://example.com/x"], "unsupported store URL");
    let (code, _, out) = idem(&["stats", "--store", "postgres://postgres@127.0.0.1:1/x"]);
    assert_eq!(code, 3, "{out}");
    let (code, _, out) = idem(&["outbox", "status", "--store", "/tmp/x.db", "--table", "bad name"]);
    assert_eq!(code, 2, "{out}");
    // Redis behind Sentinel: a URL without its service is refused, one
    // whose sentinels do not answer is unreachable.
    refused(&["stats", "--store", "redis+sentinel://127.0.0.1:1"], "no service name");
    let (code, _, out) = idem(&["stats", "--store", "redis+sentinel://:pw@127.0.0.1:1/main"]);
    assert_eq!(code, 3, "{out}");
    assert!(out.contains("no master for service") && !out.contains("pw@"), "{out}");
}
