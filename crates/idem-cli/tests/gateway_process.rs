//! `idem gateway` as a process: configurations that can never work are
//! refused at start with exit 2, an https upstream is verified against
//! `--upstream-ca-file`, and SIGTERM waits for the recording of a caller
//! that went away, so its retry after a restart replays.

mod support;

use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::http::StatusCode;
use axum::routing::post;
use support::{Gateway, free_port, healthy};

fn gateway(args: &[&str]) -> Gateway {
    Gateway(
        Command::new(env!("CARGO_BIN_EXE_idem"))
            .arg("gateway")
            .args(args)
            .env("RUST_LOG", "warn,idem_gateway=info")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("idem runs"),
    )
}

/// The tenant source of the tests' gateways.
const TENANT: &[&str] = &["--tenant", "authorization"];

fn temp(name: &str) -> String {
    support::temp("gw-process", name)
}

/// Configurations that can never work are refused at start with exit 2 and a message naming what is wrong.
#[test]
fn impossible_configurations_exit_2() {
    let store = temp("refused.db");
    let listen = format!("127.0.0.1:{}", free_port());
    for (args, said) in [
        (
            // A CA file that cannot be read could only ever fail every call.
            vec![
                "--upstream",
                "https://127.0.0.1:9443",
                "--upstream-ca-file",
                "/nonexistent/ca.pem",
                "--tenant",
                "anonymous",
            ],
            "upstream_ca_file: CA file /nonexistent/ca.pem: cannot be read",
        ),
        (vec!["--upstream", "http://127.0.0.1:9"], "[tenant]"),
        (
            vec!["--upstream", "http://127.0.0.1:9", "--tenant", "bearer"],
            "--tenant",
        ),
        (
            vec![
                "--upstream",
                "http://127.0.0.1:9",
                "--tenant",
                "trusted-header:x-tenant-id",
            ],
            "trusted_proxies",
        ),
    ] {
        let mut g = gateway(&[&args[..], &["--listen", &listen, "--store", &store]].concat());
        let Some(status) = g.wait_exit(Duration::from_secs(20)) else {
            panic!("idem gateway {args:?} started instead of refusing");
        };
        let stderr = g.stderr();
        assert_eq!(status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(said), "{args:?}: {stderr}");
    }
}

/// The upstream: `POST /v1/slow` takes 3 s and counts its calls and the calls that finished.
async fn slow_upstream() -> (String, Arc<AtomicUsize>, Arc<AtomicUsize>) {
    let (calls, finished) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let (c, f) = (calls.clone(), finished.clone());
    let app = Router::new().route(
        "/v1/slow",
        post(move || {
            let (c, f) = (c.clone(), f.clone());
            async move {
                let n = c.fetch_add(1, Ordering::SeqCst) + 1;
                tokio::time::sleep(Duration::from_secs(3)).await;
                f.fetch_add(1, Ordering::SeqCst);
                (StatusCode::CREATED, format!("order {n}"))
            }
        }),
    );
    (support::serve(app).await, calls, finished)
}

fn order(base: &str, key: &str) -> reqwest::RequestBuilder {
    idem_tls::test_pki::http_client()
        .post(format!("{base}/v1/slow"))
        .bearer_auth("demo")
        .header("idempotency-key", format!("\"{key}\""))
        .header("content-type", "application/json")
        .body("{}")
}

/// The caller disconnects while the upstream works, and the gateway gets SIGTERM: it exits only after the upstream's answer is recorded, and after a restart the retry replays it; the upstream ran once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_waits_for_the_recording_of_a_caller_gone() {
    let (upstream, calls, finished) = slow_upstream().await;
    let store = temp("drain.db");
    let config = temp("drain.toml");
    // A short lease: a claim left in progress by a lost recording would be
    // taken over by the retry, and the upstream called again.
    std::fs::write(&config, "[defaults]\nlease_ms = 1000\n").unwrap();
    let port = free_port();
    let base = format!("http://127.0.0.1:{port}");
    let args = [
        "--upstream",
        &upstream,
        "--listen",
        &format!("127.0.0.1:{port}"),
        "--store",
        &store,
        "--config",
        &config,
    ];
    let args = [&args[..], TENANT].concat();
    let mut g = gateway(&args);
    healthy(&base).await;
    let key = uuid::Uuid::now_v7().to_string();
    let gone = tokio::time::timeout(Duration::from_millis(500), order(&base, &key).send()).await;
    assert!(gone.is_err(), "the caller went away before the answer");
    assert_eq!(calls.load(Ordering::SeqCst), 1, "the upstream is working");
    let pid = g.0.id().to_string();
    assert!(Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
    let status = tokio::task::spawn_blocking(move || {
        let status = g.wait_exit(Duration::from_secs(60));
        (status, g)
    })
    .await
    .unwrap();
    let (status, mut g) = status;
    let status = status.expect("the gateway exits within its grace period");
    assert!(status.success(), "{status}: {}", g.stderr());
    assert_eq!(
        finished.load(Ordering::SeqCst),
        1,
        "the upstream finished before the gateway exited"
    );
    let _again = gateway(&args);
    healthy(&base).await;
    let retry = order(&base, &key).send().await.unwrap();
    assert_eq!(retry.status(), 201);
    assert_eq!(
        retry.headers().get("idempotent-replayed").map(|v| v.as_bytes()),
        Some(&b"true"[..]),
        "the retry replays the recorded answer"
    );
    assert_eq!(retry.text().await.unwrap(), "order 1");
    assert_eq!(calls.load(Ordering::SeqCst), 1, "the upstream ran once");
}

/// The binary in front of an https upstream verified against --upstream-ca-file: a keyed POST reaches it once and its retry is replayed; without the CA file the upstream is refused (502) and reached by nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_https_upstream_verified_against_the_ca_file() {
    let pki = idem_tls::test_pki::TestPki::new("cli-gateway");
    let calls = Arc::new(AtomicUsize::new(0));
    let c = calls.clone();
    let app = Router::new().route(
        "/v1/slow",
        post(move || {
            let c = c.clone();
            async move {
                (
                    StatusCode::CREATED,
                    format!("order {}", c.fetch_add(1, Ordering::SeqCst) + 1),
                )
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let upstream = format!("https://{}", listener.local_addr().unwrap());
    let tls = fake_vendor::TlsListener::new(listener, pki.server_config());
    tokio::spawn(async move { axum::serve(tls, app).await.unwrap() });
    let ca = pki.ca_file().display().to_string();
    for (with_ca, expected) in [(true, 201), (false, 502)] {
        let listen = format!("127.0.0.1:{}", free_port());
        let store = temp("https.db");
        let mut args = vec!["--upstream", &upstream, "--listen", &listen, "--store", &store];
        if with_ca {
            args.extend(["--upstream-ca-file", &ca]);
        }
        let _g = gateway(&[&args[..], TENANT].concat());
        let base = format!("http://{listen}");
        healthy(&base).await;
        let key = uuid::Uuid::now_v7().to_string();
        let first = order(&base, &key).send().await.unwrap();
        assert_eq!(first.status().as_u16(), expected);
        let again = order(&base, &key).send().await.unwrap();
        assert_eq!(again.status().as_u16(), expected);
        if with_ca {
            assert_eq!(again.headers()["idempotent-replayed"], "true");
            assert_eq!(again.text().await.unwrap(), "order 1");
        }
    }
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}
