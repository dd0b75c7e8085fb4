//! Against the real ledger, run as a child process on a SQLite file in a
//! temporary directory: replays and rejections as the client surfaces them,
//! a lost response retried with the same key, and a client process killed
//! with SIGKILL mid-call that resumes from its pending file with the same
//! key, so the top-up is applied exactly once.
//!
//! The ledger is the fault-injection build the running `cargo test` made, or
//! `cargo build -p ledger --features fault-injection` (or taken from
//! `IDEM_CLIENT_LEDGER_BIN`). Between client and ledger, a proxy in the test
//! records each request's `Idempotency-Key` and can hold or drop answers.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

#[path = "../../chaos/src/cargo.rs"]
#[allow(unreachable_pub)]
mod cargo;

use idem_client::{Client, Error, Key, Operation, PendingStore, SqlitePending};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// The ledger binary, built once per test process.
fn ledger_binary() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        if let Ok(p) = std::env::var("IDEM_CLIENT_LEDGER_BIN") {
            return PathBuf::from(p);
        }
        // The chaos harness's binary (`fault-injection`, off unless its
        // environment turns faults on): the running `cargo test`'s, or one
        // build for both suites.
        cargo::fault_injection_ledger().unwrap_or_else(|e| panic!("the ledger binary: {e}"))
    })
}

fn temp_dir() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("idem-client-ledger-{}", uuid::Uuid::now_v7()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A ledger process on a SQLite file in `dir`, killed when dropped.
struct Ledger {
    child: Child,
    base: String,
}

impl Ledger {
    fn start(dir: &Path) -> Self {
        let db = dir.join("ledger.db");
        let mut child = Command::new(ledger_binary())
            .current_dir(dir)
            .args([
                "--listen",
                "127.0.0.1:0",
                "--snapshot-every-secs",
                "0",
                "--database-url",
            ])
            .arg(&db)
            .env("RUST_LOG", "info")
            .env("NO_COLOR", "1")
            .env_remove("DATABASE_URL")
            .env_remove("NATS_URL")
            .env_remove("LEDGER_TOKENS")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("the ledger starts");
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        // Generous: the machine may be busy building other crates.
        let deadline = Instant::now() + Duration::from_secs(180);
        let mut lines = Vec::new();
        while Instant::now() < deadline {
            let Ok(line) = rx.recv_timeout(Duration::from_millis(200)) else {
                if let Ok(Some(status)) = child.try_wait() {
                    panic!(
                        "the ledger exited at start: {status}; its output:\n{}",
                        lines.join("\n")
                    );
                }
                continue;
            };
            if line.contains("ledger listening")
                && let Some(addr) = line.split_whitespace().find_map(|w| w.strip_prefix("addr="))
            {
                return Self {
                    child,
                    base: format!("http://{addr}"),
                };
            }
            lines.push(line);
        }
        let _ = child.kill();
        let _ = child.wait();
        panic!(
            "the ledger did not start listening within 180 s; its output:\n{}",
            lines.join("\n")
        );
    }

    fn addr(&self) -> String {
        self.base.trim_start_matches("http://").to_owned()
    }
}

impl Drop for Ledger {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// What the proxy does with the ledger's answers on new connections.
const PASS: u8 = 0;
/// Reads the answer and never forwards it (the client waits).
const HOLD: u8 = 1;
/// Reads the answer's first bytes, then closes the client's connection;
/// once, then the proxy passes answers again.
const DROP: u8 = 2;

/// A TCP proxy in front of the ledger that records every Idempotency-Key.
struct Proxy {
    base: String,
    mode: Arc<AtomicU8>,
    keys: Arc<Mutex<Vec<String>>>,
    answered: tokio::sync::mpsc::UnboundedReceiver<u8>,
}

impl Proxy {
    async fn start(upstream: String, mode: u8) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let mode = Arc::new(AtomicU8::new(mode));
        let keys = Arc::new(Mutex::new(Vec::new()));
        let (tx, answered) = tokio::sync::mpsc::unbounded_channel();
        let (m, k) = (mode.clone(), keys.clone());
        tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    return;
                };
                let Ok(server) = TcpStream::connect(&upstream).await else {
                    continue;
                };
                // A dropped answer is dropped once: the retry passes.
                let mode = m
                    .compare_exchange(DROP, PASS, Ordering::SeqCst, Ordering::SeqCst)
                    .unwrap_or_else(|current| current);
                tokio::spawn(relay(client, server, mode, k.clone(), tx.clone()));
            }
        });
        Self {
            base,
            mode,
            keys,
            answered,
        }
    }

    fn keys(&self) -> Vec<String> {
        self.keys.lock().unwrap().clone()
    }

    /// Waits until the ledger answered a request on a connection in `mode`.
    async fn answered_in(&mut self, mode: u8) {
        let wait = async {
            while let Some(m) = self.answered.recv().await {
                if m == mode {
                    return;
                }
            }
        };
        tokio::time::timeout(Duration::from_secs(120), wait)
            .await
            .expect("the ledger answered through the proxy");
    }
}

/// Pipes one connection, recording keys on the way up and treating the answer per `mode`.
async fn relay(
    client: TcpStream,
    server: TcpStream,
    mode: u8,
    keys: Arc<Mutex<Vec<String>>>,
    answered: tokio::sync::mpsc::UnboundedSender<u8>,
) {
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    let up = tokio::spawn(async move {
        let mut line = Vec::new();
        let mut buf = [0u8; 8192];
        loop {
            let n = match client_read.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            for &b in &buf[..n] {
                if b == b'\n' {
                    let text = String::from_utf8_lossy(&line).to_string();
                    if let Some((name, value)) = text.split_once(':')
                        && name.eq_ignore_ascii_case("idempotency-key")
                    {
                        keys.lock().unwrap().push(value.trim().to_owned());
                    }
                    line.clear();
                } else if line.len() < 4096 {
                    line.push(b);
                }
            }
            if server_write.write_all(&buf[..n]).await.is_err() {
                return;
            }
        }
    });
    let mut buf = [0u8; 8192];
    let mut first = true;
    loop {
        let n = match server_read.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if first {
            first = false;
            let _ = answered.send(mode);
        }
        match mode {
            HOLD => continue,
            DROP => break,
            _ => {
                if client_write.write_all(&buf[..n]).await.is_err() {
                    break;
                }
            }
        }
    }
    drop(client_write);
    up.abort();
}

fn token() -> String {
    format!("tok-{}", uuid::Uuid::now_v7())
}

fn client(token: &str) -> Client {
    Client::builder()
        .bearer(token)
        .backoff(Duration::from_millis(20), Duration::from_millis(200))
        .deadline(Duration::from_secs(60))
        .build()
        .unwrap()
}

/// Creates an account; its id.
async fn account(client: &Client, base: &str) -> String {
    let op = Operation::post(&format!("{base}/v1/accounts"))
        .json(&serde_json::json!({"name": "alice"}))
        .build()
        .unwrap();
    let answer = client.send(&op).await.unwrap();
    assert_eq!(answer.status(), 201);
    answer.json::<serde_json::Value>().unwrap()["id"]
        .as_str()
        .unwrap()
        .to_owned()
}

/// A ledger started in a directory of its own (the directory, the ledger),
/// a caller's token, a client with it that goes to the ledger directly, and
/// the id of an account it opened.
async fn opened() -> (PathBuf, Ledger, String, Client, String) {
    let dir = temp_dir();
    let ledger = Ledger::start(&dir);
    let token = token();
    let direct = client(&token);
    let account = account(&direct, &ledger.base).await;
    (dir, ledger, token, direct, account)
}

/// GET through the client (a GET needs no key; one is sent and ignored).
async fn get(client: &Client, url: &str) -> serde_json::Value {
    let op = Operation::builder(idem_client::Method::GET, url).build().unwrap();
    client.send(&op).await.unwrap().json().unwrap()
}

fn top_up(base: &str, account: &str, amount: i64) -> Operation {
    Operation::post(&format!("{base}/v1/top-ups"))
        .json(&serde_json::json!({"account_id": account, "amount": amount}))
        .build()
        .unwrap()
}

/// The ledger's answers as the client surfaces them: a replay with the recorded body, problems for rejections.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replays_and_rejections_from_the_ledger() {
    let (dir, ledger, _, client, id) = opened().await;
    let base = ledger.base.clone();

    let op = top_up(&base, &id, 250);
    let first = client.send(&op).await.unwrap();
    assert_eq!(first.status(), 201);
    assert!(!first.replayed());
    let again = client.send(&op).await.unwrap();
    assert!(again.replayed());
    assert_eq!(again.body(), first.body());
    assert_eq!(get(&client, &format!("{base}/v1/accounts/{id}")).await["balance"], 250);

    // The same key with another body: 422, final.
    let reused = Operation::post(&format!("{base}/v1/top-ups"))
        .key(op.key().clone())
        .json(&serde_json::json!({"account_id": id, "amount": 999}))
        .build()
        .unwrap();
    let cases = [
        (reused, 422, "idempotency-key-reused"),
        (top_up(&base, &id, 0), 400, "invalid-amount"),
        (
            top_up(&base, "0192f0c1-7b4e-7cc3-9d2a-0a6b5f1e2d3c", 5),
            404,
            "account-not-found",
        ),
    ];
    for (op, status, slug) in cases {
        match client.send(&op).await {
            Err(Error::Rejected(r)) => {
                assert_eq!(r.status(), status, "{}", r.text());
                assert!(r.problem().unwrap().is(slug), "{:?}", r.problem());
            }
            other => panic!("{slug}: {other:?}"),
        }
    }
    // No credentials: 401.
    let anonymous = Client::builder().build().unwrap();
    let err = anonymous.send(&top_up(&base, &id, 5)).await.unwrap_err();
    assert_eq!(err.response().unwrap().status(), 401);
    assert!(err.response().unwrap().problem().unwrap().is("unauthorized"));

    assert!(client.store().list().await.unwrap().is_empty());
    assert_eq!(get(&client, &format!("{base}/v1/accounts/{id}")).await["balance"], 250);
    let _ = std::fs::remove_dir_all(dir);
}

/// A lost response: the proxy drops the ledger's first answer; the client retries with the same key and gets the replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_response_is_retried_with_the_same_key() {
    let (dir, ledger, tok, direct, id) = opened().await;
    let mut proxy = Proxy::start(ledger.addr(), DROP).await;
    let client = client(&tok);
    let op = top_up(&proxy.base, &id, 300);
    let sending = {
        let (client, op) = (client.clone(), op.clone());
        tokio::spawn(async move { client.send(&op).await })
    };
    proxy.answered_in(DROP).await;
    let answer = sending.await.unwrap().unwrap();
    assert_eq!(answer.status(), 201);
    assert!(answer.replayed(), "the retry replays the applied top-up");
    let keys = proxy.keys();
    assert!(keys.len() >= 2, "{keys:?}");
    assert!(keys.iter().all(|k| *k == format!("\"{}\"", op.key())), "{keys:?}");
    assert_eq!(
        get(&direct, &format!("{}/v1/accounts/{id}", ledger.base)).await["balance"],
        300
    );
    let _ = std::fs::remove_dir_all(dir);
}

/// Runs the demo client to completion; its stdout.
fn run_demo(args: &[&str]) -> (std::process::ExitStatus, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_idem-client-demo"))
        .args(args)
        .stderr(Stdio::inherit())
        .output()
        .expect("the demo runs");
    (out.status, String::from_utf8_lossy(&out.stdout).to_string())
}

/// The client process is killed with SIGKILL after the ledger applied its top-up and before the answer reached it; restarted on the same pending file it resends with the same key, gets the replay, and the top-up is applied once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_client_resumes_with_the_same_key() {
    use std::os::unix::process::ExitStatusExt;

    let (dir, ledger, tok, direct, id) = opened().await;
    let account_url = format!("{}/v1/accounts/{id}", ledger.base);
    let mut proxy = Proxy::start(ledger.addr(), HOLD).await;
    let pending = dir.join("pending.db");
    let pending_arg = pending.to_str().unwrap();

    // The client sends the top-up; the proxy holds the ledger's answer.
    let mut child = Command::new(env!("CARGO_BIN_EXE_idem-client-demo"))
        .args(["--pending", pending_arg, "--token", &tok, "top-up", "--ledger"])
        .args([&proxy.base, "--account", &id, "--amount", "500"])
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("the demo starts");
    proxy.answered_in(HOLD).await;
    child.kill().unwrap();
    let status = child.wait().unwrap();
    assert_eq!(status.signal(), Some(9), "killed with SIGKILL: {status}");

    // The ledger applied it; the client never heard. The pending file kept it with its key.
    let keys = proxy.keys();
    assert_eq!(keys.len(), 1, "{keys:?}");
    let first_key = keys[0].clone();
    assert_eq!(get(&direct, &account_url).await["balance"], 500);
    let store = SqlitePending::open(&pending).await.unwrap();
    let left = store.list().await.unwrap();
    assert_eq!(left.len(), 1);
    assert_eq!(format!("\"{}\"", left[0].key()), first_key);
    assert_eq!(left[0].url().as_str(), format!("{}/v1/top-ups", proxy.base));
    store.close().await;

    // Restarted: it resumes with the original key and gets the replay.
    proxy.mode.store(PASS, Ordering::SeqCst);
    let (status, stdout) = run_demo(&["--pending", pending_arg, "--token", &tok, "resume"]);
    assert!(status.success(), "{status}: {stdout}");
    let key = Key::new(first_key.trim_matches('"')).unwrap();
    let line = stdout
        .lines()
        .find(|l| l.starts_with("answer "))
        .unwrap_or_else(|| panic!("no answer in {stdout:?}"));
    assert!(
        line.starts_with(&format!("answer key={key} status=201 replayed=true ")),
        "{line}"
    );
    assert_eq!(proxy.keys(), vec![first_key.clone(), first_key]);

    // Applied exactly once; nothing left pending.
    assert_eq!(get(&direct, &account_url).await["balance"], 500);
    let audit = get(&direct, &format!("{}/v1/audit", ledger.base)).await;
    assert_eq!(audit["top_ups_total"], 500, "{audit}");
    assert_eq!(audit["conserved"], true, "{audit}");
    let store = SqlitePending::open(&pending).await.unwrap();
    assert!(store.list().await.unwrap().is_empty());
    store.close().await;
    drop(ledger);
    let _ = std::fs::remove_dir_all(dir);
}
