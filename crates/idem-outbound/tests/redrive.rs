//! Redrive against the fake vendor: the original key, one payment, the
//! vendor's recorded answer kept; caps; held and mismatched dead letters.

mod support;

use idem_core::{DeadLetterFilter, DeadLetterState, DeadLetterStore, NewDeadLetter, Scope};
use idem_memory::MemoryDeadLetters;
use idem_outbound::{OutboundClient, OutboundError, RedriveOptions, RedriveResult, Redriver};
use support::{config, key, ledger, payout, set_faults, stats, vendor};

fn scope() -> Scope {
    Scope::parse("acme", "payout").unwrap()
}

fn dead() -> DeadLetterFilter {
    DeadLetterFilter {
        state: Some(DeadLetterState::Dead),
        ..DeadLetterFilter::default()
    }
}

/// A call the vendor applied but never answered (every send dropped) is
/// dead-lettered; its redrive, with the original key, gets the vendor's
/// recorded answer: one payment, the dead letter resolved with that body.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redrive_replays_the_applied_call_and_resolves_it() {
    let (base, _vendor) = vendor().await;
    let store = MemoryDeadLetters::new();
    set_faults(&base, serde_json::json!({ "apply_then_drop": 1.0 })).await;
    let k = key("payout-42");
    let request = payout(&base, r#"{"amount":42,"reference":"inv-42"}"#);
    // No retries: the first send (applied, then dropped) is the only one.
    let c = OutboundClient::new(config(&[])).unwrap();
    let error = c.send(&k, &request).await.unwrap_err();
    assert!(matches!(error, OutboundError::Exhausted { attempts: 1, .. }), "{error}");
    let id = store
        .record(&error.dead_letter(&scope(), &k, &request).unwrap())
        .await
        .unwrap();
    assert_eq!(ledger(&base).await, (1, vec!["payout-42".to_owned()]));

    set_faults(&base, serde_json::json!({})).await;
    let redriver = Redriver::new(OutboundClient::new(config(&[10, 10])).unwrap(), store.clone());
    let report = redriver.redrive(&dead(), RedriveOptions::default()).await.unwrap();
    assert_eq!(
        (report.resolved, report.failed, report.skipped, report.errors),
        (1, 0, 0, 0)
    );
    assert_eq!(report.items[0].id, id);
    assert_eq!(
        report.items[0].result,
        RedriveResult::Resolved {
            status: 201,
            attempts: 1
        }
    );
    // Still one payment; the redrive was a replay.
    assert_eq!(ledger(&base).await, (1, vec!["payout-42".to_owned()]));
    assert_eq!(stats(&base).await["replayed"], 1);
    let letter = store.get(id).await.unwrap().unwrap();
    assert_eq!(letter.state, DeadLetterState::Resolved);
    assert_eq!(letter.response_status, Some(201));
    // The body kept is the one the vendor recorded when it paid.
    let replay = idem_tls::test_pki::http_client()
        .post(format!("{base}/v1/payouts"))
        .header("idempotency-key", "payout-42")
        .header("content-type", "application/json")
        .body(r#"{"amount":42,"reference":"inv-42"}"#)
        .send()
        .await
        .unwrap();
    let recorded: serde_json::Value = replay.json().await.unwrap();
    let kept: serde_json::Value = serde_json::from_slice(letter.response_body.as_deref().unwrap()).unwrap();
    assert_eq!(kept, recorded);
    assert_eq!(kept["amount"], 42);
    // Resolved: a second run has nothing to do.
    let again = redriver.redrive_one(id).await.unwrap();
    assert_eq!(again, RedriveResult::Skipped);
}

/// `max` bounds the dead letters considered; one held by another redrive is
/// skipped; what is past the cap stays dead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redrives_are_capped_and_held_letters_skipped() {
    let (base, _vendor) = vendor().await;
    let store = MemoryDeadLetters::new();
    let mut ids = Vec::new();
    for i in 0..5 {
        let letter = NewDeadLetter::new(
            scope(),
            key(&format!("cap-{i}")),
            payout(&base, &format!(r#"{{"amount":{}}}"#, i + 1)),
            5,
            "HTTP 503",
        );
        ids.push(store.record(&letter).await.unwrap());
    }
    // Another redrive holds the second one.
    let _held = store.begin_redrive(ids[1], 60_000).await.unwrap().unwrap();
    let redriver = Redriver::new(OutboundClient::new(config(&[])).unwrap(), store.clone());
    let all = DeadLetterFilter::default();
    let report = redriver
        .redrive(
            &all,
            RedriveOptions {
                max: 3,
                per_second: 100,
            },
        )
        .await
        .unwrap();
    let results: Vec<_> = report.items.iter().map(|i| (i.id, i.result.clone())).collect();
    let resolved = RedriveResult::Resolved {
        status: 201,
        attempts: 1,
    };
    assert_eq!(
        results,
        [
            (ids[0], resolved.clone()),
            (ids[1], RedriveResult::Skipped),
            (ids[2], resolved)
        ]
    );
    assert_eq!((report.resolved, report.skipped), (2, 1));
    assert_eq!(ledger(&base).await, (2, vec!["cap-0".to_owned(), "cap-2".to_owned()]));
    for (id, state) in [
        (ids[0], DeadLetterState::Resolved),
        (ids[1], DeadLetterState::Redriving),
        (ids[2], DeadLetterState::Resolved),
        (ids[3], DeadLetterState::Dead),
        (ids[4], DeadLetterState::Dead),
    ] {
        assert_eq!(store.get(id).await.unwrap().unwrap().state, state, "{id}");
    }
    // The next run takes the rest (the held one is not dead), page by page.
    let report = redriver
        .redrive(
            &DeadLetterFilter { limit: 1, ..dead() },
            RedriveOptions {
                max: 10,
                per_second: 100,
            },
        )
        .await
        .unwrap();
    assert_eq!((report.resolved, report.items.len()), (2, 2));
    assert_eq!(ledger(&base).await.0, 4);
}

/// The vendor refuses the stored request (its key was used with another
/// body): the redrive fails, the dead letter is dead again with the error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mismatched_body_fails_the_redrive() {
    let (base, _vendor) = vendor().await;
    let c = OutboundClient::new(config(&[10])).unwrap();
    c.send(&key("same-key"), &payout(&base, r#"{"amount":100}"#))
        .await
        .unwrap();
    let store = MemoryDeadLetters::new();
    let id = store
        .record(&NewDeadLetter::new(
            scope(),
            key("same-key"),
            payout(&base, r#"{"amount":200}"#),
            5,
            "HTTP 503",
        ))
        .await
        .unwrap();
    let redriver = Redriver::new(c, store.clone());
    match redriver.redrive_one(id).await.unwrap() {
        RedriveResult::Failed { attempts, error } => {
            assert_eq!(attempts, 1);
            assert!(error.contains("rejected with HTTP 422"), "{error}");
            assert!(error.contains("idempotency_key_reused"), "{error}");
        }
        other => panic!("{other:?}"),
    }
    let letter = store.get(id).await.unwrap().unwrap();
    assert_eq!(letter.state, DeadLetterState::Dead);
    assert_eq!(letter.attempts, 6);
    assert!(letter.last_error.contains("422"), "{}", letter.last_error);
    assert_eq!(ledger(&base).await.0, 1);
    assert_eq!(stats(&base).await["mismatched"], 1);
}

/// Redrive refuses a pace it cannot keep.
#[tokio::test]
async fn a_zero_rate_is_refused() {
    let redriver = Redriver::new(OutboundClient::new(config(&[])).unwrap(), MemoryDeadLetters::new());
    let result = redriver
        .redrive(&dead(), RedriveOptions { max: 1, per_second: 0 })
        .await;
    assert!(matches!(result, Err(OutboundError::InvalidConfig(_))), "{result:?}");
}
