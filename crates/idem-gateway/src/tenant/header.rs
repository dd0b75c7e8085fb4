//! The `header` source: the tenant a trusted proxy in front names in a
//! header (the door accepts that header only from `trusted_proxies`).

use axum::http::{HeaderMap, HeaderName, StatusCode};
use idem_core::Tenant;

use super::{Refusal, problem};

/// The tenant in the one `name` header of a request, or the answer that
/// refuses it (no such header, several, or a value that is no tenant).
pub(super) fn header_tenant(name: &HeaderName, headers: &HeaderMap) -> Result<Tenant, Refusal> {
    let mut values = headers.get_all(name).iter();
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
