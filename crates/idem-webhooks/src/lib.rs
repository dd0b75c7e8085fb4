//! Verification of incoming webhooks per the
//! [Standard Webhooks](https://www.standardwebhooks.com/) specification.
//!
//! The guide, with examples: `docs/events.md` in the repository.
//!
//! A provider signs `"{webhook-id}.{webhook-timestamp}.{body}"` with
//! HMAC-SHA256 under a shared secret and sends the base64 signature, prefixed
//! `v1,`, in `webhook-signature` (several, space-separated, while it rotates
//! its secret). A [`Verifier`] checks the headers, the timestamp against a
//! tolerance (a captured request replayed later is refused), and the
//! signature against each of its secrets, in constant time. Only a verified
//! webhook should reach its inbox, which then deduplicates it on its
//! `webhook-id`: that id stays the same across the provider's retries.
//!
//! ```
//! use idem_webhooks::{Verifier, sign};
//!
//! let secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
//! let verifier = Verifier::new([secret]).unwrap();
//! let body = br#"{"test": 2432232314}"#;
//! let signature = sign(secret, "msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, body).unwrap();
//! verifier
//!     .verify("msg_p5jXN8AQM9LWM0D4loKWxJek", "1614265330", &signature, body, 1614265330)
//!     .unwrap();
//! ```

use std::time::Duration;

mod inbox;
pub use inbox::{ReceiveError, Verified, WebhookInbox};

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use hmac::{KeyInit, Mac};
use http::HeaderMap;

type HmacSha256 = hmac::Hmac<sha2::Sha256>;

/// The header naming the webhook (the same on every retry).
pub const WEBHOOK_ID: &str = "webhook-id";
/// The header with the send time, in seconds since the Unix epoch.
pub const WEBHOOK_TIMESTAMP: &str = "webhook-timestamp";
/// The header with the signatures (`v1,<base64>`, space-separated).
pub const WEBHOOK_SIGNATURE: &str = "webhook-signature";

/// Svix's name for [`WEBHOOK_ID`], accepted as well.
pub const SVIX_ID: &str = "svix-id";
/// Svix's name for [`WEBHOOK_TIMESTAMP`], accepted as well.
pub const SVIX_TIMESTAMP: &str = "svix-timestamp";
/// Svix's name for [`WEBHOOK_SIGNATURE`], accepted as well.
pub const SVIX_SIGNATURE: &str = "svix-signature";

/// The default timestamp tolerance: five minutes either way, as the
/// specification recommends.
pub const DEFAULT_TOLERANCE: Duration = Duration::from_secs(300);

/// The longest `webhook-id` accepted.
pub const MAX_ID_LEN: usize = 255;
/// The longest `webhook-signature` header accepted.
pub const MAX_SIGNATURE_HEADER_LEN: usize = 4096;

/// Why a webhook was refused. Each says what was wrong without revealing
/// anything about the secrets.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WebhookError {
    /// A required header is missing, repeated or not text.
    #[error("the {0} header is missing or malformed")]
    Header(&'static str),
    /// `webhook-timestamp` is not a number of seconds.
    #[error("the webhook-timestamp header is not a Unix time in seconds")]
    Timestamp,
    /// The timestamp is outside the tolerance (a replayed or delayed request).
    #[error("the webhook timestamp is {skew_secs} s away from now, beyond the tolerance of {tolerance_secs} s")]
    Stale {
        /// How far the timestamp is from now, in seconds.
        skew_secs: u64,
        /// The tolerance, in seconds.
        tolerance_secs: u64,
    },
    /// No `v1` signature matches any secret.
    #[error("no webhook signature matches")]
    Signature,
    /// A secret is not valid base64 (with or without its `whsec_` prefix).
    #[error("a webhook secret is not valid base64")]
    Secret,
}

/// Verifies webhooks signed with any of its secrets.
#[derive(Clone)]
pub struct Verifier {
    keys: Vec<Vec<u8>>,
    tolerance: Duration,
}

impl std::fmt::Debug for Verifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Verifier")
            .field("secrets", &self.keys.len())
            .field("tolerance", &self.tolerance)
            .finish()
    }
}

fn decode_secret(secret: &str) -> Result<Vec<u8>, WebhookError> {
    let encoded = secret.strip_prefix("whsec_").unwrap_or(secret);
    match STANDARD.decode(encoded) {
        Ok(key) if !key.is_empty() => Ok(key),
        _ => Err(WebhookError::Secret),
    }
}

impl Verifier {
    /// A verifier accepting signatures made with any of `secrets` (the
    /// current one and, while a rotation is under way, the previous one).
    /// Secrets are base64, with or without the `whsec_` prefix. Fails if a
    /// secret is not valid base64 or none is given: a verifier with no
    /// secret would refuse everything, which is a misconfiguration.
    pub fn new<I, S>(secrets: I) -> Result<Self, WebhookError>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let keys = secrets
            .into_iter()
            .map(|s| decode_secret(s.as_ref()))
            .collect::<Result<Vec<_>, _>>()?;
        if keys.is_empty() {
            return Err(WebhookError::Secret);
        }
        Ok(Self {
            keys,
            tolerance: DEFAULT_TOLERANCE,
        })
    }

    /// Replaces the timestamp tolerance.
    pub fn with_tolerance(mut self, tolerance: Duration) -> Self {
        self.tolerance = tolerance;
        self
    }

    /// Verifies a webhook from its three header values and raw body, at
    /// `now_secs` (seconds since the Unix epoch).
    pub fn verify(
        &self,
        id: &str,
        timestamp: &str,
        signatures: &str,
        body: &[u8],
        now_secs: i64,
    ) -> Result<(), WebhookError> {
        if id.is_empty() || id.len() > MAX_ID_LEN || id.chars().any(char::is_control) {
            return Err(WebhookError::Header(WEBHOOK_ID));
        }
        if signatures.len() > MAX_SIGNATURE_HEADER_LEN {
            return Err(WebhookError::Header(WEBHOOK_SIGNATURE));
        }
        let sent: i64 = timestamp.trim().parse().map_err(|_| WebhookError::Timestamp)?;
        let skew = now_secs.abs_diff(sent);
        if skew > self.tolerance.as_secs() {
            return Err(WebhookError::Stale {
                skew_secs: skew,
                tolerance_secs: self.tolerance.as_secs(),
            });
        }
        let candidates: Vec<Vec<u8>> = signatures
            .split(' ')
            .filter_map(|s| s.strip_prefix("v1,"))
            .filter_map(|s| STANDARD.decode(s).ok())
            .collect();
        for key in &self.keys {
            for candidate in &candidates {
                let mut mac = HmacSha256::new_from_slice(key).map_err(|_| WebhookError::Secret)?;
                mac.update(id.as_bytes());
                mac.update(b".");
                mac.update(timestamp.trim().as_bytes());
                mac.update(b".");
                mac.update(body);
                if mac.verify_slice(candidate).is_ok() {
                    return Ok(());
                }
            }
        }
        Err(WebhookError::Signature)
    }

    /// Verifies a webhook from its request headers and raw body; answers its
    /// id, the key its inbox deduplicates on.
    ///
    /// The headers are read as one family: `webhook-id`, `webhook-timestamp`
    /// and `webhook-signature` (Standard Webhooks) if any of them is there,
    /// else Svix's `svix-id`, `svix-timestamp` and `svix-signature`; each
    /// must be there exactly once. The signed content is the same in both.
    pub fn verify_headers<'h>(
        &self,
        headers: &'h HeaderMap,
        body: &[u8],
        now_secs: i64,
    ) -> Result<&'h str, WebhookError> {
        let one = |name: &'static str| {
            let mut values = headers.get_all(name).iter();
            match (values.next(), values.next()) {
                (Some(value), None) => value.to_str().map_err(|_| WebhookError::Header(name)),
                _ => Err(WebhookError::Header(name)),
            }
        };
        let standard = [WEBHOOK_ID, WEBHOOK_TIMESTAMP, WEBHOOK_SIGNATURE];
        let svix = [SVIX_ID, SVIX_TIMESTAMP, SVIX_SIGNATURE];
        let [id, timestamp, signature] =
            if standard.iter().all(|n| !headers.contains_key(*n)) && svix.iter().any(|n| headers.contains_key(*n)) {
                svix
            } else {
                standard
            };
        let id = one(id)?;
        self.verify(id, one(timestamp)?, one(signature)?, body, now_secs)?;
        Ok(id)
    }
}

/// Signs a webhook as a provider would: `v1,` and the base64 HMAC-SHA256 of
/// `"{id}.{timestamp}.{body}"` under `secret`.
pub fn sign(secret: &str, id: &str, timestamp: i64, body: &[u8]) -> Result<String, WebhookError> {
    let key = decode_secret(secret)?;
    let mut mac = HmacSha256::new_from_slice(&key).map_err(|_| WebhookError::Secret)?;
    mac.update(format!("{id}.{timestamp}.").as_bytes());
    mac.update(body);
    Ok(format!("v1,{}", STANDARD.encode(mac.finalize().into_bytes())))
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
    const ID: &str = "msg_p5jXN8AQM9LWM0D4loKWxJek";
    const TS: i64 = 1614265330;
    const BODY: &[u8] = br#"{"test": 2432232314}"#;
    const EXPECTED: &str = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=";

    /// The specification's test vector under one family of header names
    /// (id, timestamp, signature).
    fn vector_headers([id, timestamp, signature]: [&'static str; 3]) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(id, ID.parse().unwrap());
        headers.insert(timestamp, "1614265330".parse().unwrap());
        headers.insert(signature, EXPECTED.parse().unwrap());
        headers
    }

    #[test]
    fn reproduces_the_specification_test_vector() {
        assert_eq!(sign(SECRET, ID, TS, BODY).unwrap(), EXPECTED);
        let verifier = Verifier::new([SECRET]).unwrap();
        verifier.verify(ID, "1614265330", EXPECTED, BODY, TS).unwrap();
    }

    #[test]
    fn the_whsec_prefix_is_optional() {
        let bare = SECRET.strip_prefix("whsec_").unwrap();
        Verifier::new([bare])
            .unwrap()
            .verify(ID, "1614265330", EXPECTED, BODY, TS)
            .unwrap();
    }

    #[test]
    fn tampering_is_refused() {
        let verifier = Verifier::new([SECRET]).unwrap();
        let refused = |id: &str, ts: &str, sig: &str, body: &[u8]| verifier.verify(id, ts, sig, body, TS);
        assert_eq!(
            refused(ID, "1614265330", EXPECTED, b"{\"test\": 1}"),
            Err(WebhookError::Signature)
        );
        assert_eq!(
            refused("msg_other", "1614265330", EXPECTED, BODY),
            Err(WebhookError::Signature)
        );
        let moved = sign(SECRET, ID, TS + 1, BODY).unwrap();
        assert_eq!(refused(ID, "1614265330", &moved, BODY), Err(WebhookError::Signature));
        assert_eq!(
            refused(
                ID,
                "1614265330",
                "v2,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=",
                BODY
            ),
            Err(WebhookError::Signature)
        );
        assert_eq!(
            refused(ID, "1614265330", "v1,not base64!", BODY),
            Err(WebhookError::Signature)
        );
        assert_eq!(refused(ID, "1614265330", "", BODY), Err(WebhookError::Signature));
        let other = Verifier::new(["whsec_dGhpcyBpcyBhbm90aGVyIHNlY3JldA=="]).unwrap();
        assert_eq!(
            other.verify(ID, "1614265330", EXPECTED, BODY, TS),
            Err(WebhookError::Signature)
        );
    }

    #[test]
    fn several_signatures_and_secrets_for_rotation() {
        let new_secret = "whsec_dGhpcyBpcyBhbm90aGVyIHNlY3JldA==";
        let by_new = sign(new_secret, ID, TS, BODY).unwrap();
        let header = format!("v1,bm9wZQ== {by_new} {EXPECTED}");
        Verifier::new([SECRET])
            .unwrap()
            .verify(ID, "1614265330", &header, BODY, TS)
            .unwrap();
        Verifier::new([new_secret])
            .unwrap()
            .verify(ID, "1614265330", &header, BODY, TS)
            .unwrap();
        let rotating = Verifier::new([new_secret, SECRET]).unwrap();
        rotating.verify(ID, "1614265330", EXPECTED, BODY, TS).unwrap();
        rotating.verify(ID, "1614265330", &by_new, BODY, TS).unwrap();
    }

    #[test]
    fn stale_and_future_timestamps_are_refused() {
        let verifier = Verifier::new([SECRET]).unwrap();
        verifier.verify(ID, "1614265330", EXPECTED, BODY, TS + 300).unwrap();
        verifier.verify(ID, "1614265330", EXPECTED, BODY, TS - 300).unwrap();
        assert_eq!(
            verifier.verify(ID, "1614265330", EXPECTED, BODY, TS + 301),
            Err(WebhookError::Stale {
                skew_secs: 301,
                tolerance_secs: 300
            })
        );
        assert!(matches!(
            verifier.verify(ID, "1614265330", EXPECTED, BODY, TS - 3600),
            Err(WebhookError::Stale { .. })
        ));
        let strict = verifier.with_tolerance(Duration::from_secs(10));
        assert!(matches!(
            strict.verify(ID, "1614265330", EXPECTED, BODY, TS + 11),
            Err(WebhookError::Stale { .. })
        ));
        assert_eq!(
            Verifier::new([SECRET]).unwrap().verify(ID, "soon", EXPECTED, BODY, TS),
            Err(WebhookError::Timestamp)
        );
    }

    #[test]
    fn headers_are_read_once_each() {
        let verifier = Verifier::new([SECRET]).unwrap();
        let mut headers = vector_headers([WEBHOOK_ID, WEBHOOK_TIMESTAMP, WEBHOOK_SIGNATURE]);
        assert_eq!(verifier.verify_headers(&headers, BODY, TS), Ok(ID));
        headers.append(WEBHOOK_ID, "msg_second".parse().unwrap());
        assert_eq!(
            verifier.verify_headers(&headers, BODY, TS),
            Err(WebhookError::Header(WEBHOOK_ID))
        );
        headers.remove(WEBHOOK_ID);
        assert_eq!(
            verifier.verify_headers(&headers, BODY, TS),
            Err(WebhookError::Header(WEBHOOK_ID))
        );
        headers.insert(WEBHOOK_ID, "x".repeat(MAX_ID_LEN + 1).parse().unwrap());
        assert_eq!(
            verifier.verify_headers(&headers, BODY, TS),
            Err(WebhookError::Header(WEBHOOK_ID))
        );
    }

    /// Svix's header names carry the same signed content: the
    /// specification's test vector verifies under them, a mixed or
    /// repeated family is refused naming the header.
    #[test]
    fn svix_header_names_are_accepted_too() {
        let verifier = Verifier::new([SECRET]).unwrap();
        let headers = vector_headers([SVIX_ID, SVIX_TIMESTAMP, SVIX_SIGNATURE]);
        assert_eq!(verifier.verify_headers(&headers, BODY, TS), Ok(ID));
        assert_eq!(
            verifier.verify_headers(&headers, b"{\"test\": 1}", TS),
            Err(WebhookError::Signature)
        );
        let mut repeated = headers.clone();
        repeated.append(SVIX_SIGNATURE, EXPECTED.parse().unwrap());
        assert_eq!(
            verifier.verify_headers(&repeated, BODY, TS),
            Err(WebhookError::Header(SVIX_SIGNATURE))
        );
        let mut partial = headers.clone();
        partial.remove(SVIX_TIMESTAMP);
        assert_eq!(
            verifier.verify_headers(&partial, BODY, TS),
            Err(WebhookError::Header(SVIX_TIMESTAMP))
        );
        // A family is taken whole: a standard id does not borrow Svix's signature.
        let mut mixed = headers.clone();
        mixed.insert(WEBHOOK_ID, ID.parse().unwrap());
        assert_eq!(
            verifier.verify_headers(&mixed, BODY, TS),
            Err(WebhookError::Header(WEBHOOK_TIMESTAMP))
        );
        assert_eq!(
            verifier.verify_headers(&HeaderMap::new(), BODY, TS),
            Err(WebhookError::Header(WEBHOOK_ID))
        );
    }

    #[test]
    fn bad_secrets_fail_closed() {
        assert_eq!(Verifier::new(["whsec_***"]).err(), Some(WebhookError::Secret));
        assert_eq!(Verifier::new(Vec::<String>::new()).err(), Some(WebhookError::Secret));
        assert_eq!(Verifier::new(["whsec_"]).err(), Some(WebhookError::Secret));
        assert_eq!(sign("***", ID, TS, BODY), Err(WebhookError::Secret));
    }
}
