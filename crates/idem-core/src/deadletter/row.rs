//! A dead letter's row in plain values, as every engine stores it.

use std::time::Duration;

use super::*;
use crate::error::StoreErrorKind;

/// A dead letter's row as a store reads it, in plain values: every engine
/// maps its column types to these, and [`decode`](Self::decode) checks and
/// builds the [`DeadLetter`] once for all of them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeadLetterRow {
    /// `id`.
    pub id: i64,
    /// `tenant`.
    pub tenant: String,
    /// `operation`.
    pub operation: String,
    /// `idem_key`.
    pub idem_key: String,
    /// `method`.
    pub method: String,
    /// `url`.
    pub url: String,
    /// `headers`: a JSON array of `[name, value]` pairs.
    pub headers: String,
    /// `body`.
    pub body: Vec<u8>,
    /// `attempts`.
    pub attempts: i64,
    /// `last_error`.
    pub last_error: String,
    /// `state`.
    pub state: String,
    /// `redrives`.
    pub redrives: i64,
    /// `created_at_ms`.
    pub created_at_ms: i64,
    /// `updated_at_ms`.
    pub updated_at_ms: i64,
    /// `redrive_until_ms`.
    pub redrive_until_ms: Option<i64>,
    /// `response_status`.
    pub response_status: Option<i64>,
    /// `response_body`.
    pub response_body: Option<Vec<u8>>,
    /// `first_reached_at_ms`.
    pub first_reached_at_ms: Option<i64>,
    /// `verdict`.
    pub verdict: Option<String>,
    /// `verdict_by`.
    pub verdict_by: Option<String>,
    /// `verdict_at_ms`.
    pub verdict_at_ms: Option<i64>,
    /// `verdict_note`.
    pub verdict_note: Option<String>,
    /// `key_horizon_ms` (with the next two: all set, or none).
    pub key_horizon_ms: Option<i64>,
    /// `horizon_margin_ms`.
    pub horizon_margin_ms: Option<i64>,
    /// `settle_ms`.
    pub settle_ms: Option<i64>,
}

impl DeadLetterRow {
    /// The row's values, as a store writes them.
    pub fn of(letter: &DeadLetter) -> Result<Self> {
        let r = letter.reconciliation.as_ref();
        Ok(Self {
            id: letter.id,
            tenant: letter.scope.tenant().as_str().to_owned(),
            operation: letter.scope.operation().as_str().to_owned(),
            idem_key: letter.key.as_str().to_owned(),
            method: letter.request.method().to_owned(),
            url: letter.request.url().to_owned(),
            headers: encode_headers(letter.request.headers())?,
            body: letter.request.body().to_vec(),
            attempts: i64::from(letter.attempts),
            last_error: clip_text(&letter.last_error).to_owned(),
            state: letter.state.as_str().to_owned(),
            redrives: i64::from(letter.redrives),
            created_at_ms: letter.created_at_ms,
            updated_at_ms: letter.updated_at_ms,
            redrive_until_ms: letter.redrive_until_ms,
            response_status: letter.response_status.map(i64::from),
            response_body: letter.response_body.as_deref().map(|b| clip_response(b).to_vec()),
            first_reached_at_ms: letter.first_reached_at_ms,
            verdict: r.map(|r| r.verdict.as_str().to_owned()),
            verdict_by: r.map(|r| r.by.as_str().to_owned()),
            verdict_at_ms: r.map(|r| r.at_ms),
            verdict_note: r.map(|r| clip_text(&r.note).to_owned()),
            key_horizon_ms: letter.sent_under.map(|t| SentUnder::millis(t.key_horizon)),
            horizon_margin_ms: letter.sent_under.map(|t| SentUnder::millis(t.horizon_margin)),
            settle_ms: letter.sent_under.map(|t| SentUnder::millis(t.settle)),
        })
    }

    /// The dead letter, every value checked.
    pub fn decode(self) -> Result<DeadLetter> {
        let id = self.id;
        let corrupt = |what: String| Error::store(StoreErrorKind::Other, format!("corrupt dead letter {id}: {what}"));
        let count = |name: &str, n: i64| u32::try_from(n).map_err(|_| corrupt(format!("{name} {n}")));
        let headers: Vec<(String, String)> =
            serde_json::from_str(&self.headers).map_err(|e| corrupt(format!("headers: {e}")))?;
        let request = OutboundRequest::stored(self.method, self.url, headers, self.body)
            .map_err(|e| corrupt(format!("request: {e}")))?;
        let reconciliation = match (self.verdict, self.verdict_by, self.verdict_at_ms) {
            (Some(verdict), Some(by), Some(at_ms)) => Some(Reconciliation {
                verdict: Verdict::parse(&verdict).map_err(|e| corrupt(e.to_string()))?,
                by: VerdictSource::parse(&by).map_err(|e| corrupt(e.to_string()))?,
                at_ms,
                note: self.verdict_note.unwrap_or_default(),
            }),
            (None, _, _) => None,
            _ => return Err(corrupt("a verdict without its source or time".into())),
        };
        let millis = |name: &str, ms: i64| {
            u64::try_from(ms)
                .map(Duration::from_millis)
                .map_err(|_| corrupt(format!("{name} {ms}")))
        };
        let sent_under = match (self.key_horizon_ms, self.horizon_margin_ms, self.settle_ms) {
            (Some(h), Some(m), Some(s)) => Some(SentUnder {
                key_horizon: millis("key horizon", h)?,
                horizon_margin: millis("horizon margin", m)?,
                settle: millis("settle time", s)?,
            }),
            (None, None, None) => None,
            _ => return Err(corrupt("send terms only in part".into())),
        };
        Ok(DeadLetter {
            id,
            scope: Scope::parse(&self.tenant, &self.operation).map_err(|e| corrupt(e.to_string()))?,
            key: IdempotencyKey::new(self.idem_key).map_err(|e| corrupt(e.to_string()))?,
            request,
            attempts: count("attempts", self.attempts)?,
            last_error: self.last_error,
            state: DeadLetterState::parse(&self.state).map_err(|e| corrupt(e.to_string()))?,
            redrives: count("redrives", self.redrives)?,
            created_at_ms: self.created_at_ms,
            updated_at_ms: self.updated_at_ms,
            redrive_until_ms: self.redrive_until_ms,
            response_status: self
                .response_status
                .map(|s| u16::try_from(s).map_err(|_| corrupt(format!("response status {s}"))))
                .transpose()?,
            response_body: self.response_body,
            first_reached_at_ms: self.first_reached_at_ms,
            reconciliation,
            sent_under,
        })
    }
}

/// Headers as stored: a JSON array of `[name, value]` pairs.
pub fn encode_headers(headers: &[(String, String)]) -> Result<String> {
    serde_json::to_string(headers).map_err(|e| Error::InvalidRequest(format!("headers cannot be stored: {e}")))
}
