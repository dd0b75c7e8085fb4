//! Withdrawals: `POST /v1/withdrawals` served by the multi-step operation
//! `withdrawal@1` through idem's steps service (`idem_http::steps`), and
//! `GET /v1/withdrawals/{id}`.

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::request::Parts;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use idem_http::steps::HttpOperation;
use idem_http::{DEFAULT_PROBLEM_BASE, Problem};
use serde::Deserialize;

use super::body::{account_id, amount, json_object, media_type, whole_number};
use super::problem::problem;
use super::{ApiError, AppState, Principal};
use crate::db::{LedgerDb, Withdrawal};
use crate::withdrawals::{Withdraw, WithdrawalInput, Withdrawn};

/// The longest destination, in bytes.
pub const MAX_DESTINATION: usize = 100;

#[derive(Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct NewWithdrawal {
    /// The account debited.
    #[schema(pattern = r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")]
    account: String,
    /// Minor units of `currency`.
    #[schema(minimum = 1, maximum = 1_000_000_000_000_i64)]
    #[serde(deserialize_with = "whole_number")]
    amount: i64,
    /// The account's currency: three capital letters.
    #[schema(pattern = "^[A-Z]{3}$")]
    currency: String,
    /// The currency paid out: three capital letters.
    #[schema(pattern = "^[A-Z]{3}$")]
    payout_currency: String,
    /// Where the payout vendor pays it: 1 to 100 visible ASCII characters.
    #[schema(pattern = "^[!-~]{1,100}$")]
    destination: String,
}

fn invalid(slug: &str, title: &str, detail: impl Into<String>) -> Problem {
    Problem::new(StatusCode::BAD_REQUEST, slug, title).with_detail(detail)
}

fn currency(field: &str, code: &str) -> Result<(), Problem> {
    if code.len() == 3 && code.bytes().all(|b| b.is_ascii_uppercase()) {
        Ok(())
    } else {
        Err(invalid(
            "invalid-request",
            "Invalid request",
            format!("{field} must be three capital letters (ISO 4217), got {code:?}"),
        ))
    }
}

/// The request's input, checked: bad input is a problem, and nothing is
/// written.
fn parse(parts: &Parts, body: &Bytes) -> Result<WithdrawalInput, Problem> {
    let tenant = parts
        .extensions
        .get::<Principal>()
        .map(|p| p.tenant.as_str().to_owned())
        .ok_or_else(|| {
            Problem::new(StatusCode::UNAUTHORIZED, "unauthorized", "Unauthorized")
                .with_detail("send Authorization: Bearer <token>")
        })?;
    let json = media_type(&parts.headers)
        .is_some_and(|v| v == "application/json" || (v.starts_with("application/") && v.ends_with("+json")));
    if !json {
        return Err(Problem::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported-media-type",
            "Unsupported media type",
        )
        .with_detail("the request body must be JSON, sent with Content-Type: application/json"));
    }
    let req: NewWithdrawal = json_object(body, "request body")
        .map_err(|detail| invalid("invalid-request", "Invalid request body", detail))?;
    let shown = |e: ApiError| match e {
        ApiError::Amount(detail) => invalid("invalid-amount", "Invalid amount", detail),
        ApiError::Invalid(detail) => invalid("invalid-request", "Invalid request", detail),
        _ => invalid("invalid-request", "Invalid request", "invalid withdrawal"),
    };
    account_id("account", &req.account).map_err(shown)?;
    let amount = amount(req.amount).map_err(shown)?;
    currency("currency", &req.currency)?;
    currency("payout_currency", &req.payout_currency)?;
    let d = &req.destination;
    if d.is_empty() || d.len() > MAX_DESTINATION || !d.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(invalid(
            "invalid-request",
            "Invalid request",
            format!("destination must be 1 to {MAX_DESTINATION} visible ASCII characters"),
        ));
    }
    Ok(WithdrawalInput {
        tenant,
        account: req.account,
        amount,
        currency: req.currency,
        payout_currency: req.payout_currency,
        destination: req.destination,
    })
}

/// A JSON response of `status`.
fn json_response(
    status: StatusCode,
    content_type: &'static str,
    body: &impl serde::Serialize,
) -> axum::http::Response<Bytes> {
    let bytes = serde_json::to_vec(body).unwrap_or_default();
    let mut response = axum::http::Response::new(Bytes::from(bytes));
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(header::CONTENT_TYPE, axum::http::HeaderValue::from_static(content_type));
    response
}

/// A problem response, built from the recorded failure only.
fn problem_bytes(
    status: StatusCode,
    slug: &str,
    title: &str,
    detail: String,
    members: serde_json::Value,
) -> axum::http::Response<Bytes> {
    let mut body = serde_json::json!({
        "type": format!("{DEFAULT_PROBLEM_BASE}{slug}"),
        "title": title,
        "status": status.as_u16(),
        "detail": detail,
    });
    if let (Some(body), Some(members)) = (body.as_object_mut(), members.as_object()) {
        for (k, v) in members {
            body.insert(k.clone(), v.clone());
        }
    }
    json_response(status, "application/problem+json", &body)
}

/// The problem slugs of the refusals of the ledger's rules a withdrawal's
/// debit declares. The debit is the first step, so such a refusal records
/// nothing: a call under the same key runs afresh and reads the balance
/// anew (the refusal's detail may differ; its type does not).
pub const REFUSAL_SLUGS: [&str; 3] = [REFUSALS[0].0, REFUSALS[1].0, REFUSALS[2].0];

/// The refusals of the ledger's rules a withdrawal's debit declares, by
/// code: the code is the problem's slug, with its status and title.
const REFUSALS: [(&str, StatusCode, &str); 3] = [
    (
        "insufficient-funds",
        StatusCode::UNPROCESSABLE_ENTITY,
        "Insufficient funds",
    ),
    ("account-not-found", StatusCode::NOT_FOUND, "Account not found"),
    ("balance-limit", StatusCode::UNPROCESSABLE_ENTITY, "Balance limit"),
];

impl<D: LedgerDb> HttpOperation<D> for Withdraw<D> {
    fn input(&self, parts: &Parts, body: &Bytes) -> Result<WithdrawalInput, Problem> {
        parse(parts, body)
    }

    fn completed(&self, output: &Withdrawn) -> axum::http::Response<Bytes> {
        json_response(StatusCode::CREATED, "application/json", output)
    }

    fn failed(&self, failure: &serde_json::Value) -> axum::http::Response<Bytes> {
        let code = failure["code"].as_str();
        if let Some(&(slug, status, title)) = REFUSALS.iter().find(|(slug, ..)| code == Some(*slug)) {
            let detail = failure["detail"].as_str().unwrap_or_default().to_owned();
            return problem_bytes(status, slug, title, detail, serde_json::Value::Null);
        }
        let reason = crate::withdrawals::reason_of(failure);
        let members = serde_json::json!({
            "step": failure["step"].as_str().unwrap_or("cancelled"),
            "reason": failure["reason"].as_str().unwrap_or(&reason),
        });
        problem_bytes(
            StatusCode::UNPROCESSABLE_ENTITY,
            "withdrawal-declined",
            "Withdrawal declined",
            format!("{reason}; any quote was released and the amount credited back to the account"),
            members,
        )
    }
}

/// `POST /v1/withdrawals` when no FX or payout vendor is configured: 503,
/// nothing written.
pub(super) async fn unavailable() -> Response {
    problem(
        StatusCode::SERVICE_UNAVAILABLE,
        "withdrawals-unavailable",
        "Withdrawals unavailable",
        "this ledger has no FX and payout vendors configured (--fx-url, --vendor-url); nothing was applied",
    )
}

/// `GET /v1/withdrawals/{id}`; a malformed id is not found either.
pub(super) async fn get_withdrawal<D: LedgerDb>(
    State(st): State<AppState<D>>,
    Extension(who): Extension<Principal>,
    Path(id): Path<String>,
) -> Result<Json<Withdrawal>, Response> {
    let missing = || {
        problem(
            StatusCode::NOT_FOUND,
            "withdrawal-not-found",
            "Withdrawal not found",
            format!("no withdrawal {id}"),
        )
    };
    if account_id("id", &id).is_err() {
        return Err(missing());
    }
    match st.db.withdrawal(who.tenant.as_str(), &id).await {
        Ok(Some(w)) => Ok(Json(w)),
        Ok(None) => Err(missing()),
        Err(e) => Err(ApiError::Db(e).into_response()),
    }
}
