//! Finds or builds a binary of this workspace from inside a test, as the
//! harnesses need (the ledger and `idem` with fault injection).
//!
//! A test started by `cargo test` first asks for the binary that build made
//! ([`from_running_test_build`]): the same command again with `--no-run`,
//! every unit already fresh, so nothing compiles. The ledger's and
//! `idem-cli`'s test builds carry the fault points (their dev-dependencies
//! turn `fault-injection` on; the points stay off unless a harness's
//! environment sets them), so that binary is the harness's. A build of its
//! own ([`build_binary`]) resolves the dependencies' features for the one
//! package and compiles much of the dependency graph again, so it is the
//! fallback: for a test run whose build has no such binary (`cargo test -p
//! chaos`), or a process cargo did not start as a test.
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
    let mut cmd = cargo_command(&root);
    cmd.arg("build").args(args).arg("--message-format=json");
    if !cfg!(debug_assertions) {
        cmd.arg("--release");
    }
    let out = cmd
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| format!("cargo did not run: {e}"))?;
    if !out.status.success() {
        return Err(format!("cargo build {} failed", args.join(" ")));
    }
    binary_in(&out.stdout, name).ok_or_else(|| format!("cargo reported no {name} executable"))
}

/// The ledger with `fault-injection`: the running `cargo test`'s, or a
/// build of its own.
pub fn fault_injection_ledger() -> Result<PathBuf, String> {
    match from_running_test_build("ledger") {
        Some(built) => Ok(built),
        None => build_binary(&["-p", "ledger", "--features", "fault-injection"], "ledger"),
    }
}

/// The binary `name` as built by the `cargo test` that started this
/// process, if its build has one: that command again (read from the parent
/// process, in the parent's directory, up to any `--`) with `--no-run`,
/// once per process. Every unit of it is fresh, so cargo compiles nothing
/// and reports the executables. `None` where the parent is not `cargo …
/// test`, the command fails, or its build has no binary `name`.
pub fn from_running_test_build(name: &str) -> Option<PathBuf> {
    static MESSAGES: std::sync::OnceLock<Option<Vec<u8>>> = std::sync::OnceLock::new();
    binary_in(MESSAGES.get_or_init(running_test_build_messages).as_deref()?, name)
}

/// Cargo's JSON messages for the running `cargo test`'s build, run again
/// with `--no-run`.
fn running_test_build_messages() -> Option<Vec<u8>> {
    let parent = std::os::unix::process::parent_id();
    let cmdline = std::fs::read(format!("/proc/{parent}/cmdline")).ok()?;
    let cwd = std::fs::read_link(format!("/proc/{parent}/cwd")).ok()?;
    let args: Vec<String> = cmdline
        .split(|b| *b == 0)
        .filter(|a| !a.is_empty())
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect();
    let args = test_command_args(&args)?;
    let out = cargo_command(&cwd)
        .args(args)
        .args(["--no-run", "--message-format=json"])
        .stderr(Stdio::null())
        .output()
        .ok()?;
    out.status.success().then_some(out.stdout)
}

/// The arguments of a `cargo test` command line (program first) to run it
/// again: from `test` up to any `--`, without a message format of its own.
/// `None` unless the program is cargo and its first argument that is not a
/// flag or a toolchain is `test`.
fn test_command_args(args: &[String]) -> Option<&[String]> {
    let program = Path::new(args.first()?).file_name()?.to_str()?;
    if program != "cargo" {
        return None;
    }
    let start = 1 + args[1..]
        .iter()
        .position(|a| !a.starts_with('-') && !a.starts_with('+'))?;
    if args[start] != "test" {
        return None;
    }
    let end = start
        + args[start..]
            .iter()
            .position(|a| a == "--")
            .unwrap_or(args.len() - start);
    let args = &args[start..end];
    (!args
        .iter()
        .any(|a| a.starts_with("--message-format") || a == "--no-run"))
    .then_some(args)
}

/// Cargo, in `dir`, without the variables cargo sets for a test process.
fn cargo_command(dir: &Path) -> Command {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.current_dir(dir);
    for (var, _) in std::env::vars_os() {
        if var
            .to_str()
            .is_some_and(|v| TEST_PROCESS_PREFIXES.iter().any(|p| v.starts_with(p)))
        {
            cmd.env_remove(var);
        }
    }
    cmd
}

/// The executable of the binary target `name` among cargo's JSON messages
/// (not a test harness of the same name).
fn binary_in(messages: &[u8], name: &str) -> Option<PathBuf> {
    String::from_utf8_lossy(messages)
        .lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .filter(|v| {
            v["reason"] == "compiler-artifact"
                && v["target"]["name"] == name
                && v["target"]["kind"]
                    .as_array()
                    .is_some_and(|k| k.iter().any(|k| k == "bin"))
                && v["profile"]["test"] == false
        })
        .filter_map(|v| v["executable"].as_str().map(PathBuf::from))
        .next_back()
}

#[cfg(test)]
mod tests {
    use super::test_command_args;

    fn args(line: &str) -> Vec<String> {
        line.split(' ').map(str::to_owned).collect()
    }

    #[test]
    fn a_cargo_test_command_is_read_up_to_its_separator() {
        let cases: [(&str, Option<&str>); 8] = [
            ("cargo test --workspace", Some("test --workspace")),
            (
                "/opt/bin/cargo test --workspace -- --nocapture",
                Some("test --workspace"),
            ),
            (
                "cargo test -p chaos --test harness sqlite",
                Some("test -p chaos --test harness sqlite"),
            ),
            ("cargo run --release -p chaos -- --ops 5", None),
            ("cargo test --workspace --message-format=short", None),
            ("cargo test --no-run", None),
            ("cargo-nextest test --workspace", None),
            ("cargo --locked", None),
        ];
        for (line, want) in cases {
            let args = args(line);
            let got = test_command_args(&args).map(|a| a.join(" "));
            assert_eq!(got.as_deref(), want, "{line}");
        }
    }
}
