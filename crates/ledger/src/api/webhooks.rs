//! `POST /v1/webhooks/payments`: a payment provider's signed webhooks
//! (Standard Webhooks), applied once per provider event.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderValue, StatusCode};
use axum::middleware;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Extension, Json, Router};
use idem_core::TxEngine;
use idem_webhooks::{WebhookError, WebhookInbox};
use serde::Deserialize;

use super::body::{account_id, amount, json_object, media_type, whole_number};
use super::problem::{problem, retry_soon, unsupported_media_type};
use super::{ApiError, AppState, MAX_BODY_BYTES, Options, Principal, auth};
use crate::db::{DbError, LedgerDb, LedgerTx, WEBHOOK_INBOX_TABLE};

/// The webhook inbox, if webhooks are configured.
#[derive(Clone)]
struct WebhookState<D: LedgerDb>(Option<Arc<WebhookInbox<D>>>);

/// The webhook route, behind the bearer tokens but with no
/// `Idempotency-Key`: webhooks are deduplicated on the provider's event id,
/// in their own table. Without a verifier it refuses every webhook.
pub(super) fn router<D: LedgerDb>(state: &AppState<D>, options: &Options) -> Router<AppState<D>> {
    let webhooks = options.webhooks.clone().map(|verifier| {
        let store = state
            .db
            .keyed(idem_core::TableName::new(WEBHOOK_INBOX_TABLE).expect("a valid table name"));
        let inbox = idem_inbox::Inbox::new(TxEngine::new(store).with_clock(state.clock.clone()));
        Arc::new(WebhookInbox::new(verifier, inbox, "payments-webhook"))
    });
    Router::new()
        .route("/v1/webhooks/payments", post(payment_webhook::<D>))
        .layer(Extension(WebhookState(webhooks)))
        .layer(axum::extract::DefaultBodyLimit::max(MAX_BODY_BYTES))
        .route_layer(middleware::from_fn_with_state(
            options.tokens.clone(),
            auth::authenticate,
        ))
}

#[derive(Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct PaymentWebhook {
    /// The provider's event id: the same on each of its retries. 1 to 255
    /// printable ASCII characters.
    #[schema(min_length = 1, max_length = 255, pattern = r"^[\x20-\x7e]+$")]
    event_id: String,
    /// The account to credit.
    #[schema(pattern = r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")]
    account_id: String,
    /// Minor units.
    #[schema(minimum = 1, maximum = 1_000_000_000_000_i64)]
    #[serde(deserialize_with = "whole_number")]
    amount: i64,
}

#[derive(Debug, serde::Serialize, Deserialize, utoipa::ToSchema)]
pub(crate) struct WebhookDone {
    /// The provider's event id.
    event_id: String,
    /// The journal entry of the top-up.
    id: String,
    account_id: String,
    amount: i64,
    /// The balance right after this top-up.
    balance: i64,
}

fn webhook_refused(e: &WebhookError) -> Response {
    match e {
        WebhookError::Signature => problem(
            StatusCode::UNAUTHORIZED,
            "webhook-signature-invalid",
            "Invalid webhook signature",
            "no webhook-signature matches the body under the configured secrets",
        ),
        WebhookError::Stale { .. } | WebhookError::Timestamp => problem(
            StatusCode::BAD_REQUEST,
            "webhook-timestamp-invalid",
            "Webhook timestamp out of tolerance",
            e.to_string(),
        ),
        other => problem(
            StatusCode::BAD_REQUEST,
            "webhook-headers-invalid",
            "Invalid webhook headers",
            other.to_string(),
        ),
    }
}

/// `POST /v1/webhooks/payments`: a provider-initiated top-up, verified per
/// Standard Webhooks and applied once per (tenant, provider event id), in
/// one transaction with its ledger rows and its event. A redelivery answers
/// the recorded result with `Idempotent-Replayed: true`.
async fn payment_webhook<D: LedgerDb>(
    State(st): State<AppState<D>>,
    Extension(who): Extension<Principal>,
    Extension(WebhookState(webhooks)): Extension<WebhookState<D>>,
    headers: axum::http::HeaderMap,
    body: Result<Bytes, axum::extract::rejection::BytesRejection>,
) -> Response {
    let Some(webhooks) = webhooks else {
        return problem(
            StatusCode::SERVICE_UNAVAILABLE,
            "webhooks-not-configured",
            "Webhooks not configured",
            "this ledger has no webhook secret (--webhook-secret or LEDGER_WEBHOOK_SECRET); no webhook is accepted",
        );
    };
    let body = match body {
        Ok(b) => b,
        Err(e) => {
            return problem(
                e.status(),
                if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
                    "request-body-too-large"
                } else {
                    "invalid-request"
                },
                "Unreadable webhook body",
                e.body_text(),
            );
        }
    };
    let now_secs = st.clock.now_ms().div_euclid(1000);
    // The signature is checked before the body is even parsed.
    let verified = match webhooks.verify(&who.tenant, &headers, &body, now_secs) {
        Ok(v) => v,
        Err(e) => return webhook_refused(&e),
    };
    if media_type(&headers).is_none_or(|v| v != "application/json") {
        return unsupported_media_type("the webhook body must be JSON, sent with Content-Type: application/json");
    }
    let invalid = |detail: String| {
        problem(
            StatusCode::BAD_REQUEST,
            "invalid-request",
            "Invalid webhook body",
            detail,
        )
    };
    let req: PaymentWebhook = match json_object(verified.body(), "webhook body") {
        Ok(r) => r,
        Err(detail) => return invalid(detail),
    };
    if let Err(e) = idem_core::IdempotencyKey::new(req.event_id.as_str()) {
        return invalid(format!("event_id: {e}"));
    }
    if let Err(e) = account_id("account_id", &req.account_id).and_then(|()| amount(req.amount).map(|_| ())) {
        return e.into_response();
    }
    let tenant = verified.tenant().clone();
    let (account, amount) = (req.account_id.clone(), req.amount);
    // Applied once per (tenant, the provider's event id in the body).
    let verified = match verified.keyed_by(|_| Ok::<_, std::convert::Infallible>(req.event_id)) {
        Ok(v) => v,
        Err(never) => match never {},
    };
    let event_id = verified.event_id().to_owned();
    let (events, clock) = (st.events.clone(), st.clock.clone());
    let applied = webhooks
        .apply(&verified, |tx| {
            let (tenant, event_id, account, events, clock) = (
                tenant.clone(),
                event_id.clone(),
                account.clone(),
                events.clone(),
                clock.clone(),
            );
            Box::pin(async move {
                let id = uuid::Uuid::now_v7().to_string();
                let now_ms = clock.now_ms();
                let balance = tx.top_up(tenant.as_str(), &id, "webhook_top_up", &account, amount, now_ms).await?;
                let data =
                    serde_json::json!({ "journal_id": id, "event_id": event_id, "account_id": account, "amount": amount });
                events
                    .enqueue(tx, "webhook_top_up.created", tenant.as_str(), now_ms, data)
                    .await?;
                Ok::<_, DbError>(WebhookDone {
                    event_id,
                    id,
                    account_id: account,
                    amount,
                    balance,
                })
            })
        })
        .await;
    match applied {
        Ok(delivery) => {
            let replayed = !delivery.is_applied();
            let mut r = (StatusCode::OK, Json(delivery.into_inner())).into_response();
            if replayed {
                r.headers_mut()
                    .insert("idempotent-replayed", HeaderValue::from_static("true"));
            }
            r
        }
        Err(DbError::Idem(idem_core::Error::Mismatch)) => problem(
            StatusCode::UNPROCESSABLE_ENTITY,
            "webhook-event-reused",
            "Webhook event id reused",
            "this event id was applied before with a different body",
        ),
        Err(DbError::Idem(idem_core::Error::InFlight { .. })) => retry_soon(problem(
            StatusCode::CONFLICT,
            "webhook-in-flight",
            "Webhook in flight",
            "a delivery of this event is being applied; retry later",
        )),
        Err(e) => ApiError::Db(e).into_response(),
    }
}
