use std::time::Duration;

use super::*;

fn new(unknown: bool, reached: Option<i64>) -> NewDeadLetter {
    let letter = NewDeadLetter::new(
        Scope::parse("t", "payout").unwrap(),
        IdempotencyKey::new("k").unwrap(),
        OutboundRequest::new("POST", "http://v/v1/payouts", vec![], b"{}".to_vec()).unwrap(),
        2,
        "timeout",
    )
    .reached_at(reached)
    .sent_under(SentUnder {
        key_horizon: Duration::from_secs(86_400),
        horizon_margin: Duration::from_secs(3_600),
        settle: Duration::from_secs(35),
    });
    if unknown { letter.outcome_unknown() } else { letter }
}

/// Proves a letter recorded again under other terms keeps the terms
/// safe for every send: the shortest horizon, the longest margin and
/// settle time; a letter without terms takes the new ones.
#[test]
fn recording_again_keeps_the_strictest_terms() {
    let mut l = DeadLetter::created(&new(false, Some(5)), 100);
    let keyless = SentUnder {
        key_horizon: Duration::ZERO,
        horizon_margin: Duration::ZERO,
        settle: Duration::from_secs(10),
    };
    assert!(l.on_record(&new(false, None).sent_under(keyless), 110));
    assert_eq!(
        l.sent_under,
        Some(SentUnder {
            key_horizon: Duration::ZERO,
            horizon_margin: Duration::from_secs(3_600),
            settle: Duration::from_secs(35),
        })
    );
    let mut bare = new(false, None);
    bare.sent_under = None;
    let mut old = DeadLetter::created(&bare, 100);
    assert_eq!(old.sent_under, None);
    assert!(old.on_record(&new(false, None).sent_under(keyless), 110));
    assert_eq!(old.sent_under, Some(keyless));
    let before = old.sent_under;
    assert!(old.on_record(&bare, 120));
    assert_eq!(
        old.sent_under, before,
        "a record that does not say keeps the known terms"
    );
}

/// A redrive killed after its send (its hold runs out, nothing stored)
/// leaves its take as the first send that may have reached the vendor:
/// an older "not applied" no longer makes the letter cancellable, a
/// later redrive that fails keeps that reach, and only a verdict asked
/// after it clears it.
#[test]
fn a_crashed_redrive_leaves_its_reach_behind() {
    let mut letter = DeadLetter::created(&new(false, None), 1_000);
    let not_applied = Settlement {
        verdict: Verdict::NotApplied,
        by: VerdictSource::Operator,
        status: None,
        body: Vec::new(),
        note: "checked the vendor's dashboard".into(),
    };
    assert!(letter.settle(&not_applied, 2_000));
    assert!(letter.known_not_applied(), "before any redrive it may be cancelled");
    // A redrive takes it and is killed after its send.
    assert_eq!(letter.take(3_000, 10_000).unwrap(), Some(1));
    assert_eq!(letter.first_reached_at_ms, Some(3_000), "the take is the sent mark");
    assert!(!letter.known_not_applied(), "a send may have reached the vendor since");
    // Its hold runs out; a later redrive meets only refused connections.
    assert_eq!(letter.take(20_000, 10_000).unwrap(), Some(2));
    assert_eq!(letter.first_reached_at_ms, Some(3_000), "the earliest reach is kept");
    let refused = RedriveOutcome::Failed {
        attempts: 3,
        error: "connection refused".into(),
        first_reached_at_ms: None,
        not_applied_at_ms: None,
    };
    assert!(letter.finish(2, &refused, 21_000));
    assert_eq!(
        letter.first_reached_at_ms,
        Some(3_000),
        "a failed redrive keeps the reach"
    );
    assert!(
        !letter.cancel(22_000),
        "a letter that may have been paid is never cancelled"
    );
    // The vendor, asked during a redrive, says it never applied it.
    assert_eq!(letter.take(30_000, 10_000).unwrap(), Some(3));
    let asked = RedriveOutcome::Failed {
        attempts: 1,
        error: "vendor refused".into(),
        first_reached_at_ms: None,
        not_applied_at_ms: Some(30_500),
    };
    assert!(letter.finish(3, &asked, 31_000));
    assert_eq!(letter.first_reached_at_ms, None);
    assert!(letter.cancel(32_000), "now known not applied");
}

/// A redrive that ends unknown keeps the earliest reach too.
#[test]
fn an_unknown_redrive_keeps_the_earliest_reach() {
    let mut letter = DeadLetter::created(&new(false, Some(500)), 1_000);
    assert_eq!(letter.take(3_000, 10_000).unwrap(), Some(1));
    assert_eq!(letter.first_reached_at_ms, Some(500));
    let unknown = RedriveOutcome::Unknown {
        attempts: 1,
        reason: "no reconcile hook".into(),
        first_reached_at_ms: Some(3_100),
    };
    assert!(letter.finish(1, &unknown, 4_000));
    assert_eq!(letter.first_reached_at_ms, Some(500));
}

/// Proves requests are validated, credentials refused, and stored credentials dropped on reading.
#[test]
fn requests_are_validated() {
    let ok = OutboundRequest::new(
        "POST",
        "https://vendor.example/v1/payouts?x=1",
        vec![("content-type".into(), "application/json".into())],
        b"{}".to_vec(),
    );
    assert!(ok.is_ok());
    for (method, url) in [
        ("", "http://v/"),
        ("GE\nT", "http://v/"),
        ("POST", "/relative"),
        ("POST", "http://v/a b"),
        ("POST", "javascript:alert(1)"),
    ] {
        assert!(
            OutboundRequest::new(method, url, vec![], vec![]).is_err(),
            "{method} {url}"
        );
    }
    let crlf = OutboundRequest::new("POST", "http://v/", vec![("x".into(), "a\r\nb: c".into())], vec![]);
    assert!(crlf.is_err());
    let big = OutboundRequest::new("POST", "http://v/", vec![], vec![0; MAX_DEAD_LETTER_BODY + 1]);
    assert!(big.is_err());
    for name in ["Authorization", "cookie", "X-API-Key", "Proxy-Authorization"] {
        let secret = vec![(name.to_owned(), "s3cret".to_owned())];
        let e = OutboundRequest::new("POST", "http://v/", secret.clone(), vec![]).unwrap_err();
        assert!(!e.to_string().contains("s3cret"), "{e}");
        let stored = OutboundRequest::stored("POST".into(), "http://v/".into(), secret, vec![]).unwrap();
        assert!(stored.headers().is_empty(), "{name} dropped on reading");
    }
    let moved = ok.unwrap().with_url("http://other:81/v1/payouts").unwrap();
    assert_eq!(moved.url(), "http://other:81/v1/payouts");
    assert!(moved.with_url("ftp://x").is_err());
}

/// Proves text and bodies are bounded without splitting a character.
#[test]
fn text_and_bodies_are_clipped_on_a_character_boundary() {
    let long = "é".repeat(MAX_DEAD_LETTER_TEXT);
    let clipped = clip_text(&long);
    assert!(clipped.len() <= MAX_DEAD_LETTER_TEXT && clipped.len() >= MAX_DEAD_LETTER_TEXT - 1);
    assert_eq!(clip_text("short"), "short");
    let binary = vec![0xFF; MAX_DEAD_LETTER_RESPONSE + 10];
    assert_eq!(clip_response(&binary).len(), MAX_DEAD_LETTER_RESPONSE);
    assert_eq!(clip_body(&binary).len(), MAX_DEAD_LETTER_TEXT);
    let text = "é".repeat(MAX_DEAD_LETTER_RESPONSE);
    assert!(std::str::from_utf8(clip_response(text.as_bytes())).is_ok());
}

/// Proves holds and page sizes are checked.
#[test]
fn holds_and_pages_are_checked() {
    assert!(redrive_hold_ms(0).is_err());
    assert!(redrive_hold_ms(-5).is_err());
    assert_eq!(redrive_hold_ms(i64::MAX).unwrap(), i64::MAX / 4);
    for (limit, ok) in [
        (0, false),
        (1, true),
        (MAX_DEAD_LETTER_PAGE, true),
        (MAX_DEAD_LETTER_PAGE + 1, false),
    ] {
        let filter = DeadLetterFilter {
            limit,
            ..DeadLetterFilter::default()
        };
        assert_eq!(filter.check().is_ok(), ok, "{limit}");
    }
}

/// Proves every state, verdict and source round-trips through its stored form.
#[test]
fn states_round_trip() {
    for s in [
        DeadLetterState::Dead,
        DeadLetterState::Redriving,
        DeadLetterState::Resolved,
        DeadLetterState::Unknown,
        DeadLetterState::Cancelled,
    ] {
        assert_eq!(DeadLetterState::parse(s.as_str()).unwrap(), s);
    }
    assert!(DeadLetterState::parse("gone").is_err());
    for v in [Verdict::Applied, Verdict::NotApplied, Verdict::Unknown] {
        assert_eq!(Verdict::parse(v.as_str()).unwrap(), v);
    }
    for b in [VerdictSource::Vendor, VerdictSource::Operator, VerdictSource::Sender] {
        assert_eq!(VerdictSource::parse(b.as_str()).unwrap(), b);
    }
}

/// Proves recording again keeps a redrive's hold, keeps the earliest reach, and holds an unknown outcome.
#[test]
fn recording_again_never_drops_a_hold_or_a_hold_for_an_operator() {
    let mut l = DeadLetter::created(&new(false, Some(50)), 100);
    assert_eq!(l.state, DeadLetterState::Dead);
    let token = l.take(110, 1000).unwrap().unwrap();
    assert!(l.on_record(&new(false, Some(40)), 120));
    assert_eq!(l.state, DeadLetterState::Redriving, "the hold stands");
    assert_eq!(l.redrive_until_ms, Some(1110));
    assert_eq!(l.first_reached_at_ms, Some(40));
    assert_eq!(l.attempts, 4);
    assert!(l.finish(
        token,
        &RedriveOutcome::Failed {
            attempts: 1,
            error: "x".into(),
            first_reached_at_ms: Some(60),
            not_applied_at_ms: None
        },
        130
    ));
    assert_eq!(
        l.first_reached_at_ms,
        Some(40),
        "a failed redrive never moves the earliest reach later"
    );
    assert!(l.on_record(&new(true, None), 140));
    assert_eq!(l.state, DeadLetterState::Unknown);
    assert!(l.on_record(&new(false, None), 150));
    assert_eq!(l.state, DeadLetterState::Unknown, "an unknown outcome stays held");
}

/// Proves cancelling needs a "not applied" verdict with no send that may have reached the vendor after it.
#[test]
fn only_a_call_known_not_applied_is_cancelled() {
    let mut l = DeadLetter::created(&new(false, Some(50)), 100);
    assert!(!l.cancel(101), "no verdict");
    let not_applied = Settlement {
        verdict: Verdict::NotApplied,
        by: VerdictSource::Operator,
        status: None,
        body: vec![],
        note: "checked the dashboard".into(),
    };
    assert!(l.settle(&not_applied, 102));
    assert!(l.known_not_applied());
    l.on_record(&new(false, Some(103)), 104);
    assert!(!l.known_not_applied(), "a later send may have reached the vendor");
    assert!(!l.cancel(105));
    assert!(l.settle(&not_applied, 106));
    assert!(l.cancel(107));
    assert_eq!(l.state, DeadLetterState::Cancelled);
    assert!(!l.settle(&not_applied, 108), "final");
    assert!(!l.on_record(&new(false, Some(1)), 109), "final");
    assert!(l.take(110, 10).unwrap().is_none());
}

/// Proves rows round-trip through their plain values, and corrupt values are reported, not panicked on.
#[test]
fn rows_round_trip_and_corruption_is_an_error() {
    let mut l = DeadLetter::created(&new(true, Some(5)), 100);
    l.id = 7;
    let row = DeadLetterRow::of(&l).unwrap();
    assert_eq!(row.clone().decode().unwrap(), l);
    for broken in [
        DeadLetterRow {
            state: "gone".into(),
            ..row.clone()
        },
        DeadLetterRow {
            attempts: -1,
            ..row.clone()
        },
        DeadLetterRow {
            headers: "{".into(),
            ..row.clone()
        },
        DeadLetterRow {
            verdict_by: None,
            ..row.clone()
        },
        DeadLetterRow {
            settle_ms: None,
            ..row.clone()
        },
        DeadLetterRow {
            key_horizon_ms: Some(-1),
            ..row.clone()
        },
    ] {
        assert!(broken.decode().is_err());
    }
}
