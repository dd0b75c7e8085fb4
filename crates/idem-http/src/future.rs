//! The response future of [`Idempotency`](crate::Idempotency).

use axum_core::body::Body;
use http::Response;
use idem_core::BoxFuture;

/// The future returned by [`Idempotency`](crate::Idempotency)'s `call`.
pub type ResponseFuture<E> = BoxFuture<'static, Result<Response<Body>, E>>;
