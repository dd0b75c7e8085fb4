//! Redis lease store for idem (lease mode only: Redis has no transaction a
//! caller's database writes could join).
//!
//! The guide: `docs/http.md` (Engines) and `docs/operations.md` in the repository.
//!
//! Each key lives in one Redis hash, `<prefix>:{<tag>}:r`, where the tag is
//! 128 bits of SHA-256 over (tenant, operation, key): fingerprint, status,
//! fencing token, lease expiry, key expiry, recorded outcome and the time
//! the claim was first marked sent. Its fencing counter,
//! `<prefix>:{<tag>}:t`, has the same hash tag, so it lives in the same
//! slot and every script below touches one slot: they all run on **Redis
//! Cluster**.
//!
//! - **Claim**: one script checks the row and, if it is absent or stale
//!   (expired, or an in-progress lease past its lease, but never a claim
//!   marked sent: that one is held until the key expires), writes the new
//!   in-progress row with a token larger than any token the key handed out
//!   before (the larger of the engine's fresh token and the counter plus
//!   one) and sets the row's time to live. Atomic like `SET NX PX`, and it
//!   takes over a stale row in the same step.
//! - **Complete, release, extend, mark sent**: compare-and-set scripts on
//!   the token, for a claim in progress or marked sent (status 0 or 4); a
//!   stale holder changes nothing and gets [`Error::Fenced`]. Marking sent
//!   sets status 4 and keeps the earliest mark's time (`sent`), which
//!   completing keeps too. An extension whose lease would outlive the key
//!   raises the key's expiry with it — in the row, in its Redis TTL and in
//!   its index entry — as the SQL stores raise `expires_at_ms`: a holder
//!   whose work outlives the key's TTL keeps its claim while its heartbeat
//!   runs.
//! - **Resolve**: one script settles an unexpired row holding an unknown
//!   outcome — recorded as unknown (status 3), or marked sent (status 4)
//!   with its lease run out — by recording an outcome or deleting the row.
//! - **Lookup** reads the row with one `HMGET`. Rows written before sent
//!   claims existed have no `sent` field: they were never marked.
//! - **Sweep**: Redis expires rows itself (their TTL is the key's expiry);
//!   [`Sweep`] walks the sorted set `<prefix>:expiry` in bounded batches
//!   and settles each entry due: an expired row is deleted, an entry whose
//!   row Redis already expired (a *ghost*) is removed and counted apart
//!   ([`SweepBatch::ghosts`]), an entry of a row whose lease raised its
//!   expiry moves up. The index is thus bounded by the live rows once a
//!   sweep has run (the `idem` gateway runs one in the background).
//! - **The expiry index** is written off the claim's path: a claim queues
//!   its entry and answers; one writer per store adds what is queued in one
//!   `ZADD` (on Redis Cluster the index lives in its own slot, so no script
//!   could write it with the row). The queue is bounded (a full queue makes
//!   claims wait for room). The sweep and the operator's view
//!   ([`KeyAdmin`](idem_core::KeyAdmin): stats, listings, purges) of a store
//!   first wait for its own queue ([`flush_index`](RedisStore::flush_index));
//!   another process sees a claim in the index about one Redis round trip
//!   after it was made. A process that stops between a claim and its index
//!   write leaves the row unindexed: the sweeper and the operator commands
//!   do not see it, and Redis deletes it at its expiry by its TTL. The
//!   operator's view reads each indexed row (many at once on one
//!   connection); an entry whose row is gone is no key. A purge deletes a
//!   row only through a script that checks the filter again on the row as
//!   it is then, so a key claimed again meanwhile is never deleted.
//!
//! Tokens are compared as decimal strings inside the scripts: they exceed
//! 2^53, which Lua's numbers cannot hold exactly.
//!
//! # Connecting
//!
//! [`RedisStore::connect`] (one server), [`RedisStore::connect_cluster`]
//! (seed nodes), or [`RedisStore::connect_any`], which takes what a user
//! types: one URL (a cluster node is recognised by `INFO`), or several
//! separated by commas (a cluster), and gives a store on a
//! [`RedisConnection`].
//!
//! # Durability
//!
//! A lease store is only as good as its memory of claims. Run Redis with
//! `appendonly yes` and `appendfsync everysec` (or `always`) and
//! `maxmemory-policy noeviction`: an evicted or lost row lets a second holder
//! claim a key whose first holder is still working, or whose outcome was
//! recorded. [`RedisStore::check_deployment`] reads those settings on every
//! master, refuses an eviction policy and warns about missing persistence;
//! the `idem` gateway and the `idem` commands that write run it at start. A
//! failover to a replica that had not received the latest writes loses them
//! the same way (Redis replication is asynchronous): after a failover, a key
//! claimed or completed in the last moments before it may run again, unless
//! the store waits for replicas: with
//! [`RedisStore::with_replica_acks`], each write of a key's row counts only
//! once that many replicas acknowledged it (`WAIT`), and one they did not is
//! an error. `docs/deployments.md` measures both.

mod acks;
mod admin;
mod connection;
mod deployment;
mod index;
mod scripts;
mod sentinel;
mod tls;

use std::fmt;
use std::sync::Arc;

use futures_util::{StreamExt, TryStreamExt};
use idem_core::{
    BoxFuture, ClaimRequest, Error, IdempotencyKey, Lease, LeaseClaim, LeaseStore, Record, Resolution, Result, Scope,
    StoreErrorKind, StoredRow, Sweep, SweepBatch, TimeSource, Token,
};
use redis::aio::{ConnectionLike, ConnectionManager};
use redis::cluster_async::ClusterConnection;
use redis::{Script, Value};
use sha2::{Digest, Sha256};

use crate::acks::ScriptCall;

pub use crate::connection::RedisConnection;
pub use crate::sentinel::{LOOKUP_TIMEOUT, REDISCOVERY_PAUSE, SentinelConnection, WATCH_INTERVAL};

/// The default key prefix.
pub const DEFAULT_PREFIX: &str = "idem";

/// Row scripts and reads in flight at once when a sweep or an operator
/// command walks many rows: each row is its own key (and, on a cluster, its
/// own slot), so they cannot share one pipeline or script, but they can
/// share the connection.
const CONCURRENCY: usize = 64;

struct Scripts {
    claim: Script,
    mark_sent: Script,
    complete: Script,
    resolve: Script,
    release: Script,
    extend: Script,
    sweep_one: Script,
    settle_index: Script,
    purge_one: Script,
}

/// The lease store on Redis or Redis Cluster (`C` is the connection:
/// [`ConnectionManager`] for one server, [`ClusterConnection`] for a
/// cluster).
#[derive(Clone)]
pub struct RedisStore<C = ConnectionManager> {
    conn: C,
    prefix: Arc<str>,
    /// `<prefix>:expiry`, made once.
    expiry: Arc<str>,
    /// Whether commands on many rows may share one pipeline: on one server
    /// they may; on a cluster each row is in a slot of its own.
    pipelines: bool,
    scripts: Arc<Scripts>,
    index: Arc<index::IndexQueue>,
    /// How to reach the deployment's other nodes (its replicas) with the
    /// same credentials and TLS, for the deployment check.
    dialer: Option<Arc<deployment::Dialer>>,
    /// Replicas that must acknowledge each write of a key's row.
    acks: Option<acks::ReplicaAcks>,
}

impl<C> fmt::Debug for RedisStore<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStore")
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

/// Maps a Redis error to a portable store error.
pub fn store_error(e: redis::RedisError) -> Error {
    // A server that refuses a write as a replica (demoted by a failover),
    // one cut off from its master or still loading its data wrote nothing:
    // the call may be made again.
    let refused_for_now = matches!(
        e.kind(),
        redis::ErrorKind::Server(
            redis::ServerErrorKind::MasterDown
                | redis::ServerErrorKind::BusyLoading
                | redis::ServerErrorKind::TryAgain
                | redis::ServerErrorKind::ClusterDown
        )
    ) || refused_by_replica(&e);
    let kind = if refused_for_now
        || e.is_io_error()
        || e.is_connection_dropped()
        || e.is_timeout()
        || e.is_connection_refusal()
    {
        StoreErrorKind::Unavailable
    } else {
        StoreErrorKind::Other
    };
    Error::store(kind, e)
}

/// Whether a server refused a write as a replica: `READONLY`, or (Redis 6)
/// a script error that carries it.
pub(crate) fn refused_by_replica(e: &redis::RedisError) -> bool {
    matches!(e.kind(), redis::ErrorKind::Server(redis::ServerErrorKind::ReadOnly))
        || e.detail().is_some_and(names_a_readonly_refusal)
}

/// Whether an error's text is a replica's refusal of a write.
pub(crate) fn names_a_readonly_refusal(detail: &str) -> bool {
    detail.contains("-READONLY ") || detail.starts_with("READONLY ")
}

/// How long a command's answer may take. Claims of many callers share one
/// connection, and on a busy host the last of thousands in flight can wait
/// past the driver's default of half a second although Redis answered each
/// at once; a claim that times out may have been taken (its caller is then
/// told in flight until its lease ends), so the bound is generous: a Redis
/// that takes longer is in trouble, not busy.
const RESPONSE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// Commands go out as they come, several in flight on one connection: with
/// Nagle's algorithm a command written while an earlier one is unanswered
/// would wait for the server's ACK.
fn tcp_settings() -> redis::io::tcp::TcpSettings {
    redis::io::tcp::TcpSettings::default().set_nodelay(true)
}

impl RedisStore<ConnectionManager> {
    /// Connects to one Redis server (`redis://host:port/db`, or
    /// `rediss://` for TLS, with `?ca_file=PATH` to trust only that CA),
    /// reconnecting as needed once connected. A server that cannot be
    /// reached at all fails at once, rather than after the reconnection
    /// attempts.
    pub async fn connect(url: &str) -> Result<Self> {
        let (url, ca) = tls::split_ca_file(url)?;
        let url = url.as_str();
        let bad =
            |e: redis::RedisError| Error::Config(idem_core::redact_credentials(&format!("Redis URL {url:?}: {e}")));
        let info = redis::IntoConnectionInfo::into_connection_info(url)
            .map_err(bad)?
            .set_tcp_settings(tcp_settings());
        let dialer = deployment::Dialer::new(info.clone(), ca.clone(), url);
        let client = tls::client(info, ca.as_deref(), url)?;
        // One plain connection first: the manager below retries a refused
        // connection for seconds, which helps a running service through a
        // restart of Redis but only delays a start against a wrong address.
        drop(
            client
                .get_multiplexed_async_connection()
                .await
                .map_err(|e| tls::connect_error(url, e))?,
        );
        let config = redis::aio::ConnectionManagerConfig::new().set_response_timeout(Some(RESPONSE_TIMEOUT));
        let conn = ConnectionManager::new_with_config(client, config)
            .await
            .map_err(store_error)?;
        Ok(Self::new(conn).with_dialer(Some(Arc::new(dialer))))
    }
}

impl RedisStore<ClusterConnection> {
    /// Connects to a Redis Cluster through any of its nodes (`rediss://`
    /// for TLS; a `?ca_file=PATH` on any node is the CA of all).
    pub async fn connect_cluster(nodes: &[&str]) -> Result<Self> {
        let mut ca = None;
        let mut plain = Vec::with_capacity(nodes.len());
        for node in nodes {
            let (node, node_ca) = tls::split_ca_file(node)?;
            ca = ca.or(node_ca);
            plain.push(node);
        }
        let builder = redis::cluster::ClusterClient::builder(plain.clone())
            .tcp_settings(tcp_settings())
            .response_timeout(RESPONSE_TIMEOUT);
        let client = tls::cluster_certs(builder, ca.as_deref())?.build().map_err(|e| {
            Error::Config(idem_core::redact_credentials(&format!(
                "Redis Cluster nodes {plain:?}: {e}"
            )))
        })?;
        let conn = client
            .get_async_connection()
            .await
            .map_err(|e| tls::connect_error(&plain.join(","), e))?;
        let dialer = plain.first().and_then(|first| {
            redis::IntoConnectionInfo::into_connection_info(first.as_str())
                .ok()
                .map(|info| {
                    Arc::new(deployment::Dialer::new(
                        info.set_tcp_settings(tcp_settings()),
                        ca.clone(),
                        first,
                    ))
                })
        });
        Ok(Self::new(conn).on_cluster().with_dialer(dialer))
    }
}

impl<C> RedisStore<C> {
    /// Marks the store as one on a Redis Cluster: commands on many rows are
    /// sent row by row (several in flight), never in one pipeline.
    pub(crate) fn on_cluster(mut self) -> Self {
        self.pipelines = false;
        self
    }

    /// A store on `conn` with the prefix [`DEFAULT_PREFIX`].
    pub fn new(conn: C) -> Self {
        Self {
            conn,
            prefix: DEFAULT_PREFIX.into(),
            expiry: format!("{DEFAULT_PREFIX}:expiry").into(),
            pipelines: true,
            scripts: Arc::new(Scripts {
                claim: Script::new(scripts::CLAIM),
                mark_sent: Script::new(scripts::MARK_SENT),
                complete: Script::new(scripts::COMPLETE),
                resolve: Script::new(scripts::RESOLVE),
                release: Script::new(scripts::RELEASE),
                extend: Script::new(scripts::EXTEND),
                sweep_one: Script::new(scripts::SWEEP_ONE),
                settle_index: Script::new(scripts::SETTLE_INDEX),
                purge_one: Script::new(scripts::PURGE_ONE),
            }),
            index: Arc::default(),
            dialer: None,
            acks: None,
        }
    }

    /// Counts a write of a key's row (a claim, a sent mark, an outcome, a
    /// release, an extension, a resolution) only once `replicas` replicas
    /// acknowledged it within `timeout` (1 ms to 4 s): each such write is
    /// followed by `WAIT replicas timeout` on its connection, and a write
    /// fewer replicas acknowledged in time fails with a store error
    /// ([`StoreErrorKind::Unavailable`]) although the master holds it. A
    /// claim so refused is answered in flight to a retry until its lease
    /// ends; an outcome so refused leaves the key in progress, then an
    /// unknown outcome, as any completion the store refused.
    ///
    /// With it, a failover to a replica that acknowledged the write keeps
    /// every claim, sent mark and outcome the store answered for. Sentinel
    /// and Redis Cluster promote the replica furthest along, so `replicas`
    /// may be fewer than the master's replicas; with as many as it has, any
    /// replica promoted holds them. The cost is a `WAIT` per write (one
    /// round trip to the replicas), and the commands of one connection queue
    /// behind it; `docs/deployments.md` has the figures. While no replica
    /// acknowledges, every write fails after its wait, and a claim that finds
    /// a recorded outcome (a replay) answers once the wait has run out.
    pub fn with_replica_acks(mut self, replicas: u32, timeout: std::time::Duration) -> Result<Self> {
        self.acks = Some(acks::ReplicaAcks::new(replicas, timeout)?);
        Ok(self)
    }

    /// Keeps how the deployment's other nodes are reached.
    pub(crate) fn with_dialer(mut self, dialer: Option<Arc<deployment::Dialer>>) -> Self {
        self.dialer = dialer;
        self
    }

    /// Uses another key prefix (1 to 64 of `[A-Za-z0-9_.:-]`): one per
    /// service, or per kind of key.
    pub fn with_prefix(mut self, prefix: &str) -> Result<Self> {
        let ok = !prefix.is_empty()
            && prefix.len() <= 64
            && prefix
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b':' | b'-'));
        if !ok {
            return Err(Error::Config(format!(
                "Redis key prefix {prefix:?} must be 1 to 64 of [A-Za-z0-9_.:-]"
            )));
        }
        self.prefix = prefix.into();
        self.expiry = format!("{prefix}:expiry").into();
        // The index of another prefix is written by a queue of its own.
        self.index = Arc::default();
        Ok(self)
    }

    /// The key prefix.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The connection the store sends its commands on (a
    /// [`RedisConnection`] says which master Sentinel named, for one).
    pub fn connection(&self) -> &C {
        &self.conn
    }

    fn tag(scope: &idem_core::Scope, key: &idem_core::IdempotencyKey) -> String {
        let mut h = Sha256::new();
        for part in [scope.tenant().as_str(), scope.operation().as_str(), key.as_str()] {
            h.update((part.len() as u64).to_le_bytes());
            h.update(part.as_bytes());
        }
        hex::encode(&h.finalize()[..16])
    }

    fn row_key(&self, tag: &str) -> String {
        format!("{}:{{{tag}}}:r", self.prefix)
    }

    fn counter_key(&self, tag: &str) -> String {
        format!("{}:{{{tag}}}:t", self.prefix)
    }

    fn expiry_key(&self) -> &str {
        &self.expiry
    }
}

fn bytes(v: &Value) -> Option<Vec<u8>> {
    match v {
        Value::BulkString(b) => Some(b.clone()),
        Value::SimpleString(s) => Some(s.clone().into_bytes()),
        _ => None,
    }
}

/// The bytes of a string value, moved out of it.
fn take_bytes(v: &mut Value) -> Option<Vec<u8>> {
    match std::mem::replace(v, Value::Nil) {
        Value::BulkString(b) => Some(b),
        Value::SimpleString(s) => Some(s.into_bytes()),
        _ => None,
    }
}

fn text(v: &Value) -> Option<String> {
    match v {
        Value::VerbatimString { text, .. } => Some(text.clone()),
        other => bytes(other).and_then(|b| String::from_utf8(b).ok()),
    }
}

fn corrupt(what: &str) -> Error {
    Error::Corrupt(format!("Redis row: {what}"))
}

/// A string value's text, borrowed.
fn str_of(v: &Value) -> Option<&str> {
    match v {
        Value::BulkString(b) => std::str::from_utf8(b).ok(),
        Value::SimpleString(s) => Some(s),
        Value::VerbatimString { text, .. } => Some(text),
        _ => None,
    }
}

fn int(v: &Value, what: &str) -> Result<i64> {
    str_of(v).and_then(|s| s.parse().ok()).ok_or_else(|| corrupt(what))
}

/// An optional integer field: absent (nil) or empty is `None`.
fn opt_int(v: &Value, what: &str) -> Result<Option<i64>> {
    match v {
        Value::Nil => Ok(None),
        v => match str_of(v) {
            Some("") => Ok(None),
            Some(s) => s.parse().map(Some).map_err(|_| corrupt(what)),
            None => Err(corrupt(what)),
        },
    }
}

/// The row fields read back as a [`StoredRow`], in this order.
const ROW_FIELDS: [&str; 7] = ["fp", "st", "tok", "lease", "exp", "pl", "sent"];

/// Decodes a row from its fields (fingerprint, status, token, lease expiry,
/// key expiry), its recorded outcome and its sent mark's time.
fn decode_row(fields: &[Value], payload: Option<Vec<u8>>, sent_at_ms: Option<i64>) -> Result<StoredRow> {
    let [fingerprint, status, token, lease, expires, ..] = fields else {
        return Err(corrupt("missing fields"));
    };
    let fingerprint = bytes(fingerprint).ok_or_else(|| corrupt("fingerprint"))?;
    let status = i16::try_from(int(status, "status")?).map_err(|_| corrupt("status"))?;
    let row = StoredRow::from_columns(
        &fingerprint,
        status,
        int(token, "token")?,
        payload,
        opt_int(lease, "lease")?,
        int(expires, "expiry")?,
    )?;
    Ok(row.with_sent_at_ms(sent_at_ms))
}

impl<C: ConnectionLike + Clone + Send + Sync + 'static> RedisStore<C> {
    /// Runs a compare-and-set `script` on the lease's row (and its counter)
    /// with the lease's token and `extra` arguments; answers the script's
    /// code (1 or more: done), or [`Error::Fenced`] (0).
    async fn fenced(&self, script: &Script, lease: &Lease, extra: &[&[u8]]) -> Result<i64> {
        let tag = Self::tag(&lease.scope, &lease.key);
        let mut call = ScriptCall::new(script)
            .key(self.row_key(&tag))
            .key(self.counter_key(&tag))
            .arg(lease.token.0.to_string());
        for a in extra {
            call = call.arg(*a);
        }
        let mut conn = self.conn.clone();
        let done: i64 = call.run(&mut conn, self.acks, |done: &i64| *done >= 1).await?;
        if done >= 1 { Ok(done) } else { Err(Error::Fenced) }
    }
}

impl<C: ConnectionLike + Clone + Send + Sync + 'static> LeaseStore for RedisStore<C> {
    fn try_claim<'a>(&'a self, req: &'a ClaimRequest<'a>) -> BoxFuture<'a, Result<LeaseClaim>> {
        Box::pin(async move {
            let tag = Self::tag(req.scope, req.key);
            let lease = req.lease_expires_at_ms.unwrap_or(req.expires_at_ms);
            let ttl_ms = (req.expires_at_ms - req.now_ms).max(1);
            let mut conn = self.conn.clone();
            let mut reply: Vec<Value> = ScriptCall::new(&self.scripts.claim)
                .key(self.row_key(&tag))
                .key(self.counter_key(&tag))
                .arg(&req.fingerprint.as_bytes()[..])
                .arg(req.now_ms)
                .arg(req.expires_at_ms)
                .arg(req.fresh_token.0.to_string())
                .arg(lease)
                .arg(ttl_ms)
                .arg(req.scope.tenant().as_str())
                .arg(req.scope.operation().as_str())
                .arg(req.key.as_str())
                .run(&mut conn, self.acks, |reply: &Vec<Value>| {
                    reply.first().and_then(str_of) == Some("acquired")
                })
                .await?;
            match reply.first().and_then(str_of) {
                Some("acquired") => {
                    let token = reply
                        .get(1)
                        .map(|v| int(v, "token"))
                        .transpose()?
                        .ok_or_else(|| corrupt("token"))?;
                    // The sweeper's index, written off this path; Redis also
                    // expires the row by its TTL.
                    self.index
                        .add(&self.conn, self.expiry_key(), tag, req.expires_at_ms)
                        .await;
                    Ok(LeaseClaim::Acquired(Token(token)))
                }
                Some("found") if reply.len() == 7 => {
                    // The recorded outcome is taken out of the reply, not
                    // copied. The claim does not read the sent mark's time.
                    let payload = take_bytes(&mut reply[6]);
                    Ok(LeaseClaim::Found(decode_row(&reply[1..6], payload, None)?))
                }
                _ => Err(corrupt("unexpected claim reply")),
            }
        })
    }

    fn mark_sent<'a>(&'a self, lease: &'a Lease, now_ms: i64) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            let now = now_ms.to_string();
            self.fenced(&self.scripts.mark_sent, lease, &[now.as_bytes()])
                .await
                .map(drop)
        })
    }

    /// Reads the row with one `HMGET`, expired or not (until Redis drops
    /// it by its TTL).
    fn lookup<'a>(&'a self, scope: &'a Scope, key: &'a IdempotencyKey) -> BoxFuture<'a, Result<Option<StoredRow>>> {
        Box::pin(async move {
            let mut conn = self.conn.clone();
            let mut fields: Vec<Value> = redis::cmd("HMGET")
                .arg(self.row_key(&Self::tag(scope, key)))
                .arg(&ROW_FIELDS)
                .query_async(&mut conn)
                .await
                .map_err(store_error)?;
            if fields.len() != ROW_FIELDS.len() {
                return Err(corrupt("unexpected lookup reply"));
            }
            if fields[0] == Value::Nil {
                return Ok(None);
            }
            let sent_at_ms = opt_int(&fields[6], "sent")?;
            let payload = take_bytes(&mut fields[5]);
            decode_row(&fields[..5], payload, sent_at_ms).map(Some)
        })
    }

    fn complete<'a>(&'a self, lease: &'a Lease, record: &'a Record) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            let status = record.status.code().to_string();
            self.fenced(&self.scripts.complete, lease, &[status.as_bytes(), &record.payload])
                .await
                .map(drop)
        })
    }

    fn release<'a>(&'a self, lease: &'a Lease) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move { self.fenced(&self.scripts.release, lease, &[]).await.map(drop) })
    }

    /// Moves the lease, and the key's expiry with it when the lease would
    /// outlive the key (the row's expiry, its TTL in Redis and its expiry
    /// index entry), as the SQL stores raise `expires_at_ms`.
    fn extend<'a>(&'a self, lease: &'a Lease, lease_expires_at_ms: i64) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            let until = lease_expires_at_ms.to_string();
            let done = self.fenced(&self.scripts.extend, lease, &[until.as_bytes()]).await?;
            if done == 2 {
                let tag = Self::tag(&lease.scope, &lease.key);
                self.index
                    .add(&self.conn, self.expiry_key(), tag, lease_expires_at_ms)
                    .await;
            }
            Ok(())
        })
    }

    fn resolve_unknown<'a>(&'a self, req: &'a Resolution<'a>) -> BoxFuture<'a, Result<bool>> {
        Box::pin(async move {
            let tag = Self::tag(req.scope, req.key);
            let mut conn = self.conn.clone();
            let call = ScriptCall::new(&self.scripts.resolve)
                .key(self.row_key(&tag))
                .arg(req.now_ms);
            let call = match req.record {
                Some(record) => call
                    .arg("r")
                    .arg(record.status.code().to_string())
                    .arg(&record.payload[..]),
                None => call.arg("d"),
            };
            let done: i64 = call.run(&mut conn, self.acks, |done: &i64| *done == 1).await?;
            Ok(done == 1)
        })
    }
}

impl<C: ConnectionLike + Clone + Send + Sync + 'static> Sweep for RedisStore<C> {
    fn sweep_expired(&self, now_ms: i64, limit: u32) -> BoxFuture<'_, Result<u64>> {
        Box::pin(async move { Ok(self.sweep_batch(now_ms, limit).await?.deleted) })
    }

    /// Takes up to `limit` index entries due at `now_ms` and settles each
    /// by its row: an expired row is deleted, an entry whose row Redis
    /// already expired by its TTL (or that was released) is a ghost and is
    /// removed, an entry whose row lives on (its lease extended it) moves
    /// up to the row's expiry. Every entry taken up leaves the range due at
    /// `now_ms`, so a sweep that runs batches until one takes up fewer than
    /// `limit` ends, and leaves an index bounded by the live rows.
    fn sweep_batch(&self, now_ms: i64, limit: u32) -> BoxFuture<'_, Result<SweepBatch>> {
        Box::pin(async move {
            self.index.flush().await;
            let mut conn = self.conn.clone();
            let due: Vec<(String, f64)> = redis::cmd("ZRANGEBYSCORE")
                .arg(self.expiry_key())
                .arg("-inf")
                .arg(now_ms)
                .arg("WITHSCORES")
                .arg("LIMIT")
                .arg(0)
                .arg(limit)
                .query_async(&mut conn)
                .await
                .map_err(store_error)?;
            let looks: Vec<_> = due
                .iter()
                .map(|(tag, _)| {
                    let mut conn = self.conn.clone();
                    let mut invocation = self.scripts.sweep_one.key(self.row_key(tag));
                    invocation.arg(now_ms);
                    async move {
                        invocation
                            .invoke_async::<(i64, String)>(&mut conn)
                            .await
                            .map_err(store_error)
                    }
                })
                .collect();
            let looked: Vec<(i64, String)> = futures_util::stream::iter(looks)
                .buffered(CONCURRENCY)
                .try_collect()
                .await?;
            let mut batch = SweepBatch {
                examined: due.len() as u64,
                ..SweepBatch::default()
            };
            let mut settle = Vec::with_capacity(due.len());
            for ((tag, score), (found, expires)) in due.iter().zip(&looked) {
                match found {
                    0 => {
                        batch.ghosts += 1;
                        settle.push(("r", tag.as_str(), score.to_string()));
                    }
                    1 => {
                        batch.deleted += 1;
                        settle.push(("r", tag.as_str(), score.to_string()));
                    }
                    _ => settle.push(("m", tag.as_str(), expires.clone())),
                }
            }
            self.settle_index(&settle).await?;
            tracing::debug!(
                prefix = %self.prefix,
                deleted = batch.deleted,
                ghosts = batch.ghosts,
                examined = batch.examined,
                "swept expired keys"
            );
            Ok(batch)
        })
    }
}

impl<C: ConnectionLike + Clone + Send + Sync + 'static> RedisStore<C> {
    /// Runs the index-settling script over `(op, tag, score)` triples, a
    /// thousand at a time so that no one script holds Redis for long.
    async fn settle_index(&self, triples: &[(&str, &str, String)]) -> Result<()> {
        let mut conn = self.conn.clone();
        for chunk in triples.chunks(1_000) {
            let mut invocation = self.scripts.settle_index.key(self.expiry_key());
            for (op, tag, score) in chunk {
                invocation.arg(*op).arg(*tag).arg(score.as_str());
            }
            let _: i64 = invocation.invoke_async(&mut conn).await.map_err(store_error)?;
        }
        Ok(())
    }

    /// Waits until every claim made so far through this store (or a clone of
    /// it) is in the expiry index. The sweep and the operator methods of this
    /// store do this first; call it before another process reads the index.
    pub async fn flush_index(&self) {
        self.index.flush().await;
    }
}

impl<C: ConnectionLike + Clone + Send + Sync + 'static> TimeSource for RedisStore<C> {
    /// `TIME`: the server's clock (on a cluster, the node the command reaches).
    fn source_now_ms(&self) -> BoxFuture<'_, Result<i64>> {
        Box::pin(async move {
            let mut conn = self.conn.clone();
            let (secs, micros): (i64, i64) = redis::cmd("TIME").query_async(&mut conn).await.map_err(store_error)?;
            Ok(secs * 1000 + micros / 1000)
        })
    }
}
