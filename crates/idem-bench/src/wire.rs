//! A counting TCP proxy: forwards every byte between clients and one
//! server and counts round trips at the wire.
//!
//! A round trip is a flight of bytes from the client that follows an answer
//! from the server (or opens the connection): however a message is split
//! into segments or reads, a request the client sends and then waits for
//! counts once, and statements the client pipelines in one flight count once.
//!
//! The proxy runs on threads of its own named [`THREAD_NAME`], so the cost
//! meter can leave its CPU out of the client's.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// The name of every proxy thread.
pub const THREAD_NAME: &str = "cost-wire";

/// A running proxy (it serves until the process ends).
#[derive(Debug, Clone)]
pub struct Wire {
    addr: SocketAddr,
    flights: Arc<AtomicU64>,
}

impl Wire {
    /// Listens on an ephemeral loopback port and forwards to `upstream`.
    pub fn start(upstream: SocketAddr) -> std::io::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let wire = Self {
            addr: listener.local_addr()?,
            flights: Arc::new(AtomicU64::new(0)),
        };
        let flights = wire.flights.clone();
        std::thread::Builder::new().name(THREAD_NAME.into()).spawn(move || {
            for client in listener.incoming().flatten() {
                let flights = flights.clone();
                let _ = std::thread::Builder::new()
                    .name(THREAD_NAME.into())
                    .spawn(move || serve(client, upstream, flights));
            }
        })?;
        Ok(wire)
    }

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Round trips counted so far, over every connection.
    pub fn round_trips(&self) -> u64 {
        self.flights.load(Ordering::SeqCst)
    }
}

fn serve(client: TcpStream, upstream: SocketAddr, flights: Arc<AtomicU64>) {
    let Ok(server) = TcpStream::connect(upstream) else {
        return;
    };
    let _ = (client.set_nodelay(true), server.set_nodelay(true));
    // Whether the server spoke last: the client's next bytes open a round trip.
    let server_spoke = Arc::new(AtomicBool::new(true));
    let (Ok(client2), Ok(server2)) = (client.try_clone(), server.try_clone()) else {
        return;
    };
    let spoke = server_spoke.clone();
    let down = std::thread::Builder::new()
        .name(THREAD_NAME.into())
        .spawn(move || copy(server2, client2, |_| spoke.store(true, Ordering::SeqCst)));
    copy(client, server, |_| {
        if server_spoke.swap(false, Ordering::SeqCst) {
            flights.fetch_add(1, Ordering::SeqCst);
        }
    });
    if let Ok(down) = down {
        let _ = down.join();
    }
}

/// Copies `from` to `to` until either closes, calling `seen` before
/// forwarding each read.
fn copy(mut from: TcpStream, mut to: TcpStream, seen: impl Fn(usize)) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                seen(n);
                if to.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
        }
    }
    let _ = to.shutdown(Shutdown::Write);
    let _ = from.shutdown(Shutdown::Read);
}

/// `url` with its host and port replaced by `addr`
/// (`postgres://user@host:5432/db?x=y` → `postgres://user@127.0.0.1:PORT/db?x=y`).
pub fn via(url: &str, addr: SocketAddr) -> Result<String, String> {
    let (scheme, rest) = url.split_once("://").ok_or_else(|| format!("{url:?}: no scheme"))?;
    let end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(end);
    let userinfo = authority.rsplit_once('@').map(|(u, _)| format!("{u}@"));
    Ok(format!("{scheme}://{}{addr}{tail}", userinfo.unwrap_or_default()))
}

/// The server address `url` names (default `port` if it names none).
pub fn server_of(url: &str, port: u16) -> Result<SocketAddr, String> {
    use std::net::ToSocketAddrs;
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let authority = &rest[..rest.find(['/', '?']).unwrap_or(rest.len())];
    let host_port = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    let with_port = if host_port
        .rsplit_once(':')
        .is_some_and(|(_, p)| p.parse::<u16>().is_ok())
    {
        host_port.to_owned()
    } else {
        format!("{host_port}:{port}")
    };
    with_port
        .to_socket_addrs()
        .map_err(|e| format!("{url:?}: {e}"))?
        .next()
        .ok_or_else(|| format!("{url:?}: no address"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The proxy's URL keeps the scheme, user, database and options.
    #[test]
    fn rewrites_the_authority_only() {
        let addr: SocketAddr = "127.0.0.1:4000".parse().unwrap();
        assert_eq!(
            via("postgres://postgres@127.0.0.1:5432/test?sslmode=disable", addr).unwrap(),
            "postgres://postgres@127.0.0.1:4000/test?sslmode=disable"
        );
        assert_eq!(
            via("mysql://root:p%40ss@db.example:3306/test", addr).unwrap(),
            "mysql://root:p%40ss@127.0.0.1:4000/test"
        );
        assert_eq!(via("postgres://localhost", addr).unwrap(), "postgres://127.0.0.1:4000");
        assert!(via("no scheme", addr).is_err());
        assert_eq!(
            server_of("postgres://u@127.0.0.1/test", 5432).unwrap(),
            "127.0.0.1:5432".parse().unwrap()
        );
        assert_eq!(
            server_of("mysql://root@127.0.0.1:3307/test", 3306).unwrap(),
            "127.0.0.1:3307".parse().unwrap()
        );
    }

    /// Each request answered counts one round trip, however it is split
    /// into writes; bytes the server sends unasked open none.
    #[test]
    fn counts_flights_not_segments() {
        let server = TcpListener::bind("127.0.0.1:0").unwrap();
        let upstream = server.local_addr().unwrap();
        let echo = std::thread::spawn(move || {
            let (mut s, _) = server.accept().unwrap();
            s.write_all(b"hello").unwrap();
            let mut buf = [0u8; 6];
            for _ in 0..3 {
                s.read_exact(&mut buf).unwrap();
                s.write_all(b"ok").unwrap();
            }
        });
        let wire = Wire::start(upstream).unwrap();
        let mut c = TcpStream::connect(wire.addr()).unwrap();
        c.set_nodelay(true).unwrap();
        let mut greeting = [0u8; 5];
        c.read_exact(&mut greeting).unwrap();
        for _ in 0..3 {
            c.write_all(b"abc").unwrap();
            std::thread::sleep(std::time::Duration::from_millis(20));
            c.write_all(b"def").unwrap();
            let mut ok = [0u8; 2];
            c.read_exact(&mut ok).unwrap();
        }
        echo.join().unwrap();
        assert_eq!(wire.round_trips(), 3);
    }
}
