//! The sweeper's expiry index, written off the request path.
//!
//! A claim's row carries its own time to live, so the index only serves the
//! sweeper and the operator commands; a claim need not wait for it. Each
//! claim queues (tag, expiry) to one writer task per store (shared by its
//! clones), which adds everything queued since its last write in one `ZADD`:
//! under load, many claims cost Redis one command. After a write the writer
//! lingers a few milliseconds before the next, so that claims made one at a
//! time are batched too instead of costing a `ZADD` each (the index is read
//! only by the sweep and the operator's commands, which flush it first, and
//! no entry is due for far longer than the linger). The queue is bounded: when
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
/// How long the writer waits after a write before it takes the next batch.
const LINGER: std::time::Duration = std::time::Duration::from_millis(5);

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
        let wrote = !adds.is_empty();
        if wrote {
            zadd(&mut conn, &expiry_key, adds).await;
        }
        let flushed = !flushes.is_empty();
        for done in flushes {
            let _ = done.send(());
        }
        // A flush is answered at once; a write is followed by a pause in
        // which the next claims gather into one batch.
        if wrote && !flushed {
            tokio::time::sleep(LINGER).await;
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

#[cfg(test)]
pub(crate) mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    use redis::{Cmd, Pipeline, RedisFuture, Value};

    use super::*;

    /// A command's plain arguments, its name first.
    pub(crate) fn command_args(cmd: &Cmd) -> Vec<Vec<u8>> {
        cmd.args_iter()
            .filter_map(|a| match a {
                redis::Arg::Simple(b) => Some(b.to_vec()),
                _ => None,
            })
            .collect()
    }

    /// A connection that answers every command and counts the `ZADD`s.
    #[derive(Clone, Default)]
    struct Counting {
        zadds: Arc<AtomicUsize>,
        entries: Arc<AtomicUsize>,
    }

    impl ConnectionLike for Counting {
        fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
            let args = command_args(cmd);
            if args.first().is_some_and(|a| a.as_slice() == b"ZADD") {
                self.zadds.fetch_add(1, Ordering::SeqCst);
                self.entries.fetch_add((args.len() - 2) / 2, Ordering::SeqCst);
            }
            Box::pin(async { Ok(Value::Int(1)) })
        }

        fn req_packed_commands<'a>(
            &'a mut self,
            _cmd: &'a Pipeline,
            _offset: usize,
            _count: usize,
        ) -> RedisFuture<'a, Vec<Value>> {
            Box::pin(async { Ok(Vec::new()) })
        }

        fn get_db(&self) -> i64 {
            0
        }
    }

    /// Claims made one at a time, a millisecond apart, share `ZADD`s (one
    /// per linger) rather than costing one each; a flush still sees every
    /// entry.
    #[tokio::test(start_paused = true)]
    async fn claims_one_at_a_time_are_batched() {
        let conn = Counting::default();
        let queue = IndexQueue::default();
        for i in 0..50 {
            queue.add(&conn, "idem:expiry", format!("t{i}"), 1_000 + i).await;
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        queue.flush().await;
        assert_eq!(conn.entries.load(Ordering::SeqCst), 50, "every claim is indexed");
        let zadds = conn.zadds.load(Ordering::SeqCst);
        assert!(zadds <= 12, "50 claims 1 ms apart cost {zadds} ZADDs");
    }
}
