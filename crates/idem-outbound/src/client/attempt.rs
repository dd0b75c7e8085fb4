//! One attempt over HTTP: the request prepared once for all attempts, sent
//! through the host's breaker within its timeout, and its answer read
//! (bounded) and classified.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use idem_core::{IdempotencyKey, OutboundRequest};
use reqwest::header::{self, HeaderMap, HeaderName, HeaderValue};

use super::failure::Failure;
#[cfg(feature = "tls")]
use super::target::host_of;
use super::target::parse_target;
use super::{OutboundClient, OutboundResponse};
use crate::breaker::Admission;
use crate::error::{OutboundError, Result};
use crate::retry_after::parse_retry_after;

/// Request headers never copied from a stored request: the connection's
/// own (the client sets them for each attempt).
const FRAMING_HEADERS: [&str; 9] = [
    "host",
    "content-length",
    "transfer-encoding",
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "upgrade",
];

impl OutboundClient {
    /// The request as reqwest sends it, checked once for all attempts.
    pub(super) fn prepare(&self, key: &IdempotencyKey, request: &OutboundRequest) -> Result<reqwest::Request> {
        let invalid = |why: String| OutboundError::Invalid(why);
        let url = parse_target(request.url(), self.inner.tls)?;
        let method = reqwest::Method::from_bytes(request.method().as_bytes())
            .map_err(|_| invalid(format!("invalid method {:?}", request.method())))?;
        let key_header = &self.inner.config.key_header;
        let mut headers = HeaderMap::new();
        for (name, value) in request.headers() {
            let name = HeaderName::from_bytes(name.as_bytes())
                .map_err(|_| invalid(format!("invalid header name {name:?}")))?;
            if name == *key_header || FRAMING_HEADERS.contains(&name.as_str()) {
                continue;
            }
            let value = HeaderValue::from_bytes(value.as_bytes())
                .map_err(|_| invalid(format!("invalid value of header {name}")))?;
            headers.append(name, value);
        }
        // Secret headers come from the configuration, never from storage.
        for (name, value) in &self.inner.config.secret_headers {
            headers.insert(name.clone(), value.clone());
        }
        let key_value =
            HeaderValue::from_str(key.as_str()).map_err(|_| invalid("the key is not a valid header value".into()))?;
        headers.insert(key_header.clone(), key_value);
        self.inner
            .http
            .request(method, url)
            .headers(headers)
            .body(request.body().to_vec())
            .build()
            .map_err(|e| invalid(error_chain(&e)))
    }

    /// One attempt: through the breaker, bounded by `timeout`, classified.
    pub(super) async fn attempt(
        &self,
        prepared: &reqwest::Request,
        host: &Arc<str>,
        host_label: &str,
        timeout: Duration,
    ) -> Result<OutboundResponse, Failure> {
        let labels = &self.inner.labels;
        let Some(request) = prepared.try_clone() else {
            return Err(Failure::Invalid("the request body cannot be sent twice".into()));
        };
        let permit = match self.inner.breakers.admit(host) {
            Admission::Allowed(permit) => permit,
            Admission::Refused { state, retry_in } => {
                labels.attempt(host_label, "circuit_open");
                return Err(Failure::CircuitOpen {
                    host: host.clone(),
                    state,
                    retry_in,
                });
            }
        };
        let result = tokio::time::timeout(timeout, self.exchange(request))
            .await
            .unwrap_or(Err(Failure::Timeout(Some(timeout))));
        let (outcome, healthy) = match &result {
            Ok(_) => ("success", true),
            Err(failure) => failure.outcome(),
        };
        if matches!(result, Err(Failure::Invalid(_) | Failure::Status { status: 429, .. })) {
            // Says nothing of the host's health (a 429 is its flow control,
            // not a failure, nor a sign it works): no count moves, and a
            // probe hands its turn on.
            drop(permit);
        } else {
            permit.finish(healthy);
        }
        labels.attempt(host_label, outcome);
        tracing::debug!(outcome, "outbound attempt");
        result
    }

    /// Sends one request and reads its answer (the body bounded).
    async fn exchange(&self, request: reqwest::Request) -> Result<OutboundResponse, Failure> {
        let mut response = self.inner.http.execute(request).await.map_err(|e| {
            if e.is_builder() {
                Failure::Invalid(error_chain(&e))
            } else if e.is_connect() {
                Failure::Connect(error_chain(&e))
            } else if e.is_timeout() {
                Failure::Timeout(None)
            } else {
                Failure::Network(error_chain(&e))
            }
        })?;
        let status = response.status().as_u16();
        let headers = std::mem::take(response.headers_mut());
        let max = self.inner.config.max_response_body;
        let mut body = Vec::new();
        let mut body_truncated = false;
        loop {
            let chunk = response.chunk().await.map_err(|e| {
                if e.is_timeout() {
                    Failure::Timeout(None)
                } else {
                    Failure::Network(format!("the response body was cut off: {}", error_chain(&e)))
                }
            })?;
            let Some(chunk) = chunk else { break };
            let room = max - body.len();
            if chunk.len() > room {
                body.extend_from_slice(&chunk[..room]);
                body_truncated = true;
                break;
            }
            body.extend_from_slice(&chunk);
        }
        if (200..300).contains(&status) {
            return Ok(OutboundResponse {
                status,
                headers,
                body,
                body_truncated,
                attempts: 0,
                reconciled: false,
            });
        }
        let retry_after = match status {
            409 | 429 | 503 => headers
                .get(header::RETRY_AFTER)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| parse_retry_after(v, SystemTime::now())),
            _ => None,
        };
        let in_flight = status == 409 && says_in_flight(&body, &self.inner.config.in_flight_codes);
        Err(Failure::Status {
            status,
            body,
            retry_after,
            in_flight,
        })
    }
}

/// Whether a 409's JSON body says the key is still being processed: a
/// string value of `code`, `type` or `message` (at the top level or under
/// `error`) that is one of `codes`, ends in `/code`, or starts with
/// `code:` or `code ` — how Stripe (`idempotency_key_in_use`) and the
/// Idempotency-Key draft (a problem type ending in
/// `idempotency-key-in-flight`) say it. A body that is not JSON says
/// nothing.
pub(crate) fn says_in_flight(body: &[u8], codes: &[String]) -> bool {
    let Ok(value) = serde_json::from_slice::<serde_json::Value>(body) else {
        return false;
    };
    let matches = |text: &str| {
        codes.iter().any(|code| {
            text == code
                || text.ends_with(&format!("/{code}"))
                || text.starts_with(&format!("{code}:"))
                || text.starts_with(&format!("{code} "))
        })
    };
    [&value, &value["error"]].iter().any(|v| {
        ["code", "type", "message"]
            .iter()
            .filter_map(|field| v.get(field).and_then(serde_json::Value::as_str))
            .any(matches)
    })
}

/// An error and its sources, on one line; a failed TLS handshake is said
/// as such, with the URL it was for and rustls's reason.
fn error_chain(e: &reqwest::Error) -> String {
    #[cfg(feature = "tls")]
    if let Some(failed) = idem_tls::handshake_failure(e) {
        return match e.url() {
            Some(url) => format!("{}: {failed}", host_of(url).unwrap_or_else(|_| url.to_string())),
            None => failed,
        };
    }
    source_chain(e)
}

/// An error and its sources, on one line.
fn source_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let part = s.to_string();
        if !text.contains(&part) {
            text.push_str(": ");
            text.push_str(&part);
        }
        source = s.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::OutboundConfig;

    /// Proves a 409 is recognised as "still being processed" by Stripe's code and the draft's problem type, and nothing else.
    #[test]
    fn in_flight_409_bodies_are_recognised() {
        let codes = OutboundConfig::default().in_flight_codes;
        for yes in [
            r#"{"error":{"type":"idempotency_error","code":"idempotency_key_in_use","message":"x"}}"#,
            r#"{"error":{"type":"idempotency_error","message":"idempotency_key_in_use: retry later"}}"#,
            r#"{"type":"https://idem.dev/problems/idempotency-key-in-flight","status":409}"#,
        ] {
            assert!(says_in_flight(yes.as_bytes(), &codes), "{yes}");
        }
        for no in [
            r#"{"error":{"type":"invalid_request_error","code":"resource_already_exists"}}"#,
            r#"{"message":"not_idempotency_key_in_use"}"#,
            "idempotency_key_in_use",
            "",
        ] {
            assert!(!says_in_flight(no.as_bytes(), &codes), "{no}");
        }
    }
}
