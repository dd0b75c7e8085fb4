//! Dead letters of outbound calls: the vocabulary and the trait their stores
//! implement.
//!
//! An outbound call (a vendor payout) that used up its retries is kept in the
//! service's own database with everything needed to send it again: the
//! request, its idempotency key, the attempts and the last error. A redrive
//! sends the same request with the **same key**, so a vendor that did apply
//! it the first time answers with its recorded result instead of applying it
//! twice. The SQL lives in the store crates; the sending in `idem-outbound`.
//!
//! A dead letter is unique per (tenant, operation, key): recording the same
//! logical call again (a worker that crashed after recording it, a redrive
//! that failed) updates the one row, never adds a second.
//!
//! # Re-sends and the vendor's memory
//!
//! A vendor remembers an idempotency key only for a while (its *key
//! horizon*: 24 h at Stripe, 30 min at Qonto), and some vendors have no keys
//! at all. A dead letter therefore keeps **when the first send that may have
//! reached the vendor started** (`first_reached_at_ms`): a redrive within
//! the horizon may send blindly, one past it must first ask the vendor
//! (reconcile), and what cannot be established is held in state
//! [`Unknown`](DeadLetterState::Unknown) for an operator, never sent on a
//! guess. What the vendor or an operator said is kept as a
//! [`Reconciliation`].
//!
//! # States
//!
//! ```text
//!            record                 begin_redrive                 finish: Resolved
//!   (new) ─────────► dead ◄──────────────────────► redriving ───────────────────► resolved
//!                     │  ▲   finish: Failed            │
//!      settle: applied│  │settle: not applied          │finish: Unknown
//!       (to resolved) │  │                             ▼
//!                     │  └──────────────────────── unknown ◄── record (unknown)
//!                     └─► cancelled (only when reconciled "not applied")
//! ```
//!
//! The transitions are methods of [`DeadLetter`] (`on_record`, `take`,
//! `finish`, `settle`, `cancel`, `retarget`), pure functions of the row and
//! the store's clock; a store reads the row under a lock, applies one, and
//! writes the row back, so every engine makes the same decisions.

use std::time::Duration;

use crate::error::{Error, Result, StoreErrorKind};
use crate::key::IdempotencyKey;
use crate::scope::Scope;
use crate::store::BoxFuture;

/// The largest request body a dead letter keeps (1 MiB).
pub const MAX_DEAD_LETTER_BODY: usize = 1024 * 1024;
/// The most request headers a dead letter keeps.
pub const MAX_DEAD_LETTER_HEADERS: usize = 64;
/// The longest URL a dead letter keeps, in bytes.
pub const MAX_DEAD_LETTER_URL: usize = 2048;
/// The longest header name plus value, in bytes.
pub const MAX_DEAD_LETTER_HEADER: usize = 8192;
/// Errors and notes are cut to this many bytes (on a character boundary)
/// before they are stored.
pub const MAX_DEAD_LETTER_TEXT: usize = 4096;
/// The success answer of a call is kept up to this many bytes (64 KiB): a
/// vendor's answer carries what reconciliation needs (its id of the
/// payment), and vendors answer with objects of several KiB.
pub const MAX_DEAD_LETTER_RESPONSE: usize = 64 * 1024;

/// Request headers that carry credentials. A stored request never holds
/// them: they are sent from the client's configuration on every send
/// (secret headers), so a dead letter, a listing or a log never shows one.
pub const CREDENTIAL_HEADERS: [&str; 4] = ["authorization", "proxy-authorization", "cookie", "x-api-key"];

/// The request of an outbound call, as sent (without the idempotency key
/// header, which is added from the key on every send, and without
/// credentials, which the sending client adds from its configuration).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboundRequest {
    method: String,
    url: String,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl OutboundRequest {
    /// A request; refused (nothing stored) when the method is not an HTTP
    /// token, the URL not absolute `http(s)://` of at most
    /// [`MAX_DEAD_LETTER_URL`] bytes, a header malformed, too large or a
    /// credential ([`CREDENTIAL_HEADERS`]: those are the client's secret
    /// headers, sent but never stored), or the body over
    /// [`MAX_DEAD_LETTER_BODY`].
    ///
    /// ```
    /// use idem_core::OutboundRequest;
    /// let r = OutboundRequest::new("POST", "http://vendor/v1/payouts", vec![], b"{}".to_vec())?;
    /// assert_eq!(r.method(), "POST");
    /// assert!(OutboundRequest::new("PO ST", "http://v/", vec![], vec![]).is_err());
    /// assert!(OutboundRequest::new("POST", "ftp://v/", vec![], vec![]).is_err());
    /// let secret = vec![("Authorization".to_owned(), "Bearer sk_live".to_owned())];
    /// assert!(OutboundRequest::new("POST", "http://v/", secret, vec![]).is_err());
    /// # Ok::<(), idem_core::Error>(())
    /// ```
    pub fn new(
        method: impl Into<String>,
        url: impl Into<String>,
        headers: Vec<(String, String)>,
        body: Vec<u8>,
    ) -> Result<Self> {
        if let Some((name, _)) = headers.iter().find(|(name, _)| is_credential(name)) {
            return Err(Error::InvalidRequest(format!(
                "header {name} carries credentials: give it to the sending client as a secret header, \
                 which is sent but never stored"
            )));
        }
        Self::checked(method.into(), url.into(), headers, body)
    }

    /// A request read back from a store: checked like [`new`](Self::new),
    /// except that credential headers written by an older version are
    /// dropped rather than refused, so the letter stays readable and the
    /// credential is neither shown nor sent from storage.
    pub fn stored(method: String, url: String, headers: Vec<(String, String)>, body: Vec<u8>) -> Result<Self> {
        let headers = headers.into_iter().filter(|(name, _)| !is_credential(name)).collect();
        Self::checked(method, url, headers, body)
    }

    fn checked(method: String, url: String, headers: Vec<(String, String)>, body: Vec<u8>) -> Result<Self> {
        let bad = |why: String| Err(Error::InvalidRequest(why));
        if method.is_empty() || method.len() > 32 || !method.bytes().all(is_tchar) {
            return bad(format!("invalid HTTP method {method:?}"));
        }
        check_url(&url)?;
        if headers.len() > MAX_DEAD_LETTER_HEADERS {
            return bad(format!("more than {MAX_DEAD_LETTER_HEADERS} headers"));
        }
        for (name, value) in &headers {
            if name.is_empty() || !name.bytes().all(is_tchar) {
                return bad(format!("invalid header name {name:?}"));
            }
            if value.bytes().any(|b| b == b'\r' || b == b'\n' || b == 0) {
                return bad(format!("header {name} has a line break or NUL in its value"));
            }
            if name.len() + value.len() > MAX_DEAD_LETTER_HEADER {
                return bad(format!("header {name} is over {MAX_DEAD_LETTER_HEADER} bytes"));
            }
        }
        if body.len() > MAX_DEAD_LETTER_BODY {
            return bad(format!("a body of {} bytes exceeds {MAX_DEAD_LETTER_BODY}", body.len()));
        }
        Ok(Self {
            method,
            url,
            headers,
            body,
        })
    }

    /// The same request sent to `url` instead (a redrive's target
    /// override), checked as in [`new`](Self::new).
    pub fn with_url(&self, url: impl Into<String>) -> Result<Self> {
        let url = url.into();
        check_url(&url)?;
        Ok(Self { url, ..self.clone() })
    }

    /// The method.
    pub fn method(&self) -> &str {
        &self.method
    }

    /// The absolute URL.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The headers, in order.
    pub fn headers(&self) -> &[(String, String)] {
        &self.headers
    }

    /// The body.
    pub fn body(&self) -> &[u8] {
        &self.body
    }
}

fn check_url(url: &str) -> Result<()> {
    let lower = url.to_ascii_lowercase();
    if !(lower.starts_with("http://") || lower.starts_with("https://"))
        || url.len() > MAX_DEAD_LETTER_URL
        || url.chars().any(|c| c.is_control() || c == ' ')
    {
        return Err(Error::InvalidRequest(format!(
            "the URL must be absolute http(s), at most {MAX_DEAD_LETTER_URL} bytes, without spaces"
        )));
    }
    Ok(())
}

/// Whether a header name is one of [`CREDENTIAL_HEADERS`].
pub fn is_credential(name: &str) -> bool {
    CREDENTIAL_HEADERS.iter().any(|c| name.eq_ignore_ascii_case(c))
}

/// RFC 9110 token characters.
fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// Cuts `text` to at most [`MAX_DEAD_LETTER_TEXT`] bytes on a character
/// boundary.
pub fn clip_text(text: &str) -> &str {
    clip_str(text, MAX_DEAD_LETTER_TEXT)
}

fn clip_str(text: &str, max: usize) -> &str {
    if text.len() <= max {
        return text;
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

/// A body cut to [`MAX_DEAD_LETTER_TEXT`] bytes: on a character boundary
/// when it is text (for error bodies shown in messages).
pub fn clip_body(body: &[u8]) -> &[u8] {
    clip_bytes(body, MAX_DEAD_LETTER_TEXT)
}

/// A success answer cut to [`MAX_DEAD_LETTER_RESPONSE`] bytes, on a
/// character boundary when it is text.
pub fn clip_response(body: &[u8]) -> &[u8] {
    clip_bytes(body, MAX_DEAD_LETTER_RESPONSE)
}

fn clip_bytes(body: &[u8], max: usize) -> &[u8] {
    match std::str::from_utf8(body) {
        Ok(text) => clip_str(text, max).as_bytes(),
        Err(_) => &body[..body.len().min(max)],
    }
}

/// A redrive's hold, checked: positive, and bounded so that adding it to a
/// clock cannot overflow.
pub fn redrive_hold_ms(hold_ms: i64) -> Result<i64> {
    if hold_ms <= 0 {
        return Err(Error::InvalidRequest(format!(
            "a redrive hold must be positive, not {hold_ms} ms"
        )));
    }
    Ok(hold_ms.min(i64::MAX / 4))
}

/// What is known of whether the vendor applied a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Verdict {
    /// The vendor applied it (its answer is kept with the letter).
    Applied,
    /// The vendor did not apply it, as of the verdict's time.
    NotApplied,
    /// It cannot be established (the vendor cannot say, or there is no way
    /// to ask it).
    Unknown,
}

impl Verdict {
    /// `applied`, `not_applied` or `unknown`, as stored.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Applied => "applied",
            Self::NotApplied => "not_applied",
            Self::Unknown => "unknown",
        }
    }

    /// Parses [`as_str`](Self::as_str)'s form.
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "applied" => Ok(Self::Applied),
            "not_applied" => Ok(Self::NotApplied),
            "unknown" => Ok(Self::Unknown),
            other => Err(Error::InvalidRequest(format!(
                "unknown verdict {other:?} (applied, not_applied, unknown)"
            ))),
        }
    }
}

/// Who gave a verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum VerdictSource {
    /// The vendor, asked through a reconcile hook.
    Vendor,
    /// An operator (`idem dlq resolve`), from what the vendor says elsewhere.
    Operator,
    /// The sender itself: no reconcile hook, or an answer it cannot trust.
    Sender,
}

impl VerdictSource {
    /// `vendor`, `operator` or `sender`, as stored.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Vendor => "vendor",
            Self::Operator => "operator",
            Self::Sender => "sender",
        }
    }

    /// Parses [`as_str`](Self::as_str)'s form.
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "vendor" => Ok(Self::Vendor),
            "operator" => Ok(Self::Operator),
            "sender" => Ok(Self::Sender),
            other => Err(Error::InvalidRequest(format!(
                "unknown verdict source {other:?} (vendor, operator, sender)"
            ))),
        }
    }
}

/// The last verdict on a dead letter's call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reconciliation {
    /// What was said.
    pub verdict: Verdict,
    /// By whom.
    pub by: VerdictSource,
    /// When (ms since the epoch).
    pub at_ms: i64,
    /// Why, or what the operator noted (clipped to
    /// [`MAX_DEAD_LETTER_TEXT`]).
    pub note: String,
}

/// A logical call to keep as a dead letter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewDeadLetter {
    /// Who made the call and what it was (tenant, operation).
    pub scope: Scope,
    /// The idempotency key every send of this call carries.
    pub key: IdempotencyKey,
    /// The request.
    pub request: OutboundRequest,
    /// Sends tried so far.
    pub attempts: u32,
    /// Why the last one failed (clipped to [`MAX_DEAD_LETTER_TEXT`] when
    /// stored).
    pub last_error: String,
    /// When the first send that may have reached the vendor started (ms,
    /// the sender's clock); `None` when none can have (every attempt was
    /// refused before it was sent).
    pub first_reached_at_ms: Option<i64>,
    /// Whether its outcome is unknown and it must be held for an operator
    /// (state [`Unknown`](DeadLetterState::Unknown)) rather than be
    /// redriven.
    pub unknown: bool,
    /// The terms its sends were made under (the vendor's key horizon and
    /// the settle time), kept so a redrive judges them by the same facts;
    /// `None` when the sender did not say.
    pub sent_under: Option<SentUnder>,
}

/// The terms a call's sends were made under, kept with its dead letter: a
/// redrive run by another process (an operator's `idem dlq redrive`, with
/// its own defaults) judges the earlier sends by the facts they were sent
/// under, never by a guess.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SentUnder {
    /// How long the vendor remembers an idempotency key; zero when it has
    /// none (a send after one that may have reached it is never blind).
    pub key_horizon: Duration,
    /// Kept from the horizon: a send is blind only while the first one
    /// that may have reached the vendor is younger than the horizon minus
    /// this margin.
    pub horizon_margin: Duration,
    /// How long after a send started the vendor's "not applied" is
    /// trusted (its attempt timeout plus the time a request can take to
    /// arrive).
    pub settle: Duration,
}

impl SentUnder {
    /// The terms that are safe under both `self` and `other`: the shorter
    /// horizon, the longer margin, the longer settle time.
    pub fn strictest(self, other: Self) -> Self {
        Self {
            key_horizon: self.key_horizon.min(other.key_horizon),
            horizon_margin: self.horizon_margin.max(other.horizon_margin),
            settle: self.settle.max(other.settle),
        }
    }

    fn millis(d: Duration) -> i64 {
        i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
    }
}

impl NewDeadLetter {
    /// A dead letter of a call that gave up, no send of which reached the
    /// vendor (see [`reached_at`](Self::reached_at)).
    pub fn new(
        scope: Scope,
        key: IdempotencyKey,
        request: OutboundRequest,
        attempts: u32,
        last_error: impl Into<String>,
    ) -> Self {
        Self {
            scope,
            key,
            request,
            attempts,
            last_error: last_error.into(),
            first_reached_at_ms: None,
            unknown: false,
            sent_under: None,
        }
    }

    /// Its sends were made under `terms` (see [`SentUnder`]).
    pub fn sent_under(mut self, terms: SentUnder) -> Self {
        self.sent_under = Some(terms);
        self
    }

    /// The first send that may have reached the vendor started at
    /// `first_reached_at_ms`.
    pub fn reached_at(mut self, first_reached_at_ms: Option<i64>) -> Self {
        self.first_reached_at_ms = first_reached_at_ms;
        self
    }

    /// Its outcome is unknown: hold it for an operator.
    pub fn outcome_unknown(mut self) -> Self {
        self.unknown = true;
        self
    }
}

/// Where a dead letter stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DeadLetterState {
    /// Waiting for an operator (or a policy) to redrive it.
    Dead,
    /// Being sent again; the redriver holds it until its lease runs out.
    Redriving,
    /// The vendor applied it: a redrive got a success answer, the vendor
    /// said so when asked, or an operator recorded it. The answer is kept.
    Resolved,
    /// Whether the vendor applied it cannot be established: held for an
    /// operator, never sent again on a guess (a redrive only asks the
    /// vendor, when it can).
    Unknown,
    /// Given up for good after the vendor was found not to have applied it
    /// (the business side reversed it); never sent again.
    Cancelled,
}

impl DeadLetterState {
    /// `dead`, `redriving`, `resolved`, `unknown` or `cancelled`, as stored.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Dead => "dead",
            Self::Redriving => "redriving",
            Self::Resolved => "resolved",
            Self::Unknown => "unknown",
            Self::Cancelled => "cancelled",
        }
    }

    /// Parses [`as_str`](Self::as_str)'s form.
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "dead" => Ok(Self::Dead),
            "redriving" => Ok(Self::Redriving),
            "resolved" => Ok(Self::Resolved),
            "unknown" => Ok(Self::Unknown),
            "cancelled" => Ok(Self::Cancelled),
            other => Err(Error::InvalidRequest(format!(
                "unknown dead-letter state {other:?} (dead, redriving, resolved, unknown, cancelled)"
            ))),
        }
    }

    /// Whether nothing will change it any more (resolved or cancelled).
    pub fn is_final(self) -> bool {
        matches!(self, Self::Resolved | Self::Cancelled)
    }
}

/// A stored dead letter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeadLetter {
    /// The row's id.
    pub id: i64,
    /// The call's scope.
    pub scope: Scope,
    /// The call's idempotency key.
    pub key: IdempotencyKey,
    /// The request.
    pub request: OutboundRequest,
    /// Sends tried, redrives included.
    pub attempts: u32,
    /// Why the last send failed.
    pub last_error: String,
    /// Where it stands.
    pub state: DeadLetterState,
    /// Redrives started.
    pub redrives: u32,
    /// When it was first recorded (ms since the epoch, the store's clock).
    pub created_at_ms: i64,
    /// When it last changed.
    pub updated_at_ms: i64,
    /// Until when a redrive holds it (state `redriving`).
    pub redrive_until_ms: Option<i64>,
    /// The success status the vendor answered (state `resolved`).
    pub response_status: Option<u16>,
    /// The success body the vendor answered, up to
    /// [`MAX_DEAD_LETTER_RESPONSE`] bytes.
    pub response_body: Option<Vec<u8>>,
    /// When the first send that may have reached the vendor started, since
    /// the vendor was last found not to have applied it (`None`: no send
    /// can have reached it since).
    pub first_reached_at_ms: Option<i64>,
    /// The last verdict on the call, if any.
    pub reconciliation: Option<Reconciliation>,
    /// The terms its sends were made under (`None`: a letter written
    /// before they were kept, or by a sender that did not say).
    pub sent_under: Option<SentUnder>,
}

/// How a redrive ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RedriveOutcome {
    /// The vendor applied it: a send got a success answer, or (with
    /// `reconciled`) the vendor said so when asked, and nothing was sent.
    /// The letter is resolved and keeps the answer.
    Resolved {
        /// The status.
        status: u16,
        /// The body (clipped to [`MAX_DEAD_LETTER_RESPONSE`] when stored).
        body: Vec<u8>,
        /// Whether the answer came from asking the vendor (no send).
        reconciled: bool,
    },
    /// It failed again: the letter is dead again, with the attempts added
    /// and the new error.
    Failed {
        /// Sends this redrive tried.
        attempts: u32,
        /// Why the last one failed.
        error: String,
        /// When the first send that may have reached the vendor started,
        /// as the redrive leaves it: it replaces the letter's.
        first_reached_at_ms: Option<i64>,
        /// When the vendor said it had not applied the call, if this
        /// redrive asked and no send reached it after.
        not_applied_at_ms: Option<i64>,
    },
    /// Whether the vendor applied it cannot be established: the letter is
    /// held in state `unknown` for an operator.
    Unknown {
        /// Sends this redrive tried.
        attempts: u32,
        /// Why it cannot be established.
        reason: String,
        /// As in [`Failed`](Self::Failed).
        first_reached_at_ms: Option<i64>,
    },
}

/// What an operator (or the vendor, asked without a send) says about a
/// letter's call: [`DeadLetterStore::settle`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settlement {
    /// Applied (the letter is resolved with `status` and `body`), not
    /// applied (it is dead, and may be redriven or cancelled), or unknown
    /// (it is held).
    pub verdict: Verdict,
    /// Who says so.
    pub by: VerdictSource,
    /// The vendor's success status, with `Applied` (200 if none).
    pub status: Option<u16>,
    /// The vendor's answer, with `Applied` (empty if none).
    pub body: Vec<u8>,
    /// Why, or where it was checked.
    pub note: String,
}

impl DeadLetter {
    /// The row a first record of `new` creates (its `id` is the store's to
    /// set).
    pub fn created(new: &NewDeadLetter, now_ms: i64) -> Self {
        let state = if new.unknown {
            DeadLetterState::Unknown
        } else {
            DeadLetterState::Dead
        };
        Self {
            id: 0,
            scope: new.scope.clone(),
            key: new.key.clone(),
            request: new.request.clone(),
            attempts: new.attempts,
            last_error: clip_text(&new.last_error).to_owned(),
            state,
            redrives: 0,
            created_at_ms: now_ms,
            updated_at_ms: now_ms,
            redrive_until_ms: None,
            response_status: None,
            response_body: None,
            first_reached_at_ms: new.first_reached_at_ms,
            reconciliation: new.unknown.then(|| Reconciliation {
                verdict: Verdict::Unknown,
                by: VerdictSource::Sender,
                at_ms: now_ms,
                note: clip_text(&new.last_error).to_owned(),
            }),
            sent_under: new.sent_under,
        }
    }

    /// Recording the same call again: attempts added, the error replaced,
    /// the earliest send that may have reached kept. A final letter
    /// (resolved, cancelled) is left as it is: its call is settled. A letter
    /// being redriven keeps its state and its hold (the redrive decides
    /// how it ends). A dead letter recorded as unknown becomes unknown; an
    /// unknown one stays unknown. Answers whether it changed.
    pub fn on_record(&mut self, new: &NewDeadLetter, now_ms: i64) -> bool {
        if self.state.is_final() {
            return false;
        }
        self.attempts = self.attempts.saturating_add(new.attempts);
        self.last_error = clip_text(&new.last_error).to_owned();
        self.first_reached_at_ms = earliest(self.first_reached_at_ms, new.first_reached_at_ms);
        // Sends under other terms (a changed setting): the letter keeps
        // the terms that are safe for all of them.
        self.sent_under = match (self.sent_under, new.sent_under) {
            (Some(a), Some(b)) => Some(a.strictest(b)),
            (a, b) => a.or(b),
        };
        if new.unknown && self.state == DeadLetterState::Dead {
            self.state = DeadLetterState::Unknown;
            self.reconciliation = Some(Reconciliation {
                verdict: Verdict::Unknown,
                by: VerdictSource::Sender,
                at_ms: now_ms,
                note: self.last_error.clone(),
            });
        }
        self.updated_at_ms = now_ms;
        true
    }

    /// Takes the letter for a redrive until `now_ms + hold_ms`: a dead or
    /// unknown letter, or one whose earlier hold ran out. Answers the
    /// hold's token (the redrive count), or `None` when it cannot be taken.
    ///
    /// From the moment it is taken a send of this redrive may reach the
    /// vendor, so the take is also the durable "sent" mark: `now_ms`
    /// becomes the first send that may have reached the vendor unless an
    /// earlier one is known. A redrive killed after its send, before it
    /// stored the answer, leaves that mark behind: the next redrive judges
    /// its send by the vendor's key horizon (and asks past it), and the
    /// letter is never known "not applied" on the strength of an older
    /// verdict.
    pub fn take(&mut self, now_ms: i64, hold_ms: i64) -> Result<Option<u32>> {
        let hold_ms = redrive_hold_ms(hold_ms)?;
        let free = match self.state {
            DeadLetterState::Dead | DeadLetterState::Unknown => true,
            DeadLetterState::Redriving => self.redrive_until_ms.is_none_or(|until| until <= now_ms),
            DeadLetterState::Resolved | DeadLetterState::Cancelled => false,
        };
        let Some(token) = self.redrives.checked_add(1).filter(|_| free) else {
            return Ok(None);
        };
        self.redrives = token;
        self.state = DeadLetterState::Redriving;
        self.first_reached_at_ms = earliest(self.first_reached_at_ms, Some(now_ms));
        self.redrive_until_ms = Some(now_ms.saturating_add(hold_ms));
        self.updated_at_ms = now_ms;
        Ok(Some(token))
    }

    /// [`take`](Self::take), answering the hold: the letter as taken, the
    /// token, and until when an earlier redrive held it.
    pub fn take_hold(&mut self, now_ms: i64, hold_ms: i64) -> Result<Option<RedriveHold>> {
        let earlier_hold_until_ms = match self.state {
            DeadLetterState::Redriving => self.redrive_until_ms,
            _ => None,
        };
        Ok(self.take(now_ms, hold_ms)?.map(|token| RedriveHold {
            dead_letter: self.clone(),
            token,
            earlier_hold_until_ms,
        }))
    }

    /// Whether the redrive with `token` holds it.
    pub fn held_by(&self, token: u32) -> bool {
        self.state == DeadLetterState::Redriving && self.redrives == token
    }

    /// Ends the redrive with `token`. Answers false (and changes nothing)
    /// when that redrive no longer holds it.
    pub fn finish(&mut self, token: u32, outcome: &RedriveOutcome, now_ms: i64) -> bool {
        if !self.held_by(token) {
            return false;
        }
        match outcome {
            RedriveOutcome::Resolved {
                status,
                body,
                reconciled,
            } => {
                self.state = DeadLetterState::Resolved;
                self.response_status = Some(*status);
                self.response_body = Some(clip_response(body).to_vec());
                if *reconciled {
                    self.reconciliation = Some(Reconciliation {
                        verdict: Verdict::Applied,
                        by: VerdictSource::Vendor,
                        at_ms: now_ms,
                        note: "the vendor's record was found; nothing was sent".into(),
                    });
                }
            }
            RedriveOutcome::Failed {
                attempts,
                error,
                first_reached_at_ms,
                not_applied_at_ms,
            } => {
                self.state = DeadLetterState::Dead;
                self.attempts = self.attempts.saturating_add(*attempts);
                self.last_error = clip_text(error).to_owned();
                // The earliest reach only moves earlier, unless the vendor,
                // asked during this redrive, said it had not applied the call
                // (and no send reached it after): then the redrive's own view
                // stands.
                self.first_reached_at_ms = match not_applied_at_ms {
                    Some(_) => *first_reached_at_ms,
                    None => earliest(self.first_reached_at_ms, *first_reached_at_ms),
                };
                if let Some(at_ms) = not_applied_at_ms {
                    self.reconciliation = Some(Reconciliation {
                        verdict: Verdict::NotApplied,
                        by: VerdictSource::Vendor,
                        at_ms: *at_ms,
                        note: "the vendor has no record of it".into(),
                    });
                }
            }
            RedriveOutcome::Unknown {
                attempts,
                reason,
                first_reached_at_ms,
            } => {
                self.state = DeadLetterState::Unknown;
                self.attempts = self.attempts.saturating_add(*attempts);
                self.last_error = clip_text(reason).to_owned();
                self.first_reached_at_ms = earliest(self.first_reached_at_ms, *first_reached_at_ms);
                self.reconciliation = Some(Reconciliation {
                    verdict: Verdict::Unknown,
                    by: VerdictSource::Sender,
                    at_ms: now_ms,
                    note: self.last_error.clone(),
                });
            }
        }
        self.redrive_until_ms = None;
        self.updated_at_ms = now_ms;
        true
    }

    /// Records what an operator (or the vendor, asked without a send) says
    /// of a dead or unknown letter: applied → resolved with the answer; not
    /// applied → dead, with no send that may have reached since (so a
    /// redrive sends it, and the business side may cancel it); unknown →
    /// held. Answers false (and changes nothing) for a letter being redriven
    /// or final.
    pub fn settle(&mut self, settlement: &Settlement, now_ms: i64) -> bool {
        if !matches!(self.state, DeadLetterState::Dead | DeadLetterState::Unknown) {
            return false;
        }
        match settlement.verdict {
            Verdict::Applied => {
                self.state = DeadLetterState::Resolved;
                self.response_status = Some(settlement.status.unwrap_or(200));
                self.response_body = Some(clip_response(&settlement.body).to_vec());
            }
            Verdict::NotApplied => {
                self.state = DeadLetterState::Dead;
                self.first_reached_at_ms = None;
            }
            Verdict::Unknown => self.state = DeadLetterState::Unknown,
        }
        self.reconciliation = Some(Reconciliation {
            verdict: settlement.verdict,
            by: settlement.by,
            at_ms: now_ms,
            note: clip_text(&settlement.note).to_owned(),
        });
        self.updated_at_ms = now_ms;
        true
    }

    /// Whether the vendor is known not to have applied the call: its last
    /// verdict says so and no send that may have reached it came after.
    pub fn known_not_applied(&self) -> bool {
        self.first_reached_at_ms.is_none()
            && self
                .reconciliation
                .as_ref()
                .is_some_and(|r| r.verdict == Verdict::NotApplied)
    }

    /// Cancels a dead letter known not to have been applied (see
    /// [`known_not_applied`](Self::known_not_applied)); it is never sent
    /// again. Answers false (and changes nothing) otherwise.
    pub fn cancel(&mut self, now_ms: i64) -> bool {
        if self.state != DeadLetterState::Dead || !self.known_not_applied() {
            return false;
        }
        self.state = DeadLetterState::Cancelled;
        self.updated_at_ms = now_ms;
        true
    }

    /// Points the held letter at `url` (a redrive's target override), so
    /// what is stored is what was sent. False when `token` does not hold it.
    pub fn retarget(&mut self, token: u32, url: &str, now_ms: i64) -> Result<bool> {
        if !self.held_by(token) {
            return Ok(false);
        }
        self.request = self.request.with_url(url)?;
        self.updated_at_ms = now_ms;
        Ok(true)
    }
}

/// The earlier of two optional times.
fn earliest(a: Option<i64>, b: Option<i64>) -> Option<i64> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// A dead letter's row as a store reads it, in plain values: every engine
/// maps its column types to these, and [`decode`](Self::decode) checks and
/// builds the [`DeadLetter`] once for all of them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeadLetterRow {
    /// `id`.
    pub id: i64,
    /// `tenant`.
    pub tenant: String,
    /// `operation`.
    pub operation: String,
    /// `idem_key`.
    pub idem_key: String,
    /// `method`.
    pub method: String,
    /// `url`.
    pub url: String,
    /// `headers`: a JSON array of `[name, value]` pairs.
    pub headers: String,
    /// `body`.
    pub body: Vec<u8>,
    /// `attempts`.
    pub attempts: i64,
    /// `last_error`.
    pub last_error: String,
    /// `state`.
    pub state: String,
    /// `redrives`.
    pub redrives: i64,
    /// `created_at_ms`.
    pub created_at_ms: i64,
    /// `updated_at_ms`.
    pub updated_at_ms: i64,
    /// `redrive_until_ms`.
    pub redrive_until_ms: Option<i64>,
    /// `response_status`.
    pub response_status: Option<i64>,
    /// `response_body`.
    pub response_body: Option<Vec<u8>>,
    /// `first_reached_at_ms`.
    pub first_reached_at_ms: Option<i64>,
    /// `verdict`.
    pub verdict: Option<String>,
    /// `verdict_by`.
    pub verdict_by: Option<String>,
    /// `verdict_at_ms`.
    pub verdict_at_ms: Option<i64>,
    /// `verdict_note`.
    pub verdict_note: Option<String>,
    /// `key_horizon_ms` (with the next two: all set, or none).
    pub key_horizon_ms: Option<i64>,
    /// `horizon_margin_ms`.
    pub horizon_margin_ms: Option<i64>,
    /// `settle_ms`.
    pub settle_ms: Option<i64>,
}

impl DeadLetterRow {
    /// The row's values, as a store writes them.
    pub fn of(letter: &DeadLetter) -> Result<Self> {
        let r = letter.reconciliation.as_ref();
        Ok(Self {
            id: letter.id,
            tenant: letter.scope.tenant().as_str().to_owned(),
            operation: letter.scope.operation().as_str().to_owned(),
            idem_key: letter.key.as_str().to_owned(),
            method: letter.request.method().to_owned(),
            url: letter.request.url().to_owned(),
            headers: encode_headers(letter.request.headers())?,
            body: letter.request.body().to_vec(),
            attempts: i64::from(letter.attempts),
            last_error: clip_text(&letter.last_error).to_owned(),
            state: letter.state.as_str().to_owned(),
            redrives: i64::from(letter.redrives),
            created_at_ms: letter.created_at_ms,
            updated_at_ms: letter.updated_at_ms,
            redrive_until_ms: letter.redrive_until_ms,
            response_status: letter.response_status.map(i64::from),
            response_body: letter.response_body.as_deref().map(|b| clip_response(b).to_vec()),
            first_reached_at_ms: letter.first_reached_at_ms,
            verdict: r.map(|r| r.verdict.as_str().to_owned()),
            verdict_by: r.map(|r| r.by.as_str().to_owned()),
            verdict_at_ms: r.map(|r| r.at_ms),
            verdict_note: r.map(|r| clip_text(&r.note).to_owned()),
            key_horizon_ms: letter.sent_under.map(|t| SentUnder::millis(t.key_horizon)),
            horizon_margin_ms: letter.sent_under.map(|t| SentUnder::millis(t.horizon_margin)),
            settle_ms: letter.sent_under.map(|t| SentUnder::millis(t.settle)),
        })
    }

    /// The dead letter, every value checked.
    pub fn decode(self) -> Result<DeadLetter> {
        let id = self.id;
        let corrupt = |what: String| Error::store(StoreErrorKind::Other, format!("corrupt dead letter {id}: {what}"));
        let count = |name: &str, n: i64| u32::try_from(n).map_err(|_| corrupt(format!("{name} {n}")));
        let headers: Vec<(String, String)> =
            serde_json::from_str(&self.headers).map_err(|e| corrupt(format!("headers: {e}")))?;
        let request = OutboundRequest::stored(self.method, self.url, headers, self.body)
            .map_err(|e| corrupt(format!("request: {e}")))?;
        let reconciliation = match (self.verdict, self.verdict_by, self.verdict_at_ms) {
            (Some(verdict), Some(by), Some(at_ms)) => Some(Reconciliation {
                verdict: Verdict::parse(&verdict).map_err(|e| corrupt(e.to_string()))?,
                by: VerdictSource::parse(&by).map_err(|e| corrupt(e.to_string()))?,
                at_ms,
                note: self.verdict_note.unwrap_or_default(),
            }),
            (None, _, _) => None,
            _ => return Err(corrupt("a verdict without its source or time".into())),
        };
        let millis = |name: &str, ms: i64| {
            u64::try_from(ms)
                .map(Duration::from_millis)
                .map_err(|_| corrupt(format!("{name} {ms}")))
        };
        let sent_under = match (self.key_horizon_ms, self.horizon_margin_ms, self.settle_ms) {
            (Some(h), Some(m), Some(s)) => Some(SentUnder {
                key_horizon: millis("key horizon", h)?,
                horizon_margin: millis("horizon margin", m)?,
                settle: millis("settle time", s)?,
            }),
            (None, None, None) => None,
            _ => return Err(corrupt("send terms only in part".into())),
        };
        Ok(DeadLetter {
            id,
            scope: Scope::parse(&self.tenant, &self.operation).map_err(|e| corrupt(e.to_string()))?,
            key: IdempotencyKey::new(self.idem_key).map_err(|e| corrupt(e.to_string()))?,
            request,
            attempts: count("attempts", self.attempts)?,
            last_error: self.last_error,
            state: DeadLetterState::parse(&self.state).map_err(|e| corrupt(e.to_string()))?,
            redrives: count("redrives", self.redrives)?,
            created_at_ms: self.created_at_ms,
            updated_at_ms: self.updated_at_ms,
            redrive_until_ms: self.redrive_until_ms,
            response_status: self
                .response_status
                .map(|s| u16::try_from(s).map_err(|_| corrupt(format!("response status {s}"))))
                .transpose()?,
            response_body: self.response_body,
            first_reached_at_ms: self.first_reached_at_ms,
            reconciliation,
            sent_under,
        })
    }
}

/// Headers as stored: a JSON array of `[name, value]` pairs.
pub fn encode_headers(headers: &[(String, String)]) -> Result<String> {
    serde_json::to_string(headers).map_err(|e| Error::InvalidRequest(format!("headers cannot be stored: {e}")))
}

/// Which dead letters to list, oldest first, in pages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeadLetterFilter {
    /// Only this tenant's.
    pub tenant: Option<String>,
    /// Only this operation's.
    pub operation: Option<String>,
    /// Only in this state.
    pub state: Option<DeadLetterState>,
    /// Only ids greater than this (the last id of the previous page).
    pub after_id: Option<i64>,
    /// At most this many (1..=1000).
    pub limit: u32,
}

impl Default for DeadLetterFilter {
    fn default() -> Self {
        Self {
            tenant: None,
            operation: None,
            state: None,
            after_id: None,
            limit: 100,
        }
    }
}

/// The most dead letters one listing answers.
pub const MAX_DEAD_LETTER_PAGE: u32 = 1000;

impl DeadLetterFilter {
    /// Refuses a page of no letters or of more than
    /// [`MAX_DEAD_LETTER_PAGE`].
    pub fn check(&self) -> Result<()> {
        if self.limit == 0 || self.limit > MAX_DEAD_LETTER_PAGE {
            return Err(Error::InvalidRequest(format!(
                "a dead-letter page holds 1 to {MAX_DEAD_LETTER_PAGE} letters, not {}",
                self.limit
            )));
        }
        Ok(())
    }
}

/// A dead letter taken for a redrive. `token` proves the hold: a redrive
/// whose hold ran out and was taken by another cannot finish it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedriveHold {
    /// The dead letter as taken.
    pub dead_letter: DeadLetter,
    /// The hold's token (the redrive count after taking it).
    pub token: u32,
    /// When the taken letter was still held by an earlier redrive whose
    /// hold has since run out: that redrive may have sent until then, so a
    /// vendor's "not applied" is trusted only once a send started then has
    /// settled. `None` when the letter was not being redriven.
    pub earlier_hold_until_ms: Option<i64>,
}

/// A store of dead letters. Store crates also offer recording inside the
/// caller's own transaction, so a business row and its dead letter commit
/// together. Each write reads the row under a lock, applies one of
/// [`DeadLetter`]'s transitions on the store's clock, and writes it back.
pub trait DeadLetterStore: Clone + Send + Sync + 'static {
    /// Records a dead letter, or updates the one of the same (tenant,
    /// operation, key) by [`DeadLetter::on_record`]. Answers its id.
    fn record(&self, letter: &NewDeadLetter) -> BoxFuture<'_, Result<i64>>;

    /// Lists dead letters by `filter`, by id ascending.
    fn list(&self, filter: &DeadLetterFilter) -> BoxFuture<'_, Result<Vec<DeadLetter>>>;

    /// One dead letter.
    fn get(&self, id: i64) -> BoxFuture<'_, Result<Option<DeadLetter>>>;

    /// The dead letter of (scope, key), if any.
    fn find(&self, scope: &Scope, key: &IdempotencyKey) -> BoxFuture<'_, Result<Option<DeadLetter>>>;

    /// Takes a dead letter for a redrive ([`DeadLetter::take`]) until
    /// `now + hold_ms` (the store's clock). `None` when it does not exist,
    /// is final, or another redrive holds it.
    fn begin_redrive(&self, id: i64, hold_ms: i64) -> BoxFuture<'_, Result<Option<RedriveHold>>>;

    /// Points a held letter at another URL ([`DeadLetter::retarget`]).
    /// False when the hold was lost.
    fn retarget(&self, id: i64, token: u32, url: &str) -> BoxFuture<'_, Result<bool>>;

    /// Ends a redrive with its outcome ([`DeadLetter::finish`]). Answers
    /// false (and changes nothing) when the hold was lost to another
    /// redrive.
    fn finish_redrive(&self, id: i64, token: u32, outcome: &RedriveOutcome) -> BoxFuture<'_, Result<bool>>;

    /// Records a verdict on a dead or unknown letter
    /// ([`DeadLetter::settle`]). False (nothing changed) when it is missing,
    /// held by a redrive, or final.
    fn settle(&self, id: i64, settlement: &Settlement) -> BoxFuture<'_, Result<bool>>;

    /// Cancels a dead letter known not to have been applied
    /// ([`DeadLetter::cancel`]). False (nothing changed) otherwise.
    fn cancel(&self, id: i64) -> BoxFuture<'_, Result<bool>>;

    /// Deletes at most `limit` final (resolved or cancelled) dead letters
    /// settled more than `older_than_ms` ago; answers how many.
    fn purge_resolved(&self, older_than_ms: i64, limit: u32) -> BoxFuture<'_, Result<u64>>;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn new(unknown: bool, reached: Option<i64>) -> NewDeadLetter {
        let letter = NewDeadLetter::new(
            Scope::parse("t", "payout").unwrap(),
            IdempotencyKey::new("k").unwrap(),
            OutboundRequest::new("POST", "http://v/v1/payouts", vec![], b"{}".to_vec()).unwrap(),
            2,
            "timeout",
        )
        .reached_at(reached)
        .sent_under(SentUnder {
            key_horizon: Duration::from_secs(86_400),
            horizon_margin: Duration::from_secs(3_600),
            settle: Duration::from_secs(35),
        });
        if unknown { letter.outcome_unknown() } else { letter }
    }

    /// Proves a letter recorded again under other terms keeps the terms
    /// safe for every send: the shortest horizon, the longest margin and
    /// settle time; a letter without terms takes the new ones.
    #[test]
    fn recording_again_keeps_the_strictest_terms() {
        let mut l = DeadLetter::created(&new(false, Some(5)), 100);
        let keyless = SentUnder {
            key_horizon: Duration::ZERO,
            horizon_margin: Duration::ZERO,
            settle: Duration::from_secs(10),
        };
        assert!(l.on_record(&new(false, None).sent_under(keyless), 110));
        assert_eq!(
            l.sent_under,
            Some(SentUnder {
                key_horizon: Duration::ZERO,
                horizon_margin: Duration::from_secs(3_600),
                settle: Duration::from_secs(35),
            })
        );
        let mut bare = new(false, None);
        bare.sent_under = None;
        let mut old = DeadLetter::created(&bare, 100);
        assert_eq!(old.sent_under, None);
        assert!(old.on_record(&new(false, None).sent_under(keyless), 110));
        assert_eq!(old.sent_under, Some(keyless));
        let before = old.sent_under;
        assert!(old.on_record(&bare, 120));
        assert_eq!(
            old.sent_under, before,
            "a record that does not say keeps the known terms"
        );
    }

    /// A redrive killed after its send (its hold runs out, nothing stored)
    /// leaves its take as the first send that may have reached the vendor:
    /// an older "not applied" no longer makes the letter cancellable, a
    /// later redrive that fails keeps that reach, and only a verdict asked
    /// after it clears it.
    #[test]
    fn a_crashed_redrive_leaves_its_reach_behind() {
        let mut letter = DeadLetter::created(&new(false, None), 1_000);
        let not_applied = Settlement {
            verdict: Verdict::NotApplied,
            by: VerdictSource::Operator,
            status: None,
            body: Vec::new(),
            note: "checked the vendor's dashboard".into(),
        };
        assert!(letter.settle(&not_applied, 2_000));
        assert!(letter.known_not_applied(), "before any redrive it may be cancelled");
        // A redrive takes it and is killed after its send.
        assert_eq!(letter.take(3_000, 10_000).unwrap(), Some(1));
        assert_eq!(letter.first_reached_at_ms, Some(3_000), "the take is the sent mark");
        assert!(!letter.known_not_applied(), "a send may have reached the vendor since");
        // Its hold runs out; a later redrive meets only refused connections.
        assert_eq!(letter.take(20_000, 10_000).unwrap(), Some(2));
        assert_eq!(letter.first_reached_at_ms, Some(3_000), "the earliest reach is kept");
        let refused = RedriveOutcome::Failed {
            attempts: 3,
            error: "connection refused".into(),
            first_reached_at_ms: None,
            not_applied_at_ms: None,
        };
        assert!(letter.finish(2, &refused, 21_000));
        assert_eq!(
            letter.first_reached_at_ms,
            Some(3_000),
            "a failed redrive keeps the reach"
        );
        assert!(
            !letter.cancel(22_000),
            "a letter that may have been paid is never cancelled"
        );
        // The vendor, asked during a redrive, says it never applied it.
        assert_eq!(letter.take(30_000, 10_000).unwrap(), Some(3));
        let asked = RedriveOutcome::Failed {
            attempts: 1,
            error: "vendor refused".into(),
            first_reached_at_ms: None,
            not_applied_at_ms: Some(30_500),
        };
        assert!(letter.finish(3, &asked, 31_000));
        assert_eq!(letter.first_reached_at_ms, None);
        assert!(letter.cancel(32_000), "now known not applied");
    }

    /// A redrive that ends unknown keeps the earliest reach too.
    #[test]
    fn an_unknown_redrive_keeps_the_earliest_reach() {
        let mut letter = DeadLetter::created(&new(false, Some(500)), 1_000);
        assert_eq!(letter.take(3_000, 10_000).unwrap(), Some(1));
        assert_eq!(letter.first_reached_at_ms, Some(500));
        let unknown = RedriveOutcome::Unknown {
            attempts: 1,
            reason: "no reconcile hook".into(),
            first_reached_at_ms: Some(3_100),
        };
        assert!(letter.finish(1, &unknown, 4_000));
        assert_eq!(letter.first_reached_at_ms, Some(500));
    }

    /// Proves requests are validated, credentials refused, and stored credentials dropped on reading.
    #[test]
    fn requests_are_validated() {
        let ok = OutboundRequest::new(
            "POST",
            "https://vendor.example/v1/payouts?x=1",
            vec![("content-type".into(), "application/json".into())],
            b"{}".to_vec(),
        );
        assert!(ok.is_ok());
        for (method, url) in [
            ("", "http://v/"),
            ("GE\nT", "http://v/"),
            ("POST", "/relative"),
            ("POST", "http://v/a b"),
            ("POST", "javascript:alert(1)"),
        ] {
            assert!(
                OutboundRequest::new(method, url, vec![], vec![]).is_err(),
                "{method} {url}"
            );
        }
        let crlf = OutboundRequest::new("POST", "http://v/", vec![("x".into(), "a\r\nb: c".into())], vec![]);
        assert!(crlf.is_err());
        let big = OutboundRequest::new("POST", "http://v/", vec![], vec![0; MAX_DEAD_LETTER_BODY + 1]);
        assert!(big.is_err());
        for name in ["Authorization", "cookie", "X-API-Key", "Proxy-Authorization"] {
            let secret = vec![(name.to_owned(), "s3cret".to_owned())];
            let e = OutboundRequest::new("POST", "http://v/", secret.clone(), vec![]).unwrap_err();
            assert!(!e.to_string().contains("s3cret"), "{e}");
            let stored = OutboundRequest::stored("POST".into(), "http://v/".into(), secret, vec![]).unwrap();
            assert!(stored.headers().is_empty(), "{name} dropped on reading");
        }
        let moved = ok.unwrap().with_url("http://other:81/v1/payouts").unwrap();
        assert_eq!(moved.url(), "http://other:81/v1/payouts");
        assert!(moved.with_url("ftp://x").is_err());
    }

    /// Proves text and bodies are bounded without splitting a character.
    #[test]
    fn text_and_bodies_are_clipped_on_a_character_boundary() {
        let long = "é".repeat(MAX_DEAD_LETTER_TEXT);
        let clipped = clip_text(&long);
        assert!(clipped.len() <= MAX_DEAD_LETTER_TEXT && clipped.len() >= MAX_DEAD_LETTER_TEXT - 1);
        assert_eq!(clip_text("short"), "short");
        let binary = vec![0xFF; MAX_DEAD_LETTER_RESPONSE + 10];
        assert_eq!(clip_response(&binary).len(), MAX_DEAD_LETTER_RESPONSE);
        assert_eq!(clip_body(&binary).len(), MAX_DEAD_LETTER_TEXT);
        let text = "é".repeat(MAX_DEAD_LETTER_RESPONSE);
        assert!(std::str::from_utf8(clip_response(text.as_bytes())).is_ok());
    }

    /// Proves holds and page sizes are checked.
    #[test]
    fn holds_and_pages_are_checked() {
        assert!(redrive_hold_ms(0).is_err());
        assert!(redrive_hold_ms(-5).is_err());
        assert_eq!(redrive_hold_ms(i64::MAX).unwrap(), i64::MAX / 4);
        for (limit, ok) in [
            (0, false),
            (1, true),
            (MAX_DEAD_LETTER_PAGE, true),
            (MAX_DEAD_LETTER_PAGE + 1, false),
        ] {
            let filter = DeadLetterFilter {
                limit,
                ..DeadLetterFilter::default()
            };
            assert_eq!(filter.check().is_ok(), ok, "{limit}");
        }
    }

    /// Proves every state, verdict and source round-trips through its stored form.
    #[test]
    fn states_round_trip() {
        for s in [
            DeadLetterState::Dead,
            DeadLetterState::Redriving,
            DeadLetterState::Resolved,
            DeadLetterState::Unknown,
            DeadLetterState::Cancelled,
        ] {
            assert_eq!(DeadLetterState::parse(s.as_str()).unwrap(), s);
        }
        assert!(DeadLetterState::parse("gone").is_err());
        for v in [Verdict::Applied, Verdict::NotApplied, Verdict::Unknown] {
            assert_eq!(Verdict::parse(v.as_str()).unwrap(), v);
        }
        for b in [VerdictSource::Vendor, VerdictSource::Operator, VerdictSource::Sender] {
            assert_eq!(VerdictSource::parse(b.as_str()).unwrap(), b);
        }
    }

    /// Proves recording again keeps a redrive's hold, keeps the earliest reach, and holds an unknown outcome.
    #[test]
    fn recording_again_never_drops_a_hold_or_a_hold_for_an_operator() {
        let mut l = DeadLetter::created(&new(false, Some(50)), 100);
        assert_eq!(l.state, DeadLetterState::Dead);
        let token = l.take(110, 1000).unwrap().unwrap();
        assert!(l.on_record(&new(false, Some(40)), 120));
        assert_eq!(l.state, DeadLetterState::Redriving, "the hold stands");
        assert_eq!(l.redrive_until_ms, Some(1110));
        assert_eq!(l.first_reached_at_ms, Some(40));
        assert_eq!(l.attempts, 4);
        assert!(l.finish(
            token,
            &RedriveOutcome::Failed {
                attempts: 1,
                error: "x".into(),
                first_reached_at_ms: Some(60),
                not_applied_at_ms: None
            },
            130
        ));
        assert_eq!(
            l.first_reached_at_ms,
            Some(40),
            "a failed redrive never moves the earliest reach later"
        );
        assert!(l.on_record(&new(true, None), 140));
        assert_eq!(l.state, DeadLetterState::Unknown);
        assert!(l.on_record(&new(false, None), 150));
        assert_eq!(l.state, DeadLetterState::Unknown, "an unknown outcome stays held");
    }

    /// Proves cancelling needs a "not applied" verdict with no send that may have reached the vendor after it.
    #[test]
    fn only_a_call_known_not_applied_is_cancelled() {
        let mut l = DeadLetter::created(&new(false, Some(50)), 100);
        assert!(!l.cancel(101), "no verdict");
        let not_applied = Settlement {
            verdict: Verdict::NotApplied,
            by: VerdictSource::Operator,
            status: None,
            body: vec![],
            note: "checked the dashboard".into(),
        };
        assert!(l.settle(&not_applied, 102));
        assert!(l.known_not_applied());
        l.on_record(&new(false, Some(103)), 104);
        assert!(!l.known_not_applied(), "a later send may have reached the vendor");
        assert!(!l.cancel(105));
        assert!(l.settle(&not_applied, 106));
        assert!(l.cancel(107));
        assert_eq!(l.state, DeadLetterState::Cancelled);
        assert!(!l.settle(&not_applied, 108), "final");
        assert!(!l.on_record(&new(false, Some(1)), 109), "final");
        assert!(l.take(110, 10).unwrap().is_none());
    }

    /// Proves rows round-trip through their plain values, and corrupt values are reported, not panicked on.
    #[test]
    fn rows_round_trip_and_corruption_is_an_error() {
        let mut l = DeadLetter::created(&new(true, Some(5)), 100);
        l.id = 7;
        let row = DeadLetterRow::of(&l).unwrap();
        assert_eq!(row.clone().decode().unwrap(), l);
        for broken in [
            DeadLetterRow {
                state: "gone".into(),
                ..row.clone()
            },
            DeadLetterRow {
                attempts: -1,
                ..row.clone()
            },
            DeadLetterRow {
                headers: "{".into(),
                ..row.clone()
            },
            DeadLetterRow {
                verdict_by: None,
                ..row.clone()
            },
            DeadLetterRow {
                settle_ms: None,
                ..row.clone()
            },
            DeadLetterRow {
                key_horizon_ms: Some(-1),
                ..row.clone()
            },
        ] {
            assert!(broken.decode().is_err());
        }
    }
}
