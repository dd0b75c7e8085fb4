//! The upstream: its URL, checked (and shown without credentials), and how
//! long it may take.

use std::time::Duration;

use super::{Config, ConfigError};

/// Whether the gateway can call `https://` upstreams: only with TLS built
/// in (the `tls` feature); without it such an upstream is refused at start
/// rather than answered with a 502 on every request.
const TLS: bool = cfg!(feature = "tls");

impl Config {
    /// The upstream URL, validated: `http://`, or `https://` when TLS is
    /// built in, with no user, password, query or fragment. Messages show
    /// the URL without its user and password.
    pub fn upstream(&self) -> Result<reqwest::Url, ConfigError> {
        let raw = self
            .upstream
            .as_deref()
            .ok_or_else(|| ConfigError("no upstream: pass --upstream URL".into()))?;
        let shown = redact(raw);
        let url = reqwest::Url::parse(raw).map_err(|e| ConfigError(format!("upstream {shown:?}: {e}")))?;
        if !matches!(url.scheme(), "http" | "https") || url.host().is_none() {
            return Err(ConfigError(format!(
                "upstream {shown:?} must be an http:// or https:// URL"
            )));
        }
        if url.scheme() == "https" && !TLS {
            return Err(ConfigError(format!(
                "upstream {shown:?}: this build has no TLS, so an https:// upstream cannot be called; use \
                 http:// (a TLS-terminating proxy next to the upstream) or a build with the `tls` feature"
            )));
        }
        if url.query().is_some() || url.fragment().is_some() || !url.username().is_empty() || url.password().is_some() {
            return Err(ConfigError(format!(
                "upstream {shown:?} must be scheme, host, port and an optional base path: no query, fragment, \
                 user or password"
            )));
        }
        Ok(url)
    }

    /// How long the upstream may take.
    pub fn upstream_timeout(&self) -> Duration {
        Duration::from_secs(self.upstream_timeout_secs.max(1))
    }

    /// How long a graceful shutdown may take: the upstream's time, and a
    /// margin to record the last outcomes.
    pub fn shutdown_grace(&self) -> Duration {
        self.upstream_timeout() + Duration::from_secs(10)
    }
}

/// `raw` with any user and password between `://` and the host replaced
/// by `***`, for messages.
pub(super) fn redact(raw: &str) -> String {
    let Some(start) = raw.find("://").map(|i| i + 3) else {
        return raw.to_owned();
    };
    let authority_end = raw[start..].find(['/', '?', '#']).map_or(raw.len(), |i| start + i);
    match raw[start..authority_end].rfind('@') {
        Some(at) => format!("{}***{}", &raw[..start], &raw[start + at..]),
        None => raw.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An https:// upstream is refused while no TLS is built in.
    #[test]
    fn https_needs_tls() {
        let c = Config {
            upstream: Some("https://127.0.0.1:9443".into()),
            ..Config::default()
        };
        let e = c.upstream().map(|_| ()).map_err(|e| e.to_string());
        if TLS {
            assert!(e.is_ok());
        } else {
            let e = e.unwrap_err();
            assert!(e.contains("no TLS") && e.contains("https://127.0.0.1:9443"), "{e}");
        }
    }
}
