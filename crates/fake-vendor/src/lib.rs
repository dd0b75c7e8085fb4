//! A Stripe-like fake payout vendor, for demos and tests of outbound calls.
//!
//! The guide, with examples: `docs/ledger.md` in the repository.
//!
//! - `POST /v1/payouts` `{"amount": n, "reference": "…", "destination":
//!   "…"}` (reference and destination optional) with an `Idempotency-Key`
//!   header: a new key pays (201, `{"id", "amount", "reference"}`, plus
//!   `"destination"` when one was sent) and records the answer; the same key
//!   with the same body answers the recorded response (with
//!   `Idempotent-Replayed: true`) and pays nothing; the same key with
//!   another body is 422 `idempotency_key_reused`; no key is 400. A
//!   destination starting with `closed-` is declined: 402
//!   `destination_closed`, recorded under the key like a payment (its
//!   replay is the same 402), and nothing is paid.
//! - `GET /v1/ledger`: what it paid — `{"payouts": n, "total": sum, "keys": [...]}`.
//! - `PUT /_faults` sets the faults (JSON, every field optional):
//!   `apply_then_drop` (probability: pay, record, then drop the connection
//!   without answering), `error_500` (answer 500 before paying),
//!   `rate_limit_429` (answer 429 with `Retry-After: retry_after_secs`,
//!   before paying), `slow_ms` (answer this much later), `refuse_ms` (stop
//!   accepting connections for this long). `GET /_faults` reads them,
//!   `GET /_stats` counts what happened.
//! - **Forgetful, as real vendors are.** A key is remembered for
//!   [`Options::key_horizon`] on the vendor's own clock (Stripe-like 24 h by
//!   default; set it short, or move the clock with [`Vendor::advance`] or
//!   `PUT /_clock {"advance_ms": n}`): a key older than that is forgotten,
//!   and the same request with it **pays again**. With
//!   [`Options::idempotency`] off the vendor has no keys at all (the
//!   header is ignored): every request pays.
//! - `GET /v1/payouts?reference=R`: the vendor's own record, kept forever:
//!   `{"object": "list", "data": [{"id", "amount", "reference", "status":
//!   "paid"}, …]}`, plus `{"reference", "amount", "status": "processing"}`
//!   while a request with that reference is still being worked on. This is
//!   what a reconcile asks.
//! - A request whose key an earlier request is still processing gets `409`
//!   `{"error": {"type": "idempotency_error", "message":
//!   "idempotency_key_in_use: …"}}` without `Retry-After`, as Stripe
//!   answers.
//! - `POST /v1/quotes`, `GET /v1/quotes?reference=R`, `POST
//!   /v1/quotes/{id}/cancel`: a foreign-exchange quote API **without
//!   idempotency keys** (every request books a new quote; a reconcile asks
//!   by reference), with the same faults (see [`quotes`]).
//!   `lookup_error_500` makes lookups by reference (of payouts and quotes)
//!   answer 500.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tokio::sync::Mutex;

pub mod quotes;

/// Switchable faults.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct Faults {
    /// Probability of paying, recording, then dropping the connection.
    pub apply_then_drop: f64,
    /// Probability of a 500 before paying.
    pub error_500: f64,
    /// Probability of a 429 before paying.
    pub rate_limit_429: f64,
    /// The `Retry-After` of a 429, in seconds.
    pub retry_after_secs: u64,
    /// Every answer this much later, in ms.
    pub slow_ms: u64,
    /// Refuse connections for this long from now, in ms (write-only).
    pub refuse_ms: u64,
    /// Probability of a 500 for a lookup by reference (of payouts or quotes).
    pub lookup_error_500: f64,
}

/// How the vendor treats idempotency keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Options {
    /// How long a key is remembered, on the vendor's clock (default 24 h).
    pub key_horizon: Duration,
    /// Whether the vendor deduplicates by key at all (default true).
    pub idempotency: bool,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            key_horizon: Duration::from_secs(24 * 3600),
            idempotency: true,
        }
    }
}

/// What happened, for tests.
#[derive(Debug, Default, Serialize)]
pub struct Stats {
    /// Payouts made.
    pub paid: u64,
    /// Answers replayed for a known key.
    pub replayed: u64,
    /// Keys reused with another body.
    pub mismatched: u64,
    /// Connections dropped after paying.
    pub dropped: u64,
    /// 500s.
    pub errors_500: u64,
    /// 429s.
    pub rate_limited: u64,
    /// Keys forgotten past the horizon.
    pub forgotten: u64,
    /// 409s for a key still being processed.
    pub in_use: u64,
    /// Lookups by reference.
    pub lookups: u64,
    /// Lookups by reference answered 500 on purpose.
    pub lookup_errors: u64,
    /// Quotes booked.
    pub quotes_booked: u64,
    /// Quotes cancelled.
    pub quotes_cancelled: u64,
    /// Payouts declined (a closed destination).
    pub declined: u64,
}

#[derive(Clone)]
struct Recorded {
    fingerprint: [u8; 32],
    status: StatusCode,
    body: serde_json::Value,
    at_ms: u64,
}

/// Keys and references of requests being processed (a reference may be in
/// several requests at once: its amount and count).
type InProcess = (HashSet<String>, HashMap<String, (i64, u32)>);

/// The vendor's state.
#[derive(Default)]
pub struct Vendor {
    options: Options,
    faults: Mutex<Faults>,
    /// The keys it still remembers.
    keys: Mutex<HashMap<String, Recorded>>,
    /// Every payment made, in order: its key and its answer.
    payments: Mutex<Vec<(Option<String>, serde_json::Value)>>,
    processing: std::sync::Mutex<InProcess>,
    /// How far the vendor's clock is ahead of the system's, in ms.
    clock_offset_ms: AtomicU64,
    forgotten: AtomicU64,
    in_use: AtomicU64,
    lookups: AtomicU64,
    lookup_errors: AtomicU64,
    quotes: quotes::QuoteBook,
    total: AtomicU64,
    paid: AtomicU64,
    replayed: AtomicU64,
    mismatched: AtomicU64,
    dropped: AtomicU64,
    errors_500: AtomicU64,
    rate_limited: AtomicU64,
    declined: AtomicU64,
    seq: AtomicU64,
    /// Until when connections are refused (ms since the epoch).
    pub refuse_until_ms: AtomicU64,
}

impl Vendor {
    /// A vendor treating keys by `options`.
    pub fn new(options: Options) -> Self {
        Self {
            options,
            ..Self::default()
        }
    }

    /// Payouts made so far.
    pub fn paid(&self) -> u64 {
        self.paid.load(Ordering::SeqCst)
    }

    /// Quotes booked so far (cancelled ones included).
    pub async fn quotes_booked(&self) -> usize {
        self.quotes.count().await
    }

    /// Quote bookings being processed right now (arrived, not yet answered).
    pub fn quotes_in_process(&self) -> usize {
        self.quotes.in_process()
    }

    /// The `lookup_error_500` fault: a 500 for this lookup, or `None`.
    async fn lookup_fault(&self) -> Option<Response> {
        self.lookups.fetch_add(1, Ordering::SeqCst);
        let p = self.faults.lock().await.lookup_error_500;
        if p > 0.0 && chance(self.seq.fetch_add(1, Ordering::SeqCst) * 3) < p {
            self.lookup_errors.fetch_add(1, Ordering::SeqCst);
            return Some(error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "api_error",
                "an injected failure of a lookup",
            ));
        }
        None
    }

    /// The faults that answer a request before it applies anything, by
    /// the request's sequence number `seq`: a 500 (`error_500`) or a 429
    /// with `Retry-After` (`rate_limit_429`); `None` when neither fires.
    /// `nothing` says what was not done ("paid", "booked").
    fn refused_before_applying(&self, faults: &Faults, seq: u64, nothing: &str) -> Option<Response> {
        if chance(seq * 3) < faults.error_500 {
            self.errors_500.fetch_add(1, Ordering::SeqCst);
            let message = format!("an injected failure; nothing was {nothing}");
            return Some(error(StatusCode::INTERNAL_SERVER_ERROR, "api_error", &message));
        }
        if chance(seq * 3 + 1) < faults.rate_limit_429 {
            self.rate_limited.fetch_add(1, Ordering::SeqCst);
            let message = format!("slow down; nothing was {nothing}");
            let mut res = error(StatusCode::TOO_MANY_REQUESTS, "rate_limit", &message);
            res.headers_mut().insert(
                header::RETRY_AFTER,
                faults.retry_after_secs.to_string().parse().expect("digits"),
            );
            return Some(res);
        }
        None
    }

    /// Payout requests being processed right now (arrived, not yet answered).
    pub fn in_process(&self) -> usize {
        self.lock_processing().0.len()
    }

    /// Sets the switchable faults (`refuse_ms` starts refusing now).
    pub async fn set_faults(&self, faults: Faults) {
        if faults.refuse_ms > 0 {
            self.refuse_until_ms
                .store(now_ms().saturating_add(faults.refuse_ms), Ordering::SeqCst);
        }
        *self.faults.lock().await = Faults { refuse_ms: 0, ..faults };
    }

    /// Moves the vendor's clock forward (keys age by as much).
    pub fn advance(&self, by: Duration) {
        self.clock_offset_ms
            .fetch_add(u64::try_from(by.as_millis()).unwrap_or(u64::MAX), Ordering::SeqCst);
    }

    fn now_ms(&self) -> u64 {
        now_ms().saturating_add(self.clock_offset_ms.load(Ordering::SeqCst))
    }

    fn lock_processing(&self) -> std::sync::MutexGuard<'_, InProcess> {
        self.processing
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// Marks a request as being processed until dropped.
struct Processing<'a> {
    vendor: &'a Vendor,
    key: Option<String>,
    reference: Option<String>,
}

impl Drop for Processing<'_> {
    fn drop(&mut self) {
        let mut p = self.vendor.lock_processing();
        if let Some(key) = &self.key {
            p.0.remove(key);
        }
        if let Some(reference) = &self.reference
            && let Some(entry) = p.1.get_mut(reference)
        {
            entry.1 -= 1;
            if entry.1 == 0 {
                p.1.remove(reference);
            }
        }
    }
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// A pseudo-random number in [0, 1), from a counter (no RNG dependency).
fn chance(seq: u64) -> f64 {
    let h = Sha256::digest(seq.to_le_bytes());
    u64::from_le_bytes(h[..8].try_into().expect("8 bytes")) as f64 / u64::MAX as f64
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct NewPayout {
    amount: i64,
    #[serde(default)]
    reference: Option<String>,
    #[serde(default)]
    destination: Option<String>,
}

/// Destinations the vendor declines (an account closed at the bank).
pub const CLOSED_DESTINATION_PREFIX: &str = "closed-";

fn error(status: StatusCode, code: &str, message: &str) -> Response {
    (
        status,
        Json(serde_json::json!({ "error": { "type": code, "message": message } })),
    )
        .into_response()
}

/// `POST /v1/payouts`. The work runs in a task of its own, as at a real
/// vendor: a caller that gives up (times out, hangs up) does not stop it,
/// and it may still pay after the caller has gone.
async fn payout(State(v): State<Arc<Vendor>>, headers: HeaderMap, body: axum::body::Bytes) -> Response {
    match tokio::spawn(process(v, headers, body)).await {
        Ok(response) => response,
        // The `apply_then_drop` fault: the connection goes away unanswered.
        Err(e) => std::panic::resume_unwind(e.into_panic()),
    }
}

async fn process(v: Arc<Vendor>, headers: HeaderMap, body: axum::body::Bytes) -> Response {
    // Whether a key is still remembered is judged when the request arrives,
    // as a real vendor looks a key up first: a slow answer does not age it.
    let arrived_ms = v.now_ms();
    let faults = v.faults.lock().await.clone();
    let key = headers
        .get("idempotency-key")
        .and_then(|k| k.to_str().ok())
        .map(str::to_owned);
    let key = match (v.options.idempotency, key) {
        (true, Some(key)) => Some(key),
        (true, None) => {
            return error(
                StatusCode::BAD_REQUEST,
                "invalid_request",
                "an Idempotency-Key header is required",
            );
        }
        // A vendor without idempotency ignores the header altogether.
        (false, _) => None,
    };
    let Ok(req) = serde_json::from_slice::<NewPayout>(&body) else {
        return error(
            StatusCode::BAD_REQUEST,
            "invalid_request",
            "body: {\"amount\": positive integer, \"reference\"?, \"destination\"?}",
        );
    };
    if req.amount <= 0 {
        return error(StatusCode::BAD_REQUEST, "invalid_request", "amount must be positive");
    }
    // From here the request is being processed: a second request with its
    // key is told so (409), and a lookup of its reference says
    // "processing", until it ends whichever way.
    let _processing = {
        let mut p = v.lock_processing();
        if let Some(key) = &key
            && !p.0.insert(key.clone())
        {
            drop(p);
            v.in_use.fetch_add(1, Ordering::SeqCst);
            return error(
                StatusCode::CONFLICT,
                "idempotency_error",
                "idempotency_key_in_use: a request with this key is being processed; retry later",
            );
        }
        if let Some(reference) = &req.reference {
            p.1.entry(reference.clone()).or_insert((req.amount, 0)).1 += 1;
        }
        Processing {
            vendor: &v,
            key: key.clone(),
            reference: req.reference.clone(),
        }
    };
    if faults.slow_ms > 0 {
        tokio::time::sleep(Duration::from_millis(faults.slow_ms)).await;
    }
    let fingerprint: [u8; 32] = Sha256::digest(&body).into();
    let mut keys = v.keys.lock().await;
    if let Some(key) = &key
        && let Some(r) = keys.get(key)
    {
        if arrived_ms.saturating_sub(r.at_ms) >= v.options.key_horizon.as_millis() as u64 {
            // Past the horizon the vendor has forgotten the key: the same
            // request is a new one, and pays again.
            keys.remove(key);
            v.forgotten.fetch_add(1, Ordering::SeqCst);
        } else if r.fingerprint != fingerprint {
            v.mismatched.fetch_add(1, Ordering::SeqCst);
            return error(
                StatusCode::UNPROCESSABLE_ENTITY,
                "idempotency_key_reused",
                "this key was used with another request",
            );
        } else {
            v.replayed.fetch_add(1, Ordering::SeqCst);
            let mut res = (r.status, Json(r.body.clone())).into_response();
            res.headers_mut()
                .insert("idempotent-replayed", "true".parse().expect("a header value"));
            return res;
        }
    }
    let seq = v.seq.fetch_add(1, Ordering::SeqCst);
    if let Some(refused) = v.refused_before_applying(&faults, seq, "paid") {
        return refused;
    }
    if let Some(destination) = req
        .destination
        .as_deref()
        .filter(|d| d.starts_with(CLOSED_DESTINATION_PREFIX))
    {
        // Declined, and the decline recorded under the key: a retry is told
        // the same, and nothing is paid.
        let declined = serde_json::json!({ "error": {
            "type": "destination_closed",
            "message": format!("the destination {destination} is closed; nothing was paid"),
        }});
        if let Some(key) = &key {
            keys.insert(
                key.clone(),
                Recorded {
                    fingerprint,
                    status: StatusCode::PAYMENT_REQUIRED,
                    body: declined.clone(),
                    at_ms: v.now_ms(),
                },
            );
        }
        v.declined.fetch_add(1, Ordering::SeqCst);
        return (StatusCode::PAYMENT_REQUIRED, Json(declined)).into_response();
    }
    let mut body = serde_json::json!({
        "id": format!("po_{}", uuid::Uuid::now_v7().simple()),
        "amount": req.amount,
        "reference": req.reference,
    });
    if let Some(destination) = &req.destination {
        body["destination"] = destination.as_str().into();
    }
    if let Some(key) = &key {
        keys.insert(
            key.clone(),
            Recorded {
                fingerprint,
                status: StatusCode::CREATED,
                body: body.clone(),
                at_ms: v.now_ms(),
            },
        );
    }
    v.payments.lock().await.push((key, body.clone()));
    v.paid.fetch_add(1, Ordering::SeqCst);
    v.total.fetch_add(req.amount as u64, Ordering::SeqCst);
    drop(keys);
    if chance(seq * 3 + 2) < faults.apply_then_drop {
        v.dropped.fetch_add(1, Ordering::SeqCst);
        // Paid and recorded; the connection goes away without an answer.
        panic!("{DROPPED_ON_PURPOSE}");
    }
    (StatusCode::CREATED, Json(body)).into_response()
}

/// What it paid: `payouts` (payments made), `total`, `keys` (the distinct
/// keys that paid) and `references` (the distinct references paid). A key
/// or reference paid twice shows as fewer keys or references than payouts.
async fn ledger(State(v): State<Arc<Vendor>>) -> Json<serde_json::Value> {
    let payments = v.payments.lock().await;
    let keys: std::collections::BTreeSet<&String> = payments.iter().filter_map(|(k, _)| k.as_ref()).collect();
    let references: std::collections::BTreeSet<&str> =
        payments.iter().filter_map(|(_, b)| b["reference"].as_str()).collect();
    Json(serde_json::json!({
        "payouts": v.paid.load(Ordering::SeqCst),
        "total": v.total.load(Ordering::SeqCst),
        "keys": keys,
        "references": references,
    }))
}

#[derive(Deserialize)]
struct Lookup {
    reference: String,
}

/// `GET /v1/payouts?reference=R`: the payments of that reference, and the
/// requests with it still being processed.
async fn lookup(State(v): State<Arc<Vendor>>, Query(q): Query<Lookup>) -> Response {
    if let Some(failed) = v.lookup_fault().await {
        return failed;
    }
    let mut data: Vec<serde_json::Value> = v
        .payments
        .lock()
        .await
        .iter()
        .filter(|(_, b)| b["reference"].as_str() == Some(q.reference.as_str()))
        .map(|(_, b)| {
            let mut b = b.clone();
            b["status"] = "paid".into();
            b
        })
        .collect();
    if let Some((amount, _)) = v.lock_processing().1.get(&q.reference) {
        data.push(serde_json::json!({ "reference": q.reference, "amount": amount, "status": "processing" }));
    }
    Json(serde_json::json!({ "object": "list", "data": data })).into_response()
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ClockMove {
    advance_ms: u64,
}

/// `PUT /_clock {"advance_ms": n}`: moves the vendor's clock forward.
async fn move_clock(State(v): State<Arc<Vendor>>, Json(m): Json<ClockMove>) -> StatusCode {
    v.advance(Duration::from_millis(m.advance_ms));
    StatusCode::NO_CONTENT
}

async fn get_faults(State(v): State<Arc<Vendor>>) -> Json<Faults> {
    Json(v.faults.lock().await.clone())
}

async fn set_faults(State(v): State<Arc<Vendor>>, Json(f): Json<Faults>) -> Response {
    let bad = |p: f64| !(0.0..=1.0).contains(&p);
    if bad(f.apply_then_drop) || bad(f.error_500) || bad(f.rate_limit_429) || bad(f.lookup_error_500) {
        return error(
            StatusCode::BAD_REQUEST,
            "invalid_request",
            "probabilities are between 0 and 1",
        );
    }
    v.set_faults(f).await;
    StatusCode::NO_CONTENT.into_response()
}

async fn stats(State(v): State<Arc<Vendor>>) -> Json<Stats> {
    let (quotes_booked, quotes_cancelled, _) = v.quotes.summary().await;
    Json(Stats {
        paid: v.paid.load(Ordering::SeqCst),
        replayed: v.replayed.load(Ordering::SeqCst),
        mismatched: v.mismatched.load(Ordering::SeqCst),
        dropped: v.dropped.load(Ordering::SeqCst),
        errors_500: v.errors_500.load(Ordering::SeqCst),
        rate_limited: v.rate_limited.load(Ordering::SeqCst),
        forgotten: v.forgotten.load(Ordering::SeqCst),
        in_use: v.in_use.load(Ordering::SeqCst),
        lookups: v.lookups.load(Ordering::SeqCst),
        lookup_errors: v.lookup_errors.load(Ordering::SeqCst),
        quotes_booked: quotes_booked as u64,
        quotes_cancelled: quotes_cancelled as u64,
        declined: v.declined.load(Ordering::SeqCst),
    })
}

/// The vendor's routes.
pub fn router(vendor: Arc<Vendor>) -> Router {
    Router::new()
        .route("/v1/payouts", post(payout).get(lookup))
        .route("/v1/quotes", post(quotes::book).get(quotes::lookup))
        .route("/v1/quotes/ledger", get(quotes::ledger))
        .route("/v1/quotes/{id}/cancel", post(quotes::cancel))
        .route("/_clock", axum::routing::put(move_clock))
        .route("/v1/ledger", get(ledger))
        .route("/_faults", get(get_faults).put(set_faults))
        .route("/_stats", get(stats))
        .with_state(vendor)
}

/// Serves on `addr` until `shutdown`. While a `refuse_ms` fault is on, the
/// listener is closed (connections are refused) and opened again after.
pub async fn serve(
    addr: std::net::SocketAddr,
    vendor: Arc<Vendor>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    serve_with_tls(addr, vendor, None, shutdown).await
}

/// Starts a vendor treating keys by `options` on a free loopback port, over
/// TLS with `tls` when given, and answers its base URL (`http://` or
/// `https://`) once it accepts connections; it serves until the runtime
/// ends. Fails if it does not accept within two seconds.
pub async fn start(
    options: Options,
    tls: Option<Arc<idem_tls::rustls::ServerConfig>>,
) -> std::io::Result<(String, Arc<Vendor>)> {
    // The listener is bound here and served as it is: no other server can
    // take the port between its choice and its use.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let scheme = if tls.is_some() { "https" } else { "http" };
    let vendor = Arc::new(Vendor::new(options));
    tokio::spawn(serve_listener(listener, vendor.clone(), tls, std::future::pending()));
    for _ in 0..200 {
        if tokio::net::TcpStream::connect(addr).await.is_ok() {
            return Ok((format!("{scheme}://{addr}"), vendor));
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    Err(std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        format!("the fake vendor did not start on {addr}"),
    ))
}

/// [`serve`], over TLS with `tls` when given (`https://`).
pub async fn serve_with_tls(
    addr: std::net::SocketAddr,
    vendor: Arc<Vendor>,
    tls: Option<Arc<idem_tls::rustls::ServerConfig>>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    serve_listener(tokio::net::TcpListener::bind(addr).await?, vendor, tls, shutdown).await
}

/// The `apply_then_drop` fault ends its connection's task with a panic on
/// purpose (the only way an axum handler drops its connection unanswered):
/// the process's panic hook leaves those out, once installed, and reports
/// every other panic as the hook before it did. Every server this crate
/// starts installs it, so a test's own failure is not buried under the
/// vendor's backtraces.
pub fn quiet_dropped_answers() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let payload = info.payload();
            let message = payload
                .downcast_ref::<&str>()
                .copied()
                .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
                .unwrap_or("");
            if message != DROPPED_ON_PURPOSE {
                previous(info);
            }
        }));
    });
}

/// The message of the panics [`quiet_dropped_answers`] leaves out, and of
/// no other.
pub const DROPPED_ON_PURPOSE: &str = "fake vendor: the response is dropped on purpose";

/// [`serve_with_tls`] on a bound `listener`; a refusal fault closes it and
/// binds its address again when the fault ends.
async fn serve_listener(
    mut listener: tokio::net::TcpListener,
    vendor: Arc<Vendor>,
    tls: Option<Arc<idem_tls::rustls::ServerConfig>>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    quiet_dropped_answers();
    let addr = listener.local_addr()?;
    tokio::pin!(shutdown);
    loop {
        let v = vendor.clone();
        let refused = async move {
            loop {
                tokio::time::sleep(Duration::from_millis(20)).await;
                if v.refuse_until_ms.load(Ordering::SeqCst) > now_ms() {
                    return;
                }
            }
        };
        let app = router(vendor.clone());
        let served = async {
            match &tls {
                Some(config) => axum::serve(TlsListener::new(listener, config.clone()), app).await,
                None => axum::serve(listener, app).await,
            }
        };
        tokio::select! {
            r = served => return r,
            _ = &mut shutdown => return Ok(()),
            _ = refused => {}
        }
        // Refusing: the listener is dropped until the fault ends (or is
        // ended early through `refuse_until_ms`).
        while vendor.refuse_until_ms.load(Ordering::SeqCst) > now_ms() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        listener = tokio::net::TcpListener::bind(addr).await?;
    }
}

/// A TCP listener whose connections are TLS servers: each accepted
/// connection is handed on once its handshake is done; one whose handshake
/// fails (a client that does not trust the certificate, plain HTTP) is
/// logged and closed. Handshakes run beside the accept loop, so a slow
/// client holds up no other.
pub struct TlsListener {
    addr: std::net::SocketAddr,
    ready: tokio::sync::mpsc::Receiver<(
        tokio_rustls::server::TlsStream<tokio::net::TcpStream>,
        std::net::SocketAddr,
    )>,
    accepting: tokio::task::JoinHandle<()>,
}

impl TlsListener {
    /// TLS with `config` on the connections of `listener`.
    pub fn new(listener: tokio::net::TcpListener, config: Arc<idem_tls::rustls::ServerConfig>) -> Self {
        let addr = listener.local_addr().unwrap_or_else(|_| ([0, 0, 0, 0], 0).into());
        let acceptor = tokio_rustls::TlsAcceptor::from(config);
        let (tx, ready) = tokio::sync::mpsc::channel(64);
        let accepting = tokio::spawn(async move {
            loop {
                let (tcp, peer) = match listener.accept().await {
                    Ok(c) => c,
                    Err(e) => {
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(10)).await;
                        continue;
                    }
                };
                let acceptor = acceptor.clone();
                let tx = tx.clone();
                tokio::spawn(async move {
                    match tokio::time::timeout(Duration::from_secs(10), acceptor.accept(tcp)).await {
                        Ok(Ok(stream)) => {
                            let _ = tx.send((stream, peer)).await;
                        }
                        Ok(Err(e)) => tracing::info!(%peer, error = %e, "TLS handshake failed"),
                        Err(_) => tracing::info!(%peer, "TLS handshake timed out"),
                    }
                });
            }
        });
        Self { addr, ready, accepting }
    }
}

impl Drop for TlsListener {
    fn drop(&mut self) {
        self.accepting.abort();
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = tokio_rustls::server::TlsStream<tokio::net::TcpStream>;
    type Addr = std::net::SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.ready.recv().await {
            Some(conn) => conn,
            // The accept loop never ends while the listener lives.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        Ok(self.addr)
    }
}
