//! What every deployment's processes share: a scratch directory removed on
//! drop, free loopback ports, a child process killed on drop, and waiting
//! for a condition with a deadline.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::{Duration, Instant};

/// A directory of its own under the system's temporary directory, removed
/// (with everything in it) when dropped.
///
/// A watcher process starts with it: once this process is gone without
/// dropping it (killed with SIGKILL, where no destructor runs), the watcher
/// kills every process started in the directory or whose command line names
/// it (the servers a deployment started there) and removes the directory.
/// That also stops the servers of a deployment kept in a `static`, which is
/// never dropped.
#[derive(Debug)]
pub struct Scratch {
    path: PathBuf,
    _watcher: Guarded,
}

impl Scratch {
    /// Creates `idem-<what>-<pid>-<uuid>` under the temporary directory.
    pub fn new(what: &str) -> std::io::Result<Self> {
        let path = std::env::temp_dir().join(format!(
            "idem-{what}-{}-{}",
            std::process::id(),
            uuid::Uuid::now_v7().simple()
        ));
        std::fs::create_dir_all(&path)?;
        let watcher = watch(&path)?;
        Ok(Self {
            path,
            _watcher: watcher,
        })
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

/// Starts the watcher of a [`Scratch`] directory: it waits until this process
/// is gone, then kills every other process started in `dir` (or below it)
/// or whose command line names it, and removes `dir` (until it stays removed: a tool still writing there can
/// refill it). It leads a process group of its own, so an interrupt that
/// stops this process's group leaves it to clean up.
fn watch(dir: &Path) -> std::io::Result<Guarded> {
    const SCRIPT: &str = r#"
while kill -0 "$1" 2>/dev/null; do sleep 0.5; done
for p in /proc/[0-9]*; do
  pid=${p#/proc/}
  [ "$pid" = "$$" ] && continue
  # Started in the directory (a server may rewrite its command line, as
  # redis-server does), or naming it.
  case "$(readlink "$p/cwd" 2>/dev/null)" in
    "$2" | "$2"/*) kill -KILL "$pid" 2>/dev/null; continue ;;
  esac
  grep -qaF -- "$2" "$p/cmdline" 2>/dev/null && kill -KILL "$pid" 2>/dev/null
done
for i in 1 2 3 4 5 6 7 8 9 10; do
  rm -rf "$2" 2>/dev/null
  sleep 0.5
  [ -e "$2" ] || break
done
"#;
    let child = std::process::Command::new("sh")
        .args(["-c", SCRIPT, "scratch-watcher", &std::process::id().to_string()])
        .arg(dir)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .process_group(0)
        .spawn()?;
    Ok(Guarded::new(child))
}

/// A free loopback port below the kernel's ephemeral range (see
/// [`idem_conformance::free_port`]).
pub fn free_port() -> u16 {
    idem_conformance::free_port()
}

/// A child process killed (SIGKILL) and reaped when dropped, unless it has
/// exited already.
#[derive(Debug)]
pub struct Guarded {
    child: Option<Child>,
}

impl Guarded {
    /// Guards `child`.
    pub fn new(child: Child) -> Self {
        Self { child: Some(child) }
    }

    /// The process id.
    pub fn id(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Whether the process has exited.
    pub fn exited(&mut self) -> bool {
        match self.child.as_mut() {
            Some(child) => !matches!(child.try_wait(), Ok(None)),
            None => true,
        }
    }

    /// Kills the process with SIGKILL and reaps it.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Sends SIGTERM and waits up to `grace` for the process to exit, then
    /// kills it.
    pub fn stop(&mut self, grace: Duration) {
        if let Some(child) = self.child.as_mut() {
            let _ = std::process::Command::new("kill")
                .args(["-TERM", &child.id().to_string()])
                .status();
            let deadline = Instant::now() + grace;
            while Instant::now() < deadline {
                if !matches!(child.try_wait(), Ok(None)) {
                    self.child = None;
                    return;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        self.kill();
    }
}

impl Drop for Guarded {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Polls `ready` every 100 ms until it answers `true`, or fails with `what`
/// once `within` has passed.
pub async fn wait_until<F, Fut>(within: Duration, what: &str, mut ready: F) -> Result<(), String>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + within;
    loop {
        if ready().await {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(format!("{what}: not ready within {within:?}"));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
