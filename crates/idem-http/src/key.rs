//! Parsing the `Idempotency-Key` request header.

use http::HeaderMap;
use idem_core::IdempotencyKey;

/// The header name.
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";

/// What the request says about its key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyHeader {
    /// No `Idempotency-Key` header.
    Missing,
    /// A valid key.
    Present(IdempotencyKey),
    /// A header that is not a valid key, and why.
    Invalid(String),
}

/// Reads the `Idempotency-Key` header: an RFC 9651 sf-string (`"…"`, with
/// parameters ignored) or a bare unquoted token, 1–255 printable ASCII
/// characters after unquoting. More than one header is invalid.
///
/// ```
/// use http::HeaderMap;
/// use idem_http::{KeyHeader, parse_key_header};
/// let mut h = HeaderMap::new();
/// h.insert("idempotency-key", "\"8e03978e-40d5\"".parse().unwrap());
/// assert!(matches!(parse_key_header(&h), KeyHeader::Present(k) if k.as_str() == "8e03978e-40d5"));
/// h.insert("idempotency-key", "8e03978e-40d5".parse().unwrap());
/// assert!(matches!(parse_key_header(&h), KeyHeader::Present(k) if k.as_str() == "8e03978e-40d5"));
/// ```
pub fn parse_key_header(headers: &HeaderMap) -> KeyHeader {
    let mut values = headers.get_all(IDEMPOTENCY_KEY).iter();
    let Some(value) = values.next() else {
        return KeyHeader::Missing;
    };
    if values.next().is_some() {
        return KeyHeader::Invalid("more than one Idempotency-Key header".into());
    }
    let Ok(raw) = value.to_str() else {
        return KeyHeader::Invalid("the header is not visible ASCII".into());
    };
    let raw = raw.trim_matches(|c| c == ' ' || c == '\t');
    let text = if raw.starts_with('"') {
        match sfv::Parser::new(raw).parse_item::<sfv::Item>() {
            Ok(item) => match item.bare_item.as_string() {
                Some(s) => s.as_str().to_owned(),
                None => return KeyHeader::Invalid("the header is not an sf-string".into()),
            },
            Err(e) => return KeyHeader::Invalid(format!("the header is not a valid sf-string: {e}")),
        }
    } else {
        if raw.chars().any(|c| c == '"' || c == ',' || c.is_ascii_whitespace()) {
            return KeyHeader::Invalid("an unquoted key must be a single token".into());
        }
        raw.to_owned()
    };
    match IdempotencyKey::new(text) {
        Ok(key) => KeyHeader::Present(key),
        Err(e) => KeyHeader::Invalid(e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(v: &str) -> KeyHeader {
        let mut h = HeaderMap::new();
        h.insert(IDEMPOTENCY_KEY, v.parse().unwrap());
        parse_key_header(&h)
    }

    #[test]
    fn forms() {
        assert_eq!(
            parse("\"abc\""),
            KeyHeader::Present(IdempotencyKey::new("abc").unwrap())
        );
        assert_eq!(
            parse("\"a b\\\"c\""),
            KeyHeader::Present(IdempotencyKey::new("a b\"c").unwrap())
        );
        assert_eq!(
            parse("\"abc\";p=1"),
            KeyHeader::Present(IdempotencyKey::new("abc").unwrap())
        );
        assert_eq!(parse("abc"), KeyHeader::Present(IdempotencyKey::new("abc").unwrap()));
        assert_eq!(
            parse("0192f0c1-7b4e-7cc3-9d2a-0a6b5f1e2d3c").clone(),
            KeyHeader::Present(IdempotencyKey::new("0192f0c1-7b4e-7cc3-9d2a-0a6b5f1e2d3c").unwrap())
        );
        assert!(matches!(parse("\"\""), KeyHeader::Invalid(_)));
        assert!(matches!(parse("\"unterminated"), KeyHeader::Invalid(_)));
        assert!(matches!(parse("a b"), KeyHeader::Invalid(_)));
        assert!(matches!(parse("a,b"), KeyHeader::Invalid(_)));
        assert!(matches!(
            parse(&format!("\"{}\"", "x".repeat(256))),
            KeyHeader::Invalid(_)
        ));
        assert!(matches!(parse(&"x".repeat(256)), KeyHeader::Invalid(_)));
        assert_eq!(
            parse(&"x".repeat(255)),
            KeyHeader::Present(IdempotencyKey::new("x".repeat(255)).unwrap())
        );
    }

    #[test]
    fn two_headers_are_invalid() {
        let mut h = HeaderMap::new();
        h.append(IDEMPOTENCY_KEY, "a".parse().unwrap());
        h.append(IDEMPOTENCY_KEY, "b".parse().unwrap());
        assert!(matches!(parse_key_header(&h), KeyHeader::Invalid(_)));
        assert_eq!(parse_key_header(&HeaderMap::new()), KeyHeader::Missing);
    }
}
