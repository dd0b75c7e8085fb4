//! Who the caller is, over real sockets: callers told apart by a cookie or
//! an API key never share keys or answers, a refreshed token keeps its key
//! space when the upstream names the principal, a tenant header counts only
//! from trusted proxies, and a gateway without a tenant source does not start.

mod support;

use std::sync::atomic::Ordering;

use support::{
    Answer, fresh, gateway_on_sqlite, json, one_answer, refusal, send, send_with, sqlite_store, start_gateway,
    start_upstream,
};

fn replayed(a: &Answer) -> bool {
    a.1.get("idempotent-replayed").is_some_and(|v| v == "true")
}

/// Alice and Bob, told apart by `credential`, send one key and one body: each reaches the upstream, neither sees the other's answer or cookie, and each retry replays its own answer without a cookie.
async fn callers_never_share(credential: &str, alice: (&str, &str), bob: (&str, &str)) {
    let tenant = format!("[tenant]\nsource = \"credentials\"\ncredentials = [\"{credential}\"]\n");
    let (g, state) = gateway_on_sqlite(&tenant).await;
    let key = fresh();
    let body = r#"{"amount":5}"#;
    let as_alice = [alice, ("x-login", "alice")];
    let as_bob = [bob, ("x-login", "bob")];
    let a1 = send_with(&g.base, "POST", "/v1/payments", &as_alice, Some(&key), body).await;
    assert_eq!(a1.0, 201, "{}", a1.2);
    assert!(a1.1["set-cookie"].to_str().unwrap().starts_with("session=alice-1"));
    let b1 = send_with(&g.base, "POST", "/v1/payments", &as_bob, Some(&key), body).await;
    assert_eq!(b1.0, 201, "{}", b1.2);
    assert!(!replayed(&b1), "Bob got a replay: {}", b1.2);
    assert_ne!(b1.2, a1.2, "Bob got Alice's answer");
    assert_eq!(json(&b1.2)["call"], 2, "Bob reached the upstream");
    assert!(
        b1.1["set-cookie"].to_str().unwrap().starts_with("session=bob-2"),
        "Bob got his own cookie"
    );
    for (who, first, as_who) in [("alice", &a1, &as_alice), ("bob", &b1, &as_bob)] {
        let again = send_with(&g.base, "POST", "/v1/payments", as_who, Some(&key), body).await;
        assert!(replayed(&again), "{who}'s retry replays");
        assert_eq!(again.2, first.2, "{who} gets their own answer");
        assert!(!again.1.contains_key("set-cookie"), "a replay carries no cookie");
    }
    assert_eq!(state.calls(), 2);
}

/// Callers told apart by a session cookie never share keys or answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn callers_by_cookie_never_share_keys() {
    callers_never_share(
        "cookie:session",
        ("cookie", "theme=dark; session=alice-secret"),
        ("cookie", "theme=dark; session=bob-secret"),
    )
    .await;
}

/// Callers told apart by an `X-Api-Key` header never share keys or answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn callers_by_api_key_never_share_keys() {
    callers_never_share(
        "header:x-api-key",
        ("x-api-key", "key-of-alice"),
        ("x-api-key", "key-of-bob"),
    )
    .await;
}

/// A keyed request without any configured credential is refused with 401 before the upstream sees it; an unkeyed read still passes.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_keyed_request_without_credentials_is_refused() {
    let tenant = "[tenant]\nsource = \"credentials\"\ncredentials = [\"header:x-api-key\", \"cookie:session\"]\n";
    let (g, state) = gateway_on_sqlite(tenant).await;
    let (status, headers, body) = send_with(
        &g.base,
        "POST",
        "/v1/payments",
        &[("cookie", "theme=dark")],
        Some(&fresh()),
        "{}",
    )
    .await;
    assert_eq!(status, 401, "{body}");
    assert_eq!(headers["content-type"], "application/problem+json");
    assert!(
        body.contains("credentials-missing") && body.contains("x-api-key"),
        "{body}"
    );
    assert_eq!(state.calls(), 0);
    let (status, ..) = send_with(&g.base, "GET", "/v1/doc", &[], None, "").await;
    assert_eq!(status, 200);
}

fn identity(answer: &str) -> String {
    format!(
        "[tenant]\nsource = \"identity\"\ncredentials = [\"authorization\"]\n[tenant.identity]\npath = \"/whoami\"\n{answer}\n"
    )
}

/// A client whose bearer token is refreshed between an attempt and its retry reaches the upstream once: keys follow the principal the upstream names, read from a header or a JSON field.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_refreshed_token_reaches_the_upstream_once() {
    for answer in ["header = \"x-user-id\"", "json_pointer = \"/user/id\""] {
        let (g, state) = gateway_on_sqlite(&identity(answer)).await;
        let key = fresh();
        let first = send(&g.base, "/v1/payments", "alice.token-1", Some(&key), r#"{"amount":5}"#).await;
        assert_eq!(first.0, 201, "{answer}: {}", first.2);
        assert!(
            json(&first.2)["authorization"] == "Bearer alice.token-1",
            "the upstream gets the credential"
        );
        let retry = send(&g.base, "/v1/payments", "alice.token-2", Some(&key), r#"{"amount":5}"#).await;
        assert_eq!(retry.0, 201);
        assert!(replayed(&retry), "{answer}: the retry with a new token replays");
        assert_eq!(retry.2, first.2);
        assert_eq!(state.calls(), 1, "{answer}: the upstream was called once");
        let again = send(&g.base, "/v1/payments", "alice.token-2", Some(&key), r#"{"amount":5}"#).await;
        assert!(replayed(&again));
        assert_eq!(
            state.whoami.load(Ordering::SeqCst),
            2,
            "one identity request per token, then cached"
        );
        // Another principal with the same key is another key space.
        let bob = send(&g.base, "/v1/payments", "bob.token-1", Some(&key), r#"{"amount":5}"#).await;
        assert_eq!(bob.0, 201);
        assert!(!replayed(&bob));
        assert_eq!(state.calls(), 2);
    }
}

/// Sixteen concurrent attempts of one operation, each with a token of its own for one principal, reach the upstream once and all get its answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_attempts_with_refreshed_tokens_reach_the_upstream_once() {
    let (g, state) = gateway_on_sqlite(&identity("header = \"x-user-id\"")).await;
    let key = fresh();
    let tasks: Vec<_> = (0..16)
        .map(|i| {
            let (base, key) = (g.base.clone(), key.clone());
            tokio::spawn(
                async move { send(&base, "/v1/payments", &format!("carol.token-{i}"), Some(&key), "{}").await },
            )
        })
        .collect();
    one_answer(tasks, 201).await;
    assert_eq!(state.calls(), 1, "the upstream was called once");
}

/// Credentials the upstream rejects are answered with its 401 (and challenge) as a problem; nothing is claimed or forwarded.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rejected_credentials_are_a_401() {
    let (g, state) = gateway_on_sqlite(&identity("header = \"x-user-id\"")).await;
    let (status, headers, body) = send(&g.base, "/v1/payments", "bad.token", Some(&fresh()), "{}").await;
    assert_eq!(status, 401, "{body}");
    assert!(body.contains("identity-rejected"), "{body}");
    assert_eq!(headers["www-authenticate"], "Bearer error=\"invalid_token\"");
    let (status, _, body) = send_with(&g.base, "POST", "/v1/payments", &[], Some(&fresh()), "{}").await;
    assert_eq!(status, 401);
    assert!(body.contains("credentials-missing"), "{body}");
    assert_eq!(state.calls(), 0);
}

/// An identity answer that names nobody is a 502; nothing is claimed or forwarded.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_identity_answer_naming_nobody_is_a_502() {
    let (g, state) = gateway_on_sqlite(&identity("header = \"x-nobody\"")).await;
    let (status, _, body) = send(&g.base, "/v1/payments", "alice.1", Some(&fresh()), "{}").await;
    assert_eq!(status, 502, "{body}");
    assert!(body.contains("identity-invalid"), "{body}");
    assert_eq!(state.calls(), 0);
}

/// A tenant header counts only from a trusted proxy: from anyone else any request carrying it is refused with 403 and never forwarded.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_tenant_header_counts_only_from_trusted_proxies() {
    let (upstream, state) = start_upstream().await;
    let tenant = "[tenant]\nsource = \"header\"\nheader = \"x-tenant-id\"\n";
    let untrusted = start_gateway(
        &upstream,
        &sqlite_store(),
        &format!("trusted_proxies = [\"10.0.0.0/8\"]\n{tenant}"),
    )
    .await;
    for (method, key) in [("POST", Some(fresh())), ("GET", None)] {
        let (status, _, body) = send_with(
            &untrusted.base,
            method,
            "/v1/payments",
            &[("x-tenant-id", "acme")],
            key.as_deref(),
            "{}",
        )
        .await;
        assert_eq!(status, 403, "{method}: {body}");
        assert!(body.contains("tenant-header-untrusted"), "{body}");
    }
    assert_eq!(state.calls(), 0, "a spoofed tenant header never reaches the upstream");
    let trusted = start_gateway(
        &upstream,
        &sqlite_store(),
        &format!("trusted_proxies = [\"127.0.0.1\"]\n{tenant}"),
    )
    .await;
    let key = fresh();
    let pay_as = async |tenant: &str| {
        let from_tenant = [("x-tenant-id", tenant)];
        send_with(&trusted.base, "POST", "/v1/payments", &from_tenant, Some(&key), "{}").await
    };
    let acme = pay_as("acme").await;
    assert_eq!(acme.0, 201, "{}", acme.2);
    let globex = pay_as("globex").await;
    assert!(!replayed(&globex), "another tenant's key space");
    let missing = send_with(&trusted.base, "POST", "/v1/payments", &[], Some(&key), "{}").await;
    assert_eq!(missing.0, 400, "{}", missing.2);
    assert_eq!(state.calls(), 2);
}

/// A gateway without a tenant source refuses to start, and says which setting is missing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_gateway_without_a_tenant_source_does_not_start() {
    let e = refusal(&format!(
        "upstream = \"http://127.0.0.1:9\"\nstore = {:?}\n",
        sqlite_store()
    ))
    .await;
    assert!(e.contains("[tenant]"), "{e}");
}
