//! The client side of idem: for services that call idem-protected HTTP APIs.
//!
//! The guide, with examples: `docs/client.md` in the repository.
//!
//! A caller that never heard back cannot know whether its operation was
//! applied, so it sends it again; the server applies it once only if every
//! attempt carries the same `Idempotency-Key`. This crate makes that the
//! default:
//!
//! - [`Key`]: one UUIDv7 per logical operation ([`Key::generate`]), sent as
//!   an RFC 9651 sf-string.
//! - [`Client`]: sends an [`Operation`] until a final answer, with its key on
//!   every attempt. Connection failures, timeouts, resets, cut-off bodies,
//!   5xx, 408, 429 and the 409 `…/idempotency-key-in-flight` are retried —
//!   after `Retry-After` when the server gives one, else on an exponential
//!   backoff with jitter ([`backon`]) — until an overall deadline. Other
//!   4xx stop at once as [`Error::Rejected`], with the `application/problem+json`
//!   body parsed ([`Problem`]). A replayed answer says so
//!   ([`Response::replayed`]).
//! - [`PendingStore`]: each operation is saved before its first byte is sent
//!   and removed once it got a final answer. [`SqlitePending`] keeps them in
//!   a local SQLite file (WAL, `synchronous = FULL`), so a client killed
//!   mid-call resends them with their original keys on start
//!   ([`Client::resume`]), and the server replays what it had applied.
//!   [`MemoryPending`] is for tests and in-process retries only.
//!
//! Credentials go in the client's default headers
//! ([`ClientBuilder::bearer`], [`ClientBuilder::default_header`]): they are
//! sent with every attempt and never written to the pending store, which
//! keeps each operation's own method, URL, headers and body as they are.
//!
//! ```no_run
//! use std::time::Duration;
//! use idem_client::{Client, Error, Operation, SqlitePending};
//!
//! # async fn demo() -> idem_client::Result<()> {
//! let client = Client::builder()
//!     .store(SqlitePending::open("pending.db").await?)
//!     .bearer("my-token")
//!     .deadline(Duration::from_secs(60))
//!     .build()?;
//!
//! // On start: finish what a previous run left pending, with the same keys.
//! for resumed in client.resume().await? {
//!     println!("{}: {:?}", resumed.operation.key(), resumed.result.map(|r| r.status()));
//! }
//!
//! // One logical operation, one key, however many attempts it takes.
//! let op = Operation::post("http://127.0.0.1:8080/v1/top-ups")
//!     .json(&serde_json::json!({ "account_id": "0192…", "amount": 500 }))
//!     .build()?;
//! match client.send(&op).await {
//!     Ok(answer) => println!("{} (replayed: {})", answer.text(), answer.replayed()),
//!     Err(Error::Rejected(answer)) if answer.problem().is_some_and(|p| p.is("insufficient-funds")) => {
//!         println!("declined");
//!     }
//!     // Still pending: the next send of `op` or resume() uses the same key.
//!     Err(e) if e.is_outcome_unknown() => println!("unknown yet: {e}"),
//!     Err(e) => return Err(e),
//! }
//! # Ok(()) }
//! ```
//!
//! | feature | default | what it adds |
//! |---|---|---|
//! | `sqlite` | yes | [`SqlitePending`] (sqlx, bundled SQLite) and the `idem-client-demo` binary |
//! | `tls` | no | https with the default client: rustls on ring, the platform's roots or [`ClientBuilder::ca_file`] |
//!
//! Without `tls` the default reqwest client speaks plain HTTP and refuses an
//! https operation at once; or pass a `reqwest::Client` of your own to
//! [`ClientBuilder::http`].

mod client;
mod error;
mod key;
mod operation;
mod response;
#[cfg(feature = "sqlite")]
mod sqlite;
mod store;

pub use client::{
    AttemptEvent, AttemptOutcome, Client, ClientBuilder, IDEMPOTENCY_KEY, Next, Resumed, TransportError, TransportKind,
};
pub use error::{Error, LastFailure, Result};
pub use key::{Key, MAX_KEY_LEN};
pub use operation::{MAX_HEADER_BYTES, MAX_HEADERS, MAX_URL_BYTES, Operation, OperationBuilder};
pub use response::{Decision, IDEMPOTENT_REPLAYED, KEY_IN_FLIGHT, Problem, Response, decide, retry_after};
#[cfg(feature = "sqlite")]
pub use sqlite::SqlitePending;
pub use store::{BoxFuture, DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_PENDING, MemoryPending, PendingStore};

/// The HTTP types the API uses, from the reqwest this crate is built with.
pub use reqwest::{Method, StatusCode, Url, header};
