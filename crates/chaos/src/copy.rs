//! A copy of a built binary that is safe to start.
//!
//! Shared by source: the ledger's tests include this file with `#[path]`
//! (they cannot depend on this crate, which depends on the ledger).

/// Copies the binary `built` to `copy` and answers once the copy can be
/// run.
///
/// While the copy is written, a process that another test's thread forks
/// holds the copy's open write descriptor until that process execs; running
/// the copy then fails with "Text file busy" (ETXTBSY). So the copy is run
/// once with `--help` (every binary here is a clap program), again after a
/// short pause while it is busy; once it runs, nothing holds it open for
/// writing any more, and every later start of it is safe.
pub(crate) fn runnable_copy(built: &std::path::Path, copy: &std::path::Path) -> std::io::Result<()> {
    /// Linux's ETXTBSY.
    const TEXT_FILE_BUSY: i32 = 26;
    std::fs::copy(built, copy)?;
    for _ in 0..200 {
        match std::process::Command::new(copy)
            .arg("--help")
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
        {
            Err(e) if e.raw_os_error() == Some(TEXT_FILE_BUSY) => {
                std::thread::sleep(std::time::Duration::from_millis(10))
            }
            Err(e) => return Err(e),
            Ok(_) => return Ok(()),
        }
    }
    Err(std::io::Error::other(format!(
        "{} stayed busy (ETXTBSY) for 2 s after it was copied",
        copy.display()
    )))
}
