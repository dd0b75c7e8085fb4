//! The client over TLS, against the fake vendor serving https on loopback
//! with certificates made for the test: verified against a CA file it is
//! answered; an unknown issuer, a wrong CA file or https to a plain server
//! is a transport failure that names the server and the handshake's reason,
//! and the operation stays pending with its key.

use std::sync::Arc;
use std::time::Duration;

use idem_client::{Client, ClientBuilder, Error, Operation};
use idem_tls::test_pki::TestPki;

/// The fake vendor on loopback, over TLS with `pki`'s certificate if given
/// (`https://`, else `http://`).
async fn vendor(pki: Option<&TestPki>) -> (String, Arc<fake_vendor::Vendor>) {
    fake_vendor::start(fake_vendor::Options::default(), pki.map(TestPki::server_config))
        .await
        .unwrap()
}

fn fast() -> ClientBuilder {
    Client::builder()
        .backoff(Duration::from_millis(5), Duration::from_millis(20))
        .attempt_timeout(Duration::from_secs(5))
        .max_attempts(2)
}

fn payout(base: &str, reference: &str) -> Operation {
    Operation::post(&format!("{base}/v1/payouts"))
        .json(&serde_json::json!({"amount": 5, "reference": reference}))
        .build()
        .unwrap()
}

/// An https operation verified against the CA file is answered, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_with_the_ca_file_is_answered() {
    let pki = TestPki::new("client-ok");
    let (base, vendor) = vendor(Some(&pki)).await;
    let client = fast().ca_file(pki.ca_file()).build().unwrap();
    let op = payout(&base, "c-1");
    assert_eq!(client.send(&op).await.unwrap().status(), 201);
    assert_eq!(vendor.paid(), 1);
    assert!(client.store().list().await.unwrap().is_empty());
}

/// The platform's roots or another CA: the handshake is refused, the error says which server and why, nothing is paid, and the operation stays pending.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_issuer_is_a_clear_failure() {
    let pki = TestPki::new("client-unknown");
    let other = TestPki::new("client-other");
    let (base, vendor) = vendor(Some(&pki)).await;
    for client in [
        fast().build().unwrap(),
        fast().ca_file(other.ca_file()).build().unwrap(),
    ] {
        let op = payout(&base, "c-2");
        let failed = client.send(&op).await.unwrap_err();
        let text = failed.to_string();
        assert!(matches!(failed, Error::GaveUp { .. }), "{failed:?}");
        assert!(
            text.contains(&format!(
                "{base}: TLS handshake failed: invalid peer certificate: UnknownIssuer"
            )),
            "{text}"
        );
        assert_eq!(client.store().list().await.unwrap(), vec![op]);
    }
    assert_eq!(vendor.paid(), 0);
}

/// https to a plain-HTTP server fails its handshake, saying so; plain http to the TLS port gets no answer; neither pays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_and_tls_do_not_mix() {
    let pki = TestPki::new("client-plain");
    let client = fast().ca_file(pki.ca_file()).build().unwrap();
    let (plain_base, plain_vendor) = vendor(None).await;
    let plain_base = plain_base.replace("http://", "https://");
    let failed = client.send(&payout(&plain_base, "c-3")).await.unwrap_err();
    assert!(
        failed
            .to_string()
            .contains(&format!("{plain_base}: TLS handshake failed: ")),
        "{failed}"
    );
    assert_eq!(plain_vendor.paid(), 0);

    let (tls_base, tls_vendor) = vendor(Some(&pki)).await;
    let http_to_tls = tls_base.replace("https://", "http://");
    let failed = client.send(&payout(&http_to_tls, "c-4")).await.unwrap_err();
    assert!(matches!(failed, Error::GaveUp { .. }), "{failed:?}");
    assert_eq!(tls_vendor.paid(), 0);
}

/// A CA file that cannot be read fails the build of the client, naming it.
#[test]
fn a_missing_ca_file_fails_the_build() {
    let missing = std::env::temp_dir().join("idem-client-no-such-ca.pem");
    let e = fast().ca_file(&missing).build().unwrap_err().to_string();
    assert!(
        e.contains(&format!("CA file {}: cannot be read", missing.display())),
        "{e}"
    );
}
