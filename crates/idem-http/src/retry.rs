//! [`RetryTransaction`]: a handler's request to run its transaction again.

use axum_core::response::{IntoResponse, IntoResponseParts, Response, ResponseParts};
use http::StatusCode;

use crate::problem::{DEFAULT_PROBLEM_BASE, Problem, slugs};

/// A marker a handler puts in its response's extensions to say that its
/// transaction lost a race — one of its own statements failed with a
/// deadlock or a serialisation failure (PostgreSQL `40001`/`40P01`, MySQL
/// `1213`) — and should be run again.
///
/// Behind a transactional [`IdempotencyLayer`](crate::IdempotencyLayer),
/// on a request with a key, the layer then rolls the transaction back
/// (nothing is recorded and nothing commits) and calls the handler again
/// with the same, buffered request in a new transaction, a bounded number
/// of times with a short jittered backoff
/// ([`ContentionRetries`](idem_core::ContentionRetries)). If every run asks
/// again, the client gets a 503 `idempotency-transaction-conflict` problem
/// and may retry with the same key. Elsewhere the marker does nothing, and
/// the response is sent as it is.
///
/// It is a response part and a response of its own (a 503 problem with the
/// marker), so a handler can return it directly:
///
/// ```
/// use axum::response::{IntoResponse, Response};
/// use http::StatusCode;
/// use idem_http::RetryTransaction;
///
/// fn respond(db: Result<String, sqlx_like::Error>) -> Response {
///     match db {
///         Ok(body) => (StatusCode::CREATED, body).into_response(),
///         Err(e) if e.is_contention() => RetryTransaction.into_response(),
///         Err(_) => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
///     }
/// }
/// # mod sqlx_like { pub struct Error; impl Error { pub fn is_contention(&self) -> bool { true } } }
/// let response = respond(Err(sqlx_like::Error));
/// assert_eq!(response.status(), 503);
/// assert!(response.extensions().get::<RetryTransaction>().is_some());
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct RetryTransaction;

impl IntoResponseParts for RetryTransaction {
    type Error = std::convert::Infallible;

    fn into_response_parts(self, mut res: ResponseParts) -> Result<ResponseParts, Self::Error> {
        res.extensions_mut().insert(self);
        Ok(res)
    }
}

impl IntoResponse for RetryTransaction {
    fn into_response(self) -> Response {
        let mut response = conflict().into_response(DEFAULT_PROBLEM_BASE);
        response.extensions_mut().insert(self);
        response
    }
}

/// The problem sent when a transaction lost every race it was allowed.
pub(crate) fn conflict() -> Problem {
    Problem::new(
        StatusCode::SERVICE_UNAVAILABLE,
        slugs::TRANSACTION_CONFLICT,
        "Transaction conflict",
    )
    .with_detail(
        "the request's transaction kept conflicting with concurrent ones and was not applied; \
         retry with the same Idempotency-Key",
    )
    .with_retry_after_secs(1)
}
