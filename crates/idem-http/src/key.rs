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

/// The longest header value read (a key is at most 255 characters; the rest
/// is quoting and parameters).
pub const MAX_HEADER_BYTES: usize = 1024;

/// Reads the `Idempotency-Key` header.
///
/// The grammar, after optional surrounding spaces:
///
/// - an RFC 9651 sf-string, `"8e03978e-40d5"` (the canonical form), or
/// - a bare token: RFC 9651 token characters (`tchar`, `:` and `/`) starting
///   with a letter or `*` as the sf-token grammar says, and also with a digit
///   so that unquoted UUIDs keep working (`0192f0c1-7b4e-…`);
///
/// each optionally followed by RFC 9651 parameters, which are ignored:
/// `"abc"`, `"abc";p=1` and `abc;p=1` are the same key. The key (the string's
/// content or the token) is 1–255 characters. Anything else is invalid: other
/// structured types (`?1`, `(x)`, `@x`, `12.5`), characters outside the
/// grammar (`{}`, `tok=`, spaces, commas), non-ASCII, a value longer than
/// [`MAX_HEADER_BYTES`], and more than one header.
///
/// ```
/// use http::HeaderMap;
/// use idem_http::{KeyHeader, parse_key_header};
/// let mut h = HeaderMap::new();
/// h.insert("idempotency-key", "\"8e03978e-40d5\"".parse().unwrap());
/// assert!(matches!(parse_key_header(&h), KeyHeader::Present(k) if k.as_str() == "8e03978e-40d5"));
/// h.insert("idempotency-key", "8e03978e-40d5;p=1".parse().unwrap());
/// assert!(matches!(parse_key_header(&h), KeyHeader::Present(k) if k.as_str() == "8e03978e-40d5"));
/// h.insert("idempotency-key", "{}".parse().unwrap());
/// assert!(matches!(parse_key_header(&h), KeyHeader::Invalid(_)));
/// ```
pub fn parse_key_header(headers: &HeaderMap) -> KeyHeader {
    let mut values = headers.get_all(IDEMPOTENCY_KEY).iter();
    let Some(value) = values.next() else {
        return KeyHeader::Missing;
    };
    if values.next().is_some() {
        return KeyHeader::Invalid("more than one Idempotency-Key header".into());
    }
    if value.len() > MAX_HEADER_BYTES {
        return KeyHeader::Invalid(format!("the header is longer than {MAX_HEADER_BYTES} bytes"));
    }
    let Ok(raw) = value.to_str() else {
        return KeyHeader::Invalid("the header is not visible ASCII".into());
    };
    let text = match parse_key_text(raw) {
        Ok(text) => text,
        Err(why) => return KeyHeader::Invalid(why.into()),
    };
    match IdempotencyKey::new(text) {
        Ok(key) => KeyHeader::Present(key),
        Err(e) => KeyHeader::Invalid(e.to_string()),
    }
}

/// The key text of a header value, or why it is not one.
fn parse_key_text(raw: &str) -> Result<String, &'static str> {
    let raw = raw.trim_matches(' ');
    if raw.starts_with('"') {
        let item = sfv::Parser::new(raw)
            .parse_item::<sfv::Item>()
            .map_err(|_| "the header is not a valid sf-string (RFC 9651)")?;
        return match item.bare_item.as_string() {
            Some(s) => Ok(s.as_str().to_owned()),
            None => Err("the header is not an sf-string"),
        };
    }
    let end = raw.find(|c: char| !is_token_char(c)).unwrap_or(raw.len());
    let (token, params) = raw.split_at(end);
    match token.chars().next() {
        None => return Err("the header is neither an sf-string nor a token"),
        Some(c) if !(c.is_ascii_alphanumeric() || c == '*') => {
            return Err("an unquoted key must start with a letter, a digit or '*'");
        }
        Some(_) => {}
    }
    if !params.is_empty() {
        // Only parameters may follow a token: check them as RFC 9651 does by
        // parsing them after a placeholder item.
        if !params.starts_with(';') {
            return Err("an unquoted key must be a single token");
        }
        sfv::Parser::new(&format!("x{params}"))
            .parse_item::<sfv::Item>()
            .map_err(|_| "the parameters after the key are not valid (RFC 9651)")?;
    }
    Ok(token.to_owned())
}

/// RFC 9651 token characters after the first: `tchar`, `:` and `/`.
fn is_token_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || "!#$%&'*+-.^_`|~:/".contains(c)
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

    fn key(s: &str) -> KeyHeader {
        KeyHeader::Present(IdempotencyKey::new(s).unwrap())
    }

    #[test]
    fn parameters_are_ignored() {
        for v in [
            "\"abc\"",
            "\"abc\";p=1",
            "abc;p=1",
            "abc",
            " abc ",
            "abc;p",
            "\"abc\";a=1;b=?0",
            "abc;a=\"x\"",
        ] {
            assert_eq!(parse(v), key("abc"), "{v}");
        }
        assert_eq!(parse("*x/y:z"), key("*x/y:z"));
        assert_eq!(parse("a!#$%&'*+-.^_`|~"), key("a!#$%&'*+-.^_`|~"));
    }

    #[test]
    fn outside_the_grammar_is_refused() {
        for v in [
            "{}",
            "?",
            "@x",
            "(x)",
            "tok=",
            "",
            " ",
            "?1",
            "-x",
            ".x",
            "a=b",
            "a;",
            "a;P=1",
            "a;p=",
            "\"abc\" x",
            "\"abc\";",
            "a b",
            "a,b",
            "\"a\",\"b\"",
            "\"\"",
            "abc;p={}",
        ] {
            assert!(matches!(parse(v), KeyHeader::Invalid(_)), "{v:?} accepted");
        }
        let mut h = HeaderMap::new();
        h.insert(
            IDEMPOTENCY_KEY,
            http::HeaderValue::from_bytes("\"caf\u{e9}\"".as_bytes()).unwrap(),
        );
        assert!(matches!(parse_key_header(&h), KeyHeader::Invalid(_)));
        let long = format!("abc;p=\"{}\"", "x".repeat(MAX_HEADER_BYTES));
        assert!(matches!(parse(&long), KeyHeader::Invalid(_)));
    }

    mod props {
        use super::*;
        use proptest::prelude::*;

        fn token() -> impl Strategy<Value = String> {
            "[A-Za-z0-9*][A-Za-z0-9!#$%&'*+.^_`|~:/-]{0,40}"
        }

        fn params() -> impl Strategy<Value = String> {
            prop::collection::vec(
                (
                    "[a-z*][a-z0-9_.*-]{0,5}",
                    prop::option::of("[0-9]{1,5}|\\?[01]|[a-z][a-z0-9]{0,5}"),
                ),
                0..3,
            )
            .prop_map(|ps| {
                ps.into_iter()
                    .map(|(k, v)| match v {
                        Some(v) => format!(";{k}={v}"),
                        None => format!(";{k}"),
                    })
                    .collect()
            })
        }

        proptest! {
            #[test]
            fn quoted_and_bare_tokens_are_one_key(t in token(), p1 in params(), p2 in params()) {
                let quoted = parse(&format!("\"{t}\"{p1}"));
                prop_assert_eq!(&quoted, &key(&t));
                prop_assert_eq!(parse(&format!("{t}{p2}")), quoted);
            }

            #[test]
            fn any_sf_string_is_its_content(s in "[ !#-\\[\\]-~\"\\\\]{1,100}") {
                let escaped: String = s.chars().flat_map(|c| match c {
                    '"' | '\\' => vec!['\\', c],
                    c => vec![c],
                }).collect();
                prop_assert_eq!(parse(&format!("\"{escaped}\"")), key(&s));
            }

            #[test]
            fn a_value_starting_outside_the_grammar_is_refused(first in "[^A-Za-z0-9*\" ]", rest in "[ -~]{0,20}") {
                let v = format!("{first}{rest}");
                if let Ok(v) = http::HeaderValue::from_str(&v) {
                    let mut h = HeaderMap::new();
                    h.insert(IDEMPOTENCY_KEY, v);
                    prop_assert!(matches!(parse_key_header(&h), KeyHeader::Invalid(_)));
                }
            }

            #[test]
            fn never_panics(bytes in prop::collection::vec(any::<u8>(), 0..300)) {
                if let Ok(v) = http::HeaderValue::from_bytes(&bytes) {
                    let mut h = HeaderMap::new();
                    h.insert(IDEMPOTENCY_KEY, v);
                    if let KeyHeader::Present(k) = parse_key_header(&h) {
                        prop_assert!(!k.as_str().is_empty() && k.as_str().len() <= 255);
                    }
                }
            }
        }
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
