//! The sweeper's expiry index, written off the request path.
//!
//! A claim's row carries its own time to live, so the index only serves the
//! sweeper and the operator commands; a claim need not wait for it. Each
//! claim queues (tag, expiry) to one writer task per store (shared by its
//! clones), which adds everything queued since its last write in one `ZADD`:
//! under load, many claims cost Redis one command. The queue is bounded: when
//! it is full, a claim waits for room, so a slow Redis slows claims down
//! instead of growing memory. The writer starts on the first claim, and ends
//! once every clone of the store is gone and the queue is written.

use std::sync::OnceLock;

use redis::aio::ConnectionLike;
use tokio::sync::{mpsc, oneshot};

/// Entries the queue holds before a claim waits for room.
const CAPACITY: usize = 4096;
/// Entries one `ZADD` adds at most.
const BATCH: usize = 512;

enum Entry {
    Add {
        tag: String,
        expires_at_ms: i64,
    },
    /// Answered once every entry queued before it has been written.
    Flush(oneshot::Sender<()>),
}

/// The queue of index writes of one store and its clones.
#[derive(Default)]
pub(crate) struct IndexQueue {
    sender: OnceLock<mpsc::Sender<Entry>>,
}

impl IndexQueue {
    /// Queues `tag` with its expiry, starting the writer on first use; waits
    /// only while the queue is full. If the writer is gone (its runtime shut
    /// down), writes the entry itself.
    pub(crate) async fn add<C>(&self, conn: &C, expiry_key: &str, tag: String, expires_at_ms: i64)
    where
        C: ConnectionLike + Clone + Send + Sync + 'static,
    {
        let sender = self.sender.get_or_init(|| {
            let (sender, queue) = mpsc::channel(CAPACITY);
            tokio::spawn(write(conn.clone(), expiry_key.to_owned(), queue));
            sender
        });
        let entry = Entry::Add { tag, expires_at_ms };
        let entry = match sender.try_send(entry) {
            Ok(()) => return,
            Err(mpsc::error::TrySendError::Full(entry)) => match sender.send(entry).await {
                Ok(()) => return,
                Err(mpsc::error::SendError(entry)) => entry,
            },
            Err(mpsc::error::TrySendError::Closed(entry)) => entry,
        };
        if let Entry::Add { tag, expires_at_ms } = entry {
            let mut conn = conn.clone();
            zadd(&mut conn, expiry_key, vec![(tag, expires_at_ms)]).await;
        }
    }

    /// Waits until every entry queued so far has been written (or failed and
    /// been logged).
    pub(crate) async fn flush(&self) {
        let Some(sender) = self.sender.get() else { return };
        let (done, written) = oneshot::channel();
        if sender.send(Entry::Flush(done)).await.is_ok() {
            let _ = written.await;
        }
    }
}

async fn write<C: ConnectionLike + Send>(mut conn: C, expiry_key: String, mut queue: mpsc::Receiver<Entry>) {
    let mut taken = Vec::with_capacity(BATCH);
    while queue.recv_many(&mut taken, BATCH).await > 0 {
        let mut adds = Vec::with_capacity(taken.len());
        let mut flushes = Vec::new();
        for entry in taken.drain(..) {
            match entry {
                Entry::Add { tag, expires_at_ms } => adds.push((tag, expires_at_ms)),
                Entry::Flush(done) => flushes.push(done),
            }
        }
        if !adds.is_empty() {
            zadd(&mut conn, &expiry_key, adds).await;
        }
        for done in flushes {
            let _ = done.send(());
        }
    }
}

async fn zadd<C: ConnectionLike + Send>(conn: &mut C, expiry_key: &str, adds: Vec<(String, i64)>) {
    let mut cmd = redis::cmd("ZADD");
    cmd.arg(expiry_key);
    for (tag, expires_at_ms) in &adds {
        cmd.arg(*expires_at_ms).arg(tag);
    }
    let written: redis::RedisResult<i64> = cmd.query_async(conn).await;
    if let Err(e) = written {
        tracing::debug!(error = %e, entries = adds.len(), "expiry index not updated; Redis expires the rows by their TTL");
    }
}
