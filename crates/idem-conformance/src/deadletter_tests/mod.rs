//! Dead-letter store behaviours, by theme: recording and listing letters
//! (`recording.rs`), and redriving them, holds and verdicts
//! (`redrives.rs`). The helpers both use are here.

mod recording;
mod redrives;

use idem_core::{
    DeadLetter, DeadLetterStore, IdempotencyKey, NewDeadLetter, OutboundRequest, RedriveHold, RedriveOutcome, Scope,
};

pub use recording::{
    dead_letter_round_trips_every_field, keys_are_scoped_and_exact, list_filters_and_pages_in_id_order,
    purge_resolved_deletes_only_old_resolved, recording_again_keeps_the_strictest_send_terms,
    recording_twice_updates_one_row,
};
pub use redrives::{
    a_held_letter_can_be_pointed_elsewhere, begin_redrive_takes_a_letter_once,
    expired_hold_is_taken_again_and_fences_the_old_token, failed_redrive_is_dead_again,
    first_reach_is_kept_and_a_redrive_replaces_it, held_letter_is_not_taken_again, missing_letters_and_bad_holds,
    only_a_letter_known_not_applied_is_cancelled, recording_a_held_letter_keeps_its_hold, resolved_letter_is_final,
    unknown_outcomes_are_held_until_settled,
};

/// A long hold: nothing in a test outlives it.
const LONG_HOLD_MS: i64 = 600_000;

/// A scope of its own for one test, with a tenant no other test uses.
fn scope_of(tenant: &str, operation: &str) -> Scope {
    Scope::parse(tenant, operation).expect("valid scope")
}

/// A fresh tenant name (non-ASCII, so tenants are stored byte for byte).
fn fresh_tenant() -> String {
    format!("tenant-ü-{}", uuid::Uuid::new_v4().simple())
}

fn request(body: &[u8]) -> OutboundRequest {
    OutboundRequest::new(
        "POST",
        "https://vendor.example/v1/payouts?currency=eur&x=%C3%A9",
        vec![
            ("content-type".into(), "application/json".into()),
            ("x-trace".into(), "b".into()),
            ("x-trace".into(), "a".into()),
            ("x-note".into(), "naïve \"quoted\" \\ tab\there ✓".into()),
        ],
        body.to_vec(),
    )
    .expect("a valid request")
}

fn letter(scope: &Scope, key: &str, attempts: u32, error: &str) -> NewDeadLetter {
    NewDeadLetter::new(
        scope.clone(),
        IdempotencyKey::new(key).expect("valid key"),
        request(b"{\"amount\":100}"),
        attempts,
        error,
    )
}

fn resolved(status: u16, body: &[u8]) -> RedriveOutcome {
    RedriveOutcome::Resolved {
        status,
        body: body.to_vec(),
        reconciled: false,
    }
}

async fn fetch<D: DeadLetterStore>(store: &D, id: i64) -> DeadLetter {
    store
        .get(id)
        .await
        .expect("get")
        .unwrap_or_else(|| panic!("dead letter {id} is missing"))
}

async fn take<D: DeadLetterStore>(store: &D, id: i64, hold_ms: i64) -> RedriveHold {
    store
        .begin_redrive(id, hold_ms)
        .await
        .expect("begin_redrive")
        .unwrap_or_else(|| panic!("dead letter {id} could not be taken"))
}
