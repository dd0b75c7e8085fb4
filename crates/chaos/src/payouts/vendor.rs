//! The harness's fake vendor: served in this process, its faults set
//! through its control endpoints (a window held against the other attacks),
//! its ledger and statistics read back.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Mutex;

use super::VENDOR_KEY_HORIZON_SECS;
use crate::Error;

/// The harness's fake vendor, served in this process.
pub(crate) struct Vendor {
    /// Its base URL.
    pub(crate) url: String,
    http: reqwest::Client,
    stop: std::sync::Mutex<Option<tokio::sync::oneshot::Sender<()>>>,
    /// Whether a window of [`attack_vendor`](super::attack_vendor)'s is held: while it is, the
    /// other attacks leave the vendor's faults alone.
    held: Mutex<bool>,
    /// The vendor itself (what it is working on right now).
    pub(crate) inner: Arc<fake_vendor::Vendor>,
}

/// The vendor's own ledger (`GET /v1/ledger`).
#[derive(Debug, Clone, Default, serde::Deserialize)]
pub(crate) struct VendorLedger {
    pub(crate) payouts: u64,
    pub(crate) total: u64,
    pub(crate) keys: Vec<String>,
    /// The distinct references it paid (a reference paid twice shows as
    /// fewer references than payouts, even under another key).
    #[serde(default)]
    pub(crate) references: Vec<String>,
}

impl Vendor {
    pub(crate) async fn start(port: u16) -> Result<Arc<Self>, Error> {
        let addr: std::net::SocketAddr = ([127, 0, 0, 1], port).into();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let vendor = Arc::new(fake_vendor::Vendor::new(fake_vendor::Options {
            key_horizon: Duration::from_secs(VENDOR_KEY_HORIZON_SECS),
            idempotency: true,
        }));
        let inner = vendor.clone();
        tokio::spawn(async move {
            let shutdown = async move {
                let _ = stopped.await;
            };
            if let Err(e) = fake_vendor::serve(addr, vendor, shutdown).await {
                eprintln!("chaos: the fake vendor stopped: {e}");
            }
        });
        let me = Arc::new(Self {
            url: format!("http://{addr}"),
            http: ledger::http_builder().timeout(Duration::from_secs(10)).build()?,
            stop: std::sync::Mutex::new(Some(stop)),
            held: Mutex::new(false),
            inner,
        });
        me.wait_up(Duration::from_secs(20)).await?;
        Ok(me)
    }

    /// Waits until the vendor accepts connections (after a refusal window).
    pub(super) async fn wait_up(&self, within: Duration) -> Result<(), Error> {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            if let Ok(r) = self.http.get(format!("{}/_stats", self.url)).send().await
                && r.status().is_success()
            {
                return Ok(());
            }
            if tokio::time::Instant::now() > deadline {
                return Err(Error::Service(format!(
                    "the fake vendor at {} does not answer",
                    self.url
                )));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Sets the vendor's faults.
    pub(crate) async fn set(&self, faults: &fake_vendor::Faults) -> Result<(), Error> {
        let r = self
            .http
            .put(format!("{}/_faults", self.url))
            .header("content-type", "application/json")
            .body(serde_json::to_vec(faults).map_err(|e| Error::Service(e.to_string()))?)
            .send()
            .await?;
        if !r.status().is_success() {
            return Err(Error::Service(format!("the vendor refused faults: {}", r.status())));
        }
        Ok(())
    }

    /// Sets the vendor's faults unless a window is held; answers whether
    /// it did.
    pub(super) async fn change(&self, faults: &fake_vendor::Faults) -> Result<bool, Error> {
        let held = self.held.lock().await;
        if *held {
            return Ok(false);
        }
        self.set(faults).await?;
        Ok(true)
    }

    /// Sets faults that only [`Vendor::release`] changes.
    pub(super) async fn hold(&self, faults: &fake_vendor::Faults) -> Result<(), Error> {
        let mut held = self.held.lock().await;
        self.set(faults).await?;
        *held = true;
        Ok(())
    }

    /// Sets faults that the other attacks may change again.
    pub(super) async fn release(&self, faults: &fake_vendor::Faults) -> Result<(), Error> {
        let mut held = self.held.lock().await;
        self.set(faults).await?;
        *held = false;
        Ok(())
    }

    pub(crate) async fn get_json<T: serde::de::DeserializeOwned>(&self, path: &str) -> Result<T, Error> {
        let bytes = self
            .http
            .get(format!("{}{path}", self.url))
            .send()
            .await?
            .error_for_status()?
            .bytes()
            .await?;
        serde_json::from_slice(&bytes).map_err(|e| Error::Service(format!("vendor {path}: {e}")))
    }

    pub(crate) fn stop(&self) {
        if let Some(stop) = self.stop.lock().ok().and_then(|mut s| s.take()) {
            let _ = stop.send(());
        }
    }
}
