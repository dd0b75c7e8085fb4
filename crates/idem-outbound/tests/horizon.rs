//! Re-sends and the vendor's memory, against the fake vendor: a re-send
//! within the key horizon is sent blindly and replayed; past it, or to a
//! vendor without keys, the vendor is asked first (applied: nothing sent;
//! not applied: sent); without a way to ask, nothing is sent and the
//! outcome is unknown. Also: the in-flight 409, refused https and user
//! information, secret headers.

mod support;

use std::sync::Arc;
use std::time::Duration;

use idem_core::{Clock, DeadLetterStore, ManualClock, Scope};
use idem_memory::MemoryDeadLetters;
use idem_outbound::{Earlier, KeyHorizon, OutboundClient, OutboundConfig, OutboundError, RedriveResult, Redriver};
use support::{Answer, Lookup, Scripted, config, key, ledger, payout, set_faults, stats, vendor_with};

const HOUR: Duration = Duration::from_secs(3600);

fn short_horizon() -> fake_vendor::Options {
    fake_vendor::Options {
        key_horizon: HOUR,
        ..Default::default()
    }
}

fn client_at(clock: &ManualClock, horizon: KeyHorizon) -> OutboundClient {
    OutboundClient::new(OutboundConfig {
        key_horizon: horizon,
        ..config(&[10, 10, 10])
    })
    .unwrap()
    .with_clock(Arc::new(clock.clone()))
}

fn hour_horizon() -> KeyHorizon {
    KeyHorizon::new(HOUR, Duration::from_secs(60))
}

/// A vendor without idempotency keys that pays every call and then drops
/// its answer, and a lookup of its records.
async fn keyless_vendor_dropping_answers() -> (String, Arc<Lookup>) {
    let (base, _) = vendor_with(fake_vendor::Options {
        idempotency: false,
        ..Default::default()
    })
    .await;
    set_faults(&base, serde_json::json!({ "apply_then_drop": 1.0 })).await;
    let lookup = Lookup::new(&base);
    (base, lookup)
}

/// A client that asks `lookup` before a re-send it cannot make blindly,
/// with `config(&[10, 10])` changed by `edit`.
fn reconciling(lookup: &Arc<Lookup>, edit: impl FnOnce(&mut OutboundConfig)) -> OutboundClient {
    let mut c = config(&[10, 10]);
    edit(&mut c);
    OutboundClient::new(c).unwrap().with_reconcile(lookup.clone())
}

/// Records the dead letter of a payout `reference` that timed out at the
/// vendor's door, then lets two hours pass.
async fn timed_out_letter(letters: &MemoryDeadLetters, clock: &ManualClock, base: &str, reference: &str) -> i64 {
    let request = payout(base, &format!(r#"{{"amount":9,"reference":"{reference}"}}"#));
    let scope = Scope::parse("t", "payout").unwrap();
    let letter =
        idem_core::NewDeadLetter::new(scope, key(reference), request, 4, "timeout").reached_at(Some(clock.now_ms()));
    let id = letters.record(&letter).await.unwrap();
    clock.advance(2 * HOUR);
    id
}

/// A re-send within the horizon is sent blindly and the vendor replays; past it, without a reconcile hook, nothing is sent and the outcome is unknown; with one, the vendor's record is taken and nothing is paid twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_horizon_the_vendor_is_asked_before_any_send() {
    let (base, vendor) = vendor_with(short_horizon()).await;
    let clock = ManualClock::starting_now();
    let request = payout(&base, r#"{"amount":5,"reference":"po-1"}"#);
    let first_at = clock.now_ms();
    let paid = client_at(&clock, hour_horizon())
        .send(&key("po-1"), &request)
        .await
        .unwrap();
    assert_eq!(paid.status, 201);
    let earlier = Earlier {
        first_reached_at_ms: Some(first_at),
        ..Earlier::default()
    };
    // Within the horizon: blind, replayed.
    clock.advance(Duration::from_secs(30 * 60));
    vendor.advance(Duration::from_secs(30 * 60));
    let again = client_at(&clock, hour_horizon())
        .resend(&key("po-1"), &request, earlier)
        .await
        .unwrap();
    assert_eq!(again.headers["idempotent-replayed"], "true");
    // Past it: the vendor has forgotten the key. Without a hook: held.
    clock.advance(HOUR);
    vendor.advance(HOUR);
    let held = client_at(&clock, hour_horizon())
        .resend(&key("po-1"), &request, earlier)
        .await;
    match held {
        Err(OutboundError::Unknown {
            attempts,
            reason,
            first_reached_at_ms,
            ..
        }) => {
            assert_eq!(attempts, 1);
            assert!(reason.contains("past the vendor's key horizon"), "{reason}");
            assert_eq!(first_reached_at_ms, Some(first_at));
        }
        other => panic!("{other:?}"),
    }
    // With a hook: the vendor's record is the answer, and nothing is sent.
    let lookup = Lookup::new(&base);
    let found = client_at(&clock, hour_horizon())
        .with_reconcile(lookup.clone())
        .resend(&key("po-1"), &request, earlier)
        .await
        .unwrap();
    assert!(found.reconciled);
    let record: serde_json::Value = serde_json::from_slice(&found.body).unwrap();
    assert_eq!(record["id"], paid_id(&paid.body));
    assert_eq!(lookup.asked(), 1);
    let (payouts, _) = ledger(&base).await;
    assert_eq!(payouts, 1, "paid once");
    assert_eq!(
        stats(&base).await["forgotten"],
        0,
        "the forgotten key was never sent again"
    );
    // The operator's override sends past the horizon: the vendor pays again.
    // That is why it is an explicit override.
    let forced = client_at(&clock, hour_horizon())
        .resend(
            &key("po-1"),
            &request,
            Earlier {
                past_horizon_override: true,
                ..earlier
            },
        )
        .await
        .unwrap();
    assert!(!forced.reconciled);
    assert_eq!(ledger(&base).await.0, 2);
}

fn paid_id(body: &[u8]) -> serde_json::Value {
    serde_json::from_slice::<serde_json::Value>(body).unwrap()["id"].clone()
}

/// Past the horizon, a call the vendor has no record of is sent (once), and the redrive of its dead letter resolves it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_the_vendor_never_applied_is_sent_after_asking() {
    let (base, _) = vendor_with(short_horizon()).await;
    let clock = ManualClock::starting_now();
    let letters = MemoryDeadLetters::new().with_clock(Arc::new(clock.clone()));
    // A send that timed out at the vendor's door, two hours ago.
    let id = timed_out_letter(&letters, &clock, &base, "po-2").await;
    let lookup = Lookup::new(&base);
    let redriver = Redriver::new(
        client_at(&clock, hour_horizon()).with_reconcile(lookup.clone()),
        letters.clone(),
    );
    let result = redriver.redrive_one(id).await.unwrap();
    assert!(
        matches!(result, RedriveResult::Resolved { status: 201, .. }),
        "{result:?}"
    );
    assert_eq!(lookup.asked(), 1);
    assert_eq!(ledger(&base).await.0, 1);
    let stored = letters.get(id).await.unwrap().unwrap();
    assert_eq!(stored.state, idem_core::DeadLetterState::Resolved);
    // Without a hook, the same redrive holds the letter as unknown, sends nothing.
    let (base2, _) = vendor_with(short_horizon()).await;
    let id = timed_out_letter(&letters, &clock, &base2, "po-3").await;
    let blind = Redriver::new(client_at(&clock, hour_horizon()), letters.clone());
    let result = blind.redrive_one(id).await.unwrap();
    assert!(matches!(result, RedriveResult::Unknown { .. }), "{result:?}");
    assert_eq!(
        letters.get(id).await.unwrap().unwrap().state,
        idem_core::DeadLetterState::Unknown
    );
    assert_eq!(ledger(&base2).await.0, 0, "nothing sent on a guess");
    // An unknown letter stays held even with the horizon override.
    let forced = Redriver::new(client_at(&clock, hour_horizon()), letters.clone()).with_past_horizon_override(true);
    assert!(matches!(
        forced.redrive_one(id).await.unwrap(),
        RedriveResult::Unknown { .. }
    ));
    assert_eq!(ledger(&base2).await.0, 0);
}

/// A vendor without idempotency is asked before every re-send, even within one call: an answer dropped after paying is found by the lookup, and paid once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vendor_without_keys_is_asked_before_every_resend() {
    let (base, lookup) = keyless_vendor_dropping_answers().await;
    let client = reconciling(&lookup, |c| c.key_horizon = KeyHorizon::NONE);
    let answer = client
        .send(&key("k"), &payout(&base, r#"{"amount":3,"reference":"po-4"}"#))
        .await
        .unwrap();
    assert!(answer.reconciled);
    assert_eq!(lookup.asked(), 1);
    assert_eq!(ledger(&base).await.0, 1, "paid once, by the only send");
    // Refused connections never reached it: retried without asking.
    let refused = format!("http://{}", support::free_addr());
    let _ = client
        .send(&key("k2"), &payout(&refused, r#"{"amount":3,"reference":"po-5"}"#))
        .await;
    assert_eq!(lookup.asked(), 1, "nothing to ask about a send that never left");
}

/// A vendor declared keyless in `host_key_horizons` with a trailing `/`
/// is keyless: its answer dropped after paying is looked up, not sent
/// again blindly under the default horizon.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_horizon_written_with_a_slash_applies() {
    let (base, lookup) = keyless_vendor_dropping_answers().await;
    let client = reconciling(&lookup, |c| {
        c.host_key_horizons = vec![(format!("{base}/"), KeyHorizon::NONE)];
    });
    let answer = client
        .send(&key("k"), &payout(&base, r#"{"amount":3,"reference":"po-slash"}"#))
        .await
        .unwrap();
    assert!(answer.reconciled, "{answer:?}");
    assert_eq!(ledger(&base).await.0, 1, "paid once");
}

/// A 409 idempotency_key_in_use without Retry-After (the key still being processed at the vendor) is waited out and asked again, not taken as final.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_in_flight_409_without_retry_after_is_asked_again() {
    let in_use = r#"{"error":{"type":"idempotency_error","code":"idempotency_key_in_use","message":"in use"}}"#;
    let server = Scripted::start(vec![Answer::status(409).body(in_use), Answer::status(201)]).await;
    let answer = OutboundClient::new(config(&[10, 10]))
        .unwrap()
        .send(&key("busy"), &server.request("/"))
        .await
        .unwrap();
    assert_eq!((answer.status, answer.attempts), (201, 2));
    // Another 409 is final.
    let server = Scripted::start(vec![
        Answer::status(409).body(r#"{"error":{"code":"resource_exists"}}"#),
    ])
    .await;
    let refused = OutboundClient::new(config(&[10, 10]))
        .unwrap()
        .send(&key("exists"), &server.request("/"))
        .await;
    assert!(
        matches!(refused, Err(OutboundError::Rejected { status: 409, .. })),
        "{refused:?}"
    );
    assert_eq!(server.count(), 1);
    // Against the fake vendor: the first send outlives its attempt timeout,
    // the retry meets the 409, then the recorded answer. Paid once.
    let (base, _) = vendor_with(fake_vendor::Options::default()).await;
    set_faults(&base, serde_json::json!({ "slow_ms": 600 })).await;
    let client = OutboundClient::new(OutboundConfig {
        attempt_timeout: Duration::from_millis(300),
        ..config(&[50, 100, 200, 400, 800])
    })
    .unwrap();
    // Once the vendor has answered a 409, it answers at once again.
    let calm = {
        let base = base.clone();
        tokio::spawn(async move {
            while stats(&base).await["in_use"] == 0 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            set_faults(&base, serde_json::json!({})).await;
        })
    };
    let answer = client
        .send(&key("slow"), &payout(&base, r#"{"amount":2,"reference":"po-6"}"#))
        .await
        .unwrap();
    calm.await.unwrap();
    assert_eq!(answer.status, 201);
    assert!(stats(&base).await["in_use"].as_u64().unwrap() >= 1);
    assert_eq!(ledger(&base).await.0, 1);
}

/// A URL with user information or a fragment is refused at once: nothing sent, no retry, the breaker untouched (https without TLS: the `check_target` doc test).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn targets_that_cannot_work_are_refused_at_once() {
    let client = OutboundClient::new(config(&[10, 10])).unwrap();
    for url in [
        "https://user:pw@127.0.0.1:9/v1/payouts",
        "http://user:pw@127.0.0.1:9/x",
        "http://127.0.0.1:9/#/v1",
    ] {
        let request = idem_core::OutboundRequest::new("POST", url, vec![], b"{}".to_vec()).unwrap();
        let refused = client.send(&key("k"), &request).await;
        assert!(matches!(refused, Err(OutboundError::Invalid(_))), "{url}: {refused:?}");
        assert!(client.check_target(url).is_err());
    }
    assert_eq!(
        client.breaker_state("http://127.0.0.1:9/").unwrap(),
        idem_outbound::BreakerState::Closed
    );
}

/// Secret headers go out with every attempt and every redrive, and are never in the dead letter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secret_headers_are_sent_never_stored() {
    let server = Scripted::start(vec![Answer::status(503), Answer::status(503), Answer::status(201)]).await;
    let config = OutboundConfig {
        retry_delays: vec![Duration::from_millis(10)],
        ..config(&[])
    }
    .with_secret_header("Authorization", "Bearer sk_live_secret")
    .unwrap();
    let client = OutboundClient::new(config).unwrap();
    let request = server.request("/");
    let failed = client.send(&key("s"), &request).await.unwrap_err();
    let letter = failed
        .dead_letter(&Scope::parse("t", "payout").unwrap(), &key("s"), &request)
        .unwrap();
    let letters = MemoryDeadLetters::new();
    let id = letters.record(&letter).await.unwrap();
    let stored = letters.get(id).await.unwrap().unwrap();
    assert!(
        stored
            .request
            .headers()
            .iter()
            .all(|(n, _)| !n.eq_ignore_ascii_case("authorization"))
    );
    assert!(!format!("{stored:?}{failed}").contains("sk_live_secret"));
    let result = Redriver::new(client, letters).redrive_one(id).await.unwrap();
    assert!(matches!(result, RedriveResult::Resolved { .. }), "{result:?}");
    assert_eq!(
        server.header_values("authorization"),
        vec![vec!["Bearer sk_live_secret".to_owned()]; 3]
    );
}

/// The caller's guard is asked right before each attempt: once it says no (a lease run out while the call waited to retry), the call ends as `Stopped` and nothing more is sent, however many retries were left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guard_that_says_no_stops_the_call_before_the_next_send() {
    let server = Scripted::start(vec![Answer::status(500), Answer::status(201).body("{}")]).await;
    let client = OutboundClient::new(config(&[10, 10, 10])).unwrap();
    let allowed = std::sync::atomic::AtomicUsize::new(1);
    let guard = || {
        if allowed
            .fetch_update(
                std::sync::atomic::Ordering::SeqCst,
                std::sync::atomic::Ordering::SeqCst,
                |n| n.checked_sub(1),
            )
            .is_ok()
        {
            Ok(())
        } else {
            Err("the lease ran out".to_owned())
        }
    };
    let started = idem_core::SystemClock.now_ms();
    let result = client
        .resend_while(
            &key("po-guard"),
            &server.request("/v1/payouts"),
            Earlier::default(),
            &guard,
        )
        .await;
    match result {
        Err(OutboundError::Stopped {
            attempts,
            reason,
            first_reached_at_ms,
        }) => {
            assert_eq!(attempts, 1, "the attempt the guard stopped is not counted");
            assert!(reason.contains("the lease ran out"), "{reason}");
            // The 500 may have been applied: a later holder must know.
            assert!(first_reached_at_ms.is_some_and(|at| at >= started));
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(server.count(), 1, "nothing sent after the guard said no");
    let stopped = OutboundError::Stopped {
        attempts: 1,
        reason: "x".into(),
        first_reached_at_ms: None,
    };
    assert!(
        stopped
            .dead_letter(
                &Scope::parse("acme", "payout").unwrap(),
                &key("k"),
                &payout("http://v", "{}")
            )
            .is_none(),
        "a stopped call is not a dead letter: its new holder carries on"
    );
}

/// A lookup that takes longer than the redrive's hold (the clock is moved while the vendor is asked, as if the process had been stopped), then says "not applied".
struct SlowLookup {
    clock: ManualClock,
    by: Duration,
}

impl idem_outbound::Reconcile for SlowLookup {
    fn reconcile<'a>(
        &'a self,
        _key: &'a idem_core::IdempotencyKey,
        _request: &'a idem_core::OutboundRequest,
        _timeout: Duration,
    ) -> idem_core::BoxFuture<'a, Result<idem_outbound::Reconciled, String>> {
        Box::pin(async move {
            self.clock.advance(self.by);
            Ok(idem_outbound::Reconciled::NotApplied)
        })
    }
}

/// A redrive whose hold ran out while it asked the vendor (another redrive may hold the letter, have asked and sent it) sends nothing when it carries on, and leaves the letter to the redrive that holds it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redrive_whose_hold_ran_out_sends_nothing() {
    let (base, _) = vendor_with(short_horizon()).await;
    let clock = ManualClock::starting_now();
    let letters = MemoryDeadLetters::new().with_clock(Arc::new(clock.clone()));
    let request = payout(&base, r#"{"amount":9,"reference":"po-hold"}"#);
    let scope = Scope::parse("t", "payout").unwrap();
    let letter =
        idem_core::NewDeadLetter::new(scope, key("po-hold"), request, 4, "timeout").reached_at(Some(clock.now_ms()));
    let id = letters.record(&letter).await.unwrap();
    clock.advance(2 * HOUR);
    let slow = Arc::new(SlowLookup {
        clock: clock.clone(),
        by: Duration::from_secs(120),
    });
    let redriver = Redriver::new(client_at(&clock, hour_horizon()).with_reconcile(slow), letters.clone())
        .with_hold(Duration::from_secs(60));
    let result = redriver.redrive_one(id).await.unwrap();
    assert!(matches!(result, RedriveResult::HoldLost), "{result:?}");
    assert_eq!(ledger(&base).await.0, 0, "nothing sent once the hold ran out");
    // A quick enough redrive, later, sends it once.
    let quick = Arc::new(SlowLookup {
        clock: clock.clone(),
        by: Duration::ZERO,
    });
    let redriver = Redriver::new(client_at(&clock, hour_horizon()).with_reconcile(quick), letters.clone());
    let result = redriver.redrive_one(id).await.unwrap();
    assert!(
        matches!(result, RedriveResult::Resolved { status: 201, .. }),
        "{result:?}"
    );
    assert_eq!(ledger(&base).await.0, 1);
}

/// A lookup's "not applied" is trusted only once the last send has settled:
/// by default its attempt timeout plus `SETTLE_MARGIN` after it started, or
/// the client's `reconcile_settle`. Before it nothing is sent; after it the
/// call is sent once. A settle time shorter than the attempt timeout is
/// refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn not_applied_is_trusted_only_once_the_last_send_settled() {
    let (base, _) = vendor_with(short_horizon()).await;
    let clock = ManualClock::starting_now();
    let client = |settle: Option<Duration>| {
        OutboundClient::new(OutboundConfig {
            attempt_timeout: Duration::from_secs(1),
            reconcile_settle: settle,
            deadline: Duration::from_secs(2),
            ..config(&[10, 10])
        })
        .unwrap()
        .with_clock(Arc::new(clock.clone()))
        .with_reconcile(Lookup::new(&base))
    };
    let earlier = |last_sent_secs_ago: i64| Earlier {
        first_reached_at_ms: Some(clock.now_ms() - 2 * HOUR.as_millis() as i64),
        must_reconcile: true,
        last_sent_at_ms: Some(clock.now_ms() - last_sent_secs_ago * 1_000),
        ..Earlier::default()
    };
    let request = payout(&base, r#"{"amount":3,"reference":"po-settle"}"#);
    // Default: 1 s + 5 s. A send 3 s ago may still be in flight.
    let busy = client(None).resend(&key("po-settle"), &request, earlier(3)).await;
    assert!(busy.is_err(), "{busy:?}");
    assert_eq!(ledger(&base).await.0, 0, "nothing sent before the last send settled");
    // A longer settle holds a send 10 s ago that the default would trust.
    let busy = client(Some(Duration::from_secs(60)))
        .resend(&key("po-settle"), &request, earlier(10))
        .await;
    assert!(busy.is_err(), "{busy:?}");
    assert_eq!(ledger(&base).await.0, 0);
    // A shorter one trusts a send 3 s ago: sent once.
    let sent = client(Some(Duration::from_secs(2)))
        .resend(&key("po-settle"), &request, earlier(3))
        .await
        .unwrap();
    assert_eq!((sent.status, sent.reconciled), (201, false));
    assert_eq!(ledger(&base).await.0, 1);
    // Shorter than the attempt timeout: refused.
    let refused = OutboundClient::new(OutboundConfig {
        attempt_timeout: Duration::from_secs(1),
        reconcile_settle: Some(Duration::from_millis(500)),
        ..config(&[])
    });
    assert!(
        matches!(&refused, Err(OutboundError::InvalidConfig(why)) if why.contains("reconcile_settle")),
        "{refused:?}"
    );
}

/// A dead letter keeps the key horizon its sends were made under: a call to a vendor without keys, paid but its answer lost, is dead-lettered by a keyless client; a redriver configured with a 24 h horizon (an operator's defaults) does not send it blindly (held as unknown, nothing sent, paid once). A letter that does not say its terms is refused by a redriver told not to guess, neither taken nor sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redrive_keeps_to_the_horizon_the_letter_was_sent_under() {
    let (base, _) = keyless_vendor_dropping_answers().await;
    let clock = ManualClock::starting_now();
    let letters = MemoryDeadLetters::new().with_clock(Arc::new(clock.clone()));
    let scope = Scope::parse("t", "payout").unwrap();
    let request = payout(&base, r#"{"amount":7,"reference":"po-keyless"}"#);
    // No retries: the call gives up after its one send (a dead letter,
    // not an unknown outcome).
    let keyless = OutboundClient::new(OutboundConfig {
        key_horizon: KeyHorizon::NONE,
        ..config(&[])
    })
    .unwrap()
    .with_clock(Arc::new(clock.clone()));
    let failed = keyless.send(&key("po-keyless"), &request).await.unwrap_err();
    assert!(matches!(failed, OutboundError::Exhausted { .. }), "{failed:?}");
    set_faults(&base, serde_json::json!({})).await;
    assert_eq!(ledger(&base).await.0, 1, "the vendor paid; its answer was lost");
    let letter = failed.dead_letter(&scope, &key("po-keyless"), &request).expect("kept");
    let terms = letter.sent_under.expect("the letter says its terms");
    assert_eq!(terms.key_horizon, Duration::ZERO);
    let id = letters.record(&letter).await.unwrap();
    assert_eq!(letters.get(id).await.unwrap().unwrap().sent_under, Some(terms));
    clock.advance(Duration::from_secs(60));
    let day = KeyHorizon::new(Duration::from_secs(86_400), Duration::from_secs(3_600));
    let result = Redriver::new(client_at(&clock, day), letters.clone())
        .redrive_one(id)
        .await
        .unwrap();
    assert!(matches!(result, RedriveResult::Unknown { .. }), "{result:?}");
    assert_eq!(ledger(&base).await.0, 1, "never sent blindly to a vendor without keys");
    // A letter written before terms were kept: refused, not guessed.
    let old = idem_core::NewDeadLetter::new(
        scope,
        key("po-old"),
        payout(&base, r#"{"amount":7,"reference":"po-old"}"#),
        2,
        "timeout",
    )
    .reached_at(Some(clock.now_ms()));
    let old_id = letters.record(&old).await.unwrap();
    let careful = Redriver::new(client_at(&clock, day), letters.clone()).with_terms_required(true);
    let result = careful.redrive_one(old_id).await.unwrap();
    assert!(matches!(result, RedriveResult::Refused { .. }), "{result:?}");
    let kept = letters.get(old_id).await.unwrap().unwrap();
    assert_eq!(
        (kept.state, kept.redrives),
        (idem_core::DeadLetterState::Dead, 0),
        "neither taken nor sent"
    );
    assert_eq!(ledger(&base).await.0, 1);
}
