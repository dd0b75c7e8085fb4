//! The statement-level PostgreSQL scripts of `crates/idem-bench/pgbench`
//! (docs/benchmarks.md), as `scripts.sh` writes them: each runs, `store.sql`
//! holds the statements the store really sends, so its figures stay the
//! store's as the store changes, and each variant is its base with its one
//! part changed.
//!
//! Needs PostgreSQL (`IDEM_TEST_POSTGRES_URL`, default
//! `postgres://postgres@127.0.0.1:5432/test`) and its `pgbench` and `psql`.

use std::path::{Path, PathBuf};
use std::process::Command;

use idem_core::{Call, Fingerprint, IdempotencyKey, Scope, TableName, TxEngine};
use idem_postgres::PgStore;

fn url() -> String {
    idem_conformance::env::postgres_url()
}

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("pgbench")
}

/// Every script, as `scripts.sh` writes them, in a folder of `test`'s own.
fn scripts(test: &str) -> PathBuf {
    let out = std::env::temp_dir().join(format!("idem-pgbench-{}-{test}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    run("bash", &["scripts.sh", out.to_str().unwrap()]);
    out
}

fn run(program: &str, args: &[&str]) -> String {
    let out = Command::new(program)
        .args(args)
        .current_dir(dir())
        .output()
        .unwrap_or_else(|e| panic!("{program} (PostgreSQL's client tools are needed): {e}"));
    assert!(out.status.success(), "{program} {args:?}: {out:?}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The scripts share tables of their own (`setup.sql`), so they run one
/// after another in one test.
#[test]
fn every_script_runs_and_store_sql_commits_its_records() {
    let url = url();
    let folder = scripts("runs");
    let scripts: Vec<String> = std::fs::read_dir(&folder)
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| n.ends_with(".sql"))
        .collect();
    assert_eq!(scripts.len(), 13, "{scripts:?}");
    for script in &scripts {
        run("psql", &["-q", &url, "-f", "setup.sql"]);
        let path = folder.join(script);
        let out = run(
            "pgbench",
            &[
                "-n",
                "-M",
                "prepared",
                "-c",
                "1",
                "-t",
                "3",
                "-f",
                path.to_str().unwrap(),
                &url,
            ],
        );
        assert!(
            out.contains("number of transactions actually processed: 3/3"),
            "{script}: {out}"
        );
        assert!(!out.contains("number of failed transactions: 1"), "{script}: {out}");
        if script.starts_with("store") {
            // Three keys claimed and recorded, three business rows.
            let counts = run(
                "psql",
                &[
                    "-Atq",
                    &url,
                    "-c",
                    "SELECT (SELECT count(*) FROM pgb_keys WHERE status = 1) || ' ' || (SELECT count(*) FROM pgb_effects)",
                ],
            );
            assert_eq!(counts.trim(), "3 3", "{script}");
        }
    }
    run(
        "psql",
        &[
            "-q",
            &url,
            "-c",
            "DROP TABLE IF EXISTS pgb_keys, pgb_keys_noexp, pgb_keys_brin, pgb_effects",
        ],
    );
    std::fs::remove_dir_all(folder).unwrap();
}

/// `$n` parameters of `sql` replaced by `values[n - 1]`.
fn bind(sql: &str, values: &[&str]) -> String {
    let mut out = String::new();
    let mut rest = sql;
    while let Some(at) = rest.find('$') {
        out.push_str(&rest[..at]);
        let digits: String = rest[at + 1..].chars().take_while(char::is_ascii_digit).collect();
        let n: usize = digits.parse().unwrap_or_else(|_| panic!("a bare $ in {sql}"));
        out.push_str(values[n - 1]);
        rest = &rest[at + 1 + digits.len()..];
    }
    out + rest
}

/// The claim and the record in `store.sql` are the store's prepared
/// statements (read back from `pg_prepared_statements` after a fresh call),
/// with its parameters written as the script's values.
#[tokio::test]
async fn store_sql_holds_the_statements_the_store_sends() {
    let table = format!("pgb_probe_{}", std::process::id());
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(&url())
        .await
        .expect("PostgreSQL at IDEM_TEST_POSTGRES_URL");
    let store = PgStore::new(pool.clone()).with_table(TableName::new(table.as_str()).unwrap());
    store.migrate().await.unwrap();
    let engine = TxEngine::new(store);
    let scope = Scope::parse("t", "POST /bench").unwrap();
    let fingerprint = Fingerprint::of_json(scope.operation(), b"{}").unwrap();
    let call = Call::new(scope, IdempotencyKey::new("probe-1").unwrap(), fingerprint);
    engine
        .execute(&call, |_tx| Box::pin(async { Ok::<i64, idem_core::Error>(1) }))
        .await
        .unwrap();
    let prepared: Vec<(String, String)> = sqlx::query_as("SELECT name, statement FROM pg_prepared_statements")
        .fetch_all(&pool)
        .await
        .unwrap();
    // The table's name is this test's own (digits and letters only).
    sqlx::query(sqlx::AssertSqlSafe(format!("DROP TABLE {table}, {table}_schema")))
        .execute(&pool)
        .await
        .unwrap();
    // The store prepares its statements in the text of the first request that
    // needs them (`PREPARE a …; PREPARE b …; BEGIN; EXECUTE a(…)`), which is
    // what the view shows for each; its statements hold no semicolon.
    let statement = |prefix: &str| {
        let (name, text) = prepared
            .iter()
            .find(|(name, _)| name.starts_with(prefix))
            .unwrap_or_else(|| panic!("no {prefix}… among {prepared:?}"));
        let own = &text[text.find(&format!("PREPARE {name} (")).expect("its PREPARE")..];
        let own = own.split(';').next().unwrap();
        own[own.find(" AS ").expect("PREPARE … AS …") + 4..].replace(&table, "pgb_keys")
    };
    let key = ":client_id || '-' || :a || '-' || :b";
    let fingerprint = "'\\xabababababababababababababababababababababababababababababababab'::bytea";
    let first = bind(
        &statement("idem_first_"),
        &[
            "'t'",
            "'POST /bench'",
            key,
            fingerprint,
            "1::bigint",
            "1::bigint",
            "9000000000000000::bigint",
            "NULL::bigint",
            "'5000'",
        ],
    );
    let look = bind(&statement("idem_look_"), &["'t'", "'POST /bench'", key, "1::bigint"]);
    let record = bind(
        &statement("idem_record_"),
        &[
            "1::smallint",
            "'\\x7b226f6b223a747275657d'::bytea",
            "'t'",
            "'POST /bench'",
            key,
        ],
    );
    let script = std::fs::read_to_string(dir().join("store.sql")).unwrap();
    let lines: Vec<&str> = script.lines().collect();
    for (what, statement) in [("first insert", &first), ("look", &look), ("record", &record)] {
        assert!(
            lines.contains(&format!("{statement};").as_str()),
            "store.sql's {what} is not the store's; the store's, as the script writes it:\n{statement};"
        );
    }
}

/// A script of `folder`'s statements: its lines from the first `\set` on
/// (the comment at its head says what it is, and differs between scripts).
fn body(folder: &Path, script: &str) -> Vec<String> {
    let text = std::fs::read_to_string(folder.join(script)).unwrap();
    let lines: Vec<String> = text.lines().map(str::to_owned).collect();
    let start = lines.iter().position(|l| l.starts_with("\\set")).expect("a \\set line");
    lines[start..].to_vec()
}

/// The line of `lines` that starts with `prefix`: there must be exactly one.
fn line_starting<'a>(lines: &'a [String], prefix: &str) -> &'a str {
    let found: Vec<&String> = lines.iter().filter(|l| l.starts_with(prefix)).collect();
    assert_eq!(found.len(), 1, "one line starting {prefix:?} in {lines:?}");
    found[0]
}

/// Each variant `scripts.sh` writes is its base with its one part changed,
/// so the variants of `store.sql` follow the store's statements as
/// `store.sql` does (which the test above holds to the store).
#[test]
fn every_variant_differs_from_its_base_in_its_one_part() {
    let folder = scripts("variants");
    let body = |script: &str| body(&folder, script);
    let store = body("store.sql");
    let paired = body("paired.sql");
    let first = line_starting(&store, "INSERT INTO pgb_keys").to_owned();
    let look = line_starting(&store, "SELECT NULL::bigint").to_owned();
    let record = line_starting(&store, "WITH done").to_owned();
    // `store` with each line of `changes` replaced by its new text, or left
    // out where that is empty.
    let with = |changes: &[(&str, &str)]| -> Vec<String> {
        store
            .iter()
            .filter_map(|l| match changes.iter().find(|(from, _)| l == from) {
                Some((_, "")) => None,
                Some((_, to)) => Some((*to).to_owned()),
                None => Some(l.clone()),
            })
            .collect()
    };

    let plain_update = line_starting(&paired, "UPDATE pgb_keys");
    assert_eq!(body("store-plainrecord.sql"), with(&[(&record, plain_update)]));
    let plain_upsert = line_starting(&paired, "INSERT INTO pgb_keys");
    assert_eq!(
        body("store-plainclaim.sql"),
        with(&[(&first, plain_upsert), (&look, "")])
    );

    // Without the wait bound: the subqueries that save and set lock_timeout
    // go, the one that restores it becomes a constant, and nothing else
    // changes.
    let save_and_set = " FROM (SELECT set_config('lock_timeout', '5000', true) AS bounded FROM (SELECT \
        set_config('idem.saved_lock_timeout', current_setting('lock_timeout'), true) AS saved OFFSET 0) AS saved \
        OFFSET 0) AS bounded";
    let restore = "(SELECT set_config('lock_timeout', current_setting('idem.saved_lock_timeout'), true) AS restored)";
    assert!(
        first.contains(save_and_set) && look.contains(restore),
        "{first}\n{look}"
    );
    let unbounded_first = first.replace(save_and_set, "");
    let unbounded_look = look.replace(restore, "(SELECT '' AS restored)");
    assert_eq!(
        body("store-nolt.sql"),
        with(&[(&first, &unbounded_first), (&look, &unbounded_look)])
    );

    // The general claim is written by hand; everything around it is the
    // store's.
    let general = body("store-general.sql");
    let general_claim = line_starting(&general, "WITH saved").to_owned();
    assert_eq!(general, with(&[(&first, &general_claim), (&look, "")]));

    // The same script on another keys table of setup.sql.
    let on = |base: &str, table: &str| -> Vec<String> {
        body(base)
            .iter()
            .map(|l| l.replace("pgb_keys ", &format!("{table} ")))
            .collect()
    };
    assert_eq!(body("paired-noexp.sql"), on("paired.sql", "pgb_keys_noexp"));
    assert_eq!(body("onewrite-noexp.sql"), on("onewrite.sql", "pgb_keys_noexp"));
    assert_eq!(body("onewrite-brin.sql"), on("onewrite.sql", "pgb_keys_brin"));
    assert!(
        body("onewrite-brin.sql")
            .iter()
            .any(|l| l.contains("INSERT INTO pgb_keys_brin "))
    );
    std::fs::remove_dir_all(folder).unwrap();
}

/// The option lists `run.sh` and `cpu.sh` run by default name only scripts
/// `scripts.sh` writes (a name left behind when a variant goes would make
/// `run.sh` stop at it).
#[test]
fn the_default_option_lists_name_scripts_that_exist() {
    let folder = scripts("lists");
    let read = |file: &str| std::fs::read_to_string(dir().join(file)).unwrap();
    let run_sh = read("run.sh");
    let (_, after) = run_sh
        .split_once("${OPTIONS:-")
        .expect("run.sh reads its option list from OPTIONS, with a default");
    let run_list = after.split_once('}').expect("the default ends with }").0;
    let cpu_sh = read("cpu.sh");
    let (_, after) = cpu_sh
        .split_once("|| options=(")
        .expect("cpu.sh has a default option list");
    let cpu_list = after.split_once(')').expect("the list ends with )").0;
    for (file, list) in [("run.sh", run_list), ("cpu.sh", cpu_list)] {
        let names: Vec<&str> = list.split_whitespace().collect();
        assert!(names.len() >= 4, "{file}: {names:?}");
        for name in names {
            assert!(
                folder.join(format!("{name}.sql")).is_file(),
                "{file} runs {name}, which scripts.sh does not write"
            );
        }
    }
    std::fs::remove_dir_all(&folder).unwrap();
}
