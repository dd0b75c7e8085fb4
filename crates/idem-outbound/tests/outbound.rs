//! The client over real sockets: one key across retries (checked in the
//! vendor's own ledger), what retries and what does not, Retry-After, the
//! deadline, refused connections, cut-off bodies, and the circuit breaker.

mod support;

use std::time::{Duration, SystemTime};

use idem_outbound::{BreakerConfig, BreakerState, OutboundClient, OutboundConfig, OutboundError};
use support::{Answer, Scripted, config, key, ledger, payout, set_faults, stats, vendor};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn client(config: OutboundConfig) -> OutboundClient {
    OutboundClient::new(config).unwrap()
}

fn exhausted(result: Result<idem_outbound::OutboundResponse, OutboundError>) -> (u32, String) {
    match result {
        Err(OutboundError::Exhausted {
            attempts, last_error, ..
        }) => (attempts, last_error),
        other => panic!("expected Exhausted, got {other:?}"),
    }
}

fn retry_later(result: Result<idem_outbound::OutboundResponse, OutboundError>) -> (u32, String, Duration) {
    match result {
        Err(OutboundError::RetryLater {
            attempts,
            last_error,
            after,
            ..
        }) => (attempts, last_error, after),
        other => panic!("expected RetryLater, got {other:?}"),
    }
}

/// Every attempt of one call carries the same key, and only that key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_attempt_carries_the_same_key() {
    let server = Scripted::start(vec![Answer::status(500), Answer::status(503), Answer::status(201)]).await;
    let c = client(config(&[10, 10, 10]));
    let mut request = server.request("/v1/payouts");
    // A stale key header in the stored request is replaced, not doubled.
    request = idem_core::OutboundRequest::new(
        request.method(),
        request.url(),
        vec![
            ("Idempotency-Key".into(), "stale".into()),
            ("x-trace".into(), "t1".into()),
        ],
        request.body().to_vec(),
    )
    .unwrap();
    let answer = c.send(&key("pay-1"), &request).await.unwrap();
    assert_eq!((answer.status, answer.attempts), (201, 3));
    assert_eq!(answer.body, b"{\"status\":201}");
    assert_eq!(
        server.header_values("idempotency-key"),
        vec![vec!["pay-1".to_owned()]; 3]
    );
    assert_eq!(server.header_values("x-trace"), vec![vec!["t1".to_owned()]; 3]);
}

/// A configured key header name is the one sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_key_header_name_is_configurable() {
    let server = Scripted::start(vec![Answer::status(200)]).await;
    let c = client(config(&[]).with_key_header("X-Request-Key").unwrap());
    c.send(&key("k-9"), &server.request("/")).await.unwrap();
    assert_eq!(server.header_values("x-request-key"), [["k-9"]]);
    assert_eq!(server.header_values("idempotency-key"), [[""; 0]]);
}

/// The vendor fails with 500s, then works: the call succeeds and the vendor
/// paid once, under the call's key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vendor_500s_then_success_pays_once() {
    let (base, _vendor) = vendor().await;
    set_faults(&base, serde_json::json!({ "error_500": 1.0 })).await;
    let clear = {
        let base = base.clone();
        tokio::spawn(async move {
            while stats(&base).await["errors_500"].as_u64().unwrap() < 2 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            set_faults(&base, serde_json::json!({})).await;
        })
    };
    let c = client(config(&[50; 40]));
    let answer = c
        .send(&key("pay-500"), &payout(&base, r#"{"amount":100}"#))
        .await
        .unwrap();
    clear.await.unwrap();
    assert_eq!(answer.status, 201);
    assert!(answer.attempts >= 3, "{} attempts", answer.attempts);
    assert_eq!(ledger(&base).await, (1, vec!["pay-500".to_owned()]));
    assert!(stats(&base).await["errors_500"].as_u64().unwrap() >= 2);
}

/// The vendor pays and drops the connection: the retry, with the same key,
/// gets the recorded answer and nothing is paid twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn apply_then_drop_is_replayed_by_the_retry() {
    let (base, _vendor) = vendor().await;
    set_faults(&base, serde_json::json!({ "apply_then_drop": 1.0 })).await;
    let c = client(config(&[20, 20, 20]));
    let answer = c
        .send(&key("pay-drop"), &payout(&base, r#"{"amount":7}"#))
        .await
        .unwrap();
    assert_eq!((answer.status, answer.attempts), (201, 2));
    assert_eq!(answer.headers["idempotent-replayed"], "true");
    let body: serde_json::Value = serde_json::from_slice(&answer.body).unwrap();
    assert_eq!(body["amount"], 7);
    assert_eq!(ledger(&base).await, (1, vec!["pay-drop".to_owned()]));
    let s = stats(&base).await;
    assert_eq!((s["dropped"].as_u64(), s["replayed"].as_u64()), (Some(1), Some(1)));
}

/// A 4xx other than 408/425/429 ends the call at the first attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn final_rejections_are_not_retried() {
    for status in [400, 401, 404, 409, 422] {
        let server = Scripted::start(vec![Answer::status(status).body("nope")]).await;
        let result = client(config(&[10, 10])).send(&key("r"), &server.request("/")).await;
        match result {
            Err(OutboundError::Rejected {
                status: s,
                body,
                attempts,
                ..
            }) => {
                assert_eq!((s, body.as_slice(), attempts), (status, &b"nope"[..], 1));
            }
            other => panic!("{status}: {other:?}"),
        }
        assert_eq!(server.count(), 1, "{status}");
    }
    // The vendor's own 400 (a bad amount), once.
    let (base, _vendor) = vendor().await;
    let result = client(config(&[10, 10]))
        .send(&key("bad"), &payout(&base, r#"{"amount":-1}"#))
        .await;
    assert!(
        matches!(
            result,
            Err(OutboundError::Rejected {
                status: 400,
                attempts: 1,
                ..
            })
        ),
        "{result:?}"
    );
    // A redirect is not followed and not retried.
    let server = Scripted::start(vec![Answer::status(302).header("location", "http://elsewhere/")]).await;
    let result = client(config(&[10])).send(&key("redir"), &server.request("/")).await;
    assert!(
        matches!(
            result,
            Err(OutboundError::Rejected {
                status: 302,
                attempts: 1,
                ..
            })
        ),
        "{result:?}"
    );
}

/// 408 is retried.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_timeouts_are_retried() {
    let server = Scripted::start(vec![Answer::status(408), Answer::status(200)]).await;
    let answer = client(config(&[10]))
        .send(&key("t"), &server.request("/"))
        .await
        .unwrap();
    assert_eq!((answer.status, answer.attempts), (200, 2));
}

/// A 429's Retry-After, in seconds or as an HTTP-date, governs the wait:
/// past the deadline the call gives up at once; within it, it retries.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_after_is_read_in_both_forms() {
    let short_deadline = OutboundConfig {
        deadline: Duration::from_millis(500),
        ..config(&[10, 10, 10])
    };
    let soon = httpdate::fmt_http_date(SystemTime::now() + Duration::from_secs(3600));
    for retry_after in ["1".to_owned(), soon] {
        let server = Scripted::start(vec![Answer::status(429).header("retry-after", retry_after.clone())]).await;
        let (attempts, error, _) = retry_later(
            client(short_deadline.clone())
                .send(&key("ra"), &server.request("/"))
                .await,
        );
        assert_eq!(attempts, 1, "{retry_after}");
        assert!(error.contains("HTTP 429"), "{error}");
        assert!(error.contains("past the 500 ms deadline"), "{error}");
        // The scheduled 10 ms retry did not happen.
        assert_eq!(server.count(), 1);
    }
    // Within the deadline the retry happens after the wait asked for.
    let server = Scripted::start(vec![
        Answer::status(429).header("retry-after", "1"),
        Answer::status(200),
    ])
    .await;
    let answer = client(config(&[10]))
        .send(&key("ra2"), &server.request("/"))
        .await
        .unwrap();
    assert_eq!(answer.attempts, 2);
    // A date already past: retried on the schedule.
    let past = httpdate::fmt_http_date(SystemTime::now() - Duration::from_secs(60));
    let server = Scripted::start(vec![
        Answer::status(429).header("retry-after", past),
        Answer::status(200),
    ])
    .await;
    let answer = client(short_deadline)
        .send(&key("ra3"), &server.request("/"))
        .await
        .unwrap();
    assert_eq!(answer.attempts, 2);
}

/// The vendor's own 429 (rate limit fault) with Retry-After past the
/// deadline: given up at once as "retry later", with the wait asked for,
/// nothing paid.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_vendors_rate_limit_is_honoured() {
    let (base, _vendor) = vendor().await;
    set_faults(
        &base,
        serde_json::json!({ "rate_limit_429": 1.0, "retry_after_secs": 30 }),
    )
    .await;
    let c = client(OutboundConfig {
        deadline: Duration::from_secs(5),
        ..config(&[10, 10, 10])
    });
    let (attempts, error, after) = retry_later(c.send(&key("rl"), &payout(&base, r#"{"amount":1}"#)).await);
    assert_eq!(attempts, 1);
    assert_eq!(after, Duration::from_secs(30));
    assert!(error.contains("Retry-After 30s"), "{error}");
    assert_eq!(stats(&base).await["rate_limited"], 1);
    assert_eq!(ledger(&base).await.0, 0);
}

/// Refused connections are retried; all refused: Exhausted with attempts =
/// delays + 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_connections_are_retried() {
    let addr = support::free_addr();
    let request = payout(&format!("http://{addr}"), r#"{"amount":1}"#);
    let refused = client(config(&[10, 10, 10])).send(&key("x"), &request).await;
    assert_eq!(
        refused.as_ref().err().and_then(OutboundError::first_reached_at_ms),
        None,
        "a refused connection cannot have reached the vendor"
    );
    let (attempts, error) = exhausted(refused);
    assert_eq!(attempts, 4);
    assert!(error.starts_with("not sent, no connection"), "{error}");
    assert!(error.contains("no retries left (3 configured)"), "{error}");

    // The vendor refuses connections for a while, then pays once.
    let (base, _vendor) = vendor().await;
    set_faults(&base, serde_json::json!({ "refuse_ms": 400 })).await;
    let vendor_addr = base.trim_start_matches("http://").to_owned();
    while tokio::net::TcpStream::connect(&vendor_addr).await.is_ok() {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let answer = client(config(&[100; 30]))
        .send(&key("after-refusal"), &payout(&base, r#"{"amount":5}"#))
        .await
        .unwrap();
    assert_eq!(answer.status, 201);
    assert!(answer.attempts >= 2, "{} attempts", answer.attempts);
    assert_eq!(ledger(&base).await, (1, vec!["after-refusal".to_owned()]));
}

/// A body cut off mid-way is a network failure and is retried.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_cut_off_is_retried() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        for n in 0.. {
            let (mut socket, _) = listener.accept().await.unwrap();
            let mut buf = vec![0; 65536];
            let mut read = 0;
            // The request's head and its 2-byte body.
            while !buf[..read].windows(4).any(|w| w == b"\r\n\r\n") || !buf[..read].ends_with(b"{}") {
                read += socket.read(&mut buf[read..]).await.unwrap();
            }
            if n == 0 {
                socket
                    .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly ten b")
                    .await
                    .unwrap();
                // Closed with 90 bytes missing.
            } else {
                socket
                    .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\nconnection: close\r\n\r\nfull")
                    .await
                    .unwrap();
            }
        }
    });
    let request = idem_core::OutboundRequest::new("POST", format!("http://{addr}/"), vec![], b"{}".to_vec()).unwrap();
    let answer = client(config(&[10])).send(&key("cut"), &request).await.unwrap();
    assert_eq!((answer.attempts, answer.body.as_slice()), (2, &b"full"[..]));
}

/// An attempt with no answer in time is cut and retried; all of them: the
/// call is exhausted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_answers_time_out_and_are_retried() {
    let server = Scripted::start(vec![Answer::status(200).held()]).await;
    let c = client(OutboundConfig {
        attempt_timeout: Duration::from_millis(100),
        ..config(&[10, 10])
    });
    let (attempts, error) = exhausted(c.send(&key("slow"), &server.request("/")).await);
    assert_eq!((attempts, server.count()), (3, 3));
    assert!(error.starts_with("no complete answer within 100 ms"), "{error}");
}

/// Retries used up: attempts = delays + 1, each one sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exhausted_after_every_delay() {
    let server = Scripted::start(vec![Answer::status(503).body("down")]).await;
    let (attempts, error) = exhausted(client(config(&[5, 5, 5])).send(&key("e"), &server.request("/")).await);
    assert_eq!((attempts, server.count()), (4, 4));
    assert!(error.starts_with("HTTP 503: down"), "{error}");
}

/// A long body is kept up to the limit and said to be truncated.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_bodies_are_cut_at_the_limit() {
    let server = Scripted::start(vec![Answer::status(200).body("x".repeat(200_000))]).await;
    let c = client(OutboundConfig {
        max_response_body: 1024,
        ..config(&[])
    });
    let answer = c.send(&key("big"), &server.request("/")).await.unwrap();
    assert_eq!((answer.body.len(), answer.body_truncated), (1024, true));
    let small = Scripted::start(vec![Answer::status(200).body("ok")]).await;
    let answer = c.send(&key("small"), &small.request("/")).await.unwrap();
    assert_eq!((answer.body.as_slice(), answer.body_truncated), (&b"ok"[..], false));
}

/// Requests that cannot be sent are refused before any attempt.
#[tokio::test]
async fn invalid_requests_are_refused_up_front() {
    let c = client(config(&[10]));
    let request = idem_core::OutboundRequest::new("POST", "http://", vec![], vec![]).unwrap();
    let result = c.send(&key("i"), &request).await;
    assert!(matches!(result, Err(OutboundError::Invalid(_))), "{result:?}");
    assert_eq!(result.unwrap_err().attempts(), 0);
}

fn breaker_config(delays_ms: &[u64]) -> OutboundConfig {
    OutboundConfig {
        breaker: BreakerConfig {
            failure_threshold: 3,
            open_for: Duration::from_millis(300),
            max_hosts: 16,
        },
        ..config(delays_ms)
    }
}

/// A server that answers `status`, and a client whose breaker to it three
/// calls answered so have opened; the breaker's URL.
async fn opened_breaker(status: u16) -> (Scripted, OutboundClient, String) {
    let server = Scripted::start(vec![Answer::status(status)]).await;
    let c = client(breaker_config(&[]));
    let url = format!("{}/", server.base);
    for i in 0..3 {
        exhausted(c.send(&key(&format!("f{i}")), &server.request("/")).await);
    }
    (server, c, url)
}

/// Opens after N consecutive failures; refuses without sending while open;
/// half-open lets exactly one of 8 concurrent callers through; its success
/// closes the breaker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_breaker_opens_probes_once_and_closes() {
    let (server, c, url) = opened_breaker(500).await;
    assert_eq!(c.breaker_state(&url).unwrap(), BreakerState::Open);
    // Open: refused, not sent; the call is for later (it sent nothing),
    // never a dead letter.
    let (attempts, error, after) = retry_later(c.send(&key("while-open"), &server.request("/")).await);
    assert_eq!(attempts, 1);
    // The open period left (300 ms at most), never less than a second.
    assert_eq!(after, Duration::from_secs(1), "{after:?}");
    assert!(error.contains("circuit breaker of http://127.0.0.1:"), "{error}");
    assert!(error.contains("is open for"), "{error}");
    assert_eq!(server.count(), 3);
    tokio::time::sleep(Duration::from_millis(350)).await;
    server.script(vec![Answer::status(200).held()]);
    let calls: Vec<_> = (0..8)
        .map(|i| {
            let c = c.clone();
            let request = server.request("/");
            tokio::spawn(async move { c.send(&key(&format!("probe-{i}")), &request).await })
        })
        .collect();
    server.wait_for(4).await;
    // Seven are refused at once while the probe is held.
    for _ in 0..500 {
        if calls.iter().filter(|c| c.is_finished()).count() == 7 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(calls.iter().filter(|c| c.is_finished()).count(), 7);
    assert_eq!(c.breaker_state(&url).unwrap(), BreakerState::HalfOpen);
    server.release(1);
    let mut ok = 0;
    for call in calls {
        match call.await.unwrap() {
            Ok(answer) => {
                assert_eq!(answer.status, 200);
                ok += 1;
            }
            Err(OutboundError::RetryLater {
                attempts: 1,
                last_error,
                ..
            }) => {
                assert!(last_error.contains("half-open"), "{last_error}");
            }
            Err(e) => panic!("{e}"),
        }
    }
    assert_eq!((ok, server.count()), (1, 4));
    assert_eq!(c.breaker_state(&url).unwrap(), BreakerState::Closed);
    server.script(vec![Answer::status(200)]);
    c.send(&key("after"), &server.request("/")).await.unwrap();
}

/// A failed probe opens the breaker again for a full period.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_probe_reopens_the_breaker() {
    let (server, c, url) = opened_breaker(503).await;
    tokio::time::sleep(Duration::from_millis(350)).await;
    let (_, error) = exhausted(c.send(&key("probe"), &server.request("/")).await);
    assert!(error.starts_with("HTTP 503"), "{error}");
    assert_eq!(server.count(), 4);
    assert_eq!(c.breaker_state(&url).unwrap(), BreakerState::Open);
    let (_, error, _) = retry_later(c.send(&key("refused"), &server.request("/")).await);
    assert!(error.contains("is open for"), "{error}");
    assert_eq!(server.count(), 4);
}

/// Final rejections count as the host working: they do not open the
/// breaker, and they reset the failure count.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rejections_keep_the_breaker_closed() {
    let server = Scripted::start(vec![
        Answer::status(500),
        Answer::status(500),
        Answer::status(422),
        Answer::status(500),
        Answer::status(500),
        Answer::status(404),
    ])
    .await;
    let c = client(breaker_config(&[]));
    for i in 0..6 {
        let _ = c.send(&key(&format!("k{i}")), &server.request("/")).await;
    }
    assert_eq!(
        c.breaker_state(&format!("{}/", server.base)).unwrap(),
        BreakerState::Closed
    );
    assert_eq!(server.count(), 6);
}

/// A call whose retries fall inside the open period waits it out, within
/// its deadline, and then gets through as the probe.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_waits_out_the_open_period_within_its_deadline() {
    let server = Scripted::start(vec![Answer::status(500)]).await;
    let c = client(breaker_config(&[10, 10]));
    exhausted(c.send(&key("trip"), &server.request("/")).await);
    assert_eq!(server.count(), 3);
    assert_eq!(
        c.breaker_state(&format!("{}/", server.base)).unwrap(),
        BreakerState::Open
    );
    server.script(vec![Answer::status(200)]);
    let answer = c.send(&key("patient"), &server.request("/")).await.unwrap();
    // Refused once, then sent as the probe after the open period.
    assert_eq!((answer.attempts, server.count()), (2, 4));
}

/// An open period that outlasts the call's deadline ends the call at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_period_past_the_deadline_ends_the_call_at_once() {
    let server = Scripted::start(vec![Answer::status(500)]).await;
    let c = client(OutboundConfig {
        deadline: Duration::from_millis(200),
        ..breaker_config(&[10, 10])
    });
    exhausted(c.send(&key("trip"), &server.request("/")).await);
    assert_eq!(server.count(), 3);
    let (attempts, error, _) = retry_later(c.send(&key("late"), &server.request("/")).await);
    assert_eq!((attempts, server.count()), (1, 3));
    assert!(error.contains("is open for"), "{error}");
    assert!(error.contains("past the 200 ms deadline"), "{error}");
}

/// A vendor's 429s are its flow control, not a failure of the host: however
/// many, they never open the breaker, and later calls are sent; nor do they
/// count as the host working (failures around them still add up).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rate_limits_keep_the_breaker_closed() {
    let server = Scripted::start(vec![Answer::status(429)]).await;
    let c = client(breaker_config(&[]));
    for i in 0..6 {
        exhausted(c.send(&key(&format!("busy{i}")), &server.request("/")).await);
    }
    assert_eq!(
        c.breaker_state(&format!("{}/", server.base)).unwrap(),
        BreakerState::Closed
    );
    assert_eq!(server.count(), 6, "every call was sent");
    // Neutral, not healthy: 429s between failures do not hide them.
    server.script(vec![
        Answer::status(503),
        Answer::status(429),
        Answer::status(503),
        Answer::status(429),
        Answer::status(503),
    ]);
    for i in 0..5 {
        let _ = c.send(&key(&format!("mixed{i}")), &server.request("/")).await;
    }
    assert_eq!(
        c.breaker_state(&format!("{}/", server.base)).unwrap(),
        BreakerState::Open,
        "three failures in a row, 429s between them"
    );
}
