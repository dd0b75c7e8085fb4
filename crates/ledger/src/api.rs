//! The HTTP API: routes, request validation and problem responses.

use std::collections::HashSet;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{FromRequest, Path, Request, State};
use axum::http::{HeaderValue, StatusCode, header, request::Parts};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use idem_core::{Contention, Policy, SharedClock, Tenant, TxEngine};
use idem_http::{DEFAULT_PROBLEM_BASE, IdempotencyLayer, Problem, RetryTransaction, RoutePolicy, Tx};
use metrics_exporter_prometheus::PrometheusHandle;
use serde::Deserialize;
use serde::de::DeserializeOwned;
use sha2::{Digest, Sha256};

use crate::db::{Account, DbError, LedgerDb, MAX_AMOUNT, Statement, WEBHOOK_INBOX_TABLE};
use crate::events::Namespace;
use idem_webhooks::{Verifier, WebhookError, WebhookInbox};

/// What every handler shares.
#[derive(Clone)]
pub struct AppState<D: LedgerDb> {
    /// The store: idempotency keys and the ledger's tables.
    pub db: D,
    /// The outbox every mutation enqueues its event in.
    pub outbox: D::Outbox,
    /// Where the events are published.
    pub namespace: Namespace,
    /// The clock of key expiry and timestamps.
    pub clock: SharedClock,
    /// The Prometheus recorder, for `GET /metrics`.
    pub metrics: Option<PrometheusHandle>,
    /// Event settings refused at start, for `/healthz`.
    pub events_health: crate::events::EventsHealth,
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
    /// Where the events report settings refused at start (shown by
    /// `/healthz` as 503 `events-configuration-refused`).
    pub events_health: crate::events::EventsHealth,
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
            events_health: crate::events::EventsHealth::default(),
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
    let engine = TxEngine::new(state.db.clone()).with_clock(state.clock.clone());
    let required = if options.require_keys {
        RoutePolicy::required()
    } else {
        RoutePolicy::optional()
    };
    let idempotency = IdempotencyLayer::transactional(engine, tenant_of)
        .default_route(required.with_policy(policy))
        .route("POST /v1/accounts", RoutePolicy::optional().with_policy(policy))
        // Money leaving: keys kept for at least 7 days.
        .route(
            "POST /v1/payouts",
            required.with_policy(policy.with_ttl_secs(options.key_ttl_secs.max(PAYOUT_KEY_TTL_SECS))),
        )
        .max_request_bytes(MAX_BODY_BYTES);
    let api = Router::new()
        .route("/v1/accounts", post(create_account::<D>))
        .route("/v1/accounts/{id}", get(get_account::<D>))
        .route("/v1/top-ups", post(top_up::<D>))
        .route("/v1/transfers", post(transfer::<D>))
        .route("/v1/payouts", post(request_payout::<D>))
        .route("/v1/payouts/{id}", get(get_payout::<D>))
        .route("/v1/payouts/{id}/cancel", post(cancel_payout::<D>))
        .route("/v1/accounts/{id}/statement", get(statement::<D>))
        .route("/v1/audit", get(audit::<D>))
        .route_layer(idempotency)
        .route_layer(middleware::from_fn_with_state(options.tokens.clone(), authenticate));
    // Webhooks carry no Idempotency-Key: they are deduplicated on the
    // provider's event id, in their own table.
    let webhooks = options.webhooks.clone().map(|verifier| {
        let store = state
            .db
            .keyed(idem_core::TableName::new(WEBHOOK_INBOX_TABLE).expect("a valid table name"));
        let inbox = idem_inbox::Inbox::new(TxEngine::new(store).with_clock(state.clock.clone()));
        Arc::new(WebhookInbox::new(verifier, inbox, "payments-webhook"))
    });
    let hooks = Router::new()
        .route("/v1/webhooks/payments", post(payment_webhook::<D>))
        .layer(Extension(WebhookState(webhooks)))
        .layer(axum::extract::DefaultBodyLimit::max(MAX_BODY_BYTES))
        .route_layer(middleware::from_fn_with_state(options.tokens.clone(), authenticate));
    Router::new()
        .route("/healthz", get(healthz::<D>))
        .route("/metrics", get(metrics_text::<D>))
        .route("/openapi.json", get(openapi_json))
        .merge(api)
        .merge(hooks)
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(state)
}

fn problem(status: StatusCode, slug: &str, title: &str, detail: impl Into<String>) -> Response {
    Problem::new(status, slug, title)
        .with_detail(detail)
        .into_response(DEFAULT_PROBLEM_BASE)
}

fn unauthorized() -> Problem {
    Problem::new(StatusCode::UNAUTHORIZED, "unauthorized", "Unauthorized")
        .with_detail("send Authorization: Bearer <token>")
}

fn tenant_of(parts: &Parts) -> Result<Tenant, Problem> {
    parts
        .extensions
        .get::<Principal>()
        .map(|p| p.tenant.clone())
        .ok_or_else(unauthorized)
}

/// The tenant of a bearer token: `t_` and the first 40 hex digits of its SHA-256.
pub fn tenant_for_token(token: &str) -> Tenant {
    let digest = Sha256::digest(token.as_bytes());
    Tenant::new(format!("t_{}", &hex::encode(digest)[..40])).expect("a hex digest is a valid tenant")
}

/// The token of an `Authorization: Bearer <token>` value. The scheme is
/// case-insensitive (RFC 9110 §11.1); the token is a token68 (RFC 6750) of at
/// most 1024 characters.
pub fn bearer_token(value: &str) -> Option<&str> {
    let (scheme, token) = value.trim().split_once(' ')?;
    if !scheme.eq_ignore_ascii_case("bearer") {
        return None;
    }
    let token = token.trim_start_matches(' ');
    let body = token.trim_end_matches('=');
    let token68 = !body.is_empty()
        && body
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~' | b'+' | b'/'));
    (token68 && token.len() <= 1024).then_some(token)
}

async fn authenticate(State(tokens): State<Arc<HashSet<String>>>, mut req: Request, next: Next) -> Response {
    let token = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(bearer_token)
        .filter(|token| tokens.is_empty() || tokens.contains(*token));
    match token {
        Some(token) => {
            let tenant = tenant_for_token(token);
            req.extensions_mut().insert(Principal { tenant });
            next.run(req).await
        }
        None => {
            let mut response = unauthorized().into_response(DEFAULT_PROBLEM_BASE);
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            response
        }
    }
}

/// A JSON body that must match `T` exactly: a JSON object (never an array
/// in field order) with no unknown fields, sent as `application/json` (or a
/// `+json` type). A body of another media type is a 415 problem with
/// `Accept-Post: application/json`; any other mismatch is a 400 problem.
/// Either way nothing is written.
pub struct JsonBody<T>(pub T);

/// Whether the request says its body is JSON.
fn is_json(req: &Request) -> bool {
    req.headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(|v| v.split(';').next().unwrap_or("").trim().to_ascii_lowercase())
        .is_some_and(|v| v == "application/json" || (v.starts_with("application/") && v.ends_with("+json")))
}

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for JsonBody<T> {
    type Rejection = Response;

    async fn from_request(req: Request, state: &S) -> Result<Self, Response> {
        if !is_json(&req) {
            let mut r = problem(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "unsupported-media-type",
                "Unsupported media type",
                "the request body must be JSON, sent with Content-Type: application/json",
            );
            r.headers_mut()
                .insert("accept-post", HeaderValue::from_static("application/json"));
            return Err(r);
        }
        let bytes = Bytes::from_request(req, state)
            .await
            .map_err(IntoResponse::into_response)?;
        let invalid = |detail: String| {
            problem(
                StatusCode::BAD_REQUEST,
                "invalid-request",
                "Invalid request body",
                detail,
            )
        };
        // Serde accepts a struct written as an array of its fields; the
        // contract is an object.
        if bytes.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
            return Err(invalid("the request body must be a JSON object".into()));
        }
        serde_json::from_slice(&bytes)
            .map(JsonBody)
            .map_err(|e| invalid(format!("invalid JSON body: {e}")))
    }
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
                let mut r = problem(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "database-conflict",
                    "Database conflict",
                    "the request conflicted with concurrent ones and was not applied; retry it with the same Idempotency-Key",
                );
                r.headers_mut()
                    .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
                r.extensions_mut().insert(RetryTransaction);
                r
            }
            ApiError::Db(e) => {
                tracing::warn!(error = %e, "database error");
                let mut r = problem(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "database-unavailable",
                    "Database unavailable",
                    "the request was not applied; retry it with the same Idempotency-Key",
                );
                r.headers_mut()
                    .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
                r
            }
        }
    }
}

fn amount(value: i64) -> Result<i64, ApiError> {
    if value <= 0 {
        return Err(ApiError::Amount(format!(
            "amount must be a positive integer of minor units, got {value}"
        )));
    }
    if value > MAX_AMOUNT {
        return Err(ApiError::Amount(format!(
            "amount must be at most {MAX_AMOUNT}, got {value}"
        )));
    }
    Ok(value)
}

/// A JSON number read exactly, never through `f64`: `5`, `5.0`, `5e0` and
/// `50e-1` are all 5 (JSON Schema's `integer`), but
/// `4.9999999999999999999`, `5.000000000000000000001` and
/// `999999999999.99999` are not whole numbers and are refused (a float
/// would round each to a whole one). Whole numbers beyond `i64` saturate,
/// so the amount's range check names them; strings and the like are type
/// errors.
fn whole_number<'de, D: serde::Deserializer<'de>>(d: D) -> Result<i64, D::Error> {
    use serde::Deserialize as _;
    let raw = Box::<serde_json::value::RawValue>::deserialize(d)?;
    exact_integer(raw.get()).map_err(serde::de::Error::custom)
}

/// The whole number a JSON number token spells exactly (see
/// [`whole_number`]); saturated to `i64`.
pub(crate) fn exact_integer(token: &str) -> Result<i64, String> {
    let not_whole = || format!("{token} is not a whole number");
    let bytes = token.as_bytes();
    let (negative, rest) = match bytes.first() {
        Some(b'-') => (true, &token[1..]),
        Some(b'0'..=b'9') => (false, token),
        _ => return Err(format!("{token} is not a number")),
    };
    let (mantissa, exponent) = match rest.find(['e', 'E']) {
        Some(i) => (&rest[..i], Some(&rest[i + 1..])),
        None => (rest, None),
    };
    let (int, frac) = match mantissa.split_once('.') {
        Some((i, f)) => (i, f),
        None => (mantissa, ""),
    };
    if int.is_empty() || !int.bytes().all(|b| b.is_ascii_digit()) || !frac.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!("{token} is not a number"));
    }
    // The exponent, bounded: past 10^6 digits any non-zero number is out
    // of range (or not whole) anyway.
    let exp: i64 = match exponent {
        None => 0,
        Some(e) => {
            let (sign, digits) = match e.as_bytes().first() {
                Some(b'-') => (-1, &e[1..]),
                Some(b'+') => (1, &e[1..]),
                _ => (1, e),
            };
            if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
                return Err(format!("{token} is not a number"));
            }
            let digits = digits.trim_start_matches('0');
            if digits.len() > 7 {
                sign * 10_000_000
            } else {
                sign * digits.parse::<i64>().unwrap_or(0)
            }
        }
    };
    // digits × 10^(exp − frac digits), with the significant digits only.
    let all = format!("{int}{frac}");
    let all = all.trim_start_matches('0');
    if all.is_empty() {
        return Ok(0);
    }
    let trailing = all.len() - all.trim_end_matches('0').len();
    let digits = all.trim_end_matches('0');
    let scale = exp - frac.len() as i64 + trailing as i64;
    if scale < 0 {
        return Err(not_whole());
    }
    let magnitude = if scale > 19 || digits.len() as i64 + scale > 19 {
        None
    } else {
        digits
            .parse::<i64>()
            .ok()
            .and_then(|d| 10i64.checked_pow(scale as u32).and_then(|p| d.checked_mul(p)))
    };
    Ok(match (magnitude, negative) {
        (Some(m), false) => m,
        (Some(m), true) => -m,
        (None, false) => i64::MAX,
        (None, true) => i64::MIN,
    })
}

/// Account ids are canonical lower-case UUIDs.
fn account_id(field: &str, id: &str) -> Result<(), ApiError> {
    let ok = id.len() == 36
        && id.char_indices().all(|(i, c)| match i {
            8 | 13 | 18 | 23 => c == '-',
            _ => c.is_ascii_digit() || ('a'..='f').contains(&c),
        });
    if ok {
        Ok(())
    } else {
        Err(ApiError::Invalid(format!("{field} is not an account id")))
    }
}

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

async fn create_account<D: LedgerDb>(
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
    D::insert_account(&mut tx, who.tenant.as_str(), &id, name, now_ms).await?;
    crate::events::enqueue::<D>(
        &st.outbox,
        &mut tx,
        &st.namespace,
        "account.created",
        who.tenant.as_str(),
        now_ms,
        serde_json::json!({ "account_id": id, "name": name }),
    )
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

async fn get_account<D: LedgerDb>(
    State(st): State<AppState<D>>,
    Extension(who): Extension<Principal>,
    Path(id): Path<String>,
) -> Result<Json<Account>, ApiError> {
    if account_id("id", &id).is_err() {
        return Err(ApiError::Db(DbError::AccountNotFound(id)));
    }
    match st.db.account(who.tenant.as_str(), &id).await? {
        Some(account) => Ok(Json(account)),
        None => Err(ApiError::Db(DbError::AccountNotFound(id))),
    }
}

async fn top_up<D: LedgerDb>(
    State(st): State<AppState<D>>,
    Extension(who): Extension<Principal>,
    mut tx: Tx<D>,
    JsonBody(req): JsonBody<NewTopUp>,
) -> Result<(StatusCode, Json<TopUpDone>), ApiError> {
    account_id("account_id", &req.account_id)?;
    let amount = amount(req.amount)?;
    let id = uuid::Uuid::now_v7().to_string();
    let now_ms = st.clock.now_ms();
    let balance = D::top_up(
        &mut tx,
        who.tenant.as_str(),
        &id,
        "top_up",
        &req.account_id,
        amount,
        now_ms,
    )
    .await?;
    crate::events::enqueue::<D>(
        &st.outbox,
        &mut tx,
        &st.namespace,
        "top_up.created",
        who.tenant.as_str(),
        now_ms,
        serde_json::json!({ "journal_id": id, "account_id": req.account_id, "amount": amount }),
    )
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

async fn transfer<D: LedgerDb>(
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
    D::transfer(&mut tx, who.tenant.as_str(), &id, &req.from, &req.to, amount, now_ms).await?;
    crate::events::enqueue::<D>(
        &st.outbox,
        &mut tx,
        &st.namespace,
        "transfer.created",
        who.tenant.as_str(),
        now_ms,
        serde_json::json!({ "journal_id": id, "from": req.from, "to": req.to, "amount": amount }),
    )
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
    status: crate::db::PayoutState,
}

/// Debits the account now and leaves the vendor call to the payout worker:
/// the payout row and its `payout.requested` event commit with the debit.
async fn request_payout<D: LedgerDb>(
    State(st): State<AppState<D>>,
    Extension(who): Extension<Principal>,
    mut tx: Tx<D>,
    JsonBody(req): JsonBody<NewPayout>,
) -> Result<(StatusCode, Json<PayoutRequested>), ApiError> {
    account_id("account_id", &req.account_id)?;
    let amount = amount(req.amount)?;
    let id = uuid::Uuid::now_v7().to_string();
    let now_ms = st.clock.now_ms();
    let balance = D::request_payout(&mut tx, who.tenant.as_str(), &id, &req.account_id, amount, now_ms).await?;
    crate::events::enqueue::<D>(
        &st.outbox,
        &mut tx,
        &st.namespace,
        "payout.requested",
        who.tenant.as_str(),
        now_ms,
        serde_json::json!({ "payout_id": id, "account_id": req.account_id, "amount": amount }),
    )
    .await?;
    Ok((
        StatusCode::CREATED,
        Json(PayoutRequested {
            id,
            account_id: req.account_id,
            amount,
            balance,
            status: crate::db::PayoutState::Requested,
        }),
    ))
}

async fn get_payout<D: LedgerDb>(
    State(st): State<AppState<D>>,
    Extension(who): Extension<Principal>,
    Path(id): Path<String>,
) -> Result<Json<crate::db::Payout>, Response> {
    let missing = || {
        problem(
            StatusCode::NOT_FOUND,
            "payout-not-found",
            "Payout not found",
            format!("no payout {id}"),
        )
    };
    if account_id("id", &id).is_err() {
        return Err(missing());
    }
    match st.db.payout(who.tenant.as_str(), &id).await {
        Ok(Some(payout)) => Ok(Json(payout)),
        Ok(None) => Err(missing()),
        Err(e) => Err(ApiError::Db(e).into_response()),
    }
}

/// The answer to a cancelled payout.
#[derive(serde::Serialize, utoipa::ToSchema)]
pub(crate) struct PayoutCancelled {
    /// The payout id.
    id: String,
    account_id: String,
    amount: i64,
    /// `cancelled`.
    status: crate::db::PayoutState,
}

/// `POST /v1/payouts/{id}/cancel`: cancels a dead-lettered or unknown
/// payout that the vendor is known not to have paid (its dead letter's
/// verdict is "not applied", and nothing was sent since), reversing the
/// debit. The payout, its reversal, its event and its dead letter change in
/// one transaction, once (a retry with the key replays). Anything else is a
/// 409 problem and nothing is written: a payout that may have been paid is
/// never cancelled.
async fn cancel_payout<D: LedgerDb>(
    State(st): State<AppState<D>>,
    Extension(who): Extension<Principal>,
    Path(id): Path<String>,
    mut tx: Tx<D>,
) -> Result<(StatusCode, Json<PayoutCancelled>), Response> {
    use idem_core::DeadLetterStore as _;
    let tenant = who.tenant.as_str();
    let missing = || {
        problem(
            StatusCode::NOT_FOUND,
            "payout-not-found",
            "Payout not found",
            format!("no payout {id}"),
        )
    };
    if account_id("id", &id).is_err() {
        return Err(missing());
    }
    let db_error = |e: DbError| ApiError::Db(e).into_response();
    let Some(payout) = st.db.payout(tenant, &id).await.map_err(db_error)? else {
        return Err(missing());
    };
    let not_cancellable = |state: &str| {
        problem(
            StatusCode::CONFLICT,
            "payout-not-cancellable",
            "Payout not cancellable",
            format!("payout {id} is {state}: only a dead-lettered or unknown payout can be cancelled"),
        )
    };
    if !matches!(
        payout.status,
        crate::db::PayoutState::DeadLettered | crate::db::PayoutState::Unknown
    ) {
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
    if !D::cancel_payout(&mut tx, tenant, &id, now_ms).await.map_err(db_error)? {
        return Err(not_cancellable("no longer dead-lettered or unknown"));
    }
    crate::events::enqueue::<D>(
        &st.outbox,
        &mut tx,
        &st.namespace,
        "payout.cancelled",
        tenant,
        now_ms,
        serde_json::json!({ "payout_id": id, "account_id": payout.account_id, "amount": payout.amount }),
    )
    .await
    .map_err(db_error)?;
    Ok((
        StatusCode::OK,
        Json(PayoutCancelled {
            id,
            account_id: payout.account_id,
            amount: payout.amount,
            status: crate::db::PayoutState::Cancelled,
        }),
    ))
}

async fn statement<D: LedgerDb>(
    State(st): State<AppState<D>>,
    Extension(who): Extension<Principal>,
    Path(id): Path<String>,
) -> Result<Json<Statement>, ApiError> {
    if account_id("id", &id).is_err() || st.db.account(who.tenant.as_str(), &id).await?.is_none() {
        return Err(ApiError::Db(DbError::AccountNotFound(id)));
    }
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

/// The webhook inbox, if webhooks are configured.
#[derive(Clone)]
struct WebhookState<D: LedgerDb>(Option<Arc<WebhookInbox<D>>>);

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
    let content_type_ok = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| {
            v.split(';')
                .next()
                .unwrap_or("")
                .trim()
                .eq_ignore_ascii_case("application/json")
        });
    if !content_type_ok {
        let mut r = problem(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported-media-type",
            "Unsupported media type",
            "the webhook body must be JSON, sent with Content-Type: application/json",
        );
        r.headers_mut()
            .insert("accept-post", HeaderValue::from_static("application/json"));
        return r;
    }
    let invalid = |detail: String| {
        problem(
            StatusCode::BAD_REQUEST,
            "invalid-request",
            "Invalid webhook body",
            detail,
        )
    };
    if body.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        return invalid("the webhook body must be a JSON object".into());
    }
    let req: PaymentWebhook = match serde_json::from_slice(verified.body()) {
        Ok(r) => r,
        Err(e) => return invalid(format!("invalid JSON body: {e}")),
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
    let (outbox, clock, ns) = (st.outbox.clone(), st.clock.clone(), st.namespace.clone());
    let applied = webhooks
        .apply(&verified, |tx| {
            let (tenant, event_id, account, outbox, clock, ns) = (
                tenant.clone(),
                event_id.clone(),
                account.clone(),
                outbox.clone(),
                clock.clone(),
                ns.clone(),
            );
            Box::pin(async move {
                let id = uuid::Uuid::now_v7().to_string();
                let now_ms = clock.now_ms();
                let balance = D::top_up(tx, tenant.as_str(), &id, "webhook_top_up", &account, amount, now_ms).await?;
                crate::events::enqueue::<D>(
                    &outbox,
                    tx,
                    &ns,
                    "webhook_top_up.created",
                    tenant.as_str(),
                    now_ms,
                    serde_json::json!({ "journal_id": id, "event_id": event_id, "account_id": account, "amount": amount }),
                )
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
        Err(DbError::Idem(idem_core::Error::InFlight { .. })) => {
            let mut r = problem(
                StatusCode::CONFLICT,
                "webhook-in-flight",
                "Webhook in flight",
                "a delivery of this event is being applied; retry later",
            );
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
            r
        }
        Err(e) => ApiError::Db(e).into_response(),
    }
}

async fn audit<D: LedgerDb>(
    State(st): State<AppState<D>>,
    Extension(who): Extension<Principal>,
) -> Result<Json<crate::db::Audit>, ApiError> {
    Ok(Json(st.db.audit(who.tenant.as_str()).await?))
}

async fn healthz<D: LedgerDb>(State(st): State<AppState<D>>) -> Response {
    let refused = st.events_health.refused();
    if !refused.is_empty() {
        return problem(
            StatusCode::SERVICE_UNAVAILABLE,
            "events-configuration-refused",
            "Events configuration refused",
            refused.join("; "),
        );
    }
    match st.db.ping().await {
        Ok(()) => Json(serde_json::json!({"status": "ok"})).into_response(),
        Err(e) => problem(
            StatusCode::SERVICE_UNAVAILABLE,
            "database-unavailable",
            "Database unavailable",
            e.to_string(),
        ),
    }
}

async fn metrics_text<D: LedgerDb>(State(st): State<AppState<D>>) -> Response {
    match &st.metrics {
        Some(handle) => ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], handle.render()).into_response(),
        None => problem(
            StatusCode::NOT_FOUND,
            "not-found",
            "Not found",
            "metrics are not enabled",
        ),
    }
}

async fn openapi_json() -> Json<serde_json::Value> {
    static DOCUMENT: std::sync::OnceLock<serde_json::Value> = std::sync::OnceLock::new();
    Json(DOCUMENT.get_or_init(crate::openapi::document_json).clone())
}

async fn not_found(req: Request) -> Response {
    problem(
        StatusCode::NOT_FOUND,
        "not-found",
        "Not found",
        format!("no route for {} {}", req.method(), req.uri().path()),
    )
}

async fn method_not_allowed(req: Request) -> Response {
    problem(
        StatusCode::METHOD_NOT_ALLOWED,
        "method-not-allowed",
        "Method not allowed",
        format!("{} is not allowed on {}", req.method(), req.uri().path()),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Amounts are read exactly: whole numbers in any spelling pass, fractions that a float would round are refused.
    #[test]
    fn amounts_are_parsed_exactly() {
        for (token, want) in [
            ("5", 5),
            ("5.0", 5),
            ("5e0", 5),
            ("50e-1", 5),
            ("0.5e1", 5),
            ("-5", -5),
            ("1000000000000", 1_000_000_000_000),
            ("1e12", 1_000_000_000_000),
            ("0", 0),
            ("0.000e5", 0),
            ("99999999999999999999", i64::MAX),
            ("1e400", i64::MAX),
            ("-1e400", i64::MIN),
            ("1e99999999999999999999", i64::MAX),
        ] {
            assert_eq!(exact_integer(token), Ok(want), "{token}");
        }
        for token in [
            "4.9999999999999999999",
            "5.000000000000000000001",
            "999999999999.99999",
            "1.5",
            "5e-1",
            "1e-99999999999999999999",
            "\"5\"",
            "true",
            "",
        ] {
            assert!(exact_integer(token).is_err(), "{token}");
        }
    }

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
