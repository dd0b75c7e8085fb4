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
use tokio::sync::watch;

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
        // An answer streams to its caller in several writes (the end of the
        // body waits for the record): with Nagle's algorithm the last write
        // would wait for the caller's delayed ACK, some 40 ms.
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!(error = %e, "cannot set TCP_NODELAY on a caller's connection");
        }
        let connection = hyper::server::conn::http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(l.header_read_timeout)
            .serve_connection(TokioIo::new(tcp), service(l.handler.clone(), addr, l.body));
        let connection = graceful.watch(connection);
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!(error = %e, peer = %addr, "connection ended with an error");
            }
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
) -> impl hyper::service::Service<Request<Incoming>, Response = Response<Body>, Error = Infallible, Future: Send> + Clone
{
    hyper::service::service_fn(move |req: Request<Incoming>| {
        let handler = handler.clone();
        async move {
            let mut req = req.map(|b| Body::new(TimedBody::new(b, body)));
            req.extensions_mut().insert(Peer(addr));
            Ok::<_, Infallible>(handler(req).await)
        }
    })
}
