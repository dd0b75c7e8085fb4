//! Outbound calls for idem: a vendor call (a payout) sent with **one
//! idempotency key across every retry**, so a vendor that honours the key
//! applies it at most once however many times it is sent; a per-host circuit
//! breaker; and the redrive of calls that ended as dead letters.
//!
//! The guide, with examples: `docs/outbound.md` in the repository.
//!
//! ```no_run
//! use idem_core::{IdempotencyKey, OutboundRequest};
//! use idem_outbound::{OutboundClient, OutboundConfig, OutboundError};
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let client = OutboundClient::new(OutboundConfig::default())?;
//! let key = IdempotencyKey::generate();
//! let request = OutboundRequest::new(
//!     "POST",
//!     "http://vendor.example/v1/payouts",
//!     vec![("content-type".into(), "application/json".into())],
//!     br#"{"amount": 100}"#.to_vec(),
//! )?;
//! match client.send(&key, &request).await {
//!     Ok(answer) => println!("{} after {} attempt(s)", answer.status, answer.attempts),
//!     Err(OutboundError::Rejected { status, .. }) => println!("refused: {status}"),
//!     Err(e) => {
//!         // Retries used up: keep it (e.dead_letter(..)) and redrive it later
//!         // with the same key.
//!         println!("{e}");
//!     }
//! }
//! # Ok(()) }
//! ```
//!
//! # Retries
//!
//! One logical call = [`OutboundClient::send`]. Every attempt carries the
//! same key in the configured header (default `Idempotency-Key`; a header of
//! that name in the request is replaced).
//!
//! | answer | retried? | breaker |
//! |---|---|---|
//! | 2xx | no: [`OutboundResponse`] | success |
//! | 3xx (not followed) | no: [`OutboundError::Rejected`] | success |
//! | other 4xx | no: [`OutboundError::Rejected`] | success |
//! | 408, 425, 5xx | yes | failure |
//! | 429 | yes, honouring `Retry-After` | failure |
//! | 409 with `Retry-After`, or whose body says `idempotency_key_in_use` / `…/idempotency-key-in-flight` (the key is in flight at the vendor) | yes, after the wait | success |
//! | connect refused, DNS (not sent) | yes | failure |
//! | reset, body cut off, attempt timeout (may have reached the vendor) | yes | failure |
//! | refused by an open breaker (not sent) | yes, not before the open period ends | — |
//! | `https://` without the `tls` feature, user information, a fragment, port 0 (cannot work) | no: [`OutboundError::Invalid`], nothing sent | — |
//!
//! The waits are the configured list (default 500 ms, 2 s, 5 s, 30 s), each
//! spread by the [`Jitter`] (default ±20 %); after the last the call gives
//! up with [`OutboundError::Exhausted`] (`attempts` = delays + 1). A
//! `Retry-After` on a 429 or 503 (delta-seconds or an HTTP-date) replaces a
//! shorter scheduled wait. Nothing waits past the call's `deadline` (default
//! 60 s): a wait that would reach it ends the call at once (a server's
//! `Retry-After` then ends it as [`OutboundError::RetryLater`], with the
//! wait asked for, so a worker can defer the call), and each attempt
//! is cut at `attempt_timeout` (default 10 s) or the deadline, whichever is
//! first. Response bodies are read up to `max_response_body` (default
//! 1 MiB), never further. The classification of statuses is the core's
//! [`idem_core::http_status_retryable`].
//!
//! # The vendor's memory: key horizons and reconcile
//!
//! A vendor remembers an idempotency key only for a while (Stripe and
//! Checkout.com 24 h, Qonto 30 min), and some have no keys at all. A
//! re-send — a retry within a call, a [`resend`](OutboundClient::resend)
//! by a worker that took a call over, a redrive — is sent blindly only
//! while **the first send that may have reached the vendor** is younger
//! than the target's [`KeyHorizon`] less its margin (configuration:
//! `key_horizon`, default 24 h less 1 h; per host in `host_key_horizons`;
//! [`KeyHorizon::NONE`] for a vendor without keys). Past it, the vendor is
//! asked first through the client's [`Reconcile`] hook (typically a lookup
//! by the reference the request carries):
//!
//! | the vendor says | the call |
//! |---|---|
//! | [`Reconciled::Applied`] | its record is the answer (`reconciled`), nothing is sent |
//! | [`Reconciled::NotApplied`] | is sent (and the horizon starts over) |
//! | [`Reconciled::InFlight`] | waits and asks again, within the deadline |
//! | [`Reconciled::Unknown`], or no hook | ends as [`OutboundError::Unknown`]: nothing sent; kept as a dead letter in state `unknown` for an operator |
//!
//! Only attempts that may have reached the vendor count: any answer, a
//! timeout, a connection lost after the request was written. A refused
//! connection, a breaker's refusal or an invalid request sent nothing. The
//! age is measured on the client's clock ([`with_clock`](OutboundClient::with_clock):
//! the store's `AnchoredClock` in production, so every instance agrees),
//! and callers persist the first reach where a re-send can see it (a dead
//! letter's `first_reached_at_ms`; the ledger's payout row). An operator may
//! override the horizon ([`Earlier::past_horizon_override`],
//! `idem dlq redrive --past-horizon`) after checking the vendor; an outcome
//! held as unknown is released only by a verdict (`idem dlq resolve`).
//!
//! # Secret headers
//!
//! Vendor credentials go in the configuration's `secret_headers`
//! ([`OutboundConfig::with_secret_header`]): sent with every attempt, marked
//! sensitive, never part of an [`OutboundRequest`](idem_core::OutboundRequest) — which refuses
//! `Authorization`, `Proxy-Authorization`, `Cookie` and `X-Api-Key` — so a
//! dead letter, `idem dlq show` or a log never holds them, and a redrive's
//! client supplies them again from its own configuration.
//!
//! # The circuit breaker
//!
//! One per host (`scheme://host:port`). **Closed**: attempts go through;
//! `failure_threshold` (default 5) consecutive failures open it (a count,
//! not a rate: it behaves the same at one call a minute and at a thousand a
//! second). **Open** for `open_for` (default 30 s): attempts are not sent;
//! such an attempt counts as one of the call's attempts, and the call keeps
//! to its schedule, waiting at least until the open period ends — or ends
//! at once with `Exhausted` when that is past its deadline. **Half-open**:
//! the first attempt after the open period is the single probe; every other
//! attempt is refused while it is in flight (a probe whose call is cancelled
//! hands its turn to the next attempt). The probe's success closes the
//! breaker, its failure opens it for another period. Outcomes of attempts
//! admitted in an earlier state are ignored.
//!
//! A 429 counts as a failure: a host that throttles is overloaded, and the
//! breaker sheds its load, while `Retry-After` still paces each call.
//! The breaker is written here rather than taken from `recloser` (see
//! `breaker.rs` for why: std time, no state to read, several callers let
//! through in half-open).
//!
//! # Dead letters and redrive
//!
//! An [`OutboundError::Exhausted`] call is kept with
//! [`OutboundError::dead_letter`] in an [`idem_core::DeadLetterStore`]. A
//! [`Redriver`] sends dead letters again with their stored key and request:
//! at most `max` per run, at most `per_second` sends, each held in the store
//! while it is sent (another redrive skips it), then resolved with the
//! vendor's answer or dead again with the attempts added.
//!
//! # Observability
//!
//! A `tracing` span `outbound_call` per call (key, method, host, attempts)
//! and `redrive` per dead letter (id, key, scope). Metrics:
//!
//! | metric | kind | labels |
//! |---|---|---|
//! | `idem_outbound_attempts_total` | counter | `client`, `host`, `outcome` (`success`, `rejected`, `in_flight`, `http_408`, `http_425`, `http_429`, `http_5xx`, `timeout`, `connect`, `network`, `circuit_open`, `invalid`) |
//! | `idem_outbound_retries_total` | counter | `client`, `host` |
//! | `idem_outbound_calls_total` | counter | `client`, `host`, `result` (`success`, `reconciled`, `rejected`, `exhausted`, `retry_later`, `unknown`) |
//! | `idem_outbound_reconciles_total` | counter | `client`, `result` (`applied`, `not_applied`, `in_flight`, `unknown`, `held` (no hook), `error`) |
//! | `idem_outbound_breaker_transitions_total` | counter | `client`, `host`, `to` (`closed`, `open`, `half_open`) |
//! | `idem_outbound_breaker_state` | gauge | `client`, `host` (0 closed, 1 half-open, 2 open) |
//! | `idem_outbound_redrives_total` | counter | `client`, `result` (`resolved`, `failed`, `unknown`, `skipped`, `error`) |
//!
//! `client` is the configured `name`. `host` is `scheme://host:port` for the
//! first `max_host_labels` hosts (default 64) a client sees and `other`
//! after that, so a client calling many hosts (per-tenant webhook URLs)
//! cannot grow the number of series without bound; the state gauge of
//! `other` shows the last transition of any of those hosts.
//!
//! # Built on
//!
//! [`reqwest`] (no default features; HTTPS needs a TLS feature enabled by
//! the application), [`backon`] (the retry loop: schedule, `when`,
//! `adjust` for `Retry-After`, tokio sleep), `httpdate` (HTTP-date
//! `Retry-After`), `fastrand` (jitter), `metrics`, `tracing`, and tokio's
//! clock for every wait and timeout (tests run on paused time). No crate
//! features.

mod breaker;
mod client;
mod config;
mod error;
mod metrics;
mod reconcile;
mod redrive;
mod retry_after;

pub use breaker::BreakerState;
pub use client::{Earlier, OutboundClient, OutboundResponse, SETTLE_MARGIN};
pub use config::{BreakerConfig, Jitter, MAX_DEADLINE, MAX_RESPONSE_BODY_LIMIT, MAX_RETRIES, OutboundConfig};
pub use error::{OutboundError, Result};
pub use reconcile::{KeyHorizon, Reconcile, Reconciled};
pub use redrive::{
    AnswerCheck, MAX_REDRIVES_PER_SECOND, RedriveItem, RedriveOptions, RedriveReport, RedriveResult, Redriver,
};
pub use retry_after::{MAX_RETRY_AFTER, parse_retry_after};
