//! Errors of the API as RFC 9457 problem responses.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use idem_core::Contention;
use idem_http::{DEFAULT_PROBLEM_BASE, Problem, RetryTransaction};

use crate::db::DbError;

/// A problem response: `status`, a type named by `slug`, a title and what
/// happened in this case.
pub(super) fn problem(status: StatusCode, slug: &str, title: &str, detail: impl Into<String>) -> Response {
    Problem::new(status, slug, title)
        .with_detail(detail)
        .into_response(DEFAULT_PROBLEM_BASE)
}

/// `response`, telling the client to try again in a second.
pub(super) fn retry_soon(mut response: Response) -> Response {
    response
        .headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    response
}

/// The 415 problem of a body that is not JSON, with
/// `Accept-Post: application/json`.
pub(super) fn unsupported_media_type(detail: &str) -> Response {
    let mut r = problem(
        StatusCode::UNSUPPORTED_MEDIA_TYPE,
        "unsupported-media-type",
        "Unsupported media type",
        detail,
    );
    r.headers_mut()
        .insert("accept-post", HeaderValue::from_static("application/json"));
    r
}

/// Errors of the API, each a problem response.
#[derive(Debug)]
pub enum ApiError {
    /// 400: the request is malformed.
    Invalid(String),
    /// 400: an amount is out of range.
    Amount(String),
    /// 422: a transfer from an account to itself.
    SameAccount,
    /// From the database.
    Db(DbError),
}

impl From<DbError> for ApiError {
    fn from(e: DbError) -> Self {
        ApiError::Db(e)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        match self {
            ApiError::Invalid(detail) => problem(StatusCode::BAD_REQUEST, "invalid-request", "Invalid request", detail),
            ApiError::Amount(detail) => problem(StatusCode::BAD_REQUEST, "invalid-amount", "Invalid amount", detail),
            ApiError::SameAccount => problem(
                StatusCode::UNPROCESSABLE_ENTITY,
                "same-account",
                "Same account",
                "from and to must be different accounts",
            ),
            ApiError::Db(DbError::AccountNotFound(id)) => problem(
                StatusCode::NOT_FOUND,
                "account-not-found",
                "Account not found",
                format!("no account {id}"),
            ),
            ApiError::Db(e @ DbError::InsufficientFunds { .. }) => problem(
                StatusCode::UNPROCESSABLE_ENTITY,
                "insufficient-funds",
                "Insufficient funds",
                e.to_string(),
            ),
            ApiError::Db(e @ DbError::BalanceLimit) => problem(
                StatusCode::UNPROCESSABLE_ENTITY,
                "balance-limit",
                "Balance limit",
                e.to_string(),
            ),
            ApiError::Db(e) if e.is_contention() => {
                // The handler's transaction lost a race; nothing of it
                // commits. The idempotency layer runs the request again in a
                // new transaction, a bounded number of times.
                tracing::debug!(error = %e, "contention; asking for the transaction to run again");
                let mut r = retry_soon(problem(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "database-conflict",
                    "Database conflict",
                    "the request conflicted with concurrent ones and was not applied; retry it with the same Idempotency-Key",
                ));
                r.extensions_mut().insert(RetryTransaction);
                r
            }
            ApiError::Db(e) => {
                tracing::warn!(error = %e, "database error");
                retry_soon(problem(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "database-unavailable",
                    "Database unavailable",
                    "the request was not applied; retry it with the same Idempotency-Key",
                ))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A database error that is contention asks the idempotency layer to run the transaction again; other errors do not.
    #[test]
    fn contention_asks_for_a_rerun() {
        let kind = idem_core::StoreErrorKind::Serialization;
        let lost = ApiError::Db(DbError::Idem(idem_core::Error::store(kind, "40001"))).into_response();
        assert_eq!(lost.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert!(lost.extensions().get::<RetryTransaction>().is_some());
        let down = idem_core::StoreErrorKind::Unavailable;
        let gone = ApiError::Db(DbError::Idem(idem_core::Error::store(down, "gone"))).into_response();
        assert_eq!(gone.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert!(gone.extensions().get::<RetryTransaction>().is_none());
    }
}
