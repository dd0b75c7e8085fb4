//! Servers of a test's own, over TLS with certificates it made: a
//! PostgreSQL instance (`initdb` in a temporary directory, `ssl = on`,
//! TLS-only `pg_hba.conf`), a NATS server with JetStream (`--tls`) and a
//! MariaDB instance (`--require-secure-transport`). Each is stopped and its
//! directory removed on drop.

#![allow(dead_code, unreachable_pub)]

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use idem_tls::test_pki::TestPki;

/// A free loopback port.
pub fn free_port() -> u16 {
    idem_conformance::free_port()
}

fn scratch(name: &str) -> PathBuf {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    let dir = std::env::temp_dir().join(format!("idem-{name}-{}-{nanos}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

/// `program args…`, as the user `postgres` when this runs as root (the
/// server refuses to run as root).
fn as_postgres(program: &str, args: &[&str]) -> Command {
    if is_root() {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--", program]).args(args);
        c
    } else {
        let mut c = Command::new(program);
        c.args(args);
        c
    }
}

fn run(mut command: Command, what: &str) {
    let out = command
        .output()
        .unwrap_or_else(|e| panic!("{what}: cannot run {command:?}: {e}"));
    assert!(
        out.status.success(),
        "{what} failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn wait_for_port(port: u16, what: &str) {
    let until = Instant::now() + Duration::from_secs(30);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < until, "{what} did not listen on {port}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A PostgreSQL instance that accepts TLS connections only.
pub struct TlsPostgres {
    dir: PathBuf,
    data: PathBuf,
    pub port: u16,
}

impl TlsPostgres {
    pub fn start(pki: &TestPki) -> Self {
        let dir = scratch("pg-tls");
        let data = dir.join("data");
        if is_root() {
            run(
                {
                    let mut c = Command::new("chown");
                    c.args(["postgres:postgres"]).arg(&dir);
                    c
                },
                "chown",
            );
        }
        let data_s = data.display().to_string();
        run(
            as_postgres(
                "initdb",
                &[
                    "-D",
                    &data_s,
                    "-U",
                    "postgres",
                    "--auth=trust",
                    "--no-sync",
                    "-E",
                    "UTF8",
                ],
            ),
            "initdb",
        );
        std::fs::copy(pki.cert_file(), data.join("server.pem")).unwrap();
        std::fs::copy(pki.key_file(), data.join("server.key")).unwrap();
        std::fs::write(
            data.join("pg_hba.conf"),
            "local all all trust\nhostssl all all 127.0.0.1/32 trust\n",
        )
        .unwrap();
        if is_root() {
            run(
                {
                    let mut c = Command::new("chown");
                    c.args(["-R", "postgres:postgres"]).arg(&data);
                    c
                },
                "chown",
            );
        }
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(data.join("server.key"), std::fs::Permissions::from_mode(0o600)).unwrap();
        let port = free_port();
        let options = format!(
            "-p {port} -k {} -c listen_addresses=127.0.0.1 -c ssl=on -c ssl_cert_file=server.pem \
             -c ssl_key_file=server.key -c fsync=off",
            dir.display()
        );
        let log = dir.join("postgres.log").display().to_string();
        let started = as_postgres(
            "pg_ctl",
            &["-D", &data_s, "-l", &log, "-o", &options, "-w", "-t", "60", "start"],
        )
        .output();
        let this = Self { dir, data, port };
        let out = started.expect("pg_ctl runs");
        assert!(
            out.status.success(),
            "PostgreSQL did not start: {}\n{}",
            String::from_utf8_lossy(&out.stderr),
            std::fs::read_to_string(this.dir.join("postgres.log")).unwrap_or_default()
        );
        this
    }

    /// `postgres://postgres@127.0.0.1:PORT/postgres` with `params`.
    pub fn url(&self, params: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres?{params}", self.port)
    }
}

impl Drop for TlsPostgres {
    fn drop(&mut self) {
        let data = self.data.display().to_string();
        let _ = as_postgres("pg_ctl", &["-D", &data, "-m", "immediate", "-w", "stop"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A child process killed on drop, with a directory removed.
pub struct Server {
    child: Child,
    dir: PathBuf,
    pub port: u16,
}

impl Server {
    /// Runs `command` (its output dropped), a server of `dir` that listens
    /// on `port`, and waits until it does.
    fn spawn(mut command: Command, dir: PathBuf, port: u16) -> Self {
        let what = command.get_program().to_string_lossy().into_owned();
        let child = command
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("{what} runs: {e}"));
        let server = Server { child, dir, port };
        wait_for_port(port, &what);
        server
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A NATS server with JetStream that speaks TLS only.
pub fn tls_nats(pki: &TestPki) -> Server {
    let dir = scratch("nats-tls");
    let port = free_port();
    let mut command = Command::new("nats-server");
    command
        .args(["-a", "127.0.0.1", "-p", &port.to_string(), "--tls", "--tlscert"])
        .arg(pki.cert_file())
        .arg("--tlskey")
        .arg(pki.key_file())
        .args(["-js", "-sd"])
        .arg(dir.join("js"));
    Server::spawn(command, dir, port)
}

/// A MariaDB instance of its own that requires TLS.
pub fn tls_mariadb(pki: &TestPki) -> Server {
    let dir = scratch("mariadb-tls");
    let data = dir.join("data");
    let user = if is_root() { "root" } else { "" };
    let mut install = Command::new("mariadb-install-db");
    install
        .arg("--no-defaults")
        .arg(format!("--datadir={}", data.display()))
        .args(["--auth-root-authentication-method=normal", "--skip-test-db"]);
    if !user.is_empty() {
        install.arg(format!("--user={user}"));
    }
    run(install, "mariadb-install-db");
    let port = free_port();
    let mut command = Command::new("mariadbd");
    command
        .arg("--no-defaults")
        .arg(format!("--datadir={}", data.display()))
        .arg(format!("--socket={}", dir.join("mysqld.sock").display()))
        .arg(format!("--pid-file={}", dir.join("mysqld.pid").display()))
        .args([
            "--bind-address=127.0.0.1",
            "--skip-networking=0",
            "--skip-grant-tables=0",
        ])
        .arg(format!("--port={port}"))
        .arg(format!("--ssl-cert={}", pki.cert_file().display()))
        .arg(format!("--ssl-key={}", pki.key_file().display()))
        .arg(format!("--ssl-ca={}", pki.ca_file().display()))
        .arg("--require-secure-transport=ON")
        .arg("--innodb-buffer-pool-size=16M")
        .arg(format!("--log-error={}", dir.join("error.log").display()));
    if !user.is_empty() {
        command.arg(format!("--user={user}"));
    }
    Server::spawn(command, dir, port)
}
