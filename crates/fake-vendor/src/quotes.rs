//! A foreign-exchange quote API **without idempotency keys**, as many real
//! vendors are: every `POST /v1/quotes` books a new quote, whatever header
//! it carries, so a caller that lost an answer must ask before it books
//! again.
//!
//! - `POST /v1/quotes` `{"reference", "from", "to", "amount"}`: books a quote
//!   (201, `{"id", "reference", "from", "to", "amount", "rate",
//!   "amount_out", "status": "booked"}`); `rate` is an exact decimal string
//!   and `amount_out` is `amount × rate` rounded down. A pair it does not
//!   quote is 422 `unsupported_pair`; an amount that converts to nothing is
//!   422 `amount_too_small`; a malformed body is 400.
//! - `GET /v1/quotes?reference=R`: every quote booked with that reference
//!   (`{"object": "list", "data": [...]}`), plus `{"reference", "status":
//!   "processing"}` while a request with it is still being worked on. This
//!   is what a reconcile asks; the fault `lookup_error_500` makes it fail.
//! - `POST /v1/quotes/{id}/cancel`: cancels a booked quote (200, the quote
//!   with `"status": "cancelled"`); cancelling it again answers the same;
//!   an unknown id is 404.
//! - `GET /v1/quotes/ledger`: what it booked — `{"quotes": n, "cancelled":
//!   n, "references": [...]}` (the distinct references booked; a reference
//!   booked twice shows as fewer references than quotes).
//!
//! The switchable faults of payouts apply here too: `slow_ms`, `error_500`
//! and `rate_limit_429` before booking, `apply_then_drop` after booking,
//! `refuse_ms` for the whole vendor.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::Json;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use tokio::sync::Mutex;

use crate::{Vendor, chance, error};

/// The quotes booked, in order, and the references being worked on.
#[derive(Default)]
pub(crate) struct QuoteBook {
    /// Every quote booked, with its current status.
    booked: Mutex<Vec<serde_json::Value>>,
    /// References of booking requests in progress, with their count.
    processing: std::sync::Mutex<HashMap<String, u32>>,
}

impl QuoteBook {
    fn lock_processing(&self) -> std::sync::MutexGuard<'_, HashMap<String, u32>> {
        self.processing
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Booking requests in progress.
    pub(crate) fn in_process(&self) -> usize {
        self.lock_processing().values().map(|n| *n as usize).sum()
    }

    /// The quotes booked so far (cancelled ones included).
    pub(crate) async fn count(&self) -> usize {
        self.booked.lock().await.len()
    }

    /// `(booked, cancelled, distinct references booked)`.
    pub(crate) async fn summary(&self) -> (usize, usize, Vec<String>) {
        let booked = self.booked.lock().await;
        let cancelled = booked.iter().filter(|q| q["status"] == "cancelled").count();
        let references: std::collections::BTreeSet<String> = booked
            .iter()
            .filter_map(|q| q["reference"].as_str().map(str::to_owned))
            .collect();
        (booked.len(), cancelled, references.into_iter().collect())
    }
}

/// A reference being booked, until dropped.
struct Booking<'a> {
    book: &'a QuoteBook,
    reference: String,
}

impl Drop for Booking<'_> {
    fn drop(&mut self) {
        let mut p = self.book.lock_processing();
        if let Some(n) = p.get_mut(&self.reference) {
            *n -= 1;
            if *n == 0 {
                p.remove(&self.reference);
            }
        }
    }
}

/// The rates it quotes, in ten-thousandths: `(from, to, rate × 10 000)`.
/// Any currency converts to itself at 1.
const RATES: &[(&str, &str, i128)] = &[
    ("EUR", "USD", 10_842),
    ("USD", "EUR", 9_223),
    ("GBP", "USD", 12_650),
    ("USD", "GBP", 7_905),
    ("EUR", "GBP", 8_571),
    ("GBP", "EUR", 11_667),
];

/// The rate of `from` into `to`, in ten-thousandths, if it is quoted.
fn rate(from: &str, to: &str) -> Option<i128> {
    if from == to {
        return Some(10_000);
    }
    RATES.iter().find(|(f, t, _)| *f == from && *t == to).map(|r| r.2)
}

fn is_currency(code: &str) -> bool {
    code.len() == 3 && code.bytes().all(|b| b.is_ascii_uppercase())
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct NewQuote {
    reference: String,
    from: String,
    to: String,
    amount: i64,
}

/// `POST /v1/quotes`. As with payouts, the booking runs in a task of its
/// own: a caller that gives up does not stop it.
pub(crate) async fn book(State(v): State<Arc<Vendor>>, body: axum::body::Bytes) -> Response {
    match tokio::spawn(book_quote(v, body)).await {
        Ok(response) => response,
        // The `apply_then_drop` fault: the connection goes away unanswered.
        Err(e) => std::panic::resume_unwind(e.into_panic()),
    }
}

async fn book_quote(v: Arc<Vendor>, body: axum::body::Bytes) -> Response {
    let faults = v.faults.lock().await.clone();
    let Ok(req) = serde_json::from_slice::<NewQuote>(&body) else {
        return error(
            StatusCode::BAD_REQUEST,
            "invalid_request",
            "body: {\"reference\": text, \"from\": currency, \"to\": currency, \"amount\": positive integer}",
        );
    };
    if req.amount <= 0 || req.reference.is_empty() || req.reference.len() > 255 {
        return error(
            StatusCode::BAD_REQUEST,
            "invalid_request",
            "amount must be positive and the reference 1 to 255 bytes",
        );
    }
    if !is_currency(&req.from) || !is_currency(&req.to) {
        return error(
            StatusCode::BAD_REQUEST,
            "invalid_request",
            "currencies are three capital letters",
        );
    }
    let Some(rate) = rate(&req.from, &req.to) else {
        return error(
            StatusCode::UNPROCESSABLE_ENTITY,
            "unsupported_pair",
            "this pair of currencies is not quoted",
        );
    };
    let amount_out = i128::from(req.amount) * rate / 10_000;
    let Ok(amount_out) = i64::try_from(amount_out) else {
        return error(StatusCode::BAD_REQUEST, "invalid_request", "amount too large");
    };
    if amount_out == 0 {
        return error(
            StatusCode::UNPROCESSABLE_ENTITY,
            "amount_too_small",
            "the amount converts to nothing",
        );
    }
    // From here a lookup of the reference says "processing" until the
    // request ends, whichever way.
    let _booking = {
        *v.quotes.lock_processing().entry(req.reference.clone()).or_insert(0) += 1;
        Booking {
            book: &v.quotes,
            reference: req.reference.clone(),
        }
    };
    if faults.slow_ms > 0 {
        tokio::time::sleep(Duration::from_millis(faults.slow_ms)).await;
    }
    let seq = v.seq.fetch_add(1, Ordering::SeqCst);
    if let Some(refused) = v.refused_before_applying(&faults, seq, "booked") {
        return refused;
    }
    let quote = serde_json::json!({
        "id": format!("qt_{}", uuid::Uuid::now_v7().simple()),
        "reference": req.reference,
        "from": req.from,
        "to": req.to,
        "amount": req.amount,
        "rate": format!("{}.{:04}", rate / 10_000, rate % 10_000),
        "amount_out": amount_out,
        "status": "booked",
    });
    v.quotes.booked.lock().await.push(quote.clone());
    if chance(seq * 3 + 2) < faults.apply_then_drop {
        v.dropped.fetch_add(1, Ordering::SeqCst);
        // Booked; the connection goes away without an answer.
        panic!("{}", crate::DROPPED_ON_PURPOSE);
    }
    (StatusCode::CREATED, Json(quote)).into_response()
}

#[derive(Deserialize)]
pub(crate) struct ByReference {
    reference: String,
}

/// `GET /v1/quotes?reference=R`: the quotes booked with it, and whether a
/// booking with it is in progress.
pub(crate) async fn lookup(State(v): State<Arc<Vendor>>, Query(q): Query<ByReference>) -> Response {
    if let Some(failed) = v.lookup_fault().await {
        return failed;
    }
    let mut data: Vec<serde_json::Value> = v
        .quotes
        .booked
        .lock()
        .await
        .iter()
        .filter(|b| b["reference"].as_str() == Some(q.reference.as_str()))
        .cloned()
        .collect();
    if v.quotes.lock_processing().contains_key(&q.reference) {
        data.push(serde_json::json!({ "reference": q.reference, "status": "processing" }));
    }
    Json(serde_json::json!({ "object": "list", "data": data })).into_response()
}

/// `GET /v1/quotes/ledger`: quotes booked, cancelled, and the distinct
/// references booked.
pub(crate) async fn ledger(State(v): State<Arc<Vendor>>) -> Json<serde_json::Value> {
    let (quotes, cancelled, references) = v.quotes.summary().await;
    Json(serde_json::json!({ "quotes": quotes, "cancelled": cancelled, "references": references }))
}

/// `POST /v1/quotes/{id}/cancel`: the quote, cancelled (again or not).
pub(crate) async fn cancel(State(v): State<Arc<Vendor>>, Path(id): Path<String>) -> Response {
    let mut booked = v.quotes.booked.lock().await;
    match booked.iter_mut().find(|q| q["id"].as_str() == Some(id.as_str())) {
        Some(quote) => {
            quote["status"] = "cancelled".into();
            (StatusCode::OK, Json(quote.clone())).into_response()
        }
        None => error(StatusCode::NOT_FOUND, "resource_missing", "no such quote"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rates are exact: the amount out is the amount times the rate, rounded down.
    #[test]
    fn rates_are_exact_and_rounded_down() {
        assert_eq!(rate("EUR", "EUR"), Some(10_000));
        assert_eq!(rate("EUR", "USD"), Some(10_842));
        assert_eq!(rate("EUR", "JPY"), None);
        assert_eq!(100_i128 * rate("USD", "GBP").unwrap() / 10_000, 79);
        assert!(is_currency("USD"));
        assert!(!is_currency("usd") && !is_currency("US") && !is_currency("USDT"));
    }
}
