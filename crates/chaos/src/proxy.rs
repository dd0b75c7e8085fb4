//! A TCP fault proxy between the clients and the ledger. Each client request
//! uses its own connection, so each connection's fate is one request's fate:
//! passed through, delayed, cut mid-request, or answered by the service and
//! then dropped before the client hears the response. Behind it a
//! [`Balancer`] picks the instance each connection goes to (with one
//! instance, always that one).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Mutex;

use crate::balancer::Balancer;
use crate::rng::Rng;

/// How often each fault strikes a connection.
#[derive(Debug, Clone, Copy)]
pub struct ProxyOdds {
    /// The service answers; the client never hears it.
    pub drop_response: f64,
    /// The request is cut part-way through.
    pub cut_request: f64,
    /// The request is delayed before it is forwarded.
    pub delay: f64,
}

impl ProxyOdds {
    /// No fault: every connection passes through.
    pub const NONE: ProxyOdds = ProxyOdds {
        drop_response: 0.0,
        cut_request: 0.0,
        delay: 0.0,
    };
}

/// What the proxy did.
#[derive(Debug, Default)]
pub struct ProxyCounts {
    /// Responses the service sent that the client never received.
    pub responses_dropped: AtomicU64,
    /// Requests cut mid-way.
    pub connections_cut: AtomicU64,
    /// Requests delayed.
    pub delays: AtomicU64,
    /// Connections passed through.
    pub passed: AtomicU64,
}

/// A running proxy.
pub struct Proxy {
    /// Where clients connect.
    pub addr: std::net::SocketAddr,
    /// What it did.
    pub counts: Arc<ProxyCounts>,
    enabled: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<()>,
}

enum Fate {
    Pass,
    Delay(Duration),
    Cut(usize),
    DropResponse,
}

impl Proxy {
    /// Starts a proxy to the instances of `upstream`.
    pub async fn start(upstream: Arc<Balancer>, odds: ProxyOdds, rng: Rng) -> std::io::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let counts = Arc::new(ProxyCounts::default());
        let enabled = Arc::new(AtomicBool::new(true));
        let rng = Arc::new(Mutex::new(rng));
        let task = {
            let (counts, enabled) = (counts.clone(), enabled.clone());
            tokio::spawn(async move {
                while let Ok((client, _)) = listener.accept().await {
                    let fate = if enabled.load(Ordering::SeqCst) {
                        let mut r = rng.lock().await;
                        let roll = r.unit();
                        if roll < odds.drop_response {
                            Fate::DropResponse
                        } else if roll < odds.drop_response + odds.cut_request {
                            Fate::Cut(r.range(1, 260) as usize)
                        } else if roll < odds.drop_response + odds.cut_request + odds.delay {
                            Fate::Delay(Duration::from_millis(r.range(20, 400)))
                        } else {
                            Fate::Pass
                        }
                    } else {
                        Fate::Pass
                    };
                    tokio::spawn(serve(client, upstream.clone(), fate, counts.clone()));
                }
            })
        };
        Ok(Self {
            addr,
            counts,
            enabled,
            task,
        })
    }

    /// Stops injecting faults (connections then pass through).
    pub fn calm(&self) {
        self.enabled.store(false, Ordering::SeqCst);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn serve(mut client: TcpStream, upstream: Arc<Balancer>, fate: Fate, counts: Arc<ProxyCounts>) {
    let Some((_, mut server)) = upstream.connect().await else {
        // Every instance is down (killed, restarting): the client sees the
        // connection close and retries.
        return;
    };
    match fate {
        Fate::Pass => {
            counts.passed.fetch_add(1, Ordering::Relaxed);
            let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
        }
        Fate::Delay(d) => {
            counts.delays.fetch_add(1, Ordering::Relaxed);
            tokio::time::sleep(d).await;
            let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
        }
        Fate::Cut(n) => {
            let mut buf = vec![0u8; n];
            let mut sent = 0;
            while sent < n {
                match client.read(&mut buf[sent..]).await {
                    Ok(0) | Err(_) => break,
                    Ok(k) => {
                        if server.write_all(&buf[sent..sent + k]).await.is_err() {
                            break;
                        }
                        sent += k;
                    }
                }
            }
            counts.connections_cut.fetch_add(1, Ordering::Relaxed);
            // Both sides are dropped here: the request is cut.
        }
        Fate::DropResponse => {
            let (mut cr, _cw) = client.split();
            let (mut sr, mut sw) = server.split();
            let upload = async {
                let mut buf = [0u8; 8192];
                loop {
                    match cr.read(&mut buf).await {
                        Ok(0) | Err(_) => break,
                        Ok(k) => {
                            if sw.write_all(&buf[..k]).await.is_err() {
                                break;
                            }
                        }
                    }
                }
                std::future::pending::<()>().await;
            };
            // Wait for the first byte of the response: by then the service
            // has committed (or rejected) the request. Then hang up on the
            // client without passing it on.
            let first_byte = async {
                let mut byte = [0u8; 1];
                matches!(sr.read(&mut byte).await, Ok(1))
            };
            let answered = tokio::select! {
                _ = upload => false,
                a = first_byte => a,
                _ = tokio::time::sleep(Duration::from_secs(30)) => false,
            };
            if answered {
                counts.responses_dropped.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}
