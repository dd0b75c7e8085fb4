//! Who the caller is: the tenant that scopes its keys.
//!
//! A gateway must never replay one principal's answer to another, so the
//! tenant source is explicit, one of:
//!
//! - `credentials`: a digest of the credentials listed (`authorization`,
//!   `header:NAME`, `cookie:NAME`), all of them as sent. Two callers share
//!   keys only if every listed credential is byte for byte the same. A
//!   client keeps every listed credential unchanged across the retries of
//!   one operation; a refreshed token starts a new key space.
//! - `identity`: the principal the upstream itself names. The gateway sends
//!   the listed credentials (and nothing else) to a configured path of the
//!   upstream (`GET /whoami`), reads the principal from a response header or
//!   a JSON field, and keeps the answer per credential digest for a bounded
//!   time in a bounded cache. A client may refresh its token between
//!   retries: the key space follows the principal. This decides scoping
//!   only; every forwarded request still carries its own credentials for
//!   the upstream to check.
//! - `header`: a header a trusted proxy in front sets to the principal
//!   (accepted only from `trusted_proxies`). The proxy keeps it stable for
//!   a principal.
//! - `anonymous`: every caller shares one key space (an explicit opt-in,
//!   for an upstream with one client).

//!
//! One source a file: the credentials and their digest
//! (`credentials.rs`), the upstream's identity answer (`identity.rs`) with
//! its cache (`cache.rs`), and the trusted proxy's header (`header.rs`). The
//! `[tenant]` table and the finder that picks among them stay here.

mod cache;
mod credentials;
mod header;
mod identity;

use axum::body::Body;
use axum::http::request::Parts;
use axum::http::{HeaderName, Response, StatusCode};
use idem_core::Tenant;
use idem_http::{DEFAULT_PROBLEM_BASE, Problem};
use serde::Deserialize;

use crate::ConfigError;
use credentials::{Credential, credential_tenant, parse_credentials, presented};
use identity::Identity;
pub use identity::IdentityConfig;

/// Where the tenant comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TenantSource {
    /// A digest of the listed credentials.
    Credentials,
    /// The principal the upstream names for the listed credentials.
    Identity,
    /// A header set by a trusted proxy.
    Header,
    /// One key space for every caller.
    Anonymous,
}

/// The `[tenant]` table.
///
/// ```toml
/// [tenant]
/// source = "identity"
/// credentials = ["authorization", "cookie:session"]
/// [tenant.identity]
/// path = "/v1/me"          # GET, with the credentials above
/// json_pointer = "/id"     # or: header = "x-user-id"
/// cache_secs = 60
/// cache_entries = 10000
/// timeout_ms = 5000
/// ```
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantConfig {
    /// Where the tenant comes from.
    pub source: TenantSource,
    /// The credentials (`credentials` and `identity` sources):
    /// `authorization`, `header:NAME` or `cookie:NAME`.
    #[serde(default)]
    pub credentials: Vec<String>,
    /// The header naming the tenant (`header` source).
    pub header: Option<String>,
    /// How to ask the upstream (`identity` source).
    pub identity: Option<IdentityConfig>,
}

impl TenantConfig {
    /// The source the `--tenant` flag names: `anonymous`,
    /// `trusted-header:NAME`, or credentials separated by commas
    /// (`authorization`, `header:NAME`, `cookie:NAME`).
    pub fn from_flag(spec: &str) -> Result<Self, ConfigError> {
        let spec = spec.trim();
        let config = if spec == "anonymous" {
            Self {
                source: TenantSource::Anonymous,
                credentials: Vec::new(),
                header: None,
                identity: None,
            }
        } else if let Some(name) = spec.strip_prefix("trusted-header:") {
            Self {
                source: TenantSource::Header,
                credentials: Vec::new(),
                header: Some(name.to_owned()),
                identity: None,
            }
        } else {
            Self {
                source: TenantSource::Credentials,
                credentials: spec.split(',').map(|s| s.trim().to_owned()).collect(),
                header: None,
                identity: None,
            }
        };
        config
            .validate(true)
            .map_err(|e| ConfigError(format!("--tenant {spec:?}: {}", e.0)))?;
        Ok(config)
    }

    /// Checks that the source has what it needs and nothing it ignores.
    pub(crate) fn validate(&self, has_trusted_proxies: bool) -> Result<(), ConfigError> {
        fn fail<T>(why: String) -> Result<T, ConfigError> {
            Err(ConfigError(format!("tenant: {why}")))
        }
        let uses_credentials = matches!(self.source, TenantSource::Credentials | TenantSource::Identity);
        if uses_credentials {
            parse_credentials(&self.credentials).or_else(|why| fail(format!("credentials: {why}")))?;
        } else if !self.credentials.is_empty() {
            return fail(format!("credentials are not used by source = {:?}", self.source));
        }
        if self.source == TenantSource::Header {
            let Some(name) = &self.header else {
                return fail("source = \"header\" needs header = \"NAME\"".into());
            };
            if HeaderName::from_bytes(name.as_bytes()).is_err() {
                return fail(format!("header {name:?} is not a header name"));
            }
            if !has_trusted_proxies {
                return fail(format!(
                    "source = \"header\" needs trusted_proxies: the addresses of the proxies that set {name} \
                     (from anyone else the header is refused)"
                ));
            }
        } else if self.header.is_some() {
            return fail(format!("header is not used by source = {:?}", self.source));
        }
        match (&self.identity, self.source) {
            (Some(identity), TenantSource::Identity) => {
                identity.validate().or_else(|why| fail(format!("identity: {why}")))
            }
            (None, TenantSource::Identity) => fail("source = \"identity\" needs [tenant.identity] with a path".into()),
            (Some(_), source) => fail(format!("[tenant.identity] is not used by source = {source:?}")),
            (None, _) => Ok(()),
        }
    }
}

/// The tenant of a request, found at the door for the layer to scope by.
#[derive(Debug, Clone)]
pub(crate) struct Resolved(pub(crate) Tenant);

/// Finds tenants as configured.
pub(crate) enum Tenants {
    Credentials(Vec<Credential>),
    Identity(Vec<Credential>, Box<Identity>),
    Header(HeaderName),
    Anonymous,
}

/// The answer that refuses a request whose tenant cannot be found.
pub(crate) type Refusal = Box<Response<Body>>;

fn problem(status: StatusCode, slug: &str, title: &str, detail: impl Into<String>) -> Refusal {
    Box::new(
        Problem::new(status, slug, title)
            .with_detail(detail)
            .into_response(DEFAULT_PROBLEM_BASE),
    )
}

impl Tenants {
    /// The tenant finder of a validated configuration; identity requests go
    /// to `upstream` through `client`.
    pub(crate) fn new(
        config: &TenantConfig,
        client: reqwest::Client,
        upstream: &reqwest::Url,
    ) -> Result<Self, ConfigError> {
        let credentials =
            || parse_credentials(&config.credentials).map_err(|why| ConfigError(format!("tenant: {why}")));
        Ok(match config.source {
            TenantSource::Credentials => Self::Credentials(credentials()?),
            TenantSource::Identity => {
                let identity = config
                    .identity
                    .as_ref()
                    .ok_or_else(|| ConfigError("tenant: source = \"identity\" needs [tenant.identity]".into()))?;
                Self::Identity(credentials()?, Box::new(Identity::new(identity, client, upstream)?))
            }
            TenantSource::Header => {
                let name = config.header.as_deref().unwrap_or_default();
                Self::Header(
                    HeaderName::from_bytes(name.as_bytes())
                        .map_err(|_| ConfigError(format!("tenant: header {name:?} is not a header name")))?,
                )
            }
            TenantSource::Anonymous => Self::Anonymous,
        })
    }

    /// The header a trusted proxy sets, for the `header` source.
    pub(crate) fn trusted_header(&self) -> Option<&HeaderName> {
        match self {
            Self::Header(h) => Some(h),
            _ => None,
        }
    }

    /// The tenant of a request, or the answer that refuses it.
    pub(crate) async fn resolve(&self, parts: &Parts) -> Result<Tenant, Refusal> {
        match self {
            Self::Anonymous => Ok(Tenant::new("anonymous").expect("a valid tenant")),
            Self::Header(name) => header::header_tenant(name, &parts.headers),
            Self::Credentials(credentials) => {
                let presented = presented(credentials, &parts.headers)?;
                Ok(credential_tenant(credentials, &presented))
            }
            Self::Identity(credentials, identity) => {
                let presented = presented(credentials, &parts.headers)?;
                identity.tenant(credentials, &presented).await
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The flag's forms, and what each source refuses.
    #[test]
    fn flags_and_validation() {
        assert_eq!(
            TenantConfig::from_flag("anonymous").unwrap().source,
            TenantSource::Anonymous
        );
        let c = TenantConfig::from_flag("authorization,cookie:session").unwrap();
        assert_eq!((c.source, c.credentials.len()), (TenantSource::Credentials, 2));
        assert_eq!(
            TenantConfig::from_flag("trusted-header:x-user").unwrap().source,
            TenantSource::Header
        );
        for bad in [
            "",
            "bearer",
            "header:bad name",
            "cookie:",
            "authorization,authorization",
            "header:cookie",
        ] {
            assert!(TenantConfig::from_flag(bad).is_err(), "{bad}");
        }
        let header = TenantConfig {
            source: TenantSource::Header,
            credentials: Vec::new(),
            header: Some("x-user".into()),
            identity: None,
        };
        let e = header.validate(false).unwrap_err().to_string();
        assert!(e.contains("trusted_proxies"), "{e}");
        let identity = TenantConfig {
            source: TenantSource::Identity,
            credentials: vec!["authorization".into()],
            header: None,
            identity: Some(IdentityConfig {
                path: "/me/../admin".into(),
                header: Some("x-user".into()),
                json_pointer: None,
                cache_secs: 60,
                cache_entries: 10,
                timeout_ms: 1000,
            }),
        };
        assert!(identity.validate(false).unwrap_err().to_string().contains("canonical"));
    }
}
