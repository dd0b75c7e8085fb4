//! What the `idem` process tests share: a gateway process killed when the
//! test ends, free ports, temporary paths and names, engine URLs, databases
//! of a test's own, the fake vendor and other upstreams, gateway
//! configurations, keyed requests and `idem` runs.

#![allow(dead_code)]

// Not every test binary that includes this module uses each one.
#[allow(unused_imports)]
pub(crate) use idem_conformance::env::{mysql_url, postgres_url, redis_url};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A gateway process, killed when the test ends.
pub(crate) struct Gateway(pub(crate) Child);

impl Drop for Gateway {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Gateway {
    /// Kills the process at once (SIGKILL) and reaps it.
    pub(crate) fn kill(&mut self) {
        self.0.kill().expect("the gateway can be killed");
        self.0.wait().expect("the gateway can be reaped");
    }

    /// Waits up to `limit` for the process to exit.
    pub(crate) fn wait_exit(&mut self, limit: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            if let Some(status) = self.0.try_wait().expect("the process can be waited for") {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }

    /// What the process printed on its stderr, when that was piped.
    pub(crate) fn stderr(&mut self) -> String {
        use std::io::Read;
        let mut out = String::new();
        if let Some(mut e) = self.0.stderr.take() {
            let _ = e.read_to_string(&mut out);
        }
        out
    }
}

/// Starts `idem gateway` on `store` with the arguments `extra`, in front of
/// a closed port, for callers of tenant `anonymous` (the store is the point)
/// and without `IDEM_SKIP_REDIS_CHECKS`, and waits up to 20 s for it to
/// exit: its exit code (`None` when it kept running) and its stderr.
pub(crate) fn gateway_exit(store: &str, extra: &[&str]) -> (Option<i32>, String) {
    let mut g = Gateway(
        Command::new(env!("CARGO_BIN_EXE_idem"))
            .args(["gateway", "--upstream", "http://127.0.0.1:9", "--listen", "127.0.0.1:0"])
            .args(["--store", store])
            .args(extra)
            .env_remove("IDEM_SKIP_REDIS_CHECKS")
            .env("IDEM_TENANT", "anonymous")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("idem runs"),
    );
    match g.wait_exit(Duration::from_secs(20)) {
        Some(status) => (status.code(), g.stderr()),
        None => (None, String::new()),
    }
}

pub(crate) fn free_port() -> u16 {
    idem_conformance::free_port()
}

/// A path in the temporary directory no other test uses.
pub(crate) fn temp(prefix: &str, name: &str) -> String {
    std::env::temp_dir()
        .join(format!("idem-{prefix}-{}-{name}", uuid::Uuid::now_v7()))
        .display()
        .to_string()
}

/// A short name no other test uses: the last 12 characters of a UUIDv7.
pub(crate) fn tag() -> String {
    let t = uuid::Uuid::now_v7().simple().to_string();
    t[t.len() - 12..].to_owned()
}

async fn postgres_admin() -> sqlx::PgPool {
    let admin_url = postgres_url();
    sqlx::PgPool::connect(&admin_url)
        .await
        .unwrap_or_else(|e| panic!("cannot reach PostgreSQL at {admin_url}: {e}"))
}

async fn mysql_admin() -> sqlx::MySqlPool {
    let admin_url = mysql_url();
    sqlx::MySqlPool::connect(&admin_url)
        .await
        .unwrap_or_else(|e| panic!("cannot reach MariaDB at {admin_url}: {e}"))
}

/// The URL of `admin_url`'s server with the database `db`.
fn with_database(admin_url: &str, db: &str) -> String {
    let (base, _) = admin_url.rsplit_once('/').unwrap();
    format!("{base}/{db}")
}

/// The database a URL names.
pub(crate) fn database_of(url: &str) -> &str {
    url.rsplit_once('/').unwrap().1
}

/// A SQL server the tests make databases of their own on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Sql {
    /// PostgreSQL, at [`postgres_url`].
    Postgres,
    /// MariaDB, at [`mysql_url`].
    MariaDb,
}

impl Sql {
    /// The URL of the server's administrator.
    pub(crate) fn admin_url(self) -> String {
        match self {
            Sql::Postgres => postgres_url(),
            Sql::MariaDb => mysql_url(),
        }
    }

    /// Runs `statement` as the server's administrator.
    async fn execute_as_admin(self, statement: String) {
        let statement = sqlx::AssertSqlSafe(statement);
        match self {
            Sql::Postgres => sqlx::query(statement).execute(&postgres_admin().await).await.map(drop),
            Sql::MariaDb => sqlx::query(statement).execute(&mysql_admin().await).await.map(drop),
        }
        .unwrap();
    }

    /// A database of the test's own on this server, named `{prefix}_{tag}`:
    /// its URL.
    pub(crate) async fn create_db(self, prefix: &str) -> String {
        let db = format!("{prefix}_{}", tag());
        self.execute_as_admin(format!("CREATE DATABASE {db}")).await;
        with_database(&self.admin_url(), &db)
    }

    /// Drops the database of [`create_db`](Self::create_db) at `url`; on
    /// PostgreSQL even while connections are open.
    pub(crate) async fn drop_db(self, url: &str) {
        let force = match self {
            Sql::Postgres => " WITH (FORCE)",
            Sql::MariaDb => "",
        };
        self.execute_as_admin(format!("DROP DATABASE {}{force}", database_of(url)))
            .await;
    }

    /// Runs `test` on the URL of a database of its own on this server
    /// (named `{prefix}_{tag}`), then drops the database.
    pub(crate) async fn with_db(self, prefix: &str, test: impl AsyncFnOnce(&str)) {
        let url = self.create_db(prefix).await;
        test(&url).await;
        self.drop_db(&url).await;
    }
}

/// A store of a test's own.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum OwnStore {
    /// A SQLite file in the temporary directory.
    Sqlite,
    /// A database on a SQL server.
    On(Sql),
}

impl OwnStore {
    /// Runs `test` on the URL of a store of its own (a file or a database
    /// named `{prefix}_{tag}`), then deletes the store.
    pub(crate) async fn with_store(self, prefix: &str, test: impl AsyncFnOnce(&str)) {
        match self {
            OwnStore::Sqlite => {
                let path = std::env::temp_dir().join(format!("{prefix}_{}.db", tag()));
                let url = path.display().to_string();
                test(&url).await;
                for suffix in ["", "-wal", "-shm"] {
                    let _ = std::fs::remove_file(format!("{url}{suffix}"));
                }
            }
            OwnStore::On(sql) => sql.with_db(prefix, test).await,
        }
    }
}

/// Three tests, `on_sqlite`, `on_postgres` and `on_mysql`, each running
/// the scenario `$scenario` (an async function of a store's URL) on a
/// store of its own named after `$prefix` (see [`OwnStore::with_store`]).
#[allow(unused_macros)]
macro_rules! on_each_sql_store {
    ($prefix:literal, $scenario:expr) => {
        async fn on(store: crate::support::OwnStore) {
            store.with_store($prefix, $scenario).await;
        }

        idem_conformance::cases!(on, 2 => {
            on_sqlite(crate::support::OwnStore::Sqlite);
            on_postgres(crate::support::OwnStore::On(crate::support::Sql::Postgres));
            on_mysql(crate::support::OwnStore::On(crate::support::Sql::MariaDb));
        });
    };
}
#[allow(unused_imports)]
pub(crate) use on_each_sql_store;

/// Runs `idem <args>`, which must refuse them as bad input (exit code 2),
/// saying `says`.
pub(crate) fn refused(args: &[&str], says: &str) {
    let (code, _, out) = idem_out(args);
    assert_eq!(code, 2, "{out}");
    assert!(out.contains(says), "{out}");
}

/// Serves `vendor` (the fake vendor) on its own runtime and thread, so the
/// test's runtime can block on an `idem` process meanwhile; its base URL.
pub(crate) fn serve_vendor(vendor: Arc<fake_vendor::Vendor>) -> String {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr: std::net::SocketAddr = ([127, 0, 0, 1], port).into();
    std::thread::spawn(move || {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap()
            .block_on(fake_vendor::serve(addr, vendor, std::future::pending()))
            .unwrap();
    });
    for _ in 0..200 {
        if std::net::TcpStream::connect(addr).is_ok() {
            return format!("http://{addr}");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!("the fake vendor did not start on {addr}");
}

/// Serves `app` on a port of its own, on the test's runtime; its base URL.
pub(crate) async fn serve(app: axum::Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    format!("http://{addr}")
}

/// Writes a gateway configuration file of `settings` (top-level settings,
/// then the routes) whose tenant is a digest of the `Authorization` header,
/// which carries each test's bearer token; its path.
pub(crate) fn gateway_config(settings: &str) -> String {
    let path = temp("gateway", "gateway.toml");
    let tenant = "[tenant]\nsource = \"credentials\"\ncredentials = [\"authorization\"]\n";
    std::fs::write(&path, format!("{settings}\n{tenant}")).unwrap();
    path
}

/// Starts `idem gateway` in front of `upstream` on `store` with the
/// configuration file `config`, and waits until it is healthy.
pub(crate) async fn start_gateway(upstream: &str, store: &str, config: &str) -> (Gateway, String) {
    let port = free_port();
    let child = Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(["gateway", "--upstream", upstream, "--store", store, "--config", config])
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .env("RUST_LOG", "error")
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("idem runs");
    let g = Gateway(child);
    let base = format!("http://127.0.0.1:{port}");
    healthy(&base).await;
    (g, base)
}

/// Waits until the gateway at `base` answers `/_idem/healthz` with 200 (at
/// most 20 s).
pub(crate) async fn healthy(base: &str) {
    for _ in 0..800 {
        if idem_tls::test_pki::get(format!("{base}/_idem/healthz"))
            .await
            .is_ok_and(|r| r.status() == 200)
        {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("the gateway at {base} did not become healthy");
}

/// A gateway's answer.
#[derive(Debug)]
pub(crate) struct Answer {
    pub(crate) status: u16,
    pub(crate) replayed: bool,
    pub(crate) retry_after: Option<u64>,
    /// The `content-type` header, empty when there is none.
    pub(crate) content_type: String,
    /// The problem type's last segment, for a problem.
    pub(crate) problem: Option<String>,
    pub(crate) body: String,
}

/// Sends `POST {base}{path}` with `key` and the tenant's bearer `token`;
/// `None` when the connection failed.
pub(crate) async fn post_keyed(base: &str, path: &str, token: &str, key: &str) -> Option<Answer> {
    let r = idem_tls::test_pki::http_client()
        .post(format!("{base}{path}"))
        .bearer_auth(token)
        .header("idempotency-key", format!("\"{key}\""))
        .header("content-type", "application/json")
        .body(r#"{"amount":5}"#)
        .send()
        .await
        .ok()?;
    let header = |n: &str| r.headers().get(n).and_then(|v| v.to_str().ok()).map(str::to_owned);
    let replayed = header("idempotent-replayed").as_deref() == Some("true");
    let retry_after = header("retry-after").and_then(|v| v.parse().ok());
    let content_type = header("content-type").unwrap_or_default();
    let is_problem = content_type == "application/problem+json";
    let status = r.status().as_u16();
    let body = r.text().await.ok()?;
    let problem = is_problem
        .then(|| serde_json::from_str::<serde_json::Value>(&body).ok())
        .flatten()
        .and_then(|p| p["type"].as_str().and_then(|t| t.rsplit('/').next()).map(str::to_owned));
    Some(Answer {
        status,
        replayed,
        retry_after,
        content_type,
        problem,
        body,
    })
}

/// The entry of `key` in `idem keys list --store {store} {filters}
/// --key-prefix {key}`; fails the test when it is not listed.
pub(crate) fn listed_key(store: &str, key: &str, filters: &[&str]) -> serde_json::Value {
    let mut args = vec!["keys", "list", "--store", store];
    args.extend_from_slice(filters);
    args.extend(["--key-prefix", key]);
    let (code, list) = idem_json(&args);
    assert_eq!(code, 0, "{list}");
    list.as_array()
        .unwrap()
        .iter()
        .find(|k| k["key"] == key)
        .unwrap_or_else(|| panic!("{key} not listed: {list}"))
        .clone()
}

/// The arguments `keys <command> --store <store> --tenant <tenant>
/// --operation <operation> --key <key> <rest…>`: a command about one key.
pub(crate) fn keys_command<'a>(
    command: &'a str,
    store: &'a str,
    tenant: &'a str,
    operation: &'a str,
    key: &'a str,
    rest: &[&'a str],
) -> Vec<&'a str> {
    let mut args = vec!["keys", command, "--store", store, "--tenant", tenant];
    args.extend(["--operation", operation, "--key", key]);
    args.extend_from_slice(rest);
    args
}

/// The tenant the gateway scoped `key` by, as `idem keys list --store {store}
/// {filters}` shows it, and the key's state there.
pub(crate) fn listed_tenant_and_state(store: &str, key: &str, filters: &[&str]) -> (String, String) {
    let k = listed_key(store, key, filters);
    let field = |name: &str| k[name].as_str().unwrap().to_owned();
    (field("tenant"), field("state"))
}

/// `idem dlq <sub> --store <url> <rest…>`, as [`idem_out`] answers.
pub(crate) fn dlq(url: &str, sub_and_rest: &[&str]) -> (i32, serde_json::Value, String) {
    let (sub, rest) = sub_and_rest.split_first().expect("a subcommand");
    let args: Vec<&str> = ["dlq", sub, "--store", url]
        .into_iter()
        .chain(rest.iter().copied())
        .collect();
    idem_out(&args)
}

/// `idem dlq resolve --id <id> --not-applied --note <note>`: the operator's
/// word that the vendor did not apply letter `id`, which must be taken.
pub(crate) fn resolve_not_applied(url: &str, id: i64, note: &str) {
    let (code, _, out) = dlq(
        url,
        &["resolve", "--id", &id.to_string(), "--not-applied", "--note", note],
    );
    assert_eq!(code, 0, "{out}");
}

/// Runs `idem <args>`: exit code, stdout as JSON (null when it is not),
/// and everything it printed.
pub(crate) fn idem_out(args: &[&str]) -> (i32, serde_json::Value, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(args)
        .output()
        .expect("idem runs");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let json = serde_json::from_str(stdout.trim()).unwrap_or(serde_json::Value::Null);
    (
        out.status.code().unwrap_or(-1),
        json,
        format!("{stdout}{}", String::from_utf8_lossy(&out.stderr)),
    )
}

/// Runs `idem --json <args>`: exit code and stdout as JSON.
pub(crate) fn idem_json(args: &[&str]) -> (i32, serde_json::Value) {
    let out = Command::new(env!("CARGO_BIN_EXE_idem"))
        .arg("--json")
        .args(args)
        .stderr(Stdio::inherit())
        .output()
        .expect("idem runs");
    let text = String::from_utf8_lossy(&out.stdout);
    let json = serde_json::from_str(text.trim()).unwrap_or_else(|e| panic!("{args:?}: {e}: {text}"));
    (out.status.code().unwrap_or(-1), json)
}

/// A finished `idem` run.
pub(crate) struct Run {
    pub(crate) code: i32,
    pub(crate) stdout: String,
    pub(crate) stderr: String,
}

impl Run {
    /// Everything it printed.
    pub(crate) fn all(&self) -> String {
        format!("{}{}", self.stdout, self.stderr)
    }

    /// Stdout as one JSON document.
    pub(crate) fn json(&self) -> serde_json::Value {
        serde_json::from_str(self.stdout.trim())
            .unwrap_or_else(|e| panic!("stdout is not one JSON document ({e}): {}", self.all()))
    }
}

/// Runs `idem <args>` without the environment variables `unset`.
pub(crate) fn idem_run(args: &[&str], unset: &[&str]) -> Run {
    let mut command = Command::new(env!("CARGO_BIN_EXE_idem"));
    command.args(args);
    for name in unset {
        command.env_remove(name);
    }
    let out = command.output().expect("idem runs");
    Run {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// `count` completed lease-mode keys of (`tenant`, `operation`) in `store`,
/// each with a TTL of `ttl_secs`, claimed `ago_ms` before now (0: on the
/// real clock, which Redis expires its rows by).
pub(crate) async fn completed_keys<S>(
    store: &S,
    tenant: &str,
    operation: &str,
    count: usize,
    ttl_secs: u64,
    ago_ms: i64,
) where
    S: idem_core::LeaseStore + Clone + 'static,
{
    use idem_core::{Call, Clock, Fingerprint, IdempotencyKey, LeaseEngine, ManualClock, Policy, Scope};
    let mut engine = LeaseEngine::new(store.clone());
    if ago_ms != 0 {
        let then = idem_core::SystemClock.now_ms() - ago_ms;
        engine = engine.with_clock(Arc::new(ManualClock::new(then)));
    }
    let scope = Scope::parse(tenant, operation).unwrap();
    for _ in 0..count {
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
