//! Request bodies and the validation of what they hold: JSON objects of an
//! exact shape, amounts read exactly, account ids.

use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::de::DeserializeOwned;

use super::problem::{ApiError, problem, unsupported_media_type};
use crate::db::MAX_AMOUNT;

/// A JSON body that must match `T` exactly: a JSON object (never an array
/// in field order) with no unknown fields, sent as `application/json` (or a
/// `+json` type). A body of another media type is a 415 problem with
/// `Accept-Post: application/json`; any other mismatch is a 400 problem.
/// Either way nothing is written.
pub struct JsonBody<T>(pub T);

/// The media type of a body (its `Content-Type` without parameters),
/// lower-cased.
pub(super) fn media_type(headers: &HeaderMap) -> Option<String> {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(|v| v.split(';').next().unwrap_or("").trim().to_ascii_lowercase())
}

/// Whether the request says its body is JSON.
fn is_json(req: &Request) -> bool {
    media_type(req.headers())
        .is_some_and(|v| v == "application/json" || (v.starts_with("application/") && v.ends_with("+json")))
}

/// `bytes` read as a `T` written as a JSON object; the error says why, and
/// calls the body `what`.
pub(super) fn json_object<T: DeserializeOwned>(bytes: &[u8], what: &str) -> Result<T, String> {
    // Serde accepts a struct written as an array of its fields; the
    // contract is an object.
    if bytes.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        return Err(format!("the {what} must be a JSON object"));
    }
    serde_json::from_slice(bytes).map_err(|e| format!("invalid JSON body: {e}"))
}

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for JsonBody<T> {
    type Rejection = Response;

    async fn from_request(req: Request, state: &S) -> Result<Self, Response> {
        if !is_json(&req) {
            return Err(unsupported_media_type(
                "the request body must be JSON, sent with Content-Type: application/json",
            ));
        }
        let bytes = Bytes::from_request(req, state)
            .await
            .map_err(IntoResponse::into_response)?;
        json_object(&bytes, "request body").map(JsonBody).map_err(|detail| {
            problem(
                StatusCode::BAD_REQUEST,
                "invalid-request",
                "Invalid request body",
                detail,
            )
        })
    }
}

/// An amount of one operation: a positive number of minor units, at most
/// [`MAX_AMOUNT`].
pub(super) fn amount(value: i64) -> Result<i64, ApiError> {
    if value <= 0 {
        return Err(ApiError::Amount(format!(
            "amount must be a positive integer of minor units, got {value}"
        )));
    }
    if value > MAX_AMOUNT {
        return Err(ApiError::Amount(format!(
            "amount must be at most {MAX_AMOUNT}, got {value}"
        )));
    }
    Ok(value)
}

/// A JSON number read exactly, never through `f64`: `5`, `5.0`, `5e0` and
/// `50e-1` are all 5 (JSON Schema's `integer`), but
/// `4.9999999999999999999`, `5.000000000000000000001` and
/// `999999999999.99999` are not whole numbers and are refused (a float
/// would round each to a whole one). Whole numbers beyond `i64` saturate,
/// so the amount's range check names them; strings and the like are type
/// errors.
pub(super) fn whole_number<'de, D: serde::Deserializer<'de>>(d: D) -> Result<i64, D::Error> {
    use serde::Deserialize as _;
    let raw = Box::<serde_json::value::RawValue>::deserialize(d)?;
    exact_integer(raw.get()).map_err(serde::de::Error::custom)
}

/// The whole number a JSON number token spells exactly (see
/// [`whole_number`]); saturated to `i64`.
fn exact_integer(token: &str) -> Result<i64, String> {
    let not_whole = || format!("{token} is not a whole number");
    let bytes = token.as_bytes();
    let (negative, rest) = match bytes.first() {
        Some(b'-') => (true, &token[1..]),
        Some(b'0'..=b'9') => (false, token),
        _ => return Err(format!("{token} is not a number")),
    };
    let (mantissa, exponent) = match rest.find(['e', 'E']) {
        Some(i) => (&rest[..i], Some(&rest[i + 1..])),
        None => (rest, None),
    };
    let (int, frac) = match mantissa.split_once('.') {
        Some((i, f)) => (i, f),
        None => (mantissa, ""),
    };
    if int.is_empty() || !int.bytes().all(|b| b.is_ascii_digit()) || !frac.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!("{token} is not a number"));
    }
    // The exponent, bounded: past 10^6 digits any non-zero number is out
    // of range (or not whole) anyway.
    let exp: i64 = match exponent {
        None => 0,
        Some(e) => {
            let (sign, digits) = match e.as_bytes().first() {
                Some(b'-') => (-1, &e[1..]),
                Some(b'+') => (1, &e[1..]),
                _ => (1, e),
            };
            if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
                return Err(format!("{token} is not a number"));
            }
            let digits = digits.trim_start_matches('0');
            if digits.len() > 7 {
                sign * 10_000_000
            } else {
                sign * digits.parse::<i64>().unwrap_or(0)
            }
        }
    };
    // digits × 10^(exp − frac digits), with the significant digits only.
    let all = format!("{int}{frac}");
    let all = all.trim_start_matches('0');
    if all.is_empty() {
        return Ok(0);
    }
    let trailing = all.len() - all.trim_end_matches('0').len();
    let digits = all.trim_end_matches('0');
    let scale = exp - frac.len() as i64 + trailing as i64;
    if scale < 0 {
        return Err(not_whole());
    }
    let magnitude = if scale > 19 || digits.len() as i64 + scale > 19 {
        None
    } else {
        digits
            .parse::<i64>()
            .ok()
            .and_then(|d| 10i64.checked_pow(scale as u32).and_then(|p| d.checked_mul(p)))
    };
    Ok(match (magnitude, negative) {
        (Some(m), false) => m,
        (Some(m), true) => -m,
        (None, false) => i64::MAX,
        (None, true) => i64::MIN,
    })
}

/// Account ids are canonical lower-case UUIDs.
pub(super) fn account_id(field: &str, id: &str) -> Result<(), ApiError> {
    let ok = id.len() == 36
        && id.char_indices().all(|(i, c)| match i {
            8 | 13 | 18 | 23 => c == '-',
            _ => c.is_ascii_digit() || ('a'..='f').contains(&c),
        });
    if ok {
        Ok(())
    } else {
        Err(ApiError::Invalid(format!("{field} is not an account id")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Amounts are read exactly: whole numbers in any spelling pass, fractions that a float would round are refused.
    #[test]
    fn amounts_are_parsed_exactly() {
        for (token, want) in [
            ("5", 5),
            ("5.0", 5),
            ("5e0", 5),
            ("50e-1", 5),
            ("0.5e1", 5),
            ("-5", -5),
            ("1000000000000", 1_000_000_000_000),
            ("1e12", 1_000_000_000_000),
            ("0", 0),
            ("0.000e5", 0),
            ("99999999999999999999", i64::MAX),
            ("1e400", i64::MAX),
            ("-1e400", i64::MIN),
            ("1e99999999999999999999", i64::MAX),
        ] {
            assert_eq!(exact_integer(token), Ok(want), "{token}");
        }
        for token in [
            "4.9999999999999999999",
            "5.000000000000000000001",
            "999999999999.99999",
            "1.5",
            "5e-1",
            "1e-99999999999999999999",
            "\"5\"",
            "true",
            "",
        ] {
            assert!(exact_integer(token).is_err(), "{token}");
        }
    }
}
