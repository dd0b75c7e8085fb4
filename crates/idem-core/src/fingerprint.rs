//! Request fingerprints: what makes two requests "the same".

pub mod canonical;

use std::fmt;

use sha2::{Digest, Sha256};

use crate::error::{Error, Result};
use crate::scope::Operation;

/// The format of a fingerprint.
///
/// Stored fingerprints are 32 bytes. A [`V2`](Self::V2) fingerprint is the
/// byte `0x02` followed by the first 31 bytes of a SHA-256 digest; a
/// [`V1`](Self::V1) fingerprint is a whole SHA-256 digest. A store's column
/// keeps either, so a new format needs no schema change, and an engine can
/// accept a retry whose earlier attempt was fingerprinted in the previous
/// format (see [`Call::with_previous_fingerprint`](crate::Call::with_previous_fingerprint)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum FingerprintVersion {
    /// JSON canonicalised per RFC 8785, numbers through `f64`: digits past
    /// double precision are lost. Kept to recognise stored fingerprints.
    V1,
    /// JSON canonicalised exactly by [`canonical::canonical_json`].
    #[default]
    V2,
}

impl FingerprintVersion {
    /// The version byte that opens a fingerprint of this format, if it has one.
    pub fn tag(self) -> Option<u8> {
        match self {
            Self::V1 => None,
            Self::V2 => Some(0x02),
        }
    }
}

/// A digest of the operation and the canonical request: 32 bytes whose
/// layout depends on its [`FingerprintVersion`].
///
/// A key replayed with a different fingerprint is a
/// [`Error::Mismatch`], never a replay of another request's outcome. JSON
/// bodies are canonicalised exactly first (see [`canonical`]), so member
/// order, whitespace and the spelling of numbers and strings do not change
/// the fingerprint, while every digit of every number does; other bodies are
/// hashed as raw bytes. The constructors make the current format,
/// [`FingerprintVersion::V2`].
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
    /// Fingerprint of a JSON request body in its exact canonical form.
    /// Fails with [`Error::InvalidRequest`] if `json` has no canonical form
    /// (it is not JSON, repeats a member name, nests too deeply...).
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
    version: FingerprintVersion,
}

impl FingerprintBuilder {
    /// Starts a fingerprint for `operation` in the current format.
    pub fn new(operation: &Operation) -> Self {
        Self::with_version(operation, FingerprintVersion::default())
    }

    /// Starts a fingerprint for `operation` in the format `version`.
    pub fn with_version(operation: &Operation, version: FingerprintVersion) -> Self {
        let mut b = Self {
            hasher: Sha256::new(),
            version,
        };
        b.hasher.update(match version {
            FingerprintVersion::V1 => b"idem-fingerprint-v1\0",
            FingerprintVersion::V2 => b"idem-fingerprint-v2\0",
        });
        b.part(b'o', operation.as_str().as_bytes());
        b
    }

    /// The format being built.
    pub fn version(&self) -> FingerprintVersion {
        self.version
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

    /// Adds a JSON document in its canonical form: exact (see [`canonical`])
    /// in V2, RFC 8785 through `f64` in V1. Fails with
    /// [`Error::InvalidRequest`] if the document has no canonical form.
    pub fn json(mut self, json: &[u8]) -> Result<Self> {
        match self.version {
            FingerprintVersion::V1 => {
                let value: serde_json::Value = serde_json::from_slice(json)
                    .map_err(|e| Error::InvalidRequest(format!("body is not valid JSON: {e}")))?;
                self.value(&value)
            }
            FingerprintVersion::V2 => {
                let canonical = canonical::canonical_json(json)
                    .map_err(|e| Error::InvalidRequest(format!("body has no canonical JSON form: {e}")))?;
                self.part(b'j', &canonical);
                Ok(self)
            }
        }
    }

    /// Adds a serialisable value in its canonical JSON form.
    pub fn value<T: serde::Serialize>(mut self, value: &T) -> Result<Self> {
        let canonical = match self.version {
            FingerprintVersion::V1 => serde_json_canonicalizer::to_vec(value)
                .map_err(|e| Error::InvalidRequest(format!("value cannot be canonicalised: {e}")))?,
            FingerprintVersion::V2 => {
                let json = serde_json::to_vec(value)
                    .map_err(|e| Error::InvalidRequest(format!("value cannot be serialised: {e}")))?;
                canonical::canonical_json(&json)
                    .map_err(|e| Error::InvalidRequest(format!("value has no canonical JSON form: {e}")))?
            }
        };
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
        match self.version.tag() {
            None => bytes.copy_from_slice(&out),
            Some(tag) => {
                bytes[0] = tag;
                bytes[1..].copy_from_slice(&out[..31]);
            }
        }
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

    // Digits past double precision make a different request.
    #[test]
    fn numbers_keep_every_digit() {
        let f = |s: &str| Fingerprint::of_json(&op("x"), s.as_bytes()).unwrap();
        assert_ne!(
            f(r#"{"account_id":9007199254740993}"#),
            f(r#"{"account_id":9007199254740992}"#)
        );
        assert_ne!(f(r#"{"amount":0.30000000000000001}"#), f(r#"{"amount":0.3}"#));
        assert_eq!(f("[1,1.0,1e0,-0]"), f("[10e-1, 1.00, 0.1e1, 0]"));
        assert_eq!(f(r#"{"a":"\u0041"}"#), f(r#"{"a":"A"}"#));
    }

    // Current fingerprints open with their version byte; V1 ones are whole digests.
    #[test]
    fn versions_are_distinct_formats() {
        let v2 = Fingerprint::of_json(&op("x"), b"[1]").unwrap();
        assert_eq!(v2.as_bytes()[0], 0x02);
        let v1 = FingerprintBuilder::with_version(&op("x"), FingerprintVersion::V1)
            .json(b"[1]")
            .unwrap()
            .finish();
        assert_ne!(v1, v2);
        // V1 loses the 54th bit; V2 does not.
        let v1_of = |s: &[u8]| {
            FingerprintBuilder::with_version(&op("x"), FingerprintVersion::V1)
                .json(s)
                .unwrap()
                .finish()
        };
        assert_eq!(v1_of(b"9007199254740993"), v1_of(b"9007199254740992"));
    }

    // Duplicate member names have no canonical form.
    #[test]
    fn duplicate_names_are_an_error() {
        assert!(matches!(
            Fingerprint::of_json(&op("x"), br#"{"a":1,"a":2}"#),
            Err(Error::InvalidRequest(_))
        ));
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

    // The V2 format is frozen: these digests were taken before any change to
    // the canonicaliser, and a stored fingerprint must keep matching.
    #[test]
    fn v2_digests_are_frozen() {
        let cases: [(&[u8], &str); 4] = [
            (br#"{"b":[1,2.50,-0,1e3],"a":"x\u00e9\n"}"#, "024bd9c2370b1fcc003d50db20235e524749a1f3ffb30fc3acec0b926162655c"),
            ("{\"\u{e000}\":2,\"\u{1f600}\":1,\"z\":{\"y\":[true,false,null,{}],\"x\":[]}}".as_bytes(), "027e708bac034c93f4a218ae081344bc9e14eddf0f9714616ab70ee2b812a94d"),
            (br#"[9007199254740993, 0.30000000000000001, 12e-7, "\"\\\/\b\f\r\t\u001f"]"#, "023337c65266a178208d2558a3a829aaf868ada3a8c147f2c135d92da200e593"),
            (br#"{"account_id":9007199254740993,"currency":"EUR","items":[{"sku":"SKU-000001","quantity":2,"unit_price":"19.99"}]}"#, "02f455eeb642bc1005e7aee96d4021c67dd0b1b28cd0426219430dd59f0659f1"),
        ];
        for (json, want) in cases {
            let got = FingerprintBuilder::new(&op("POST /v1/orders"))
                .field("path", "/v1/orders")
                .field("query", "")
                .json(json)
                .unwrap()
                .finish();
            assert_eq!(got.to_hex(), want, "{}", String::from_utf8_lossy(json));
        }
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
