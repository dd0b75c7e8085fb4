//! A PostgreSQL primary with a streaming replica, asynchronous or
//! synchronous, and its failover by promotion.
//!
//! [`PgPair::start`] makes a cluster with `initdb`, starts it as the primary,
//! copies it with `pg_basebackup -R -X stream` and starts the copy as a hot
//! standby that streams from the primary; both listen on free loopback ports
//! and keep their sockets and data in a [`Scratch`] directory of their own.
//! The [`Mode`] is given to the primary on its command line
//! (`synchronous_standby_names`, `synchronous_commit`), so the replica does not
//! inherit it: once promoted, it acknowledges commits on its own.
//!
//! A failover is [`PgPair::kill_primary`] (SIGKILL to every process of the
//! primary at once, as a crash of its host would stop them) followed by
//! [`PgPair::promote`]. [`PgPair::stall_replication`] stops the primary's WAL
//! sender (SIGSTOP), so the replica falls behind by whatever commits next.
//!
//! PostgreSQL refuses to run as root: as root, every server binary runs as
//! the `postgres` user (through `setpriv`, which executes it in place, so the
//! child's pid is the postmaster's), and the scratch directory is given to
//! that user. Each postmaster leads a process group of its own, so it and its
//! children are killed together. If the process that started a pair dies
//! without dropping it (a pair kept in a `static`, or a test process killed),
//! the scratch directory's watcher kills both servers (and their backends,
//! whose working directory is their data directory) and removes the
//! directory once that process is gone.

use std::fmt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use sqlx::postgres::{PgConnectOptions, PgConnection};
use sqlx::{Connection, Row};

use crate::process::{Guarded, Scratch, free_port};

/// How long a server may take to accept connections, and the replica to
/// start streaming.
const READY_WITHIN: Duration = Duration::from_secs(60);

/// How the primary waits for the replica before it acknowledges a commit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Asynchronous streaming: a commit is acknowledged once the primary has
    /// flushed it; the replica follows when it can.
    Async,
    /// `synchronous_standby_names = '*'`, `synchronous_commit = on`: a commit
    /// is acknowledged once the replica has flushed its WAL.
    SyncOn,
    /// `synchronous_standby_names = '*'`, `synchronous_commit =
    /// remote_apply`: a commit is acknowledged once the replica has applied
    /// it (its readers see it).
    RemoteApply,
}

impl Mode {
    /// Every mode, the cheapest first.
    pub const ALL: [Mode; 3] = [Mode::Async, Mode::SyncOn, Mode::RemoteApply];

    /// The mode's name in tables and messages.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Async => "async",
            Mode::SyncOn => "sync on",
            Mode::RemoteApply => "remote_apply",
        }
    }

    /// Whether the primary waits for the replica before it acknowledges.
    pub fn is_synchronous(self) -> bool {
        !matches!(self, Mode::Async)
    }

    /// The primary's settings of this mode.
    fn primary_settings(self) -> &'static [&'static str] {
        match self {
            Mode::Async => &[],
            Mode::SyncOn => &["synchronous_standby_names=*", "synchronous_commit=on"],
            Mode::RemoteApply => &["synchronous_standby_names=*", "synchronous_commit=remote_apply"],
        }
    }
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The replica as the primary sees it (a row of `pg_stat_replication`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Replication {
    /// The standby's `application_name` (`walreceiver` unless it sets one).
    pub application_name: String,
    /// `streaming` once the replica has caught up.
    pub state: String,
    /// `async`, or `sync` when the primary waits for it.
    pub sync_state: String,
}

/// The directory holding PostgreSQL's server binaries: `pg_config --bindir`
/// if `initdb` is there, else the newest `/usr/lib/postgresql/<version>/bin`.
pub fn bin_dir() -> Result<PathBuf, String> {
    let has_initdb = |dir: &Path| dir.join("initdb").is_file() && dir.join("pg_basebackup").is_file();
    if let Ok(out) = Command::new("pg_config").arg("--bindir").output()
        && out.status.success()
    {
        let dir = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        if has_initdb(&dir) {
            return Ok(dir);
        }
    }
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let version = entry.file_name().to_str()?.parse::<u32>().ok()?;
            Some((version, entry.path().join("bin")))
        })
        .filter(|(_, dir)| has_initdb(dir))
        .collect();
    versions.sort();
    versions.pop().map(|(_, dir)| dir).ok_or_else(|| {
        "PostgreSQL's server binaries (initdb, pg_basebackup, postgres, pg_ctl) were not found: \
         neither `pg_config --bindir` nor /usr/lib/postgresql/<version>/bin has them; install the \
         PostgreSQL server package"
            .to_owned()
    })
}

/// Whether this process runs as root (then the servers run as `postgres`).
fn running_as_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|out| String::from_utf8_lossy(&out.stdout).trim() == "0")
        .unwrap_or(false)
}

/// The uid and gid of the `postgres` user.
fn postgres_ids() -> Result<(u32, u32), String> {
    let id = |flag: &str| -> Result<u32, String> {
        let out = Command::new("id")
            .args([flag, "postgres"])
            .output()
            .map_err(|e| format!("id {flag} postgres: {e}"))?;
        String::from_utf8_lossy(&out.stdout).trim().parse().map_err(|_| {
            "running as root, PostgreSQL's servers must run as the `postgres` user, and there is none".to_owned()
        })
    };
    Ok((id("-u")?, id("-g")?))
}

/// Parses an LSN as PostgreSQL prints it (`16/B374D848`).
pub fn parse_lsn(text: &str) -> Result<u64, String> {
    let (high, low) = text.split_once('/').ok_or_else(|| format!("not an LSN: {text}"))?;
    let high = u64::from_str_radix(high, 16).map_err(|_| format!("not an LSN: {text}"))?;
    let low = u64::from_str_radix(low, 16).map_err(|_| format!("not an LSN: {text}"))?;
    Ok(high << 32 | low)
}

/// One server: its postmaster, leader of a process group of its own.
#[derive(Debug)]
struct Server {
    postmaster: Guarded,
    pgid: u32,
}

impl Server {
    /// Kills every process of the server at once (SIGKILL to its process
    /// group) and reaps the postmaster.
    fn kill(&mut self) {
        // Once reaped, the group's id may be another's: signal it only while
        // the postmaster (at worst a zombie, holding its pid) is ours.
        if self.postmaster.id().is_some() {
            signal_group("KILL", self.pgid);
            self.postmaster.kill();
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Sends `signal` to process `pid`.
fn signal(signal: &str, pid: u32) -> Result<(), String> {
    let status = Command::new("kill")
        .args([&format!("-{signal}"), &pid.to_string()])
        .status()
        .map_err(|e| format!("kill -{signal} {pid}: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("kill -{signal} {pid} failed ({status})"))
    }
}

/// Sends `signal` to every process of group `pgid`.
fn signal_group(signal: &str, pgid: u32) {
    let _ = Command::new("kill")
        .args([&format!("-{signal}"), "--", &format!("-{pgid}")])
        .stderr(Stdio::null())
        .status();
}

/// A primary and its streaming replica on loopback ports of their own;
/// dropping it kills both and removes their directory.
#[derive(Debug)]
pub struct PgPair {
    mode: Mode,
    primary: Server,
    // Held for its drop, which kills the replica.
    _replica: Server,
    primary_port: u16,
    replica_port: u16,
    bin: PathBuf,
    as_postgres: bool,
    /// The WAL sender stopped by [`PgPair::stall_replication`].
    stalled: Option<u32>,
    // Dropped last, once no server writes in it.
    scratch: Scratch,
}

impl Drop for PgPair {
    /// A stalled WAL sender is stopped: it would never see its postmaster
    /// die, and it leads a session of its own.
    fn drop(&mut self) {
        if let Some(pid) = self.stalled.take() {
            let _ = signal("KILL", pid);
        }
    }
}

impl PgPair {
    /// Starts a primary in `mode` and a replica streaming from it, and waits
    /// until the replica streams (and, in a synchronous mode, is the
    /// primary's synchronous standby).
    pub async fn start(mode: Mode) -> Result<Self, String> {
        let bin = bin_dir()?;
        let as_postgres = running_as_root();
        let scratch = Scratch::new("pg-replica").map_err(|e| format!("scratch directory: {e}"))?;
        let dir = scratch.path().to_owned();
        if as_postgres {
            let (uid, gid) = postgres_ids()?;
            std::os::unix::fs::chown(&dir, Some(uid), Some(gid))
                .map_err(|e| format!("chown {} to postgres: {e}", dir.display()))?;
        }
        let p = dir.join("p");
        let r = dir.join("r");
        let started = Instant::now();
        let run = Runner { bin: &bin, as_postgres };
        run.tool(
            "initdb",
            &[
                "-D",
                path_str(&p)?,
                "-A",
                "trust",
                "-U",
                "postgres",
                "--no-sync",
                "-E",
                "UTF8",
                "--locale=C",
            ],
        )
        .await?;
        let primary_port = free_port();
        let mut settings = vec!["wal_level=replica", "max_wal_senders=5"];
        settings.extend_from_slice(mode.primary_settings());
        let mut primary = run.server(&p, primary_port, &dir, &settings, &dir.join("p.log"))?;
        wait_ready(&mut primary, primary_port, &dir.join("p.log"), "the primary").await?;
        let port = primary_port.to_string();
        run.tool(
            "pg_basebackup",
            &[
                "-h",
                "127.0.0.1",
                "-p",
                &port,
                "-U",
                "postgres",
                "-D",
                path_str(&r)?,
                "-R",
                "-X",
                "stream",
                "--no-sync",
            ],
        )
        .await?;
        let replica_port = free_port();
        let mut replica = run.server(&r, replica_port, &dir, &["hot_standby=on"], &dir.join("r.log"))?;
        wait_ready(&mut replica, replica_port, &dir.join("r.log"), "the replica").await?;
        let pair = Self {
            mode,
            primary,
            _replica: replica,
            primary_port,
            replica_port,
            bin,
            as_postgres,
            stalled: None,
            scratch,
        };
        let wanted = if mode.is_synchronous() { "sync" } else { "async" };
        let deadline = Instant::now() + READY_WITHIN;
        loop {
            let state = pair.replication().await?;
            if state
                .as_ref()
                .is_some_and(|s| s.state == "streaming" && s.sync_state == wanted)
            {
                break;
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "the replica is not streaming as {wanted} within {READY_WITHIN:?}: {state:?}; see {}",
                    pair.scratch.path().join("r.log").display()
                ));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        tracing::info!(%mode, elapsed_ms = started.elapsed().as_millis() as u64, "primary and replica up");
        Ok(pair)
    }

    /// The mode the primary runs in.
    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// The primary's URL (database `postgres`, user `postgres`, no password).
    pub fn primary_url(&self) -> String {
        url(self.primary_port)
    }

    /// The replica's URL: read-only until promoted.
    pub fn replica_url(&self) -> String {
        url(self.replica_port)
    }

    /// The directory holding both servers' data, sockets and logs.
    pub fn dir(&self) -> &Path {
        self.scratch.path()
    }

    /// The replica as the primary sees it, if it is connected.
    pub async fn replication(&self) -> Result<Option<Replication>, String> {
        let mut conn = connect(self.primary_port).await?;
        let row = sqlx::query("SELECT application_name, state, sync_state FROM pg_stat_replication")
            .fetch_optional(&mut conn)
            .await
            .map_err(|e| format!("read pg_stat_replication: {e}"))?;
        Ok(row.map(|row| Replication {
            application_name: row.get(0),
            state: row.get(1),
            sync_state: row.get(2),
        }))
    }

    /// Stops the primary's WAL sender (SIGSTOP): the primary goes on
    /// committing, and in [`Mode::Async`] acknowledging, while the replica
    /// receives nothing more. Stopping the replica's WAL receiver instead would
    /// not do: what the sender already wrote to the socket (hundreds of
    /// kilobytes on loopback) would still be read once it resumed, even after
    /// the primary died. In a synchronous mode every commit then waits.
    pub async fn stall_replication(&mut self) -> Result<(), String> {
        if self.stalled.is_some() {
            return Ok(());
        }
        let mut conn = connect(self.primary_port).await?;
        let pid: Option<i32> = sqlx::query_scalar("SELECT pid FROM pg_stat_replication")
            .fetch_optional(&mut conn)
            .await
            .map_err(|e| format!("find the WAL sender: {e}"))?;
        let pid = pid.ok_or("no WAL sender to stall: the replica is not connected")?;
        let pid = u32::try_from(pid).map_err(|_| format!("odd WAL sender pid {pid}"))?;
        signal("STOP", pid)?;
        self.stalled = Some(pid);
        Ok(())
    }

    /// Lets a stalled WAL sender go on (SIGCONT).
    pub fn resume_replication(&mut self) -> Result<(), String> {
        match self.stalled.take() {
            Some(pid) => signal("CONT", pid),
            None => Ok(()),
        }
    }

    /// The primary's WAL flushed so far (`pg_current_wal_flush_lsn()`): every
    /// commit the primary has acknowledged is at or below it.
    pub async fn primary_flush_lsn(&self) -> Result<u64, String> {
        lsn(self.primary_port, "SELECT pg_current_wal_flush_lsn()::text").await
    }

    /// The WAL the replica has received and flushed
    /// (`pg_last_wal_receive_lsn()`): what its promotion will replay.
    pub async fn replica_received_lsn(&self) -> Result<u64, String> {
        lsn(self.replica_port, "SELECT pg_last_wal_receive_lsn()::text").await
    }

    /// The WAL the replica has applied (`pg_last_wal_replay_lsn()`).
    pub async fn replica_replayed_lsn(&self) -> Result<u64, String> {
        lsn(self.replica_port, "SELECT pg_last_wal_replay_lsn()::text").await
    }

    /// Crashes the primary: SIGKILL to the postmaster and every process it
    /// started, at once. Nothing is shut down cleanly or flushed.
    pub fn kill_primary(&mut self) {
        self.primary.kill();
        // A backend leads a session of its own, so the group's kill misses
        // it, and a stopped WAL sender never sees its postmaster die.
        if let Some(pid) = self.stalled.take() {
            let _ = signal("KILL", pid);
        }
    }

    /// Promotes the replica (`pg_ctl promote`) and waits until it accepts
    /// writes (`pg_is_in_recovery()` is false); returns how long that took.
    pub async fn promote(&mut self) -> Result<Duration, String> {
        let started = Instant::now();
        let run = Runner {
            bin: &self.bin,
            as_postgres: self.as_postgres,
        };
        let r = self.scratch.path().join("r");
        run.tool("pg_ctl", &["promote", "-D", path_str(&r)?, "-w", "-t", "60"])
            .await?;
        let deadline = Instant::now() + READY_WITHIN;
        loop {
            let mut conn = connect(self.replica_port).await?;
            let in_recovery: bool = sqlx::query_scalar("SELECT pg_is_in_recovery()")
                .fetch_one(&mut conn)
                .await
                .map_err(|e| format!("pg_is_in_recovery(): {e}"))?;
            if !in_recovery {
                return Ok(started.elapsed());
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "the replica is still in recovery {READY_WITHIN:?} after its promotion"
                ));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// A URL on loopback port `port`.
fn url(port: u16) -> String {
    format!("postgres://postgres@127.0.0.1:{port}/postgres")
}

/// One connection to the server on `port`.
async fn connect(port: u16) -> Result<PgConnection, String> {
    let options = PgConnectOptions::new()
        .host("127.0.0.1")
        .port(port)
        .username("postgres")
        .database("postgres");
    PgConnection::connect_with(&options)
        .await
        .map_err(|e| format!("connect to 127.0.0.1:{port}: {e}"))
}

/// Runs `sql`, which answers one LSN as text, on the server on `port`.
async fn lsn(port: u16, sql: &'static str) -> Result<u64, String> {
    let mut conn = connect(port).await?;
    let text: Option<String> = sqlx::query_scalar(sql)
        .fetch_one(&mut conn)
        .await
        .map_err(|e| format!("{sql}: {e}"))?;
    parse_lsn(&text.ok_or_else(|| format!("{sql}: no LSN"))?)
}

/// A path as UTF-8, for a command line.
fn path_str(path: &Path) -> Result<&str, String> {
    path.to_str().ok_or_else(|| format!("not UTF-8: {}", path.display()))
}

/// Runs PostgreSQL's binaries, as `postgres` when this process is root.
struct Runner<'a> {
    bin: &'a Path,
    as_postgres: bool,
}

impl Runner<'_> {
    /// A command running the binary `name`.
    fn command(&self, name: &str) -> Command {
        let program = self.bin.join(name);
        if self.as_postgres {
            let mut command = Command::new("setpriv");
            command
                .args(["--reuid=postgres", "--regid=postgres", "--init-groups", "--"])
                .arg(program);
            command
        } else {
            Command::new(program)
        }
    }

    /// Runs the tool `name` to its end; fails with its output if it fails.
    async fn tool(&self, name: &str, args: &[&str]) -> Result<(), String> {
        let mut command = tokio::process::Command::from(self.command(name));
        command.args(args).stdin(Stdio::null()).kill_on_drop(true);
        let out = command.output().await.map_err(|e| {
            format!(
                "cannot run {} (as postgres: {}): {e}",
                self.bin.join(name).display(),
                self.as_postgres
            )
        })?;
        if out.status.success() {
            Ok(())
        } else {
            Err(format!(
                "{name} {} failed ({}): {}{}",
                args.join(" "),
                out.status,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ))
        }
    }

    /// Starts the server of data directory `data` on `port`, its socket in
    /// `socket_dir` and its log in `log`, leading a process group of its own.
    fn server(
        &self,
        data: &Path,
        port: u16,
        socket_dir: &Path,
        settings: &[&str],
        log: &Path,
    ) -> Result<Server, String> {
        let log_file = std::fs::File::create(log).map_err(|e| format!("create {}: {e}", log.display()))?;
        let err_file = log_file.try_clone().map_err(|e| format!("{}: {e}", log.display()))?;
        let mut command = self.command("postgres");
        command
            .arg("-D")
            .arg(data)
            .args(["-p", &port.to_string(), "-k"])
            .arg(socket_dir)
            .args([
                "-c",
                "listen_addresses=127.0.0.1",
                "-c",
                "fsync=off",
                "-c",
                "max_connections=150",
            ]);
        for setting in settings {
            command.args(["-c", setting]);
        }
        command
            .stdin(Stdio::null())
            .stdout(log_file)
            .stderr(err_file)
            .process_group(0);
        let child = command
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", self.bin.join("postgres").display()))?;
        let pgid = child.id();
        Ok(Server {
            postmaster: Guarded::new(child),
            pgid,
        })
    }
}

/// Waits until `server` accepts connections on `port`; fails with its log
/// if it exits or takes too long.
async fn wait_ready(server: &mut Server, port: u16, log: &Path, what: &str) -> Result<(), String> {
    let deadline = Instant::now() + READY_WITHIN;
    loop {
        if server.postmaster.exited() {
            return Err(format!(
                "{what} exited at start:\n{}",
                std::fs::read_to_string(log).unwrap_or_default()
            ));
        }
        match connect(port).await {
            Ok(conn) => {
                let _ = conn.close().await;
                return Ok(());
            }
            Err(e) if Instant::now() >= deadline => {
                return Err(format!(
                    "{what} does not accept connections within {READY_WITHIN:?} ({e}):\n{}",
                    std::fs::read_to_string(log).unwrap_or_default()
                ));
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::parse_lsn;

    /// LSNs parse as PostgreSQL prints them.
    #[test]
    fn lsns_parse() {
        assert_eq!(parse_lsn("0/0"), Ok(0));
        assert_eq!(parse_lsn("16/B374D848"), Ok(0x16_B374_D848));
        assert!(parse_lsn("16B374D848").is_err());
    }
}
