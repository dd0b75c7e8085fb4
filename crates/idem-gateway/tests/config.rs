//! Configurations that can never work are refused when the gateway starts,
//! with a message naming the setting, before anything is served.

mod support;

use support::{BEARER, refusal, sqlite_store};

/// A key TTL no longer than the upstream timeout or the lease is refused, naming the route (or the defaults).
#[tokio::test]
async fn a_key_that_could_expire_mid_call_is_refused() {
    let store = sqlite_store();
    let base = format!("upstream = \"http://127.0.0.1:9\"\nstore = {store:?}\nupstream_timeout_secs = 60\n{BEARER}");
    let e = refusal(&format!(
        "{base}[[routes]]\nmethod = \"POST\"\npath = \"/v1/payouts/{{id}}\"\nttl_secs = 45\n"
    ))
    .await;
    assert!(
        e.contains("route POST /v1/payouts/{id}") && e.contains("upstream_timeout_secs"),
        "{e}"
    );
    let e = refusal(&format!("{base}[defaults]\nttl_secs = 90\nlease_ms = 120000\n")).await;
    assert!(e.contains("[defaults]") && e.contains("lease_ms"), "{e}");
}

/// An upstream CA file that cannot be read stops the start, naming the setting and the file.
#[tokio::test]
async fn an_unreadable_upstream_ca_file_is_refused() {
    let e = refusal(&format!(
        "upstream = \"https://127.0.0.1:9443\"\nupstream_ca_file = \"/nonexistent/ca.pem\"\nstore = {:?}\n{BEARER}",
        sqlite_store()
    ))
    .await;
    assert!(
        e.contains("upstream_ca_file") && e.contains("CA file /nonexistent/ca.pem: cannot be read"),
        "{e}"
    );
}
