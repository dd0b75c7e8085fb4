//! Outbound calls over TLS, against the fake vendor serving https on
//! loopback with certificates made for the test: a call verified against a
//! CA file pays; an unknown issuer, a wrong CA file or plain http to the
//! TLS port pays nothing and says why; a redrive goes through the same TLS.

mod support;

use std::sync::Arc;

use idem_core::{DeadLetterFilter, DeadLetterStore, Scope};
use idem_memory::MemoryDeadLetters;
use idem_outbound::{OutboundClient, OutboundConfig, OutboundError, RedriveOptions, Redriver};
use idem_tls::test_pki::TestPki;
use support::{config, key, payout};

/// The fake vendor serving https with `pki`'s certificate.
async fn https_vendor(pki: &TestPki) -> (String, Arc<fake_vendor::Vendor>) {
    fake_vendor::start(fake_vendor::Options::default(), Some(pki.server_config()))
        .await
        .unwrap()
}

fn with_ca(pki: Option<&TestPki>) -> OutboundConfig {
    OutboundConfig {
        ca_file: pki.map(TestPki::ca_file),
        ..config(&[10])
    }
}

/// A payout to an https vendor whose CA is the configured CA file is paid once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_https_vendor_signed_by_the_ca_file_is_paid() {
    let pki = TestPki::new("outbound-ok");
    let (base, vendor) = https_vendor(&pki).await;
    let client = OutboundClient::new(with_ca(Some(&pki))).unwrap();
    client.check_target(&format!("{base}/v1/payouts")).unwrap();
    let request = payout(&base, r#"{"amount": 100, "reference": "tls-1"}"#);
    let paid = client.send(&key("tls-1"), &request).await.unwrap();
    assert_eq!(paid.status, 201);
    assert_eq!(paid.attempts, 1);
    // The same key again is the vendor's replay: still one payment.
    let again = client.send(&key("tls-1"), &request).await.unwrap();
    assert_eq!(again.status, 201);
    assert_eq!(vendor.paid(), 1);
}

/// Without a CA file the platform's roots do not know the test CA: nothing is paid, and the error names the vendor and the handshake's reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_issuer_is_refused_with_the_reason() {
    let pki = TestPki::new("outbound-unknown");
    let (base, vendor) = https_vendor(&pki).await;
    for config in [with_ca(None), with_ca(Some(&TestPki::new("outbound-other")))] {
        let client = OutboundClient::new(config).unwrap();
        let failed = client
            .send(&key("tls-2"), &payout(&base, r#"{"amount": 1, "reference": "tls-2"}"#))
            .await
            .unwrap_err();
        let text = failed.to_string();
        let expected = format!("{base}: TLS handshake failed: invalid peer certificate: UnknownIssuer");
        assert!(text.contains(&expected), "{text}");
        assert!(matches!(failed, OutboundError::Exhausted { .. }), "{failed:?}");
        // A refused handshake sent nothing: the call may be sent again blindly.
        assert_eq!(failed.first_reached_at_ms(), None, "{failed:?}");
    }
    assert_eq!(vendor.paid(), 0);
}

/// Plain http to the vendor's TLS port fails (nothing paid), and https to a plain-http server fails its handshake, saying so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_and_tls_do_not_mix() {
    let pki = TestPki::new("outbound-plain");
    let (base, vendor) = https_vendor(&pki).await;
    let client = OutboundClient::new(with_ca(Some(&pki))).unwrap();
    let plain = base.replace("https://", "http://");
    let failed = client
        .send(&key("tls-3"), &payout(&plain, r#"{"amount": 1, "reference": "tls-3"}"#))
        .await
        .unwrap_err();
    assert!(matches!(failed, OutboundError::Exhausted { .. }), "{failed:?}");
    assert_eq!(vendor.paid(), 0);

    let (http_base, http_vendor) = support::vendor().await;
    let tls_to_plain = http_base.replace("http://", "https://");
    let failed = client
        .send(
            &key("tls-4"),
            &payout(&tls_to_plain, r#"{"amount": 1, "reference": "tls-4"}"#),
        )
        .await
        .unwrap_err();
    let text = failed.to_string();
    assert!(
        text.contains(&format!("{tls_to_plain}: TLS handshake failed: ")),
        "{text}"
    );
    assert_eq!(http_vendor.paid(), 0);
}

/// A CA file that is missing or holds no certificate is refused when the client is built, naming the file.
#[test]
fn a_bad_ca_file_is_refused_at_start() {
    let dir = std::env::temp_dir().join(format!("idem-outbound-bad-ca-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let missing = dir.join("missing.pem");
    let empty = dir.join("empty.pem");
    std::fs::write(&empty, "not a certificate\n").unwrap();
    for (file, why) in [(&missing, "cannot be read"), (&empty, "holds no PEM certificate")] {
        let config = OutboundConfig {
            ca_file: Some(file.clone()),
            ..config(&[])
        };
        let refused = OutboundClient::new(config).unwrap_err();
        let text = refused.to_string();
        assert!(matches!(refused, OutboundError::InvalidConfig(_)), "{refused:?}");
        assert!(text.contains(&format!("CA file {}: {why}", file.display())), "{text}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A dead letter of an https call is redriven through the same TLS settings and paid once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_https_dead_letter_is_redriven() {
    let pki = TestPki::new("outbound-redrive");
    let (base, vendor) = https_vendor(&pki).await;
    let request = payout(&base, r#"{"amount": 7, "reference": "tls-5"}"#);
    // First through a client that does not trust the vendor: dead-lettered.
    let untrusting = OutboundClient::new(with_ca(None)).unwrap();
    let failed = untrusting.send(&key("tls-5"), &request).await.unwrap_err();
    let scope = Scope::parse("t", "payout").unwrap();
    let letters = MemoryDeadLetters::new();
    letters
        .record(&failed.dead_letter(&scope, &key("tls-5"), &request).unwrap())
        .await
        .unwrap();
    let trusting = OutboundClient::new(with_ca(Some(&pki))).unwrap();
    let report = Redriver::new(trusting, letters.clone())
        .redrive(&DeadLetterFilter::default(), RedriveOptions::default())
        .await
        .unwrap();
    assert_eq!(report.resolved, 1, "{report:?}");
    assert_eq!(vendor.paid(), 1);
}
