//! The client's rules, against small servers on loopback sockets: an axum
//! server answering from a script, and a raw TCP server for broken
//! connections.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::response::Response as AxumResponse;
use idem_client::{
    AttemptOutcome, BoxFuture, Client, ClientBuilder, Error, Key, MemoryPending, Next, Operation, PendingStore,
    SqlitePending, TransportKind,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// What the scripted server answers to one request.
#[derive(Clone)]
enum Reply {
    /// A status, headers and a body.
    Status(u16, Vec<(&'static str, String)>, String),
    /// Never answers.
    Hang,
}

fn status(code: u16) -> Reply {
    Reply::Status(code, vec![], String::new())
}

fn problem(code: u16, slug: &str, extra: Vec<(&'static str, String)>) -> Reply {
    let mut headers = vec![("content-type", "application/problem+json".to_owned())];
    headers.extend(extra);
    Reply::Status(
        code,
        headers,
        format!(
            r#"{{"type":"https://idem.dev/problems/{slug}","title":"{slug}","status":{code},"detail":"detail of {slug}"}}"#
        ),
    )
}

fn created(body: &str) -> Reply {
    Reply::Status(
        201,
        vec![("content-type", "application/json".to_owned())],
        body.to_owned(),
    )
}

/// One request as the server saw it.
#[derive(Debug, Clone)]
struct Seen {
    path: String,
    key: Option<String>,
    authorization: Option<String>,
    body: Bytes,
}

/// Checks run on each request as it arrives (e.g. what the pending store holds).
type Probe = Arc<dyn Fn(&Seen) + Send + Sync>;

#[derive(Clone, Default)]
struct Script {
    replies: Arc<Mutex<VecDeque<Reply>>>,
    seen: Arc<Mutex<Vec<Seen>>>,
    probe: Arc<Mutex<Option<Probe>>>,
}

impl Script {
    fn new(replies: impl IntoIterator<Item = Reply>) -> Self {
        let s = Self::default();
        s.replies.lock().unwrap().extend(replies);
        s
    }

    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }
}

async fn scripted(State(script): State<Script>, req: Request) -> AxumResponse {
    let (parts, body) = req.into_parts();
    let body = axum::body::to_bytes(body, 1 << 20).await.unwrap_or_default();
    let header = |name: &str| {
        parts
            .headers
            .get(name)
            .map(|v| v.to_str().unwrap_or("<not text>").to_owned())
    };
    let seen = Seen {
        path: parts.uri.path().to_owned(),
        key: header("idempotency-key"),
        authorization: header("authorization"),
        body,
    };
    let probe = script.probe.lock().unwrap().clone();
    if let Some(probe) = probe {
        probe(&seen);
    }
    script.seen.lock().unwrap().push(seen);
    // An empty script answers 201.
    let reply = script
        .replies
        .lock()
        .unwrap()
        .pop_front()
        .unwrap_or_else(|| created(r#"{"done":true}"#));
    match reply {
        Reply::Status(code, headers, body) => {
            let mut b = AxumResponse::builder().status(code);
            for (name, value) in headers {
                b = b.header(name, value);
            }
            b.body(Body::from(body)).unwrap()
        }
        Reply::Hang => std::future::pending().await,
    }
}

/// Serves `script` on `listener`.
fn serve_on(listener: TcpListener, script: Script) {
    let app = axum::Router::new().fallback(scripted).with_state(script);
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
}

/// A scripted server on a fresh loopback port; its base URL.
async fn server(script: &Script) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    serve_on(listener, script.clone());
    base
}

/// A client with short waits, so tests spend little time in backoff.
fn fast() -> ClientBuilder {
    Client::builder()
        .backoff(Duration::from_millis(5), Duration::from_millis(40))
        .attempt_timeout(Duration::from_secs(10))
        .deadline(Duration::from_secs(60))
}

/// One observer event: (key, attempt, outcome summary, next).
type Event = (String, u32, String, Next);

/// Every observer event, kept.
#[derive(Clone, Default)]
struct Events(Arc<Mutex<Vec<Event>>>);

impl Events {
    fn install(&self, builder: ClientBuilder) -> ClientBuilder {
        let events = self.0.clone();
        builder.on_attempt(move |e| {
            let outcome = match &e.outcome {
                AttemptOutcome::Answered(r) => format!("status {}", r.status().as_u16()),
                AttemptOutcome::Failed(t) => format!("failed {:?}", t.kind),
                _ => "other".to_owned(),
            };
            events
                .lock()
                .unwrap()
                .push((e.key.to_string(), e.attempt, outcome, e.next));
        })
    }

    fn all(&self) -> Vec<Event> {
        self.0.lock().unwrap().clone()
    }
}

/// A scripted server answering `replies`, a client built from `builder`
/// sending to it, the client's observer events, and a top-up for the server.
async fn observed(
    replies: impl IntoIterator<Item = Reply>,
    builder: ClientBuilder,
) -> (Script, Client, Events, Operation) {
    let script = Script::new(replies);
    let base = server(&script).await;
    let events = Events::default();
    let client = events.install(builder).build().unwrap();
    let op = top_up(&base);
    (script, client, events, op)
}

fn top_up(base: &str) -> Operation {
    Operation::post(&format!("{base}/v1/top-ups"))
        .json(&serde_json::json!({"account_id": "a", "amount": 5}))
        .build()
        .unwrap()
}

/// Asserts the server saw `n` requests, each with the operation's key (as an sf-string) and body.
fn assert_same_key(seen: &[Seen], op: &Operation, n: usize) {
    assert_eq!(seen.len(), n, "requests seen: {seen:?}");
    let want = format!("\"{}\"", op.key());
    for s in seen {
        assert_eq!(s.key.as_deref(), Some(want.as_str()), "{seen:?}");
        assert_eq!(&s.body, op.body());
        assert_eq!(s.path, "/v1/top-ups");
    }
}

/// Several 5xx answers are retried, every attempt carrying the same key and body, until the 201.
#[tokio::test]
async fn every_retry_carries_the_same_key() {
    let script = Script::new([status(503), status(502), status(500), created(r#"{"id":1}"#)]);
    let base = server(&script).await;
    let client = fast().build().unwrap();
    let op = top_up(&base);
    let answer = client.send(&op).await.unwrap();
    assert_eq!(answer.status(), 201);
    assert_eq!(answer.attempt(), 4);
    assert_eq!(answer.key(), op.key());
    assert!(!answer.replayed());
    assert_eq!(answer.json::<serde_json::Value>().unwrap()["id"], 1);
    assert_same_key(&script.seen(), &op, 4);
    assert!(client.store().list().await.unwrap().is_empty());
}

/// A 5xx then a success: the observer sees one retry on the backoff, then a final answer.
#[tokio::test]
async fn server_error_then_success() {
    let (script, client, events, op) =
        observed([problem(503, "database-unavailable", vec![]), created("{}")], fast()).await;
    let answer = client.send(&op).await.unwrap();
    assert_eq!(answer.status(), 201);
    let all = events.all();
    assert_eq!(all.len(), 2, "{all:?}");
    assert_eq!(all[0].0, op.key().to_string());
    assert_eq!((all[0].1, all[0].2.as_str()), (1, "status 503"));
    // The backoff: at least its minimum, at most the maximum plus the jitter.
    match all[0].3 {
        Next::RetryIn(wait) => assert!(
            wait >= Duration::from_millis(5) && wait < Duration::from_millis(80),
            "{wait:?}"
        ),
        other => panic!("{other:?}"),
    }
    assert_eq!((all[1].1, all[1].2.as_str(), all[1].3), (2, "status 201", Next::Done));
    assert_same_key(&script.seen(), &op, 2);
}

/// A 409 in-flight waits the server's Retry-After, then sends the same key again and gets the replay.
#[tokio::test]
async fn in_flight_conflict_honours_retry_after() {
    let replayed = Reply::Status(
        201,
        vec![
            ("content-type", "application/json".to_owned()),
            ("idempotent-replayed", "true".to_owned()),
        ],
        r#"{"id":7}"#.to_owned(),
    );
    let in_flight = problem(409, "idempotency-key-in-flight", vec![("retry-after", "1".to_owned())]);
    let (script, client, events, op) = observed([in_flight, replayed], fast()).await;
    let answer = client.send(&op).await.unwrap();
    assert_eq!(answer.status(), 201);
    assert!(answer.replayed());
    let all = events.all();
    assert_eq!(all[0].2, "status 409");
    // The wait is the server's, not the backoff's (whose maximum is 40 ms).
    assert_eq!(all[0].3, Next::RetryIn(Duration::from_secs(1)));
    assert_same_key(&script.seen(), &op, 2);
}

/// A 409 that is not the in-flight problem is a final answer.
#[tokio::test]
async fn other_conflicts_are_final() {
    let script = Script::new([problem(409, "version-conflict", vec![("retry-after", "1".to_owned())])]);
    let base = server(&script).await;
    let client = fast().build().unwrap();
    let op = top_up(&base);
    match client.send(&op).await {
        Err(Error::Rejected(r)) => {
            assert_eq!(r.status(), 409);
            assert!(r.problem().unwrap().is("version-conflict"));
        }
        other => panic!("{other:?}"),
    }
    assert_same_key(&script.seen(), &op, 1);
}

/// 400, 401, 404 and 422 stop at once: one request, the problem parsed, nothing left pending.
#[tokio::test]
async fn client_errors_stop_at_once() {
    for (code, slug) in [
        (400, "invalid-amount"),
        (401, "unauthorized"),
        (404, "account-not-found"),
        (422, "idempotency-key-reused"),
        (422, "insufficient-funds"),
    ] {
        let script = Script::new([problem(code, slug, vec![])]);
        let base = server(&script).await;
        let client = fast().build().unwrap();
        let op = top_up(&base);
        let err = client.send(&op).await.unwrap_err();
        assert!(!err.is_outcome_unknown());
        let r = err.response().expect("the rejection carries the answer");
        assert_eq!(r.status(), code);
        let p = r.problem().expect("a problem document");
        assert!(p.is(slug), "{p:?}");
        assert_eq!(p.status, Some(code));
        assert_eq!(p.detail.as_deref(), Some(format!("detail of {slug}").as_str()));
        assert!(err.to_string().contains(slug), "{err}");
        assert_same_key(&script.seen(), &op, 1);
        assert!(client.store().list().await.unwrap().is_empty(), "{code}");
    }
}

/// A plain 400 without a problem body is also final, with no problem parsed.
#[tokio::test]
async fn client_errors_without_problem_bodies() {
    let script = Script::new([Reply::Status(400, vec![], "bad".into())]);
    let base = server(&script).await;
    let client = fast().build().unwrap();
    let err = client.send(&top_up(&base)).await.unwrap_err();
    let r = err.response().unwrap();
    assert!(r.problem().is_none());
    assert_eq!(r.text(), "bad");
    assert_eq!(script.seen().len(), 1);
}

/// Refused connections are retried until the server comes up; it then sees one request, with the key.
#[tokio::test]
async fn connection_refused_then_server_up() {
    // A port nobody listens on (for now).
    let addr: SocketAddr = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let base = format!("http://{addr}");
    let (refused_tx, mut refused_rx) = tokio::sync::mpsc::unbounded_channel();
    let events = Events::default();
    let client = events
        .install(fast())
        .on_attempt(move |e| {
            if let AttemptOutcome::Failed(t) = &e.outcome {
                let _ = refused_tx.send(t.kind);
            }
        })
        .build()
        .unwrap();
    let op = top_up(&base);
    let sending = {
        let (client, op) = (client.clone(), op.clone());
        tokio::spawn(async move { client.send(&op).await })
    };
    // Two refused attempts, then the server comes up on that port.
    for _ in 0..2 {
        assert_eq!(refused_rx.recv().await, Some(TransportKind::Connect));
    }
    let script = Script::default();
    serve_on(TcpListener::bind(addr).await.unwrap(), script.clone());
    let answer = sending.await.unwrap().unwrap();
    assert_eq!(answer.status(), 201);
    assert!(answer.attempt() >= 3);
    assert_same_key(&script.seen(), &op, 1);
    assert!(client.store().list().await.unwrap().is_empty());
}

/// What the raw server does with one request.
#[derive(Clone, Copy, Debug)]
enum Raw {
    /// Closes the connection with a reset, without answering.
    Reset,
    /// Sends a head announcing 100 bytes, 7 of them, then closes.
    CutOff,
    /// Answers 201.
    Created,
}

/// A raw HTTP/1.1 server: reads each request, records its key, acts per `plan`.
async fn raw_server(plan: Vec<Raw>) -> (String, Arc<Mutex<Vec<String>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let keys = Arc::new(Mutex::new(Vec::new()));
    let seen = keys.clone();
    tokio::spawn(async move {
        let mut plan = plan.into_iter();
        loop {
            let (mut socket, _) = listener.accept().await.unwrap();
            let Some(key) = read_request(&mut socket).await else {
                continue;
            };
            seen.lock().unwrap().push(key);
            match plan.next().unwrap_or(Raw::Created) {
                Raw::Reset => {
                    socket.set_zero_linger().unwrap();
                    drop(socket);
                }
                Raw::CutOff => {
                    let _ = socket
                        .write_all(b"HTTP/1.1 201 Created\r\ncontent-length: 100\r\n\r\npartial")
                        .await;
                    let _ = socket.shutdown().await;
                }
                Raw::Created => {
                    let _ = socket
                        .write_all(b"HTTP/1.1 201 Created\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok")
                        .await;
                    let _ = socket.shutdown().await;
                }
            }
        }
    });
    (base, keys)
}

/// Reads one request's head and body; its Idempotency-Key value.
async fn read_request(socket: &mut TcpStream) -> Option<String> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let head_end = loop {
        let n = socket.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_string();
    let header = |name: &str| {
        head.lines().find_map(|l| {
            let (n, v) = l.split_once(':')?;
            n.eq_ignore_ascii_case(name).then(|| v.trim().to_owned())
        })
    };
    let length: usize = header("content-length").and_then(|v| v.parse().ok()).unwrap_or(0);
    while buf.len() < head_end + length {
        let n = socket.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    Some(header("idempotency-key").unwrap_or_default())
}

/// A reset connection and a body cut off are retried with the same key.
#[tokio::test]
async fn resets_and_cut_off_bodies_are_retried() {
    let (base, keys) = raw_server(vec![Raw::Reset, Raw::CutOff, Raw::Created]).await;
    let events = Events::default();
    let client = events.install(fast()).build().unwrap();
    let op = top_up(&base);
    let answer = client.send(&op).await.unwrap();
    assert_eq!(answer.status(), 201);
    assert_eq!(answer.body().as_ref(), b"ok");
    let want = format!("\"{}\"", op.key());
    assert_eq!(*keys.lock().unwrap(), vec![want.clone(), want.clone(), want]);
    let kinds: Vec<String> = events.all().into_iter().map(|e| e.2).collect();
    assert_eq!(kinds, ["failed Request", "failed Body", "status 201"]);
}

/// An attempt that outlives its timeout is retried with the same key.
#[tokio::test]
async fn timeouts_are_retried() {
    let (script, client, events, op) = observed(
        [Reply::Hang, created("{}")],
        fast().attempt_timeout(Duration::from_millis(300)),
    )
    .await;
    assert_eq!(client.send(&op).await.unwrap().status(), 201);
    assert_eq!(events.all()[0].2, "failed Timeout");
    assert_same_key(&script.seen(), &op, 2);
}

/// A replayed answer is surfaced; a first answer is not marked replayed.
#[tokio::test]
async fn replay_flag_is_surfaced() {
    let replay = Reply::Status(201, vec![("idempotent-replayed", "true".into())], "{}".into());
    let script = Script::new([created("{}"), replay]);
    let base = server(&script).await;
    let client = fast().build().unwrap();
    let op = top_up(&base);
    assert!(!client.send(&op).await.unwrap().replayed());
    // The same operation sent again: the server replays.
    assert!(client.send(&op).await.unwrap().replayed());
    assert_same_key(&script.seen(), &op, 2);
}

/// Giving up keeps the operation pending; resume later sends it with the same key and clears it.
#[tokio::test]
async fn giving_up_keeps_the_operation_pending_for_resume() {
    let script = Script::new([status(503), status(503), status(503)]);
    let base = server(&script).await;
    let client = fast().max_attempts(3).build().unwrap();
    let op = top_up(&base);
    let err = client.send(&op).await.unwrap_err();
    assert!(err.is_outcome_unknown());
    match &err {
        Error::GaveUp { key, attempts, .. } => assert_eq!((key, *attempts), (op.key(), 3)),
        other => panic!("{other:?}"),
    }
    assert_eq!(err.response().unwrap().status(), 503);
    assert_eq!(client.store().list().await.unwrap(), vec![op.clone()]);
    // The server recovers (an empty script answers 201).
    let resumed = client.resume().await.unwrap();
    assert_eq!(resumed.len(), 1);
    assert_eq!(resumed[0].operation, op);
    assert_eq!(resumed[0].result.as_ref().unwrap().status(), 201);
    assert!(client.store().list().await.unwrap().is_empty());
    assert_same_key(&script.seen(), &op, 4);
}

/// A Retry-After longer than what is left of the deadline ends the send at once, still pending.
#[tokio::test]
async fn deadline_ends_retries() {
    let wait = problem(503, "database-unavailable", vec![("retry-after", "30".into())]);
    let (script, client, events, op) = observed([wait], fast().deadline(Duration::from_secs(5))).await;
    match client.send(&op).await {
        Err(Error::GaveUp { attempts: 1, .. }) => {}
        other => panic!("{other:?}"),
    }
    assert_eq!(events.all()[0].3, Next::GiveUp);
    assert_eq!(script.seen().len(), 1);
    assert_eq!(client.store().list().await.unwrap().len(), 1);
}

/// The store is written before the first byte is sent: the server finds the key pending when the request arrives.
#[tokio::test]
async fn saved_before_sent() {
    let store = Arc::new(MemoryPending::new());
    let script = Script::default();
    let found = Arc::new(Mutex::new(Vec::new()));
    {
        let (store, found) = (store.clone(), found.clone());
        *script.probe.lock().unwrap() = Some(Arc::new(move |seen: &Seen| {
            let store = store.clone();
            let pending: Vec<String> = std::thread::scope(|s| {
                s.spawn(|| {
                    tokio::runtime::Builder::new_current_thread()
                        .build()
                        .unwrap()
                        .block_on(store.list())
                        .unwrap()
                        .iter()
                        .map(|op| format!("\"{}\"", op.key()))
                        .collect()
                })
                .join()
                .unwrap()
            });
            found.lock().unwrap().push((seen.key.clone(), pending));
        }));
    }
    let base = server(&script).await;
    let client = fast().shared_store(store.clone()).build().unwrap();
    let op = top_up(&base);
    client.send(&op).await.unwrap();
    let want = format!("\"{}\"", op.key());
    assert_eq!(*found.lock().unwrap(), vec![(Some(want.clone()), vec![want])]);
    assert!(store.list().await.unwrap().is_empty());
}

/// A store that cannot save.
struct Broken;

impl PendingStore for Broken {
    fn save<'a>(&'a self, _: &'a Operation) -> BoxFuture<'a, idem_client::Result<()>> {
        Box::pin(async { Err(Error::Store("disk full".into())) })
    }
    fn remove<'a>(&'a self, _: &'a Key) -> BoxFuture<'a, idem_client::Result<()>> {
        Box::pin(async { Ok(()) })
    }
    fn list(&self) -> BoxFuture<'_, idem_client::Result<Vec<Operation>>> {
        Box::pin(async { Ok(Vec::new()) })
    }
}

/// When the save fails, nothing is sent.
#[tokio::test]
async fn nothing_is_sent_without_a_save() {
    let script = Script::default();
    let base = server(&script).await;
    let client = fast().store(Broken).build().unwrap();
    match client.send(&top_up(&base)).await {
        Err(Error::Store(why)) => assert_eq!(why, "disk full"),
        other => panic!("{other:?}"),
    }
    assert!(script.seen().is_empty());
}

/// Default headers go with every attempt, resumed ones too, and are never stored; bodies over the bound are refused before sending.
#[tokio::test]
async fn credentials_are_sent_not_stored() {
    let path = std::env::temp_dir().join(format!("idem-client-creds-{}.db", uuid::Uuid::now_v7()));
    let script = Script::new([status(503)]);
    let base = server(&script).await;
    let store = SqlitePending::open(&path).await.unwrap().with_max_body_bytes(64);
    let client = fast().store(store).bearer("s3cret").max_attempts(1).build().unwrap();
    let op = top_up(&base);
    assert!(client.send(&op).await.unwrap_err().is_outcome_unknown());
    drop(client);
    let file = std::fs::read(&path).unwrap();
    let wal = std::fs::read(path.with_extension("db-wal")).unwrap_or_default();
    let needle = b"s3cret";
    for bytes in [&file, &wal] {
        assert!(
            !bytes.windows(needle.len()).any(|w| w == needle),
            "the token was written to disk"
        );
    }
    // A restarted client resumes with the same key and its own credentials.
    let store = SqlitePending::open(&path).await.unwrap().with_max_body_bytes(64);
    let client = fast().store(store).bearer("s3cret").build().unwrap();
    let resumed = client.resume().await.unwrap();
    assert_eq!(resumed.len(), 1);
    assert_eq!(resumed[0].result.as_ref().unwrap().status(), 201);
    let seen = script.seen();
    assert_same_key(&seen, &op, 2);
    assert!(seen.iter().all(|s| s.authorization.as_deref() == Some("Bearer s3cret")));
    assert!(client.store().list().await.unwrap().is_empty());
    // A body over the store's bound: refused, nothing sent.
    let big = Operation::post(&format!("{base}/v1/top-ups"))
        .body(vec![b'x'; 65])
        .build()
        .unwrap();
    assert!(matches!(client.send(&big).await, Err(Error::InvalidOperation(_))));
    assert_eq!(script.seen().len(), 2);
}

/// A final answer over the response limit is an error and ends the operation; a retryable one is retried.
#[tokio::test]
async fn response_limit() {
    let script = Script::new([
        Reply::Status(503, vec![], "x".repeat(100)),
        Reply::Status(201, vec![], "y".repeat(100)),
    ]);
    let base = server(&script).await;
    let client = fast().max_response_bytes(50).build().unwrap();
    let op = top_up(&base);
    match client.send(&op).await {
        Err(Error::ResponseTooLarge {
            status: 201,
            max_bytes: 50,
            key,
        }) => assert_eq!(&key, op.key()),
        other => panic!("{other:?}"),
    }
    assert_same_key(&script.seen(), &op, 2);
    assert!(client.store().list().await.unwrap().is_empty());
}

/// One key per operation: two operations get two keys, each kept over its own retries.
#[tokio::test]
async fn one_key_per_operation() {
    let script = Script::new([status(500), created("{}"), status(500), created("{}")]);
    let base = server(&script).await;
    let client = fast().build().unwrap();
    let (a, b) = (top_up(&base), top_up(&base));
    client.send(&a).await.unwrap();
    client.send(&b).await.unwrap();
    let seen = script.seen();
    assert_same_key(&seen[..2], &a, 2);
    assert_same_key(&seen[2..], &b, 2);
    assert_ne!(a.key(), b.key());
}

/// `Retry-After: 0` waits the backoff's minimum, not zero; a Retry-After over the cap waits the cap.
#[tokio::test]
async fn retry_after_is_bounded_both_ways() {
    let replies = [
        problem(409, "idempotency-key-in-flight", vec![("retry-after", "0".to_owned())]),
        problem(503, "database-unavailable", vec![("retry-after", "3600".to_owned())]),
    ];
    let (script, client, events, op) = observed(replies, fast().max_retry_after(Duration::from_millis(50))).await;
    assert_eq!(client.send(&op).await.unwrap().status(), 201);
    let nexts: Vec<Next> = events.all().into_iter().map(|e| e.3).collect();
    assert_eq!(
        nexts,
        [
            Next::RetryIn(Duration::from_millis(5)),
            Next::RetryIn(Duration::from_millis(50)),
            Next::Done
        ]
    );
    assert_same_key(&script.seen(), &op, 3);
}

/// A deadline, attempt timeout, backoff or Retry-After bound too large to add to an instant does not panic: the operation is sent as usual.
#[tokio::test]
async fn huge_durations_do_not_overflow() {
    let script = Script::new([problem(503, "database-unavailable", vec![("retry-after", "1".into())])]);
    let base = server(&script).await;
    let client = Client::builder()
        .deadline(Duration::MAX)
        .attempt_timeout(Duration::MAX)
        .backoff(Duration::from_millis(5), Duration::MAX)
        .max_retry_after(Duration::MAX)
        .build()
        .unwrap();
    let answer = client.send(&top_up(&base)).await.unwrap();
    assert_eq!(answer.status(), 201);
    assert_eq!(script.seen().len(), 2);
}

/// Resume sends pending operations side by side: one to a host that never answers does not hold up the others, which finish first.
#[tokio::test]
async fn resume_does_not_wait_for_one_unreachable_host() {
    // A host that accepts connections and never answers.
    let silent = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let silent_base = format!("http://{}", silent.local_addr().unwrap());
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = silent.accept().await {
            held.push(socket);
        }
    });
    let script = Script::default();
    let base = server(&script).await;
    let store = Arc::new(MemoryPending::new());
    let stuck = top_up(&silent_base);
    let fine: Vec<Operation> = (0..3).map(|_| top_up(&base)).collect();
    store.save(&stuck).await.unwrap();
    for op in &fine {
        store.save(op).await.unwrap();
    }
    let events = Events::default();
    let client = events
        .install(
            fast()
                .shared_store(store.clone())
                .attempt_timeout(Duration::from_secs(2))
                .deadline(Duration::from_secs(2)),
        )
        .build()
        .unwrap();
    let resumed = client.resume().await.unwrap();
    assert_eq!(resumed.len(), 4);
    assert_eq!(resumed[0].operation, stuck, "answered oldest first");
    assert!(resumed[0].result.is_err());
    assert!(
        resumed[1..]
            .iter()
            .all(|r| r.result.as_ref().is_ok_and(|a| a.status() == 201))
    );
    let order: Vec<String> = events.all().into_iter().map(|e| e.0).collect();
    let stuck_at = order.iter().position(|k| *k == stuck.key().to_string()).unwrap();
    for op in &fine {
        let at = order.iter().position(|k| *k == op.key().to_string()).unwrap();
        assert!(at < stuck_at, "{op:?} waited for the unreachable host: {order:?}");
    }
    assert_eq!(
        store.list().await.unwrap(),
        vec![stuck],
        "only the unanswered one stays pending"
    );
}
