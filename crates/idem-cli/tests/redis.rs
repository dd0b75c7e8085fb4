//! The `idem` binary on Redis servers and a Redis Cluster that the tests
//! start themselves: the expiry index is swept of entries whose rows Redis
//! already expired, the deployment is checked before writing, and the
//! gateway and the operator commands run on a 3-master cluster.

#[path = "../../idem-redis/tests/support/servers.rs"]
mod servers;
mod support;

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use idem_gateway::AnyLease;
use servers::{RedisCluster, RedisServer};
use support::{Gateway, Run, keys_command};

fn idem(args: &[&str]) -> Run {
    support::idem_run(args, &["IDEM_STORE", "IDEM_SKIP_REDIS_CHECKS"])
}

async fn redis_conn(url: &str) -> redis::aio::MultiplexedConnection {
    redis::Client::open(url)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap_or_else(|e| panic!("cannot reach Redis at {url}: {e}"))
}

/// `count` completed keys of tenant `cli-test` with a TTL of `ttl_secs`, on
/// the real clock (Redis expires rows by their TTL on its own clock).
async fn seed(store: &AnyLease, count: usize, ttl_secs: u64) {
    support::completed_keys(store, "cli-test", "POST /x", count, ttl_secs, 0).await;
    if let AnyLease::Redis(redis) = store {
        redis.flush_index().await;
    }
}

async fn rows(conn: &mut redis::aio::MultiplexedConnection) -> usize {
    let keys: Vec<String> = redis::cmd("KEYS").arg("idem:*:r").query_async(conn).await.unwrap();
    keys.len()
}

/// The entries of the expiry index.
async fn index_entries(conn: &mut redis::aio::MultiplexedConnection) -> u64 {
    redis::cmd("ZCARD").arg("idem:expiry").query_async(conn).await.unwrap()
}

/// Rows Redis expired by their TTL leave index entries behind: `stats`
/// does not count them as keys, and `sweep` removes every one of them,
/// batch after batch, although no batch deletes a row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sweep_removes_every_ghost_entry_and_stats_ignores_them() {
    let server = RedisServer::start(&["--appendonly", "yes", "--maxmemory-policy", "noeviction"]);
    let url = server.url();
    let store = AnyLease::connect(&url).await.unwrap();
    seed(&store, 25, 1).await;
    seed(&store, 3, 86_400).await;
    let mut conn = redis_conn(&url).await;
    let deadline = Instant::now() + Duration::from_secs(20);
    while rows(&mut conn).await > 3 {
        assert!(Instant::now() < deadline, "Redis did not expire the short-lived rows");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let entries = index_entries(&mut conn).await;
    assert_eq!(entries, 28, "every claim was indexed");

    let run = idem(&["stats", "--store", &url, "--json"]);
    assert_eq!(run.code, 0, "{}", run.all());
    let v = run.json();
    assert_eq!(
        (
            v["completed"].as_u64(),
            v["expired"].as_u64(),
            v["in_progress"].as_u64()
        ),
        (Some(3), Some(0), Some(0)),
        "rows Redis already deleted are no keys: {v}"
    );

    let run = idem(&["sweep", "--store", &url, "--batch", "10", "--pause-ms", "0", "--json"]);
    assert_eq!(run.code, 0, "{}", run.all());
    let v = run.json();
    assert_eq!(
        (v["deleted"].as_u64(), v["ghosts"].as_u64(), v["batches"].as_u64()),
        (Some(0), Some(25), Some(3)),
        "{v}"
    );
    let entries = index_entries(&mut conn).await;
    assert_eq!(entries, 3, "the index holds the live rows only");
    assert_eq!(rows(&mut conn).await, 3);
}

/// `idem sweep` on a Redis server of its own, started with `args`.
fn sweep_on(args: &[&str]) -> Run {
    let server = RedisServer::start(args);
    idem(&["sweep", "--store", &server.url()])
}

/// Before writing, the gateway and the writing commands read the server's
/// eviction policy and persistence: an eviction policy (keys could vanish:
/// double effects) is refused with exit 2 naming `maxmemory-policy`, a
/// server without AOF or RDB is a warning, a server that hides CONFIG and
/// INFO is a warning too, and `--skip-redis-checks` skips the check.
/// Read-only commands do not check.
#[test]
fn the_redis_deployment_is_checked_before_writing() {
    let evicting = RedisServer::start(&["--maxmemory-policy", "allkeys-lru", "--appendonly", "yes"]);
    let url = evicting.url();
    for args in [
        vec!["sweep", "--store", url.as_str()],
        vec!["keys", "purge", "--store", url.as_str(), "--state", "expired"],
        vec!["migrate", "--store", url.as_str()],
    ] {
        let run = idem(&args);
        assert_eq!(run.code, 2, "{args:?}: {}", run.all());
        assert!(
            run.stderr.contains("maxmemory-policy") && run.stderr.contains("allkeys-lru"),
            "{args:?}: {}",
            run.all()
        );
        assert!(
            run.stderr.contains("--skip-redis-checks"),
            "{args:?} names the override: {}",
            run.all()
        );
    }
    let run = idem(&["stats", "--store", &url]);
    assert_eq!(run.code, 0, "read-only commands do not check: {}", run.all());
    let run = idem(&["sweep", "--store", &url, "--skip-redis-checks"]);
    assert_eq!(run.code, 0, "{}", run.all());
    let (code, err) = support::gateway_exit(&url, &[]);
    assert_eq!(code, Some(2), "the gateway refuses an evicting Redis at start: {err}");
    assert!(err.contains("maxmemory-policy"), "{err}");

    // CONFIG disabled (managed Redis): INFO still tells the policy.
    let run = sweep_on(&[
        "--maxmemory-policy",
        "volatile-ttl",
        "--appendonly",
        "yes",
        "--rename-command",
        "CONFIG",
        "",
    ]);
    assert_eq!(run.code, 2, "{}", run.all());
    assert!(run.stderr.contains("volatile-ttl"), "{}", run.all());

    // Nothing readable: a warning, and the command runs.
    let run = sweep_on(&[
        "--maxmemory-policy",
        "allkeys-lru",
        "--rename-command",
        "CONFIG",
        "",
        "--rename-command",
        "INFO",
        "",
    ]);
    assert_eq!(run.code, 0, "{}", run.all());
    assert!(
        run.stderr.contains("maxmemory-policy"),
        "the warning names the setting: {}",
        run.all()
    );

    // No persistence: a warning naming appendonly and save, and the command runs.
    let run = sweep_on(&["--maxmemory-policy", "noeviction", "--appendonly", "no", "--save", ""]);
    assert_eq!(run.code, 0, "{}", run.all());
    assert!(
        run.stderr.contains("appendonly") && run.stderr.contains("save"),
        "the warning names the settings: {}",
        run.all()
    );
    let run = sweep_on(&["--maxmemory-policy", "noeviction", "--appendonly", "yes"]);
    assert_eq!(run.code, 0, "{}", run.all());
    assert!(
        !run.stderr.contains("WARN"),
        "a sound deployment is not warned about: {}",
        run.all()
    );
}

/// An HTTP/1.1 upstream that creates an order on every request and counts
/// them (one thread per connection, keep-alive).
fn counting_upstream() -> (String, Arc<AtomicUsize>) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let calls = Arc::new(AtomicUsize::new(0));
    let counted = calls.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(stream) = stream else { continue };
            let counted = counted.clone();
            std::thread::spawn(move || {
                let mut reader = BufReader::new(stream.try_clone().unwrap());
                let mut writer = stream;
                loop {
                    let mut length = 0usize;
                    let mut line = String::new();
                    if reader.read_line(&mut line).unwrap_or(0) == 0 {
                        return;
                    }
                    loop {
                        line.clear();
                        if reader.read_line(&mut line).unwrap_or(0) == 0 {
                            return;
                        }
                        if line == "\r\n" {
                            break;
                        }
                        if let Some((name, value)) = line.split_once(':')
                            && name.eq_ignore_ascii_case("content-length")
                        {
                            length = value.trim().parse().unwrap_or(0);
                        }
                    }
                    let mut body = vec![0; length];
                    if reader.read_exact(&mut body).is_err() {
                        return;
                    }
                    let n = counted.fetch_add(1, Ordering::SeqCst) + 1;
                    let answer = format!(r#"{{"order":{n}}}"#);
                    let head = format!(
                        "HTTP/1.1 201 Created\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
                        answer.len()
                    );
                    if writer.write_all(head.as_bytes()).is_err() || writer.write_all(answer.as_bytes()).is_err() {
                        return;
                    }
                }
            });
        }
    });
    (format!("http://{addr}"), calls)
}

async fn start_gateway(upstream: &str, store: &str) -> (Gateway, String) {
    let port = servers::free_port();
    let listen = format!("127.0.0.1:{port}");
    let child = Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(["gateway", "--upstream", upstream, "--listen", &listen, "--store", store])
        // Tenants from a digest of Authorization, for gateways that ask.
        .env("IDEM_TENANT", "authorization")
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let gateway = Gateway(child);
    let base = format!("http://{listen}");
    support::healthy(&base).await;
    (gateway, base)
}

/// The gateway and `stats`, `keys list/show/purge` and `sweep` run on a
/// 3-master Redis Cluster given by its seed URLs (or by one of them): each
/// key reaches the upstream once, retries replay, and the operator commands
/// see the keys on every master.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_and_the_operator_commands_run_on_a_cluster() {
    let cluster = RedisCluster::start();
    let store = cluster.urls().join(",");
    let (upstream, calls) = counting_upstream();
    let (_gateway, base) = start_gateway(&upstream, &store).await;
    let client = idem_tls::test_pki::http_client();
    let keys: Vec<String> = (0..20).map(|i| format!("order-{i}")).collect();
    for round in 0..2 {
        for key in &keys {
            let r = client
                .post(format!("{base}/v1/orders"))
                .bearer_auth("cluster-test")
                .header("idempotency-key", format!("\"{key}\""))
                .header("content-type", "application/json")
                .body(r#"{"item":"book"}"#)
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 201);
            assert_eq!(r.headers().contains_key("idempotent-replayed"), round == 1, "{key}");
        }
    }
    assert_eq!(calls.load(Ordering::SeqCst), 20, "each key reached the upstream once");
    assert!(
        cluster.keys_per_master().iter().all(|n| *n > 0),
        "the keys spread over every master: {:?}",
        cluster.keys_per_master()
    );

    // The gateway indexes its claims off their path: wait for all of them.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let run = idem(&["stats", "--store", &store, "--json"]);
        assert_eq!(run.code, 0, "{}", run.all());
        if run.json()["completed"] == 20 {
            break;
        }
        assert!(Instant::now() < deadline, "stats never saw the 20 keys: {}", run.all());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // One seed is enough: the cluster is discovered from it.
    let run = idem(&["stats", "--store", &cluster.urls()[1], "--json"]);
    assert_eq!(
        (run.code, run.json()["completed"].as_u64()),
        (0, Some(20)),
        "{}",
        run.all()
    );

    let run = idem(&["keys", "list", "--store", &store, "--json"]);
    assert_eq!(run.code, 0, "{}", run.all());
    let listed = run.json();
    assert_eq!(listed.as_array().map(Vec::len), Some(20), "{listed}");
    let tenant = listed[0]["tenant"].as_str().unwrap().to_owned();
    let show = keys_command("show", &store, &tenant, "POST (unrouted)", "order-7", &["--json"]);
    let run = idem(&show);
    assert_eq!(run.code, 0, "{}", run.all());
    assert_eq!(run.json()["response"]["status"], 201, "{}", run.all());

    let run = idem(&["sweep", "--store", &store, "--json"]);
    assert_eq!(run.code, 0, "{}", run.all());
    assert_eq!(run.json()["deleted"], 0, "nothing has expired: {}", run.all());
    let run = idem(&[
        "keys",
        "purge",
        "--store",
        &store,
        "--tenant",
        &tenant,
        "--state",
        "completed",
        "--json",
    ]);
    assert_eq!(
        (run.code, run.json()["deleted"].as_u64()),
        (0, Some(20)),
        "{}",
        run.all()
    );
    let run = idem(&["stats", "--store", &store, "--json"]);
    assert_eq!(run.json()["completed"], 0, "{}", run.all());
}
