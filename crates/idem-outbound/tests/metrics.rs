//! Attempts, retries, calls and breaker transitions are counted, and the
//! `host` label stays within its cap.

mod support;

use std::collections::HashSet;

use idem_outbound::{BreakerConfig, OutboundClient, OutboundConfig, OutboundError};
use metrics_util::CompositeKey;
use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use support::{Answer, Scripted, config, key};

type Snapshot = Vec<(
    CompositeKey,
    Option<metrics::Unit>,
    Option<metrics::SharedString>,
    DebugValue,
)>;

fn value(snapshot: &Snapshot, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    snapshot.iter().find_map(|(k, _, _, v)| {
        let key = k.key();
        let matches = key.name() == name
            && labels
                .iter()
                .all(|(n, want)| key.labels().any(|l| l.key() == *n && l.value() == *want));
        match (matches, v) {
            (true, DebugValue::Counter(c)) => Some(*c as f64),
            (true, DebugValue::Gauge(g)) => Some(g.into_inner()),
            _ => None,
        }
    })
}

#[test]
fn outcomes_and_transitions_are_counted_with_bounded_hosts() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let host_a = metrics::with_local_recorder(&recorder, || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let a = Scripted::start(vec![Answer::status(500), Answer::status(200)]).await;
            let b = Scripted::start(vec![Answer::status(503)]).await;
            let c = OutboundClient::new(OutboundConfig {
                name: "vendor".into(),
                max_host_labels: 1,
                breaker: BreakerConfig {
                    failure_threshold: 2,
                    ..BreakerConfig::default()
                },
                ..config(&[1, 1])
            })
            .unwrap();
            assert_eq!(c.send(&key("a"), &a.request("/")).await.unwrap().attempts, 2);
            // Two 503s open the breaker; the third attempt is refused and
            // the schedule is used up: the call is for later (a breaker's
            // refusal sent nothing), never a dead letter.
            let e = c.send(&key("b"), &b.request("/")).await.unwrap_err();
            assert!(matches!(e, OutboundError::RetryLater { attempts: 3, .. }), "{e}");
            assert_eq!(b.count(), 2);
            // The host label: scheme://host:port, as in the base URL.
            a.base.clone()
        })
    });
    let host_a = host_a.as_str();
    // One snapshot: taking it drains the recorder.
    let snapshot: Snapshot = snapshotter.snapshot().into_vec();
    let v = |name, labels: &[(&str, &str)]| value(&snapshot, name, labels);
    let client = ("client", "vendor");
    // (metric, host, its other label as `name=value`, value); the second
    // host is past the label cap.
    let expected = [
        ("idem_outbound_attempts_total", host_a, "outcome=http_5xx", 1.0),
        ("idem_outbound_attempts_total", host_a, "outcome=success", 1.0),
        ("idem_outbound_retries_total", host_a, "", 1.0),
        ("idem_outbound_calls_total", host_a, "result=success", 1.0),
        ("idem_outbound_attempts_total", "other", "outcome=http_5xx", 2.0),
        ("idem_outbound_attempts_total", "other", "outcome=circuit_open", 1.0),
        ("idem_outbound_calls_total", "other", "result=retry_later", 1.0),
        ("idem_outbound_breaker_transitions_total", "other", "to=open", 1.0),
        ("idem_outbound_breaker_state", "other", "", 2.0),
    ];
    for (name, host, label, want) in expected {
        let labels: Vec<_> = [client, ("host", host)]
            .into_iter()
            .chain(label.split_once('='))
            .collect();
        assert_eq!(v(name, &labels), Some(want), "{name} {labels:?}");
    }
    let hosts: HashSet<String> = snapshot
        .iter()
        .flat_map(|(k, ..)| {
            k.key()
                .labels()
                .filter(|l| l.key() == "host")
                .map(|l| l.value().to_owned())
                .collect::<Vec<_>>()
        })
        .collect();
    assert_eq!(hosts, HashSet::from([host_a.to_owned(), "other".to_owned()]));
}
