//! What the gateway-process tests share: a gateway process killed when the
//! test ends, free ports, temporary paths, engine URLs and keyed requests.

#![allow(dead_code)]

use std::process::{Child, Command, Stdio};
use std::time::Duration;

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
}

pub(crate) fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// A path in the temporary directory no other test uses.
pub(crate) fn temp(prefix: &str, name: &str) -> String {
    std::env::temp_dir()
        .join(format!("idem-{prefix}-{}-{name}", uuid::Uuid::now_v7()))
        .display()
        .to_string()
}

pub(crate) fn postgres_url() -> String {
    std::env::var("IDEM_TEST_POSTGRES_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

pub(crate) fn mysql_url() -> String {
    std::env::var("IDEM_TEST_MYSQL_URL").unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into())
}

pub(crate) fn redis_url() -> String {
    std::env::var("IDEM_TEST_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
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
    for _ in 0..800 {
        if idem_tls::test_pki::get(format!("{base}/_idem/healthz"))
            .await
            .is_ok_and(|r| r.status() == 200)
        {
            return (g, base);
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("the gateway on {store} did not become healthy");
}

/// A gateway's answer.
#[derive(Debug)]
pub(crate) struct Answer {
    pub(crate) status: u16,
    pub(crate) replayed: bool,
    pub(crate) retry_after: Option<u64>,
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
    let is_problem = header("content-type").as_deref() == Some("application/problem+json");
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
        problem,
        body,
    })
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
