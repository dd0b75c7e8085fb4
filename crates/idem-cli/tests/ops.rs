//! `idem ops list | show | mark | resume | cancel | hold | purge` on each SQL
//! store: operations written by the store as a service's runs leave them
//! (running, held on an unknown outcome with an open send, held failed or
//! exhausted, completed), listed by every filter, and driven by the real
//! `idem` binary; each change is checked on the row, and a refused one
//! writes nothing; a purge deletes only final operations past their expiry.
//! PostgreSQL and MariaDB get a database of their own. The end to
//! end run (an operation held on an unknown outcome, marked applied, then
//! finished once by the service's completer) is in `ops_completer.rs`.

mod support;

use std::time::Duration;

use idem_core::multistep::{
    HoldKind, JournalEntry, MultiStep, MultiStepState, MultiStepStore, NewMultiStep, StepKind, StepOutcome,
};
use idem_core::{Clock, Fingerprint, IdempotencyKey, Scope, SentUnder, SystemClock, TxBackend, Verdict};
use idem_gateway::AnyLease;
use support::{idem_out as idem, refused, tag};

const TENANT: &str = "ops-test";
const ROUTE: &str = "POST /v1/withdrawals";
const LEASE_MS: i64 = 30_000;

/// The operations of one store, as the test reads and writes them.
enum Ops {
    Sqlite(idem_sqlite::SqliteStore, idem_sqlite::SqliteMultiSteps),
    Postgres(idem_postgres::PgStore, idem_postgres::PgMultiSteps),
    MySql(idem_mysql::MySqlStore, idem_mysql::MySqlMultiSteps),
}

macro_rules! each {
    ($self:expr, $b:ident, $s:ident => $body:expr) => {
        match $self {
            Ops::Sqlite($b, $s) => $body,
            Ops::Postgres($b, $s) => $body,
            Ops::MySql($b, $s) => $body,
        }
    };
}

impl Ops {
    async fn open(url: &str) -> Self {
        Self::open_table(url, "idem_operations").await
    }

    /// The operations in `table`.
    async fn open_table(url: &str, table: &str) -> Self {
        let table = idem_core::TableName::new(table).unwrap();
        match AnyLease::open(url).await.unwrap() {
            AnyLease::Sqlite(s) => Self::Sqlite(
                s.clone(),
                idem_sqlite::SqliteMultiSteps::with_table(s.pool().clone(), table),
            ),
            AnyLease::Postgres(s) => Self::Postgres(
                s.clone(),
                idem_postgres::PgMultiSteps::with_table(s.pool().clone(), table),
            ),
            AnyLease::MySql(s) => Self::MySql(
                s.clone(),
                idem_mysql::MySqlMultiSteps::with_table(s.pool().clone(), table),
            ),
            AnyLease::Redis(_) => unreachable!(),
        }
    }

    /// The operation `id`, if it is still there.
    async fn find(&self, id: i64) -> Option<MultiStep> {
        each!(self, b, s => find_of(b, s, id).await)
    }

    /// Inserts `row` as a first step's transaction does: its id.
    async fn insert(&self, row: &MultiStep) -> i64 {
        each!(self, b, s => insert_of(b, s, row).await)
    }

    async fn get(&self, id: i64) -> MultiStep {
        each!(self, b, s => get_of(b, s, id).await)
    }

    async fn write(&self, row: &MultiStep) {
        each!(self, b, s => write_of(b, s, row).await)
    }

    /// Stores an operation started at `started` by its first runner (token
    /// 1), then changed by `change` as that runner's writes would: its id.
    async fn stored(&self, started: i64, change: impl FnOnce(&mut MultiStep)) -> i64 {
        let scope = Scope::parse(TENANT, ROUTE).unwrap();
        let new = NewMultiStep {
            fingerprint: Fingerprint::of_bytes(scope.operation(), b"{}"),
            scope,
            key: IdempotencyKey::new(format!("w-{}", tag())).unwrap(),
            definition: "withdrawal@1".into(),
            input: br#"{"amount":100}"#.to_vec(),
            ttl_ms: 86_400_000,
        };
        let row = MultiStep::created(&new, 1, started, LEASE_MS).unwrap();
        let id = self.insert(&row).await;
        let mut row = self.get(id).await;
        change(&mut row);
        self.write(&row).await;
        id
    }
}

/// Inserts `row` into `steps` in a transaction of `backend`: its id.
async fn insert_of<B: TxBackend, S: MultiStepStore<B>>(backend: &B, steps: &S, row: &MultiStep) -> i64 {
    let mut tx = backend.begin().await.unwrap();
    let id = steps.insert_in(&mut tx, row).await.unwrap().expect("a new operation");
    backend.commit(tx).await.unwrap();
    id
}

/// The operation `id` of `steps`, beside the backend `_backend`.
async fn get_of<B: TxBackend, S: MultiStepStore<B>>(_backend: &B, steps: &S, id: i64) -> MultiStep {
    steps.get(id).await.unwrap().expect("the operation is there")
}

/// The operation `id` of `steps` if it is there, beside the backend `_backend`.
async fn find_of<B: TxBackend, S: MultiStepStore<B>>(_backend: &B, steps: &S, id: i64) -> Option<MultiStep> {
    steps.get(id).await.unwrap()
}

/// Writes `row` to `steps`, beside the backend `_backend`.
async fn write_of<B: TxBackend, S: MultiStepStore<B>>(_backend: &B, steps: &S, row: &MultiStep) {
    steps.write(row).await.unwrap();
}

fn debit() -> JournalEntry {
    JournalEntry {
        name: "debit".into(),
        kind: StepKind::Local,
        undo: false,
        outcome: StepOutcome::Output(serde_json::json!({ "debited": 100 })),
        at_ms: 0,
    }
}

fn terms(settle: Duration) -> SentUnder {
    SentUnder {
        key_horizon: Duration::from_secs(86_400),
        horizon_margin: Duration::from_secs(3_600),
        settle,
    }
}

/// The ids an `idem ops list` run printed as JSON.
fn ids(v: &serde_json::Value) -> Vec<i64> {
    v.as_array()
        .unwrap_or_else(|| panic!("an array: {v}"))
        .iter()
        .map(|o| o["id"].as_i64().unwrap())
        .collect()
}

/// `idem ops <sub> --store <url> <rest…>`.
fn ops(url: &str, sub: &str, rest: &[&str]) -> (i32, serde_json::Value, String) {
    let args: Vec<&str> = ["ops", sub, "--store", url]
        .into_iter()
        .chain(rest.iter().copied())
        .collect();
    idem(&args)
}

async fn operator_commands(url: &str) {
    let sqlite = !url.contains("://");
    // No table yet: exit 3, and the way to make it (on SQLite, no file
    // yet either: reading commands never create one).
    let (code, _, out) = ops(url, "list", &[]);
    assert_eq!(code, 3, "{out}");
    if sqlite {
        assert!(out.contains("no such database file"), "{out}");
        assert!(!std::path::Path::new(url).exists(), "nothing created");
    }
    // `idem migrate --operations` creates it; a dry run applies nothing.
    let (code, v, out) = idem(&["migrate", "--store", url, "--operations", "--dry-run", "--json"]);
    assert_eq!((code, &v["applied"]), (0, &serde_json::json!(false)), "{out}");
    let (code, v, out) = idem(&["migrate", "--store", url, "--operations", "--json"]);
    assert_eq!((code, &v["applied"]), (0, &serde_json::json!(true)), "{out}");
    let (code, _, out) = idem(&["migrate", "--store", url, "--operations"]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("and the operations table are current"), "{out}");
    let (code, v, out) = ops(url, "list", &["--json"]);
    assert_eq!((code, v), (0, serde_json::json!([])), "{out}");
    let (code, _, out) = ops(url, "list", &["--table", "no_such_ops"]);
    assert_eq!(code, 3, "{out}");
    assert!(
        out.contains(
            "table no_such_ops does not exist; run `idem migrate --operations --operations-table no_such_ops`"
        ),
        "{out}"
    );

    let store = Ops::open(url).await;
    let now = SystemClock.now_ms();
    let hour_ago = now - 3_600_000;
    // Their first runs left them so; every lease has run out.
    let running = store
        .stored(hour_ago, |r| r.record(1, debit(), hour_ago + 1).unwrap())
        .await;
    let settled = store
        .stored(hour_ago + 10, |r| {
            r.record(1, debit(), hour_ago + 11).unwrap();
            r.mark_sent(1, "payout", hour_ago + 12, Some(terms(Duration::from_secs(35))))
                .unwrap();
            r.hold(1, HoldKind::Unknown, "timed out after the send", hour_ago + 13)
                .unwrap();
        })
        .await;
    let failed = store
        .stored(hour_ago + 20, |r| {
            r.record(1, debit(), hour_ago + 21).unwrap();
            r.hold(1, HoldKind::Failed, "broken contract", hour_ago + 22).unwrap();
        })
        .await;
    let exhausted = store
        .stored(hour_ago + 30, |r| {
            r.hold(
                1,
                HoldKind::Exhausted,
                "taken 21 times without finishing",
                hour_ago + 31,
            )
            .unwrap();
        })
        .await;
    // Sent a minute ago; the vendor's answers may arrive for an hour.
    let unknown = store
        .stored(now - 120_000, |r| {
            r.record(1, debit(), now - 119_000).unwrap();
            r.mark_sent(1, "payout", now - 60_000, Some(terms(Duration::from_secs(3_600))))
                .unwrap();
            r.hold(1, HoldKind::Unknown, "the answer was lost", now - 59_000)
                .unwrap();
        })
        .await;
    let completed = store
        .stored(now - 2_000, |r| {
            r.record(1, debit(), now - 1_500).unwrap();
            r.finish(1, br#"{"payout":"po_1"}"#.to_vec(), now - 1_000).unwrap();
        })
        .await;
    let every = [running, settled, failed, exhausted, unknown, completed];

    // Listing: the longest unchanged first, by every filter.
    let list = |rest: &[&str]| {
        let mut args = rest.to_vec();
        args.push("--json");
        let (code, v, out) = ops(url, "list", &args);
        assert_eq!(code, 0, "{out}");
        ids(&v)
    };
    assert_eq!(list(&[]), every);
    assert_eq!(list(&["--state", "held"]), [settled, failed, exhausted, unknown]);
    assert_eq!(
        list(&["--state", "completed", "--state", "running"]),
        [running, completed]
    );
    assert_eq!(list(&["--state", "held", "--step", "payout"]), [settled, unknown]);
    assert_eq!(list(&["--older-than", "5m"]), [running, settled, failed, exhausted]);
    assert_eq!(list(&["--recovery-point", "0"]), [exhausted]);
    assert_eq!(list(&["--tenant", TENANT, "--operation", ROUTE]), every);
    assert_eq!(list(&["--tenant", "nobody"]), [] as [i64; 0]);
    assert_eq!(list(&["--limit", "2"]), [running, settled]);
    let (code, v, out) = ops(url, "list", &["--state", "held", "--json"]);
    assert_eq!(code, 0, "{out}");
    let held = &v[3];
    assert_eq!(
        (
            held["state"].as_str(),
            held["recovery_point"].as_u64(),
            held["open_step"].as_str(),
            held["hold"]["kind"].as_str(),
            held["hold"]["note"].as_str(),
            held["definition"].as_str()
        ),
        (
            Some("held"),
            Some(1),
            Some("payout"),
            Some("unknown"),
            Some("the answer was lost"),
            Some("withdrawal@1")
        ),
        "{v}"
    );
    assert!(held["age_ms"].as_i64().unwrap() >= 59_000, "{v}");
    // As a table, a page at a time: a full page says where the next starts.
    let (code, _, out) = ops(url, "list", &["--limit", "2"]);
    assert_eq!(code, 0, "{out}");
    let second = store.get(settled).await;
    let after = format!("{}:{}", second.updated_at_ms, settled);
    assert!(out.contains(&format!("the next page: --after {after}")), "{out}");
    assert_eq!(list(&["--limit", "2", "--after", &after]), [failed, exhausted]);
    let (code, _, out) = ops(url, "list", &["--state", "held"]);
    assert_eq!(code, 0, "{out}");
    let line = out
        .lines()
        .find(|l| l.starts_with(&format!("{unknown}\t")))
        .unwrap_or_else(|| panic!("{out}"));
    for part in [
        TENANT,
        ROUTE,
        "withdrawal@1",
        "held (unknown)",
        "1 open:payout",
        "the answer was lost",
    ] {
        assert!(line.contains(part), "{part}: {line}");
    }
    assert!(out.contains("4 operation(s)"), "{out}");
    // Bad filters are refused before the store is read.
    for (bad, why) in [
        (&["--state", "stuck"][..], "invalid value"),
        (&["--older-than", "10 minutes"], "unit"),
        (&["--step", "undo:payout"], "step name"),
        (&["--tenant", ""], "--tenant is empty"),
        (&["--limit", "1001"], "1001"),
        (&["--after", "42"], "UPDATED_AT_MS:ID"),
    ] {
        let (code, _, out) = ops(url, "list", bad);
        assert_eq!(code, 2, "{bad:?}: {out}");
        assert!(out.contains(why), "{bad:?}: {out}");
    }

    // Show: the whole row.
    let (code, v, out) = ops(url, "show", &[&unknown.to_string(), "--json"]);
    assert_eq!(code, 0, "{out}");
    assert_eq!(
        (
            v["journal"][0]["name"].as_str(),
            v["journal"][0]["outcome"].as_str(),
            v["journal"][0]["value"]["debited"].as_i64(),
            v["open"]["step"].as_str(),
            v["open"]["sends"].as_u64(),
            v["open"]["sent_under"]["settle_secs"].as_f64(),
            v["input"].as_str()
        ),
        (
            Some("debit"),
            Some("output"),
            Some(100),
            Some("payout"),
            Some(1),
            Some(3_600.0),
            Some(r#"{"amount":100}"#)
        ),
        "{v}"
    );
    let (code, v, _) = ops(url, "show", &[&completed.to_string(), "--json"]);
    assert_eq!((code, v["response"].as_str()), (0, Some(r#"{"payout":"po_1"}"#)));

    // "Not applied" before the last send can have settled: refused, and
    // nothing written.
    let before = store.get(unknown).await;
    let (code, _, out) = ops(url, "mark", &[&unknown.to_string(), "--not-applied", "--by", "alice"]);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("may still arrive") && out.contains("nothing was changed"),
        "{out}"
    );
    assert_eq!(store.get(unknown).await, before, "nothing written");
    // Nor is an operation whose send may have been applied cancelled.
    let (code, _, out) = ops(url, "cancel", &[&unknown.to_string(), "--reason", "customer asked"]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("may have been applied"), "{out}");
    assert_eq!(store.get(unknown).await, before, "nothing written");
    // Nor resumed: only a verdict lets it go.
    let (code, _, out) = ops(url, "resume", &[&unknown.to_string()]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("give a verdict"), "{out}");
    assert_eq!(store.get(unknown).await, before, "nothing written");

    // Applied, with the vendor's record: it goes on, the answer kept for
    // the step to decide from; its former runner is fenced.
    let body = support::temp("ops", "payout.json");
    std::fs::write(&body, r#"{"id":"po_9","amount":100}"#).unwrap();
    let (code, v, out) = ops(
        url,
        "mark",
        &[
            &unknown.to_string(),
            "--applied",
            "--status",
            "201",
            "--body-file",
            &body,
            "--note",
            "seen on the vendor's dashboard",
            "--by",
            "alice",
            "--json",
        ],
    );
    assert_eq!(code, 0, "{out}");
    assert_eq!(v["state"], "running", "{v}");
    let after = store.get(unknown).await;
    assert_eq!(after.state, MultiStepState::Running);
    assert_eq!((after.version, after.token), (before.version + 1, before.token + 1));
    assert_eq!(after.hold, None);
    assert_eq!(
        after.open.as_ref().map(|o| o.step.as_str()),
        Some("payout"),
        "the runner records the step"
    );
    let verdict = after.verdict.clone().expect("a verdict");
    assert_eq!(
        (
            verdict.reconciliation.verdict,
            verdict.status,
            verdict.body.as_slice(),
            verdict.reconciliation.note.as_str()
        ),
        (
            Verdict::Applied,
            Some(201),
            &br#"{"id":"po_9","amount":100}"#[..],
            "alice: seen on the vendor's dashboard"
        )
    );
    assert!(after.is_due(SystemClock.now_ms()), "a completer may take it at once");
    // Once: a second verdict is refused, and so is cancelling it.
    let (code, _, out) = ops(url, "mark", &[&unknown.to_string(), "--applied", "--by", "bob"]);
    assert_eq!(code, 1, "{out}");
    let (code, _, out) = ops(url, "cancel", &[&unknown.to_string(), "--reason", "changed my mind"]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("may have been applied"), "{out}");
    assert_eq!(store.get(unknown).await, after, "nothing written");

    // Not applied, once the last send has settled: the send is forgotten
    // and the step sends afresh.
    let (code, _, out) = ops(
        url,
        "mark",
        &[
            &settled.to_string(),
            "--not-applied",
            "--note",
            "no such payout",
            "--by",
            "bob",
        ],
    );
    assert_eq!(code, 0, "{out}");
    let s = store.get(settled).await;
    assert_eq!(
        (s.state, s.open.clone(), s.hold.clone()),
        (MultiStepState::Running, None, None)
    );
    assert_eq!(s.verdict.map(|v| v.reconciliation.verdict), Some(Verdict::NotApplied));

    // Resume of a failed hold: running, under a new token.
    let before = store.get(failed).await;
    let (code, v, out) = ops(url, "resume", &[&failed.to_string(), "--json"]);
    assert_eq!(code, 0, "{out}");
    assert_eq!(v["next"].as_str().map(|n| n.starts_with("resumed")), Some(true), "{v}");
    let after = store.get(failed).await;
    assert_eq!((after.state, after.hold.clone()), (MultiStepState::Running, None));
    assert_ne!(after.token, before.token, "its former runner is fenced");
    assert_eq!(after.journal, before.journal, "from where it stopped");
    let (code, _, out) = ops(url, "resume", &[&failed.to_string()]);
    assert_eq!(code, 1, "only a held one resumes: {out}");
    assert!(out.contains("only a held operation resumes"), "{out}");

    // Cancel of a held operation with no open send: its compensation runs.
    let (code, _, out) = ops(url, "cancel", &[&exhausted.to_string(), "--reason", "customer asked"]);
    assert_eq!(code, 0, "{out}");
    let c = store.get(exhausted).await;
    assert_eq!(
        (c.state, c.failure.clone(), c.hold.clone()),
        (
            MultiStepState::Compensating,
            Some(serde_json::json!({ "cancelled": "customer asked" })),
            None
        )
    );
    assert!(c.is_due(SystemClock.now_ms()));
    let (code, _, out) = ops(url, "cancel", &[&completed.to_string(), "--reason", "late"]);
    assert_eq!(code, 1, "a completed one is not cancelled: {out}");

    // Hold, then resume: no runner takes it meanwhile.
    let (code, _, out) = ops(url, "hold", &[&running.to_string(), "--note", "looking into it"]);
    assert_eq!(code, 0, "{out}");
    let h = store.get(running).await;
    assert_eq!(
        (h.state, h.hold.as_ref().map(|h| (h.kind, h.note.as_str()))),
        (MultiStepState::Held, Some((HoldKind::Operator, "looking into it")))
    );
    assert!(!h.is_due(SystemClock.now_ms()));
    let (code, _, out) = ops(url, "resume", &[&running.to_string()]);
    assert_eq!(code, 0, "{out}");
    assert_eq!(store.get(running).await.state, MultiStepState::Running);

    // Mistakes: a clear error, a non-zero exit, nothing written.
    let (code, _, out) = ops(url, "show", &["987654321"]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("no operation 987654321 in idem_operations"), "{out}");
    let (code, v, _) = ops(url, "resume", &["987654321", "--json"]);
    assert_eq!((code, v["exit_code"].as_i64()), (1, Some(1)), "{v}");
    for bad in [
        &["show", "abc"][..],
        &["resume", "0"],
        &["hold", "1"],
        &["mark", "1", "--by", "x"],
    ] {
        let (code, _, out) = ops(url, bad[0], &bad[1..]);
        assert_eq!(code, 2, "{bad:?}: {out}");
    }
    let (code, _, out) = ops(url, "cancel", &[&running.to_string(), "--reason", " "]);
    assert_eq!(code, 2, "a blank reason: {out}");
    let (code, _, out) = ops(url, "mark", &[&running.to_string(), "--applied", "--by", " "]);
    assert_eq!(code, 2, "no operator named: {out}");
    let (code, _, out) = ops(
        url,
        "mark",
        &[
            &running.to_string(),
            "--applied",
            "--body-file",
            "/no/such/file",
            "--by",
            "x",
        ],
    );
    assert_eq!(code, 2, "{out}");
    assert_eq!(
        store.get(running).await.state,
        MultiStepState::Running,
        "nothing written"
    );
    let _ = std::fs::remove_file(&body);
}

/// Operators racing on one held operation: exactly one verdict is written,
/// every other run is refused (it changed meanwhile, or is no longer held)
/// and writes nothing.
async fn racing_operators(url: &str) {
    let store = Ops::open(url).await;
    let now = SystemClock.now_ms();
    let id = store
        .stored(now - 600_000, |r| {
            r.mark_sent(1, "payout", now - 500_000, Some(terms(Duration::from_secs(35))))
                .unwrap();
            r.hold(1, HoldKind::Unknown, "lost", now - 499_000).unwrap();
        })
        .await;
    let before = store.get(id).await;
    let children: Vec<_> = (0..6)
        .map(|i| {
            let verdict = if i % 2 == 0 { "--applied" } else { "--not-applied" };
            std::process::Command::new(env!("CARGO_BIN_EXE_idem"))
                .args(["ops", "mark", &id.to_string(), "--store", url, verdict])
                .args(["--by", &format!("operator-{i}")])
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .expect("idem runs")
        })
        .collect();
    let mut won = 0;
    for child in children {
        let out = child.wait_with_output().unwrap();
        let text = String::from_utf8_lossy(&out.stderr).into_owned();
        match out.status.code() {
            Some(0) => won += 1,
            Some(1) => assert!(
                text.contains("changed meanwhile") || text.contains("only an operation held on an unknown outcome"),
                "{text}"
            ),
            other => panic!("{other:?}: {text}"),
        }
    }
    assert_eq!(won, 1, "one verdict");
    let after = store.get(id).await;
    assert_eq!(after.version, before.version + 1, "written once");
    assert_eq!(after.state, MultiStepState::Running);
}

/// `idem ops purge` deletes the final operations past their expiry (by
/// `--older-than`, at most `--limit`, in batches until none is left) and
/// nothing else: not a final one before its expiry, nor a running, held or
/// compensating one whatever its times. On a table of its own, so the
/// counts are exact.
async fn purging(url: &str) {
    const TABLE: &str = "ops_purge";
    let purge = |rest: &[&str]| {
        let mut args = vec!["--table", TABLE];
        args.extend_from_slice(rest);
        ops(url, "purge", &args)
    };
    let (code, v, out) = purge(&["--json"]);
    assert_eq!((code, v["exit_code"].as_i64()), (3, Some(3)), "no table yet: {out}");
    assert!(out.contains("table ops_purge does not exist"), "{out}");
    let (code, _, out) = idem(&["migrate", "--store", url, "--operations", "--operations-table", TABLE]);
    assert_eq!(code, 0, "{out}");

    let store = Ops::open_table(url, TABLE).await;
    let now = SystemClock.now_ms();
    let (day, hour) = (86_400_000, 3_600_000);
    // Kept a day (the rows' TTL) after they ended ten days ago: expired
    // nine days ago.
    let long_ago = now - 10 * day;
    let finished = |at: i64| move |r: &mut MultiStep| r.finish(1, br#"{"payout":"po_1"}"#.to_vec(), at).unwrap();
    let mut expired = Vec::new();
    for i in 0..3 {
        expired.push(store.stored(long_ago + i, finished(long_ago + 10 + i)).await);
    }
    expired.push(
        store
            .stored(long_ago + 20, |r| {
                r.record(1, debit(), long_ago + 21).unwrap();
                r.fail(1, serde_json::json!({ "declined": true }), long_ago + 22)
                    .unwrap();
                r.finish(1, br#"{"declined":true}"#.to_vec(), long_ago + 23).unwrap();
            })
            .await,
    );
    assert_eq!(store.get(expired[3]).await.state, MultiStepState::Compensated);
    // Expired an hour ago.
    let lately = store.stored(now - day - hour - 10, finished(now - day - hour)).await;
    // Ended a second ago: kept until tomorrow.
    let recent = store.stored(now - 2_000, finished(now - 1_000)).await;
    // Not final, each with an expiry (and a change) ten days old.
    let very_old = |change: Box<dyn FnOnce(&mut MultiStep)>| {
        move |r: &mut MultiStep| {
            change(r);
            r.expires_at_ms = Some(long_ago);
            r.updated_at_ms = long_ago;
        }
    };
    let running = store
        .stored(
            long_ago,
            very_old(Box::new(|r| r.record(1, debit(), long_ago).unwrap())),
        )
        .await;
    let held = store
        .stored(
            long_ago,
            very_old(Box::new(|r| r.hold(1, HoldKind::Failed, "broken", long_ago).unwrap())),
        )
        .await;
    let compensating = store
        .stored(
            long_ago,
            very_old(Box::new(|r| {
                r.fail(1, serde_json::json!("over the limit"), long_ago).unwrap()
            })),
        )
        .await;
    let mut kept = Vec::new();
    for id in [recent, running, held, compensating] {
        kept.push(store.get(id).await);
    }
    assert_eq!(
        kept.iter().map(|r| r.state).collect::<Vec<_>>(),
        [
            MultiStepState::Completed,
            MultiStepState::Running,
            MultiStepState::Held,
            MultiStepState::Compensating
        ]
    );

    // At most --limit, in one batch.
    let (code, v, out) = purge(&["--limit", "2", "--json"]);
    assert_eq!(code, 0, "{out}");
    assert_eq!(
        (v["deleted"].as_u64(), v["table"].as_str()),
        (Some(2), Some(TABLE)),
        "{v}"
    );
    // Expired at least two hours ago: the other two of ten days ago, not
    // the one of an hour ago.
    let (code, v, out) = purge(&["--older-than", "2h", "--json"]);
    assert_eq!(code, 0, "{out}");
    assert_eq!(v["deleted"].as_u64(), Some(2), "{v}");
    for id in &expired {
        assert_eq!(store.find(*id).await, None, "{id} purged");
    }
    assert!(
        store.find(lately).await.is_some(),
        "expired too lately for --older-than 2h"
    );
    // Every expired one (--older-than now, the default).
    let (code, _, out) = purge(&[]);
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("ops_purge: 1 final operation(s) past their expiry deleted"),
        "{out}"
    );
    assert_eq!(store.find(lately).await, None);
    let (code, v, out) = purge(&["--older-than", "now", "--json"]);
    assert_eq!(
        (code, v["deleted"].as_u64(), v["batches"].as_u64()),
        (0, Some(0), Some(1)),
        "{out}"
    );
    for row in &kept {
        assert_eq!(
            store.find(row.id).await.as_ref(),
            Some(row),
            "a {} operation is kept, unchanged",
            row.state.as_str()
        );
    }

    // Bad flags: exit 2, nothing deleted.
    for (bad, why) in [
        (&["--older-than", "soon"][..], "or now"),
        (&["--older-than", "10 minutes"], "or now"),
        (&["--limit", "0"], "0"),
    ] {
        let (code, _, out) = purge(bad);
        assert_eq!(code, 2, "{bad:?}: {out}");
        assert!(out.contains(why), "{bad:?}: {out}");
    }
    assert!(store.find(recent).await.is_some());
}

/// The operator commands, racing operators and purging, on the store at
/// `url`.
async fn every_scenario(url: &str) {
    operator_commands(url).await;
    racing_operators(url).await;
    purging(url).await;
}

support::on_each_sql_store!("idem_cli_ops", every_scenario);

#[test]
fn redis_keeps_no_operations() {
    let no_operations = "Redis keeps no multi-step operations";
    refused(&["ops", "list", "--store", "redis://127.0.0.1:6379/15"], no_operations);
    refused(
        &["migrate", "--store", "redis://127.0.0.1:6379/15", "--operations"],
        no_operations,
    );
    let (code, _, out) = idem(&["ops", "list", "--store", "/tmp/x.db", "--table", "bad name"]);
    assert_eq!(code, 2, "{out}");
}
