//! The serving loop: HTTP/1.1 connections with read timeouts, and a
//! graceful stop.
//!
//! `axum::serve` sets no timer on its connections, so a caller that sends
//! half a request head holds its connection for ever. Here each connection
//! is served by hyper with a header read timeout (the request head must be
//! whole in time, and an idle kept-alive connection is closed after as
//! long), each request body gets the body read bounds of
//! [`TimedBody`](crate::body::TimedBody), and `TCP_NODELAY` is on.
//!
//! On stop the listener closes, open connections finish their requests
//! (idle ones close at once), bounded by the grace period.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, Response};
use futures_util::future::BoxFuture;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tokio::sync::{Semaphore, watch};

use crate::body::{BodyTimeouts, TimedBody};
use crate::trust::Peer;

/// What answers the requests of one listener.
pub(crate) type Handler = Arc<dyn Fn(Request<Body>) -> BoxFuture<'static, Response<Body>> + Send + Sync>;

/// One listener and how its connections are served.
pub(crate) struct Listener {
    pub(crate) listener: TcpListener,
    pub(crate) handler: Handler,
    pub(crate) header_read_timeout: Duration,
    pub(crate) body: BodyTimeouts,
    pub(crate) limits: Limits,
}

/// What one listener holds at once: connections, and request-body bytes
/// (counted in KiB) reserved by the requests being served.
#[derive(Clone)]
pub(crate) struct Limits {
    connections: Arc<Semaphore>,
    buffered_kib: Arc<Semaphore>,
    max_request_bytes: usize,
}

impl Limits {
    pub(crate) fn new(max_connections: usize, max_buffered_bytes: usize, max_request_bytes: usize) -> Self {
        Self {
            connections: Arc::new(Semaphore::new(max_connections.min(Semaphore::MAX_PERMITS))),
            buffered_kib: Arc::new(Semaphore::new(kib(max_buffered_bytes).min(Semaphore::MAX_PERMITS))),
            max_request_bytes,
        }
    }

    /// The body bytes a request may hold: its `Content-Length` (bounded by
    /// the largest accepted), the largest accepted when it is chunked, none
    /// without a body.
    fn reservation(&self, req: &Request<Incoming>) -> usize {
        let headers = req.headers();
        if let Some(length) = headers
            .get(axum::http::header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok())
        {
            return usize::try_from(length)
                .unwrap_or(usize::MAX)
                .min(self.max_request_bytes);
        }
        if headers.contains_key(axum::http::header::TRANSFER_ENCODING) {
            return self.max_request_bytes;
        }
        0
    }
}

/// A request's share of `max_buffered_bytes`, held as long as the request
/// (its parts) lives.
#[derive(Clone)]
struct Reserved(#[allow(dead_code)] Arc<tokio::sync::OwnedSemaphorePermit>);

fn kib(bytes: usize) -> usize {
    bytes.div_ceil(1024)
}

/// The answer past a limit: 503 `gateway-busy`, try again in a second.
fn busy(what: &str) -> Response<Body> {
    let mut response = idem_http::Problem::new(
        axum::http::StatusCode::SERVICE_UNAVAILABLE,
        "gateway-busy",
        "Gateway busy",
    )
    .with_detail(format!(
        "the gateway holds as many {what} as it is configured for; try again shortly"
    ))
    .into_response(idem_http::DEFAULT_PROBLEM_BASE);
    let headers = response.headers_mut();
    headers.insert(
        axum::http::header::RETRY_AFTER,
        axum::http::HeaderValue::from_static("1"),
    );
    headers.insert(
        axum::http::header::CONNECTION,
        axum::http::HeaderValue::from_static("close"),
    );
    response
}

/// Answers a connection past `max_connections` with a 503 and closes it,
/// without reading its request (bounded in time).
async fn refuse_connection(mut tcp: tokio::net::TcpStream) {
    use tokio::io::AsyncWriteExt;
    let body = r#"{"type":"https://idem.dev/problems/gateway-busy","title":"Gateway busy","status":503,"detail":"the gateway holds as many connections as it is configured for; try again shortly"}"#;
    let answer = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/problem+json\r\nretry-after: 1\r\n\
         connection: close\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    let _ = tokio::time::timeout(Duration::from_secs(2), async move {
        let _ = tcp.write_all(answer.as_bytes()).await;
        let _ = tcp.shutdown().await;
    })
    .await;
}

/// Accept errors that concern one connection, not the listener.
fn is_connection_error(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::ConnectionRefused
            | std::io::ErrorKind::ConnectionAborted
            | std::io::ErrorKind::ConnectionReset
    )
}

/// Serves `l` until `stop` turns true, then lets open connections finish,
/// for at most `grace`.
pub(crate) async fn serve(l: Listener, mut stop: watch::Receiver<bool>, grace: Duration) {
    let graceful = GracefulShutdown::new();
    loop {
        let accepted = tokio::select! {
            biased;
            _ = stop.wait_for(|stopped| *stopped) => break,
            accepted = l.listener.accept() => accepted,
        };
        let (tcp, addr) = match accepted {
            Ok(accepted) => accepted,
            Err(e) if is_connection_error(&e) => continue,
            Err(e) => {
                // Out of file descriptors, for instance: wait for some to close.
                tracing::error!(error = %e, "cannot accept a connection");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Ok(held) = l.limits.connections.clone().try_acquire_owned() else {
            metrics::counter!("idem_gateway_refused_total", "reason" => "connections").increment(1);
            tokio::spawn(refuse_connection(tcp));
            continue;
        };
        // An answer streams to its caller in several writes (the end of the
        // body waits for the record): with Nagle's algorithm the last write
        // would wait for the caller's delayed ACK, some 40 ms.
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!(error = %e, "cannot set TCP_NODELAY on a caller's connection");
        }
        let connection = hyper::server::conn::http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(l.header_read_timeout)
            .serve_connection(
                TokioIo::new(tcp),
                service(l.handler.clone(), addr, l.body, l.limits.clone()),
            );
        let connection = graceful.watch(connection);
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!(error = %e, peer = %addr, "connection ended with an error");
            }
            drop(held);
        });
    }
    drop(l.listener);
    if tokio::time::timeout(grace, graceful.shutdown()).await.is_err() {
        tracing::warn!(
            grace_secs = grace.as_secs(),
            "connections still open after the grace period are closed"
        );
    }
}

fn service(
    handler: Handler,
    addr: SocketAddr,
    body: BodyTimeouts,
    limits: Limits,
) -> impl hyper::service::Service<Request<Incoming>, Response = Response<Body>, Error = Infallible, Future: Send> + Clone
{
    hyper::service::service_fn(move |req: Request<Incoming>| {
        let (handler, limits) = (handler.clone(), limits.clone());
        async move {
            // The body's bytes are reserved before any is read, and held
            // until the answer is made: all requests together never hold
            // more than max_buffered_bytes.
            let wanted = u32::try_from(kib(limits.reservation(&req))).unwrap_or(u32::MAX);
            let reserved = if wanted == 0 {
                None
            } else {
                match limits.buffered_kib.clone().try_acquire_many_owned(wanted) {
                    Ok(permit) => Some(permit),
                    Err(_) => {
                        metrics::counter!("idem_gateway_refused_total", "reason" => "buffered_bytes").increment(1);
                        return Ok::<_, Infallible>(busy("request bytes"));
                    }
                }
            };
            let mut req = req.map(|b| Body::new(TimedBody::new(b, body)));
            req.extensions_mut().insert(Peer(addr));
            // The reservation travels with the request: work that goes on
            // after its caller left (a recording) still holds its bytes.
            let reserved = reserved.map(Arc::new);
            if let Some(reserved) = &reserved {
                req.extensions_mut().insert(Reserved(reserved.clone()));
            }
            let response = handler(req).await;
            drop(reserved);
            Ok::<_, Infallible>(response)
        }
    })
}
