//! RFC 9457 problem details (`application/problem+json`).

use axum_core::body::Body;
use http::{HeaderValue, Response, StatusCode, header};

/// The default base of problem `type` URIs; each type appends its slug
/// (`…/idempotency-key-missing`).
pub const DEFAULT_PROBLEM_BASE: &str = "https://idem.dev/problems/";

/// The `Content-Type` of problem responses.
pub const PROBLEM_JSON: &str = "application/problem+json";

/// An RFC 9457 problem: a machine-readable error response.
///
/// ```
/// use idem_http::Problem;
/// use http::StatusCode;
/// let p = Problem::new(StatusCode::UNPROCESSABLE_ENTITY, "insufficient-funds", "Insufficient funds")
///     .with_detail("the account holds 5 but 7 were asked");
/// let response = p.into_response(idem_http::DEFAULT_PROBLEM_BASE);
/// assert_eq!(response.status(), 422);
/// assert_eq!(response.headers()["content-type"], "application/problem+json");
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    status: StatusCode,
    slug: String,
    title: String,
    detail: String,
    retry_after_secs: Option<u64>,
    members: Vec<(&'static str, String)>,
}

impl Problem {
    /// A problem with a status, a stable slug (the last segment of its
    /// `type` URI) and a short human title.
    pub fn new(status: StatusCode, slug: impl Into<String>, title: impl Into<String>) -> Self {
        Self {
            status,
            slug: slug.into(),
            title: title.into(),
            detail: String::new(),
            retry_after_secs: None,
            members: Vec::new(),
        }
    }

    /// Adds the occurrence-specific explanation.
    pub fn with_detail(mut self, detail: impl Into<String>) -> Self {
        self.detail = detail.into();
        self
    }

    /// Adds a `Retry-After` header, in whole seconds.
    pub fn with_retry_after_secs(mut self, secs: u64) -> Self {
        self.retry_after_secs = Some(secs);
        self
    }

    /// Adds an extension member with a string value (RFC 9457 §3.2), such
    /// as the step a multi-step operation stands at. A member named as one
    /// of the standard ones (`type`, `title`, `status`, `detail`,
    /// `instance`) is ignored.
    pub fn with_member(mut self, name: &'static str, value: impl Into<String>) -> Self {
        if !matches!(name, "type" | "title" | "status" | "detail" | "instance") {
            self.members.push((name, value.into()));
        }
        self
    }

    /// The HTTP status.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// The slug of the `type` URI.
    pub fn slug(&self) -> &str {
        &self.slug
    }

    /// Renders the problem with `type` = `base` + slug.
    pub fn into_response(self, base: &str) -> Response<Body> {
        let mut body = serde_json::json!({
            "type": format!("{base}{}", self.slug),
            "title": self.title,
            "status": self.status.as_u16(),
            "detail": if self.detail.is_empty() { self.title.clone() } else { self.detail },
        });
        if let Some(object) = body.as_object_mut() {
            for (name, value) in self.members {
                object.insert(name.to_owned(), serde_json::Value::String(value));
            }
        }
        let bytes = serde_json::to_vec(&body).unwrap_or_default();
        let mut response = Response::new(Body::from(bytes));
        *response.status_mut() = self.status;
        response
            .headers_mut()
            .insert(header::CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
        if let Some(secs) = self.retry_after_secs {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        response
    }
}

/// Slugs of the problems the layer itself returns.
pub mod slugs {
    /// 400: a mutating request on a route that requires a key has none.
    pub const KEY_MISSING: &str = "idempotency-key-missing";
    /// 400: the key header is not a valid key.
    pub const KEY_INVALID: &str = "idempotency-key-invalid";
    /// 422: the key was used before with a different request.
    pub const KEY_REUSED: &str = "idempotency-key-reused";
    /// 409: a request with the same key is still being processed.
    pub const KEY_IN_FLIGHT: &str = "idempotency-key-in-flight";
    /// 409: an earlier request with the same key may have taken effect and
    /// nobody knows whether it did; the key is held until an operator
    /// resolves it (`idem keys resolve`) or a reconciliation does.
    pub const OUTCOME_UNKNOWN: &str = "idempotency-outcome-unknown";
    /// 413: the request body exceeds the configured limit.
    pub const BODY_TOO_LARGE: &str = "request-body-too-large";
    /// 400: the request body could not be read.
    pub const BODY_UNREADABLE: &str = "request-body-unreadable";
    /// 408: the request body stopped arriving: reading it failed with an
    /// [`std::io::ErrorKind::TimedOut`] error (as a read timeout of the
    /// server's reports it); nothing was claimed.
    pub const BODY_TIMEOUT: &str = "request-body-timeout";
    /// 500: a response to be recorded exceeded the record limit
    /// (transactional mode: the work was rolled back; lease mode: replayed in
    /// place of the response). Responses that are not recorded are never
    /// bounded by it.
    pub const RESPONSE_TOO_LARGE: &str = "idempotency-response-too-large";
    /// 500 (transactional mode): the handler's response body failed while
    /// it was read for recording; nothing was applied.
    pub const RESPONSE_FAILED: &str = "idempotency-response-failed";
    /// 503 (transactional mode): the request's transaction kept losing races
    /// with concurrent ones (deadlocks, serialisation failures) after its
    /// bounded re-runs; nothing was applied.
    pub const TRANSACTION_CONFLICT: &str = "idempotency-transaction-conflict";
    /// 503: the idempotency store failed; nothing was recorded.
    pub const STORE_UNAVAILABLE: &str = "idempotency-store-unavailable";
    /// 409: a multi-step operation is held at a step (a failed
    /// compensation, too many runs, a changed definition, an operator's
    /// hold) until an operator acts (`idem ops`).
    pub const OPERATION_HELD: &str = "idempotency-operation-held";
    /// 500: the handler kept the transaction past its response.
    pub const TRANSACTION_UNAVAILABLE: &str = "idempotency-transaction-unavailable";
}
