//! The gateway in front of an https upstream on loopback, with certificates
//! made for the test: verified against `upstream_ca_file` a keyed request
//! reaches the upstream once and its retry is replayed; an upstream the
//! gateway cannot verify, or plain http to its TLS port, is a 502 problem
//! and reaches nothing.

mod support;

use idem_tls::test_pki::TestPki;
use support::{BEARER, fresh, send, sqlite_store, start_gateway, start_tls_upstream};

/// A keyed POST through the gateway to an https upstream signed by the configured CA reaches it once; the retry is a replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_https_upstream_signed_by_the_ca_file_is_proxied() {
    let pki = TestPki::new("gateway-ok");
    let (upstream, state) = start_tls_upstream(&pki).await;
    let extra = format!("upstream_ca_file = {:?}\n{BEARER}", pki.ca_file().display().to_string());
    let g = start_gateway(&upstream, &sqlite_store(), &extra).await;
    let (t, k) = (fresh(), fresh());
    let (status, headers, first) = send(&g.base, "/v1/payments", &t, Some(&k), r#"{"amount": 3}"#).await;
    assert_eq!(status, 201, "{first}");
    assert!(!headers.contains_key("idempotent-replayed"));
    let (status, headers, again) = send(&g.base, "/v1/payments", &t, Some(&k), r#"{"amount": 3}"#).await;
    assert_eq!((status, &again), (201, &first));
    assert_eq!(headers["idempotent-replayed"], "true");
    assert_eq!(state.calls(), 1);
}

/// Without the CA (the platform's roots) or with another CA the upstream's certificate is refused: a 502 problem saying so, nothing reaches the upstream, and the key is not consumed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_upstream_the_gateway_cannot_verify_is_a_502() {
    let pki = TestPki::new("gateway-unknown");
    let other = TestPki::new("gateway-other");
    let (upstream, state) = start_tls_upstream(&pki).await;
    let other_ca = format!("upstream_ca_file = {:?}\n", other.ca_file().display().to_string());
    for extra in [String::new(), other_ca] {
        let g = start_gateway(&upstream, &sqlite_store(), &format!("{extra}{BEARER}")).await;
        let (status, headers, body) = send(&g.base, "/v1/payments", &fresh(), Some(&fresh()), "{}").await;
        assert_eq!(status, 502, "{body}");
        assert_eq!(headers["content-type"], "application/problem+json");
        assert!(body.contains("TLS certificate was refused"), "{body}");
    }
    assert_eq!(state.calls(), 0);
}

/// Plain http to the upstream's TLS port gets no answer: a 502, nothing recorded.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn plain_http_to_a_tls_upstream_is_a_502() {
    let pki = TestPki::new("gateway-plain");
    let (upstream, state) = start_tls_upstream(&pki).await;
    let plain = upstream.replace("https://", "http://");
    let g = start_gateway(&plain, &sqlite_store(), BEARER).await;
    let (status, _, body) = send(&g.base, "/v1/payments", &fresh(), Some(&fresh()), "{}").await;
    assert_eq!(status, 502, "{body}");
    assert_eq!(state.calls(), 0);
}
