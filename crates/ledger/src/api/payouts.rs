//! Payouts: requested (the account debited at once), read, and cancelled
//! once the vendor is known not to have paid them.

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use idem_http::Tx;
use serde::Deserialize;

use super::body::{JsonBody, account_id, amount, whole_number};
use super::problem::problem;
use super::{ApiError, AppState, Principal};
use crate::db::{DbError, LedgerDb, LedgerTx, Payout, PayoutState};

#[derive(Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct NewPayout {
    /// The account debited.
    #[schema(pattern = r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")]
    account_id: String,
    /// Minor units.
    #[schema(minimum = 1, maximum = 1_000_000_000_000_i64)]
    #[serde(deserialize_with = "whole_number")]
    amount: i64,
}

#[derive(serde::Serialize, utoipa::ToSchema)]
pub(crate) struct PayoutRequested {
    /// The payout id: the key the vendor sees.
    id: String,
    account_id: String,
    amount: i64,
    /// The account's balance right after the debit.
    balance: i64,
    /// `requested`: the payout worker pays it at the vendor.
    status: PayoutState,
}

/// Debits the account now and leaves the vendor call to the payout worker:
/// the payout row and its `payout.requested` event commit with the debit.
pub(super) async fn request_payout<D: LedgerDb>(
    State(st): State<AppState<D>>,
    Extension(who): Extension<Principal>,
    mut tx: Tx<D>,
    JsonBody(req): JsonBody<NewPayout>,
) -> Result<(StatusCode, Json<PayoutRequested>), ApiError> {
    account_id("account_id", &req.account_id)?;
    let amount = amount(req.amount)?;
    let id = uuid::Uuid::now_v7().to_string();
    let now_ms = st.clock.now_ms();
    let tenant = who.tenant.as_str();
    let payout = crate::db::NewPayout {
        tenant,
        id: &id,
        account_id: &req.account_id,
        amount,
    };
    let balance = tx.request_payout(&payout, now_ms).await?;
    let data = serde_json::json!({ "payout_id": id, "account_id": req.account_id, "amount": amount });
    st.events
        .enqueue(&mut tx, "payout.requested", tenant, now_ms, data)
        .await?;
    Ok((
        StatusCode::CREATED,
        Json(PayoutRequested {
            id,
            account_id: req.account_id,
            amount,
            balance,
            status: PayoutState::Requested,
        }),
    ))
}

/// The payout `id` of `tenant`; a malformed id is not found either.
async fn find_payout<D: LedgerDb>(st: &AppState<D>, tenant: &str, id: &str) -> Result<Payout, Response> {
    let missing = || {
        problem(
            StatusCode::NOT_FOUND,
            "payout-not-found",
            "Payout not found",
            format!("no payout {id}"),
        )
    };
    if account_id("id", id).is_err() {
        return Err(missing());
    }
    match st.db.payout(tenant, id).await {
        Ok(Some(payout)) => Ok(payout),
        Ok(None) => Err(missing()),
        Err(e) => Err(ApiError::Db(e).into_response()),
    }
}

/// `GET /v1/payouts/{id}`.
pub(super) async fn get_payout<D: LedgerDb>(
    State(st): State<AppState<D>>,
    Extension(who): Extension<Principal>,
    Path(id): Path<String>,
) -> Result<Json<Payout>, Response> {
    Ok(Json(find_payout(&st, who.tenant.as_str(), &id).await?))
}

/// The answer to a cancelled payout.
#[derive(serde::Serialize, utoipa::ToSchema)]
pub(crate) struct PayoutCancelled {
    /// The payout id.
    id: String,
    account_id: String,
    amount: i64,
    /// `cancelled`.
    status: PayoutState,
}

/// `POST /v1/payouts/{id}/cancel`: cancels a dead-lettered or unknown
/// payout that the vendor is known not to have paid (its dead letter's
/// verdict is "not applied", and nothing was sent since), reversing the
/// debit. The payout, its reversal, its event and its dead letter change in
/// one transaction, once (a retry with the key replays). Anything else is a
/// 409 problem and nothing is written: a payout that may have been paid is
/// never cancelled.
pub(super) async fn cancel_payout<D: LedgerDb>(
    State(st): State<AppState<D>>,
    Extension(who): Extension<Principal>,
    Path(id): Path<String>,
    mut tx: Tx<D>,
) -> Result<(StatusCode, Json<PayoutCancelled>), Response> {
    use idem_core::DeadLetterStore as _;
    let tenant = who.tenant.as_str();
    let payout = find_payout(&st, tenant, &id).await?;
    let db_error = |e: DbError| ApiError::Db(e).into_response();
    let not_cancellable = |state: &str| {
        problem(
            StatusCode::CONFLICT,
            "payout-not-cancellable",
            "Payout not cancellable",
            format!("payout {id} is {state}: only a dead-lettered or unknown payout can be cancelled"),
        )
    };
    if !matches!(payout.status, PayoutState::DeadLettered | PayoutState::Unknown) {
        return Err(not_cancellable(payout.status.as_str()));
    }
    let letters = st.db.dead_letters();
    let scope = idem_core::Scope::parse(tenant, crate::payouts::PAYOUT_OPERATION).map_err(|e| db_error(e.into()))?;
    let key = idem_core::IdempotencyKey::new(&id).map_err(|e| db_error(e.into()))?;
    let letter = letters.find(&scope, &key).await.map_err(|e| db_error(e.into()))?;
    let not_reconciled = |detail: String| {
        problem(
            StatusCode::CONFLICT,
            "payout-not-reconciled",
            "Payout not reconciled",
            detail,
        )
    };
    let Some(letter) = letter.filter(idem_core::DeadLetter::known_not_applied) else {
        return Err(not_reconciled(format!(
            "the vendor is not known not to have paid payout {id}: it may have been paid, so it is not cancelled. \
             Check the vendor, then record what it says with `idem dlq resolve` on its dead letter"
        )));
    };
    if !D::cancel_dead_letter(&letters, &mut tx, letter.id)
        .await
        .map_err(db_error)?
    {
        return Err(not_reconciled(format!(
            "the dead letter of payout {id} changed meanwhile (a redrive holds it, or it was settled); try again"
        )));
    }
    let now_ms = st.clock.now_ms();
    if !tx.cancel_payout(tenant, &id, now_ms).await.map_err(db_error)? {
        return Err(not_cancellable("no longer dead-lettered or unknown"));
    }
    let data = serde_json::json!({ "payout_id": id, "account_id": payout.account_id, "amount": payout.amount });
    st.events
        .enqueue(&mut tx, "payout.cancelled", tenant, now_ms, data)
        .await
        .map_err(db_error)?;
    Ok((
        StatusCode::OK,
        Json(PayoutCancelled {
            id,
            account_id: payout.account_id,
            amount: payout.amount,
            status: PayoutState::Cancelled,
        }),
    ))
}
