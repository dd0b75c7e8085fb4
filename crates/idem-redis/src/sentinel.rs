//! Redis behind Sentinel: the store asks the sentinels which server is the
//! master of a named service, connects to it, and asks again once that
//! connection fails.
//!
//! A URL names the sentinels, the service and the master's database:
//!
//! ```text
//! redis+sentinel://[user:password@]sentinel1:26379,sentinel2:26379,…/SERVICE[/DB][?options]
//! rediss+sentinel://…                      (TLS to the sentinels and the master)
//! ```
//!
//! - The credentials are the master's (the data nodes'). Sentinels that ask
//!   for their own take `sentinel_username=` and `sentinel_password=`
//!   options (percent-encoded). `ca_file=PATH` is the CA of every TLS
//!   connection. A sentinel without a port is on 26379.
//! - **Discovery.** Each sentinel in the order given is asked
//!   `SENTINEL get-master-addr-by-name SERVICE`; the server it names must
//!   answer `ROLE` as a master (a sentinel that has not yet seen a failover
//!   names the old master, which a restart turned into a replica), or the
//!   next sentinel is asked. Each step is bounded by
//!   [`LOOKUP_TIMEOUT`].
//! - **Following a failover.** A command that fails on the connection (an
//!   I/O error, a timeout, a dropped connection) or that the server refuses
//!   with `READONLY` (it was demoted) makes the store forget the connection;
//!   the command fails ([`Unavailable`](idem_core::StoreErrorKind::Unavailable),
//!   as any lost connection) and the next one asks the sentinels again. A
//!   command is never sent again by the connection itself: a write whose
//!   answer was lost may have been applied, and only the engine above knows
//!   what to do with that (a claim is then answered in flight until its
//!   lease ends; an outcome leaves the key to be resolved).
//! - **Watching the sentinels.** A master demoted while it still runs (an
//!   operator's `SENTINEL FAILOVER`, a partition that healed) keeps taking
//!   writes until the sentinels turn it into a replica, seconds later;
//!   what it took meanwhile is lost. So every [`WATCH_INTERVAL`] a task asks
//!   the sentinels which master they name, and a connection to another
//!   server is forgotten. The task ends with the store's last handle.
//! - While no master can be found, commands fail at once for
//!   [`REDISCOVERY_PAUSE`] after each failed discovery, so a failover does
//!   not turn every waiting call into a round of the sentinels.
//!
//! Sentinel fails over asynchronously replicated Redis: what the old master
//! acknowledged and had not yet sent to the promoted replica is lost. With
//! [`RedisStore::with_replica_acks`](crate::RedisStore::with_replica_acks)
//! a write counts only once replicas hold it; `docs/deployments.md`
//! measures both.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idem_core::{Error, Result, StoreErrorKind};
use redis::aio::{ConnectionLike, MultiplexedConnection};
use redis::{Cmd, ErrorKind, Pipeline, RedisError, RedisFuture, ServerErrorKind, Value};

/// How long asking one sentinel, or checking the master it names, may take.
pub const LOOKUP_TIMEOUT: Duration = Duration::from_secs(2);

/// How often the sentinels are asked which master they name.
pub const WATCH_INTERVAL: Duration = Duration::from_secs(1);

/// How long commands fail at once after a discovery found no master.
pub const REDISCOVERY_PAUSE: Duration = Duration::from_millis(100);

/// The port of a sentinel given without one.
const SENTINEL_PORT: u16 = 26379;

/// What a `redis+sentinel://` URL says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SentinelUrl {
    /// `redis://` or `rediss://` URLs of each sentinel, with the sentinels'
    /// credentials.
    pub(crate) sentinels: Vec<String>,
    /// The service (the master's name in the sentinels' configuration).
    pub(crate) service: String,
    /// A `redis://` or `rediss://` URL of the master with its credentials,
    /// database and options; its address is the first sentinel's and is
    /// replaced by the master's.
    pub(crate) node: String,
    /// The CA of every TLS connection.
    pub(crate) ca: Option<PathBuf>,
}

/// Whether `url` names Redis behind Sentinel.
pub(crate) fn is_sentinel_url(url: &str) -> bool {
    url.starts_with("redis+sentinel://") || url.starts_with("rediss+sentinel://")
}

impl SentinelUrl {
    pub(crate) fn parse(url: &str) -> Result<Self> {
        let bad = |why: &str| {
            Error::Config(idem_core::redact_credentials(&format!(
                "Redis Sentinel URL {url:?}: {why} (redis+sentinel://[user:password@]host:port,…/SERVICE[/DB])"
            )))
        };
        let (scheme, rest) = if let Some(rest) = url.strip_prefix("redis+sentinel://") {
            ("redis", rest)
        } else if let Some(rest) = url.strip_prefix("rediss+sentinel://") {
            ("rediss", rest)
        } else {
            return Err(bad("not a redis+sentinel:// or rediss+sentinel:// URL"));
        };
        let (rest, query) = rest.split_once('?').unwrap_or((rest, ""));
        // The user part ends at the last `@` before the path (a password may
        // hold an unescaped `@`).
        let path_start = rest.rfind('@').map_or(0, |at| at + 1);
        let (authority, path) = match rest[path_start..].find('/') {
            Some(slash) => (&rest[..path_start + slash], &rest[path_start + slash + 1..]),
            None => (rest, ""),
        };
        let (userinfo, hosts) = match authority.rfind('@') {
            Some(at) => (Some(&authority[..at]), &authority[at + 1..]),
            None => (None, authority),
        };
        let mut sentinel_user = None;
        let mut sentinel_password = None;
        let mut node_options = Vec::new();
        let mut ca_option = None;
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            match pair.split_once('=') {
                Some(("sentinel_username", v)) => sentinel_user = Some(v),
                Some(("sentinel_password", v)) => sentinel_password = Some(v),
                Some(("ca_file", _)) => {
                    ca_option = Some(pair);
                    node_options.push(pair);
                }
                _ => node_options.push(pair),
            }
        }
        let (service, db) = match path.split_once('/') {
            Some((service, db)) => (service, Some(db.trim_end_matches('/'))),
            None => (path, None),
        };
        if service.is_empty() {
            return Err(bad("no service name"));
        }
        if !service.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c)) {
            return Err(bad(
                "the service name holds characters other than letters, digits, -, _ and .",
            ));
        }
        if let Some(db) = db
            && db.parse::<u32>().is_err()
        {
            return Err(bad("the database after the service is not a number"));
        }
        let mut sentinels = Vec::new();
        for host in hosts.split(',').map(str::trim) {
            if host.is_empty() {
                return Err(bad("an empty sentinel address"));
            }
            let with_port = if host.ends_with(']') || !host.contains(':') {
                format!("{host}:{SENTINEL_PORT}")
            } else {
                host.to_owned()
            };
            let creds = match (sentinel_user, sentinel_password) {
                (None, None) => String::new(),
                (user, password) => format!("{}:{}@", user.unwrap_or(""), password.unwrap_or("")),
            };
            let ca = ca_option.map(|o| format!("?{o}")).unwrap_or_default();
            sentinels.push(format!("{scheme}://{creds}{with_port}/{ca}"));
        }
        if sentinels.len() > 16 {
            return Err(bad("more than 16 sentinels"));
        }
        let first = sentinels[0]
            .split_once("://")
            .map(|(_, r)| r.rsplit_once('@').map_or(r, |(_, h)| h))
            .and_then(|r| r.split('/').next())
            .unwrap_or_default()
            .to_owned();
        let user = userinfo.map(|u| format!("{u}@")).unwrap_or_default();
        let options = if node_options.is_empty() {
            String::new()
        } else {
            format!("?{}", node_options.join("&"))
        };
        let node = format!("{scheme}://{user}{first}/{}{options}", db.unwrap_or("0"));
        let (node, ca) = crate::tls::split_ca_file(&node)?;
        Ok(Self {
            sentinels,
            service: service.to_owned(),
            node,
            ca,
        })
    }
}

/// A connection to the master Sentinel names for a service, found again
/// after a failover (see the module docs).
#[derive(Clone)]
pub struct SentinelConnection {
    shared: Arc<Shared>,
}

struct Shared {
    /// One client settings per sentinel.
    sentinels: Vec<redis::ConnectionInfo>,
    service: String,
    /// The master's settings; its address is replaced by the master's.
    node: redis::ConnectionInfo,
    ca: Option<PathBuf>,
    /// The URL as given, for errors (redacted when shown).
    url: String,
    response_timeout: Duration,
    state: Mutex<State>,
    /// Held by the one discovery under way.
    discovering: tokio::sync::Mutex<()>,
}

#[derive(Default)]
struct State {
    /// The master's connection and its generation.
    current: Option<(u64, MultiplexedConnection)>,
    /// The master's address (`host:port`), for the operator.
    master: Option<String>,
    generation: u64,
    /// When the last discovery failed, and why.
    failed: Option<(Instant, String)>,
}

impl SentinelConnection {
    /// Connects through the sentinels `url` names; fails at once if none
    /// of them names a master that answers as one.
    pub(crate) async fn connect(url: &str, response_timeout: Duration) -> Result<(Self, crate::deployment::Dialer)> {
        let parsed = SentinelUrl::parse(url)?;
        let bad = |e: RedisError| {
            Error::Config(idem_core::redact_credentials(&format!(
                "Redis Sentinel URL {url:?}: {e}"
            )))
        };
        let mut sentinels = Vec::with_capacity(parsed.sentinels.len());
        for s in &parsed.sentinels {
            let (s, _) = crate::tls::split_ca_file(s)?;
            sentinels.push(
                redis::IntoConnectionInfo::into_connection_info(s.as_str())
                    .map_err(bad)?
                    .set_tcp_settings(crate::tcp_settings()),
            );
        }
        let node = redis::IntoConnectionInfo::into_connection_info(parsed.node.as_str())
            .map_err(bad)?
            .set_tcp_settings(crate::tcp_settings());
        let dialer = crate::deployment::Dialer::new(node.clone(), parsed.ca.clone(), &parsed.node);
        let conn = Self {
            shared: Arc::new(Shared {
                sentinels,
                service: parsed.service,
                node,
                ca: parsed.ca,
                url: url.to_owned(),
                response_timeout,
                state: Mutex::new(State::default()),
                discovering: tokio::sync::Mutex::new(()),
            }),
        };
        conn.connection().await.map_err(|e| {
            Error::store(
                StoreErrorKind::Unavailable,
                idem_core::redact_credentials(&format!("Redis Sentinel {url:?}: {e}")),
            )
        })?;
        tokio::spawn(watch(Arc::downgrade(&conn.shared)));
        Ok((conn, dialer))
    }

    /// The master's address (`host:port`) the store last connected to.
    pub fn master(&self) -> Option<String> {
        self.state().master.clone()
    }

    /// How many masters the store connected to since it started (1 without
    /// a failover).
    pub fn discoveries(&self) -> u64 {
        self.state().generation
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.shared
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The current master's connection, found first if there is none.
    async fn connection(&self) -> redis::RedisResult<(u64, MultiplexedConnection)> {
        if let Some(current) = self.state().current.clone() {
            return Ok(current);
        }
        let _one = self.shared.discovering.lock().await;
        {
            let state = self.state();
            if let Some(current) = state.current.clone() {
                return Ok(current);
            }
            if let Some((at, why)) = &state.failed
                && at.elapsed() < REDISCOVERY_PAUSE
            {
                return Err(unavailable(why.clone()));
            }
        }
        match self.discover().await {
            Ok((conn, master)) => {
                let mut state = self.state();
                state.generation += 1;
                state.current = Some((state.generation, conn.clone()));
                state.failed = None;
                if state.master.as_deref() != Some(master.as_str()) {
                    tracing::info!(
                        service = %self.shared.service,
                        master = %master,
                        previous = ?state.master,
                        "Redis Sentinel names this master"
                    );
                    metrics::counter!("idem_redis_sentinel_master_changes_total").increment(1);
                }
                state.master = Some(master);
                Ok((state.generation, conn))
            }
            Err(why) => {
                self.state().failed = Some((Instant::now(), why.clone()));
                Err(unavailable(why))
            }
        }
    }

    /// Forgets the connection of `generation` (a newer one stays).
    fn forget(&self, generation: u64, why: &str) {
        let mut state = self.state();
        if state.current.as_ref().is_some_and(|(g, _)| *g == generation) {
            tracing::warn!(
                service = %self.shared.service,
                master = ?state.master,
                why,
                "left the Redis master; the next command asks the sentinels again"
            );
            state.current = None;
        }
    }

    /// Asks the sentinels which master they name, and forgets a connection
    /// to another server.
    async fn check_master(&self) {
        let (generation, master) = {
            let state = self.state();
            match (&state.current, &state.master) {
                (Some((generation, _)), Some(master)) => (*generation, master.clone()),
                _ => return,
            }
        };
        for sentinel in &self.shared.sentinels {
            if let Ok(Ok(Some((host, port)))) = tokio::time::timeout(LOOKUP_TIMEOUT, self.ask(sentinel)).await {
                let named = format!("{host}:{port}");
                if named != master {
                    self.forget(
                        generation,
                        &format!("sentinel {} names {named} as the master now", address(sentinel.addr())),
                    );
                }
                return;
            }
        }
    }

    /// Asks each sentinel in turn; answers the first master that says it is
    /// one, or every sentinel's reason.
    async fn discover(&self) -> std::result::Result<(MultiplexedConnection, String), String> {
        let mut reasons = Vec::new();
        for sentinel in &self.shared.sentinels {
            let at = address(sentinel.addr());
            match tokio::time::timeout(LOOKUP_TIMEOUT, self.ask(sentinel)).await {
                Ok(Ok(Some((host, port)))) => match self.master_at(&host, port).await {
                    Ok(conn) => return Ok((conn, format!("{host}:{port}"))),
                    Err(why) => reasons.push(format!("sentinel {at} names {host}:{port}, which {why}")),
                },
                Ok(Ok(None)) => reasons.push(format!("sentinel {at} knows no service {:?}", self.shared.service)),
                Ok(Err(e)) => reasons.push(format!("sentinel {at}: {}", crate::store_error(e))),
                Err(_) => reasons.push(format!("sentinel {at}: no answer within {LOOKUP_TIMEOUT:?}")),
            }
        }
        Err(format!(
            "no master for service {:?}: {}",
            self.shared.service,
            reasons.join("; ")
        ))
    }

    /// The master a sentinel names for the service, if it knows the service.
    async fn ask(&self, sentinel: &redis::ConnectionInfo) -> redis::RedisResult<Option<(String, u16)>> {
        let client = client(sentinel.clone(), self.shared.ca.as_deref(), &self.shared.url)?;
        let config = redis::AsyncConnectionConfig::new()
            .set_connection_timeout(Some(LOOKUP_TIMEOUT))
            .set_response_timeout(Some(LOOKUP_TIMEOUT));
        let mut conn = client.get_multiplexed_async_connection_with_config(&config).await?;
        redis::cmd("SENTINEL")
            .arg("get-master-addr-by-name")
            .arg(&self.shared.service)
            .query_async(&mut conn)
            .await
    }

    /// A connection to `host:port` if the server there answers `ROLE` as a
    /// master.
    async fn master_at(&self, host: &str, port: u16) -> std::result::Result<MultiplexedConnection, String> {
        let info = crate::deployment::at(&self.shared.node, host, port);
        let client = client(info, self.shared.ca.as_deref(), &self.shared.url).map_err(|e| e.to_string())?;
        let config = redis::AsyncConnectionConfig::new()
            .set_connection_timeout(Some(LOOKUP_TIMEOUT))
            .set_response_timeout(Some(self.shared.response_timeout));
        let connect_and_check = async {
            let mut conn = client
                .get_multiplexed_async_connection_with_config(&config)
                .await
                .map_err(|e| format!("cannot be reached: {}", crate::store_error(e)))?;
            let role: Value = redis::cmd("ROLE")
                .query_async(&mut conn)
                .await
                .map_err(|e| format!("refuses ROLE: {}", crate::store_error(e)))?;
            match role_of(&role).as_deref() {
                Some("master") => Ok(conn),
                Some(other) => Err(format!("answers ROLE as a {other} (a failover not yet seen)")),
                None => Err("answers ROLE with no role".to_owned()),
            }
        };
        tokio::time::timeout(LOOKUP_TIMEOUT, connect_and_check)
            .await
            .unwrap_or_else(|_| Err(format!("gave no answer within {LOOKUP_TIMEOUT:?}")))
    }
}

/// Checks every [`WATCH_INTERVAL`] that the sentinels name the master the
/// store is connected to, while the store lives.
async fn watch(shared: std::sync::Weak<Shared>) {
    loop {
        tokio::time::sleep(WATCH_INTERVAL).await;
        let Some(shared) = shared.upgrade() else {
            return;
        };
        SentinelConnection { shared }.check_master().await;
    }
}

/// A client for `info`, its TLS trusting `ca` when given.
fn client(info: redis::ConnectionInfo, ca: Option<&Path>, url: &str) -> redis::RedisResult<redis::Client> {
    crate::tls::client(info, ca, url)
        .map_err(|e| RedisError::from((ErrorKind::InvalidClientConfig, "TLS", e.to_string())))
}

/// `host:port` of a connection address.
fn address(addr: &redis::ConnectionAddr) -> String {
    match addr {
        redis::ConnectionAddr::Tcp(host, port) | redis::ConnectionAddr::TcpTls { host, port, .. } => {
            format!("{host}:{port}")
        }
        other => format!("{other:?}"),
    }
}

/// The first element of a `ROLE` reply.
fn role_of(reply: &Value) -> Option<String> {
    match reply {
        Value::Array(items) => items.first().and_then(crate::text),
        _ => None,
    }
}

/// An error the store maps to [`StoreErrorKind::Unavailable`].
fn unavailable(why: String) -> RedisError {
    RedisError::from(std::io::Error::new(std::io::ErrorKind::NotConnected, why))
}

/// Whether an error means the connection no longer reaches a master.
fn lost_master(e: &RedisError) -> bool {
    e.is_io_error()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || e.is_timeout()
        || matches!(
            e.kind(),
            ErrorKind::Server(ServerErrorKind::ReadOnly | ServerErrorKind::MasterDown)
        )
}

/// Whether a reply holds a refusal of a demoted master.
fn refused_as_replica(value: &Value) -> bool {
    match value {
        Value::ServerError(e) => matches!(e.kind(), Some(ServerErrorKind::ReadOnly | ServerErrorKind::MasterDown)),
        Value::Array(items) => items.iter().any(refused_as_replica),
        _ => false,
    }
}

impl ConnectionLike for SentinelConnection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        Box::pin(async move {
            let (generation, mut conn) = self.connection().await?;
            let reply = conn.req_packed_command(cmd).await;
            self.judge(generation, reply.as_ref().map(std::slice::from_ref));
            reply
        })
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        Box::pin(async move {
            let (generation, mut conn) = self.connection().await?;
            let reply = conn.req_packed_commands(cmd, offset, count).await;
            self.judge(generation, reply.as_deref());
            reply
        })
    }

    fn get_db(&self) -> i64 {
        self.shared.node.redis_settings().db()
    }
}

impl SentinelConnection {
    /// Forgets the connection of `generation` if `reply` says it no longer
    /// reaches a master.
    fn judge(&self, generation: u64, reply: std::result::Result<&[Value], &RedisError>) {
        match reply {
            Err(e) if lost_master(e) => self.forget(generation, &crate::store_error(e.clone()).to_string()),
            Ok(values) if values.iter().any(refused_as_replica) => {
                self.forget(generation, "the server refuses writes as a replica")
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_read() {
        let u = SentinelUrl::parse("redis+sentinel://:pw@10.0.0.1:26379,10.0.0.2,[::1]:26380/orders/2").unwrap();
        assert_eq!(
            u.sentinels,
            [
                "redis://10.0.0.1:26379/",
                "redis://10.0.0.2:26379/",
                "redis://[::1]:26380/"
            ]
        );
        assert_eq!(u.service, "orders");
        assert_eq!(u.node, "redis://:pw@10.0.0.1:26379/2");
        assert_eq!(u.ca, None);

        let u = SentinelUrl::parse(
            "rediss+sentinel://app:p%40ss@s1:1,s2:2/main?sentinel_password=sp&ca_file=/etc/ca.pem&protocol=resp3",
        )
        .unwrap();
        assert_eq!(
            u.sentinels,
            [
                "rediss://:sp@s1:1/?ca_file=/etc/ca.pem",
                "rediss://:sp@s2:2/?ca_file=/etc/ca.pem"
            ]
        );
        assert_eq!(u.node, "rediss://app:p%40ss@s1:1/0?protocol=resp3");
        assert_eq!(u.ca.as_deref(), Some(Path::new("/etc/ca.pem")));
    }

    #[test]
    fn bad_urls_are_refused_clearly() {
        for (url, says) in [
            ("redis+sentinel://s1:26379", "no service"),
            ("redis+sentinel://s1:26379/", "no service"),
            ("redis+sentinel://s1,,s2/main", "empty sentinel"),
            ("redis+sentinel://s1/ma in", "service name"),
            ("redis+sentinel://s1/main/x", "database"),
            ("redis://s1/main", "not a redis+sentinel"),
            ("redis+sentinel://s1/main?ca_file=/x", "ca_file is for TLS"),
        ] {
            let e = SentinelUrl::parse(url).unwrap_err().to_string();
            assert!(e.contains(says), "{url}: {e}");
        }
        let e = SentinelUrl::parse("redis+sentinel://:secret@s1")
            .unwrap_err()
            .to_string();
        assert!(!e.contains("secret"), "{e}");
    }

    #[test]
    fn replies_of_a_demoted_master_are_recognised() {
        let readonly = redis::parse_redis_value(b"-READONLY You can't write against a read only replica.\r\n").unwrap();
        assert!(refused_as_replica(&readonly));
        assert!(refused_as_replica(&Value::Array(vec![Value::Okay, readonly])));
        assert!(!refused_as_replica(&Value::Okay));
        assert_eq!(
            role_of(&Value::Array(vec![
                Value::BulkString(b"master".to_vec()),
                Value::Int(0)
            ]))
            .as_deref(),
            Some("master")
        );
    }
}
