//! The validated idempotency key.

use std::fmt;

use crate::error::{Error, Result};

/// The longest key accepted, in characters (all of them ASCII, so also bytes).
pub const MAX_KEY_LEN: usize = 255;

/// A client-supplied idempotency key: 1 to 255 printable ASCII characters
/// (`0x20..=0x7E`).
///
/// A key means nothing on its own; it is always looked up inside a
/// [`Scope`](crate::Scope).
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct IdempotencyKey(String);

impl IdempotencyKey {
    /// Validates `key` and wraps it.
    ///
    /// ```
    /// use idem_core::IdempotencyKey;
    /// assert!(IdempotencyKey::new("8e03978e-40d5-43e8-bc93-6894a57f9324").is_ok());
    /// assert!(IdempotencyKey::new("").is_err());
    /// assert!(IdempotencyKey::new("tab\there").is_err());
    /// ```
    pub fn new(key: impl Into<String>) -> Result<Self> {
        let key = key.into();
        validate(&key)?;
        Ok(Self(key))
    }

    /// A fresh time-ordered (UUIDv7) key, the recommended way for a client to
    /// name one logical operation.
    pub fn generate() -> Self {
        Self(uuid::Uuid::now_v7().to_string())
    }

    /// The key as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

fn validate(key: &str) -> Result<()> {
    if key.is_empty() {
        return Err(Error::InvalidKey("key is empty".into()));
    }
    if key.len() > MAX_KEY_LEN {
        return Err(Error::InvalidKey(format!(
            "key is {} bytes long; at most {MAX_KEY_LEN} are allowed",
            key.len()
        )));
    }
    if let Some((i, c)) = key.char_indices().find(|(_, c)| !(' '..='~').contains(c)) {
        return Err(Error::InvalidKey(format!(
            "character {:?} at byte {i} is not printable ASCII",
            c
        )));
    }
    Ok(())
}

impl fmt::Debug for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("IdempotencyKey").field(&self.0).finish()
    }
}

impl fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::str::FromStr for IdempotencyKey {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Self::new(s)
    }
}

impl AsRef<str> for IdempotencyKey {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn bounds_are_enforced() {
        assert!(IdempotencyKey::new("a").is_ok());
        assert!(IdempotencyKey::new("a".repeat(255)).is_ok());
        assert!(IdempotencyKey::new("a".repeat(256)).is_err());
        assert!(IdempotencyKey::new(" spaces are printable ").is_ok());
        assert!(IdempotencyKey::new("é").is_err());
        assert!(IdempotencyKey::new("nul\0").is_err());
        assert!(IdempotencyKey::new("del\x7f").is_err());
    }

    #[test]
    fn generated_keys_are_valid_and_distinct() {
        let a = IdempotencyKey::generate();
        let b = IdempotencyKey::generate();
        assert_ne!(a, b);
        assert!(IdempotencyKey::new(a.as_str()).is_ok());
    }

    proptest! {
        // Any printable-ASCII string of legal length is accepted, and round-trips unchanged.
        #[test]
        fn printable_ascii_round_trips(s in "[ -~]{1,255}") {
            let key = IdempotencyKey::new(s.clone()).unwrap();
            prop_assert_eq!(key.as_str(), s.as_str());
        }

        // Anything containing a non-printable character is refused.
        #[test]
        fn control_characters_are_refused(prefix in "[ -~]{0,10}", c in "[\\x00-\\x1f\\x7f]", suffix in "[ -~]{0,10}") {
            let candidate = format!("{prefix}{c}{suffix}");
            prop_assert!(IdempotencyKey::new(candidate).is_err());
        }
    }
}
