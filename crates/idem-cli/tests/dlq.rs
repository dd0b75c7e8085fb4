//! `idem dlq list | show | redrive` on each SQL store, against the fake
//! vendor: a redrive replays what the vendor already applied (one payment),
//! pays what it had not, fails what it refuses; caps, filters, `--json` and
//! exit codes. PostgreSQL and MariaDB get a database of their own.

mod support;

use std::sync::Arc;
use std::time::Duration;

use idem_core::{DeadLetterStore, IdempotencyKey, NewDeadLetter, OutboundRequest, Scope, SentUnder};
use idem_gateway::AnyLease;
use support::{dlq, idem_out as idem, refused, resolve_not_applied, tag};

/// The fake vendor on its own runtime and thread, so the test's runtime
/// can block on the `idem` process meanwhile.
fn start_vendor() -> String {
    start_vendor_with(fake_vendor::Options::default())
}

fn start_vendor_with(options: fake_vendor::Options) -> String {
    support::serve_vendor(Arc::new(fake_vendor::Vendor::new(options)))
}

async fn pay(base: &str, key: &str, body: &str) -> u16 {
    idem_tls::test_pki::http_client()
        .post(format!("{base}/v1/payouts"))
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(body.to_owned())
        .send()
        .await
        .unwrap()
        .status()
        .as_u16()
}

async fn payouts(base: &str) -> u64 {
    let l: serde_json::Value = idem_tls::test_pki::get(format!("{base}/v1/ledger"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    l["payouts"].as_u64().unwrap()
}

/// A letter as the service writes it: sent under the vendor's terms (a
/// 24 h key horizon).
fn letter(base: &str, key: &str, body: &str) -> NewDeadLetter {
    bare_letter(base, key, body).sent_under(SentUnder {
        key_horizon: Duration::from_secs(86_400),
        horizon_margin: Duration::from_secs(3_600),
        settle: Duration::from_secs(35),
    })
}

/// A letter as written before the send terms were kept.
fn bare_letter(base: &str, key: &str, body: &str) -> NewDeadLetter {
    NewDeadLetter::new(
        Scope::parse("dlq-test", "payout").unwrap(),
        IdempotencyKey::new(key).unwrap(),
        OutboundRequest::new(
            "POST",
            format!("{base}/v1/payouts"),
            vec![("content-type".into(), "application/json".into())],
            body.as_bytes().to_vec(),
        )
        .unwrap(),
        5,
        "HTTP 503: down",
    )
}

async fn dead_letter_commands(url: &str) {
    let base = start_vendor();
    // No table yet: a failure that says so (on SQLite, no file yet: reading
    // commands never create one).
    let sqlite = !url.contains("://");
    let (code, _, out) = idem(&["dlq", "list", "--store", url]);
    if sqlite {
        assert_eq!(code, 3, "{out}");
        assert!(out.contains("no such database file"), "{out}");
        assert!(!std::path::Path::new(url).exists(), "nothing created");
    } else {
        assert_eq!(code, 1, "{out}");
        assert!(out.contains("is the table there?"), "{out}");
    }
    // `idem migrate --dead-letters` creates it; a dry run first applies nothing.
    let (code, v, out) = idem(&["migrate", "--store", url, "--dead-letters", "--dry-run", "--json"]);
    assert_eq!(code, 0, "{out}");
    assert_eq!(v["applied"], false);
    assert!(v["pending"].as_array().is_some_and(|p| !p.is_empty()), "{out}");
    let (code, _, out) = idem(&["dlq", "list", "--store", url]);
    assert_eq!(code, if sqlite { 3 } else { 1 }, "a dry run created nothing: {out}");
    let (code, _, out) = idem(&["migrate", "--store", url, "--dead-letters"]);
    assert_eq!(code, 0, "{out}");
    let (code, v, out) = idem(&["migrate", "--store", url, "--dead-letters", "--dry-run", "--json"]);
    assert_eq!(code, 0, "{out}");
    assert_eq!(v["pending"], serde_json::json!([]), "{out}");
    let (code, v, out) = dlq(url, &["list", "--json"]);
    assert_eq!(code, 0, "{out}");
    assert_eq!(v, serde_json::json!([]), "{out}");

    let store = AnyLease::connect(url).await.unwrap();
    let ids = match &store {
        AnyLease::Sqlite(s) => record_all(idem_sqlite::SqliteDeadLetters::new(s.pool().clone()), &base).await,
        AnyLease::Postgres(s) => record_all(idem_postgres::PgDeadLetters::new(s.pool().clone()), &base).await,
        AnyLease::MySql(s) => record_all(idem_mysql::MySqlDeadLetters::new(s.pool().clone()), &base).await,
        AnyLease::Redis(_) => unreachable!(),
    };
    let [applied, fresh, mismatched] = ids;
    // The vendor had applied two of them before their answers were lost.
    assert_eq!(pay(&base, "applied", r#"{"amount":10}"#).await, 201);
    assert_eq!(pay(&base, "mismatched", r#"{"amount":30}"#).await, 201);

    let (code, json, out) = dlq(url, &["list", "--json"]);
    assert_eq!(code, 0, "{out}");
    let listed = json.as_array().expect("an array").clone();
    let listed_ids: Vec<_> = listed.iter().map(|l| l["id"].as_i64().unwrap()).collect();
    assert_eq!(listed_ids, [applied, fresh, mismatched]);
    assert!(
        listed.iter().all(|l| l["state"] == "dead" && l["attempts"] == 5),
        "{json}"
    );
    let (_, json, _) = dlq(
        url,
        &["list", "--limit", "1", "--after-id", &applied.to_string(), "--json"],
    );
    assert_eq!(json.as_array().unwrap().len(), 1);
    assert_eq!(json[0]["id"], fresh);
    let (_, json, _) = dlq(url, &["list", "--tenant", "nobody", "--json"]);
    assert_eq!(json, serde_json::json!([]));
    let (code, text, out) = idem(&["dlq", "list", "--store", url]);
    assert_eq!((code, text), (0, serde_json::Value::Null), "plain text: {out}");
    assert!(out.contains("3 dead letter(s)"), "{out}");

    let (code, json, out) = dlq(url, &["show", "--id", &applied.to_string(), "--json"]);
    assert_eq!(code, 0, "{out}");
    assert_eq!(json["key"], "applied");
    assert_eq!(json["body"], r#"{"amount":10}"#);
    assert_eq!(
        json["headers"],
        serde_json::json!([["content-type", "application/json"]])
    );
    let (code, _, out) = dlq(url, &["show", "--id", "999999"]);
    assert_eq!(code, 1, "{out}");

    // Capped at two: the applied one is replayed (not paid again), the fresh
    // one paid; the third is left alone.
    let (code, json, out) = dlq(url, &["redrive", "--max", "2", "--per-second", "50", "--json"]);
    assert_eq!(code, 0, "{out}");
    assert_eq!(
        (json["resolved"].as_u64(), json["failed"].as_u64()),
        (Some(2), Some(0)),
        "{json}"
    );
    assert_eq!(json["items"][0]["id"], applied);
    assert_eq!(json["items"][0]["status"], 201);
    assert_eq!(payouts(&base).await, 3);
    let (_, json, _) = dlq(url, &["list", "--state", "dead", "--json"]);
    assert_eq!(json.as_array().unwrap().len(), 1, "{json}");
    let (_, json, _) = dlq(url, &["show", "--id", &applied.to_string(), "--json"]);
    assert_eq!(
        (json["state"].as_str(), json["response_status"].as_u64()),
        (Some("resolved"), Some(201))
    );
    let kept: serde_json::Value = serde_json::from_str(json["response_body"].as_str().unwrap()).unwrap();
    assert_eq!(kept["amount"], 10);

    // The vendor refuses the third (its key went with another body): it
    // fails again, exit 1, and stays dead.
    let (code, json, out) = dlq(url, &["redrive", "--json"]);
    assert_eq!(code, 1, "{out}");
    assert_eq!(
        (json["failed"].as_u64(), json["resolved"].as_u64()),
        (Some(1), Some(0)),
        "{json}"
    );
    assert!(
        json["items"][0]["error"].as_str().unwrap().contains("HTTP 422"),
        "{json}"
    );
    let (_, json, _) = dlq(url, &["show", "--id", &mismatched.to_string(), "--json"]);
    assert_eq!(
        (json["state"].as_str(), json["attempts"].as_u64()),
        (Some("dead"), Some(6)),
        "{json}"
    );
    assert_eq!(payouts(&base).await, 3);

    // One by id: a resolved one is skipped.
    let (code, json, out) = dlq(url, &["redrive", "--id", &fresh.to_string(), "--json"]);
    assert_eq!(code, 0, "{out}");
    assert_eq!(json["items"][0]["result"], "skipped");
    let (code, _, out) = dlq(url, &["redrive", "--id", "1", "--tenant", "x"]);
    assert_eq!(code, 2, "--id takes no filters: {out}");
    // A mistyped id fails, clearly.
    let (code, _, out) = dlq(url, &["redrive", "--id", "987654321"]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("no dead letter 987654321"), "{out}");

    // Past the vendor's key horizon: a letter whose first send may have
    // reached the vendor two days ago is not sent (the vendor has forgotten
    // the key and would pay again); it is held as unknown.
    let two_days_ago = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
        - 48 * 3_600_000;
    let old = match &store {
        AnyLease::Sqlite(s) => {
            record_old(
                idem_sqlite::SqliteDeadLetters::new(s.pool().clone()),
                &base,
                two_days_ago,
            )
            .await
        }
        AnyLease::Postgres(s) => {
            record_old(idem_postgres::PgDeadLetters::new(s.pool().clone()), &base, two_days_ago).await
        }
        AnyLease::MySql(s) => {
            record_old(idem_mysql::MySqlDeadLetters::new(s.pool().clone()), &base, two_days_ago).await
        }
        AnyLease::Redis(_) => unreachable!(),
    };
    let paid_before = payouts(&base).await;
    let (code, json, out) = dlq(url, &["redrive", "--id", &old.to_string(), "--json"]);
    assert_eq!(code, 1, "held, not sent: {out}");
    assert_eq!(json["items"][0]["result"], "unknown", "{json}");
    assert!(
        json["items"][0]["reason"].as_str().unwrap().contains("key horizon"),
        "{json}"
    );
    assert_eq!(payouts(&base).await, paid_before, "nothing sent on a guess");
    let (_, json, _) = dlq(url, &["list", "--state", "unknown", "--json"]);
    assert_eq!(json[0]["id"], old, "{json}");
    // Still held: a second redrive sends nothing either, override or not.
    let (code, _, _) = dlq(url, &["redrive", "--id", &old.to_string(), "--past-horizon"]);
    assert_eq!(code, 1);
    assert_eq!(payouts(&base).await, paid_before);
    // The operator checks the vendor and records it: not applied.
    let (code, _, out) = dlq(url, &["resolve", "--id", &old.to_string(), "--not-applied"]);
    assert_eq!(code, 2, "a note is required: {out}");
    let (code, json, out) = dlq(
        url,
        &[
            "resolve",
            "--id",
            &old.to_string(),
            "--not-applied",
            "--note",
            "not on the vendor's dashboard",
            "--json",
        ],
    );
    assert_eq!(code, 0, "{out}");
    assert_eq!(
        (json["state"].as_str(), json["verdict"]["verdict"].as_str()),
        (Some("dead"), Some("not_applied")),
        "{json}"
    );
    assert_eq!(json["first_reached_at_ms"], serde_json::Value::Null);
    // Now it is sent, to the URL given.
    let (code, json, out) = dlq(
        url,
        &[
            "redrive",
            "--id",
            &old.to_string(),
            "--url",
            &format!("{base}/v1/payouts"),
            "--json",
        ],
    );
    assert_eq!(code, 0, "{out}");
    assert_eq!(json["items"][0]["result"], "resolved", "{json}");
    assert_eq!(payouts(&base).await, paid_before + 1);
    let (code, _, out) = dlq(url, &["redrive", "--id", "1", "--url", "http://vendor#"]);
    assert_eq!(code, 2, "a bad target is refused: {out}");
    // A new target for letters of every operation is refused: nothing sent,
    // nothing rewritten.
    let (code, _, out) = dlq(url, &["redrive", "--url", &format!("{base}/v1/payouts")]);
    assert_eq!(code, 2, "--url needs --operation or --id: {out}");
    assert!(out.contains("--operation"), "{out}");
    let (code, _, out) = dlq(
        url,
        &["redrive", "--id", "1", "--deadline-secs", "30", "--hold-secs", "5"],
    );
    assert_eq!(code, 2, "a hold shorter than the deadline: {out}");
    assert!(out.contains("--hold-secs"), "{out}");
    assert_eq!(payouts(&base).await, paid_before + 1);
    let (code, _, out) = dlq(
        url,
        &["resolve", "--id", &old.to_string(), "--applied", "--note", "again"],
    );
    assert_eq!(code, 1, "a resolved letter is final: {out}");

    // A letter of a vendor without keys (the service ran with a 0 s key
    // horizon), paid before its answer was lost: a redrive with the
    // command's defaults keeps to the horizon the letter was sent under.
    // Held as unknown, not paid again.
    let keyless_base = start_vendor_with(fake_vendor::Options {
        idempotency: false,
        ..Default::default()
    });
    assert_eq!(pay(&keyless_base, "keyless", r#"{"amount":50}"#).await, 201);
    let a_minute_ago = now_ms() - 60_000;
    let keyless = record_on(
        &store,
        &letter(&keyless_base, "keyless", r#"{"amount":50}"#)
            .reached_at(Some(a_minute_ago))
            .sent_under(KEYLESS),
    )
    .await;
    let (_, json, _) = dlq(url, &["show", "--id", &keyless.to_string(), "--json"]);
    assert_eq!(json["sent_under"]["key_horizon_secs"], 0.0, "{json}");
    let (code, json, out) = dlq(url, &["redrive", "--id", &keyless.to_string(), "--json"]);
    assert_eq!(code, 1, "held, not sent: {out}");
    assert_eq!(json["items"][0]["result"], "unknown", "{json}");
    assert_eq!(payouts(&keyless_base).await, 1, "paid once");
    // A letter written before the terms were kept: refused (exit 2),
    // neither taken nor sent, until the operator says the horizon.
    let bare = record_on(&store, &bare_letter(&base, "bare", r#"{"amount":60}"#)).await;
    let paid_before = payouts(&base).await;
    let (code, json, out) = dlq(url, &["redrive", "--id", &bare.to_string(), "--json"]);
    assert_eq!(code, 2, "{out}");
    assert_eq!(json["items"][0]["result"], "refused", "{json}");
    assert_eq!(json["refused"], 1, "{json}");
    let (_, json, _) = dlq(url, &["show", "--id", &bare.to_string(), "--json"]);
    assert_eq!(
        (json["state"].as_str(), json["redrives"].as_u64()),
        (Some("dead"), Some(0)),
        "{json}"
    );
    assert_eq!(payouts(&base).await, paid_before, "nothing sent");
    let (code, json, out) = dlq(
        url,
        &[
            "redrive",
            "--id",
            &bare.to_string(),
            "--key-horizon-secs",
            "86400",
            "--json",
        ],
    );
    assert_eq!(code, 0, "{out}");
    assert_eq!(json["items"][0]["result"], "resolved", "{json}");
    assert_eq!(payouts(&base).await, paid_before + 1);
}

/// The terms of a vendor without idempotency keys.
const KEYLESS: SentUnder = SentUnder {
    key_horizon: Duration::ZERO,
    horizon_margin: Duration::ZERO,
    settle: Duration::from_secs(35),
};

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

async fn record_on(store: &AnyLease, letter: &NewDeadLetter) -> i64 {
    match store {
        AnyLease::Sqlite(s) => {
            idem_sqlite::SqliteDeadLetters::new(s.pool().clone())
                .record(letter)
                .await
        }
        AnyLease::Postgres(s) => idem_postgres::PgDeadLetters::new(s.pool().clone()).record(letter).await,
        AnyLease::MySql(s) => idem_mysql::MySqlDeadLetters::new(s.pool().clone()).record(letter).await,
        AnyLease::Redis(_) => unreachable!(),
    }
    .unwrap()
}

/// Records a letter whose first send may have reached the vendor at `reached_at_ms`.
async fn record_old<S: DeadLetterStore>(store: S, base: &str, reached_at_ms: i64) -> i64 {
    store
        .record(&letter(base, "old", r#"{"amount":40}"#).reached_at(Some(reached_at_ms)))
        .await
        .unwrap()
}

/// Creates the table and records three dead letters; answers their ids.
async fn record_all<S: DeadLetterStore + Migrate>(store: S, base: &str) -> [i64; 3] {
    store.migrate_table().await;
    let mut ids = [0; 3];
    for (i, (key, body)) in [
        ("applied", r#"{"amount":10}"#),
        ("fresh", r#"{"amount":20}"#),
        ("mismatched", r#"{"amount":31}"#),
    ]
    .into_iter()
    .enumerate()
    {
        ids[i] = store.record(&letter(base, key, body)).await.unwrap();
    }
    ids
}

trait Migrate {
    async fn migrate_table(&self);
}

impl Migrate for idem_sqlite::SqliteDeadLetters {
    async fn migrate_table(&self) {
        self.migrate().await.unwrap();
    }
}

impl Migrate for idem_postgres::PgDeadLetters {
    async fn migrate_table(&self) {
        self.migrate().await.unwrap();
    }
}

impl Migrate for idem_mysql::MySqlDeadLetters {
    async fn migrate_table(&self) {
        self.migrate().await.unwrap();
    }
}

support::on_each_sql_store!("idem_cli_dlq", dead_letter_commands);

#[test]
fn redis_keeps_no_dead_letters() {
    refused(
        &["dlq", "list", "--store", "redis://127.0.0.1:6379/15"],
        "Redis keeps no dead letters",
    );
    let (code, _, out) = idem(&["dlq", "list", "--store", "/tmp/x.db", "--table", "bad name"]);
    assert_eq!(code, 2, "{out}");
    refused(
        &["migrate", "--store", "redis://127.0.0.1:6379/15", "--dead-letters"],
        "Redis keeps no dead letters",
    );
}

/// A redrive answered `200 {"error": …}` (a default backend, a wrong
/// endpoint) resolves its letter only without a contract to check: with
/// `--answer-field`/`--answer-echo` the letter is held as unknown (exit 1),
/// and `idem dlq resolve` is its way out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_2xx_that_is_not_the_call_holds_the_letter_as_unknown() {
    let app = axum::Router::new().route(
        "/v1/payouts",
        axum::routing::post(|| async { ([("content-type", "application/json")], r#"{"error":"not here"}"#) }),
    );
    let base = support::serve(app).await;
    let path = std::env::temp_dir().join(format!("idem-cli-dlq-answer-{}.db", tag()));
    let url = path.display().to_string();
    let (code, _, out) = idem(&["migrate", "--store", &url, "--dead-letters"]);
    assert_eq!(code, 0, "{out}");
    let pool = sqlx::SqlitePool::connect(&format!("sqlite://{url}")).await.unwrap();
    let letters = idem_sqlite::SqliteDeadLetters::new(pool);
    let checked = letters
        .record(&letter(&base, "po-a", r#"{"amount":5,"reference":"po-a"}"#))
        .await
        .unwrap();
    let unchecked = letters
        .record(&letter(&base, "po-b", r#"{"amount":6,"reference":"po-b"}"#))
        .await
        .unwrap();
    // The answer to a payout has an id and echoes its amount and reference.
    let contract = ["--answer-field=id", "--answer-echo=amount", "--answer-echo=reference"];
    let redrive = ["redrive", "--id", &checked.to_string(), "--json"];
    let (code, json, out) = dlq(&url, &[&redrive[..], &contract].concat());
    assert_eq!(code, 1, "held as unknown is a failure to redrive: {out}");
    assert_eq!(json["items"][0]["result"], "unknown", "{json}");
    let held = letters.get(checked).await.unwrap().unwrap();
    assert_eq!(held.state, idem_core::DeadLetterState::Unknown, "{held:?}");
    assert!(held.last_error.contains("contract"), "{held:?}");
    // The way out: the operator records what the vendor says.
    resolve_not_applied(&url, checked, "the vendor has no such payout");
    // Without a contract, any 2xx resolves the letter.
    let (code, json, out) = dlq(&url, &["redrive", "--id", &unchecked.to_string(), "--json"]);
    assert_eq!(code, 0, "{out}");
    assert_eq!(json["items"][0]["result"], "resolved", "{json}");
    for suffix in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{url}{suffix}"));
    }
}
