//! Target URLs: checked once as every send does, and named by their host
//! (`scheme://host:port`) for the breakers and the metrics.

use crate::error::{OutboundError, Result};

/// A target URL, checked (see [`OutboundClient::check_target`]).
pub(super) fn parse_target(url: &str, tls: bool) -> Result<reqwest::Url> {
    let invalid = |why: String| Err(OutboundError::Invalid(why));
    let parsed = match reqwest::Url::parse(url) {
        Ok(u) => u,
        Err(e) => return invalid(format!("{url:?} is not a valid URL: {e}")),
    };
    match parsed.scheme() {
        "http" => {}
        "https" if tls => {}
        "https" => {
            return invalid(format!(
                "{url:?} is https, and this client has no TLS backend: it could never be reached \
                 (build idem-outbound with its `tls` feature, or pass a reqwest client built with TLS \
                 to OutboundClient::with_http_client)"
            ));
        }
        other => return invalid(format!("{url:?}: the scheme must be http or https, not {other}")),
    }
    if parsed.host_str().is_none_or(str::is_empty) {
        return invalid(format!("{url:?} has no host"));
    }
    if parsed.port() == Some(0) {
        return invalid(format!("{url:?}: port 0 cannot be called"));
    }
    if !parsed.username().is_empty() || parsed.password().is_some() {
        return invalid(
            "the URL carries user information: give credentials as secret headers, never in a URL that is \
             stored and shown"
                .into(),
        );
    }
    if parsed.fragment().is_some() {
        return invalid(format!(
            "{url:?} has a fragment (#…), which is never sent: everything after it is lost"
        ));
    }
    Ok(parsed)
}

/// The breaker's and the metrics' name of a URL's host:
/// `scheme://host:port`.
pub(super) fn host_of(url: &reqwest::Url) -> Result<String> {
    match (url.host_str(), url.port_or_known_default()) {
        (Some(host), Some(port)) => Ok(format!("{}://{host}:{port}", url.scheme())),
        _ => Err(OutboundError::Invalid(format!("{url} has no host"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_are_scheme_host_and_port() {
        let url = |u: &str| reqwest::Url::parse(u).unwrap();
        assert_eq!(host_of(&url("http://v.example/x")).unwrap(), "http://v.example:80");
        assert_eq!(host_of(&url("https://v.example/x")).unwrap(), "https://v.example:443");
        assert_eq!(host_of(&url("http://[::1]:8080/")).unwrap(), "http://[::1]:8080");
    }

    /// Proves targets are checked as the issue asks: fragments, user information, port 0 or out of range, https without TLS.
    #[test]
    fn targets_are_checked() {
        assert!(parse_target("http://v:9100/v1/payouts?x=1", false).is_ok());
        assert!(parse_target("https://v/", true).is_ok());
        for bad in [
            "http://v#",
            "http://v/#/v1/payouts",
            "http://user:pw@v/",
            "http://v:0/",
            "http://v:65536/",
            "https://v/",
            "ftp://v/",
        ] {
            assert!(parse_target(bad, false).is_err(), "{bad}");
        }
    }
}
