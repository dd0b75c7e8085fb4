//! The fake vendor on a loopback port, as the payout and withdrawal tests
//! drive it: its faults, and what it booked, paid and counted.

#![allow(dead_code, unreachable_pub)]

use std::sync::Arc;

use fake_vendor::Faults;

/// A fake vendor serving both FX quotes and payouts until the test's
/// runtime ends.
pub struct FakeVendor {
    /// Its base URL.
    pub url: String,
    /// The vendor itself (its clock, its faults).
    pub vendor: Arc<fake_vendor::Vendor>,
}

impl FakeVendor {
    /// A vendor with the default options.
    pub async fn start() -> Self {
        Self::start_with(fake_vendor::Options::default()).await
    }

    /// A vendor treating keys by `options`.
    pub async fn start_with(options: fake_vendor::Options) -> Self {
        let (url, vendor) = fake_vendor::start(options, None).await.expect("the fake vendor starts");
        Self { url, vendor }
    }

    /// Sets `faults` through `PUT /_faults`.
    pub async fn faults(&self, faults: &Faults) {
        let r = idem_tls::test_pki::http_client()
            .put(format!("{}/_faults", self.url))
            .json(faults)
            .send()
            .await
            .unwrap();
        assert!(r.status().is_success(), "the vendor takes the faults");
    }

    /// The default faults as `set` changes them.
    pub async fn fault(&self, set: impl FnOnce(&mut Faults)) {
        let mut faults = Faults::default();
        set(&mut faults);
        self.faults(&faults).await;
    }

    /// What the vendor answers to `GET path`, as JSON.
    pub async fn get_json(&self, path: &str) -> serde_json::Value {
        idem_tls::test_pki::get(format!("{}{path}", self.url))
            .await
            .unwrap()
            .json()
            .await
            .unwrap()
    }

    /// The payouts it made: `{"payouts", "total", "keys", "references"}`.
    pub async fn payouts(&self) -> serde_json::Value {
        self.get_json("/v1/ledger").await
    }

    /// The quotes it booked: `{"quotes", "cancelled", "references"}`.
    pub async fn quotes(&self) -> serde_json::Value {
        self.get_json("/v1/quotes/ledger").await
    }

    /// What the vendor counted: answers dropped, replays, lookups, refusals.
    pub async fn stats(&self) -> serde_json::Value {
        self.get_json("/_stats").await
    }
}
