//! Withdrawals killed at each step boundary, on every engine: the ledger
//! process (built with `fault-injection`) stops at a named point of a
//! withdrawal's steps (`LEDGER_STEP_FAULTS`), prints `IDEM_FAULT point=…
//! step=…`, and is killed there with SIGKILL; a new process then finishes
//! the withdrawal, through the client's retry or its completer. Whatever
//! the point, the account is debited once (credited back once when
//! declined), the FX vendor books one quote and the payout vendor pays at
//! most once, and the audit is conserved. One more kill lands while the FX
//! vendor, which has no keys, is still booking the quote. With the
//! recovery points switched off, the same kill doubles the debit and the
//! quote: these checks can fail.

mod common;
#[path = "../../chaos/src/copy.rs"]
mod copy;

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Stdio};
use std::sync::{Arc, OnceLock, mpsc};
use std::time::{Duration, Instant};

use common::*;
use idem_core::multistep::{MultiStepState, MultiStepStore};
use idem_core::{IdempotencyKey, Scope};
use ledger::withdrawals::WITHDRAWAL_OPERATION;
use ledger::{LedgerDb, Store};

/// This test build's ledger binary, which has `fault-injection` (the
/// ledger's dev-dependency on itself turns it on), copied once per run: a
/// plain build of the ledger writes the same path. The copy is started once
/// before use ([`copy::runnable_copy`]), so a process another test forks
/// while it is written cannot make a later start fail with "Text file busy".
fn fault_ledger() -> PathBuf {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        let built = PathBuf::from(env!("CARGO_BIN_EXE_ledger"));
        let copy = built.with_file_name(format!("ledger-withdrawal-kills-{}", std::process::id()));
        copy::runnable_copy(&built, &copy).expect("the binary is copied and runs");
        copy
    })
    .clone()
}

/// A ledger process; killed with SIGKILL when dropped.
struct Process {
    child: Child,
    base: String,
    faults: mpsc::Receiver<String>,
}

impl Process {
    /// Starts the fault-injecting ledger on `database`, with both vendors
    /// at `vendor`, runs leased 1 s, `completers` completers, and the step
    /// faults `faults` (`LEDGER_STEP_FAULTS`).
    fn start(database: &str, vendor: &str, completers: u16, faults: Option<&str>) -> Self {
        Self::start_with(database, vendor, completers, faults, &[])
    }

    /// [`start`](Self::start) with more environment variables.
    fn start_with(database: &str, vendor: &str, completers: u16, faults: Option<&str>, env: &[(&str, &str)]) -> Self {
        let mut command = ledger_command(fault_ledger(), database);
        command
            .args([
                "--vendor-url",
                vendor,
                "--fx-url",
                vendor,
                "--withdrawal-lease-secs",
                "1",
            ])
            .args(["--completers", &completers.to_string()])
            .args(["--snapshot-every-secs", "0", "--sweep-every-secs", "0"])
            .env("RUST_LOG", "info,sqlx=warn")
            .env_remove("LEDGER_STEP_FAULTS")
            .env_remove("LEDGER_BREAK_RECOVERY_POINTS")
            .stderr(Stdio::piped());
        if let Some(faults) = faults {
            command.env("LEDGER_STEP_FAULTS", faults);
        }
        command.envs(env.iter().copied());
        let mut child = command.spawn().expect("the ledger starts");
        let (tx, faults) = mpsc::channel();
        let stderr = child.stderr.take().expect("stderr");
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                eprintln!("ledger: {line}");
                if line.starts_with("IDEM_FAULT ") {
                    let _ = tx.send(line);
                }
            }
        });
        let base = listening(&mut child, database);
        Self { child, base, faults }
    }

    /// The fault line it printed, once it stops at its fault point.
    fn stopped_at(&self) -> String {
        self.faults
            .recv_timeout(Duration::from_secs(60))
            .expect("the ledger reached its fault point within 60 s")
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        // SIGKILL: no shutdown, no cleanup.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A client of the ledger at `base`, as tenant `token`.
struct Client {
    http: reqwest::Client,
    token: String,
}

impl Client {
    fn new() -> Self {
        Self {
            http: idem_tls::test_pki::http_builder()
                .timeout(Duration::from_secs(60))
                .build()
                .unwrap(),
            token: token(),
        }
    }

    async fn post(
        &self,
        base: &str,
        path: &str,
        key: &str,
        body: &str,
    ) -> reqwest::Result<(u16, bool, serde_json::Value)> {
        let r = self
            .http
            .post(format!("{base}{path}"))
            .bearer_auth(&self.token)
            .header("idempotency-key", key)
            .header("content-type", "application/json")
            .body(body.to_owned())
            .send()
            .await?;
        let (status, replayed) = (r.status().as_u16(), r.headers().contains_key("idempotent-replayed"));
        Ok((status, replayed, r.json().await?))
    }

    async fn get(&self, base: &str, path: &str) -> serde_json::Value {
        let r = self
            .http
            .get(format!("{base}{path}"))
            .bearer_auth(&self.token)
            .send()
            .await
            .unwrap();
        r.json().await.unwrap()
    }
}

/// What the fake vendor at `vendor_url` answers at `path` (its own record
/// of the quotes it booked and the payouts it paid).
async fn vendor_json(vendor_url: &str, path: &str) -> serde_json::Value {
    let r = idem_tls::test_pki::get(format!("{vendor_url}{path}")).await.unwrap();
    r.json().await.unwrap()
}

/// Where the process is killed.
#[derive(Debug, Clone, Copy)]
enum Kill {
    /// At `step:point` of `LEDGER_STEP_FAULTS`.
    At(&'static str, &'static str),
    /// While the FX vendor books the quote (the send marked, its answer
    /// not yet given).
    WhileBooking,
}

/// What resumes the withdrawal in the new process.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Resume {
    /// The client's retry with the same key.
    Retry,
    /// The new process's completer (the client only reads the outcome
    /// afterwards).
    Completer,
}

/// The state of the operation `(tenant, key)` in `db`.
async fn state_of<D: LedgerDb>(db: &D, tenant: &str, key: &str) -> Option<MultiStepState> {
    let scope = Scope::parse(tenant, WITHDRAWAL_OPERATION).unwrap();
    let key = IdempotencyKey::new(key.trim_matches('"')).unwrap();
    let row = MultiStepStore::<D>::find(&db.multi_steps(), &scope, &key)
        .await
        .unwrap();
    row.map(|r| r.state)
}

/// A withdrawal about to be sent: the fake vendor (both vendors), the
/// test's own database, the first fault-injecting ledger process on them,
/// and an account of a fresh tenant topped up with 10 000 there.
struct Funded {
    vendor_url: String,
    vendor: Arc<fake_vendor::Vendor>,
    database: String,
    first: Process,
    client: Arc<Client>,
    /// The withdrawal's key.
    key: String,
    /// The withdrawal's body: 2 000 GBP of the account, paid out in EUR.
    body: String,
}

impl Funded {
    /// Starts the first process on `engine` with the step faults `faults`
    /// and the environment `env`, and funds an account there for a
    /// withdrawal to `destination`.
    async fn start(engine: Engine, faults: Option<&str>, env: &[(&str, &str)], destination: &str) -> Self {
        let (vendor_url, vendor) = fake_vendor::start(fake_vendor::Options::default(), None).await.unwrap();
        let database = own_database(engine, "ledger_wkills").await;
        tokio::task::spawn_blocking(fault_ledger).await.unwrap();
        let first = Process::start_with(&database, &vendor_url, 0, faults, env);
        let client = Arc::new(Client::new());
        let (status, _, account) = client
            .post(&first.base, "/v1/accounts", &key(), r#"{"name":"a"}"#)
            .await
            .unwrap();
        assert_eq!(status, 201);
        let account = account["id"].as_str().unwrap().to_owned();
        let top_up = format!(r#"{{"account_id":"{account}","amount":10000}}"#);
        assert_eq!(
            client
                .post(&first.base, "/v1/top-ups", &key(), &top_up)
                .await
                .unwrap()
                .0,
            201
        );
        let body = format!(
            r#"{{"account":"{account}","amount":2000,"currency":"GBP","payout_currency":"EUR","destination":"{destination}"}}"#
        );
        Self {
            vendor_url,
            vendor,
            database,
            first,
            client,
            key: key(),
            body,
        }
    }

    /// Sends the withdrawal to the first process, in a task of its own (its
    /// answer, if the process gives one before it is killed).
    fn send(&self) -> tokio::task::JoinHandle<reqwest::Result<(u16, bool, serde_json::Value)>> {
        let (client, base, k, body) = (
            self.client.clone(),
            self.first.base.clone(),
            self.key.clone(),
            self.body.clone(),
        );
        tokio::spawn(async move { client.post(&base, "/v1/withdrawals", &k, &body).await })
    }
}

/// Kills a withdrawal of 2 000 to `destination` at `kill`, resumes it by
/// `resume` in a new process, and checks every vendor effect and the books.
async fn killed(engine: Engine, kill: Kill, destination: &str, resume: Resume) {
    let declined = destination.starts_with("closed-");
    let faults = match kill {
        Kill::At(step, point) => Some(format!("{step}:{point}=1")),
        Kill::WhileBooking => None,
    };
    let funded = Funded::start(engine, faults.as_deref(), &[], destination).await;
    if let Kill::WhileBooking = kill {
        funded
            .vendor
            .set_faults(fake_vendor::Faults {
                slow_ms: 1_500,
                ..Default::default()
            })
            .await;
    }
    let pending = funded.send();
    let Funded {
        vendor_url,
        vendor,
        database,
        first,
        client,
        key: k,
        body,
    } = funded;
    match kill {
        Kill::At(step, point) => {
            let line = tokio::task::block_in_place(|| first.stopped_at());
            assert_eq!(line, format!("IDEM_FAULT point={point} step={step}"));
        }
        Kill::WhileBooking => {
            let until = Instant::now() + Duration::from_secs(30);
            while vendor.quotes_in_process() == 0 {
                assert!(Instant::now() < until, "the quote's booking never started");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    }
    drop(first);
    assert!(pending.await.unwrap().is_err(), "the killed process never answered");
    vendor.set_faults(fake_vendor::Faults::default()).await;

    let completers = if resume == Resume::Completer { 1 } else { 0 };
    let second = Process::start(&database, &vendor_url, completers, None);
    if resume == Resume::Completer {
        let store = connect(&database).await;
        let tenant = ledger::tenant_for_token(&client.token);
        let until = Instant::now() + Duration::from_secs(60);
        loop {
            let state = match &store {
                Store::Postgres(db) => state_of(db, tenant.as_str(), &k).await,
                Store::MySql(db) => state_of(db, tenant.as_str(), &k).await,
                Store::Sqlite(db) => state_of(db, tenant.as_str(), &k).await,
            };
            if state.is_some_and(MultiStepState::is_final) {
                break;
            }
            assert!(
                Instant::now() < until,
                "the completer did not finish it in 60 s: {state:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    let until = Instant::now() + Duration::from_secs(60);
    let (status, replayed, answer) = loop {
        let (status, replayed, answer) = client.post(&second.base, "/v1/withdrawals", &k, &body).await.unwrap();
        if status != 409 {
            break (status, replayed, answer);
        }
        assert!(
            answer["type"]
                .as_str()
                .is_some_and(|t| t.ends_with("/idempotency-key-in-flight")),
            "{answer}"
        );
        assert!(Instant::now() < until, "still in flight after 60 s");
        tokio::time::sleep(Duration::from_millis(150)).await;
    };
    if resume == Resume::Completer {
        assert!(replayed, "the completer finished it; the client reads its outcome");
    }
    let quotes = vendor_json(&vendor_url, "/v1/quotes/ledger").await;
    let paid = vendor_json(&vendor_url, "/v1/ledger").await;
    assert_eq!(quotes["quotes"], 1, "one quote booked: {quotes}");
    let id = quotes["references"][0].as_str().unwrap().to_owned();
    let audit = client.get(&second.base, "/v1/audit").await;
    assert_eq!(audit["conserved"], true, "{audit}");
    let withdrawal = client.get(&second.base, &format!("/v1/withdrawals/{id}")).await;
    if declined {
        assert_eq!(status, 422, "{answer}");
        assert!(
            answer["type"].as_str().unwrap().ends_with("/withdrawal-declined"),
            "{answer}"
        );
        assert_eq!(quotes["cancelled"], 1, "the quote released: {quotes}");
        assert_eq!(paid["payouts"], 0, "nothing paid: {paid}");
        assert_eq!(withdrawal["status"], "declined");
        // Debited once and credited back once.
        assert_eq!(
            (audit["withdrawals_total"].as_i64(), audit["journal_rows"].as_i64()),
            (Some(0), Some(3))
        );
    } else {
        assert_eq!(status, 201, "{answer}");
        assert_eq!(answer["id"], id.as_str());
        assert_eq!(answer["amount_out"], 2_333, "2 000 GBP at 1.1667");
        assert_eq!(quotes["cancelled"], 0);
        assert_eq!(paid["payouts"], 1, "paid once: {paid}");
        assert_eq!(paid["references"], serde_json::json!([id]));
        assert_eq!(withdrawal["status"], "paid");
        // Debited once.
        assert_eq!(
            (audit["withdrawals_total"].as_i64(), audit["journal_rows"].as_i64()),
            (Some(2_000), Some(2))
        );
    }
    let (again, replayed, replay) = client.post(&second.base, "/v1/withdrawals", &k, &body).await.unwrap();
    assert!(
        replayed && again == status && replay == answer,
        "a retry replays the outcome"
    );
}

/// Expands each kill into one test per engine.
macro_rules! kills {
    ($($name:ident: $kill:expr, $destination:expr, $resume:expr;)*) => {
        mod sqlite { use super::*; $( #[tokio::test(flavor = "multi_thread", worker_threads = 4)] async fn $name() { killed(Engine::Sqlite, $kill, $destination, $resume).await } )* }
        mod postgres { use super::*; $( #[tokio::test(flavor = "multi_thread", worker_threads = 4)] async fn $name() { killed(Engine::Postgres, $kill, $destination, $resume).await } )* }
        mod mysql { use super::*; $( #[tokio::test(flavor = "multi_thread", worker_threads = 4)] async fn $name() { killed(Engine::Mysql, $kill, $destination, $resume).await } )* }
    };
}

kills! {
    while_the_debit_is_written: Kill::At("debit", "before_step_commit"), "acct-1", Resume::Retry;
    after_the_debit_commits: Kill::At("debit", "after_step_commit"), "acct-1", Resume::Retry;
    after_the_quote_is_marked_sent: Kill::At("fx-quote", "after_sent_mark"), "acct-1", Resume::Completer;
    after_the_quote_is_answered: Kill::At("fx-quote", "after_answer"), "acct-1", Resume::Completer;
    after_the_quote_is_recorded: Kill::At("fx-quote", "after_step_commit"), "acct-1", Resume::Retry;
    after_the_payout_is_answered: Kill::At("payout", "after_answer"), "acct-1", Resume::Retry;
    after_the_payout_is_recorded: Kill::At("payout", "after_step_commit"), "acct-1", Resume::Completer;
    after_the_settle_commits: Kill::At("settle", "after_step_commit"), "acct-1", Resume::Completer;
    after_the_release_is_answered: Kill::At("release-quote", "after_answer"), "closed-acct-1", Resume::Retry;
    after_the_credit_back_commits: Kill::At("credit-back", "after_step_commit"), "closed-acct-1", Resume::Completer;
    while_the_fx_vendor_books: Kill::WhileBooking, "acct-1", Resume::Retry;
}

/// The kills above would be caught: with recovery points switched off (`LEDGER_BREAK_RECOVERY_POINTS=1`), the retry after a kill at the payout's answer runs the withdrawal from its first step: debited and quoted a second time.
async fn without_recovery_points_a_kill_doubles_the_debit_and_the_quote(engine: Engine) {
    let broken = [("LEDGER_BREAK_RECOVERY_POINTS", "1")];
    let funded = Funded::start(engine, Some("payout:after_answer=1"), &broken, "acct-1").await;
    let pending = funded.send();
    let line = tokio::task::block_in_place(|| funded.first.stopped_at());
    assert_eq!(line, "IDEM_FAULT point=after_answer step=payout");
    drop(funded.first);
    assert!(pending.await.unwrap().is_err());
    let (vendor_url, client, k, body) = (funded.vendor_url, funded.client, funded.key, funded.body);
    let second = Process::start_with(&funded.database, &vendor_url, 0, None, &broken);
    // The retry runs it from its first step once the killed run's lease
    // has run out (in flight before): debited and quoted again, whatever
    // the payout's resend (its key, with another body) then gets.
    let until = Instant::now() + Duration::from_secs(30);
    loop {
        let (status, _, _) = client.post(&second.base, "/v1/withdrawals", &k, &body).await.unwrap();
        if status != 409 || Instant::now() > until {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let quotes = vendor_json(&vendor_url, "/v1/quotes/ledger").await;
    assert_eq!(quotes["quotes"].as_u64(), Some(2), "quoted twice");
    let audit = client.get(&second.base, "/v1/audit").await;
    // The top-up and two debits (and a credit-back of the second).
    assert!(audit["journal_rows"].as_i64() >= Some(3), "debited twice: {audit}");
}

mod broken {
    use super::*;
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn sqlite() {
        without_recovery_points_a_kill_doubles_the_debit_and_the_quote(Engine::Sqlite).await
    }
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn postgres() {
        without_recovery_points_a_kill_doubles_the_debit_and_the_quote(Engine::Postgres).await
    }
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn mysql() {
        without_recovery_points_a_kill_doubles_the_debit_and_the_quote(Engine::Mysql).await
    }
}
