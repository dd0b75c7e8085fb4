//! Request fingerprints: what makes two requests "the same".

use std::fmt;

use sha2::{Digest, Sha256};

use crate::error::{Error, Result};
use crate::scope::Operation;

/// A SHA-256 digest of the operation and the canonical request.
///
/// A key replayed with a different fingerprint is a
/// [`Error::Mismatch`], never a replay of another request's outcome. JSON
/// bodies are canonicalised per RFC 8785 first, so key order and whitespace do
/// not change the fingerprint; other bodies are hashed as raw bytes.
///
/// ```
/// use idem_core::{Fingerprint, Operation};
/// let op = Operation::new("POST /v1/transfers")?;
/// let a = Fingerprint::of_json(&op, br#"{"amount": 5, "from": "a"}"#)?;
/// let b = Fingerprint::of_json(&op, br#"{"from":"a","amount":5}"#)?;
/// assert_eq!(a, b);
/// # Ok::<(), idem_core::Error>(())
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint([u8; 32]);

impl Fingerprint {
    /// Fingerprint of a JSON request body, canonicalised per RFC 8785.
    /// Fails with [`Error::InvalidRequest`] if `json` is not valid JSON.
    pub fn of_json(operation: &Operation, json: &[u8]) -> Result<Self> {
        FingerprintBuilder::new(operation).json(json).map(|b| b.finish())
    }

    /// Fingerprint of any serialisable value, via its canonical JSON form.
    pub fn of_value<T: serde::Serialize>(operation: &Operation, value: &T) -> Result<Self> {
        FingerprintBuilder::new(operation).value(value).map(|b| b.finish())
    }

    /// Fingerprint of an opaque request body, hashed byte for byte.
    pub fn of_bytes(operation: &Operation, bytes: &[u8]) -> Self {
        FingerprintBuilder::new(operation).bytes(bytes).finish()
    }

    /// Wraps a digest read back from storage.
    pub fn from_bytes(bytes: [u8; 32]) -> Self {
        Self(bytes)
    }

    /// Wraps a digest read back from storage, checking its length.
    pub fn try_from_slice(bytes: &[u8]) -> Result<Self> {
        let arr: [u8; 32] = bytes
            .try_into()
            .map_err(|_| Error::Corrupt(format!("fingerprint is {} bytes, not 32", bytes.len())))?;
        Ok(Self(arr))
    }

    /// The raw digest.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// The digest as lower-case hex.
    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint({})", &self.to_hex()[..16])
    }
}

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

/// Builds a fingerprint from several parts (for example a query string and a
/// body). Every part is tagged and length-prefixed, so no two different
/// sequences of parts hash alike.
#[derive(Clone)]
pub struct FingerprintBuilder {
    hasher: Sha256,
}

impl FingerprintBuilder {
    /// Starts a fingerprint for `operation`.
    pub fn new(operation: &Operation) -> Self {
        let mut b = Self { hasher: Sha256::new() };
        b.hasher.update(b"idem-fingerprint-v1\0");
        b.part(b'o', operation.as_str().as_bytes());
        b
    }

    fn part(&mut self, tag: u8, bytes: &[u8]) {
        self.hasher.update([tag]);
        self.hasher.update((bytes.len() as u64).to_be_bytes());
        self.hasher.update(bytes);
    }

    /// Adds raw bytes.
    pub fn bytes(mut self, bytes: &[u8]) -> Self {
        self.part(b'b', bytes);
        self
    }

    /// Adds a JSON document in its RFC 8785 canonical form.
    pub fn json(self, json: &[u8]) -> Result<Self> {
        let value: serde_json::Value =
            serde_json::from_slice(json).map_err(|e| Error::InvalidRequest(format!("body is not valid JSON: {e}")))?;
        self.value(&value)
    }

    /// Adds a serialisable value in its RFC 8785 canonical form.
    pub fn value<T: serde::Serialize>(mut self, value: &T) -> Result<Self> {
        let canonical = serde_json_canonicalizer::to_vec(value)
            .map_err(|e| Error::InvalidRequest(format!("value cannot be canonicalised: {e}")))?;
        self.part(b'j', &canonical);
        Ok(self)
    }

    /// Adds a named text field (a header value, a query string).
    pub fn field(mut self, name: &str, value: &str) -> Self {
        self.part(b'n', name.as_bytes());
        self.part(b'v', value.as_bytes());
        self
    }

    /// Finishes the digest.
    pub fn finish(self) -> Fingerprint {
        let out = self.hasher.finalize();
        let mut bytes = [0u8; 32];
        bytes.copy_from_slice(&out);
        Fingerprint(bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn op(s: &str) -> Operation {
        Operation::new(s).unwrap()
    }

    #[test]
    fn key_order_and_whitespace_do_not_matter() {
        let a = Fingerprint::of_json(&op("x"), br#"{"a":1,"b":{"d":[1,2],"c":"z"}}"#).unwrap();
        let b = Fingerprint::of_json(&op("x"), b"{ \"b\" : {\"c\":\"z\",\"d\":[1, 2]},\n \"a\":1 }").unwrap();
        assert_eq!(a, b);
    }

    #[test]
    fn values_operations_and_kinds_matter() {
        let a = Fingerprint::of_json(&op("x"), br#"{"a":1}"#).unwrap();
        assert_ne!(a, Fingerprint::of_json(&op("x"), br#"{"a":2}"#).unwrap());
        assert_ne!(a, Fingerprint::of_json(&op("y"), br#"{"a":1}"#).unwrap());
        assert_ne!(a, Fingerprint::of_bytes(&op("x"), br#"{"a":1}"#));
        // Array order is significant in JSON.
        assert_ne!(
            Fingerprint::of_json(&op("x"), b"[1,2]").unwrap(),
            Fingerprint::of_json(&op("x"), b"[2,1]").unwrap()
        );
    }

    #[test]
    fn invalid_json_is_an_error() {
        assert!(matches!(
            Fingerprint::of_json(&op("x"), b"{not json"),
            Err(Error::InvalidRequest(_))
        ));
    }

    #[test]
    fn parts_are_unambiguous() {
        let a = FingerprintBuilder::new(&op("x")).bytes(b"ab").bytes(b"c").finish();
        let b = FingerprintBuilder::new(&op("x")).bytes(b"a").bytes(b"bc").finish();
        assert_ne!(a, b);
    }

    proptest! {
        // Re-serialising a JSON object with any spacing never changes its fingerprint.
        #[test]
        fn pretty_and_compact_agree(map in proptest::collection::btree_map("[a-z]{1,6}", any::<i64>(), 0..8)) {
            let compact = serde_json::to_vec(&map).unwrap();
            let pretty = serde_json::to_vec_pretty(&map).unwrap();
            prop_assert_eq!(
                Fingerprint::of_json(&op("p"), &compact).unwrap(),
                Fingerprint::of_json(&op("p"), &pretty).unwrap()
            );
        }
    }
}
