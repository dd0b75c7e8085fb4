//! Withdrawals: `POST /v1/withdrawals`, a request that crosses two
//! vendors, applied exactly once as the multi-step operation
//! `withdrawal@1` (`idem-steps`).
//!
//! 1. `debit` (local): the account is debited to `@world` (kind
//!    `withdrawal`), the withdrawal row is written as `pending` and the
//!    `withdrawal.requested` event enqueued, in one transaction with the
//!    step's recorded output (the withdrawal id, a UUIDv7 made inside the
//!    step, so every later run reads the same one). Short of funds: nothing
//!    is written, the key stays unused, and the client gets 422.
//! 2. `fx-quote` (external): a quote at the FX vendor, which has **no
//!    idempotency keys** — `POST {fx}/v1/quotes` books a new quote on every
//!    call. Its client's key horizon is none, so a send that may have
//!    reached the vendor (a lost answer, a crash) is never repeated blindly:
//!    the vendor is asked first by reference ([`QuoteLookup`]:
//!    `GET {fx}/v1/quotes?reference={withdrawal id}`).
//! 3. `payout` (external): the quote's amount out paid to the destination
//!    at the Stripe-like payout vendor, with the step's derived key on every
//!    send; within the vendor's memory of keys a re-send is answered with
//!    its record, past it the vendor is asked by reference
//!    ([`VendorLookup`]).
//! 4. `settle` (local): the withdrawal becomes `paid` (with the quote and
//!    the vendor's payout id) and `withdrawal.paid` is enqueued. The answer
//!    is 201 with the withdrawal.
//!
//! A vendor's final refusal (an unquoted pair, a closed destination
//! answered 402) is the operation's declared failure: its compensation
//! releases the quote if one was booked (`release-quote`, external:
//! `POST {fx}/v1/quotes/{id}/cancel`, which the vendor answers the same
//! however often it is sent) and credits the debit back (`credit-back`,
//! local: kind `withdrawal_reversal`, the withdrawal `declined`,
//! `withdrawal.declined` enqueued). The answer is 422 `withdrawal-declined`.
//!
//! A run stopped anywhere (a crash, a lost answer, a client gone) is resumed
//! by the client's retry with the same key, once the run's lease has run
//! out, or by a completer ([`complete_due`], run by the server unless
//! `--completers 0`). An answer that cannot be established holds the
//! withdrawal for an operator's verdict (`idem ops mark`), and nothing is
//! sent again on a guess.

mod fx;
mod steps;

use std::sync::Arc;
use std::time::Duration;

use idem_core::SharedClock;
use idem_outbound::{KeyHorizon, OutboundClient, OutboundConfig};
use idem_steps::{Pass, Registry, StepsEngine};
use serde::{Deserialize, Serialize};

use crate::db::LedgerDb;
use crate::events::Namespace;
use crate::payouts::VendorLookup;

pub use fx::QuoteLookup;
pub use steps::Withdraw;
pub(crate) use steps::reason_of;

/// The operation of a withdrawal's scope: the route.
pub const WITHDRAWAL_OPERATION: &str = "POST /v1/withdrawals";

/// The steps of `withdrawal@1`, in order, then those of its compensation.
pub const STEPS: [&str; 6] = ["debit", "fx-quote", "payout", "settle", "release-quote", "credit-back"];

/// How withdrawals reach their vendors and are completed.
#[derive(Debug, Clone)]
pub struct WithdrawalsConfig {
    /// The FX vendor's base URL: quotes at `{fx_url}/v1/quotes`.
    pub fx_url: String,
    /// The payout vendor's base URL: payouts at `{payout_url}/v1/payouts`.
    pub payout_url: String,
    /// The FX calls' settings; their key horizon is always none, whatever
    /// this says (the FX vendor has no keys).
    pub fx: OutboundConfig,
    /// The payout calls' settings (the vendor's key horizon included).
    pub payout: OutboundConfig,
    /// How long a run holds a withdrawal before another may take it over.
    pub lease: Duration,
    /// How long a final withdrawal's outcome is kept for replays.
    pub ttl: Duration,
    /// Completers in the server process (0: none; operations whose client
    /// went away wait for a retry or a `ledger complete` process).
    pub completers: usize,
    /// How long a completer waits after a pass that found nothing.
    pub completer_idle: Duration,
    /// How long a request waits for its withdrawal before it answers 409
    /// `idempotency-key-in-flight` (the withdrawal goes on).
    pub respond_within: Duration,
}

impl WithdrawalsConfig {
    /// Withdrawals through the FX vendor at `fx_url` and the payout vendor
    /// at `payout_url`: the clients' defaults (the payout vendor remembering
    /// keys for 24 h), a 30 s lease, outcomes kept 7 days, one completer
    /// idling 1 s, answers within 25 s; each vendor call retried after
    /// 0.2, 1 and 3 s, its attempts cut at 5 s.
    pub fn new(fx_url: &str, payout_url: &str) -> Self {
        // A call's retries fit well within a run's lease: a send is never
        // started once the lease has run out.
        let within_a_run = OutboundConfig {
            retry_delays: vec![
                Duration::from_millis(200),
                Duration::from_secs(1),
                Duration::from_secs(3),
            ],
            deadline: Duration::from_secs(20),
            attempt_timeout: Duration::from_secs(5),
            ..OutboundConfig::default()
        };
        Self {
            fx_url: fx_url.trim_end_matches('/').to_owned(),
            payout_url: payout_url.trim_end_matches('/').to_owned(),
            fx: OutboundConfig {
                name: "fx".into(),
                ..within_a_run.clone()
            },
            payout: OutboundConfig {
                name: "withdrawal-payouts".into(),
                ..within_a_run
            },
            lease: Duration::from_secs(30),
            ttl: Duration::from_secs(crate::api::PAYOUT_KEY_TTL_SECS),
            completers: 1,
            completer_idle: Duration::from_secs(1),
            respond_within: Duration::from_secs(25),
        }
    }
}

impl WithdrawalsConfig {
    /// Checks that the vendors' clients can be built (URLs, TLS roots).
    pub fn validate(&self) -> Result<(), crate::StartError> {
        let clock: SharedClock = Arc::new(idem_core::SystemClock);
        Vendors::new(self, &clock).map(|_| ())
    }
}

/// The vendors' clients, each with the way it asks its vendor before a
/// send that may repeat an earlier one.
pub(crate) struct Vendors {
    /// Quotes: no keys, asked by reference.
    pub(crate) fx: OutboundClient,
    /// Releases of quotes: a cancel is answered the same however often it
    /// is sent, as a key the vendor never forgets would be.
    pub(crate) release: OutboundClient,
    /// Payouts: keys within the vendor's horizon, asked by reference past it.
    pub(crate) payout: OutboundClient,
    pub(crate) fx_url: String,
    pub(crate) payout_url: String,
}

/// A release may be sent again at any time: the vendor answers a cancelled
/// quote with its record.
const RELEASE_HORIZON: Duration = Duration::from_secs(10 * 365 * 24 * 3600);

impl Vendors {
    /// The clients of `config`, reading `clock`.
    pub(crate) fn new(config: &WithdrawalsConfig, clock: &SharedClock) -> Result<Self, crate::StartError> {
        let bad = |what: &str, e: idem_outbound::OutboundError| crate::StartError::Config(format!("{what}: {e}"));
        let fx_config = OutboundConfig {
            key_horizon: KeyHorizon::NONE,
            host_key_horizons: Vec::new(),
            ..config.fx.clone()
        };
        let fx = OutboundClient::new(fx_config.clone()).map_err(|e| bad("the FX vendor's client", e))?;
        let lookup = QuoteLookup::new(&config.fx_url)?.through(&fx);
        let fx = fx.with_clock(clock.clone()).with_reconcile(Arc::new(lookup));
        let release = OutboundClient::new(OutboundConfig {
            name: "fx-release".into(),
            key_horizon: KeyHorizon::new(RELEASE_HORIZON, Duration::ZERO),
            ..fx_config
        })
        .map_err(|e| bad("the FX vendor's client", e))?
        .with_clock(clock.clone());
        let payout = OutboundClient::new(config.payout.clone()).map_err(|e| bad("the payout vendor's client", e))?;
        let lookup = VendorLookup::new(&config.payout_url)
            .map_err(|e| crate::StartError::Config(format!("--vendor-url: {e}")))?
            .through(&payout);
        let payout = payout.with_clock(clock.clone()).with_reconcile(Arc::new(lookup));
        fx.check_target(&format!("{}/v1/quotes", config.fx_url))
            .map_err(|e| crate::StartError::Config(format!("--fx-url: {e}")))?;
        payout
            .check_target(&format!("{}/v1/payouts", config.payout_url))
            .map_err(|e| crate::StartError::Config(format!("--vendor-url: {e}")))?;
        Ok(Self {
            fx,
            release,
            payout,
            fx_url: config.fx_url.clone(),
            payout_url: config.payout_url.clone(),
        })
    }
}

/// What a client asks for: the body of `POST /v1/withdrawals` and the
/// tenant it comes from. Kept with the operation, so any run can resume it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WithdrawalInput {
    /// The tenant.
    pub tenant: String,
    /// The account debited.
    pub account: String,
    /// Minor units of `currency`.
    pub amount: i64,
    /// The account's currency (three capital letters).
    pub currency: String,
    /// The currency paid out (three capital letters).
    pub payout_currency: String,
    /// Where the payout vendor pays it.
    pub destination: String,
}

/// A paid withdrawal: the operation's output, recorded and replayed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Withdrawn {
    /// The withdrawal id: the reference both vendors see.
    pub id: String,
    /// `paid`.
    pub status: crate::db::WithdrawalState,
    /// The account debited.
    pub account: String,
    /// Minor units of `currency`, debited.
    pub amount: i64,
    /// The account's currency.
    pub currency: String,
    /// The currency paid out.
    pub payout_currency: String,
    /// Where it was paid.
    pub destination: String,
    /// The FX vendor's quote.
    pub quote_id: String,
    /// The quote's rate, an exact decimal.
    pub rate: String,
    /// Minor units of `payout_currency` paid out.
    pub amount_out: i64,
    /// The payout vendor's id of the payment.
    pub vendor_payout_id: Option<String>,
}

/// The engine of withdrawals on `db`: its operations in
/// [`LedgerDb::multi_steps`], its runs holding them `lease`, its outcomes
/// kept `ttl`.
pub fn engine<D: LedgerDb>(db: &D, clock: SharedClock, config: &WithdrawalsConfig) -> StepsEngine<D, D::MultiSteps> {
    StepsEngine::new(db.clone(), db.multi_steps())
        .with_clock(clock)
        .with_lease_ms(millis(config.lease))
        .with_ttl_ms(millis(config.ttl))
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// The operations a withdrawals completer resumes: `withdrawal@1`.
pub fn registry<D: LedgerDb>(op: Withdraw<D>) -> Registry<D, D::MultiSteps> {
    Registry::new().with(op)
}

/// One completer pass on `db`: at most `limit` withdrawals whose run
/// stopped (no live lease) resumed from their recovery points.
pub async fn complete_due<D: LedgerDb>(
    db: &D,
    clock: SharedClock,
    config: &WithdrawalsConfig,
    namespace: &Namespace,
    limit: u32,
) -> Result<Pass, crate::StartError> {
    let op = Withdraw::new(db, clock.clone(), config, namespace.clone())?;
    let engine = engine(db, clock, config);
    Ok(engine.complete_due(&registry(op), limit).await?)
}

/// `completers` completers of withdrawals on `db` until `stopped` turns
/// true; a run under way when it does is let finish.
pub async fn run_completers<D: LedgerDb>(
    db: D,
    clock: SharedClock,
    config: WithdrawalsConfig,
    namespace: Namespace,
    completers: usize,
    mut stopped: tokio::sync::watch::Receiver<bool>,
) {
    let op = match Withdraw::new(&db, clock.clone(), &config, namespace) {
        Ok(op) => op,
        Err(e) => return tracing::error!(error = %e, "the withdrawals completers did not start"),
    };
    let engine = Arc::new(engine(&db, clock, &config));
    let registry = Arc::new(registry(op));
    tracing::info!(completers, "withdrawal completers running");
    let mut running = tokio::task::JoinSet::new();
    for _ in 0..completers {
        let (engine, registry, idle) = (engine.clone(), registry.clone(), config.completer_idle);
        let mut stopped = stopped.clone();
        running.spawn(async move {
            loop {
                if *stopped.borrow() {
                    return;
                }
                match engine.complete_due(&registry, 64).await {
                    Ok(pass) if pass.taken > 0 => continue,
                    Ok(_) => {}
                    Err(e) => tracing::warn!(error = %e, "a withdrawals completer pass failed"),
                }
                tokio::select! {
                    _ = stopped.wait_for(|s| *s) => return,
                    _ = tokio::time::sleep(idle) => {}
                }
            }
        });
    }
    let _ = stopped.wait_for(|s| *s).await;
    while running.join_next().await.is_some() {}
}
