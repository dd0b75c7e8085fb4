//! The vendor's side of a payout: the call, what its answer must hold,
//! and the lookup by reference that asks the vendor whether it paid.

use std::sync::Arc;
use std::time::Duration;

use idem_core::{Error as IdemError, OutboundRequest};
use idem_outbound::Reconciled;

use super::lookup::{ByReference, Vendor};
use crate::db::{DbError, PayoutTask};

/// The vendor call of a payout: `POST {vendor}/v1/payouts` with the amount
/// and the payout id as the reference.
pub fn vendor_request(vendor_url: &str, task: &PayoutTask) -> Result<OutboundRequest, DbError> {
    let body = serde_json::to_vec(&serde_json::json!({ "amount": task.amount, "reference": task.id }))
        .map_err(|e| DbError::Idem(IdemError::Encode(e.to_string())))?;
    Ok(OutboundRequest::new(
        "POST",
        format!("{vendor_url}/v1/payouts"),
        vec![("content-type".to_owned(), "application/json".to_owned())],
        body,
    )?)
}

/// What the vendor's success answer promises, checked against the payout:
/// a JSON object with the vendor's `id` (1 to 200 bytes without control
/// characters, storable on every engine), the payout's `amount` and its
/// id as `reference`. Answers the vendor's id.
pub fn check_answer(task: &PayoutTask, body: &[u8]) -> Result<Option<String>, String> {
    check_promise(task.amount, &task.id, body)
}

/// [`check_answer`] for a redrive (`idem_outbound::Redriver::with_answer_check`):
/// the amount and reference are the ones the request sent. A redrive's 2xx
/// that is not the payout (`200 {"error": …}`) then holds the dead letter
/// as unknown, for `idem dlq resolve`, instead of resolving it.
pub fn answer_check() -> idem_outbound::AnswerCheck {
    Arc::new(|request: &OutboundRequest, body: &[u8]| {
        let sent: serde_json::Value =
            serde_json::from_slice(request.body()).map_err(|e| format!("the request is not JSON: {e}"))?;
        let (Some(amount), Some(reference)) = (sent["amount"].as_i64(), sent["reference"].as_str()) else {
            return Err("the request has no amount or reference to check the answer against".into());
        };
        check_promise(amount, reference, body).map(|_| ())
    })
}

/// What a payout vendor's success answer promises for a payment of
/// `amount` under `reference` (see [`check_answer`]): the vendor's id, if
/// storable.
pub(crate) fn check_promise(amount: i64, reference: &str, body: &[u8]) -> Result<Option<String>, String> {
    let value: serde_json::Value = serde_json::from_slice(body).map_err(|e| format!("not a JSON object ({e})"))?;
    if !value.is_object() {
        return Err("not a JSON object".into());
    }
    if value.get("amount").and_then(serde_json::Value::as_i64) != Some(amount) {
        return Err(format!("its amount is {}, not {amount}", value["amount"]));
    }
    if value.get("reference").and_then(serde_json::Value::as_str) != Some(reference) {
        return Err(format!("its reference is {}, not {reference}", value["reference"]));
    }
    match value.get("id").and_then(serde_json::Value::as_str) {
        None | Some("") => Err("it has no vendor id".into()),
        // An id the database cannot store (a NUL) does not keep a paid
        // payout requested, called again on every pass: paid, without it.
        Some(_) => Ok(vendor_payout_id(body)),
    }
}

/// The vendor's id in its answer (`{"id": …}`), if it has one that every
/// engine can store: 1 to 200 bytes without control characters (PostgreSQL
/// refuses a NUL, and a payout whose result cannot be stored would stay
/// requested and be sent again on every pass).
pub(super) fn vendor_payout_id(body: &[u8]) -> Option<String> {
    let value: serde_json::Value = serde_json::from_slice(body).ok()?;
    let id = value.get("id")?.as_str()?;
    (!id.is_empty() && id.len() <= 200 && !id.chars().any(char::is_control)).then(|| id.to_owned())
}

crate::payouts::by_reference_hook! {
    /// The ledger's reconcile hook: asks the vendor for its record of a payout,
    /// by the payout id it was sent as `reference` —
    /// `GET {vendor}/v1/payouts?reference={payout id}`, answering `{"data":
    /// [{"id", "amount", "reference", "status"}, …]}`.
    ///
    /// - one record `paid`, for the payout's amount → applied (its record is
    ///   the answer; nothing is sent);
    /// - none → not applied (the vendor keeps every payout it made, forever);
    /// - a request still `processing` → in flight (asked again later);
    /// - several paid, or a record that does not match → unknown.
    VendorLookup: Vendor::Payouts;
    /// The lookup of the vendor at `vendor_url`.
    new(vendor_url) -> DbError = |why| DbError::Idem(IdemError::Config(why));
}

impl VendorLookup {
    async fn ask(&self, request: &OutboundRequest, timeout: Duration) -> Result<Reconciled, String> {
        let sent = ByReference::sent(request)?;
        let (Some(reference), Some(amount)) = (sent["reference"].as_str(), sent["amount"].as_i64()) else {
            return Ok(Reconciled::Unknown(
                "the request has no reference or amount to look up".into(),
            ));
        };
        let decide = |data: &[&serde_json::Value]| {
            let paid: Vec<&serde_json::Value> = data.iter().copied().filter(|p| p["status"] == "paid").collect();
            Ok(match paid.as_slice() {
                [one] if one["amount"].as_i64() == Some(amount) => Reconciled::Applied {
                    status: 201,
                    body: serde_json::to_vec(one).map_err(|e| e.to_string())?,
                },
                [one] => Reconciled::Unknown(format!(
                    "the vendor paid reference {reference} for {}, not {amount}",
                    one["amount"]
                )),
                [] if data.iter().any(|p| p["status"] == "processing") => Reconciled::InFlight,
                [] if data.is_empty() => Reconciled::NotApplied,
                [] => Reconciled::Unknown(format!("the vendor's records of {reference} are in no known state")),
                many => Reconciled::Unknown(format!("the vendor paid reference {reference} {} times", many.len())),
            })
        };
        self.lookup.ask(reference, timeout, decide).await
    }
}
