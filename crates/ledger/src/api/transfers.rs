//! Top-ups (money in from `@world`) and transfers between accounts.

use axum::extract::State;
use axum::http::StatusCode;
use axum::{Extension, Json};
use idem_http::Tx;
use serde::Deserialize;

use super::body::{JsonBody, account_id, amount, whole_number};
use super::{ApiError, AppState, Principal};
use crate::db::{LedgerDb, LedgerTx};

#[derive(Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct NewTopUp {
    /// The account to credit.
    #[schema(pattern = r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")]
    account_id: String,
    /// Minor units.
    #[schema(minimum = 1, maximum = 1_000_000_000_000_i64)]
    #[serde(deserialize_with = "whole_number")]
    amount: i64,
}

#[derive(Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct NewTransfer {
    /// The account debited.
    #[schema(pattern = r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")]
    from: String,
    /// The account credited (another one).
    #[schema(pattern = r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")]
    to: String,
    /// Minor units.
    #[schema(minimum = 1, maximum = 1_000_000_000_000_i64)]
    #[serde(deserialize_with = "whole_number")]
    amount: i64,
}

#[derive(serde::Serialize, utoipa::ToSchema)]
pub(crate) struct TopUpDone {
    id: String,
    account_id: String,
    amount: i64,
    balance: i64,
}

#[derive(serde::Serialize, utoipa::ToSchema)]
pub(crate) struct TransferDone {
    id: String,
    from: String,
    to: String,
    amount: i64,
}

/// `POST /v1/top-ups`: credits an account from `@world`.
pub(super) async fn top_up<D: LedgerDb>(
    State(st): State<AppState<D>>,
    Extension(who): Extension<Principal>,
    mut tx: Tx<D>,
    JsonBody(req): JsonBody<NewTopUp>,
) -> Result<(StatusCode, Json<TopUpDone>), ApiError> {
    account_id("account_id", &req.account_id)?;
    let amount = amount(req.amount)?;
    let id = uuid::Uuid::now_v7().to_string();
    let now_ms = st.clock.now_ms();
    let tenant = who.tenant.as_str();
    let balance = tx
        .top_up(tenant, &id, "top_up", &req.account_id, amount, now_ms)
        .await?;
    let data = serde_json::json!({ "journal_id": id, "account_id": req.account_id, "amount": amount });
    st.events
        .enqueue(&mut tx, "top_up.created", tenant, now_ms, data)
        .await?;
    Ok((
        StatusCode::CREATED,
        Json(TopUpDone {
            id,
            account_id: req.account_id,
            amount,
            balance,
        }),
    ))
}

/// `POST /v1/transfers`: moves money between two of the caller's accounts.
pub(super) async fn transfer<D: LedgerDb>(
    State(st): State<AppState<D>>,
    Extension(who): Extension<Principal>,
    mut tx: Tx<D>,
    JsonBody(req): JsonBody<NewTransfer>,
) -> Result<(StatusCode, Json<TransferDone>), ApiError> {
    account_id("from", &req.from)?;
    account_id("to", &req.to)?;
    if req.from == req.to {
        return Err(ApiError::SameAccount);
    }
    let amount = amount(req.amount)?;
    let id = uuid::Uuid::now_v7().to_string();
    let now_ms = st.clock.now_ms();
    let tenant = who.tenant.as_str();
    tx.transfer(tenant, &id, &req.from, &req.to, amount, now_ms).await?;
    let data = serde_json::json!({ "journal_id": id, "from": req.from, "to": req.to, "amount": amount });
    st.events
        .enqueue(&mut tx, "transfer.created", tenant, now_ms, data)
        .await?;
    Ok((
        StatusCode::CREATED,
        Json(TransferDone {
            id,
            from: req.from,
            to: req.to,
            amount,
        }),
    ))
}
