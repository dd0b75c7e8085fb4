//! The `identity` source: the principal the upstream names when asked with
//! the caller's credentials (`[tenant.identity]`), remembered per
//! credential digest.

use std::time::Duration;

use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode, header};
use idem_core::Tenant;
use serde::Deserialize;
use sha2::{Digest, Sha256};

use super::cache::Cache;
use super::credentials::{Credential, digest};
use super::{Refusal, problem};
use crate::ConfigError;

/// How the gateway asks the upstream who a caller is.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IdentityConfig {
    /// The upstream path asked with `GET` (under the upstream's base path).
    pub path: String,
    /// The response header naming the principal.
    pub header: Option<String>,
    /// The JSON field naming the principal (an RFC 6901 pointer: `/user/id`);
    /// a string or an integer.
    pub json_pointer: Option<String>,
    /// How long an answer is kept, per credential digest.
    #[serde(default = "default_cache_secs")]
    pub cache_secs: u64,
    /// How many answers are kept at most (the oldest go first).
    #[serde(default = "default_cache_entries")]
    pub cache_entries: usize,
    /// How long the upstream may take to answer.
    #[serde(default = "default_identity_timeout")]
    pub timeout_ms: u64,
}

fn default_cache_secs() -> u64 {
    60
}

fn default_cache_entries() -> usize {
    10_000
}

fn default_identity_timeout() -> u64 {
    5_000
}

/// The largest identity answer read, bytes.
const MAX_IDENTITY_BYTES: usize = 64 * 1024;

impl IdentityConfig {
    pub(super) fn validate(&self) -> Result<(), String> {
        let uri: axum::http::Uri = self
            .path
            .parse()
            .map_err(|_| format!("path {:?} is not a path", self.path))?;
        if uri.scheme().is_some() || crate::path::canonical_target(&uri).map(|u| u.to_string()) != Ok(self.path.clone())
        {
            return Err(format!("path {:?} must be a canonical path (as /v1/me)", self.path));
        }
        match (&self.header, &self.json_pointer) {
            (Some(h), None) => {
                HeaderName::from_bytes(h.as_bytes()).map_err(|_| format!("header {h:?} is not a header name"))?;
            }
            (None, Some(p)) => {
                if !(p.is_empty() || p.starts_with('/')) {
                    return Err(format!("json_pointer {p:?} must start with / (RFC 6901)"));
                }
            }
            _ => return Err("set one of header and json_pointer: where the answer names the caller".into()),
        }
        if !(1..=86_400).contains(&self.cache_secs) {
            return Err(format!("cache_secs must be 1 to 86400, not {}", self.cache_secs));
        }
        if !(1..=10_000_000).contains(&self.cache_entries) {
            return Err(format!(
                "cache_entries must be 1 to 10000000, not {}",
                self.cache_entries
            ));
        }
        if !(1..=60_000).contains(&self.timeout_ms) {
            return Err(format!("timeout_ms must be 1 to 60000, not {}", self.timeout_ms));
        }
        Ok(())
    }
}

/// Where the upstream's identity answer names the caller.
enum Answer {
    Header(HeaderName),
    Json(String),
}

/// Asks the upstream who a caller is, and remembers the answers.
pub(crate) struct Identity {
    client: reqwest::Client,
    url: reqwest::Url,
    answer: Answer,
    timeout: Duration,
    cache: Cache,
}

impl Identity {
    pub(super) fn new(
        config: &IdentityConfig,
        client: reqwest::Client,
        upstream: &reqwest::Url,
    ) -> Result<Self, ConfigError> {
        config
            .validate()
            .map_err(|why| ConfigError(format!("tenant.identity: {why}")))?;
        let base = upstream.as_str().trim_end_matches('/');
        let url = reqwest::Url::parse(&format!("{base}{}", config.path))
            .map_err(|e| ConfigError(format!("tenant.identity.path {:?}: {e}", config.path)))?;
        let answer = match (&config.header, &config.json_pointer) {
            (Some(h), _) => Answer::Header(
                HeaderName::from_bytes(h.as_bytes()).map_err(|_| ConfigError("tenant.identity.header".into()))?,
            ),
            (None, Some(p)) => Answer::Json(p.clone()),
            (None, None) => return Err(ConfigError("tenant.identity: set header or json_pointer".into())),
        };
        Ok(Self {
            client,
            url,
            answer,
            timeout: Duration::from_millis(config.timeout_ms),
            cache: Cache::new(Duration::from_secs(config.cache_secs), config.cache_entries),
        })
    }

    pub(super) async fn tenant(&self, credentials: &[Credential], presented: &[Vec<&[u8]>]) -> Result<Tenant, Refusal> {
        let digest = digest(credentials, presented);
        if let Some(tenant) = self.cache.get(&digest) {
            metrics::counter!("idem_gateway_identity_total", "result" => "cached").increment(1);
            return Ok(tenant);
        }
        let tenant = self.ask(credentials, presented).await;
        let result = match &tenant {
            Ok(_) => "asked",
            Err(r) if r.status() == StatusCode::UNAUTHORIZED || r.status() == StatusCode::FORBIDDEN => "rejected",
            Err(_) => "failed",
        };
        metrics::counter!("idem_gateway_identity_total", "result" => result).increment(1);
        let tenant = tenant?;
        self.cache.insert(digest, tenant.clone());
        Ok(tenant)
    }

    /// One identity request, with the caller's credentials and nothing else.
    async fn ask(&self, credentials: &[Credential], presented: &[Vec<&[u8]>]) -> Result<Tenant, Refusal> {
        let unavailable = |detail: String| {
            tracing::warn!(url = %self.url, %detail, "identity request failed");
            let mut r = problem(
                StatusCode::SERVICE_UNAVAILABLE,
                "identity-unavailable",
                "Identity unavailable",
                format!(
                    "the upstream could not say who the caller is ({detail}); nothing was sent, retry with the same Idempotency-Key"
                ),
            );
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
            r
        };
        let mut headers = HeaderMap::new();
        let mut cookies = Vec::new();
        for (c, values) in credentials.iter().zip(presented) {
            for v in values {
                match c {
                    Credential::Authorization | Credential::Header(_) => {
                        let name = match c {
                            Credential::Header(h) => h.clone(),
                            _ => header::AUTHORIZATION,
                        };
                        if let Ok(v) = HeaderValue::from_bytes(v) {
                            headers.append(name, v);
                        }
                    }
                    Credential::Cookie(name) => {
                        let mut pair = Vec::with_capacity(name.len() + 1 + v.len());
                        pair.extend_from_slice(name.as_bytes());
                        pair.push(b'=');
                        pair.extend_from_slice(v);
                        cookies.push(pair);
                    }
                }
            }
        }
        if !cookies.is_empty()
            && let Ok(v) = HeaderValue::from_bytes(&cookies.join(&b"; "[..]))
        {
            headers.insert(header::COOKIE, v);
        }
        if matches!(self.answer, Answer::Json(_)) {
            headers.insert(header::ACCEPT, HeaderValue::from_static("application/json"));
        }
        let sent = self
            .client
            .get(self.url.clone())
            .headers(headers)
            .timeout(self.timeout)
            .send()
            .await;
        let mut answer = match sent {
            Ok(a) => a,
            Err(e) if e.is_timeout() => {
                return Err(unavailable(format!("no answer in {} ms", self.timeout.as_millis())));
            }
            Err(e) => return Err(unavailable(format!("unreachable: {e}"))),
        };
        let status = answer.status();
        if status == StatusCode::UNAUTHORIZED || status == StatusCode::FORBIDDEN {
            let mut r = problem(
                status,
                "identity-rejected",
                "Credentials rejected",
                format!(
                    "the upstream did not accept the caller's credentials ({} to GET {}); nothing was sent",
                    status.as_u16(),
                    self.url.path()
                ),
            );
            for v in answer.headers().get_all(header::WWW_AUTHENTICATE) {
                r.headers_mut().append(header::WWW_AUTHENTICATE, v.clone());
            }
            return Err(r);
        }
        if !status.is_success() {
            if status.is_server_error() || status == StatusCode::TOO_MANY_REQUESTS {
                return Err(unavailable(format!("status {}", status.as_u16())));
            }
            tracing::error!(url = %self.url, status = status.as_u16(), "the identity path answered neither a success nor 401/403: check tenant.identity.path");
            return Err(problem(
                StatusCode::BAD_GATEWAY,
                "identity-unavailable",
                "Identity unavailable",
                format!(
                    "the upstream's identity path answered {}; nothing was sent",
                    status.as_u16()
                ),
            ));
        }
        let name = match &self.answer {
            Answer::Header(h) => answer
                .headers()
                .get(h)
                .and_then(|v| v.to_str().ok())
                .map(|v| v.trim().to_owned()),
            Answer::Json(pointer) => {
                let mut body = Vec::new();
                let mut complete = true;
                loop {
                    match answer.chunk().await {
                        Ok(Some(chunk)) if body.len() + chunk.len() <= MAX_IDENTITY_BYTES => {
                            body.extend_from_slice(&chunk)
                        }
                        Ok(Some(_)) | Err(_) => {
                            complete = false;
                            break;
                        }
                        Ok(None) => break,
                    }
                }
                complete
                    .then(|| serde_json::from_slice::<serde_json::Value>(&body).ok())
                    .flatten()
                    .and_then(|v| match v.pointer(pointer) {
                        Some(serde_json::Value::String(s)) => Some(s.clone()),
                        Some(serde_json::Value::Number(n)) if n.is_i64() || n.is_u64() => Some(n.to_string()),
                        _ => None,
                    })
            }
        };
        match name.filter(|n| !n.is_empty()) {
            Some(name) => Ok(identity_tenant(&name)),
            None => {
                tracing::error!(url = %self.url, "the identity answer names no caller where tenant.identity says");
                Err(problem(
                    StatusCode::BAD_GATEWAY,
                    "identity-invalid",
                    "Identity invalid",
                    "the upstream's identity answer names no caller; nothing was sent",
                ))
            }
        }
    }
}

/// The tenant of a principal the upstream named: `id:<name>`, or a digest
/// (`idh:…`) of a name that is no valid tenant (too long).
fn identity_tenant(name: &str) -> Tenant {
    Tenant::new(format!("id:{name}")).unwrap_or_else(|_| {
        Tenant::new(format!("idh:{}", hex::encode(Sha256::digest(name.as_bytes()))))
            .expect("a hex digest is a valid tenant")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A principal name that is no valid tenant still gets one, apart from every valid name.
    #[test]
    fn identity_tenants() {
        assert_eq!(identity_tenant("u_1").as_str(), "id:u_1");
        let long = "x".repeat(300);
        assert!(identity_tenant(&long).as_str().starts_with("idh:"));
    }
}
