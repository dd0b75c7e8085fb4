//! An early answer reaches a client that writes its whole body before it
//! reads, over a real socket.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use axum::Router;
use axum::http::StatusCode;
use axum::routing::post;
use idem_core::{LeaseEngine, Tenant};
use idem_http::{IdempotencyLayer, Problem};
use idem_memory::MemoryStore;

async fn server() -> std::net::SocketAddr {
    let layer = IdempotencyLayer::lease(LeaseEngine::new(MemoryStore::new()), |_parts| {
        Tenant::new("t").map_err(|_| Problem::new(StatusCode::UNAUTHORIZED, "unauthorized", "Unauthorized"))
    })
    .max_request_bytes(64 << 10);
    let app = Router::new()
        .route("/v1/top-ups", post(|| async { StatusCode::CREATED }))
        .route_layer(layer);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

/// Writes the head and the whole body, then reads the answer.
fn write_then_read(addr: std::net::SocketAddr, key: &str, body_len: usize, chunked: bool) -> Result<String, String> {
    let mut s = TcpStream::connect(addr).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    s.set_write_timeout(Some(Duration::from_secs(30))).unwrap();
    let framing = if chunked {
        "transfer-encoding: chunked".to_owned()
    } else {
        format!("content-length: {body_len}")
    };
    let head =
        format!("POST /v1/top-ups HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n{key}{framing}\r\n\r\n");
    s.write_all(head.as_bytes()).map_err(|e| format!("head: {e}"))?;
    let chunk = vec![b'a'; 64 << 10];
    let mut left = body_len;
    while left > 0 {
        let n = left.min(chunk.len());
        if chunked {
            s.write_all(format!("{n:x}\r\n").as_bytes())
                .map_err(|e| format!("body: {e}"))?;
        }
        s.write_all(&chunk[..n]).map_err(|e| format!("body: {e}"))?;
        if chunked {
            s.write_all(b"\r\n").map_err(|e| format!("body: {e}"))?;
        }
        left -= n;
    }
    if chunked {
        s.write_all(b"0\r\n\r\n").map_err(|e| format!("body end: {e}"))?;
    }
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                out.extend_from_slice(&buf[..n]);
                if String::from_utf8_lossy(&out).contains("}") {
                    break;
                }
            }
            Err(e) if out.is_empty() => return Err(format!("read: {e}")),
            Err(_) => break,
        }
    }
    Ok(String::from_utf8_lossy(&out).into_owned())
}

async fn nine_times(key: &'static str, chunked: bool, status: &'static str, slug: &'static str) {
    let addr = server().await;
    let results = tokio::task::spawn_blocking(move || {
        (0..9)
            .map(|_| write_then_read(addr, key, 3 << 20, chunked))
            .collect::<Vec<_>>()
    })
    .await
    .unwrap();
    for r in &results {
        let answer = r
            .as_ref()
            .unwrap_or_else(|e| panic!("no answer: {e}; all: {results:?}"));
        assert!(answer.starts_with(&format!("HTTP/1.1 {status}")), "{answer}");
        assert!(answer.contains("application/problem+json"), "{answer}");
        assert!(answer.contains(slug), "{answer}");
    }
}

idem_conformance::cases!(nine_times, 2 => {
    a_too_large_body_gets_its_413("idempotency-key: \"k\"\r\n", false, "413", "request-body-too-large");
    a_too_large_chunked_body_gets_its_413("idempotency-key: \"k\"\r\n", true, "413", "request-body-too-large");
    a_bad_key_with_a_body_gets_its_400("idempotency-key: {}\r\n", false, "400", "idempotency-key-invalid");
});
