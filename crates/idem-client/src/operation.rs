//! One logical operation: a request and the key that names it.

use bytes::Bytes;
use reqwest::header::{HeaderMap, HeaderName, HeaderValue};
use reqwest::{Method, Url};
use serde::Serialize;

use crate::{Error, Key, Result};

/// The longest URL accepted, in bytes.
pub const MAX_URL_BYTES: usize = 8 * 1024;
/// The most headers an operation may carry.
pub const MAX_HEADERS: usize = 64;
/// The most bytes of header names and values an operation may carry.
pub const MAX_HEADER_BYTES: usize = 32 * 1024;

/// Headers an operation may not set: the client writes them itself
/// (`Idempotency-Key` from the key; framing from the body), or they belong to
/// one connection.
const RESERVED: [&str; 7] = [
    "idempotency-key",
    "content-length",
    "transfer-encoding",
    "host",
    "connection",
    "keep-alive",
    "upgrade",
];

/// One logical operation: method, URL, headers, body and the key that names
/// it. Every attempt to send it — retries, and resends after a restart —
/// carries the same key, so the server applies it at most once.
///
/// Credentials do not belong here: an operation is written to the pending
/// store as it is. Put `Authorization` in the client's default headers
/// ([`ClientBuilder::default_header`](crate::ClientBuilder::default_header)),
/// which are sent with every attempt and never stored.
///
/// ```
/// use idem_client::Operation;
/// let op = Operation::post("http://127.0.0.1:8080/v1/top-ups")
///     .json(&serde_json::json!({"account_id": "…", "amount": 500}))
///     .build()
///     .unwrap();
/// assert_eq!(op.method(), "POST");
/// assert_eq!(op.headers()["content-type"], "application/json");
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Operation {
    key: Key,
    method: Method,
    url: Url,
    headers: HeaderMap,
    body: Bytes,
}

impl Operation {
    /// Starts an operation with a fresh key ([`Key::generate`]).
    pub fn builder(method: Method, url: &str) -> OperationBuilder {
        OperationBuilder {
            key: None,
            method,
            url: url.to_owned(),
            headers: HeaderMap::new(),
            body: Bytes::new(),
            error: None,
        }
    }

    /// A `POST` operation.
    pub fn post(url: &str) -> OperationBuilder {
        Self::builder(Method::POST, url)
    }

    /// A `PUT` operation.
    pub fn put(url: &str) -> OperationBuilder {
        Self::builder(Method::PUT, url)
    }

    /// A `PATCH` operation.
    pub fn patch(url: &str) -> OperationBuilder {
        Self::builder(Method::PATCH, url)
    }

    /// A `DELETE` operation.
    pub fn delete(url: &str) -> OperationBuilder {
        Self::builder(Method::DELETE, url)
    }

    /// The key.
    pub fn key(&self) -> &Key {
        &self.key
    }

    /// The method.
    pub fn method(&self) -> &Method {
        &self.method
    }

    /// The URL.
    pub fn url(&self) -> &Url {
        &self.url
    }

    /// The operation's own headers (without the client's defaults).
    pub fn headers(&self) -> &HeaderMap {
        &self.headers
    }

    /// The body.
    pub fn body(&self) -> &Bytes {
        &self.body
    }

    /// The operation's headers as HTTP/1 field lines, `name: value\n`
    /// each, byte for byte (a header value never holds a line feed): the
    /// form a [`PendingStore`](crate::PendingStore) keeps them in, read back
    /// by [`from_stored`](Self::from_stored).
    pub fn header_lines(&self) -> Vec<u8> {
        let mut out = Vec::new();
        for (name, value) in &self.headers {
            out.extend_from_slice(name.as_str().as_bytes());
            out.extend_from_slice(b": ");
            out.extend_from_slice(value.as_bytes());
            out.push(b'\n');
        }
        out
    }

    /// Rebuilds an operation from the parts a store kept: its key, method,
    /// URL, [`header_lines`](Self::header_lines) and body, validated as
    /// [`OperationBuilder::build`] does. Anything invalid is
    /// [`Error::Corrupt`].
    pub fn from_stored(key: &str, method: &str, url: &str, header_lines: &[u8], body: Vec<u8>) -> Result<Self> {
        let corrupt = |what: String| Error::Corrupt(format!("operation {key:?}: {what}"));
        let key = Key::new(key).map_err(|e| corrupt(e.to_string()))?;
        let method = Method::from_bytes(method.as_bytes()).map_err(|e| corrupt(format!("method: {e}")))?;
        let mut builder = Operation::builder(method, url).key(key).body(body);
        for line in header_lines.split(|b| *b == b'\n').filter(|l| !l.is_empty()) {
            let at = line
                .windows(2)
                .position(|w| w == b": ")
                .ok_or_else(|| corrupt("a header line without \": \"".into()))?;
            let name = HeaderName::from_bytes(&line[..at]).map_err(|e| corrupt(format!("header name: {e}")))?;
            let value = HeaderValue::from_bytes(&line[at + 2..]).map_err(|e| corrupt(format!("header value: {e}")))?;
            builder = builder.header_value(name, value);
        }
        builder.build().map_err(|e| corrupt(e.to_string()))
    }
}

/// Builds an [`Operation`]; the first invalid input is reported by
/// [`build`](Self::build).
#[derive(Debug)]
#[must_use]
pub struct OperationBuilder {
    key: Option<Key>,
    method: Method,
    url: String,
    headers: HeaderMap,
    body: Bytes,
    error: Option<Error>,
}

impl OperationBuilder {
    /// Names the operation with `key` instead of a fresh one: for an
    /// operation whose key the caller already holds (e.g. stored with its
    /// own business record).
    pub fn key(mut self, key: Key) -> Self {
        self.key = Some(key);
        self
    }

    /// Adds a header (appended: a name may repeat).
    pub fn header(mut self, name: &str, value: &str) -> Self {
        match (HeaderName::from_bytes(name.as_bytes()), HeaderValue::from_str(value)) {
            (Ok(n), Ok(v)) => self.header_value(n, v),
            (Err(e), _) => {
                self.fail(format!("header name {name:?}: {e}"));
                self
            }
            (_, Err(e)) => {
                self.fail(format!("value of header {name:?}: {e}"));
                self
            }
        }
    }

    /// Adds a header already typed (appended: a name may repeat).
    pub fn header_value(mut self, name: HeaderName, value: HeaderValue) -> Self {
        self.headers.append(name, value);
        self
    }

    /// Sets the body.
    pub fn body(mut self, body: impl Into<Bytes>) -> Self {
        self.body = body.into();
        self
    }

    /// Sets the body to `value` as JSON and `Content-Type: application/json`.
    pub fn json<T: Serialize + ?Sized>(mut self, value: &T) -> Self {
        match serde_json::to_vec(value) {
            Ok(body) => {
                self.body = body.into();
                self.headers.insert(
                    reqwest::header::CONTENT_TYPE,
                    HeaderValue::from_static("application/json"),
                );
            }
            Err(e) => self.fail(format!("the body cannot be written as JSON: {e}")),
        }
        self
    }

    fn fail(&mut self, why: String) {
        self.error.get_or_insert(Error::InvalidOperation(why));
    }

    /// Validates the operation: an absolute `http`/`https` URL of at most
    /// [`MAX_URL_BYTES`], at most [`MAX_HEADERS`] headers of at most
    /// [`MAX_HEADER_BYTES`] in all, none of the headers the client writes
    /// itself (`Idempotency-Key`, `Content-Length`, `Transfer-Encoding`,
    /// `Host`, `Connection`, `Keep-Alive`, `Upgrade`). The body's bound is
    /// the pending store's.
    pub fn build(self) -> Result<Operation> {
        if let Some(e) = self.error {
            return Err(e);
        }
        let invalid = |why: String| Err(Error::InvalidOperation(why));
        if self.url.len() > MAX_URL_BYTES {
            return invalid(format!(
                "the URL is {} bytes long; at most {MAX_URL_BYTES} are allowed",
                self.url.len()
            ));
        }
        let url = match Url::parse(&self.url) {
            Ok(url) => url,
            Err(e) => return invalid(format!("URL {:?}: {e}", self.url)),
        };
        if !matches!(url.scheme(), "http" | "https") || !url.has_host() {
            return invalid(format!(
                "URL {:?}: only absolute http and https URLs are sent",
                self.url
            ));
        }
        if self.headers.len() > MAX_HEADERS {
            return invalid(format!(
                "{} headers; at most {MAX_HEADERS} are allowed",
                self.headers.len()
            ));
        }
        let header_bytes: usize = self.headers.iter().map(|(n, v)| n.as_str().len() + v.len()).sum();
        if header_bytes > MAX_HEADER_BYTES {
            return invalid(format!(
                "the headers take {header_bytes} bytes; at most {MAX_HEADER_BYTES} are allowed"
            ));
        }
        if let Some(name) = RESERVED.iter().find(|name| self.headers.contains_key(**name)) {
            return invalid(format!("the header {name:?} is written by the client; do not set it"));
        }
        Ok(Operation {
            key: self.key.unwrap_or_else(Key::generate),
            method: self.method,
            url,
            headers: self.headers,
            body: self.body,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a store keeps comes back as the same operation, byte for byte.
    #[test]
    fn stored_parts_round_trip() {
        let op = Operation::put("https://api.example.com/v1/things/7?x=1")
            .header("x-trace", "a: b")
            .header("x-multi", "1")
            .header("x-multi", "2")
            .header_value(
                HeaderName::from_static("x-opaque"),
                HeaderValue::from_bytes(b"caf\xc3\xa9\t!").unwrap(),
            )
            .body(vec![0u8, 1, 2, 255])
            .build()
            .unwrap();
        let back = Operation::from_stored(
            op.key().as_str(),
            op.method().as_str(),
            op.url().as_str(),
            &op.header_lines(),
            op.body().to_vec(),
        )
        .unwrap();
        assert_eq!(back, op);
        assert_eq!(back.headers().get_all("x-multi").iter().count(), 2);
    }

    /// Bad input is refused with a message naming it.
    #[test]
    fn invalid_operations_are_refused() {
        let cases = [
            Operation::post("not a url").build(),
            Operation::post("ftp://example.com/x").build(),
            Operation::post("http://example.com/x").header("bad name", "v").build(),
            Operation::post("http://example.com/x")
                .header("x", "line\nfeed")
                .build(),
            Operation::post("http://example.com/x")
                .header("Idempotency-Key", "\"k\"")
                .build(),
            Operation::post("http://example.com/x")
                .header("content-length", "3")
                .build(),
            Operation::post(&format!("http://example.com/{}", "a".repeat(MAX_URL_BYTES))).build(),
            Operation::post("http://example.com/x")
                .header("x-big", &"v".repeat(MAX_HEADER_BYTES))
                .build(),
        ];
        for (i, case) in cases.into_iter().enumerate() {
            match case {
                Err(Error::InvalidOperation(why)) => assert!(!why.is_empty()),
                other => panic!("case {i}: {other:?}"),
            }
        }
        let mut b = Operation::post("http://example.com/x");
        for i in 0..=MAX_HEADERS {
            b = b.header(&format!("x-{i}"), "v");
        }
        assert!(matches!(b.build(), Err(Error::InvalidOperation(_))));
    }

    /// Each operation gets its own fresh key unless one is given.
    #[test]
    fn keys() {
        let a = Operation::post("http://example.com/x").build().unwrap();
        let b = Operation::post("http://example.com/x").build().unwrap();
        assert_ne!(a.key(), b.key());
        let k = Key::new("order-1").unwrap();
        let c = Operation::post("http://example.com/x").key(k.clone()).build().unwrap();
        assert_eq!(c.key(), &k);
    }
}
