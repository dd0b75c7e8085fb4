//! Twins of one key in two real processes on one database file.
//!
//! The binary runs the scenarios, and re-executes itself with
//! `IDEM_SQLITE_CHILD` set to act as the other process. The two talk over
//! the child's standard input and output, one line at a time.

mod common;

use common::{TempDb, count_effects, migrated_with, write_effect};

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use idem_core::{
    Acquire, Call, Error, Fingerprint, IdempotencyKey, InFlight, LeaseEngine, Outcome, Policy, Scope, TxEngine,
};
use idem_sqlite::{SqliteOptions, SqliteStore};

/// Selects the child's role; its absence makes the binary the parent.
const CHILD_ENV: &str = "IDEM_SQLITE_CHILD";
const OPERATION: &str = "POST /v1/transfers";
/// Long enough that a twin stuck behind the database's write lock shows up
/// as a timeout of the test instead of an answer.
const BUSY_TIMEOUT_MS: u64 = 30_000;
/// The most any single answer the tests expect may take.
const GENEROUS: Duration = Duration::from_secs(15);
/// How many tasks each process runs on one key.
const TASKS: usize = 16;

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .expect("runtime");
    if let Ok(role) = std::env::var(CHILD_ENV) {
        runtime.block_on(child(&role));
        return;
    }
    let filter: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with('-')).collect();
    let mut ran = 0;
    for name in TESTS {
        if !filter.is_empty() && !filter.iter().any(|f| name.contains(f.as_str())) {
            continue;
        }
        let db = TempDb::new("proc");
        let started = Instant::now();
        runtime.block_on(run(name, db.path.clone()));
        ran += 1;
        println!("test {name} ... ok ({} ms)", started.elapsed().as_millis());
    }
    println!("test result: ok. {ran} passed");
}

/// The scenarios, run one after the other, each on a new file.
const TESTS: [&str; 5] = [
    "reject_twin_in_other_process_is_busy_then_replays",
    "wait_twin_in_other_process_keeps_to_its_bound",
    "killed_holder_releases_the_key",
    "many_tasks_in_two_processes_one_effect",
    "lease_twin_in_other_process_is_busy",
];

async fn run(name: &str, db: PathBuf) {
    match name {
        "reject_twin_in_other_process_is_busy_then_replays" => {
            reject_twin_in_other_process_is_busy_then_replays(db).await
        }
        "wait_twin_in_other_process_keeps_to_its_bound" => wait_twin_in_other_process_keeps_to_its_bound(db).await,
        "killed_holder_releases_the_key" => killed_holder_releases_the_key(db).await,
        "many_tasks_in_two_processes_one_effect" => many_tasks_in_two_processes_one_effect(db).await,
        "lease_twin_in_other_process_is_busy" => lease_twin_in_other_process_is_busy(db).await,
        other => panic!("unknown test {other}"),
    }
}

async fn open(path: &Path) -> SqliteStore {
    migrated_with(path, SqliteOptions::new().busy_timeout_ms(BUSY_TIMEOUT_MS)).await
}

fn call(tenant: &str, key: &str, in_flight: InFlight) -> Call {
    let scope = Scope::parse(tenant, OPERATION).expect("scope");
    let key = IdempotencyKey::new(key).expect("key");
    Call::new(scope.clone(), key, Fingerprint::of_bytes(scope.operation(), b"body"))
        .with_policy(Policy::default().with_in_flight(in_flight))
}

/// Runs the transactional work of every test: one effect row, answered
/// with `who`.
async fn execute(
    engine: &TxEngine<SqliteStore>,
    call: &Call,
    effect: &str,
    who: &str,
) -> Result<Outcome<String>, Error> {
    engine
        .execute(call, |tx| {
            let (effect, who) = (effect.to_owned(), who.to_owned());
            Box::pin(async move {
                write_effect(tx, &effect).await?;
                // Long enough for the twins of both processes to pile up.
                tokio::time::sleep(Duration::from_millis(20)).await;
                Ok::<_, Error>(who)
            })
        })
        .await
}

/// Runs `twin`'s transactional work as `B`, which must answer within
/// [`GENEROUS`] (`expect` says what a timeout means).
async fn execute_in_time(
    engine: &TxEngine<SqliteStore>,
    twin: &Call,
    effect: &str,
    expect: &str,
) -> Result<Outcome<String>, Error> {
    tokio::time::timeout(GENEROUS, execute(engine, twin, effect, "B"))
        .await
        .expect(expect)
}

fn assert_in_flight<T: std::fmt::Debug>(result: Result<T, Error>) {
    assert!(
        matches!(result, Err(Error::InFlight { .. })),
        "expected in flight, got {result:?}"
    );
}

/// A `Reject` twin of `key`, held by the other process, answered in flight
/// in time (`expect`: why it must be). Answers the twin's call.
async fn rejected_in_flight(engine: &TxEngine<SqliteStore>, tenant: &str, key: &str, expect: &str) -> Call {
    let twin = call(tenant, key, InFlight::Reject);
    assert_in_flight(execute_in_time(engine, &twin, key, expect).await);
    twin
}

/// The other process, driven line by line.
struct Peer {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Peer {
    fn spawn(role: &str, db: &Path, tenant: &str, key: &str) -> Self {
        let mut child = Command::new(std::env::current_exe().expect("own binary"))
            .env(CHILD_ENV, role)
            .env("IDEM_DB", db)
            .env("IDEM_TENANT", tenant)
            .env("IDEM_KEY", key)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn the other process");
        let stdin = child.stdin.take().expect("stdin");
        let stdout = BufReader::new(child.stdout.take().expect("stdout"));
        Self { child, stdin, stdout }
    }

    /// The next line the other process writes (read off the runtime).
    async fn line(&mut self) -> String {
        let mut line = String::new();
        tokio::task::block_in_place(|| self.stdout.read_line(&mut line)).expect("read from the other process");
        assert!(!line.is_empty(), "the other process ended early");
        line.trim_end().to_owned()
    }

    fn say(&mut self, line: &str) {
        writeln!(self.stdin, "{line}").expect("write to the other process");
        self.stdin.flush().expect("flush");
    }

    /// Tells a `hold-tx` process to commit, and waits for it to end well.
    async fn commit(mut self) {
        self.say("commit");
        assert_eq!(self.line().await, "committed");
        self.wait_ok();
    }

    fn wait_ok(mut self) {
        let status = self.child.wait().expect("wait for the other process");
        assert!(status.success(), "the other process failed: {status}");
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        // Only still running if a test failed half-way.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn unique_tenant() -> String {
    format!("tenant-{}", uuid::Uuid::new_v4().simple())
}

/// Opens `db`, and starts the other process as `role` on `key` of a tenant
/// of its own, once it says `ready`. Answers the store, the tenant and the
/// other process.
async fn with_peer(db: &Path, role: &str, key: &str, ready: &str) -> (SqliteStore, String, Peer) {
    let store = open(db).await;
    let tenant = unique_tenant();
    let mut peer = Peer::spawn(role, db, &tenant, key);
    assert_eq!(peer.line().await, ready);
    (store, tenant, peer)
}

/// The other process claims the key in a transaction and holds it open: a
/// `Reject` twin here is told at once that the key is in flight (not after
/// the busy timeout, not with a lock timeout), and after the holder commits,
/// the twin replays its outcome.
async fn reject_twin_in_other_process_is_busy_then_replays(db: PathBuf) {
    let (store, tenant, peer) = with_peer(&db, "hold-tx", "k-reject", "held").await;
    let engine = TxEngine::new(store.clone());

    let twin = rejected_in_flight(
        &engine,
        &tenant,
        "k-reject",
        "a Reject twin must answer at once, not wait on the database's write lock",
    )
    .await;

    peer.commit().await;
    let again = execute_in_time(&engine, &twin, "k-reject", "answer")
        .await
        .expect("replay");
    assert_eq!(again, Outcome::Replayed("A".to_owned()));
    assert_eq!(count_effects(&store, "k-reject").await, 1);
}

/// A `Wait { max_ms }` twin of a key held in another process waits about
/// its bound and then reports the key in flight.
async fn wait_twin_in_other_process_keeps_to_its_bound(db: PathBuf) {
    let (store, tenant, peer) = with_peer(&db, "hold-tx", "k-wait", "held").await;
    let engine = TxEngine::new(store.clone());

    let twin = call(&tenant, "k-wait", InFlight::Wait { max_ms: 300 });
    let started = Instant::now();
    let answer = execute_in_time(&engine, &twin, "k-wait", "a Wait twin must answer after its bound").await;
    let waited = started.elapsed();
    assert_in_flight(answer);
    assert!(
        waited >= Duration::from_millis(300),
        "answered before the bound: {waited:?}"
    );

    peer.commit().await;
    assert_eq!(count_effects(&store, "k-wait").await, 1);
}

/// A holder killed with SIGKILL never strands its key: the operating system
/// drops its locks, its open transaction never committed, and a twin
/// claims the key and runs the effect.
async fn killed_holder_releases_the_key(db: PathBuf) {
    let (store, tenant, mut peer) = with_peer(&db, "hold-tx", "k-kill", "held").await;
    let engine = TxEngine::new(store.clone());
    rejected_in_flight(&engine, &tenant, "k-kill", "a Reject twin must answer at once").await;

    peer.child.kill().expect("SIGKILL the holder");
    peer.child.wait().expect("reap the holder");
    let free = call(&tenant, "k-kill", InFlight::Wait { max_ms: 5_000 });
    let answer = execute_in_time(&engine, &free, "k-kill", "answer")
        .await
        .expect("the key is free again");
    assert_eq!(answer, Outcome::Executed("B".to_owned()));
    assert_eq!(count_effects(&store, "k-kill").await, 1);
}

/// Many tasks in each of two processes on one key: exactly one effect,
/// every other task replays it.
async fn many_tasks_in_two_processes_one_effect(db: PathBuf) {
    let (store, tenant, mut peer) = with_peer(&db, "hammer", "k-many", "ready").await;
    let engine = TxEngine::new(store.clone());
    peer.say("go");
    let executed = hammer(&engine, &tenant, "k-many", "B").await;
    let theirs: usize = peer.line().await.parse().expect("the other process's count");
    peer.wait_ok();
    assert_eq!(
        executed + theirs,
        1,
        "the work ran {executed} times here and {theirs} times there"
    );
    assert_eq!(count_effects(&store, "k-many").await, 1);
}

/// Runs [`TASKS`] twins at once; answers how many ran the work. Every twin
/// must succeed: waiting twins replay.
async fn hammer(engine: &TxEngine<SqliteStore>, tenant: &str, key: &str, who: &str) -> usize {
    let engine = Arc::new(engine.clone());
    let tasks: Vec<_> = (0..TASKS)
        .map(|_| {
            let (engine, tenant, key, who) = (engine.clone(), tenant.to_owned(), key.to_owned(), who.to_owned());
            tokio::spawn(async move {
                let twin = call(&tenant, &key, InFlight::Wait { max_ms: 20_000 });
                execute(&engine, &twin, &key, &who).await
            })
        })
        .collect();
    let mut executed = 0;
    for task in tasks {
        match task.await.expect("task") {
            Ok(Outcome::Executed(_)) => executed += 1,
            Ok(Outcome::Replayed(_)) => {}
            Err(e) => panic!("a twin failed: {e:?}"),
        }
    }
    executed
}

/// Lease mode: the other process holds a lease on the key; a `Reject` twin
/// here is told at once that the key is in flight.
async fn lease_twin_in_other_process_is_busy(db: PathBuf) {
    let (store, tenant, mut peer) = with_peer(&db, "hold-lease", "k-lease", "held").await;
    let engine = LeaseEngine::new(store.clone());
    let twin = call(&tenant, "k-lease", InFlight::Reject);
    let answer = tokio::time::timeout(GENEROUS, engine.acquire(&twin))
        .await
        .expect("a Reject twin must answer at once");
    assert_in_flight(answer.map(|_| ()));
    peer.say("done");
    peer.wait_ok();
}

/// The other process: `hold-tx` claims the key in a transaction, writes its
/// effect, says `held` and commits when told; `hold-lease` takes a lease and
/// holds it until told; `hammer` runs [`TASKS`] twins once told `go` and
/// writes how many ran the work.
async fn child(role: &str) {
    let db = PathBuf::from(std::env::var("IDEM_DB").expect("IDEM_DB"));
    let tenant = std::env::var("IDEM_TENANT").expect("IDEM_TENANT");
    let key = std::env::var("IDEM_KEY").expect("IDEM_KEY");
    let store = open(&db).await;
    let stdin = std::io::stdin();
    let read = move || {
        let mut line = String::new();
        tokio::task::block_in_place(|| stdin.lock().read_line(&mut line)).expect("read");
        line.trim_end().to_owned()
    };
    match role {
        "hold-tx" => {
            let engine = TxEngine::new(store);
            let mut read = Some(read);
            let answer = engine
                .execute(&call(&tenant, &key, InFlight::Reject), |tx| {
                    let effect = key.clone();
                    let read = read.take().expect("the work runs once");
                    Box::pin(async move {
                        write_effect(tx, &effect).await?;
                        println!("held");
                        assert_eq!(read(), "commit");
                        Ok::<_, Error>("A".to_owned())
                    })
                })
                .await
                .expect("hold and commit");
            assert_eq!(answer, Outcome::Executed("A".to_owned()));
            println!("committed");
        }
        "hold-lease" => {
            let engine = LeaseEngine::new(store);
            let Acquire::Claimed(_lease) = engine
                .acquire(&call(&tenant, &key, InFlight::Reject))
                .await
                .expect("lease")
            else {
                panic!("the key was free");
            };
            println!("held");
            assert_eq!(read(), "done");
        }
        "hammer" => {
            let engine = TxEngine::new(store);
            println!("ready");
            assert_eq!(read(), "go");
            println!("{}", hammer(&engine, &tenant, &key, "A").await);
        }
        other => panic!("unknown role {other}"),
    }
}
