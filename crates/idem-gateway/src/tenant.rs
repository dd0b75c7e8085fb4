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

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::time::Duration;

use axum::body::Body;
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderName, HeaderValue, Response, StatusCode, header};
use idem_core::Tenant;
use idem_http::{DEFAULT_PROBLEM_BASE, Problem};
use serde::Deserialize;
use sha2::{Digest, Sha256};

use crate::ConfigError;

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

/// One credential a caller presents.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Credential {
    Authorization,
    Header(HeaderName),
    Cookie(String),
}

impl Credential {
    fn parse(raw: &str) -> Result<Self, String> {
        let bad_name = || format!("credential {raw:?}: not a header or cookie name");
        if raw.eq_ignore_ascii_case("authorization") {
            return Ok(Self::Authorization);
        }
        if let Some(name) = raw.strip_prefix("header:") {
            let name = HeaderName::from_bytes(name.as_bytes()).map_err(|_| bad_name())?;
            if name == header::AUTHORIZATION || name == header::COOKIE {
                return Err(format!(
                    "credential {raw:?}: write authorization, or cookie:NAME for one cookie"
                ));
            }
            return Ok(Self::Header(name));
        }
        if let Some(name) = raw.strip_prefix("cookie:") {
            let ok = !name.is_empty()
                && name
                    .bytes()
                    .all(|b| b.is_ascii_graphic() && !b"()<>@,;:\\\"/[]?={}".contains(&b));
            return if ok {
                Ok(Self::Cookie(name.to_owned()))
            } else {
                Err(bad_name())
            };
        }
        Err(format!(
            "credential {raw:?}: write authorization, header:NAME or cookie:NAME"
        ))
    }

    /// How the credential is named to a client.
    fn describe(&self) -> String {
        match self {
            Self::Authorization => "Authorization".into(),
            Self::Header(h) => format!("the {h} header"),
            Self::Cookie(c) => format!("the {c} cookie"),
        }
    }

    /// The credential's name in the digest; the usual one is not built anew
    /// per request.
    fn label(&self) -> std::borrow::Cow<'static, str> {
        match self {
            Self::Authorization => "authorization".into(),
            Self::Header(h) => format!("header:{h}").into(),
            Self::Cookie(c) => format!("cookie:{c}").into(),
        }
    }

    /// The values the caller sent, in order.
    fn values<'a>(&self, headers: &'a HeaderMap) -> Vec<&'a [u8]> {
        match self {
            Self::Authorization => headers
                .get_all(header::AUTHORIZATION)
                .iter()
                .map(HeaderValue::as_bytes)
                .collect(),
            Self::Header(h) => headers.get_all(h).iter().map(HeaderValue::as_bytes).collect(),
            Self::Cookie(name) => headers
                .get_all(header::COOKIE)
                .iter()
                .flat_map(|v| v.as_bytes().split(|b| *b == b';'))
                .filter_map(|pair| {
                    let pair = pair.trim_ascii();
                    let eq = pair.iter().position(|b| *b == b'=')?;
                    (pair[..eq].trim_ascii() == name.as_bytes()).then(|| pair[eq + 1..].trim_ascii())
                })
                .collect(),
        }
    }
}

fn parse_credentials(raw: &[String]) -> Result<Vec<Credential>, String> {
    let mut out = Vec::new();
    for r in raw {
        let c = Credential::parse(r.trim())?;
        if out.contains(&c) {
            return Err(format!("credential {r:?} is listed twice"));
        }
        out.push(c);
    }
    if out.is_empty() {
        return Err("list at least one credential: authorization, header:NAME or cookie:NAME".into());
    }
    Ok(out)
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

impl IdentityConfig {
    fn validate(&self) -> Result<(), String> {
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
            Self::Header(name) => {
                let mut values = parts.headers.get_all(name).iter();
                let value = match (values.next(), values.next()) {
                    (Some(v), None) => v.to_str().ok().and_then(|v| Tenant::new(v).ok()),
                    _ => None,
                };
                value.ok_or_else(|| {
                    problem(
                        StatusCode::BAD_REQUEST,
                        "tenant-missing",
                        "Tenant missing",
                        format!("send the tenant in one {name} header (1 to 255 visible characters)"),
                    )
                })
            }
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

/// The values of each credential; refused when none is sent.
fn presented<'a>(credentials: &[Credential], headers: &'a HeaderMap) -> Result<Vec<Vec<&'a [u8]>>, Refusal> {
    let values: Vec<Vec<&[u8]>> = credentials.iter().map(|c| c.values(headers)).collect();
    if values.iter().all(Vec::is_empty) {
        let names: Vec<String> = credentials.iter().map(Credential::describe).collect();
        return Err(problem(
            StatusCode::UNAUTHORIZED,
            "credentials-missing",
            "Credentials missing",
            format!(
                "a request with an Idempotency-Key is scoped by its caller: send {}",
                names.join(" or ")
            ),
        ));
    }
    Ok(values)
}

/// A digest of every credential as presented: its name, how many values,
/// and each value, so no two different presentations share it.
fn digest(credentials: &[Credential], presented: &[Vec<&[u8]>]) -> [u8; 32] {
    let mut h = Sha256::new();
    for (c, values) in credentials.iter().zip(presented) {
        let label = c.label();
        h.update((label.len() as u32).to_be_bytes());
        h.update(label.as_bytes());
        h.update((values.len() as u32).to_be_bytes());
        for v in values {
            h.update((v.len() as u32).to_be_bytes());
            h.update(v);
        }
    }
    h.finalize().into()
}

/// The tenant of the `credentials` source. `Authorization` alone keeps the
/// digest gateways used before the source was configurable (`auth_…` of
/// the header's value), so keys recorded before an upgrade still replay.
fn credential_tenant(credentials: &[Credential], presented: &[Vec<&[u8]>]) -> Tenant {
    let (prefix, digest): (&[u8; 5], [u8; 32]) = match (credentials, presented) {
        ([Credential::Authorization], [values]) if values.len() == 1 => (b"auth_", Sha256::digest(values[0]).into()),
        _ => (b"cred_", digest(credentials, presented)),
    };
    // The prefix and the digest's first 20 bytes in hex, written in place:
    // the tenant's own name is the only allocation.
    let mut name = [0u8; 45];
    name[..5].copy_from_slice(prefix);
    hex::encode_to_slice(&digest[..20], &mut name[5..]).expect("40 hex digits fit");
    Tenant::new(std::str::from_utf8(&name).expect("ASCII")).expect("a hex digest is a valid tenant")
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
    fn new(config: &IdentityConfig, client: reqwest::Client, upstream: &reqwest::Url) -> Result<Self, ConfigError> {
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

    async fn tenant(&self, credentials: &[Credential], presented: &[Vec<&[u8]>]) -> Result<Tenant, Refusal> {
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

/// Identity answers per credential digest, for a bounded time, at most a
/// bounded number (the oldest answer goes first).
struct Cache {
    ttl: Duration,
    max: usize,
    inner: Mutex<CacheInner>,
}

#[derive(Default)]
struct CacheInner {
    /// The answer, until when it holds, and the number of its insertion.
    entries: HashMap<[u8; 32], (Tenant, tokio::time::Instant, u64)>,
    /// Insertions, oldest first.
    order: VecDeque<([u8; 32], u64)>,
    inserted: u64,
}

impl Cache {
    fn new(ttl: Duration, max: usize) -> Self {
        Self {
            ttl,
            max: max.max(1),
            inner: Mutex::default(),
        }
    }

    fn get(&self, digest: &[u8; 32]) -> Option<Tenant> {
        let now = tokio::time::Instant::now();
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        match inner.entries.get(digest) {
            Some((tenant, until, _)) if *until > now => Some(tenant.clone()),
            Some(_) => {
                inner.entries.remove(digest);
                None
            }
            None => None,
        }
    }

    fn insert(&self, digest: [u8; 32], tenant: Tenant) {
        let until = tokio::time::Instant::now() + self.ttl;
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let CacheInner {
            entries,
            order,
            inserted,
        } = &mut *inner;
        *inserted += 1;
        entries.insert(digest, (tenant, until, *inserted));
        order.push_back((digest, *inserted));
        let live = |entries: &HashMap<[u8; 32], (Tenant, tokio::time::Instant, u64)>, d: &[u8; 32], n: u64| {
            entries.get(d).is_some_and(|(_, _, m)| *m == n)
        };
        while entries.len() > self.max {
            let Some((old, n)) = order.pop_front() else { break };
            if live(entries, &old, n) {
                entries.remove(&old);
            }
        }
        // An answer inserted again leaves its older insertion in the queue;
        // those are dropped once they outnumber the answers.
        if order.len() > 2 * self.max {
            order.retain(|(d, n)| live(entries, d, *n));
        }
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.inner.lock().unwrap().entries.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(headers: &[(&str, &str)]) -> Parts {
        let mut b = axum::http::Request::builder().method("POST").uri("/");
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        b.body(()).unwrap().into_parts().0
    }

    fn tenants(credentials: &[&str]) -> Tenants {
        let config = TenantConfig {
            source: TenantSource::Credentials,
            credentials: credentials.iter().map(|s| (*s).to_owned()).collect(),
            header: None,
            identity: None,
        };
        config.validate(false).unwrap();
        Tenants::new(
            &config,
            crate::proxy::Proxy::client(std::time::Duration::from_secs(5), None).unwrap(),
            &"http://127.0.0.1:9".parse().unwrap(),
        )
        .unwrap()
    }

    async fn tenant(t: &Tenants, headers: &[(&str, &str)]) -> Result<String, StatusCode> {
        t.resolve(&parts(headers))
            .await
            .map(|t| t.as_str().to_owned())
            .map_err(|r| r.status())
    }

    /// Authorization alone keeps the tenant gateways gave it before, so recorded keys still replay after an upgrade.
    #[tokio::test]
    async fn authorization_keeps_its_former_digest() {
        let t = tenants(&["authorization"]);
        let a = tenant(&t, &[("authorization", "Bearer a")]).await.unwrap();
        let expected = format!("auth_{}", &hex::encode(Sha256::digest(b"Bearer a"))[..40]);
        assert_eq!(a, expected);
        assert_ne!(a, tenant(&t, &[("authorization", "Bearer b")]).await.unwrap());
        assert_eq!(tenant(&t, &[]).await, Err(StatusCode::UNAUTHORIZED));
    }

    /// Cookie and header credentials: different callers never share a tenant, the same caller always does.
    #[tokio::test]
    async fn credentials_scope_callers_apart() {
        let t = tenants(&["header:x-api-key", "cookie:session"]);
        let alice = tenant(&t, &[("cookie", "theme=dark; session=alice")]).await.unwrap();
        assert_eq!(
            alice,
            tenant(&t, &[("cookie", "session=alice; theme=light")]).await.unwrap()
        );
        assert_ne!(alice, tenant(&t, &[("cookie", "session=bob")]).await.unwrap());
        let key = tenant(&t, &[("x-api-key", "k1")]).await.unwrap();
        assert_ne!(key, alice);
        assert_ne!(
            key,
            tenant(&t, &[("x-api-key", "k1"), ("cookie", "session=alice")])
                .await
                .unwrap()
        );
        assert_eq!(
            tenant(&t, &[("cookie", "theme=dark")]).await,
            Err(StatusCode::UNAUTHORIZED),
            "an unlisted cookie is no credential"
        );
        assert!(alice.starts_with("cred_"));
    }

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

    /// The cache forgets answers after its time and keeps at most its size, the oldest going first.
    #[tokio::test(start_paused = true)]
    async fn the_cache_is_bounded_in_time_and_size() {
        let cache = Cache::new(Duration::from_secs(60), 2);
        let t = |n: &str| Tenant::new(n).unwrap();
        cache.insert([1; 32], t("a"));
        cache.insert([2; 32], t("b"));
        assert_eq!(cache.get(&[1; 32]), Some(t("a")));
        cache.insert([3; 32], t("c"));
        assert_eq!(cache.len(), 2);
        assert_eq!(cache.get(&[1; 32]), None, "the oldest went first");
        for _ in 0..100 {
            cache.insert([2; 32], t("b"));
        }
        assert_eq!(cache.len(), 2);
        assert_eq!(cache.get(&[3; 32]), Some(t("c")));
        tokio::time::advance(Duration::from_secs(61)).await;
        assert_eq!(cache.get(&[2; 32]), None, "expired");
    }

    /// A principal name that is no valid tenant still gets one, apart from every valid name.
    #[test]
    fn identity_tenants() {
        assert_eq!(identity_tenant("u_1").as_str(), "id:u_1");
        let long = "x".repeat(300);
        assert!(identity_tenant(&long).as_str().starts_with("idh:"));
    }
}
