//! A TCP proxy for tests that hold a database's answer back.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::Notify;

/// A proxy to one server on a loopback port of its own. While it is armed,
/// the server's answer to a client flight that contains `needle` (a
/// statement's text, such as `ROLLBACK`) is held back until
/// [`release`](Self::release); everything else passes at once.
///
/// The flight's mark is set before the flight is forwarded, so the server
/// cannot answer before it is held. Clients must connect in clear text (a
/// TLS session hides the statement), and a test should check
/// [`held`](Self::held). It serves until the process ends.
#[derive(Debug, Clone)]
pub struct HoldingProxy {
    addr: SocketAddr,
    armed: Arc<AtomicBool>,
    release: Arc<Notify>,
    held: Arc<AtomicUsize>,
}

impl HoldingProxy {
    /// Starts the proxy to `upstream` (`host:port`), disarmed.
    pub async fn start(upstream: String, needle: &'static [u8]) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("a loopback port for the proxy");
        let proxy = Self {
            addr: listener.local_addr().expect("the proxy's address"),
            armed: Arc::new(AtomicBool::new(false)),
            release: Arc::new(Notify::new()),
            held: Arc::new(AtomicUsize::new(0)),
        };
        let (armed, release, held) = (proxy.armed.clone(), proxy.release.clone(), proxy.held.clone());
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = tokio::net::TcpStream::connect(&upstream).await else {
                    continue;
                };
                let (client_read, client_write) = client.into_split();
                let (server_read, server_write) = server.into_split();
                let hold = Arc::new(AtomicBool::new(false));
                let armed = armed.clone();
                let marks = hold.clone();
                tokio::spawn(forward(client_read, server_write, move |bytes| {
                    if armed.load(Ordering::SeqCst) && bytes.windows(needle.len()).any(|w| w == needle) {
                        marks.store(true, Ordering::SeqCst);
                    }
                    None
                }));
                let (release, held) = (release.clone(), held.clone());
                tokio::spawn(forward(server_read, client_write, move |_| {
                    hold.swap(false, Ordering::SeqCst).then(|| {
                        held.fetch_add(1, Ordering::SeqCst);
                        release.clone()
                    })
                }));
            }
        });
        proxy
    }

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Holds answers from now on (`true`), or no longer (`false`).
    pub fn arm(&self, armed: bool) {
        self.armed.store(armed, Ordering::SeqCst);
    }

    /// Lets the answer held back (or the next one to be held) through.
    pub fn release(&self) {
        self.release.notify_one();
    }

    /// How many answers it has held back so far.
    pub fn held(&self) -> usize {
        self.held.load(Ordering::SeqCst)
    }

    /// Runs `work` in a task of its own and checks that it waits for the
    /// answer held back: still pending 200 ms on, then, once
    /// [`release`](Self::release)d, done. Panics with `waiting` when it did
    /// not wait.
    pub async fn waits_for_release<T: Send + 'static>(
        &self,
        work: impl Future<Output = T> + Send + 'static,
        waiting: &str,
    ) -> T {
        let task = tokio::spawn(work);
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        assert!(!task.is_finished(), "{waiting}");
        self.release();
        task.await.expect("the task waiting for the held answer ran to its end")
    }
}

/// Copies `from` to `to`; before each read is passed on, `inspect` may
/// answer a notification to wait for first.
async fn forward(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    inspect: impl Fn(&[u8]) -> Option<Arc<Notify>>,
) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if let Some(release) = inspect(&buf[..n]) {
            release.notified().await;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}
