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

use crate::error::{Error, Result};
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
/// Errors and response bodies are cut to this many bytes (on a character
/// boundary) before they are stored.
pub const MAX_DEAD_LETTER_TEXT: usize = 4096;

/// The request of an outbound call, as sent (without the idempotency key
/// header, which is added from the key on every send).
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
    /// [`MAX_DEAD_LETTER_URL`] bytes, a header malformed or too large, or
    /// the body over [`MAX_DEAD_LETTER_BODY`].
    ///
    /// ```
    /// use idem_core::OutboundRequest;
    /// let r = OutboundRequest::new("POST", "http://vendor/v1/payouts", vec![], b"{}".to_vec())?;
    /// assert_eq!(r.method(), "POST");
    /// assert!(OutboundRequest::new("PO ST", "http://v/", vec![], vec![]).is_err());
    /// assert!(OutboundRequest::new("POST", "ftp://v/", vec![], vec![]).is_err());
    /// # Ok::<(), idem_core::Error>(())
    /// ```
    pub fn new(
        method: impl Into<String>,
        url: impl Into<String>,
        headers: Vec<(String, String)>,
        body: Vec<u8>,
    ) -> Result<Self> {
        let method = method.into();
        let url = url.into();
        let bad = |why: String| Err(Error::InvalidRequest(why));
        if method.is_empty() || method.len() > 32 || !method.bytes().all(is_tchar) {
            return bad(format!("invalid HTTP method {method:?}"));
        }
        let lower = url.to_ascii_lowercase();
        if !(lower.starts_with("http://") || lower.starts_with("https://"))
            || url.len() > MAX_DEAD_LETTER_URL
            || url.chars().any(|c| c.is_control() || c == ' ')
        {
            return bad(format!(
                "the URL must be absolute http(s), at most {MAX_DEAD_LETTER_URL} bytes, without spaces"
            ));
        }
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

/// RFC 9110 token characters.
fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// Cuts `text` to at most [`MAX_DEAD_LETTER_TEXT`] bytes on a character
/// boundary.
pub fn clip_text(text: &str) -> &str {
    if text.len() <= MAX_DEAD_LETTER_TEXT {
        return text;
    }
    let mut end = MAX_DEAD_LETTER_TEXT;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

/// A response body cut to [`MAX_DEAD_LETTER_TEXT`] bytes: on a character
/// boundary when it is text.
pub fn clip_body(body: &[u8]) -> &[u8] {
    match std::str::from_utf8(body) {
        Ok(text) => clip_text(text).as_bytes(),
        Err(_) => &body[..body.len().min(MAX_DEAD_LETTER_TEXT)],
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
}

/// Where a dead letter stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DeadLetterState {
    /// Waiting for an operator (or a policy) to redrive it.
    Dead,
    /// Being sent again; the redriver holds it until its lease runs out.
    Redriving,
    /// A redrive got a success answer, which is kept with it.
    Resolved,
}

impl DeadLetterState {
    /// `dead`, `redriving` or `resolved`, as stored.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Dead => "dead",
            Self::Redriving => "redriving",
            Self::Resolved => "resolved",
        }
    }

    /// Parses [`as_str`](Self::as_str)'s form.
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "dead" => Ok(Self::Dead),
            "redriving" => Ok(Self::Redriving),
            "resolved" => Ok(Self::Resolved),
            other => Err(Error::InvalidRequest(format!(
                "unknown dead-letter state {other:?} (dead, redriving, resolved)"
            ))),
        }
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
    /// The success status a redrive got (state `resolved`).
    pub response_status: Option<u16>,
    /// The success body a redrive got, clipped.
    pub response_body: Option<Vec<u8>>,
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

/// How a redrive ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RedriveOutcome {
    /// The vendor answered with success: the dead letter is resolved and
    /// keeps the answer.
    Resolved {
        /// The status.
        status: u16,
        /// The body (clipped when stored).
        body: Vec<u8>,
    },
    /// It failed again: the dead letter is dead again, with the attempts
    /// added and the new error.
    Failed {
        /// Sends this redrive tried.
        attempts: u32,
        /// Why the last one failed.
        error: String,
    },
}

/// A dead letter taken for a redrive. `token` proves the hold: a redrive
/// whose hold ran out and was taken by another cannot finish it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedriveHold {
    /// The dead letter as taken.
    pub dead_letter: DeadLetter,
    /// The hold's token (the redrive count after taking it).
    pub token: u32,
}

/// A store of dead letters. Store crates also offer recording inside the
/// caller's own transaction, so a business row and its dead letter commit
/// together.
pub trait DeadLetterStore: Clone + Send + Sync + 'static {
    /// Records a dead letter, or updates the one of the same (tenant,
    /// operation, key) (attempts added, last error replaced, state back to
    /// `dead` unless it is `resolved`). Answers its id.
    fn record(&self, letter: &NewDeadLetter) -> BoxFuture<'_, Result<i64>>;

    /// Lists dead letters by `filter`, by id ascending.
    fn list(&self, filter: &DeadLetterFilter) -> BoxFuture<'_, Result<Vec<DeadLetter>>>;

    /// One dead letter.
    fn get(&self, id: i64) -> BoxFuture<'_, Result<Option<DeadLetter>>>;

    /// The dead letter of (scope, key), if any.
    fn find(&self, scope: &Scope, key: &IdempotencyKey) -> BoxFuture<'_, Result<Option<DeadLetter>>>;

    /// Takes a dead letter for a redrive: one in state `dead`, or
    /// `redriving` whose hold ran out, becomes `redriving` until
    /// `now + hold_ms` (the store's clock). `None` when it does not exist,
    /// is resolved, or another redrive holds it.
    fn begin_redrive(&self, id: i64, hold_ms: i64) -> BoxFuture<'_, Result<Option<RedriveHold>>>;

    /// Ends a redrive with its outcome. Answers false (and changes nothing)
    /// when the hold was lost to another redrive.
    fn finish_redrive(&self, id: i64, token: u32, outcome: &RedriveOutcome) -> BoxFuture<'_, Result<bool>>;

    /// Deletes at most `limit` resolved dead letters resolved more than
    /// `older_than_ms` ago; answers how many.
    fn purge_resolved(&self, older_than_ms: i64, limit: u32) -> BoxFuture<'_, Result<u64>>;
}

#[cfg(test)]
mod tests {
    use super::*;

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
    }

    #[test]
    fn text_is_clipped_on_a_character_boundary() {
        let long = "é".repeat(MAX_DEAD_LETTER_TEXT);
        let clipped = clip_text(&long);
        assert!(clipped.len() <= MAX_DEAD_LETTER_TEXT);
        assert!(clipped.len() >= MAX_DEAD_LETTER_TEXT - 1);
        assert_eq!(clip_text("short"), "short");
    }

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

    #[test]
    fn states_round_trip() {
        for s in [
            DeadLetterState::Dead,
            DeadLetterState::Redriving,
            DeadLetterState::Resolved,
        ] {
            assert_eq!(DeadLetterState::parse(s.as_str()).unwrap(), s);
        }
        assert!(DeadLetterState::parse("gone").is_err());
    }

    #[test]
    fn binary_bodies_are_cut_by_bytes_and_text_on_a_character_boundary() {
        // Proves response bodies are bounded without splitting a character.
        let binary = vec![0xFF; MAX_DEAD_LETTER_TEXT + 10];
        assert_eq!(clip_body(&binary).len(), MAX_DEAD_LETTER_TEXT);
        let text = "é".repeat(MAX_DEAD_LETTER_TEXT);
        let clipped = clip_body(text.as_bytes());
        assert!(std::str::from_utf8(clipped).is_ok());
        assert!(clipped.len() <= MAX_DEAD_LETTER_TEXT);
    }
}
