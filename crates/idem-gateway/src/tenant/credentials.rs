//! The `credentials` source: the credentials a caller presents
//! (`authorization`, `header:NAME`, `cookie:NAME`) and the digest of them
//! that names its tenant; the `identity` source sends the same credentials
//! and caches by the same digest.

use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode, header};
use idem_core::Tenant;
use sha2::{Digest, Sha256};

use super::{Refusal, problem};

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

pub(super) fn parse_credentials(raw: &[String]) -> Result<Vec<Credential>, String> {
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

/// The values of each credential; refused when none is sent.
pub(super) fn presented<'a>(credentials: &[Credential], headers: &'a HeaderMap) -> Result<Vec<Vec<&'a [u8]>>, Refusal> {
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
pub(super) fn digest(credentials: &[Credential], presented: &[Vec<&[u8]>]) -> [u8; 32] {
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
pub(super) fn credential_tenant(credentials: &[Credential], presented: &[Vec<&[u8]>]) -> Tenant {
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

#[cfg(test)]
mod tests {
    use axum::http::request::Parts;

    use super::*;
    use crate::tenant::{TenantConfig, TenantSource, Tenants};

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
}
