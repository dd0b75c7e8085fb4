//! `idem events dead-letters` and `idem events redrive` against the real
//! NATS JetStream server (`IDEM_TEST_NATS_URL`, default
//! `nats://127.0.0.1:4222`), on streams of the test's own.

mod support;

use std::time::Duration;

use idem_conformance::env::nats_url;
use idem_jetstream::async_nats::{self, jetstream, jetstream::stream};
use support::idem_out as idem;

/// `idem events <sub> --nats-url <url> --stream <stream> <rest…>`, as
/// `idem_out` answers.
fn idem_events(url: &str, stream: &str, sub_and_rest: &[&str]) -> (i32, serde_json::Value, String) {
    let (sub, rest) = sub_and_rest.split_first().expect("a subcommand");
    let args: Vec<&str> = ["events", sub, "--nats-url", url, "--stream", stream]
        .into_iter()
        .chain(rest.iter().copied())
        .collect();
    idem(&args)
}

/// Lists dead letters by handler, redrives them capped at `--max` (the copy
/// goes to the event's subject for that handler alone, and the letter leaves
/// the stream), and refuses bad input with exit 2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_are_listed_and_redriven_for_their_handler() {
    let url = nats_url();
    let client = async_nats::connect(&url)
        .await
        .unwrap_or_else(|e| panic!("cannot reach NATS at {url} (set IDEM_TEST_NATS_URL): {e}"));
    let js = jetstream::new(client);
    let t = uuid::Uuid::now_v7().simple().to_string();
    let tag = &t[t.len() - 12..];
    let (events, dead) = (format!("CLIEV_{tag}"), format!("CLIDEAD_{tag}"));
    for (name, subject) in [(&events, format!("cliev_{tag}.>")), (&dead, format!("clidead_{tag}"))] {
        js.create_stream(stream::Config {
            name: name.clone(),
            subjects: vec![subject],
            max_age: Duration::from_secs(3_600),
            storage: stream::StorageType::Memory,
            ..Default::default()
        })
        .await
        .expect("create the stream");
    }
    // Three dead letters as a consumer keeps them: two of handler a, one of b.
    for (i, handler) in ["a", "a", "b"].into_iter().enumerate() {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("Idem-Event-Id", format!("e{i}").as_str());
        headers.insert("Idem-Handler", handler);
        headers.insert("Idem-Subject", format!("cliev_{tag}.created").as_str());
        headers.insert("Idem-Deliveries", "5");
        headers.insert("Idem-Error", "transient failure: the database is down");
        let publish = jetstream::message::PublishMessage::build()
            .headers(headers)
            .message_id(format!("{handler}:e{i}"))
            .payload(format!("{{\"n\":{i}}}").into());
        js.send_publish(format!("clidead_{tag}"), publish)
            .await
            .unwrap()
            .await
            .unwrap();
    }

    let (code, v, out) = idem_events(&url, &dead, &["dead-letters", "--handler", "a", "--json"]);
    assert_eq!(code, 0, "{out}");
    let letters = v["dead_letters"].as_array().expect("a list");
    assert_eq!(letters.len(), 2, "{v}");
    assert_eq!(letters[0]["event_id"], "e0");
    assert_eq!(letters[0]["deliveries"], 5);

    let (code, v, out) = idem_events(&url, &dead, &["redrive", "--handler", "a", "--max", "1", "--json"]);
    assert_eq!(code, 0, "{out}");
    assert_eq!(v["redriven"].as_array().map(Vec::len), Some(1), "capped at --max: {v}");
    let mut s = js.get_stream(&events).await.unwrap();
    assert_eq!(s.info().await.unwrap().state.messages, 1);
    let copy = s.get_raw_message(1).await.unwrap();
    assert_eq!(
        copy.headers.get("Idem-Redrive").map(|h| h.as_str().to_owned()),
        Some("a".into())
    );
    assert_eq!(
        copy.headers.get("Idem-Event-Id").map(|h| h.as_str().to_owned()),
        Some("e0".into())
    );
    assert_eq!(copy.payload.as_ref(), br#"{"n":0}"#);

    let (code, v, out) = idem_events(&url, &dead, &["dead-letters", "--json"]);
    assert_eq!(code, 0, "{out}");
    let left: Vec<_> = v["dead_letters"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["event_id"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(left, ["e1", "e2"], "the redriven letter left the stream");

    // Bad input: exit 2, nothing written.
    let (code, v, _) = idem(&[
        "events",
        "redrive",
        "--nats-url",
        &url,
        "--stream",
        "NO_SUCH_STREAM_x",
        "--json",
    ]);
    assert_eq!(code, 2, "{v}");
    assert!(
        v["error"].as_str().unwrap_or_default().contains("NO_SUCH_STREAM_x"),
        "{v}"
    );
    let (code, _, _) = idem_events(&url, &dead, &["redrive", "--handler", ""]);
    assert_eq!(code, 2);
    let (code, _, _) = idem_events(&url, &dead, &["redrive", "--max", "0"]);
    assert_eq!(code, 2);
    let (code, _, out) = idem(&[
        "events",
        "dead-letters",
        "--nats-url",
        "nats://127.0.0.1:1",
        "--stream",
        &dead,
    ]);
    assert_eq!(code, 3, "{out}");
    assert_eq!(s.info().await.unwrap().state.messages, 1, "nothing more published");

    let _ = js.delete_stream(&events).await;
    let _ = js.delete_stream(&dead).await;
}
