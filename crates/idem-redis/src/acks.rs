//! Writes that count only once replicas hold them: Redis replicates
//! asynchronously, so a claim, a sent mark or an outcome a master
//! acknowledged can be lost by a failover to a replica that had not received
//! it yet; the key then runs again. With
//! [`RedisStore::with_replica_acks`](crate::RedisStore::with_replica_acks),
//! every write of a key's row is followed by `WAIT numreplicas timeout` on
//! the same connection, and a write fewer replicas acknowledged in time is
//! an error: the caller does not count on it.
//!
//! The script and its `WAIT` travel in one pipeline, so the `WAIT` is sure
//! to follow the write on the connection that made it (a `WAIT` on a
//! connection opened after a reconnection would count nothing of this
//! client's and answer at once). On a cluster the pipeline goes to the node
//! that serves the row's slot (the cluster client routes a pipeline by its
//! first keyed command), so the `WAIT` counts that node's replicas.

use std::time::Duration;

use idem_core::{Error, Result, StoreErrorKind};
use redis::aio::ConnectionLike;
use redis::{Cmd, FromRedisValue, Script, ToRedisArgs};

use crate::store_error;

/// How many replicas must acknowledge a write, and how long to wait for
/// them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ReplicaAcks {
    replicas: u32,
    timeout_ms: u64,
}

/// The longest `WAIT` a store accepts: it must end before the driver's
/// response timeout, or the driver would give up on an answer Redis is still
/// to send.
pub(crate) const MAX_WAIT: Duration = Duration::from_secs(4);

impl ReplicaAcks {
    /// `replicas` (1 to 16) within `timeout` (1 ms to [`MAX_WAIT`]).
    pub(crate) fn new(replicas: u32, timeout: Duration) -> Result<Self> {
        if !(1..=16).contains(&replicas) {
            return Err(Error::Config(format!(
                "Redis replica acknowledgements: {replicas} replicas; give 1 to 16 (leave the setting out for none)"
            )));
        }
        let timeout_ms = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX);
        if timeout_ms == 0 || timeout > MAX_WAIT {
            return Err(Error::Config(format!(
                "Redis replica acknowledgements: a wait of {timeout:?}; give 1 ms to {MAX_WAIT:?} \
                 (a WAIT of 0 would wait for ever)"
            )));
        }
        Ok(Self { replicas, timeout_ms })
    }

    fn wait(&self) -> Cmd {
        let mut wait = redis::cmd("WAIT");
        wait.arg(self.replicas).arg(self.timeout_ms);
        wait
    }

    /// Fails unless `acknowledged` replicas are enough.
    fn check(&self, acknowledged: i64) -> Result<()> {
        if acknowledged >= i64::from(self.replicas) {
            return Ok(());
        }
        metrics::counter!("idem_redis_replica_acks_missing_total").increment(1);
        Err(Error::store(
            StoreErrorKind::Unavailable,
            format!(
                "the write was acknowledged by {acknowledged} of the {} replicas required within {} ms: \
                 the master holds it, but a failover may lose it",
                self.replicas, self.timeout_ms
            ),
        ))
    }
}

/// A script with its keys and arguments, run plainly or followed by `WAIT`.
pub(crate) struct ScriptCall<'s> {
    script: &'s Script,
    keys: Vec<Vec<u8>>,
    args: Vec<Vec<u8>>,
}

impl<'s> ScriptCall<'s> {
    pub(crate) fn new(script: &'s Script) -> Self {
        Self {
            script,
            keys: Vec::with_capacity(2),
            args: Vec::with_capacity(10),
        }
    }

    pub(crate) fn key(mut self, key: impl ToRedisArgs) -> Self {
        key.write_redis_args(&mut self.keys);
        self
    }

    pub(crate) fn arg(mut self, arg: impl ToRedisArgs) -> Self {
        arg.write_redis_args(&mut self.args);
        self
    }

    fn evalsha(&self) -> Cmd {
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(self.script.get_hash()).arg(self.keys.len());
        for key in &self.keys {
            cmd.arg(&key[..]);
        }
        for arg in &self.args {
            cmd.arg(&arg[..]);
        }
        cmd
    }

    /// Runs the script. With `acks`, the write is acknowledged by the
    /// replicas before this answers, unless `wrote` says the script's
    /// answer wrote nothing (a found row, a fenced holder): then how many
    /// replicas hold it does not matter, and a replay still answers while
    /// the replicas are away.
    pub(crate) async fn run<T, C>(
        &self,
        conn: &mut C,
        acks: Option<ReplicaAcks>,
        wrote: impl Fn(&T) -> bool,
    ) -> Result<T>
    where
        T: FromRedisValue,
        C: ConnectionLike + Send,
    {
        let Some(acks) = acks else {
            return self.plain(conn).await;
        };
        let mut pipe = redis::pipe();
        pipe.add_command(self.evalsha()).add_command(acks.wait());
        let answered = match pipe.query_async::<(T, i64)>(conn).await {
            Err(e) if no_script(&e) => {
                self.script.load_async(conn).await.map_err(store_error)?;
                pipe.query_async::<(T, i64)>(conn).await
            }
            answered => answered,
        };
        let (answer, acknowledged) = answered.map_err(store_error)?;
        if wrote(&answer) {
            acks.check(acknowledged)?;
        }
        Ok(answer)
    }

    async fn plain<T: FromRedisValue, C: ConnectionLike + Send>(&self, conn: &mut C) -> Result<T> {
        match self.evalsha().query_async(conn).await {
            Err(e) if no_script(&e) => {
                self.script.load_async(conn).await.map_err(store_error)?;
                self.evalsha().query_async(conn).await.map_err(store_error)
            }
            answered => answered.map_err(store_error),
        }
    }
}

fn no_script(e: &redis::RedisError) -> bool {
    e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_out_of_range_are_refused() {
        assert!(ReplicaAcks::new(0, Duration::from_millis(100)).is_err());
        assert!(ReplicaAcks::new(17, Duration::from_millis(100)).is_err());
        assert!(ReplicaAcks::new(1, Duration::ZERO).is_err());
        assert!(ReplicaAcks::new(1, Duration::from_secs(5)).is_err());
        assert!(ReplicaAcks::new(1, Duration::from_micros(500)).is_err());
        let ok = ReplicaAcks::new(2, Duration::from_millis(250)).unwrap();
        assert!(ok.check(2).is_ok() && ok.check(3).is_ok());
        let short = ok.check(1).unwrap_err();
        assert_eq!(short.store_kind(), Some(StoreErrorKind::Unavailable));
        assert!(short.to_string().contains("1 of the 2 replicas"), "{short}");
    }
}
