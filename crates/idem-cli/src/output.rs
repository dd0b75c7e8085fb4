//! What a run prints and how it fails: [`say!`] and [`print`] for its
//! result, [`Failure`] for its exit code and message, and [`finish`] that
//! turns the outcome into the process's exit code with every credential
//! masked.

/// A failure with its exit code.
pub(crate) struct Failure(pub(crate) u8, pub(crate) String);

impl From<idem_core::Error> for Failure {
    fn from(e: idem_core::Error) -> Self {
        let code = match &e {
            idem_core::Error::Config(_) => 2,
            e if e.store_kind() == Some(idem_core::StoreErrorKind::Unavailable) => 3,
            _ => 1,
        };
        Failure(code, e.to_string())
    }
}

impl From<idem_outbound::OutboundError> for Failure {
    fn from(e: idem_outbound::OutboundError) -> Self {
        match e {
            idem_outbound::OutboundError::Store(e) => e.into(),
            idem_outbound::OutboundError::InvalidConfig(m) => Failure(2, m),
            other => Failure(1, other.to_string()),
        }
    }
}

impl From<idem_gateway::GatewayError> for Failure {
    fn from(e: idem_gateway::GatewayError) -> Self {
        match e {
            idem_gateway::GatewayError::Store(e) => e.into(),
            idem_gateway::GatewayError::Config(e) => Failure(2, e.to_string()),
            other => Failure(1, other.to_string()),
        }
    }
}

/// Refuses a filter flag given an empty value (exit 2): it would select
/// nothing meaningful. `filters` are the flags with their values.
pub(crate) fn refuse_empty_filters(filters: &[(&str, &Option<String>)]) -> Result<(), Failure> {
    for (flag, value) in filters {
        if value.as_deref().is_some_and(str::is_empty) {
            return Err(Failure(
                2,
                format!("{flag} is empty: give a value, or leave the filter out"),
            ));
        }
    }
    Ok(())
}

/// A store that could not be opened, with the store's URL (credentials
/// masked) in the message.
pub(crate) fn store_failure(url: &str, e: idem_core::Error) -> Failure {
    let Failure(code, message) = e.into();
    Failure(code, format!("store {}: {message}", idem_core::redact_credentials(url)))
}

/// Whether anything went to standard output: with `--json` that is the
/// run's one JSON document, and a failure after it (`dlq redrive` with a
/// letter that failed again) is told on stderr instead of in a second one.
pub(crate) static STDOUT_USED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Writes a line to standard output; a closed pipe (`idem … | head`) is
/// not an error worth a panic.
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        $crate::output::STDOUT_USED.store(true, std::sync::atomic::Ordering::Relaxed);
        let _ = writeln!(std::io::stdout().lock(), $($arg)*);
    }};
}
pub(crate) use say;

/// Prints a result: `value` with `--json`, `text` without.
pub(crate) fn print(json: bool, value: serde_json::Value, text: String) {
    if json {
        say!("{value}");
    } else {
        say!("{text}");
    }
}

/// Prints a JSON document as one line with `--json`, pretty without.
pub(crate) fn print_document(json: bool, value: &serde_json::Value) {
    if json {
        say!("{value}");
    } else {
        say!("{}", serde_json::to_string_pretty(value).unwrap_or_default());
    }
}

/// The exit code of a run's `outcome`, its failure told first: as JSON on
/// stdout with `--json` (unless the run printed its document already), on
/// stderr otherwise. `raw` is the command line, whose passwords are masked.
pub(crate) fn finish(outcome: Result<(), Failure>, json: bool, raw: &[std::ffi::OsString]) -> std::process::ExitCode {
    match outcome {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(Failure(code, message)) => {
            // Whatever the failure, no credential reaches the output: the
            // passwords of the URLs given on the command line and in the
            // environment are known whole, whatever characters they hold.
            let passwords = given_passwords(raw);
            let passwords: Vec<&str> = passwords.iter().map(String::as_str).collect();
            let message = idem_core::redact_known(&message, &passwords);
            if json && !STDOUT_USED.load(std::sync::atomic::Ordering::Relaxed) {
                say!("{}", serde_json::json!({ "error": message, "exit_code": code }));
            } else {
                eprintln!("idem: {message}");
            }
            std::process::ExitCode::from(code)
        }
    }
}

/// The passwords of every URL among the arguments (`--store URL`,
/// `--store=URL`) and the environment's values (`IDEM_STORE`…).
fn given_passwords(raw: &[std::ffi::OsString]) -> Vec<String> {
    let mut texts: Vec<String> = raw.iter().filter_map(|a| a.to_str()).map(str::to_owned).collect();
    texts.extend(std::env::vars_os().filter_map(|(_, v)| v.into_string().ok()));
    let mut found = Vec::new();
    for text in texts {
        // `--flag=URL` and the URL itself.
        for candidate in [Some(text.as_str()), text.split_once('=').map(|(_, v)| v)]
            .into_iter()
            .flatten()
        {
            found.extend(idem_core::url_passwords(candidate).into_iter().map(str::to_owned));
        }
    }
    found.sort();
    found.dedup();
    found
}
