//! `Retry-After` (RFC 9110 §10.2.3): delta-seconds or an HTTP-date.

use std::time::{Duration, SystemTime};

/// The longest `Retry-After` taken as given (one day); larger values are
/// cut to it (the call's deadline cuts them much earlier anyway).
pub const MAX_RETRY_AFTER: Duration = Duration::from_secs(24 * 3600);

/// How long a `Retry-After` value asks to wait, seen at `now`: delta-seconds
/// (`"120"`) or an HTTP-date (`"Sun, 06 Nov 1994 08:49:37 GMT"`, and the
/// obsolete RFC 850 and asctime forms). A date in the past means no wait.
/// `None` for anything else (the retry schedule applies unchanged).
///
/// ```
/// use std::time::{Duration, SystemTime};
/// use idem_outbound::parse_retry_after;
/// let now = SystemTime::UNIX_EPOCH + Duration::from_secs(784_111_777); // 06 Nov 1994 08:49:37
/// assert_eq!(parse_retry_after("120", now), Some(Duration::from_secs(120)));
/// assert_eq!(parse_retry_after("Sun, 06 Nov 1994 08:50:37 GMT", now), Some(Duration::from_secs(60)));
/// assert_eq!(parse_retry_after("soon", now), None);
/// ```
pub fn parse_retry_after(value: &str, now: SystemTime) -> Option<Duration> {
    let value = value.trim();
    if !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit()) {
        // Too many digits for a u64 is still "a very long time".
        let secs = value.parse::<u64>().unwrap_or(u64::MAX);
        return Some(Duration::from_secs(secs).min(MAX_RETRY_AFTER));
    }
    let at = httpdate::parse_http_date(value).ok()?;
    Some(at.duration_since(now).unwrap_or(Duration::ZERO).min(MAX_RETRY_AFTER))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_forms_are_understood() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(784_111_777);
        assert_eq!(parse_retry_after("0", now), Some(Duration::ZERO));
        assert_eq!(parse_retry_after(" 7 ", now), Some(Duration::from_secs(7)));
        assert_eq!(parse_retry_after("99999999999999999999999", now), Some(MAX_RETRY_AFTER));
        assert_eq!(
            parse_retry_after("Sun, 06 Nov 1994 08:49:47 GMT", now),
            Some(Duration::from_secs(10))
        );
        assert_eq!(
            parse_retry_after("Sunday, 06-Nov-94 08:49:47 GMT", now),
            Some(Duration::from_secs(10))
        );
        assert_eq!(
            parse_retry_after("Sun Nov  6 08:49:47 1994", now),
            Some(Duration::from_secs(10))
        );
        // A date already past: retry on the schedule, no extra wait.
        assert_eq!(
            parse_retry_after("Sun, 06 Nov 1994 08:00:00 GMT", now),
            Some(Duration::ZERO)
        );
        for junk in ["", "-1", "1.5", "soon", "Sun, 32 Nov 1994 08:49:37 GMT"] {
            assert_eq!(parse_retry_after(junk, now), None, "{junk}");
        }
    }
}
