//! The ledger's OpenAPI document, served at `GET /openapi.json`.
//!
//! Schemas are derived from the request and response types themselves
//! (`utoipa::ToSchema`); the operations below list every route with every
//! status it answers, and links between them for stateful testing.

use utoipa::ToSchema;
use utoipa::openapi::link::LinkBuilder;
use utoipa::openapi::path::{HttpMethod, OperationBuilder, ParameterBuilder, ParameterIn, PathItem};
use utoipa::openapi::request_body::RequestBodyBuilder;
use utoipa::openapi::security::{Http, HttpAuthScheme, SecurityRequirement, SecurityScheme};
use utoipa::openapi::{
    ComponentsBuilder, Content, InfoBuilder, ObjectBuilder, OpenApi, OpenApiBuilder, PathsBuilder, Ref, Required,
    Response, ResponseBuilder, Type,
};

use crate::api::{
    NewAccount, NewPayout, NewTopUp, NewTransfer, NewWithdrawal, PaymentWebhook, PayoutRequested, TopUpDone,
    TransferDone, WebhookDone,
};
use crate::db::{Account, Audit, Payout, PayoutState, Statement, Withdrawal, WithdrawalState};
use crate::withdrawals::Withdrawn;

/// An RFC 9457 problem, the body of every error.
#[derive(ToSchema)]
#[allow(dead_code)]
pub(crate) struct Problem {
    /// A URI naming the kind of problem.
    r#type: String,
    /// A short summary of the kind.
    title: String,
    /// The HTTP status.
    status: u16,
    /// What happened in this case.
    detail: Option<String>,
}

fn json(schema: &str) -> Content {
    Content::new(Some(Ref::from_schema_name(schema)))
}

fn problem(description: &str) -> Response {
    ResponseBuilder::new()
        .description(description)
        .content("application/problem+json", json("Problem"))
        .build()
}

fn ok(description: &str, schema: &str) -> ResponseBuilder {
    ResponseBuilder::new()
        .description(description)
        .content("application/json", json(schema))
}

/// The `Idempotency-Key` header: an sf-string of 1 to 255 characters.
fn idempotency_key(required: bool) -> utoipa::openapi::path::Parameter {
    ParameterBuilder::new()
        .name("Idempotency-Key")
        .parameter_in(ParameterIn::Header)
        .required(if required { Required::True } else { Required::False })
        .description(Some(
            "One key per logical operation: an RFC 9651 sf-string (or a bare token) of 1 to 255 \
             characters; a retry with the same key and request replays the first response",
        ))
        .schema(Some(ObjectBuilder::new().schema_type(Type::String).pattern(Some(
            r#"^("[ !#-\[\]-~]{1,255}"|[A-Za-z0-9*][!#-'*+.0-9A-Z^_`a-z|~:/-]{0,254})$"#,
        ))))
        .build()
}

/// An operation that reads a required JSON body of `schema`: 413 when the
/// body is too large, 415 when it is not sent as JSON.
fn json_post(id: &str, summary: &str, schema: &str) -> OperationBuilder {
    OperationBuilder::new()
        .operation_id(Some(id))
        .summary(Some(summary))
        .request_body(Some(
            RequestBodyBuilder::new()
                .content("application/json", json(schema))
                .required(Some(Required::True))
                .build(),
        ))
        .response("413", problem("Body over 64 KiB"))
        .response("415", problem("The body is not sent as application/json"))
}

/// A mutating operation behind the idempotency layer.
fn mutation(id: &str, summary: &str, body: &str, key_required: bool, created: Response) -> OperationBuilder {
    json_post(id, summary, body)
        .parameter(idempotency_key(key_required))
        .response("201", created)
        .response(
            "400",
            problem("Malformed request: bad JSON, wrong types, unknown fields, a bad key"),
        )
        .response("401", problem("No valid bearer token"))
        .response(
            "409",
            problem("A request with this Idempotency-Key is still in flight; retry after Retry-After"),
        )
        .response(
            "422",
            problem("The Idempotency-Key was used for a different request, or the request is refused"),
        )
        .response(
            "503",
            problem("The database is unavailable or conflicted; nothing was applied"),
        )
}

/// A keyed mutation of money on the caller's accounts: 404 when one of
/// them does not exist.
fn money_mutation(id: &str, summary: &str, body: &str, created: Response) -> OperationBuilder {
    mutation(id, summary, body, true, created).response("404", problem("No such account"))
}

fn read(id: &str, summary: &str, body: &str) -> OperationBuilder {
    OperationBuilder::new()
        .operation_id(Some(id))
        .summary(Some(summary))
        .response("200", ok("Found", body).build())
        .response("401", problem("No valid bearer token"))
        .response("503", problem("The database is unavailable"))
}

/// A read of one of the caller's resources by its path's `{id}`: 404
/// (`missing`) when the caller has none.
fn read_by_id(id: &str, summary: &str, body: &str, missing: &str) -> OperationBuilder {
    read(id, summary, body)
        .parameter(path_id())
        .response("404", problem(missing))
}

/// A Standard Webhooks header, or its Svix name: either family is
/// accepted, so neither is required by itself (a request with neither is
/// refused with 400).
fn webhook_header(name: &str, description: &str, pattern: &str, max_length: usize) -> utoipa::openapi::path::Parameter {
    ParameterBuilder::new()
        .name(name)
        .parameter_in(ParameterIn::Header)
        .required(Required::False)
        .description(Some(description))
        .schema(Some(
            ObjectBuilder::new()
                .schema_type(Type::String)
                .pattern(Some(pattern))
                .max_length(Some(max_length)),
        ))
        .build()
}

/// The webhook headers, under both names: (standard, Svix, description,
/// pattern, longest).
pub const WEBHOOK_HEADERS: [(&str, &str, &str, &str, usize); 3] = [
    (
        "webhook-id",
        "svix-id",
        "The message id (the same on every retry)",
        r"^[!-~]([ -~]{0,253}[!-~])?$",
        255,
    ),
    (
        "webhook-timestamp",
        "svix-timestamp",
        "Seconds since the Unix epoch, within 5 minutes of now",
        r"^[+-]?[0-9]{1,19}$",
        64,
    ),
    (
        "webhook-signature",
        "svix-signature",
        "Space-separated signatures, at least one `v1,<base64 HMAC-SHA256>`; others (`v1a,…`) are ignored",
        r"^([!-~]+ +)*v1,[A-Za-z0-9+/=]+( +[!-~]+)*$",
        4096,
    ),
];

/// A path served by `POST` alone.
fn post(operation: OperationBuilder) -> PathItem {
    PathItem::new(HttpMethod::Post, operation.build())
}

/// A path served by `GET` alone.
fn get(operation: OperationBuilder) -> PathItem {
    PathItem::new(HttpMethod::Get, operation.build())
}

/// The `{id}` of a resource's path.
fn path_id() -> utoipa::openapi::path::Parameter {
    ParameterBuilder::new()
        .name("id")
        .parameter_in(ParameterIn::Path)
        .required(Required::True)
        .schema(Some(ObjectBuilder::new().schema_type(Type::String)))
        .build()
}

/// A link from a created resource to `operation`, which reads it by its
/// `id`.
fn created_link(operation: &str) -> utoipa::openapi::link::Link {
    LinkBuilder::new()
        .operation_id(operation)
        .parameter("id", "$response.body#/id")
        .build()
}

/// The document.
pub fn document() -> OpenApi {
    let paths = PathsBuilder::new()
        .path(
            "/v1/accounts",
            post(mutation(
                "createAccount",
                "Opens an account (the key is optional)",
                "NewAccount",
                false,
                ok("Created", "Account")
                    .link("GetAccount", created_link("getAccount"))
                    .build(),
            )),
        )
        .path(
            "/v1/accounts/{id}",
            get(read_by_id(
                "getAccount",
                "An account and its balance",
                "Account",
                "No such account for this tenant",
            )),
        )
        .path(
            "/v1/accounts/{id}/statement",
            get(read_by_id(
                "getStatement",
                "The account's statement, from the projection of the ledger's events",
                "Statement",
                "No such account for this tenant",
            )),
        )
        .path(
            "/v1/webhooks/payments",
            post(
                json_post(
                    "receivePaymentWebhook",
                    "A provider-initiated top-up, signed per Standard Webhooks and applied once per event_id",
                    "PaymentWebhook",
                )
                .parameters(Some(WEBHOOK_HEADERS.iter().flat_map(
                    |(name, svix, what, pattern, max)| {
                        [
                            webhook_header(
                                name,
                                &format!("{what}; required unless `{svix}` is sent"),
                                pattern,
                                *max,
                            ),
                            webhook_header(svix, &format!("Svix's name for `{name}`"), pattern, *max),
                        ]
                    },
                )))
                .response(
                    "200",
                    ok(
                        "Applied now, or before (then with Idempotent-Replayed: true)",
                        "WebhookDone",
                    )
                    .build(),
                )
                .response(
                    "400",
                    problem("Malformed headers or body, or a timestamp out of tolerance"),
                )
                .response("401", problem("No valid bearer token, or no signature matches"))
                .response("404", problem("No such account"))
                .response("409", problem("A delivery of this event is being applied"))
                .response(
                    "422",
                    problem("The event id was applied with another body, or the balance limit"),
                )
                .response(
                    "503",
                    problem("Webhooks are not configured, or the database is unavailable"),
                ),
            ),
        )
        .path(
            "/v1/top-ups",
            post(money_mutation(
                "createTopUp",
                "Credits an account",
                "NewTopUp",
                ok("Created", "TopUpDone").build(),
            )),
        )
        .path(
            "/v1/transfers",
            post(money_mutation(
                "createTransfer",
                "Moves an amount between two accounts",
                "NewTransfer",
                ok("Created", "TransferDone").build(),
            )),
        )
        .path(
            "/v1/payouts",
            post(money_mutation(
                "createPayout",
                "Debits an account now and pays the amount out at the vendor (the key is required)",
                "NewPayout",
                ok("Created: debited, to be paid by the payout worker", "PayoutRequested")
                    .link("GetPayout", created_link("getPayout"))
                    .build(),
            )),
        )
        .path(
            "/v1/payouts/{id}",
            get(read_by_id(
                "getPayout",
                "A payout: requested, paid, or dead-lettered",
                "Payout",
                "No such payout for this tenant",
            )),
        )
        .path(
            "/v1/withdrawals",
            post(
                money_mutation(
                    "createWithdrawal",
                    "Debits an account, quotes the amount at the FX vendor and pays it out at the payout vendor, \
                     each once (the key is required)",
                    "NewWithdrawal",
                    ok("Created: debited, quoted and paid out", "Withdrawn")
                        .link("GetWithdrawal", created_link("getWithdrawal"))
                        .build(),
                )
                .response(
                    "409",
                    problem(
                        "The withdrawal under this key is still running (retry after Retry-After), or is held for \
                         an operator (idempotency-outcome-unknown, idempotency-operation-held)",
                    ),
                )
                .response(
                    "422",
                    problem(
                        "Insufficient funds (nothing written, the key unused), a vendor declined it \
                         (withdrawal-declined: the quote released, the amount credited back), or the key was used \
                         for a different request",
                    ),
                )
                .response(
                    "500",
                    problem("The withdrawal's run stopped unexpectedly; retry with the same key"),
                )
                .response(
                    "503",
                    problem("No vendors are configured, or the store is unavailable; retry with the same key"),
                ),
            ),
        )
        .path(
            "/v1/withdrawals/{id}",
            get(read_by_id(
                "getWithdrawal",
                "A withdrawal: pending, paid, or declined with its amount credited back",
                "Withdrawal",
                "No such withdrawal for this tenant",
            )),
        )
        .path(
            "/v1/audit",
            get(read(
                "getAudit",
                "Conservation figures computed from the stored rows",
                "Audit",
            )),
        )
        .build();
    let components = ComponentsBuilder::new()
        .schema_from::<NewAccount>()
        .schema_from::<NewTopUp>()
        .schema_from::<NewTransfer>()
        .schema_from::<Account>()
        .schema_from::<TopUpDone>()
        .schema_from::<TransferDone>()
        .schema_from::<NewPayout>()
        .schema_from::<PayoutRequested>()
        .schema_from::<Payout>()
        .schema_from::<PayoutState>()
        .schema_from::<NewWithdrawal>()
        .schema_from::<Withdrawn>()
        .schema_from::<Withdrawal>()
        .schema_from::<WithdrawalState>()
        .schema_from::<Audit>()
        .schema_from::<Statement>()
        .schema_from::<PaymentWebhook>()
        .schema_from::<WebhookDone>()
        .schema_from::<Problem>()
        .security_scheme("bearer", SecurityScheme::Http(Http::new(HttpAuthScheme::Bearer)))
        .build();
    OpenApiBuilder::new()
        .info(
            InfoBuilder::new()
                .title("idem ledger")
                .version(env!("CARGO_PKG_VERSION"))
                .description(Some(
                    "A double-entry credits ledger whose every mutation is exactly-once under the \
                     Idempotency-Key contract. Every error is application/problem+json.",
                ))
                .build(),
        )
        .paths(paths)
        .components(Some(components))
        .security(Some([SecurityRequirement::new("bearer", Vec::<String>::new())]))
        .build()
}

/// The document as JSON. Link objects are written with the field names of
/// the OpenAPI specification (`operationId`).
pub fn document_json() -> serde_json::Value {
    let mut value = serde_json::to_value(document()).expect("the document serialises");
    fix_links(&mut value);
    value
}

fn fix_links(value: &mut serde_json::Value) {
    match value {
        serde_json::Value::Object(map) => {
            if let Some(links) = map.get_mut("links").and_then(|l| l.as_object_mut()) {
                for link in links.values_mut() {
                    if let Some(link) = link.as_object_mut()
                        && let Some(id) = link.remove("operation_id")
                    {
                        link.insert("operationId".into(), id);
                    }
                }
            }
            map.values_mut().for_each(fix_links);
        }
        serde_json::Value::Array(items) => items.iter_mut().for_each(fix_links),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The documented header patterns admit what the verifier accepts: the
    /// specification's test vector, rotations with several signatures, and
    /// signatures of other schemes (`v1a,…`) next to a `v1` one.
    #[test]
    fn webhook_header_patterns_admit_what_the_verifier_accepts() {
        let secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
        let (id, ts, body) = ("msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, br#"{"test": 2432232314}"#);
        let v1 = idem_webhooks::sign(secret, id, ts, body).unwrap();
        let verifier = idem_webhooks::Verifier::new([secret]).unwrap();
        let pattern = |name: &str| {
            let (_, _, _, p, _) = WEBHOOK_HEADERS.iter().find(|h| h.0 == name).unwrap();
            regex::Regex::new(p).unwrap()
        };
        let signature = pattern("webhook-signature");
        for header in [
            v1.clone(),
            format!("v1a,c29tZSBlZDI1NTE5IHNpZ25hdHVyZQ== {v1}"),
            format!("{v1} v1a,c29tZSBlZDI1NTE5IHNpZ25hdHVyZQ=="),
            format!("v1,bm9wZQ== {v1}"),
        ] {
            verifier.verify(id, &ts.to_string(), &header, body, ts).unwrap();
            assert!(signature.is_match(&header), "{header}");
        }
        assert!(!signature.is_match("v1a,c29tZQ=="), "no v1 signature");
        assert!(
            !signature.is_match(&format!(" {v1}")),
            "no leading space: a header value cannot have one"
        );
        assert!(pattern("webhook-timestamp").is_match(&ts.to_string()));
        assert!(pattern("webhook-id").is_match(id));
        let doc = serde_json::to_value(document()).unwrap();
        let params = doc["paths"]["/v1/webhooks/payments"]["post"]["parameters"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p["name"].as_str().unwrap().to_owned())
            .collect::<Vec<_>>();
        for name in ["webhook-id", "svix-id", "webhook-signature", "svix-signature"] {
            assert!(params.iter().any(|p| p == name), "{name} documented: {params:?}");
        }
    }
}
