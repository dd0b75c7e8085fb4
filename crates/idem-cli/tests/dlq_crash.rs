//! `idem dlq redrive` killed (SIGKILL) after the vendor paid, before it
//! stored the answer. The redrive's take is its sent mark, so:
//!
//! - a later redrive of the letter whose hold ran out, past the vendor's
//!   key horizon, does not send it blindly (the vendor, past its memory,
//!   would pay again): without a way to ask the vendor it is held as
//!   unknown, and the vendor paid once;
//! - a later redrive inside the horizon that meets only refused
//!   connections does not forget the crashed send: the operator's older
//!   "not applied" no longer lets the service cancel (refund) a payout the
//!   vendor made.
//!
//! On SQLite, PostgreSQL and MariaDB.

mod support;

use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use support::{Sql, dlq, resolve_not_applied};

use idem_core::{DeadLetterState, DeadLetterStore, IdempotencyKey, NewDeadLetter, OutboundRequest, Scope};

/// The fake vendor, remembering keys for 3 s, on its own runtime and thread.
fn start_vendor() -> (String, Arc<fake_vendor::Vendor>) {
    let vendor = Arc::new(fake_vendor::Vendor::new(fake_vendor::Options {
        key_horizon: Duration::from_secs(3),
        idempotency: true,
    }));
    let base = support::serve_vendor(vendor.clone());
    (base, vendor)
}

/// A redrive process, killed when the test ends.
struct Redrive(Child);

impl Drop for Redrive {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A dead letter of a payout the vendor refused (nothing reached it), with
/// the operator's "not applied" on record; answers its id.
async fn dead_payout<S: DeadLetterStore>(store: &S, store_url: &str, base: &str) -> i64 {
    let key = format!("payout-{}", uuid::Uuid::now_v7());
    let letter = NewDeadLetter::new(
        Scope::parse("dlq-crash", "payout").unwrap(),
        IdempotencyKey::new(&key).unwrap(),
        OutboundRequest::new(
            "POST",
            format!("{base}/v1/payouts"),
            vec![("content-type".into(), "application/json".into())],
            br#"{"amount":25}"#.to_vec(),
        )
        .unwrap(),
        5,
        "HTTP 503: down",
    );
    let id = store.record(&letter).await.unwrap();
    resolve_not_applied(store_url, id, "the vendor's dashboard shows nothing");
    id
}

/// Starts `idem dlq redrive --id`, kills it (SIGKILL) while the vendor
/// works on its send, and waits until the vendor has paid.
async fn redrive_killed_after_the_vendor_paid(store_url: &str, id: i64, vendor: &fake_vendor::Vendor) {
    vendor
        .set_faults(fake_vendor::Faults {
            slow_ms: 1_500,
            ..fake_vendor::Faults::default()
        })
        .await;
    let mut redrive = Redrive(
        Command::new(env!("CARGO_BIN_EXE_idem"))
            .args(["dlq", "redrive", "--store", store_url, "--id", &id.to_string()])
            .args(["--key-horizon-secs", "3", "--deadline-secs", "2", "--hold-secs", "2"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("idem runs"),
    );
    for _ in 0..4_000 {
        if vendor.in_process() == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(vendor.in_process(), 1, "the redrive's send reached the vendor");
    redrive.0.kill().unwrap();
    redrive.0.wait().unwrap();
    for _ in 0..400 {
        if vendor.paid() == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(vendor.paid(), 1, "the vendor paid the killed redrive's send");
    vendor.set_faults(fake_vendor::Faults::default()).await;
}

/// The killed redrive's hold (`--hold-secs 2`) runs out.
async fn hold_runs_out<S: DeadLetterStore>(store: &S, id: i64) {
    let letter = store.get(id).await.unwrap().unwrap();
    let until = letter.redrive_until_ms.expect("the killed redrive holds the letter");
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64;
    assert!(
        until - now <= 2_000,
        "held for --hold-secs 2, not the default: {letter:?}"
    );
    tokio::time::sleep(Duration::from_millis((until - now).max(0) as u64 + 100)).await;
}

/// `idem dlq redrive --state redriving --json` (the letters a redrive
/// holds) for a vendor of key horizon `horizon` s, with a deadline of
/// `deadline` s; as [`dlq`] answers.
fn redrive_held(store_url: &str, horizon: &str, deadline: &str) -> (i32, serde_json::Value, String) {
    let args = [
        "redrive",
        "--state",
        "redriving",
        "--key-horizon-secs",
        horizon,
        "--deadline-secs",
        deadline,
        "--json",
    ];
    dlq(store_url, &args)
}

async fn crashed_redrive_then_past_the_horizon<S: DeadLetterStore>(store: S, store_url: &str) {
    let (base, vendor) = start_vendor();
    let id = dead_payout(&store, store_url, &base).await;
    redrive_killed_after_the_vendor_paid(store_url, id, &vendor).await;
    let left = store.get(id).await.unwrap().unwrap();
    assert_eq!(left.state, DeadLetterState::Redriving);
    assert!(left.first_reached_at_ms.is_some(), "the take marked the send: {left:?}");
    hold_runs_out(&store, id).await;
    // Past the vendor's memory (3 s on its clock and, for the redrive, since the mark).
    vendor.advance(Duration::from_secs(10));
    tokio::time::sleep(Duration::from_millis(3_100)).await;
    let (code, json, out) = redrive_held(store_url, "3", "5");
    assert_eq!(code, 1, "a letter held as unknown is a failure to redrive: {out}");
    assert_eq!(json["items"][0]["result"], "unknown", "{json}");
    assert_eq!(vendor.paid(), 1, "the vendor paid once: {out}");
    assert_eq!(store.get(id).await.unwrap().unwrap().state, DeadLetterState::Unknown);
}

async fn crashed_redrive_is_never_refunded<S: DeadLetterStore>(store: S, store_url: &str) {
    let (base, vendor) = start_vendor();
    let id = dead_payout(&store, store_url, &base).await;
    redrive_killed_after_the_vendor_paid(store_url, id, &vendor).await;
    hold_runs_out(&store, id).await;
    // Inside the horizon, a redrive that meets only refused connections.
    vendor
        .set_faults(fake_vendor::Faults {
            refuse_ms: 60_000,
            ..fake_vendor::Faults::default()
        })
        .await;
    let addr = base.trim_start_matches("http://").to_owned();
    for _ in 0..200 {
        if std::net::TcpStream::connect(&addr).is_err() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(
        std::net::TcpStream::connect(&addr).is_err(),
        "the vendor refuses connections"
    );
    let (code, json, out) = redrive_held(store_url, "3600", "1");
    assert_eq!(code, 1, "a letter that failed again is a failure to redrive: {out}");
    assert_eq!(json["items"][0]["result"], "failed", "{json}");
    let letter = store.get(id).await.unwrap().unwrap();
    assert_eq!(letter.state, DeadLetterState::Dead);
    assert!(
        letter.first_reached_at_ms.is_some(),
        "the crashed send is remembered: {letter:?}"
    );
    assert!(!letter.known_not_applied());
    assert!(
        !store.cancel(id).await.unwrap(),
        "a payout the vendor may have made is never cancelled"
    );
    assert_eq!(vendor.paid(), 1);
}

async fn sqlite_store(path: &str) -> idem_sqlite::SqliteDeadLetters {
    let pool = sqlx::SqlitePool::connect(&format!("sqlite://{path}?mode=rwc"))
        .await
        .unwrap();
    let store = idem_sqlite::SqliteDeadLetters::new(pool);
    store.migrate().await.unwrap();
    store
}

async fn postgres_store(url: &str) -> idem_postgres::PgDeadLetters {
    let pool = sqlx::PgPool::connect(url).await.unwrap();
    let store = idem_postgres::PgDeadLetters::new(pool);
    store.migrate().await.unwrap();
    store
}

async fn mysql_store(url: &str) -> idem_mysql::MySqlDeadLetters {
    let pool = sqlx::MySqlPool::connect(url).await.unwrap();
    let store = idem_mysql::MySqlDeadLetters::new(pool);
    store.migrate().await.unwrap();
    store
}

/// The tests of `$scenario` on SQLite, PostgreSQL and MariaDB, named as
/// listed, each on a file or a database of its own (so the table's ids and
/// letters are its own).
macro_rules! on_each_engine {
    ($scenario:ident => $sqlite:ident, $postgres:ident, $mariadb:ident $(,)?) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $sqlite() {
            let path = support::temp("dlq-crash", "letters.db");
            $scenario(sqlite_store(&path).await, &path).await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $postgres() {
            Sql::Postgres
                .with_db("idem_dlq_crash", async |url| {
                    $scenario(postgres_store(url).await, url).await
                })
                .await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $mariadb() {
            Sql::MariaDb
                .with_db("idem_dlq_crash", async |url| {
                    $scenario(mysql_store(url).await, url).await
                })
                .await;
        }
    };
}

on_each_engine!(crashed_redrive_then_past_the_horizon =>
    a_killed_redrive_is_not_sent_again_past_the_horizon_on_sqlite,
    a_killed_redrive_is_not_sent_again_past_the_horizon_on_postgres,
    a_killed_redrive_is_not_sent_again_past_the_horizon_on_mariadb,
);

on_each_engine!(crashed_redrive_is_never_refunded =>
    a_killed_redrive_is_never_refunded_on_sqlite,
    a_killed_redrive_is_never_refunded_on_postgres,
    a_killed_redrive_is_never_refunded_on_mariadb,
);
