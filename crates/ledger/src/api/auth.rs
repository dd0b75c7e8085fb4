//! Bearer tokens and the tenants they stand for.

use std::collections::HashSet;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode, header, request::Parts};
use axum::middleware::Next;
use axum::response::Response;
use idem_core::Tenant;
use idem_http::{DEFAULT_PROBLEM_BASE, Problem};
use sha2::{Digest, Sha256};

use super::Principal;

fn unauthorized() -> Problem {
    Problem::new(StatusCode::UNAUTHORIZED, "unauthorized", "Unauthorized")
        .with_detail("send Authorization: Bearer <token>")
}

/// The tenant of an authenticated request, for the idempotency layer.
pub(super) fn tenant_of(parts: &Parts) -> Result<Tenant, Problem> {
    parts
        .extensions
        .get::<Principal>()
        .map(|p| p.tenant.clone())
        .ok_or_else(unauthorized)
}

/// The tenant of a bearer token: `t_` and the first 40 hex digits of its SHA-256.
pub fn tenant_for_token(token: &str) -> Tenant {
    let digest = Sha256::digest(token.as_bytes());
    Tenant::new(format!("t_{}", &hex::encode(digest)[..40])).expect("a hex digest is a valid tenant")
}

/// The token of an `Authorization: Bearer <token>` value. The scheme is
/// case-insensitive (RFC 9110 §11.1); the token is a token68 (RFC 6750) of at
/// most 1024 characters.
pub fn bearer_token(value: &str) -> Option<&str> {
    let (scheme, token) = value.trim().split_once(' ')?;
    if !scheme.eq_ignore_ascii_case("bearer") {
        return None;
    }
    let token = token.trim_start_matches(' ');
    let body = token.trim_end_matches('=');
    let token68 = !body.is_empty()
        && body
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~' | b'+' | b'/'));
    (token68 && token.len() <= 1024).then_some(token)
}

/// Refuses a request without an accepted bearer token (401); otherwise
/// marks it with its [`Principal`].
pub(super) async fn authenticate(State(tokens): State<Arc<HashSet<String>>>, mut req: Request, next: Next) -> Response {
    let token = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(bearer_token)
        .filter(|token| tokens.is_empty() || tokens.contains(*token));
    match token {
        Some(token) => {
            let tenant = tenant_for_token(token);
            req.extensions_mut().insert(Principal { tenant });
            next.run(req).await
        }
        None => {
            let mut response = unauthorized().into_response(DEFAULT_PROBLEM_BASE);
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            response
        }
    }
}
