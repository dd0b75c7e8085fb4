//! A graceful stop waits for the recordings of callers that went away:
//! the upstream finishes, its answer is recorded, and a retry on a gateway
//! started afterwards replays it.

mod support;

use std::sync::atomic::Ordering;
use std::time::Duration;

use support::{BEARER, fresh, send, sqlite_store, start_upstream, wait_healthy};

/// The caller goes away while the upstream works, then the gateway is stopped: `serve` returns only once the answer is recorded, and the retry replays it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stop_waits_for_recordings_of_callers_gone() {
    let (upstream, state) = start_upstream().await;
    let store = sqlite_store();
    let toml = format!("upstream = {upstream:?}\nstore = {store:?}\n{BEARER}[defaults]\nlease_ms = 1000\n");
    let config = idem_gateway::Config::from_toml(&toml).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let first = config.clone();
    let served = tokio::spawn(async move {
        idem_gateway::serve(&first, listener, async {
            let _ = stopped.await;
        })
        .await
    });
    wait_healthy(&base).await;
    let (t, k) = (fresh(), fresh());
    // The caller gives up while the upstream is still working.
    let gone = tokio::time::timeout(Duration::from_millis(500), send(&base, "/v1/slow", &t, Some(&k), "{}")).await;
    assert!(gone.is_err(), "the caller went away before the answer");
    assert_eq!(state.calls(), 1, "the upstream is working");
    let _ = stop.send(());
    tokio::time::timeout(Duration::from_secs(30), served)
        .await
        .expect("the gateway stops within its grace period")
        .unwrap()
        .unwrap();
    assert_eq!(
        state.finished.load(Ordering::SeqCst),
        1,
        "serve returned before the upstream's answer was recorded"
    );
    // A gateway started afterwards on the same store replays the answer.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { idem_gateway::serve(&config, listener, std::future::pending()).await });
    wait_healthy(&base).await;
    let (status, headers, body) = send(&base, "/v1/slow", &t, Some(&k), "{}").await;
    assert_eq!((status, body.as_str()), (201, "slow and done"));
    assert_eq!(headers["idempotent-replayed"], "true");
    assert_eq!(state.calls(), 1, "the upstream ran once");
}
