//! Logs written to a pipe or a file carry no ANSI colour codes.

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[test]
fn piped_logs_are_plain_text() {
    let db = std::env::temp_dir().join(format!("ledger-logs-{}.db", uuid::Uuid::now_v7()));
    let mut child = Command::new(env!("CARGO_BIN_EXE_ledger"))
        .args(["--listen", "127.0.0.1:0", "--database-url"])
        .arg(&db)
        .env_remove("NO_COLOR")
        .env("RUST_LOG", "info")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the ledger starts");
    let rx = common::stdout_lines(&mut child);
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut seen = Vec::new();
    while Instant::now() < deadline {
        match rx.recv_timeout(Duration::from_millis(200)) {
            Ok(line) => {
                let listening = line.contains("ledger listening");
                seen.push(line);
                if listening {
                    break;
                }
            }
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break,
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    common::remove_sqlite_files(&db.display().to_string());
    assert!(
        seen.iter().any(|l| l.contains("ledger listening")),
        "the ledger logged its start: {seen:?}"
    );
    for line in &seen {
        assert!(!line.contains('\u{1b}'), "an ANSI escape in a piped log line: {line:?}");
    }
}
