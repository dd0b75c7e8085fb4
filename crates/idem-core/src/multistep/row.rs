//! An operation as a store keeps it: the columns its statements select,
//! lock and order by, and one document with the rest, encoded and decoded
//! once for every store.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::deadletter::{Reconciliation, SentUnder, Verdict, VerdictSource};
use crate::error::{Error, Result};
use crate::fingerprint::Fingerprint;
use crate::key::IdempotencyKey;
use crate::scope::Scope;

use super::{Hold, HoldKind, Journal, JournalEntry, MultiStep, MultiStepState, OpenSend, SendVerdict};

/// An operation's stored values: the columns a store's statements use
/// (uniqueness, the due scan, the conditional write, the purge), and the
/// rest in [`document`](Self::document).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MultiStepRow {
    /// The store's id.
    pub id: i64,
    /// The scope's tenant.
    pub tenant: String,
    /// The scope's operation.
    pub operation: String,
    /// The key.
    pub idem_key: String,
    /// [`MultiStepState::as_str`].
    pub state: String,
    /// The row's version.
    pub version: i64,
    /// The token of its latest taker.
    pub token: i64,
    /// The recovery point: how many steps finished.
    pub step: i64,
    /// Until when a runner holds it.
    pub lease_until_ms: Option<i64>,
    /// Not to be taken before.
    pub not_before_ms: Option<i64>,
    /// When it last changed.
    pub updated_at_ms: i64,
    /// When a final operation may be purged.
    pub expires_at_ms: Option<i64>,
    /// Everything else: a format byte, then JSON.
    pub document: Vec<u8>,
}

/// The first byte of a document: its format.
const DOCUMENT_V1: u8 = 0x01;

#[derive(Serialize, Deserialize)]
struct Document {
    definition: String,
    fingerprint: String,
    input: String,
    journal: Vec<JournalEntry>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    open: Option<OpenDoc>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    hold: Option<HoldDoc>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    verdict: Option<VerdictDoc>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    failure: Option<serde_json::Value>,
    runs: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    response: Option<String>,
    ttl_ms: i64,
    created_at_ms: i64,
}

#[derive(Serialize, Deserialize)]
struct OpenDoc {
    step: String,
    first_sent_at_ms: i64,
    last_sent_at_ms: i64,
    sends: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    terms: Option<TermsDoc>,
}

#[derive(Serialize, Deserialize)]
struct TermsDoc {
    key_horizon_ms: u64,
    horizon_margin_ms: u64,
    settle_ms: u64,
}

#[derive(Serialize, Deserialize)]
struct HoldDoc {
    kind: String,
    note: String,
    at_ms: i64,
}

#[derive(Serialize, Deserialize)]
struct VerdictDoc {
    verdict: String,
    by: String,
    at_ms: i64,
    note: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    status: Option<u16>,
    body: String,
}

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

fn unhex(what: &str, s: &str) -> Result<Vec<u8>> {
    hex::decode(s).map_err(|e| Error::Corrupt(format!("operation {what}: {e}")))
}

impl From<&MultiStep> for MultiStepRow {
    fn from(op: &MultiStep) -> Self {
        let document = Document {
            definition: op.definition.clone(),
            fingerprint: hex::encode(op.fingerprint.as_bytes()),
            input: hex::encode(&op.input),
            journal: op.journal.entries().to_vec(),
            open: op.open.as_ref().map(|o| OpenDoc {
                step: o.step.clone(),
                first_sent_at_ms: o.first_sent_at_ms,
                last_sent_at_ms: o.last_sent_at_ms,
                sends: o.sends,
                terms: o.sent_under.map(|t| TermsDoc {
                    key_horizon_ms: ms(t.key_horizon),
                    horizon_margin_ms: ms(t.horizon_margin),
                    settle_ms: ms(t.settle),
                }),
            }),
            hold: op.hold.as_ref().map(|h| HoldDoc {
                kind: h.kind.as_str().to_owned(),
                note: h.note.clone(),
                at_ms: h.at_ms,
            }),
            verdict: op.verdict.as_ref().map(|v| VerdictDoc {
                verdict: v.reconciliation.verdict.as_str().to_owned(),
                by: v.reconciliation.by.as_str().to_owned(),
                at_ms: v.reconciliation.at_ms,
                note: v.reconciliation.note.clone(),
                status: v.status,
                body: hex::encode(&v.body),
            }),
            failure: op.failure.clone(),
            runs: op.runs,
            response: op.response.as_ref().map(hex::encode),
            ttl_ms: op.ttl_ms,
            created_at_ms: op.created_at_ms,
        };
        let mut bytes = vec![DOCUMENT_V1];
        serde_json::to_writer(&mut bytes, &document).expect("a document always serialises");
        Self {
            id: op.id,
            tenant: op.scope.tenant().as_str().to_owned(),
            operation: op.scope.operation().as_str().to_owned(),
            idem_key: op.key.as_str().to_owned(),
            state: op.state.as_str().to_owned(),
            version: op.version,
            token: op.token,
            step: op.journal.len() as i64,
            lease_until_ms: op.lease_until_ms,
            not_before_ms: op.not_before_ms,
            updated_at_ms: op.updated_at_ms,
            expires_at_ms: op.expires_at_ms,
            document: bytes,
        }
    }
}

impl MultiStepRow {
    /// The operation these values hold; a row that does not decode is
    /// [`Error::Corrupt`].
    pub fn decode(&self) -> Result<MultiStep> {
        let json = match self.document.split_first() {
            Some((&DOCUMENT_V1, json)) => json,
            _ => return Err(Error::Corrupt("operation document of an unknown format".into())),
        };
        let d: Document =
            serde_json::from_slice(json).map_err(|e| Error::Corrupt(format!("operation document: {e}")))?;
        let fingerprint: [u8; 32] = unhex("fingerprint", &d.fingerprint)?
            .try_into()
            .map_err(|_| Error::Corrupt("operation fingerprint is not 32 bytes".into()))?;
        let mut journal = Journal::new();
        for entry in d.journal {
            journal
                .push(entry)
                .map_err(|e| Error::Corrupt(format!("operation journal: {e}")))?;
        }
        let corrupt = |e: Error| Error::Corrupt(format!("operation row: {e}"));
        Ok(MultiStep {
            id: self.id,
            version: self.version,
            scope: Scope::parse(&self.tenant, &self.operation).map_err(corrupt)?,
            key: IdempotencyKey::new(self.idem_key.clone()).map_err(corrupt)?,
            definition: d.definition,
            fingerprint: Fingerprint::from_bytes(fingerprint),
            input: unhex("input", &d.input)?,
            state: MultiStepState::parse(&self.state)?,
            journal,
            open: d.open.map(|o| OpenSend {
                step: o.step,
                first_sent_at_ms: o.first_sent_at_ms,
                last_sent_at_ms: o.last_sent_at_ms,
                sends: o.sends,
                sent_under: o.terms.map(|t| SentUnder {
                    key_horizon: Duration::from_millis(t.key_horizon_ms),
                    horizon_margin: Duration::from_millis(t.horizon_margin_ms),
                    settle: Duration::from_millis(t.settle_ms),
                }),
            }),
            hold: d
                .hold
                .map(|h| {
                    Ok::<_, Error>(Hold {
                        kind: HoldKind::parse(&h.kind)?,
                        note: h.note,
                        at_ms: h.at_ms,
                    })
                })
                .transpose()?,
            verdict: d
                .verdict
                .map(|v| {
                    Ok::<_, Error>(SendVerdict {
                        reconciliation: Reconciliation {
                            verdict: Verdict::parse(&v.verdict).map_err(corrupt)?,
                            by: VerdictSource::parse(&v.by).map_err(corrupt)?,
                            at_ms: v.at_ms,
                            note: v.note,
                        },
                        status: v.status,
                        body: unhex("verdict body", &v.body)?,
                    })
                })
                .transpose()?,
            failure: d.failure,
            token: self.token,
            lease_until_ms: self.lease_until_ms,
            not_before_ms: self.not_before_ms,
            runs: d.runs,
            response: d.response.map(|r| unhex("response", &r)).transpose()?,
            ttl_ms: d.ttl_ms,
            created_at_ms: d.created_at_ms,
            updated_at_ms: self.updated_at_ms,
            expires_at_ms: self.expires_at_ms,
        })
    }
}
