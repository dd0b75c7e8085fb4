//! The start-up checks on the stream and the dead-letter stream, against
//! the real NATS JetStream server (`IDEM_TEST_NATS_URL`, default
//! `nats://127.0.0.1:4222`): a setting under which a message could be
//! evicted before it is applied or kept, a dead letter deleted before it is
//! handled, or a dead letter too large to store, is refused with the
//! stream and the setting named.
//!
//! Each case has streams of its own; they are deleted at the end.

mod common;

use std::time::Duration;

use async_nats::jetstream::stream::{self, DiscardPolicy, RetentionPolicy};
use common::*;
use idem_core::TxEngine;
use idem_inbox::Inbox;
use idem_jetstream::{ConsumerError, ConsumerOptions, InboxConsumer};

/// Streams made for the cases of one test, deleted by `cleanup`.
struct Cases {
    js: async_nats::jetstream::Context,
    tag: String,
    store: idem_sqlite::SqliteStore,
    made: std::sync::Mutex<Vec<String>>,
}

impl Cases {
    async fn new() -> Self {
        let tag = tag();
        Self {
            js: js().await,
            store: open_sqlite(&tag).await,
            tag,
            made: Default::default(),
        }
    }

    /// Starts a consumer on a fresh events stream and dead-letter stream,
    /// both acceptable before `events` and `dead` edit them; answers the
    /// events stream's name and the refusal, if any.
    async fn start(
        &self,
        case: &str,
        events: impl FnOnce(&mut stream::Config),
        dead: impl FnOnce(&mut stream::Config),
    ) -> (String, Result<(), String>) {
        let (name, dead_name) = (format!("EV_{case}_{}", self.tag), format!("DL_{case}_{}", self.tag));
        let dead_subject = format!("dl_{case}_{}", self.tag);
        let s = events_stream(&self.js, &name, &format!("ev_{case}_{}", self.tag), events).await;
        dead_stream(&self.js, &dead_name, &dead_subject, dead).await;
        self.made.lock().unwrap().extend([name.clone(), dead_name]);
        let consumer = durable(&s, "c", Duration::from_secs(5)).await;
        let mut options = ConsumerOptions::new("h");
        options.dead_letter_subject = format!("{dead_subject}.h");
        let work = handler::<idem_sqlite::SqliteStore, _>(|_tx, _e| Box::pin(async { Ok(()) }));
        let inbox = Inbox::new(TxEngine::new(self.store.clone()));
        let started = match InboxConsumer::start(self.js.clone(), consumer, inbox, options, work).await {
            Ok(_) => Ok(()),
            Err(ConsumerError::Config(why)) => Err(why),
            Err(e) => panic!("{case}: not a configuration error: {e}"),
        };
        (name, started)
    }

    /// Asserts that `case` is refused with `setting` and the stream named.
    async fn refused(
        &self,
        case: &str,
        setting: &str,
        events: impl FnOnce(&mut stream::Config),
        dead: impl FnOnce(&mut stream::Config),
    ) {
        let (name, started) = self.start(case, events, dead).await;
        let why = started.expect_err(&format!("{case} must be refused"));
        let named = if why.contains("dead-letter stream") {
            format!("\"DL_{case}_{}\"", self.tag)
        } else {
            format!("\"{name}\"")
        };
        assert!(why.contains(setting) && why.contains(&named), "{case}: {why}");
    }

    async fn accepted(
        &self,
        case: &str,
        events: impl FnOnce(&mut stream::Config),
        dead: impl FnOnce(&mut stream::Config),
    ) {
        let (_, started) = self.start(case, events, dead).await;
        if let Err(why) = started {
            panic!("{case} must be accepted: {why}");
        }
    }

    async fn cleanup(&self) {
        let made = self.made.lock().unwrap().clone();
        for name in made {
            let _ = self.js.delete_stream(&name).await;
        }
    }
}

fn none(_: &mut stream::Config) {}

/// An edit of a stream's configuration, one case's.
type Edit = fn(&mut stream::Config);

/// A count or size limit that evicts the oldest messages (discard policy
/// Old, or a per-subject limit without `discard_new_per_subject`) could
/// remove a message waiting for its retry, never applied nor dead-lettered:
/// refused. Discard New (a full stream refuses new messages, which their
/// publisher retries) and every retention policy are accepted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn start_refuses_a_stream_whose_limits_evict_a_message_waiting_for_its_retry() {
    let c = Cases::new().await;
    let refused: [(&str, &str, Edit); 4] = [
        ("persubject", "max_messages_per_subject (1)", |s| {
            s.max_messages_per_subject = 1
        }),
        ("count", "max_messages (1000)", |s| s.max_messages = 1_000),
        ("bytes", "max_bytes (67108864)", |s| s.max_bytes = 64 << 20),
        ("persubjectnew", "max_messages_per_subject (5)", |s| {
            s.max_messages_per_subject = 5;
            s.discard = DiscardPolicy::New;
        }),
    ];
    for (case, setting, events) in refused {
        c.refused(case, setting, events, none).await;
    }
    let accepted: [(&str, Edit); 4] = [
        ("new", |s| {
            s.max_messages = 1_000;
            s.max_bytes = 64 << 20;
            s.discard = DiscardPolicy::New;
        }),
        ("newpersubject", |s| {
            s.max_messages_per_subject = 1;
            s.discard = DiscardPolicy::New;
            s.discard_new_per_subject = true;
        }),
        ("workqueue", |s| s.retention = RetentionPolicy::WorkQueue),
        ("interest", |s| s.retention = RetentionPolicy::Interest),
    ];
    for (case, events) in accepted {
        c.accepted(case, events, none).await;
    }
    c.cleanup().await;
}

/// A dead letter lives until it is redriven or resolved: a dead-letter
/// stream that deletes it by age, evicts it for a newer one, or removes it
/// when a consumer acknowledges it (or no consumer is interested) is
/// refused; one that refuses new dead letters when full is accepted (the
/// message is delivered again until one is stored).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn start_refuses_a_dead_letter_stream_that_deletes_dead_letters() {
    let c = Cases::new().await;
    c.refused("age", "518400 s after they are stored (max_age)", none, |d| {
        d.max_age = Duration::from_secs(6 * 86_400)
    })
    .await;
    c.refused("count", "max_messages (100)", none, |d| d.max_messages = 100)
        .await;
    c.refused("persubject", "max_messages_per_subject (10)", none, |d| {
        d.max_messages_per_subject = 10
    })
    .await;
    c.refused("interest", "Interest retention", none, |d| {
        d.retention = RetentionPolicy::Interest
    })
    .await;
    c.refused("workqueue", "WorkQueue retention", none, |d| {
        d.retention = RetentionPolicy::WorkQueue
    })
    .await;
    c.accepted("full", none, |d| {
        d.max_messages = 100;
        d.discard = DiscardPolicy::New;
    })
    .await;
    c.cleanup().await;
}

/// A dead letter carries more headers than its event: a stream that
/// accepts messages up to the server's `max_payload` (no `max_msg_size`),
/// or within `DEAD_LETTER_HEADROOM` of the dead letter's limit, is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn start_refuses_a_stream_whose_largest_message_could_not_be_a_dead_letter() {
    let c = Cases::new().await;
    let largest = largest_event(&c.js);
    c.refused("unlimited", "max_msg_size unlimited", |s| s.max_message_size = -1, none)
        .await;
    c.refused(
        "over",
        &format!("at most {largest}"),
        |s| s.max_message_size = largest + 1,
        none,
    )
    .await;
    // The dead-letter stream's own limit counts too.
    c.refused("deadlimit", &format!("at most {}", largest - 4096), none, |d| {
        d.max_message_size = largest
    })
    .await;
    c.accepted("largest", none, none).await;
    c.accepted(
        "deadroom",
        |s| s.max_message_size = 60_000,
        |d| d.max_message_size = 64 * 1024,
    )
    .await;
    c.cleanup().await;
}
