//! The ledger over HTTP: `POST /v1/transfers` with the idempotency layer
//! against the same route without it, from keep-alive clients in the same
//! process as the server (127.0.0.1, an ephemeral port).
//!
//! The server is the ledger's own router with `require_keys: false`, so one
//! server answers both paths:
//!
//! - `without`: no `Idempotency-Key`. The layer only matches the route and
//!   reads the body; the handler's `Tx` is a plain transaction, committed on
//!   success: no fingerprint, no claim, no record, no buffered response. The
//!   handler, its statements and its event are the same as with a key.
//! - `with`: a new key per request (claim, handler, record, one commit);
//! - `replay`: keys (and bodies) already used: the recorded response.

use std::sync::Arc;

use idem_core::BoxError;
use reqwest::StatusCode;
use tokio::sync::oneshot;

use crate::measure::Paths;

/// The bearer token of the HTTP clients (its tenant owns the accounts).
pub const TOKEN: &str = "idem-bench";

/// A request that was answered: its key and body, for replays.
pub type Sent = Arc<(String, String)>;

/// A ledger server in this process and a client of it.
pub struct HttpPaths {
    client: reqwest::Client,
    url: String,
    accounts: Arc<Vec<String>>,
    stop: Option<oneshot::Sender<()>>,
}

impl HttpPaths {
    /// Serves the ledger on `store` at 127.0.0.1 (any port); transfers move
    /// money among `accounts` of [`TOKEN`]'s tenant. With `read_first` the
    /// ledger reads a key's committed row before it claims it.
    pub async fn start(store: ledger::Store, accounts: Arc<Vec<String>>, read_first: bool) -> Result<Self, BoxError> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let url = format!("http://{}/v1/transfers", listener.local_addr()?);
        let options = ledger::Options {
            require_keys: false,
            read_first,
            events_namespace: ledger::events::Namespace::new(crate::engines::EVENTS_NAMESPACE)?,
            ..ledger::Options::default()
        };
        let (stop, stopped) = oneshot::channel();
        tokio::spawn(ledger::serve(
            listener,
            store,
            Arc::new(idem_core::SystemClock),
            options,
            async move {
                let _ = stopped.await;
            },
        ));
        Ok(Self {
            client: ledger::http_builder().build()?,
            url,
            accounts,
            stop: Some(stop),
        })
    }
}

impl Paths for HttpPaths {
    type Key = Sent;

    async fn one(&self, path: &'static str, worker: usize, n: u64, used: &[Sent]) -> Result<Option<Sent>, BoxError> {
        let (key, body) = match path {
            "without" | "with" => {
                let (from, to) = crate::transfer::pair(&self.accounts, worker, n);
                let body = serde_json::json!({ "from": from, "to": to, "amount": 1 }).to_string();
                let key = (path == "with").then(|| uuid::Uuid::now_v7().to_string());
                (key, body)
            }
            "replay" => {
                let sent = used
                    .get((worker * 7919 + n as usize) % used.len().max(1))
                    .ok_or("no requests to replay")?;
                (Some(sent.0.clone()), sent.1.clone())
            }
            other => return Err(format!("unknown path {other:?}").into()),
        };
        // A transaction that lost a race is answered 503 with Retry-After;
        // the client sends it again at once, as many times as the layer
        // would retry it.
        for _ in 0..idem_core::ContentionRetries::MAX_RUNS {
            let mut request = self
                .client
                .post(&self.url)
                .bearer_auth(TOKEN)
                .header("content-type", "application/json")
                .body(body.clone());
            if let Some(key) = &key {
                request = request.header("idempotency-key", format!("\"{key}\""));
            }
            let response = request.send().await?;
            let status = response.status();
            let replayed = response.headers().contains_key("idempotent-replayed");
            response.bytes().await?;
            match status {
                StatusCode::CREATED if replayed != (path == "replay") => {
                    return Err(format!("{path}: replayed = {replayed}").into());
                }
                StatusCode::CREATED => {
                    return Ok((path == "with").then(|| Arc::new((key.unwrap_or_default(), body))));
                }
                StatusCode::SERVICE_UNAVAILABLE => continue,
                other => return Err(format!("{path}: status {other}").into()),
            }
        }
        Err(format!("{path}: 503 after {} tries", idem_core::ContentionRetries::MAX_RUNS).into())
    }
}

impl Drop for HttpPaths {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}
