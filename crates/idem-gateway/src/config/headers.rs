//! Headers: which forwarding headers the gateway adds upstream, whose
//! tenant and forwarding headers it trusts (`trusted_proxies`), and which
//! answers' headers it never records (`private_headers`).

use serde::Deserialize;

use super::{Config, ConfigError};
use crate::trust::Trusted;

/// Which forwarding headers the gateway adds to upstream requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "kebab-case")]
pub enum ForwardedHeaders {
    /// None: the client's own such headers pass as they came.
    #[default]
    None,
    /// `X-Forwarded-For`, `X-Forwarded-Proto` and `X-Forwarded-Host`.
    XForwarded,
    /// `Forwarded` (RFC 7239).
    Forwarded,
    /// Both.
    Both,
}

impl Config {
    /// The trusted proxies, parsed.
    pub(crate) fn trusted(&self) -> Result<Trusted, ConfigError> {
        Trusted::parse(&self.trusted_proxies).map_err(|why| ConfigError(format!("trusted_proxies: {why}")))
    }

    /// The private headers: `Set-Cookie` and those configured.
    pub(crate) fn private_header_names(&self) -> Result<Vec<axum::http::HeaderName>, ConfigError> {
        let mut names = vec![axum::http::header::SET_COOKIE];
        for h in &self.private_headers {
            let name = axum::http::HeaderName::from_bytes(h.as_bytes())
                .map_err(|_| ConfigError(format!("private_headers: {h:?} is not a header name")))?;
            if !names.contains(&name) {
                names.push(name);
            }
        }
        Ok(names)
    }
}
