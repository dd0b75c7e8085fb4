//! The OpenAPI document: served, complete, and honoured by the service under
//! schema-driven fuzzing (schemathesis, all checks, stateful links).

mod common;

use common::{Engine, Instance, database_url, remove_sqlite_files};

#[tokio::test]
async fn the_document_lists_every_route() {
    let url = database_url(Engine::Sqlite);
    let ledger = Instance::start(&url);
    let doc: serde_json::Value = idem_tls::test_pki::get(format!("{}/openapi.json", ledger.base))
        .await
        .expect("served")
        .json()
        .await
        .expect("json");
    assert!(doc["openapi"].as_str().is_some_and(|v| v.starts_with("3.")));
    let paths = doc["paths"].as_object().expect("paths");
    for (path, method) in [
        ("/v1/accounts", "post"),
        ("/v1/accounts/{id}", "get"),
        ("/v1/top-ups", "post"),
        ("/v1/transfers", "post"),
        ("/v1/audit", "get"),
        ("/v1/withdrawals", "post"),
        ("/v1/withdrawals/{id}", "get"),
    ] {
        let op = &paths[path][method];
        assert!(op.is_object(), "{method} {path} is documented");
        let responses = op["responses"].as_object().expect("responses");
        assert!(responses.contains_key("401"), "{method} {path} documents 401");
        for (status, response) in responses {
            if !status.starts_with('2') {
                assert!(
                    response["content"]["application/problem+json"].is_object(),
                    "{method} {path} {status} is a problem"
                );
            }
        }
    }
    let link = &paths["/v1/accounts"]["post"]["responses"]["201"]["links"]["GetAccount"];
    assert_eq!(
        link["operationId"], "getAccount",
        "links use the specification's field names"
    );
    let link = &paths["/v1/withdrawals"]["post"]["responses"]["201"]["links"]["GetWithdrawal"];
    assert_eq!(link["operationId"], "getWithdrawal");
    for schema in [
        "NewAccount",
        "NewTopUp",
        "NewTransfer",
        "Account",
        "Audit",
        "Problem",
        "NewWithdrawal",
        "Withdrawn",
        "Withdrawal",
    ] {
        assert!(doc["components"]["schemas"][schema].is_object(), "{schema}");
    }
    drop(ledger);
    remove_sqlite_files(&url);
}

/// The schemathesis release the fuzz test runs.
const SCHEMATHESIS: &str = "schemathesis==4.32.5";

/// The `schemathesis` on the `PATH`, or else one installed from PyPI into
/// this test's own directory (once), so the suite needs nothing installed
/// beforehand but Python and pip.
fn schemathesis() -> std::process::Command {
    let on_path = std::process::Command::new("schemathesis")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if on_path {
        return std::process::Command::new("schemathesis");
    }
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("schemathesis-4.32.5");
    let marker = dir.join(".installed");
    if !marker.exists() {
        let installed = std::process::Command::new("python3")
            .args([
                "-m",
                "pip",
                "install",
                "--quiet",
                "--disable-pip-version-check",
                "--target",
            ])
            .arg(&dir)
            .arg(SCHEMATHESIS)
            .status()
            .unwrap_or_else(|e| panic!("schemathesis is not installed and python3 did not start ({e})"));
        assert!(
            installed.success(),
            "schemathesis is not installed and `python3 -m pip install --target {} {SCHEMATHESIS}` failed",
            dir.display()
        );
        std::fs::write(&marker, SCHEMATHESIS).expect("the schemathesis directory is writable");
    }
    let mut command = std::process::Command::new("python3");
    command.args(["-m", "schemathesis.cli"]).env("PYTHONPATH", &dir);
    command
}

/// A short schemathesis run: every check, the stateful phase included. The
/// long run is a documented command (README, "OpenAPI and fuzzing").
#[test]
fn schemathesis_finds_nothing() {
    let url = database_url(Engine::Sqlite);
    // Withdrawals and payouts go to a fake vendor of the test's own.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let (vendor, _vendor) = runtime
        .block_on(fake_vendor::start(fake_vendor::Options::default(), None))
        .expect("the fake vendor starts");
    let ledger = Instance::start_with(
        &url,
        &[
            "--token",
            "fuzz-token",
            "--webhook-secret",
            ledger::api::DEMO_WEBHOOK_SECRET,
            "--vendor-url",
            &vendor,
            "--fx-url",
            &vendor,
        ],
    );
    let output = schemathesis()
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .args(["run", &format!("{}/openapi.json", ledger.base)])
        .args(["-H", "Authorization: Bearer fuzz-token"])
        .args([
            "--checks",
            "all",
            "--max-examples",
            "25",
            "--workers",
            "1",
            "--seed",
            "1",
        ])
        .env("NO_COLOR", "1")
        .output()
        .unwrap_or_else(|e| panic!("schemathesis did not start ({e}): python3 -m pip install {SCHEMATHESIS}"));
    drop(ledger);
    remove_sqlite_files(&url);
    let report = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "schemathesis found failures:\n{report}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(report.contains("Stateful"), "the stateful phase ran:\n{report}");
}
