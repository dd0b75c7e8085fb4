//! Where and when a run happened: the machine, the date, the commit.

use std::process::Command;

use serde::{Deserialize, Serialize};

/// The machine a run measured.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Machine {
    /// CPUs this process may use.
    pub nproc: usize,
    /// The CPU's model name (`/proc/cpuinfo`).
    pub cpu_model: String,
    /// Total memory (`/proc/meminfo`'s `MemTotal`, in kB).
    pub memory_kb: u64,
    /// The kernel's release.
    pub kernel: String,
    /// `/proc/loadavg`'s 1, 5 and 15-minute load averages when the run
    /// started: other work on the machine moves every figure.
    #[serde(default)]
    pub load_average: String,
}

impl Machine {
    /// This machine (fields it cannot read are empty or zero).
    pub fn this() -> Self {
        let read = |path: &str| std::fs::read_to_string(path).unwrap_or_default();
        let field = |text: &str, name: &str| {
            text.lines()
                .find(|l| l.starts_with(name))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_owned())
                .unwrap_or_default()
        };
        let meminfo = read("/proc/meminfo");
        Self {
            nproc: std::thread::available_parallelism().map_or(0, |n| n.get()),
            cpu_model: field(&read("/proc/cpuinfo"), "model name"),
            memory_kb: field(&meminfo, "MemTotal")
                .trim_end_matches("kB")
                .trim()
                .parse()
                .unwrap_or(0),
            kernel: read("/proc/sys/kernel/osrelease").trim().to_owned(),
            load_average: read("/proc/loadavg")
                .split_whitespace()
                .take(3)
                .collect::<Vec<_>>()
                .join(" "),
        }
    }
}

/// The commit the run was built from.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Commit {
    /// `git rev-parse HEAD` (empty outside a repository).
    pub commit: String,
    /// Whether the work tree had changes (`git status --porcelain`).
    pub dirty: bool,
}

impl Commit {
    /// The commit of the current directory's repository.
    pub fn current() -> Self {
        let git = |args: &[&str]| {
            Command::new("git")
                .args(args)
                .output()
                .ok()
                .filter(|o| o.status.success())
                .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        };
        Self {
            commit: git(&["rev-parse", "HEAD"]).unwrap_or_default(),
            dirty: git(&["status", "--porcelain"]).is_some_and(|s| !s.is_empty()),
        }
    }
}

/// The current time in UTC, RFC 3339 (`2026-11-25T15:30:58Z`).
pub fn now_rfc3339() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64);
    rfc3339(secs)
}

/// Seconds since the epoch as RFC 3339 in UTC.
pub fn rfc3339(secs: i64) -> String {
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Known instants format as RFC 3339 in UTC.
    #[test]
    fn formats_known_instants() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(rfc3339(1_795_620_658), "2026-11-25T15:30:58Z");
    }
}
