//! The service's own routes: health, metrics and the OpenAPI document, and
//! the answers to a route or method that does not exist.

use axum::Json;
use axum::extract::{Request, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};

use super::AppState;
use super::problem::problem;
use crate::db::LedgerDb;

/// `GET /healthz`: 200 while the database answers and no events setting
/// was refused at start.
pub(super) async fn healthz<D: LedgerDb>(State(st): State<AppState<D>>) -> Response {
    let refused = st.events_health.refused();
    if !refused.is_empty() {
        return problem(
            StatusCode::SERVICE_UNAVAILABLE,
            "events-configuration-refused",
            "Events configuration refused",
            refused.join("; "),
        );
    }
    match st.db.ping().await {
        Ok(()) => Json(serde_json::json!({"status": "ok"})).into_response(),
        Err(e) => problem(
            StatusCode::SERVICE_UNAVAILABLE,
            "database-unavailable",
            "Database unavailable",
            e.to_string(),
        ),
    }
}

/// `GET /metrics`: Prometheus's text format, when metrics are enabled.
pub(super) async fn metrics_text<D: LedgerDb>(State(st): State<AppState<D>>) -> Response {
    match &st.metrics {
        Some(handle) => ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], handle.render()).into_response(),
        None => problem(
            StatusCode::NOT_FOUND,
            "not-found",
            "Not found",
            "metrics are not enabled",
        ),
    }
}

/// `GET /openapi.json`: the API's OpenAPI document.
pub(super) async fn openapi_json() -> Json<serde_json::Value> {
    static DOCUMENT: std::sync::OnceLock<serde_json::Value> = std::sync::OnceLock::new();
    Json(DOCUMENT.get_or_init(crate::openapi::document_json).clone())
}

/// A 404 problem for a route that does not exist.
pub(super) async fn not_found(req: Request) -> Response {
    problem(
        StatusCode::NOT_FOUND,
        "not-found",
        "Not found",
        format!("no route for {} {}", req.method(), req.uri().path()),
    )
}

/// A 405 problem for a method a route does not take.
pub(super) async fn method_not_allowed(req: Request) -> Response {
    problem(
        StatusCode::METHOD_NOT_ALLOWED,
        "method-not-allowed",
        "Method not allowed",
        format!("{} is not allowed on {}", req.method(), req.uri().path()),
    )
}
