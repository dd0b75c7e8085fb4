//! The HTTP API: routes, request validation and problem responses.
//!
//! [`app`] holds the route table; each door has its module: `accounts`
//! (accounts, statements, the audit), `transfers` (top-ups and transfers),
//! `payouts`, `withdrawals` (a multi-step operation across two vendors),
//! `webhooks` (signed provider webhooks), `service` (health,
//! metrics, the OpenAPI document, unknown routes). The shared parts:
//! `auth` (bearer tokens and tenants), `body` (request bodies and their
//! validation) and `problem` (errors as problem responses).

mod accounts;
mod auth;
mod body;
mod payouts;
mod problem;
mod service;
mod transfers;
mod webhooks;
mod withdrawals;

use std::collections::HashSet;
use std::sync::Arc;

use axum::Router;
use axum::middleware;
use axum::routing::{get, post, post_service};
use idem_core::{Policy, SharedClock, Tenant, TxEngine};
use idem_http::{IdempotencyLayer, RoutePolicy};
use metrics_exporter_prometheus::PrometheusHandle;

use crate::db::LedgerDb;
use crate::events::{EventOutbox, Namespace};
use idem_webhooks::Verifier;

pub use auth::{bearer_token, tenant_for_token};
pub use body::JsonBody;
pub use problem::ApiError;

pub(crate) use accounts::NewAccount;
pub(crate) use payouts::{NewPayout, PayoutRequested};
pub(crate) use transfers::{NewTopUp, NewTransfer, TopUpDone, TransferDone};
pub(crate) use webhooks::{PaymentWebhook, WebhookDone};
pub(crate) use withdrawals::NewWithdrawal;
pub use withdrawals::{MAX_DESTINATION, REFUSAL_SLUGS};

/// What every handler shares.
#[derive(Clone)]
pub struct AppState<D: LedgerDb> {
    /// The store: idempotency keys and the ledger's tables.
    pub db: D,
    /// Where every mutation enqueues its event.
    pub events: EventOutbox<D>,
    /// The clock of key expiry and timestamps.
    pub clock: SharedClock,
    /// The Prometheus recorder, for `GET /metrics`.
    pub metrics: Option<PrometheusHandle>,
    /// Event settings refused at start, for `/healthz`.
    pub events_health: crate::events::EventsHealth,
    /// `POST /v1/withdrawals`, when its vendors are configured.
    pub withdrawals: Option<WithdrawalRoute<D>>,
}

/// What serves `POST /v1/withdrawals`: idem's steps service on the
/// withdrawals engine, and the operation.
#[derive(Clone)]
pub struct WithdrawalRoute<D: LedgerDb> {
    /// The steps service (its engine, and its runs still going on after
    /// their answers).
    pub steps: idem_http::steps::Steps<D, D::MultiSteps>,
    /// The operation `withdrawal@1`.
    pub op: crate::withdrawals::Withdraw<D>,
}

impl<D: LedgerDb> WithdrawalRoute<D> {
    /// The route of withdrawals on `db` by `config`, reading `clock`; its
    /// events named in `namespace`.
    pub fn new(
        db: &D,
        clock: SharedClock,
        config: &crate::withdrawals::WithdrawalsConfig,
        namespace: Namespace,
    ) -> Result<Self, crate::StartError> {
        let op = crate::withdrawals::Withdraw::new(db, clock.clone(), config, namespace)?;
        let engine = Arc::new(crate::withdrawals::engine(db, clock, config));
        let steps = idem_http::steps::Steps::new(engine, auth::tenant_of)
            .max_request_bytes(MAX_BODY_BYTES)
            .respond_within(config.respond_within);
        Ok(Self { steps, op })
    }
}

/// Settings of the API.
#[derive(Debug, Clone)]
pub struct Options {
    /// How long idempotency keys are kept.
    pub key_ttl_secs: u64,
    /// The bearer tokens accepted. Empty: demo mode, where every token is
    /// accepted as its own tenant.
    pub tokens: Arc<HashSet<String>>,
    /// Verifies `POST /v1/webhooks/payments`. `None`: the route refuses
    /// every webhook (503), so a deployment without a secret accepts none.
    pub webhooks: Option<Verifier>,
    /// The names of the event streams and subjects.
    pub events_namespace: Namespace,
    /// Whether mutating routes refuse a request without an `Idempotency-Key`
    /// (400). `false` serves such a request in a plain transaction that
    /// commits on success, with no claim and no record: the same routes
    /// without idempotency, for measuring what the layer costs.
    pub require_keys: bool,
    /// Whether the idempotency layer reads a key's committed row before it
    /// claims (`TxEngine::with_read_first`): a retry of a recorded request
    /// is answered by that one statement, without a transaction, and every
    /// new key pays the statement. Off by default.
    pub read_first: bool,
    /// Where the events report settings refused at start (shown by
    /// `/healthz` as 503 `events-configuration-refused`).
    pub events_health: crate::events::EventsHealth,
    /// Withdrawals' vendors and completers. `None`: `POST /v1/withdrawals`
    /// answers 503 `withdrawals-unavailable`.
    pub withdrawals: Option<crate::withdrawals::WithdrawalsConfig>,
}

/// The demo's webhook secret (`whsec_` + base64 of
/// `ledger-demo-webhook-secret`), used only in demo mode when no secret is
/// configured.
pub const DEMO_WEBHOOK_SECRET: &str = "whsec_bGVkZ2VyLWRlbW8td2ViaG9vay1zZWNyZXQ=";

impl Default for Options {
    fn default() -> Self {
        Self {
            key_ttl_secs: 86_400,
            tokens: Arc::default(),
            webhooks: Some(Verifier::new([DEMO_WEBHOOK_SECRET]).expect("the demo secret is valid")),
            events_namespace: Namespace::default(),
            require_keys: true,
            read_first: false,
            events_health: crate::events::EventsHealth::default(),
            withdrawals: None,
        }
    }
}

/// The authenticated caller: in demo mode every bearer token is its own tenant.
#[derive(Debug, Clone)]
pub struct Principal {
    /// The tenant: a digest of the token, so tokens are never stored.
    pub tenant: Tenant,
}

/// The shortest time a payout's idempotency key is kept (7 days).
pub const PAYOUT_KEY_TTL_SECS: u64 = 7 * 24 * 3600;

/// The largest request body accepted.
pub const MAX_BODY_BYTES: usize = 64 * 1024;

/// Builds the ledger's router.
pub fn app<D: LedgerDb>(state: AppState<D>, options: Options) -> Router {
    let policy = Policy::default().with_ttl_secs(options.key_ttl_secs);
    let engine = TxEngine::new(state.db.clone())
        .with_clock(state.clock.clone())
        .with_read_first(options.read_first);
    let required = if options.require_keys {
        RoutePolicy::required()
    } else {
        RoutePolicy::optional()
    };
    let idempotency = IdempotencyLayer::transactional(engine, auth::tenant_of)
        .default_route(required.with_policy(policy))
        .route("POST /v1/accounts", RoutePolicy::optional().with_policy(policy))
        // Money leaving: keys kept for at least 7 days.
        .route(
            "POST /v1/payouts",
            required.with_policy(policy.with_ttl_secs(options.key_ttl_secs.max(PAYOUT_KEY_TTL_SECS))),
        )
        .max_request_bytes(MAX_BODY_BYTES);
    let api = Router::new()
        .route("/v1/accounts", post(accounts::create_account::<D>))
        .route("/v1/accounts/{id}", get(accounts::get_account::<D>))
        .route("/v1/top-ups", post(transfers::top_up::<D>))
        .route("/v1/transfers", post(transfers::transfer::<D>))
        .route("/v1/payouts", post(payouts::request_payout::<D>))
        .route("/v1/payouts/{id}", get(payouts::get_payout::<D>))
        .route("/v1/payouts/{id}/cancel", post(payouts::cancel_payout::<D>))
        .route("/v1/accounts/{id}/statement", get(accounts::statement::<D>))
        .route("/v1/audit", get(accounts::audit::<D>))
        .route("/v1/withdrawals/{id}", get(withdrawals::get_withdrawal::<D>))
        .route_layer(idempotency)
        // After the layer, which wraps only the routes above it: the steps
        // service checks the key itself, and a withdrawal is keyed once.
        .route(
            "/v1/withdrawals",
            match &state.withdrawals {
                Some(w) => post_service(w.steps.service(w.op.clone())),
                None => post(withdrawals::unavailable),
            },
        )
        .route_layer(middleware::from_fn_with_state(
            options.tokens.clone(),
            auth::authenticate,
        ));
    Router::new()
        .route("/healthz", get(service::healthz::<D>))
        .route("/metrics", get(service::metrics_text::<D>))
        .route("/openapi.json", get(service::openapi_json))
        .merge(api)
        .merge(webhooks::router(&state, &options))
        .fallback(service::not_found)
        .method_not_allowed_fallback(service::method_not_allowed)
        .with_state(state)
}
