//! `rediss://` against Redis servers of the test's own that speak TLS only
//! (`redis-server --port 0 --tls-port`), with certificates made for the
//! test: one server and a one-node cluster. Each: the URL's `ca_file`
//! verifies the server and commands run; another CA, or the platform's
//! roots, is refused naming the server and the reason; plain `redis://` to
//! the TLS port is refused.

#[path = "support/servers.rs"]
mod servers;

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use idem_redis::RedisStore;
use idem_tls::test_pki::TestPki;

/// A redis-server speaking TLS only, killed on drop.
struct TlsRedis {
    child: Child,
    dir: PathBuf,
    port: u16,
}

impl Drop for TlsRedis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl TlsRedis {
    fn start(pki: &TestPki, cluster: bool) -> Self {
        let port = servers::free_port();
        let dir = std::env::temp_dir().join(format!("idem-redis-tls-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut command = Command::new("redis-server");
        command
            .args(["--port", "0", "--bind", "127.0.0.1", "--tls-port", &port.to_string()])
            .arg("--tls-cert-file")
            .arg(pki.cert_file())
            .arg("--tls-key-file")
            .arg(pki.key_file())
            .arg("--tls-ca-cert-file")
            .arg(pki.ca_file())
            .args(["--tls-auth-clients", "no", "--save", "", "--appendonly", "no", "--dir"])
            .arg(&dir);
        if cluster {
            command.args([
                "--cluster-enabled",
                "yes",
                "--tls-cluster",
                "yes",
                "--cluster-config-file",
            ]);
            command.arg(dir.join("nodes.conf"));
        }
        let child = command
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server runs (with TLS built in)");
        let server = Self { child, dir, port };
        let until = Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < until, "redis-server did not listen on {port}");
            std::thread::sleep(Duration::from_millis(20));
        }
        if cluster {
            // One master holding every slot.
            let cli = |args: &[&str]| {
                Command::new("redis-cli")
                    .args(["--tls", "--cacert"])
                    .arg(pki.ca_file())
                    .args(["-h", "127.0.0.1", "-p", &port.to_string()])
                    .args(args)
                    .output()
                    .expect("redis-cli runs")
            };
            let out = cli(&["CLUSTER", "ADDSLOTSRANGE", "0", "16383"]);
            assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
            let until = Instant::now() + Duration::from_secs(20);
            while !String::from_utf8_lossy(&cli(&["CLUSTER", "INFO"]).stdout).contains("cluster_state:ok") {
                assert!(Instant::now() < until, "the cluster did not become ok");
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        server
    }

    fn url(&self, scheme: &str, ca: Option<&TestPki>) -> String {
        match ca {
            Some(pki) => format!(
                "{scheme}://127.0.0.1:{}/?ca_file={}",
                self.port,
                pki.ca_file().display()
            ),
            None => format!("{scheme}://127.0.0.1:{}/", self.port),
        }
    }
}

async fn refusal(url: &str) -> String {
    match tokio::time::timeout(Duration::from_secs(20), RedisStore::connect_any(url)).await {
        Ok(Ok(_)) => panic!("{url} connected"),
        Ok(Err(e)) => e.to_string(),
        Err(_) => panic!("{url}: no answer within 20 s"),
    }
}

async fn over_tls(cluster: bool) {
    let pki = TestPki::new(if cluster { "redis-cluster" } else { "redis-one" });
    let other = TestPki::new("redis-other");
    let redis = TlsRedis::start(&pki, cluster);
    let store = RedisStore::connect_any(&redis.url("rediss", Some(&pki)))
        .await
        .unwrap_or_else(|e| panic!("rediss with the CA: {e}"));
    assert_eq!(store.is_cluster(), cluster);
    // Commands run over the TLS connection (on every master).
    store.check_deployment().await.unwrap();
    let expected = format!(
        "Redis rediss://127.0.0.1:{}/: TLS handshake failed: invalid peer certificate: UnknownIssuer",
        redis.port
    );
    for url in [redis.url("rediss", Some(&other)), redis.url("rediss", None)] {
        let e = refusal(&url).await;
        assert!(e.contains(&expected), "{url}: {e}");
    }
    let e = refusal(&redis.url("redis", None)).await;
    assert!(!e.is_empty());
}

idem_conformance::cases!(over_tls, 2 => {
    /// One server, TLS only.
    one_server_over_tls(false);
    /// A cluster (one master holding every slot), TLS only, found from one rediss URL.
    a_cluster_over_tls(true);
});

/// A ca_file on a plain redis:// URL, or one that cannot be read, is refused before connecting.
#[tokio::test]
async fn a_ca_file_needs_rediss_and_a_file() {
    let e = refusal("redis://127.0.0.1:1/?ca_file=/tmp/ca.pem").await;
    assert!(e.contains("ca_file is for TLS connections (rediss://)"), "{e}");
    let e = refusal("rediss://127.0.0.1:1/?ca_file=/nonexistent/ca.pem").await;
    assert!(e.contains("CA file /nonexistent/ca.pem: cannot be read"), "{e}");
}
