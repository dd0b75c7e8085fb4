//! The Redis deployment is checked again while the gateway serves: an
//! eviction policy switched on later marks `/_idem/healthz` unhealthy
//! (naming the setting) until it is switched off again. On a Redis server
//! of the test's own, so changing its policy harms nobody.

#[path = "../../idem-redis/tests/support/servers.rs"]
mod servers;
mod support;

use std::time::Duration;

use servers::RedisServer;
use support::{BEARER, start_gateway, start_upstream};

async fn set_policy(port: u16, policy: &str) {
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}")).unwrap();
    let mut c = client.get_multiplexed_async_connection().await.unwrap();
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory-policy")
        .arg(policy)
        .query_async(&mut c)
        .await
        .unwrap();
}

async fn health(base: &str) -> (u16, String) {
    let r = idem_tls::test_pki::http_client()
        .get(format!("{base}/_idem/healthz"))
        .send()
        .await
        .unwrap();
    (r.status().as_u16(), r.text().await.unwrap())
}

/// Asks for the health every 50 ms until it answers `status`, at most 300
/// times: the last answer.
async fn health_until(base: &str, status: u16) -> (u16, String) {
    let mut seen = health(base).await;
    for _ in 1..300 {
        if seen.0 == status {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        seen = health(base).await;
    }
    seen
}

/// Within a few periods of a switch to `allkeys-lru` the health check
/// answers 503 naming `maxmemory-policy`; back on `noeviction` it is 200.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_eviction_policy_switched_on_later_marks_the_gateway_unhealthy() {
    let redis = RedisServer::start(&["--save", "", "--appendonly", "no", "--maxmemory-policy", "noeviction"]);
    let (upstream, _) = start_upstream().await;
    let g = start_gateway(
        &upstream,
        &format!("redis://127.0.0.1:{}", redis.port),
        &format!("{BEARER}[redis]\ndeployment_check_secs = 1\n"),
    )
    .await;
    assert_eq!(health(&g.base).await.0, 200);
    set_policy(redis.port, "allkeys-lru").await;
    let seen = health_until(&g.base, 503).await;
    assert_eq!(seen.0, 503, "{seen:?}");
    assert!(seen.1.contains("maxmemory-policy"), "{seen:?}");
    set_policy(redis.port, "noeviction").await;
    let seen = health_until(&g.base, 200).await;
    assert_eq!(seen.0, 200, "{seen:?}");
}
