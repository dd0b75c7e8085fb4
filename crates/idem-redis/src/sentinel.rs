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
//! - **Discovery.** Every sentinel is asked at once
//!   `SENTINEL get-master-addr-by-name SERVICE`, each within
//!   [`LOOKUP_TIMEOUT`] (a sentinel that accepts connections and never
//!   answers delays a search by that much at most). The server most of them
//!   name is tried first, then the others: it must say it is a master
//!   (`HELLO`, which any user may run; `ROLE` before Redis 6), since a
//!   sentinel that has not yet seen a failover names the old master.
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
//!   the sentinels which master they name (on connections it keeps), and
//!   once more than half of those that answer name another server, the
//!   connection is forgotten. The task ends with the store's last handle.
//! - A caller waits for another's search at most the response timeout.
//!   Clients, and the CA a `ca_file` names, are made once, when connecting:
//!   a setting that can never work is a configuration error.
//! - While no master can be found, commands fail at once for
//!   [`REDISCOVERY_PAUSE`] after each failed discovery, so a failover does
//!   not turn every waiting call into a round of the sentinels.
//!
//! Sentinel fails over asynchronously replicated Redis: what the old master
//! acknowledged and had not yet sent to the promoted replica is lost. With
//! [`RedisStore::with_replica_acks`](crate::RedisStore::with_replica_acks)
//! a write counts only once replicas hold it; `docs/deployments.md`
//! measures both.

use std::path::PathBuf;
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
#[derive(Clone)]
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

impl std::fmt::Debug for SentinelUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The URLs hold passwords.
        f.debug_struct("SentinelUrl")
            .field("service", &self.service)
            .field("sentinels", &self.sentinels.len())
            .finish_non_exhaustive()
    }
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
        let path = path.trim_end_matches('/');
        let (service, db) = match path.split_once('/') {
            Some((service, db)) => (service, Some(db)),
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
    /// Each sentinel (`host:port`) and its client, made once.
    sentinels: Vec<(String, redis::Client)>,
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

/// What one sentinel said: the master it names (`host:port`), none (it
/// does not watch the service), or why it did not answer.
type Answer = std::result::Result<Option<String>, String>;

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
        // Every client (and its CA) is made here, once: a setting that can
        // never work is a configuration error, not an outage.
        let mut sentinels = Vec::with_capacity(parsed.sentinels.len());
        for s in &parsed.sentinels {
            let (plain, _) = crate::tls::split_ca_file(s)?;
            let info = redis::IntoConnectionInfo::into_connection_info(plain.as_str())
                .map_err(bad)?
                .set_tcp_settings(crate::tcp_settings());
            let at = address(info.addr());
            sentinels.push((at, crate::tls::client(info, parsed.ca.as_deref(), url)?));
        }
        let node = redis::IntoConnectionInfo::into_connection_info(parsed.node.as_str())
            .map_err(bad)?
            .set_tcp_settings(crate::tcp_settings());
        crate::tls::client(node.clone(), parsed.ca.as_deref(), url)?;
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

    /// How many connections to a master the store made since it started
    /// (1 without a failover or a lost connection).
    pub fn discoveries(&self) -> u64 {
        self.state().generation
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.shared
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The current master's connection, found first if there is none. A
    /// caller waits for another's search at most the response timeout.
    async fn connection(&self) -> redis::RedisResult<(u64, MultiplexedConnection)> {
        if let Some(current) = self.state().current.clone() {
            return Ok(current);
        }
        let Ok(_one) = tokio::time::timeout(self.shared.response_timeout, self.shared.discovering.lock()).await else {
            return Err(unavailable(format!(
                "no master for service {:?} yet: the search is still under way",
                self.shared.service
            )));
        };
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

    /// Asks every sentinel at once which master it names; `cache` keeps
    /// connections to them from one call to the next (the watch's).
    async fn poll(&self, cache: &mut [Option<MultiplexedConnection>]) -> Vec<Answer> {
        let service = &self.shared.service;
        let asks = self
            .shared
            .sentinels
            .iter()
            .zip(cache.iter_mut())
            .map(|((_, client), cached)| async move {
                let ask = async {
                    let mut conn = match cached.take() {
                        Some(conn) => conn,
                        None => {
                            let config = redis::AsyncConnectionConfig::new()
                                .set_connection_timeout(Some(LOOKUP_TIMEOUT))
                                .set_response_timeout(Some(LOOKUP_TIMEOUT));
                            client.get_multiplexed_async_connection_with_config(&config).await?
                        }
                    };
                    let named: Option<(String, u16)> = redis::cmd("SENTINEL")
                        .arg("get-master-addr-by-name")
                        .arg(service)
                        .query_async(&mut conn)
                        .await?;
                    *cached = Some(conn);
                    Ok::<_, RedisError>(named.map(|(host, port)| format!("{host}:{port}")))
                };
                match tokio::time::timeout(LOOKUP_TIMEOUT, ask).await {
                    Ok(Ok(named)) => Ok(named),
                    Ok(Err(e)) => Err(crate::store_error(e).to_string()),
                    Err(_) => Err(format!("no answer within {LOOKUP_TIMEOUT:?}")),
                }
            });
        futures_util::future::join_all(asks).await
    }

    /// Asks every sentinel, then tries the masters they name, the one most
    /// of them name first; answers the first that says it is a master, or
    /// every sentinel's reason.
    async fn discover(&self) -> std::result::Result<(MultiplexedConnection, String), String> {
        let answers = self.poll(&mut vec![None; self.shared.sentinels.len()]).await;
        let mut reasons = Vec::new();
        for ((at, _), answer) in self.shared.sentinels.iter().zip(&answers) {
            match answer {
                Ok(Some(_)) => {}
                Ok(None) => reasons.push(format!("sentinel {at} knows no service {:?}", self.shared.service)),
                Err(why) => reasons.push(format!("sentinel {at}: {why}")),
            }
        }
        for (master, votes) in by_votes(&answers) {
            let Some((host, port)) = master
                .rsplit_once(':')
                .and_then(|(h, p)| Some((h, p.parse::<u16>().ok()?)))
            else {
                reasons.push(format!("{votes} sentinel(s) name {master:?}, no host:port"));
                continue;
            };
            match self.master_at(host, port).await {
                Ok(conn) => return Ok((conn, master)),
                Err(why) => reasons.push(format!("{votes} sentinel(s) name {master}, which {why}")),
            }
        }
        Err(format!(
            "no master for service {:?}: {}",
            self.shared.service,
            reasons.join("; ")
        ))
    }

    /// Asks the sentinels which master they name, and forgets a connection
    /// to another server once more than half of those that answer name
    /// another one.
    async fn check_master(&self, cache: &mut [Option<MultiplexedConnection>]) {
        let (generation, master) = {
            let state = self.state();
            match (&state.current, &state.master) {
                (Some((generation, _)), Some(master)) => (*generation, master.clone()),
                _ => return,
            }
        };
        let answers = self.poll(cache).await;
        let answered = answers.iter().filter(|a| a.is_ok()).count();
        if let Some((named, votes)) = by_votes(&answers).into_iter().next()
            && named != master
            && votes * 2 > answered
        {
            self.forget(
                generation,
                &format!("{votes} of {answered} sentinels name {named} as the master now"),
            );
        }
    }

    /// A connection to `host:port` if the server there says it is a
    /// master.
    async fn master_at(&self, host: &str, port: u16) -> std::result::Result<MultiplexedConnection, String> {
        let info = crate::deployment::at(&self.shared.node, host, port);
        let client =
            crate::tls::client(info, self.shared.ca.as_deref(), &self.shared.url).map_err(|e| e.to_string())?;
        let config = redis::AsyncConnectionConfig::new()
            .set_connection_timeout(Some(LOOKUP_TIMEOUT))
            .set_response_timeout(Some(self.shared.response_timeout));
        let connect_and_check = async {
            let mut conn = client
                .get_multiplexed_async_connection_with_config(&config)
                .await
                .map_err(|e| format!("cannot be reached: {}", crate::store_error(e)))?;
            match role(&mut conn).await?.as_str() {
                "master" => Ok(conn),
                other => Err(format!("says it is a {other} (a failover not yet seen)")),
            }
        };
        tokio::time::timeout(LOOKUP_TIMEOUT, connect_and_check)
            .await
            .unwrap_or_else(|_| Err(format!("gave no answer within {LOOKUP_TIMEOUT:?}")))
    }
}

/// The role a server gives itself: `HELLO` (any user may run it), or
/// `ROLE` where `HELLO` is unknown (before Redis 6).
async fn role(conn: &mut MultiplexedConnection) -> std::result::Result<String, String> {
    let hello: redis::RedisResult<Value> = redis::cmd("HELLO").query_async(conn).await;
    let e = match hello {
        Ok(reply) => return field_of(&reply, "role").ok_or_else(|| "answers HELLO without its role".to_owned()),
        Err(e) => e,
    };
    match redis::cmd("ROLE").query_async::<Value>(conn).await {
        Ok(reply) => role_of(&reply).ok_or_else(|| "answers ROLE with no role".to_owned()),
        Err(role) => Err(format!(
            "refuses HELLO ({}) and ROLE ({})",
            crate::store_error(e),
            crate::store_error(role)
        )),
    }
}

/// The value of `name` in a `HELLO` reply (a map in RESP3, pairs in an
/// array in RESP2).
fn field_of(reply: &Value, name: &str) -> Option<String> {
    match reply {
        Value::Map(pairs) => pairs
            .iter()
            .find(|(k, _)| crate::text(k).as_deref() == Some(name))
            .and_then(|(_, v)| crate::text(v)),
        Value::Array(items) => items
            .chunks(2)
            .find(|pair| crate::text(&pair[0]).as_deref() == Some(name))
            .and_then(|pair| pair.get(1).and_then(crate::text)),
        _ => None,
    }
}

/// The masters the answers name, the most named first (ties in the order
/// the sentinels are given), with how many name each.
fn by_votes(answers: &[Answer]) -> Vec<(String, usize)> {
    let mut votes: Vec<(String, usize)> = Vec::new();
    for named in answers.iter().filter_map(|a| a.as_ref().ok().and_then(Option::as_ref)) {
        match votes.iter_mut().find(|(m, _)| m == named) {
            Some((_, n)) => *n += 1,
            None => votes.push((named.clone(), 1)),
        }
    }
    votes.sort_by_key(|(_, n)| std::cmp::Reverse(*n));
    votes
}

/// Checks every [`WATCH_INTERVAL`] that the sentinels name the master the
/// store is connected to, while the store lives; keeps its connections to
/// the sentinels from one check to the next.
async fn watch(shared: std::sync::Weak<Shared>) {
    let mut cache = match shared.upgrade() {
        Some(shared) => vec![None; shared.sentinels.len()],
        None => return,
    };
    loop {
        tokio::time::sleep(WATCH_INTERVAL).await;
        let Some(shared) = shared.upgrade() else {
            return;
        };
        SentinelConnection { shared }.check_master(&mut cache).await;
    }
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
        || matches!(e.kind(), ErrorKind::Server(ServerErrorKind::MasterDown))
        || crate::refused_by_replica(e)
}

/// Whether a reply holds a refusal of a demoted master.
fn refused_as_replica(value: &Value) -> bool {
    match value {
        Value::ServerError(e) => {
            matches!(e.kind(), Some(ServerErrorKind::ReadOnly | ServerErrorKind::MasterDown))
                || e.details().is_some_and(crate::names_a_readonly_refusal)
        }
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
        assert!(!format!("{u:?}").contains("pw"), "{u:?}");
        assert_eq!(SentinelUrl::parse("redis+sentinel://s1/main/").unwrap().service, "main");

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
        assert_eq!(u.ca.as_deref(), Some(std::path::Path::new("/etc/ca.pem")));
    }

    #[test]
    fn bad_urls_are_refused_clearly() {
        for (url, says) in [
            ("redis+sentinel://s1:26379", "no service"),
            ("redis+sentinel://s1:26379/", "no service"),
            ("redis+sentinel://s1,,s2/main", "empty sentinel"),
            ("redis+sentinel://s1/ma in", "service name"),
            ("redis+sentinel://s1/main/x", "database"),
            ("redis+sentinel://s1//", "no service"),
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
        // Redis 6 reports a write refused inside a script as a script error.
        let in_script = redis::parse_redis_value(
            b"-ERR Error running script (call to f_0a1b): @user_script:1: @user_script: 1: -READONLY You can't write against a read only replica.\r\n",
        )
        .unwrap();
        assert!(refused_as_replica(&in_script));
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

    #[test]
    fn the_master_most_sentinels_name_comes_first() {
        let answers: Vec<Answer> = vec![
            Ok(Some("10.0.0.1:6379".into())),
            Err("no answer".into()),
            Ok(Some("10.0.0.2:6379".into())),
            Ok(Some("10.0.0.2:6379".into())),
            Ok(None),
        ];
        assert_eq!(
            by_votes(&answers),
            [("10.0.0.2:6379".to_owned(), 2), ("10.0.0.1:6379".to_owned(), 1)]
        );
        assert!(by_votes(&[Err("down".into()), Ok(None)]).is_empty());
    }

    #[test]
    fn hello_replies_name_the_role() {
        let resp3 = Value::Map(vec![
            (
                Value::BulkString(b"server".to_vec()),
                Value::BulkString(b"redis".to_vec()),
            ),
            (
                Value::BulkString(b"role".to_vec()),
                Value::BulkString(b"replica".to_vec()),
            ),
        ]);
        assert_eq!(field_of(&resp3, "role").as_deref(), Some("replica"));
        let resp2 = Value::Array(vec![
            Value::BulkString(b"proto".to_vec()),
            Value::Int(2),
            Value::BulkString(b"role".to_vec()),
            Value::BulkString(b"master".to_vec()),
        ]);
        assert_eq!(field_of(&resp2, "role").as_deref(), Some("master"));
        assert_eq!(field_of(&Value::Okay, "role"), None);
    }
}
