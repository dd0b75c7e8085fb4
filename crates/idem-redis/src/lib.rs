//! Redis lease store for idem (lease mode only: Redis has no transaction a
//! caller's database writes could join).
//!
//! Each key lives in one Redis hash, `<prefix>:{<tag>}:r`, where the tag is
//! 128 bits of SHA-256 over (tenant, operation, key): fingerprint, status,
//! fencing token, lease expiry, key expiry and recorded outcome. Its fencing
//! counter, `<prefix>:{<tag>}:t`, has the same hash tag, so it lives in the
//! same slot and every script below touches one slot: they all run on
//! **Redis Cluster**.
//!
//! - **Claim**: one script checks the row and, if it is absent or stale
//!   (expired, or an in-progress lease past its lease), writes the new
//!   in-progress row with a token larger than any token the key handed out
//!   before (the larger of the engine's fresh token and the counter plus
//!   one) and sets the row's time to live. Atomic like `SET NX PX`, and it
//!   takes over a stale row in the same step.
//! - **Complete, release, extend**: compare-and-set scripts on the token; a
//!   stale holder changes nothing and gets [`Error::Fenced`].
//! - **Sweep**: Redis expires rows itself (their TTL is the key's expiry);
//!   [`Sweep`] also deletes, in bounded batches, rows whose expiry passed on
//!   the engine's clock, through a sorted set `<prefix>:expiry`.
//! - **The expiry index** is written off the claim's path: a claim queues
//!   its entry and answers; one writer per store adds what is queued in one
//!   `ZADD` (on Redis Cluster the index lives in its own slot, so no script
//!   could write it with the row). The queue is bounded (a full queue makes
//!   claims wait for room). The sweep, [`stats`](RedisStore::stats),
//!   [`list_keys`](RedisStore::list_keys) and
//!   [`purge_keys`](RedisStore::purge_keys) of a store first wait for its own
//!   queue ([`flush_index`](RedisStore::flush_index)); another process sees
//!   a claim in the index about one Redis round trip after it was made. A
//!   process that stops between a claim and its index write leaves the row
//!   unindexed: the sweeper and the operator commands do not see it, and
//!   Redis deletes it at its expiry by its TTL.
//!
//! Tokens are compared as decimal strings inside the scripts: they exceed
//! 2^53, which Lua's numbers cannot hold exactly.
//!
//! # Durability
//!
//! A lease store is only as good as its memory of claims. Run Redis with
//! `appendonly yes` and `appendfsync everysec` (or `always`) and
//! `maxmemory-policy noeviction`: an evicted or lost row lets a second holder
//! claim a key whose first holder is still working, or whose outcome was
//! recorded. A failover to a replica that had not received the latest writes
//! loses them the same way (Redis replication is asynchronous): after a
//! failover, a key claimed or completed in the last moments before it may
//! run again. Use `WAIT` semantics or a database store where that is not
//! acceptable.

mod index;

use std::fmt;
use std::sync::Arc;

use idem_core::{
    BoxFuture, ClaimRequest, Error, Lease, LeaseClaim, LeaseStore, Record, RecordStatus, Result, StoreErrorKind,
    StoredRow, Sweep, TimeSource, Token,
};
use redis::aio::{ConnectionLike, ConnectionManager};
use redis::cluster_async::ClusterConnection;
use redis::{Script, Value};
use sha2::{Digest, Sha256};

/// The default key prefix.
pub const DEFAULT_PREFIX: &str = "idem";

const CLAIM: &str = r#"
local function gt(a, b)
  if #a ~= #b then return #a > #b end
  return a > b
end
local function plus_one(s)
  local d = {}
  for i = 1, #s do d[i] = string.byte(s, i) - 48 end
  local i = #d
  while i >= 1 do
    if d[i] < 9 then d[i] = d[i] + 1; break end
    d[i] = 0
    i = i - 1
  end
  local out = {}
  if i == 0 then out[1] = '1' end
  for j = 1, #d do out[#out + 1] = string.char(d[j] + 48) end
  return table.concat(out)
end
local now = tonumber(ARGV[2])
local r = redis.call('HMGET', KEYS[1], 'fp', 'st', 'tok', 'lease', 'exp', 'pl')
if r[1] then
  local stale = tonumber(r[5]) <= now or (r[2] == '0' and tonumber(r[4]) <= now)
  if not stale then
    return {'found', r[1], r[2], r[3], r[4] or '', r[5], r[6] or ''}
  end
end
local token = ARGV[4]
local last = redis.call('GET', KEYS[2])
if last then
  local n = plus_one(last)
  if gt(n, token) then token = n end
end
if r[3] then
  local n = plus_one(r[3])
  if gt(n, token) then token = n end
end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'fp', ARGV[1], 'st', '0', 'tok', token, 'lease', ARGV[5], 'exp', ARGV[3],
  'tn', ARGV[7], 'op', ARGV[8], 'k', ARGV[9], 'cr', ARGV[2])
local ttl = tonumber(ARGV[6])
redis.call('PEXPIRE', KEYS[1], ttl)
redis.call('SET', KEYS[2], token, 'PX', ttl + 604800000)
return {'acquired', token}
"#;

const COMPLETE: &str = r#"
local r = redis.call('HMGET', KEYS[1], 'st', 'tok')
if r[1] ~= '0' or r[2] ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'st', ARGV[2], 'pl', ARGV[3])
redis.call('HDEL', KEYS[1], 'lease')
return 1
"#;

const RELEASE: &str = r#"
local r = redis.call('HMGET', KEYS[1], 'st', 'tok')
if r[1] ~= '0' or r[2] ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1])
return 1
"#;

const EXTEND: &str = r#"
local r = redis.call('HMGET', KEYS[1], 'st', 'tok')
if r[1] ~= '0' or r[2] ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'lease', ARGV[2])
return 1
"#;

const SWEEP_ONE: &str = r#"
local exp = redis.call('HGET', KEYS[1], 'exp')
if exp and tonumber(exp) <= tonumber(ARGV[1]) then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
"#;

struct Scripts {
    claim: Script,
    complete: Script,
    release: Script,
    extend: Script,
    sweep_one: Script,
}

/// The lease store on Redis or Redis Cluster (`C` is the connection:
/// [`ConnectionManager`] for one server, [`ClusterConnection`] for a
/// cluster).
#[derive(Clone)]
pub struct RedisStore<C = ConnectionManager> {
    conn: C,
    prefix: Arc<str>,
    scripts: Arc<Scripts>,
    index: Arc<index::IndexQueue>,
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
    let kind = if e.is_io_error() || e.is_connection_dropped() || e.is_timeout() || e.is_connection_refusal() {
        StoreErrorKind::Unavailable
    } else {
        StoreErrorKind::Other
    };
    Error::store(kind, e)
}

/// Commands go out as they come, several in flight on one connection: with
/// Nagle's algorithm a command written while an earlier one is unanswered
/// would wait for the server's ACK.
fn tcp_settings() -> redis::io::tcp::TcpSettings {
    redis::io::tcp::TcpSettings::default().set_nodelay(true)
}

impl RedisStore<ConnectionManager> {
    /// Connects to one Redis server (`redis://host:port/db`), reconnecting
    /// as needed.
    pub async fn connect(url: &str) -> Result<Self> {
        let info = redis::IntoConnectionInfo::into_connection_info(url)
            .map_err(|e| Error::Config(format!("Redis URL {url:?}: {e}")))?
            .set_tcp_settings(tcp_settings());
        let client = redis::Client::open(info).map_err(|e| Error::Config(format!("Redis URL {url:?}: {e}")))?;
        let conn = ConnectionManager::new(client).await.map_err(store_error)?;
        Ok(Self::new(conn))
    }
}

impl RedisStore<ClusterConnection> {
    /// Connects to a Redis Cluster through any of its nodes.
    pub async fn connect_cluster(nodes: &[&str]) -> Result<Self> {
        let client = redis::cluster::ClusterClient::builder(nodes.to_vec())
            .tcp_settings(tcp_settings())
            .build()
            .map_err(|e| Error::Config(format!("Redis Cluster nodes {nodes:?}: {e}")))?;
        let conn = client.get_async_connection().await.map_err(store_error)?;
        Ok(Self::new(conn))
    }
}

impl<C> RedisStore<C> {
    /// A store on `conn` with the prefix [`DEFAULT_PREFIX`].
    pub fn new(conn: C) -> Self {
        Self {
            conn,
            prefix: DEFAULT_PREFIX.into(),
            scripts: Arc::new(Scripts {
                claim: Script::new(CLAIM),
                complete: Script::new(COMPLETE),
                release: Script::new(RELEASE),
                extend: Script::new(EXTEND),
                sweep_one: Script::new(SWEEP_ONE),
            }),
            index: Arc::default(),
        }
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
        // The index of another prefix is written by a queue of its own.
        self.index = Arc::default();
        Ok(self)
    }

    /// The key prefix.
    pub fn prefix(&self) -> &str {
        &self.prefix
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

    fn expiry_key(&self) -> String {
        format!("{}:expiry", self.prefix)
    }
}

fn bytes(v: &Value) -> Option<Vec<u8>> {
    match v {
        Value::BulkString(b) => Some(b.clone()),
        Value::SimpleString(s) => Some(s.clone().into_bytes()),
        _ => None,
    }
}

fn text(v: &Value) -> Option<String> {
    bytes(v).and_then(|b| String::from_utf8(b).ok())
}

fn corrupt(what: &str) -> Error {
    Error::Corrupt(format!("Redis row: {what}"))
}

fn int(v: &Value, what: &str) -> Result<i64> {
    text(v).and_then(|s| s.parse().ok()).ok_or_else(|| corrupt(what))
}

impl<C: ConnectionLike + Clone + Send + Sync + 'static> RedisStore<C> {
    async fn fenced(&self, script: &Script, lease: &Lease, extra: &[&[u8]]) -> Result<()> {
        let tag = Self::tag(&lease.scope, &lease.key);
        let mut invocation = script.key(self.row_key(&tag));
        invocation.arg(lease.token.0.to_string());
        for a in extra {
            invocation.arg(*a);
        }
        let mut conn = self.conn.clone();
        let done: i64 = invocation.invoke_async(&mut conn).await.map_err(store_error)?;
        if done == 1 { Ok(()) } else { Err(Error::Fenced) }
    }
}

impl<C: ConnectionLike + Clone + Send + Sync + 'static> LeaseStore for RedisStore<C> {
    fn try_claim<'a>(&'a self, req: &'a ClaimRequest<'a>) -> BoxFuture<'a, Result<LeaseClaim>> {
        Box::pin(async move {
            let tag = Self::tag(req.scope, req.key);
            let lease = req.lease_expires_at_ms.unwrap_or(req.expires_at_ms);
            let ttl_ms = (req.expires_at_ms - req.now_ms).max(1);
            let mut conn = self.conn.clone();
            let reply: Vec<Value> = self
                .scripts
                .claim
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
                .invoke_async(&mut conn)
                .await
                .map_err(store_error)?;
            match reply.first().and_then(text).as_deref() {
                Some("acquired") => {
                    let token = reply
                        .get(1)
                        .map(|v| int(v, "token"))
                        .transpose()?
                        .ok_or_else(|| corrupt("token"))?;
                    // The sweeper's index, written off this path; Redis also
                    // expires the row by its TTL.
                    self.index
                        .add(&self.conn, &self.expiry_key(), tag, req.expires_at_ms)
                        .await;
                    Ok(LeaseClaim::Acquired(Token(token)))
                }
                Some("found") if reply.len() == 7 => {
                    let fingerprint = bytes(&reply[1]).ok_or_else(|| corrupt("fingerprint"))?;
                    let status = int(&reply[2], "status")?;
                    let token = int(&reply[3], "token")?;
                    let lease = text(&reply[4]).filter(|s| !s.is_empty()).map(|s| s.parse::<i64>());
                    let lease = lease.transpose().map_err(|_| corrupt("lease"))?;
                    let expires = int(&reply[5], "expiry")?;
                    let payload = bytes(&reply[6]);
                    let row = StoredRow::from_columns(
                        &fingerprint,
                        i16::try_from(status).map_err(|_| corrupt("status"))?,
                        token,
                        payload,
                        lease,
                        expires,
                    )?;
                    Ok(LeaseClaim::Found(row))
                }
                _ => Err(corrupt("unexpected claim reply")),
            }
        })
    }

    fn complete<'a>(&'a self, lease: &'a Lease, record: &'a Record) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            let status = match record.status {
                RecordStatus::Completed => idem_core::STATUS_COMPLETED,
                RecordStatus::Rejected => idem_core::STATUS_REJECTED,
            }
            .to_string();
            self.fenced(&self.scripts.complete, lease, &[status.as_bytes(), &record.payload])
                .await
        })
    }

    fn release<'a>(&'a self, lease: &'a Lease) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move { self.fenced(&self.scripts.release, lease, &[]).await })
    }

    fn extend<'a>(&'a self, lease: &'a Lease, lease_expires_at_ms: i64) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            let until = lease_expires_at_ms.to_string();
            self.fenced(&self.scripts.extend, lease, &[until.as_bytes()]).await
        })
    }
}

impl<C: ConnectionLike + Clone + Send + Sync + 'static> Sweep for RedisStore<C> {
    fn sweep_expired(&self, now_ms: i64, limit: u32) -> BoxFuture<'_, Result<u64>> {
        Box::pin(async move {
            self.index.flush().await;
            let mut conn = self.conn.clone();
            let tags: Vec<String> = redis::cmd("ZRANGEBYSCORE")
                .arg(self.expiry_key())
                .arg("-inf")
                .arg(now_ms)
                .arg("LIMIT")
                .arg(0)
                .arg(limit)
                .query_async(&mut conn)
                .await
                .map_err(store_error)?;
            let mut deleted = 0;
            for tag in &tags {
                let n: i64 = self
                    .scripts
                    .sweep_one
                    .key(self.row_key(tag))
                    .arg(now_ms)
                    .invoke_async(&mut conn)
                    .await
                    .map_err(store_error)?;
                deleted += n as u64;
            }
            if !tags.is_empty() {
                // Only the entries looked at; a row claimed again since has
                // a later row of its own (and Redis expires it by its TTL).
                let _: i64 = redis::cmd("ZREM")
                    .arg(self.expiry_key())
                    .arg(&tags)
                    .query_async(&mut conn)
                    .await
                    .map_err(store_error)?;
            }
            Ok(deleted)
        })
    }
}

impl<C: ConnectionLike + Clone + Send + Sync + 'static> RedisStore<C> {
    /// Waits until every claim made so far through this store (or a clone of
    /// it) is in the expiry index. The sweep and the operator methods of this
    /// store do this first; call it before another process reads the index.
    pub async fn flush_index(&self) {
        self.index.flush().await;
    }

    /// How many keys the store indexes, by state, at `now_ms` (reads every
    /// live row's status, 500 at a time).
    pub async fn stats(&self, now_ms: i64) -> Result<idem_core::KeyStats> {
        self.index.flush().await;
        let mut conn = self.conn.clone();
        let expired: u64 = redis::cmd("ZCOUNT")
            .arg(self.expiry_key())
            .arg("-inf")
            .arg(now_ms)
            .query_async(&mut conn)
            .await
            .map_err(store_error)?;
        let mut stats = idem_core::KeyStats {
            expired,
            ..Default::default()
        };
        let mut offset = 0u64;
        loop {
            let tags: Vec<String> = redis::cmd("ZRANGEBYSCORE")
                .arg(self.expiry_key())
                .arg(format!("({now_ms}"))
                .arg("+inf")
                .arg("LIMIT")
                .arg(offset)
                .arg(500)
                .query_async(&mut conn)
                .await
                .map_err(store_error)?;
            for tag in &tags {
                let status: Option<String> = redis::cmd("HGET")
                    .arg(self.row_key(tag))
                    .arg("st")
                    .query_async(&mut conn)
                    .await
                    .map_err(store_error)?;
                match status.as_deref() {
                    Some("0") => stats.in_progress += 1,
                    Some("1") => stats.completed += 1,
                    Some("2") => stats.rejected += 1,
                    _ => {}
                }
            }
            if tags.len() < 500 {
                break;
            }
            offset += 500;
        }
        Ok(stats)
    }
}

impl<C: ConnectionLike + Clone + Send + Sync + 'static> RedisStore<C> {
    /// Keys matching `filter` at `now_ms`, oldest first, at most `limit`
    /// (reads the expiry index and each row).
    pub async fn list_keys(
        &self,
        filter: &idem_core::KeyFilter,
        now_ms: i64,
        limit: u32,
    ) -> Result<Vec<idem_core::KeyInfo>> {
        Ok(self
            .matching(filter, now_ms, limit)
            .await?
            .into_iter()
            .map(|(_, info)| info)
            .collect())
    }

    /// Deletes at most `limit` keys matching `filter`; answers how many.
    pub async fn purge_keys(&self, filter: &idem_core::KeyFilter, now_ms: i64, limit: u32) -> Result<u64> {
        let mut conn = self.conn.clone();
        let mut deleted = 0;
        for (tag, _) in self.matching(filter, now_ms, limit).await? {
            let n: i64 = redis::cmd("DEL")
                .arg(self.row_key(&tag))
                .query_async(&mut conn)
                .await
                .map_err(store_error)?;
            let _: i64 = redis::cmd("ZREM")
                .arg(self.expiry_key())
                .arg(&tag)
                .query_async(&mut conn)
                .await
                .map_err(store_error)?;
            deleted += n as u64;
        }
        Ok(deleted)
    }

    async fn matching(
        &self,
        filter: &idem_core::KeyFilter,
        now_ms: i64,
        limit: u32,
    ) -> Result<Vec<(String, idem_core::KeyInfo)>> {
        self.index.flush().await;
        let mut conn = self.conn.clone();
        let tags: Vec<String> = redis::cmd("ZRANGE")
            .arg(self.expiry_key())
            .arg(0)
            .arg(-1)
            .query_async(&mut conn)
            .await
            .map_err(store_error)?;
        let mut out = Vec::new();
        for tag in tags {
            let r: Vec<Option<Vec<u8>>> = redis::cmd("HMGET")
                .arg(self.row_key(&tag))
                .arg(&["tn", "op", "k", "st", "cr", "exp", "pl"])
                .query_async(&mut conn)
                .await
                .map_err(store_error)?;
            let text = |i: usize| {
                r.get(i)
                    .cloned()
                    .flatten()
                    .map(|b| String::from_utf8_lossy(&b).into_owned())
            };
            let (Some(tenant), Some(operation), Some(key), Some(status), Some(created), Some(expires)) =
                (text(0), text(1), text(2), text(3), text(4), text(5))
            else {
                continue;
            };
            let (Ok(status), Ok(created_at_ms), Ok(expires_at_ms)) =
                (status.parse::<i16>(), created.parse::<i64>(), expires.parse::<i64>())
            else {
                continue;
            };
            let state = idem_core::KeyState::of(status, expires_at_ms, now_ms);
            let keep = filter.tenant.as_deref().is_none_or(|t| t == tenant)
                && filter.operation.as_deref().is_none_or(|o| o == operation)
                && filter.key_prefix.as_deref().is_none_or(|p| key.starts_with(p))
                && filter.state.is_none_or(|s| s == state)
                && filter.older_than_ms.is_none_or(|age| created_at_ms <= now_ms - age);
            if keep {
                let payload = r.get(6).cloned().flatten().unwrap_or_default();
                out.push((
                    tag,
                    idem_core::KeyInfo {
                        tenant,
                        operation,
                        key,
                        state,
                        created_at_ms,
                        expires_at_ms,
                        payload,
                    },
                ));
            }
        }
        out.sort_by_key(|(_, i)| i.created_at_ms);
        out.truncate(limit as usize);
        Ok(out)
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
