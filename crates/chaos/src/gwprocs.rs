//! The gateway mode's processes: the `idem` binary (built, or built with
//! fault injection), the counting upstream, and the gateway processes
//! that are killed, stopped and restarted.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, Uri};
use axum::response::IntoResponse;

use crate::Error;

/// Finds or builds the `idem` binary, and runs a copy of its own, so that
/// a build made meanwhile (another run's) never changes what a restarted
/// gateway runs. The running `cargo test`'s build is taken first (its
/// fault points are off unless the environment sets them).
pub fn idem_binary(explicit: Option<&PathBuf>) -> Result<PathBuf, Error> {
    if let Some(p) = explicit {
        return Ok(p.clone());
    }
    let built = match crate::cargo::from_running_test_build("idem") {
        Some(built) => built,
        None => build_idem(&[])?,
    };
    own_copy(&built, "idem-chaos")
}

/// Finds or builds `idem` with fault injection (`IDEM_FAULT_SKIP_SENT_MARK`)
/// and keeps a copy under a name of its own. The running `cargo test`'s
/// build has it (`idem-cli`'s tests turn it on); a build of its own is
/// followed by the ordinary build again, so that `target/…/idem` stays the
/// one everything else runs.
pub fn idem_fault_binary() -> Result<PathBuf, Error> {
    if let Some(built) = crate::cargo::from_running_test_build("idem") {
        return own_copy(&built, "idem-fault-injection");
    }
    let copy = own_copy(&build_idem(&["--features", "fault-injection"])?, "idem-fault-injection")?;
    build_idem(&[])?;
    Ok(copy)
}

fn own_copy(built: &std::path::Path, name: &str) -> Result<PathBuf, Error> {
    let copy = built.with_file_name(format!("{name}-{}", uuid::Uuid::now_v7().simple()));
    crate::copy::runnable_copy(built, &copy)?;
    Ok(copy)
}

fn build_idem(extra: &[&str]) -> Result<PathBuf, Error> {
    let mut args = vec!["-p", "idem-cli", "--bin", "idem"];
    args.extend_from_slice(extra);
    crate::cargo::build_binary(&args, "idem").map_err(|e| Error::Service(format!("building idem: {e}")))
}

/// Every effect per (tenant, key), in order.
pub(crate) type Effects = HashMap<(String, String), Vec<u64>>;

/// The upstream's memory.
#[derive(Clone, Default)]
pub(crate) struct Upstream {
    seq: Arc<AtomicU64>,
    pub(crate) effects: Arc<Mutex<Effects>>,
    /// Requests applied whose answer waits at least half a second.
    pub(crate) slow_in_flight: Arc<AtomicU64>,
}

/// Applies the request (a new effect number), then answers 201 naming it
/// and the tenant, after a delay the path asks for; `/v1/fail` answers 500
/// after applying.
async fn apply(State(u): State<Upstream>, uri: Uri, headers: HeaderMap, body: Bytes) -> axum::response::Response {
    let tenant = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("")
        .to_owned();
    let key = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned();
    let delay = uri
        .query()
        .and_then(|q| q.strip_prefix("delay_ms="))
        .and_then(|d| d.parse::<u64>().ok())
        .unwrap_or(0);
    let effect = u.seq.fetch_add(1, Ordering::SeqCst) + 1;
    u.effects
        .lock()
        .unwrap()
        .entry((tenant.clone(), key.clone()))
        .or_default()
        .push(effect);
    let slow = delay >= 500;
    if slow {
        u.slow_in_flight.fetch_add(1, Ordering::SeqCst);
    }
    tokio::time::sleep(Duration::from_millis(delay)).await;
    if slow {
        u.slow_in_flight.fetch_sub(1, Ordering::SeqCst);
    }
    let answer =
        serde_json::json!({ "effect": effect, "tenant": tenant, "key": key, "body": String::from_utf8_lossy(&body) });
    let status = if uri.path() == "/v1/fail" {
        StatusCode::INTERNAL_SERVER_ERROR
    } else {
        StatusCode::CREATED
    };
    (status, [("content-type", "application/json")], answer.to_string()).into_response()
}

pub(crate) async fn start_upstream() -> Result<(String, Upstream), Error> {
    let upstream = Upstream::default();
    let app = Router::new()
        .fallback(axum::routing::post(apply))
        .with_state(upstream.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    Ok((format!("http://{addr}"), upstream))
}

/// One gateway process on a fixed port.
pub(crate) struct Instance {
    pub(crate) port: u16,
    pub(crate) child: Option<tokio::process::Child>,
}

pub(crate) struct Gateways {
    pub(crate) bin: PathBuf,
    pub(crate) config: PathBuf,
    pub(crate) upstream: String,
    pub(crate) store: String,
    pub(crate) instances: Vec<Instance>,
    /// Whether the gateways skip the sent mark (a fault-injection build).
    pub(crate) skip_sent_mark: bool,
}

impl Gateways {
    pub(crate) async fn start(&mut self, i: usize) -> Result<(), Error> {
        let port = self.instances[i].port;
        let child = tokio::process::Command::new(&self.bin)
            .args(["gateway", "--upstream", &self.upstream, "--store", &self.store])
            .arg("--config")
            .arg(&self.config)
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .env("RUST_LOG", "error")
            .envs(self.skip_sent_mark.then_some(("IDEM_FAULT_SKIP_SENT_MARK", "1")))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()?;
        self.instances[i].child = Some(child);
        let client = ledger::http_builder().timeout(Duration::from_secs(1)).build()?;
        for _ in 0..600 {
            if client
                .get(format!("http://127.0.0.1:{port}/_idem/healthz"))
                .send()
                .await
                .is_ok_and(|r| r.status() == 200)
            {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        Err(Error::Service(format!(
            "the gateway on port {port} did not become healthy"
        )))
    }

    pub(crate) fn signal(&self, i: usize, signal: &str) {
        if let Some(pid) = self.instances[i].child.as_ref().and_then(tokio::process::Child::id) {
            let _ = std::process::Command::new("kill")
                .args([signal, &pid.to_string()])
                .status();
        }
    }

    pub(crate) async fn wait_exit(&mut self, i: usize, limit: Duration) {
        if let Some(child) = self.instances[i].child.as_mut()
            && tokio::time::timeout(limit, child.wait()).await.is_err()
        {
            let _ = child.kill().await;
        }
        self.instances[i].child = None;
    }
}
