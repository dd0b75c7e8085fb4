//! Asking a vendor for its records by reference: what the ledger's reconcile
//! hooks share (the payout vendor's [`VendorLookup`](super::VendorLookup),
//! the FX vendor's [`QuoteLookup`](crate::withdrawals::QuoteLookup)). Each
//! hook reads its own terms from the request it reconciles and decides what
//! the records of its reference mean; the hook's type, the request, its
//! bounds and the checks of the list are here, once.

use std::time::Duration;

use idem_core::OutboundRequest;
use idem_outbound::Reconciled;

/// The most bytes of a lookup's answer read; a longer one is an error.
pub const MAX_LOOKUP_BYTES: usize = 1024 * 1024;

/// A vendor the ledger asks for its records by reference.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Vendor {
    /// The payout vendor, for its payouts.
    Payouts,
    /// The FX vendor, for the quotes it booked.
    Quotes,
}

impl Vendor {
    /// The path of its list under its URL, how its URL is named in a
    /// configuration error, how its lookup is named when its HTTP client
    /// cannot be built, and how answers name it.
    fn names(self) -> (&'static str, &'static str, &'static str, &'static str) {
        match self {
            Self::Payouts => ("/v1/payouts", "vendor URL", "the vendor lookup", "the vendor"),
            Self::Quotes => ("/v1/quotes", "--fx-url", "the FX lookup", "the FX vendor"),
        }
    }
}

/// The lookup of one vendor's records by reference:
/// `GET {vendor}{path}?reference={reference}`, answering `{"object": "list",
/// "data": [{"reference", "status", …}, …], "has_more"}`.
#[derive(Debug, Clone)]
pub(crate) struct ByReference {
    vendor: Vendor,
    http: reqwest::Client,
    url: reqwest::Url,
    headers: reqwest::header::HeaderMap,
}

impl ByReference {
    /// The lookup of `vendor` at `vendor_url`; why not, as a configuration
    /// error's text.
    pub(crate) fn new(vendor_url: &str, vendor: Vendor) -> Result<Self, String> {
        let (path, url_name, lookup_name, _) = vendor.names();
        let url = reqwest::Url::parse(&format!("{}{path}", vendor_url.trim_end_matches('/')))
            .map_err(|e| format!("{url_name} {vendor_url:?}: {e}"))?;
        let http = crate::http_builder()
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|e| format!("{lookup_name}'s HTTP client: {e}"))?;
        Ok(Self {
            vendor,
            http,
            url,
            headers: reqwest::header::HeaderMap::new(),
        })
    }

    /// Asks through `http` (its TLS roots and pool; redirects must be off).
    pub(crate) fn with_http_client(mut self, http: reqwest::Client) -> Self {
        self.http = http;
        self
    }

    /// Sends `headers` with every lookup, kept sensitive.
    pub(crate) fn with_headers(
        mut self,
        headers: Vec<(reqwest::header::HeaderName, reqwest::header::HeaderValue)>,
    ) -> Self {
        for (name, mut value) in headers {
            value.set_sensitive(true);
            self.headers.insert(name, value);
        }
        self
    }

    /// The JSON body of the request being reconciled, which holds the
    /// terms its records must match.
    pub(crate) fn sent(request: &OutboundRequest) -> Result<serde_json::Value, String> {
        serde_json::from_slice(request.body()).map_err(|e| format!("the request is not JSON: {e}"))
    }

    /// Asks the vendor for its records under `reference`, and answers what
    /// `decide` makes of them (every record of this very reference, on the
    /// page the vendor answered). A failed request, an answer that is not a
    /// list, or one over [`MAX_LOOKUP_BYTES`] is an error (asked again
    /// later), and so is an HTTP error status from the payout vendor; from
    /// the FX vendor, which has no keys, it is an unknown outcome, held for
    /// an operator. A record without a reference, or a page without this
    /// one's records that says more follow, is an unknown outcome.
    pub(crate) async fn ask(
        &self,
        reference: &str,
        timeout: Duration,
        decide: impl FnOnce(&[&serde_json::Value]) -> Result<Reconciled, String>,
    ) -> Result<Reconciled, String> {
        let (_, _, _, name) = self.vendor.names();
        let mut url = self.url.clone();
        url.query_pairs_mut().append_pair("reference", reference);
        let response = self
            .http
            .get(url)
            .headers(self.headers.clone())
            .timeout(timeout)
            .send()
            .await
            .map_err(|e| format!("lookup failed: {e}"))?;
        let status = response.status();
        if !status.is_success() {
            return match self.vendor {
                Vendor::Payouts => Err(format!("lookup answered HTTP {status}")),
                Vendor::Quotes => Ok(Reconciled::Unknown(format!(
                    "{name} answered its lookup of {reference} with HTTP {status}"
                ))),
            };
        }
        let body = read_bounded(response, MAX_LOOKUP_BYTES).await?;
        let found: serde_json::Value =
            serde_json::from_slice(&body).map_err(|e| format!("lookup answer is not JSON: {e}"))?;
        // A list object, as the vendors' list endpoints answer: an empty
        // body, `{}` or a bare `[]` (a wrong URL, a proxy's page) says
        // nothing, and is never taken for "not applied".
        let (true, Some(listed)) = (found["object"] == "list", found["data"].as_array()) else {
            return Err("lookup answer is not a list (object \"list\" with a data array)".into());
        };
        // A record without a reference cannot be told apart: it may be
        // this one under another field's name.
        if listed.iter().any(|r| !r["reference"].is_string()) {
            return Ok(Reconciled::Unknown(format!(
                "{name}'s answer for reference {reference} lists a record without a reference"
            )));
        }
        // Only records of this very reference count: a vendor that ignored
        // the filter lists others, which say nothing of this one.
        let data: Vec<&serde_json::Value> = listed.iter().filter(|r| r["reference"] == reference).collect();
        if data.is_empty() && found["has_more"] == true {
            // A first page without it proves nothing.
            return Ok(Reconciled::Unknown(format!(
                "{name}'s answer for reference {reference} has more pages and none of this one"
            )));
        }
        decide(&data)
    }
}

/// Declares the public reconcile hook `$name`, a [`ByReference`] lookup
/// of `$vendor` (field `lookup`): its constructor `new`, which answers a
/// configuration error as `$to_error` makes it an `$error`, its builders
/// and its `Reconcile` impl, which answers what the type's own
/// `ask(&self, request, timeout)` makes of a request.
macro_rules! by_reference_hook {
    (
        $(#[$doc:meta])*
        $name:ident: $vendor:expr;
        $(#[$new_doc:meta])*
        new($url:ident) -> $error:ty = $to_error:expr;
    ) => {
        $(#[$doc])*
        #[derive(Debug, Clone)]
        pub struct $name {
            lookup: $crate::payouts::ByReference,
        }

        impl $name {
            $(#[$new_doc])*
            pub fn new($url: &str) -> Result<Self, $error> {
                let lookup = $crate::payouts::ByReference::new($url, $vendor).map_err($to_error)?;
                Ok(Self { lookup })
            }

            /// Asks through `http` (its TLS roots and pool; redirects must
            /// be off), in place of a client of its own.
            pub fn with_http_client(self, http: reqwest::Client) -> Self {
                Self {
                    lookup: self.lookup.with_http_client(http),
                }
            }

            /// Sends `headers` with every lookup (the vendor's credentials,
            /// kept sensitive).
            pub fn with_headers(
                self,
                headers: Vec<(reqwest::header::HeaderName, reqwest::header::HeaderValue)>,
            ) -> Self {
                Self {
                    lookup: self.lookup.with_headers(headers),
                }
            }

            /// Asks as the calls of `client` go: through its HTTP client
            /// (its TLS roots), with its credentials.
            pub(crate) fn through(self, client: &idem_outbound::OutboundClient) -> Self {
                self.with_http_client(client.http_client().clone())
                    .with_headers(client.config().secret_headers.clone())
            }
        }

        impl idem_outbound::Reconcile for $name {
            fn reconcile<'a>(
                &'a self,
                _key: &'a idem_core::IdempotencyKey,
                request: &'a idem_core::OutboundRequest,
                timeout: std::time::Duration,
            ) -> idem_core::BoxFuture<'a, Result<idem_outbound::Reconciled, String>> {
                Box::pin(self.ask(request, timeout))
            }
        }
    };
}
pub(crate) use by_reference_hook;

/// `response`'s body, refused past `max` bytes (never buffered whole).
async fn read_bounded(mut response: reqwest::Response, max: usize) -> Result<Vec<u8>, String> {
    if response.content_length().is_some_and(|n| n > max as u64) {
        return Err(format!("lookup answer over {max} bytes"));
    }
    let mut body = Vec::new();
    while let Some(chunk) = response.chunk().await.map_err(|e| format!("lookup failed: {e}"))? {
        if body.len() + chunk.len() > max {
            return Err(format!("lookup answer over {max} bytes"));
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}
