//! Idempotency keys as a client makes and sends them.

use std::fmt;

use reqwest::header::HeaderValue;

use crate::{Error, Result};

/// The longest key, in characters (the HTTP contract's limit).
pub const MAX_KEY_LEN: usize = 255;

/// The name of one logical operation: 1 to 255 characters of printable ASCII
/// (space to `~`), the rule every idem-protected route applies.
///
/// A client makes one key per logical operation with [`Key::generate`] (a
/// UUIDv7, so keys sort by creation time) and sends it with every retry of
/// that operation, across restarts.
///
/// ```
/// use idem_client::Key;
/// let key = Key::generate();
/// assert_eq!(key.as_str().len(), 36);
/// assert!(Key::new("order-42/charge").is_ok());
/// assert!(Key::new("").is_err());
/// assert!(Key::new("tab\there").is_err());
/// ```
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Key(String);

impl Key {
    /// A fresh time-ordered key: a UUIDv7 in its hyphenated lower-case form.
    pub fn generate() -> Self {
        Self(uuid::Uuid::now_v7().to_string())
    }

    /// Validates `key` and wraps it.
    pub fn new(key: impl Into<String>) -> Result<Self> {
        let key = key.into();
        if key.is_empty() {
            return Err(Error::InvalidKey("the key is empty".into()));
        }
        if key.len() > MAX_KEY_LEN {
            return Err(Error::InvalidKey(format!(
                "the key is {} bytes long; at most {MAX_KEY_LEN} are allowed",
                key.len()
            )));
        }
        if let Some((i, c)) = key.char_indices().find(|(_, c)| !(' '..='~').contains(c)) {
            return Err(Error::InvalidKey(format!(
                "the key has {c:?} at byte {i}; only printable ASCII is allowed"
            )));
        }
        Ok(Self(key))
    }

    /// The key as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The `Idempotency-Key` header value: the key as an RFC 9651 sf-string
    /// (quoted, with `"` and `\` escaped).
    ///
    /// ```
    /// use idem_client::Key;
    /// assert_eq!(Key::new("a\"b").unwrap().header_value(), "\"a\\\"b\"");
    /// ```
    pub fn header_value(&self) -> HeaderValue {
        let mut quoted = String::with_capacity(self.0.len() + 2);
        quoted.push('"');
        for c in self.0.chars() {
            if c == '"' || c == '\\' {
                quoted.push('\\');
            }
            quoted.push(c);
        }
        quoted.push('"');
        // Printable ASCII only (checked by `new`), so always a valid value.
        HeaderValue::from_str(&quoted).expect("printable ASCII is a valid header value")
    }
}

impl fmt::Display for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::str::FromStr for Key {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        Self::new(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Generated keys are UUIDv7, distinct and ordered by creation.
    #[test]
    fn generated_keys_are_uuid_v7_in_order() {
        let a = Key::generate();
        let b = Key::generate();
        assert_ne!(a, b);
        assert!(a < b, "{a} then {b}");
        let u = uuid::Uuid::parse_str(a.as_str()).unwrap();
        assert_eq!(u.get_version_num(), 7);
    }

    /// The limits of the contract: 255 printable characters pass, 256 and control characters do not.
    #[test]
    fn limits() {
        assert!(Key::new("x".repeat(255)).is_ok());
        assert!(matches!(Key::new("x".repeat(256)), Err(Error::InvalidKey(_))));
        assert!(matches!(Key::new("é"), Err(Error::InvalidKey(_))));
        assert!(matches!(Key::new("a\nb"), Err(Error::InvalidKey(_))));
        assert!(Key::new(" ~").is_ok());
    }

    /// An over-long key's error counts bytes, the unit of the limit: 128
    /// two-byte characters are 256 bytes.
    #[test]
    fn an_overlong_key_is_measured_in_bytes() {
        let Err(Error::InvalidKey(why)) = Key::new("é".repeat(128)) else {
            panic!("a 256-byte key was accepted");
        };
        assert!(why.contains("256 bytes long"), "{why}");
    }

    /// The header is an sf-string even for keys with quotes and backslashes.
    #[test]
    fn header_is_an_sf_string() {
        assert_eq!(Key::new("abc").unwrap().header_value(), "\"abc\"");
        assert_eq!(Key::new(r"a\b").unwrap().header_value(), r#""a\\b""#);
    }
}
