//! The FX vendor's side of a withdrawal: the quote request, what its answer
//! must hold, the release of a quote, and the lookup by reference that asks
//! the vendor whether it booked one.

use std::time::Duration;

use idem_core::{Error as IdemError, OutboundRequest};
use idem_outbound::Reconciled;
use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::payouts::{ByReference, Vendor};

/// A booked quote: the `fx-quote` step's output.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Quote {
    /// The vendor's id of the quote.
    pub(crate) quote_id: String,
    /// The rate, an exact decimal.
    pub(crate) rate: String,
    /// Minor units of the payout currency.
    pub(crate) amount_out: i64,
}

/// The request of a quote: `POST {fx}/v1/quotes` with the withdrawal id as
/// its reference.
pub(crate) fn quote_request(
    fx_url: &str,
    reference: &str,
    from: &str,
    to: &str,
    amount: i64,
) -> Result<OutboundRequest, IdemError> {
    let body = json!({ "reference": reference, "from": from, "to": to, "amount": amount });
    OutboundRequest::new(
        "POST",
        format!("{fx_url}/v1/quotes"),
        vec![("content-type".to_owned(), "application/json".to_owned())],
        serde_json::to_vec(&body).map_err(|e| IdemError::Encode(e.to_string()))?,
    )
}

/// The release of a booked quote: `POST {fx}/v1/quotes/{id}/cancel`.
pub(crate) fn release_request(fx_url: &str, quote_id: &str) -> Result<OutboundRequest, IdemError> {
    // The id was checked when the quote was recorded (see [`check_quote`]):
    // it is safe in a path segment.
    OutboundRequest::new(
        "POST",
        format!("{fx_url}/v1/quotes/{quote_id}/cancel"),
        vec![],
        Vec::new(),
    )
}

/// Whether `id` is a vendor id every engine stores and a URL path carries
/// as it is: 1 to 200 ASCII letters, digits, `_` or `-`.
fn plain_id(id: &str) -> bool {
    !id.is_empty() && id.len() <= 200 && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// What the vendor's quote promises, checked against the request: a JSON
/// object with a plain `id`, this `reference`, pair and `amount`, a decimal
/// `rate` and a positive `amount_out`. The quote, or why the answer breaks
/// the contract.
pub(crate) fn check_quote(reference: &str, from: &str, to: &str, amount: i64, body: &[u8]) -> Result<Quote, String> {
    let v: serde_json::Value = serde_json::from_slice(body).map_err(|e| format!("not a JSON object ({e})"))?;
    if !v.is_object() {
        return Err("not a JSON object".into());
    }
    let text = |name: &str| v.get(name).and_then(serde_json::Value::as_str);
    if text("reference") != Some(reference) {
        return Err(format!("its reference is {}, not {reference}", v["reference"]));
    }
    if text("from") != Some(from) || text("to") != Some(to) {
        return Err(format!("it quotes {} to {}, not {from} to {to}", v["from"], v["to"]));
    }
    if v.get("amount").and_then(serde_json::Value::as_i64) != Some(amount) {
        return Err(format!("its amount is {}, not {amount}", v["amount"]));
    }
    let Some(id) = text("id").filter(|id| plain_id(id)) else {
        return Err(format!("its id {} is not a plain vendor id", v["id"]));
    };
    let Some(rate) = text("rate").filter(|r| {
        r.len() <= 40
            && r.split_once('.')
                .map_or(!r.is_empty(), |(i, f)| !i.is_empty() && !f.is_empty())
            && r.bytes().all(|b| b.is_ascii_digit() || b == b'.')
    }) else {
        return Err(format!("its rate {} is not a decimal", v["rate"]));
    };
    let Some(amount_out) = v
        .get("amount_out")
        .and_then(serde_json::Value::as_i64)
        .filter(|a| *a > 0)
    else {
        return Err(format!("its amount out {} is not a positive integer", v["amount_out"]));
    };
    Ok(Quote {
        quote_id: id.to_owned(),
        rate: rate.to_owned(),
        amount_out,
    })
}

/// The error type a vendor's refusal names (`{"error": {"type": …}}`), if
/// any, bounded.
pub(crate) fn refusal_type(body: &[u8]) -> String {
    serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v["error"]["type"].as_str().map(str::to_owned))
        .map(|t| idem_core::cut_at_char_boundary(&t, 100).to_owned())
        .unwrap_or_else(|| "refused".to_owned())
}

crate::payouts::by_reference_hook! {
    /// The FX vendor's reconcile hook: asks it for the quotes it booked under a
    /// reference (the withdrawal id), `GET {fx}/v1/quotes?reference={id}`,
    /// answering `{"object": "list", "data": [{"id", "reference", "from", "to",
    /// "amount", "rate", "amount_out", "status"}, …]}`.
    ///
    /// - one quote `booked` for this request → applied (its record is the
    ///   answer; nothing is booked again);
    /// - none → not applied (the vendor keeps every quote it booked);
    /// - a booking still `processing` → in flight (asked again later);
    /// - several, a record that does not match, or a lookup the vendor answers
    ///   with an error → unknown: the withdrawal is held for an operator, as the
    ///   vendor has no keys and a guess could book twice.
    ///
    /// A lookup that gets no answer (a refused connection, a timeout) is asked
    /// again later.
    QuoteLookup: Vendor::Quotes;
    /// The lookup of the FX vendor at `fx_url`.
    new(fx_url) -> crate::StartError = crate::StartError::Config;
}

impl QuoteLookup {
    async fn ask(&self, request: &OutboundRequest, timeout: Duration) -> Result<Reconciled, String> {
        let sent = ByReference::sent(request)?;
        let (Some(reference), Some(from), Some(to), Some(amount)) = (
            sent["reference"].as_str(),
            sent["from"].as_str(),
            sent["to"].as_str(),
            sent["amount"].as_i64(),
        ) else {
            return Ok(Reconciled::Unknown(
                "the request has no reference, pair or amount to look up".into(),
            ));
        };
        let decide = |data: &[&serde_json::Value]| {
            if data.iter().any(|q| q["status"] == "processing") {
                return Ok(Reconciled::InFlight);
            }
            Ok(match data {
                [] => Reconciled::NotApplied,
                [one] if one["status"] == "booked" => {
                    let record = serde_json::to_vec(one).map_err(|e| e.to_string())?;
                    match check_quote(reference, from, to, amount, &record) {
                        Ok(_) => Reconciled::Applied {
                            status: 201,
                            body: record,
                        },
                        Err(why) => Reconciled::Unknown(format!(
                            "the FX vendor's quote under reference {reference} does not match the request: {why}"
                        )),
                    }
                }
                [one] => Reconciled::Unknown(format!(
                    "the FX vendor's quote under reference {reference} is {}",
                    one["status"]
                )),
                many => Reconciled::Unknown(format!(
                    "the FX vendor booked {} quotes under reference {reference}",
                    many.len()
                )),
            })
        };
        self.lookup.ask(reference, timeout, decide).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A quote is taken only with what the vendor promised: this reference, pair and amount, a plain id, a decimal rate, a positive amount out.
    #[test]
    fn a_quote_holds_what_the_vendor_promised() {
        let good = br#"{"id":"qt_1","reference":"w","from":"EUR","to":"USD","amount":100,"rate":"1.0842","amount_out":108,"status":"booked"}"#;
        let q = check_quote("w", "EUR", "USD", 100, good).unwrap();
        assert_eq!(
            (q.quote_id.as_str(), q.rate.as_str(), q.amount_out),
            ("qt_1", "1.0842", 108)
        );
        for (bad, why) in [
            (
                &br#"{"id":"qt_1","reference":"x","from":"EUR","to":"USD","amount":100,"rate":"1.0","amount_out":1}"#[..],
                "reference",
            ),
            (
                br#"{"id":"qt_1","reference":"w","from":"EUR","to":"GBP","amount":100,"rate":"1.0","amount_out":1}"#,
                "pair",
            ),
            (
                br#"{"id":"qt_1","reference":"w","from":"EUR","to":"USD","amount":99,"rate":"1.0","amount_out":1}"#,
                "amount",
            ),
            (
                br#"{"id":"qt/../1","reference":"w","from":"EUR","to":"USD","amount":100,"rate":"1.0","amount_out":1}"#,
                "id",
            ),
            (
                br#"{"id":"qt_1","reference":"w","from":"EUR","to":"USD","amount":100,"rate":"1e3","amount_out":1}"#,
                "rate",
            ),
            (
                br#"{"id":"qt_1","reference":"w","from":"EUR","to":"USD","amount":100,"rate":"1.0","amount_out":0}"#,
                "amount out",
            ),
            (br#"[1]"#, "object"),
        ] {
            assert!(check_quote("w", "EUR", "USD", 100, bad).is_err(), "{why}");
        }
        assert_eq!(
            refusal_type(br#"{"error":{"type":"unsupported_pair"}}"#),
            "unsupported_pair"
        );
        assert_eq!(refusal_type(b"<html>"), "refused");
    }
}
