//! The gateway's connections and exposure: read timeouts against callers
//! that send half a request, the admin endpoints on a listener of their
//! own, and forwarding headers that believe only trusted proxies.

mod support;

use std::time::{Duration, Instant};

use support::{
    BEARER, fresh, gateway_on_sqlite, json, raw, send_with, sqlite_store, start_gateway, start_upstream, wait_healthy,
};

const TIMEOUTS: &str = "header_read_timeout_secs = 1\nbody_read_timeout_secs = 1\n";

/// A caller that sends half a request head and waits has its connection closed after the header read timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_half_sent_head_is_closed() {
    let (g, state) = gateway_on_sqlite(&format!("{TIMEOUTS}{BEARER}")).await;
    let started = Instant::now();
    let answer = raw(g.addr, b"POST /v1/payments HTTP/1.1\r\nHost: gateway\r\nContent-Ty").await;
    let waited = started.elapsed();
    assert!(
        waited < Duration::from_secs(8),
        "the connection stayed open {waited:?}: {answer:?}"
    );
    assert!(!answer.contains("201"), "{answer}");
    assert_eq!(state.calls(), 0);
}

/// A keyed request whose body stops halfway is answered 408 and its connection closed; nothing is claimed or forwarded.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_half_sent_keyed_body_is_408() {
    let (g, state) = gateway_on_sqlite(&format!("{TIMEOUTS}{BEARER}")).await;
    let key = fresh();
    let request = format!(
        "POST /v1/payments HTTP/1.1\r\nHost: gateway\r\nAuthorization: Bearer t\r\nIdempotency-Key: \"{key}\"\r\n\
         Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{{\"amount\":"
    );
    let started = Instant::now();
    let answer = raw(g.addr, request.as_bytes()).await;
    assert!(started.elapsed() < Duration::from_secs(8), "{answer:?}");
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer:?}");
    assert!(answer.contains("request-body-timeout"), "{answer}");
    assert_eq!(state.calls(), 0);
    // The key was never claimed: a whole retry runs.
    let (status, _, body) = send_with(
        &g.base,
        "POST",
        "/v1/payments",
        &[("authorization", "Bearer t")],
        Some(&key),
        r#"{"amount":5}"#,
    )
    .await;
    assert_eq!(status, 201, "{body}");
}

/// An unkeyed request streamed to the upstream whose body stops halfway is answered 408 too.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_half_sent_forwarded_body_is_408() {
    let (g, _) = gateway_on_sqlite(&format!("{TIMEOUTS}{BEARER}[defaults]\nkey = \"optional\"\n")).await;
    let request = "POST /v1/upload HTTP/1.1\r\nHost: gateway\r\nContent-Length: 100\r\n\r\nhalf";
    let started = Instant::now();
    let answer = raw(g.addr, request.as_bytes()).await;
    assert!(started.elapsed() < Duration::from_secs(8), "{answer:?}");
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer:?}");
}

/// With an admin listener, the gateway's endpoints are served there and the proxy's listener forwards every path.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_admin_endpoints_can_have_a_listener_of_their_own() {
    let (upstream, state) = start_upstream().await;
    let config = idem_gateway::Config::from_toml(&format!(
        "upstream = {upstream:?}\nstore = {:?}\n{BEARER}",
        sqlite_store()
    ))
    .unwrap();
    let proxy = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let admin = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let (proxy_base, admin_base) = (
        format!("http://{}", proxy.local_addr().unwrap()),
        format!("http://{}", admin.local_addr().unwrap()),
    );
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let served = tokio::spawn(async move {
        idem_gateway::serve(
            &config,
            idem_gateway::Listeners {
                proxy,
                admin: Some(admin),
            },
            async {
                let _ = stopped.await;
            },
        )
        .await
    });
    wait_healthy(&admin_base).await;
    let metrics = idem_tls::test_pki::get(format!("{admin_base}/_idem/metrics"))
        .await
        .unwrap();
    assert_eq!(metrics.status(), 200);
    let (status, _, body) = send_with(&proxy_base, "GET", "/_idem/healthz", &[], None, "").await;
    assert_eq!(status, 201, "forwarded to the upstream: {body}");
    assert_eq!(json(&body)["target"], "/_idem/healthz");
    assert_eq!(state.calls(), 1);
    let _ = stop.send(());
    served.await.unwrap().unwrap();
}

/// Forwarding headers: a caller's own are replaced unless it is a trusted proxy, whose are extended.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn forwarding_headers_believe_only_trusted_proxies() {
    let (upstream, _) = start_upstream().await;
    for (trusted, xff) in [("10.0.0.0/8", "127.0.0.1"), ("127.0.0.1", "6.6.6.6, 127.0.0.1")] {
        let g = start_gateway(
            &upstream,
            &sqlite_store(),
            &format!("forwarded_headers = \"both\"\ntrusted_proxies = [\"{trusted}\"]\n{BEARER}"),
        )
        .await;
        let spoofed = [
            ("authorization", "Bearer t"),
            ("x-forwarded-for", "6.6.6.6"),
            ("forwarded", "for=6.6.6.6"),
        ];
        let (status, _, body) = send_with(&g.base, "POST", "/v1/orders", &spoofed, Some(&fresh()), "{}").await;
        assert_eq!(status, 201, "{body}");
        let seen = json(&body);
        assert_eq!(seen["x_forwarded_for"], xff, "trusted {trusted}");
        assert_eq!(seen["x_forwarded_proto"], "http");
        assert_eq!(seen["x_forwarded_host"], g.addr.to_string());
        let forwarded = seen["forwarded"].as_str().unwrap();
        assert!(
            forwarded.ends_with(&format!("for=127.0.0.1;proto=http;host=\"{}\"", g.addr)),
            "{forwarded}"
        );
        assert_eq!(
            forwarded.starts_with("for=6.6.6.6"),
            trusted == "127.0.0.1",
            "{forwarded}"
        );
    }
}

/// `max_connections` bounds the connections served at once: past it a
/// connection is answered 503 `gateway-busy` (with `Retry-After`) and
/// closed, and once connections close new ones are served again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn connections_past_the_limit_are_answered_503() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (g, state) = gateway_on_sqlite(&format!("max_connections = 3\nheader_read_timeout_secs = 30\n{BEARER}")).await;
    // Three callers that connect and send half a head: each holds a slot.
    // A connection refused because an earlier one (the health check's) had
    // not closed yet is answered at once: it is replaced.
    let mut idle = Vec::new();
    let mut tries = 0;
    while idle.len() < 3 {
        tries += 1;
        assert!(tries < 100, "three connections never held their slots");
        let mut tcp = tokio::net::TcpStream::connect(g.addr).await.unwrap();
        tcp.write_all(b"GET /v1/thing HTTP/1.1\r\nHo").await.unwrap();
        let mut first = [0u8; 1];
        if tokio::time::timeout(Duration::from_millis(300), tcp.read(&mut first))
            .await
            .is_err()
        {
            idle.push(tcp);
        }
    }
    let refused = raw(g.addr, b"GET /v1/thing HTTP/1.1\r\nHost: gateway\r\n\r\n").await;
    assert!(refused.starts_with("HTTP/1.1 503"), "{refused}");
    assert!(refused.contains("gateway-busy"), "{refused}");
    assert!(refused.to_ascii_lowercase().contains("retry-after: 1"), "{refused}");
    assert_eq!(state.calls(), 0, "nothing forwarded");
    drop(idle);
    let mut served = String::new();
    for _ in 0..100 {
        served = raw(
            g.addr,
            b"GET /v1/thing HTTP/1.1\r\nHost: gateway\r\nAuthorization: Bearer t\r\nConnection: close\r\n\r\n",
        )
        .await;
        if !served.starts_with("HTTP/1.1 503") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(served.starts_with("HTTP/1.1 2"), "{served}");
}

/// `max_buffered_bytes` bounds the request-body bytes held at once: two
/// slow 60 KB bodies hold most of a 128 KiB budget, a third is answered 503
/// before any of its body is read (nothing forwarded), a small one still
/// passes, and once a slow body is whole and answered the budget is free
/// again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn request_bytes_past_the_budget_are_answered_503() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (g, state) = gateway_on_sqlite(&format!(
        "max_request_bytes = 65536\nmax_buffered_bytes = 131072\nbody_read_timeout_secs = 30\n\
         body_total_timeout_secs = 60\n{BEARER}[defaults]\nkey = \"optional\"\n"
    ))
    .await;
    let head = |length: usize| {
        format!(
            "POST /v1/upload HTTP/1.1\r\nHost: gateway\r\nAuthorization: Bearer t\r\nConnection: close\r\n\
             Content-Length: {length}\r\n\r\n"
        )
    };
    let mut slow = Vec::new();
    for _ in 0..2 {
        let mut tcp = tokio::net::TcpStream::connect(g.addr).await.unwrap();
        tcp.write_all(head(60_000).as_bytes()).await.unwrap();
        tcp.write_all(&[b'x'; 1_000]).await.unwrap();
        slow.push(tcp);
    }
    // Their heads read and their bytes reserved, however busy the machine.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let refused = raw(g.addr, format!("{}{}", head(60_000), "y".repeat(60_000)).as_bytes()).await;
    assert!(
        refused.starts_with("HTTP/1.1 503"),
        "{}",
        &refused[..refused.len().min(400)]
    );
    assert!(refused.contains("gateway-busy"), "{refused}");
    let small = raw(g.addr, format!("{}{}", head(100), "z".repeat(100)).as_bytes()).await;
    assert!(small.starts_with("HTTP/1.1 2"), "{small}");
    assert_eq!(state.calls(), 1, "only the small one was forwarded");
    // One slow body completes: answered, its bytes given back.
    let mut first = slow.remove(0);
    first.write_all(&[b'x'; 59_000]).await.unwrap();
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), first.read_to_end(&mut answer)).await;
    assert!(String::from_utf8_lossy(&answer).starts_with("HTTP/1.1 2"));
    let again = raw(g.addr, format!("{}{}", head(60_000), "y".repeat(60_000)).as_bytes()).await;
    assert!(again.starts_with("HTTP/1.1 2"), "{}", &again[..again.len().min(400)]);
    drop(slow);
}

/// A caller that sends a keyed body and hangs up leaves its request's
/// recording running (the upstream may act): that work still holds its
/// bytes, so callers that hang up cannot push more bodies through at once
/// than `max_buffered_bytes` allows.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn callers_that_hang_up_still_count_against_the_budget() {
    use tokio::io::AsyncWriteExt;
    let (g, state) = gateway_on_sqlite(&format!(
        "max_request_bytes = 65536\nmax_buffered_bytes = 131072\n{BEARER}"
    ))
    .await;
    for _ in 0..5 {
        let body = format!("{{\"pad\":\"{}\"}}", "p".repeat(59_000));
        let request = format!(
            "POST /v1/slow HTTP/1.1\r\nHost: gateway\r\nAuthorization: Bearer t\r\nIdempotency-Key: \"{}\"\r\n\
             Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            fresh(),
            body.len()
        );
        let mut tcp = tokio::net::TcpStream::connect(g.addr).await.unwrap();
        tcp.write_all(request.as_bytes()).await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        drop(tcp);
    }
    // The first forwarded (however busy the machine), then a moment for any
    // other: each slow call lasts 2.5 s, longer than all five sends took.
    for _ in 0..200 {
        if state.calls() > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let calls = state.calls();
    assert!(
        (1..=2).contains(&calls),
        "{calls} slow calls at once from callers that hung up: the budget holds two bodies"
    );
}
