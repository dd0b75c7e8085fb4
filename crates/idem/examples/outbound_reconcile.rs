//! A payout to a vendor that forgets idempotency keys after a horizon (as
//! Stripe does after 24 h): the first send pays; a re-send older than the
//! horizon is not sent blindly, the vendor is asked first through a
//! `Reconcile` hook (a lookup by the payout's reference), finds the payout,
//! and nothing is sent again.
//!
//! Run (self-contained: it starts an in-process fake vendor on a free port):
//!
//! ```sh
//! cargo run -p idem --features outbound --example outbound_reconcile
//! #   first send: 201 (sent)
//! #   re-send 25 h later: 201 (reconciled: nothing sent)
//! #   the vendor paid 1 time(s)
//! ```

use std::sync::Arc;
use std::time::Duration;

use idem::outbound::{Earlier, OutboundClient, OutboundConfig, Reconcile, Reconciled};
use idem::{BoxFuture, IdempotencyKey, OutboundRequest};

/// Asks the vendor for the payouts of the request's reference.
struct LookupByReference {
    vendor: String,
}

impl Reconcile for LookupByReference {
    fn reconcile<'a>(
        &'a self,
        _key: &'a IdempotencyKey,
        request: &'a OutboundRequest,
        _timeout: Duration,
    ) -> BoxFuture<'a, Result<Reconciled, String>> {
        Box::pin(async move {
            let sent: serde_json::Value = serde_json::from_slice(request.body()).map_err(|e| e.to_string())?;
            let reference = sent["reference"].as_str().ok_or("the request has no reference")?;
            let url = format!("{}/v1/payouts?reference={reference}", self.vendor);
            let found: serde_json::Value = get_json(&url).await?;
            let data = found["data"].as_array().ok_or("the lookup has no data")?;
            Ok(match data.as_slice() {
                [] => Reconciled::NotApplied,
                [one] if one["status"] == "paid" && one["amount"] == sent["amount"] => Reconciled::Applied {
                    status: 201,
                    body: one.to_string().into_bytes(),
                },
                [one] if one["status"] == "processing" => Reconciled::InFlight,
                _ => Reconciled::Unknown(format!("{} records of {reference}", data.len())),
            })
        })
    }
}

async fn get_json(url: &str) -> Result<serde_json::Value, String> {
    let body = reqwest::get(url)
        .await
        .map_err(|e| e.to_string())?
        .bytes()
        .await
        .map_err(|e| e.to_string())?;
    serde_json::from_slice(&body).map_err(|e| e.to_string())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // A vendor remembering keys for 24 hours.
    let vendor = Arc::new(fake_vendor::Vendor::new(fake_vendor::Options::default()));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    tokio::spawn(axum::serve(listener, fake_vendor::router(vendor.clone())).into_future());

    let client = OutboundClient::new(OutboundConfig::default())? // trusts keys for 24 h less 1 h
        .with_reconcile(Arc::new(LookupByReference { vendor: url.clone() }));
    let key = IdempotencyKey::generate(); // one key per logical payout, kept with it
    let request = OutboundRequest::new(
        "POST",
        format!("{url}/v1/payouts"),
        vec![("Content-Type".into(), "application/json".into())],
        br#"{"amount":500,"reference":"payout-42"}"#.to_vec(),
    )?;

    let first = client.send(&key, &request).await?;
    println!("first send: {} (sent)", first.status);

    // A worker that crashed after the vendor paid takes the payout over a
    // day later: the vendor has forgotten the key by then.
    vendor.advance(Duration::from_secs(25 * 3600));
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_millis() as i64;
    let earlier = Earlier {
        first_reached_at_ms: Some(now_ms - 25 * 3_600_000),
        ..Earlier::default()
    };
    let again = client.resend(&key, &request, earlier).await?;
    let how = if again.reconciled {
        "reconciled: nothing sent"
    } else {
        "sent"
    };
    println!("re-send 25 h later: {} ({how})", again.status);

    let stats = get_json(&format!("{url}/_stats")).await?;
    println!("the vendor paid {} time(s)", stats["paid"]);
    Ok(())
}
