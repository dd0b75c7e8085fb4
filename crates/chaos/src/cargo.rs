//! Builds a binary of this workspace from inside a test, as the harnesses
//! need (the ledger and `idem` with fault injection).
//!
//! Shared by source: `idem-client`'s and the ledger's tests include this
//! file with `#[path]`, so every such build in the workspace runs the same
//! way.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// The variables cargo sets for a test process: a build started with them
/// would see the test's package. Some build scripts track them (ring's
/// tracks `CARGO_MANIFEST_DIR`, `CARGO_PKG_NAME` and `OUT_DIR`), so a build
/// started from one package's tests ran that script again and rebuilt
/// everything above it (ring, rustls, sqlx, the workspace's crates), for
/// every package a test builds from, and once more for the workspace's next
/// build.
const TEST_PROCESS_PREFIXES: &[&str] = &[
    "OUT_DIR",
    "CARGO_MANIFEST_",
    "CARGO_PKG_",
    "CARGO_CRATE_",
    "CARGO_BIN_",
    "CARGO_TARGET_TMPDIR",
    "CARGO_PRIMARY_PACKAGE",
    "CARGO_RUSTC_CURRENT_DIR",
];

/// Runs `cargo build --message-format=json` with `args` in the workspace
/// (in release when the caller is a release build) and answers the
/// executable cargo reports for the binary `name`.
pub fn build_binary(args: &[&str], name: &str) -> Result<PathBuf, String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.current_dir(&root)
        .arg("build")
        .args(args)
        .arg("--message-format=json");
    if !cfg!(debug_assertions) {
        cmd.arg("--release");
    }
    for (var, _) in std::env::vars_os() {
        if var
            .to_str()
            .is_some_and(|v| TEST_PROCESS_PREFIXES.iter().any(|p| v.starts_with(p)))
        {
            cmd.env_remove(var);
        }
    }
    let out = cmd
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| format!("cargo did not run: {e}"))?;
    if !out.status.success() {
        return Err(format!("cargo build {} failed", args.join(" ")));
    }
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .filter(|v| v["reason"] == "compiler-artifact" && v["target"]["name"] == name)
        .filter_map(|v| v["executable"].as_str().map(PathBuf::from))
        .next_back()
        .ok_or_else(|| format!("cargo reported no {name} executable"))
}
