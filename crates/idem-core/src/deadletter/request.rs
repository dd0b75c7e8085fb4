//! The request a dead letter keeps, and the limits on what it keeps.

use crate::error::{Error, Result};

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
    crate::redact::cut_at_char_boundary(text, MAX_DEAD_LETTER_TEXT)
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
        Ok(text) => crate::redact::cut_at_char_boundary(text, max).as_bytes(),
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
