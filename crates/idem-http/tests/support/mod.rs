//! What several lease-mode test files share: one tenant for every request,
//! and a keyed JSON `POST /pay`.

use axum::body::Body;
use axum::http::Request;
use idem_core::Tenant;
use idem_http::Problem;

/// Every request is tenant `t`.
pub(crate) fn tenant(_: &http::request::Parts) -> Result<Tenant, Problem> {
    Ok(Tenant::new("t").expect("valid tenant"))
}

/// `POST /pay` with `{}` and the key `key`.
pub(crate) fn post_with_key(key: &str) -> Request<Body> {
    Request::builder()
        .method("POST")
        .uri("/pay")
        .header("idempotency-key", format!("\"{key}\""))
        .header("content-type", "application/json")
        .body(Body::from("{}"))
        .expect("valid request")
}
