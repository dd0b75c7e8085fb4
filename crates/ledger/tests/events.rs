//! The ledger's events end to end on every engine, against the real NATS
//! JetStream server (`IDEM_TEST_NATS_URL`, default `nats://127.0.0.1:4222`):
//! every committed mutation publishes one event, a refused one none, and the
//! statement projection converges on the ledger's balances. The balance
//! snapshots job runs once per run id from the CLI.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::*;
use idem_conformance::env::nats_url;

/// A namespace of the test's own.
fn namespace() -> String {
    format!("t{}", &uuid::Uuid::now_v7().simple().to_string()[20..])
}

/// The ledger on `url`, publishing its events to NATS under namespace `ns`,
/// with the further arguments `args`.
fn start_with_nats(url: &str, ns: &str, args: &[&str]) -> Instance {
    let nats = nats_url();
    let all: Vec<&str> = ["--nats-url", &nats, "--events-namespace", ns]
        .into_iter()
        .chain(args.iter().copied())
        .collect();
    Instance::start_with(url, &all)
}

/// The name of namespace `ns`'s stream `kind` (`EVENTS`, `DEAD`).
fn stream_name(ns: &str, kind: &str) -> String {
    format!("{}_{kind}", ns.to_ascii_uppercase())
}

/// Creates the file-stored stream `config` (as an earlier ledger would
/// have, or as a test prepares it).
///
/// nats-server removes an account's storage folder when its last file
/// stream is deleted; a stream created by a parallel test in that moment is
/// refused with "error creating store for stream" (10049) or "stream store
/// failed" (10077). Those two are tried again, a few times; anything else
/// fails the test at once.
async fn create_file_stream(
    js: &async_nats::jetstream::Context,
    config: async_nats::jetstream::stream::Config,
) -> async_nats::jetstream::stream::Stream {
    use async_nats::jetstream::ErrorCode;
    use async_nats::jetstream::context::CreateStreamErrorKind;
    let mut attempt = 0;
    loop {
        match js.create_stream(config.clone()).await {
            Ok(stream) => return stream,
            Err(e) => {
                let raced = matches!(e.kind(), CreateStreamErrorKind::JetStream(j)
                    if [ErrorCode::STREAM_CREATE, ErrorCode::STREAM_STORE_FAILED].contains(&j.error_code()));
                attempt += 1;
                assert!(raced && attempt < 10, "create the stream {}: {e}", config.name);
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// Deletes namespace `ns`'s streams.
async fn delete_streams(js: &async_nats::jetstream::Context, ns: &str) {
    let _ = js.delete_stream(stream_name(ns, "EVENTS")).await;
    let _ = js.delete_stream(stream_name(ns, "DEAD")).await;
}

struct Client {
    http: reqwest::Client,
    base: String,
    token: String,
}

impl Client {
    /// A client of `ledger`, with a new tenant's token.
    fn of(ledger: &Instance) -> Self {
        Self {
            http: idem_tls::test_pki::http_client(),
            base: ledger.base.clone(),
            token: token(),
        }
    }

    async fn post(&self, path: &str, body: serde_json::Value) -> (u16, serde_json::Value) {
        let r = self
            .http
            .post(format!("{}{path}", self.base))
            .bearer_auth(&self.token)
            .header("idempotency-key", format!("\"{}\"", uuid::Uuid::now_v7()))
            .json(&body)
            .send()
            .await
            .unwrap();
        let status = r.status().as_u16();
        (status, r.json().await.unwrap_or(serde_json::Value::Null))
    }

    async fn get(&self, path: &str) -> serde_json::Value {
        let r = self
            .http
            .get(format!("{}{path}", self.base))
            .bearer_auth(&self.token)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "{path}");
        r.json().await.unwrap()
    }

    async fn webhook(&self, event_id: &str, account: &str, amount: i64) -> u16 {
        let body = format!(r#"{{"event_id":"{event_id}","account_id":"{account}","amount":{amount}}}"#);
        let ts = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs() as i64;
        let sig = idem_webhooks::sign(ledger::api::DEMO_WEBHOOK_SECRET, event_id, ts, body.as_bytes()).unwrap();
        self.http
            .post(format!("{}/v1/webhooks/payments", self.base))
            .bearer_auth(&self.token)
            .header("content-type", "application/json")
            .header("webhook-id", event_id)
            .header("webhook-timestamp", ts.to_string())
            .header("webhook-signature", sig)
            .body(body)
            .send()
            .await
            .unwrap()
            .status()
            .as_u16()
    }
}

/// Event types of every message in a stream.
async fn stream_types(js: &async_nats::jetstream::Context, stream: &str) -> Vec<String> {
    let mut s = js.get_stream(stream).await.expect("the stream");
    let state = s.info().await.unwrap().state.clone();
    let mut out = Vec::new();
    if state.messages == 0 {
        return out;
    }
    for seq in state.first_sequence..=state.last_sequence {
        if let Ok(m) = s.get_raw_message(seq).await {
            let v: serde_json::Value = serde_json::from_slice(&m.payload).unwrap();
            assert_eq!(v["version"], 1);
            assert_eq!(
                m.headers.get("Nats-Msg-Id").map(|h| h.as_str().to_owned()),
                v["id"].as_str().map(str::to_owned),
                "Nats-Msg-Id is the event id"
            );
            out.push(v["type"].as_str().unwrap().to_owned());
        }
    }
    out
}

async fn events_reach_the_projection(engine: Engine) {
    let ns = namespace();
    let url = database_url(engine);
    let ledger = start_with_nats(&url, &ns, &["--relays", "2", "--projectors", "2"]);
    let c = Client::of(&ledger);
    let mut accounts = Vec::new();
    for name in ["a", "b", "c"] {
        let (status, v) = c.post("/v1/accounts", serde_json::json!({ "name": name })).await;
        assert_eq!(status, 201);
        accounts.push(v["id"].as_str().unwrap().to_owned());
    }
    let mut committed = 3;
    for (i, a) in accounts.iter().enumerate() {
        let (status, _) = c
            .post(
                "/v1/top-ups",
                serde_json::json!({ "account_id": a, "amount": 100 * (i as i64 + 1) }),
            )
            .await;
        assert_eq!(status, 201);
        committed += 1;
    }
    for k in 0..10 {
        let (from, to) = (&accounts[k % 3], &accounts[(k + 1) % 3]);
        let (status, _) = c
            .post(
                "/v1/transfers",
                serde_json::json!({ "from": from, "to": to, "amount": 7 }),
            )
            .await;
        assert_eq!(status, 201);
        committed += 1;
    }
    // Refused: insufficient funds. No event.
    let (status, _) = c
        .post(
            "/v1/transfers",
            serde_json::json!({ "from": accounts[0], "to": accounts[1], "amount": 1_000_000 }),
        )
        .await;
    assert_eq!(status, 422);
    assert_eq!(c.webhook(&format!("evt_{ns}"), &accounts[2], 55).await, 200);
    assert_eq!(
        c.webhook(&format!("evt_{ns}"), &accounts[2], 55).await,
        200,
        "a redelivery"
    );
    committed += 1;

    // The projection converges on the ledger's balances.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let mut done = true;
        for a in &accounts {
            let balance = c.get(&format!("/v1/accounts/{a}")).await["balance"].as_i64().unwrap();
            let statement = c.get(&format!("/v1/accounts/{a}/statement")).await;
            done &= statement["balance"].as_i64() == Some(balance);
        }
        if done {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "the projection did not converge");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let statement = c.get(&format!("/v1/accounts/{}/statement", accounts[2])).await;
    assert_eq!(
        statement["credits"].as_i64().unwrap() - statement["debits"].as_i64().unwrap(),
        statement["balance"].as_i64().unwrap()
    );

    // Every committed mutation published exactly one event, the refused one none.
    let client = async_nats::connect(nats_url()).await.expect("NATS");
    let js = async_nats::jetstream::new(client);
    let stream = stream_name(&ns, "EVENTS");
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let types = loop {
        let types = stream_types(&js, &stream).await;
        if types.len() >= committed || std::time::Instant::now() > deadline {
            break types;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let mut counts = BTreeMap::new();
    for t in &types {
        *counts.entry(t.as_str()).or_insert(0) += 1;
    }
    assert_eq!(types.len(), committed, "{counts:?}");
    assert_eq!(counts.get("account.created"), Some(&3));
    assert_eq!(counts.get("top_up.created"), Some(&3));
    assert_eq!(counts.get("transfer.created"), Some(&10));
    assert_eq!(counts.get("webhook_top_up.created"), Some(&1));
    drop(ledger);
    delete_streams(&js, &ns).await;
}

/// `ledger job snapshots --run-id X` twice: the second run does nothing.
async fn the_snapshot_job_runs_once_per_run_id(engine: Engine) {
    let url = database_url(engine);
    // Make sure the schema exists.
    drop(Instance::start(&url));
    let run_id = format!("test-{}", uuid::Uuid::now_v7());
    let run = || {
        std::process::Command::new(env!("CARGO_BIN_EXE_ledger"))
            .args(["--database-url", &url, "job", "snapshots", "--run-id", &run_id])
            .env("NO_COLOR", "1")
            .output()
            .expect("the job runs")
    };
    let first = run();
    assert!(first.status.success(), "{}", String::from_utf8_lossy(&first.stderr));
    let first = String::from_utf8_lossy(&first.stdout).into_owned();
    assert!(first.contains(&format!("run {run_id}: applied")), "{first}");
    let second = run();
    assert!(second.status.success());
    let second = String::from_utf8_lossy(&second.stdout).into_owned();
    assert!(second.contains("already applied; nothing done"), "{second}");
}

/// The namespace's streams, created as the ledger creates them, with the
/// projection's durable consumer (acknowledged explicitly, as the
/// projection's is) made beforehand with the rest of `consumer`.
async fn prepare(ns: &str, consumer: async_nats::jetstream::consumer::pull::Config) -> async_nats::jetstream::Context {
    use async_nats::jetstream::stream;
    let js = async_nats::jetstream::new(async_nats::connect(nats_url()).await.expect("NATS"));
    let events = create_file_stream(
        &js,
        stream::Config {
            name: stream_name(ns, "EVENTS"),
            subjects: vec![format!("{ns}.events.>")],
            duplicate_window: Duration::from_secs(120),
            max_age: Duration::from_secs(6 * 86_400),
            ..Default::default()
        },
    )
    .await;
    events
        .create_consumer(async_nats::jetstream::consumer::pull::Config {
            durable_name: Some(format!("{ns}-statements")),
            ack_policy: async_nats::jetstream::consumer::AckPolicy::Explicit,
            ..consumer
        })
        .await
        .expect("the projection's consumer");
    js
}

async fn health(base: &str) -> (u16, serde_json::Value) {
    let r = idem_tls::test_pki::get(format!("{base}/healthz")).await.unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or_default())
}

/// A projection setting the consumer refuses (here a server-side delivery
/// bound) stops the projection only: the relays publish anyway, and the
/// refusal is in `/healthz` (503) and the metrics.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_refused_projection_setting_does_not_stop_the_relays() {
    let ns = namespace();
    let js = prepare(
        &ns,
        async_nats::jetstream::consumer::pull::Config {
            max_deliver: 3,
            ..Default::default()
        },
    )
    .await;
    let url = database_url(Engine::Sqlite);
    let ledger = start_with_nats(&url, &ns, &[]);
    let c = Client::of(&ledger);
    let (status, _) = c.post("/v1/accounts", serde_json::json!({ "name": "a" })).await;
    assert_eq!(status, 201);
    let stream = stream_name(&ns, "EVENTS");
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    while stream_types(&js, &stream).await.is_empty() {
        assert!(std::time::Instant::now() < deadline, "the relay published nothing");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (status, body) = health(&ledger.base).await;
    assert_eq!(status, 503, "{body}");
    assert_eq!(
        body["type"]
            .as_str()
            .map(|t| t.ends_with("events-configuration-refused")),
        Some(true),
        "{body}"
    );
    assert!(
        body["detail"].as_str().unwrap_or_default().contains("max_deliver"),
        "{body}"
    );
    let metrics = idem_tls::test_pki::get(format!("{}/metrics", ledger.base))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(metrics.contains("ledger_events_config_refused_total"), "{metrics}");
    drop(ledger);
    delete_streams(&js, &ns).await;
}

/// `--projection-ack-wait-secs` is in force on a durable consumer that
/// already exists with another ack wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_projection_ack_wait_is_updated_on_an_existing_consumer() {
    let ns = namespace();
    let js = prepare(
        &ns,
        async_nats::jetstream::consumer::pull::Config {
            ack_wait: Duration::from_secs(30),
            max_deliver: -1,
            ..Default::default()
        },
    )
    .await;
    let url = database_url(Engine::Sqlite);
    let ledger = start_with_nats(&url, &ns, &["--projection-ack-wait-secs", "300"]);
    let stream = js.get_stream(stream_name(&ns, "EVENTS")).await.unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    loop {
        let mut c: async_nats::jetstream::consumer::PullConsumer =
            stream.get_consumer(&format!("{ns}-statements")).await.unwrap();
        if c.info().await.unwrap().config.ack_wait == Duration::from_secs(300) {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "ack_wait still 30 s");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (status, body) = health(&ledger.base).await;
    assert_eq!(status, 200, "{body}");
    drop(ledger);
    delete_streams(&js, &ns).await;
}

/// Waits until the projection has applied every event in its stream (its
/// durable consumer delivered at least one and has nothing pending).
async fn projected(js: &async_nats::jetstream::Context, ns: &str) {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        assert!(std::time::Instant::now() < deadline, "the projection applied nothing");
        tokio::time::sleep(Duration::from_millis(100)).await;
        // The ledger makes its stream and its consumer once it is up.
        let Ok(stream) = js.get_stream(stream_name(ns, "EVENTS")).await else {
            continue;
        };
        let Ok(mut c) = stream
            .get_consumer::<async_nats::jetstream::consumer::pull::Config>(&format!("{ns}-statements"))
            .await
        else {
            continue;
        };
        let info = c.info().await.unwrap().clone();
        if info.delivered.stream_sequence >= 1 && info.num_pending == 0 && info.num_ack_pending == 0 {
            return;
        }
    }
}

/// The dead-letter stream keeps a dead letter until it is handled (no
/// max_age, no limit), and the events stream's messages always fit in a
/// dead letter: so the ledger creates them, and so it brings in line the
/// streams an earlier version created (dead letters kept six days, events
/// of any size); the projection starts on both.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_dead_letter_stream_keeps_dead_letters_until_they_are_handled() {
    use async_nats::jetstream::stream;
    let js = async_nats::jetstream::new(async_nats::connect(nats_url()).await.expect("NATS"));
    let largest = i64::try_from(js.client().server_info().max_payload - idem_jetstream::DEAD_LETTER_HEADROOM).unwrap();
    let fresh = namespace();
    let earlier = namespace();
    for (name, subjects) in [
        (stream_name(&earlier, "EVENTS"), format!("{earlier}.events.>")),
        (stream_name(&earlier, "DEAD"), format!("{earlier}.dead.statements")),
    ] {
        create_file_stream(
            &js,
            stream::Config {
                name,
                subjects: vec![subjects],
                duplicate_window: Duration::from_secs(120),
                max_age: Duration::from_secs(6 * 86_400),
                ..Default::default()
            },
        )
        .await;
    }
    let url = database_url(Engine::Sqlite);
    for ns in [&fresh, &earlier] {
        let ledger = start_with_nats(&url, ns, &[]);
        let c = Client::of(&ledger);
        let (status, _) = c.post("/v1/accounts", serde_json::json!({ "name": "a" })).await;
        assert_eq!(status, 201);
        projected(&js, ns).await;
        let (status, body) = health(&ledger.base).await;
        assert_eq!(status, 200, "{ns}: {body}");
        let mut dead = js.get_stream(stream_name(ns, "DEAD")).await.unwrap();
        let dead = dead.info().await.unwrap().config.clone();
        assert_eq!(
            dead.max_age,
            Duration::ZERO,
            "{ns}: dead letters are kept until handled"
        );
        assert_eq!(dead.retention, stream::RetentionPolicy::Limits, "{ns}");
        assert!(
            dead.max_messages <= 0 && dead.max_bytes <= 0 && dead.max_messages_per_subject <= 0,
            "{ns}: no limit evicts a dead letter: {dead:?}"
        );
        let mut events = js.get_stream(stream_name(ns, "EVENTS")).await.unwrap();
        let events = events.info().await.unwrap().config.clone();
        assert_eq!(
            i64::from(events.max_message_size),
            largest,
            "{ns}: every event fits in a dead letter"
        );
        assert_eq!(events.max_age, Duration::from_secs(6 * 86_400), "{ns}");
        drop(ledger);
        delete_streams(&js, ns).await;
    }
}

macro_rules! per_engine {
    ($($engine:ident => $variant:expr),*) => {
        $(mod $engine {
            use super::*;
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn events_reach_the_projection() { super::events_reach_the_projection($variant).await }
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn the_snapshot_job_runs_once_per_run_id() { super::the_snapshot_job_runs_once_per_run_id($variant).await }
        })*
    };
}

per_engine!(sqlite => Engine::Sqlite, postgres => Engine::Postgres, mysql => Engine::Mysql);
