//! Shared test harness: engines, transports and a small client.

#![allow(dead_code, unreachable_pub)]

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use http_body_util::BodyExt;
// Not every test binary that includes this module uses each one.
#[allow(unused_imports)]
pub use idem_conformance::env::{mysql_url, postgres_url};
use idem_core::SharedClock;
use ledger::{Options, Store};
use tower::ServiceExt;

/// Where the ledger keeps its data in a test.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Engine {
    Sqlite,
    Postgres,
    Mysql,
}

/// How the test reaches the service.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    /// `Router::oneshot`, in-process.
    InProcess,
    /// A real TCP socket on 127.0.0.1.
    Socket,
}

/// A database location for one test: a fresh SQLite file, or the shared
/// server database (tests isolate themselves by tenant).
pub fn database_url(engine: Engine) -> String {
    match engine {
        Engine::Sqlite => {
            let path = std::env::temp_dir().join(format!("ledger-test-{}.db", uuid::Uuid::now_v7()));
            path.display().to_string()
        }
        Engine::Postgres => postgres_url(),
        Engine::Mysql => mysql_url(),
    }
}

pub async fn connect(url: &str) -> Store {
    match Store::connect(url, 24).await {
        Ok(store) => store,
        Err(e) => panic!(
            "cannot reach the test database at {url}: {e}\n\
             (set IDEM_TEST_POSTGRES_URL / IDEM_TEST_MYSQL_URL, or start the local service)"
        ),
    }
}

/// A running ledger the test talks to.
pub struct Ledger {
    pub url: String,
    pub store: Store,
    pub clock: SharedClock,
    transport: Transport,
    router: axum::Router,
    base: String,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    server: Option<tokio::task::JoinHandle<()>>,
    client: reqwest::Client,
}

pub struct Resp {
    pub status: u16,
    pub headers: axum::http::HeaderMap,
    pub body: Vec<u8>,
}

impl Resp {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&self.body)))
    }
    pub fn replayed(&self) -> bool {
        self.headers.get("idempotent-replayed").is_some_and(|v| v == "true")
    }
    /// Asserts this is a problem of `status` whose type ends in `slug`.
    pub fn assert_problem(&self, status: u16, slug: &str) {
        assert_eq!(self.status, status, "body: {}", String::from_utf8_lossy(&self.body));
        assert_eq!(self.headers["content-type"], "application/problem+json");
        let v = self.json();
        assert!(
            v["type"].as_str().unwrap().ends_with(&format!("/{slug}")),
            "type {} is not {slug}",
            v["type"]
        );
        assert_eq!(v["status"], status);
        assert!(v["title"].is_string() && v["detail"].is_string());
    }
}

impl Ledger {
    pub async fn start(engine: Engine, transport: Transport) -> Self {
        Self::start_with(
            &database_url(engine),
            transport,
            Arc::new(idem_core::SystemClock),
            Options::default(),
        )
        .await
    }

    pub async fn start_with(url: &str, transport: Transport, clock: SharedClock, options: Options) -> Self {
        let store = connect(url).await;
        let router = store.router(clock.clone(), options.clone());
        let client = idem_tls::test_pki::http_builder()
            .timeout(Duration::from_secs(60))
            .build()
            .unwrap();
        let mut ledger = Ledger {
            url: url.to_owned(),
            store,
            clock,
            transport,
            router: router.clone(),
            base: String::new(),
            stop: None,
            server: None,
            client,
        };
        if transport == Transport::Socket {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            ledger.base = format!("http://{}", listener.local_addr().unwrap());
            let (tx, rx) = tokio::sync::oneshot::channel::<()>();
            let store = ledger.store.clone();
            let clock = ledger.clock.clone();
            ledger.server = Some(tokio::spawn(async move {
                ledger::serve(listener, store, clock, options, async {
                    let _ = rx.await;
                })
                .await
                .unwrap();
            }));
            ledger.stop = Some(tx);
        }
        ledger
    }

    /// Stops a socket server gracefully (in-process: nothing to stop).
    pub async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(server) = self.server.take() {
            server.await.unwrap();
        }
    }

    pub async fn send(
        &self,
        method: &str,
        path: &str,
        token: Option<&str>,
        key: Option<&str>,
        body: Option<&str>,
    ) -> Resp {
        let mut headers = Vec::new();
        if let Some(t) = token {
            headers.push(("authorization".to_owned(), format!("Bearer {t}")));
        }
        if let Some(k) = key {
            headers.push(("idempotency-key".to_owned(), k.to_owned()));
        }
        if body.is_some() {
            headers.push(("content-type".to_owned(), "application/json".to_owned()));
        }
        self.send_raw(method, path, &headers, body).await
    }

    /// Sends exactly these headers and body.
    pub async fn send_raw(&self, method: &str, path: &str, headers: &[(String, String)], body: Option<&str>) -> Resp {
        match self.transport {
            Transport::InProcess => {
                let mut b = axum::http::Request::builder().method(method).uri(path);
                for (name, value) in headers {
                    b = b.header(name.as_str(), value.as_str());
                }
                let req = b.body(Body::from(body.unwrap_or("").to_owned())).unwrap();
                let res = self.router.clone().oneshot(req).await.unwrap();
                let (parts, body) = res.into_parts();
                Resp {
                    status: parts.status.as_u16(),
                    headers: parts.headers,
                    body: body.collect().await.unwrap().to_bytes().to_vec(),
                }
            }
            Transport::Socket => {
                let method = reqwest::Method::from_bytes(method.as_bytes()).unwrap();
                let mut b = self.client.request(method, format!("{}{path}", self.base));
                for (name, value) in headers {
                    b = b.header(name.as_str(), value.as_str());
                }
                if let Some(body) = body {
                    b = b.body(body.to_owned());
                }
                let res = b.send().await.unwrap();
                let status = res.status().as_u16();
                let headers = res.headers().clone();
                Resp {
                    status,
                    headers,
                    body: res.bytes().await.unwrap().to_vec(),
                }
            }
        }
    }

    pub async fn post(&self, path: &str, token: &str, key: Option<&str>, body: &str) -> Resp {
        self.send("POST", path, Some(token), key, Some(body)).await
    }

    pub async fn get(&self, path: &str, token: &str) -> Resp {
        self.send("GET", path, Some(token), None, None).await
    }

    /// Creates an account and answers its id.
    pub async fn account(&self, token: &str, name: &str) -> String {
        let r = self
            .post("/v1/accounts", token, Some(&key()), &format!("{{\"name\":\"{name}\"}}"))
            .await;
        assert_eq!(r.status, 201, "{}", String::from_utf8_lossy(&r.body));
        r.json()["id"].as_str().unwrap().to_owned()
    }

    /// A new tenant's account "a", topped up with `amount`: the tenant's
    /// token and the account.
    pub async fn funded(&self, amount: i64) -> (String, String) {
        let t = token();
        let a = self.account(&t, "a").await;
        assert_eq!(self.top_up(&t, &a, amount).await.status, 201);
        (t, a)
    }

    pub async fn top_up(&self, token: &str, account: &str, amount: i64) -> Resp {
        self.post(
            "/v1/top-ups",
            token,
            Some(&key()),
            &format!("{{\"account_id\":\"{account}\",\"amount\":{amount}}}"),
        )
        .await
    }

    /// Requests a payout of `amount` from `account`, with a new key.
    pub async fn payout(&self, token: &str, account: &str, amount: i64) -> Resp {
        self.post("/v1/payouts", token, Some(&key()), &payout_body(account, amount))
            .await
    }

    /// Asserts that `{collection}/{id}` is not found (404 `slug`) by the
    /// tenant `other`, nor `{collection}/not-an-id` by `owner`.
    pub async fn assert_not_found(&self, collection: &str, id: &str, owner: &str, other: &str, slug: &str) {
        self.get(&format!("{collection}/{id}"), other)
            .await
            .assert_problem(404, slug);
        self.get(&format!("{collection}/not-an-id"), owner)
            .await
            .assert_problem(404, slug);
    }

    pub async fn balance(&self, token: &str, account: &str) -> i64 {
        let r = self.get(&format!("/v1/accounts/{account}"), token).await;
        assert_eq!(r.status, 200);
        r.json()["balance"].as_i64().unwrap()
    }

    pub async fn audit(&self, token: &str) -> serde_json::Value {
        let r = self.get("/v1/audit", token).await;
        assert_eq!(r.status, 200);
        r.json()
    }
}

/// The body of a payout of `amount` from `account`.
pub fn payout_body(account: &str, amount: i64) -> String {
    format!(r#"{{"account_id":"{account}","amount":{amount}}}"#)
}

/// A fresh bearer token: a fresh tenant.
pub fn token() -> String {
    format!("tok-{}", uuid::Uuid::now_v7())
}

/// A fresh idempotency key, quoted as an sf-string.
pub fn key() -> String {
    format!("\"{}\"", uuid::Uuid::now_v7())
}

/// Expands one async test body `fn(Engine, Transport)` into a test per engine and transport.
#[macro_export]
macro_rules! matrix {
    ($($name:ident),* $(,)?) => {
        mod sqlite { use super::*; $crate::matrix!(@engine Engine::Sqlite; $($name),*); }
        mod postgres { use super::*; $crate::matrix!(@engine Engine::Postgres; $($name),*); }
        mod mysql { use super::*; $crate::matrix!(@engine Engine::Mysql; $($name),*); }
    };
    (@engine $engine:expr; $($name:ident),*) => {
        mod in_process { use super::*; $( #[tokio::test(flavor = "multi_thread", worker_threads = 4)] async fn $name() { super::super::$name($engine, Transport::InProcess).await } )* }
        mod socket { use super::*; $( #[tokio::test(flavor = "multi_thread", worker_threads = 4)] async fn $name() { super::super::$name($engine, Transport::Socket).await } )* }
    };
}

/// A ledger process, killed when dropped.
pub struct Instance {
    child: std::process::Child,
    pub base: String,
}

impl Instance {
    pub fn start(database_url: &str) -> Self {
        Self::start_with(database_url, &[])
    }

    /// Starts the ledger binary with extra arguments.
    pub fn start_with(database_url: &str, args: &[&str]) -> Self {
        let mut child = ledger_command(env!("CARGO_BIN_EXE_ledger"), database_url)
            .args(args)
            .env("RUST_LOG", "info")
            .stderr(std::process::Stdio::inherit())
            .spawn()
            .expect("the ledger starts");
        let base = listening(&mut child, database_url);
        Self { child, base }
    }
}

/// The ledger binary `bin` serving on a free loopback port with at most 8
/// connections to `database_url`, without colours, its stdout piped for
/// [`listening`].
pub fn ledger_command(bin: impl AsRef<std::ffi::OsStr>, database_url: &str) -> std::process::Command {
    let mut command = std::process::Command::new(bin);
    command
        .args([
            "--listen",
            "127.0.0.1:0",
            "--max-connections",
            "8",
            "--database-url",
            database_url,
        ])
        .env("NO_COLOR", "1")
        .stdout(std::process::Stdio::piped());
    command
}

/// The base URL the ledger `child` (on `database_url`, started from
/// [`ledger_command`]) listens at, once its stdout says so. The test fails,
/// and `child` is killed, if it exits first or does not listen within
/// 60 s. The rest of its stdout is read and dropped.
pub fn listening(child: &mut std::process::Child, database_url: &str) -> String {
    use std::time::Instant;
    let rx = stdout_lines(child);
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        let Ok(line) = rx.recv_timeout(Duration::from_millis(200)) else {
            if let Ok(Some(status)) = child.try_wait() {
                panic!("the ledger on {database_url} exited at start: {status}");
            }
            continue;
        };
        if let Some(addr) = line
            .split_whitespace()
            .find_map(|w| w.strip_prefix("addr="))
            .filter(|_| line.contains("ledger listening"))
        {
            return format!("http://{addr}");
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    panic!("the ledger on {database_url} did not start listening within 60 s");
}

/// The lines `child` writes to its piped stdout, taken from it, as they
/// come. They are read to the pipe's end, whether or not anyone still
/// listens, so the child never blocks on a full pipe.
pub fn stdout_lines(child: &mut std::process::Child) -> std::sync::mpsc::Receiver<String> {
    use std::io::{BufRead, BufReader};
    let stdout = child.stdout.take().expect("stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    rx
}

impl Drop for Instance {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A database of the test's own, named `{prefix}_{uuid}` (a fresh SQLite
/// file on SQLite): for tests whose workers or completers take every due
/// row of their database, so tests running at once must not share one.
/// Databases of the prefix left by runs over an hour ago are dropped first.
pub async fn own_database(engine: Engine, prefix: &str) -> String {
    let name = format!("{prefix}_{}", uuid::Uuid::now_v7().simple());
    let admin = match engine {
        Engine::Sqlite => return database_url(engine),
        Engine::Postgres => {
            let admin = postgres_url();
            let list = format!("SELECT datname::text FROM pg_database WHERE datname LIKE '{prefix}\\_%'");
            drop_stale_then_create::<sqlx::PgConnection>(&admin, "PostgreSQL", &list, prefix, &name).await;
            admin
        }
        Engine::Mysql => {
            let admin = mysql_url();
            let list = format!(
                "SELECT CAST(schema_name AS CHAR) FROM information_schema.schemata WHERE schema_name LIKE '{prefix}\\_%'"
            );
            drop_stale_then_create::<sqlx::MySqlConnection>(&admin, "MariaDB", &list, prefix, &name).await;
            admin
        }
    };
    with_database(&admin, &name)
}

/// Connects to the `server` at `admin`, drops the stale test databases
/// of `prefix` among those `list` names (see [`stale`]), then creates
/// `name`.
async fn drop_stale_then_create<C>(admin: &str, server: &str, list: &str, prefix: &str, name: &str)
where
    C: sqlx::Connection,
    for<'c> &'c mut C: sqlx::Executor<'c, Database = C::Database>,
    (String,): for<'r> sqlx::FromRow<'r, <C::Database as sqlx::Database>::Row>,
    <C::Database as sqlx::Database>::Arguments: sqlx::IntoArguments<C::Database>,
{
    let mut conn = C::connect(admin)
        .await
        .unwrap_or_else(|e| panic!("cannot reach {server} at {admin}: {e}"));
    let old: Vec<(String,)> = sqlx::query_as(sqlx::AssertSqlSafe(list.to_owned()))
        .fetch_all(&mut conn)
        .await
        .unwrap();
    for (db,) in old.into_iter().filter(|(db,)| stale(db, prefix)) {
        let drop = format!("DROP DATABASE IF EXISTS {db}");
        let _ = sqlx::query(sqlx::AssertSqlSafe(drop)).execute(&mut conn).await;
    }
    let create = format!("CREATE DATABASE {name}");
    sqlx::query(sqlx::AssertSqlSafe(create))
        .execute(&mut conn)
        .await
        .unwrap();
}

/// Whether a test database of `prefix` was made more than an hour ago (its
/// name ends in a UUIDv7, which starts with the time in ms).
fn stale(name: &str, prefix: &str) -> bool {
    let Some(id) = name.strip_prefix(prefix).and_then(|n| n.strip_prefix('_')) else {
        return false;
    };
    let Some(ms) = id.get(..12).and_then(|h| u64::from_str_radix(h, 16).ok()) else {
        return false;
    };
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    now.saturating_sub(ms) > 3_600_000
}

/// Removes the SQLite database file `path` and the files beside it: its
/// write-ahead log, its shared memory and idem's lock.
pub fn remove_sqlite_files(path: &str) {
    for suffix in ["", "-wal", "-shm", "-idem.lock"] {
        let _ = std::fs::remove_file(format!("{path}{suffix}"));
    }
}

/// Removes the files of the test's database `url` on `engine` when they are
/// SQLite's (a server's database stays).
pub fn remove_database_files(engine: Engine, url: &str) {
    if engine == Engine::Sqlite {
        remove_sqlite_files(url);
    }
}

/// `url` with its database replaced by `name`.
pub fn with_database(url: &str, name: &str) -> String {
    let (base, query) = url.split_once('?').map_or((url, None), |(b, q)| (b, Some(q)));
    let (server, _) = base.rsplit_once('/').expect("a database URL has a path");
    match query {
        Some(q) => format!("{server}/{name}?{q}"),
        None => format!("{server}/{name}"),
    }
}
