//! Accounts, their statements and the tenant's audit.

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::{Extension, Json};
use idem_http::Tx;
use serde::Deserialize;

use super::body::{JsonBody, account_id};
use super::{ApiError, AppState, Principal};
use crate::db::{Account, Audit, DbError, LedgerDb, LedgerTx, Statement};

#[derive(Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct NewAccount {
    /// 1 to 100 characters, no control characters, no surrounding whitespace.
    #[schema(
        min_length = 1,
        max_length = 100,
        pattern = r"^[^\s\x00-\x1f\x7f-\x9f]([^\x00-\x1f\x7f-\x9f]*[^\s\x00-\x1f\x7f-\x9f])?$"
    )]
    name: String,
}

/// `POST /v1/accounts`: a new account of the caller's, with a balance of 0.
pub(super) async fn create_account<D: LedgerDb>(
    State(st): State<AppState<D>>,
    Extension(who): Extension<Principal>,
    mut tx: Tx<D>,
    JsonBody(req): JsonBody<NewAccount>,
) -> Result<(StatusCode, Json<Account>), ApiError> {
    let name = req.name.trim();
    if name.is_empty() || name.chars().count() > 100 || name.chars().any(char::is_control) {
        return Err(ApiError::Invalid(
            "name must be 1 to 100 characters with no control characters".into(),
        ));
    }
    let id = uuid::Uuid::now_v7().to_string();
    let now_ms = st.clock.now_ms();
    let tenant = who.tenant.as_str();
    tx.insert_account(tenant, &id, name, now_ms).await?;
    let data = serde_json::json!({ "account_id": id, "name": name });
    st.events
        .enqueue(&mut tx, "account.created", tenant, now_ms, data)
        .await?;
    Ok((
        StatusCode::CREATED,
        Json(Account {
            id,
            name: name.to_owned(),
            balance: 0,
        }),
    ))
}

/// The caller's account `id`; a malformed id is not found either.
async fn find_account<D: LedgerDb>(st: &AppState<D>, who: &Principal, id: &str) -> Result<Account, ApiError> {
    let not_found = || ApiError::Db(DbError::AccountNotFound(id.to_owned()));
    if account_id("id", id).is_err() {
        return Err(not_found());
    }
    st.db.account(who.tenant.as_str(), id).await?.ok_or_else(not_found)
}

/// `GET /v1/accounts/{id}`.
pub(super) async fn get_account<D: LedgerDb>(
    State(st): State<AppState<D>>,
    Extension(who): Extension<Principal>,
    Path(id): Path<String>,
) -> Result<Json<Account>, ApiError> {
    Ok(Json(find_account(&st, &who, &id).await?))
}

/// `GET /v1/accounts/{id}/statement`: the account as the projection of the
/// ledger's events has it.
pub(super) async fn statement<D: LedgerDb>(
    State(st): State<AppState<D>>,
    Extension(who): Extension<Principal>,
    Path(id): Path<String>,
) -> Result<Json<Statement>, ApiError> {
    find_account(&st, &who, &id).await?;
    // An account the projection has not seen yet has an empty statement.
    let statement = st.db.statement(who.tenant.as_str(), &id).await?.unwrap_or(Statement {
        account_id: id,
        credits: 0,
        debits: 0,
        balance: 0,
        events: 0,
    });
    Ok(Json(statement))
}

/// `GET /v1/audit`: the caller's conservation figures, from stored rows.
pub(super) async fn audit<D: LedgerDb>(
    State(st): State<AppState<D>>,
    Extension(who): Extension<Principal>,
) -> Result<Json<Audit>, ApiError> {
    Ok(Json(st.db.audit(who.tenant.as_str()).await?))
}
