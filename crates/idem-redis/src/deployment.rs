//! The deployment check: a lease store is only as good as its memory of
//! claims, so before a process writes claims it reads how the server keeps
//! them.
//!
//! - **Eviction.** Under any `maxmemory-policy` but `noeviction`
//!   (`allkeys-*`, `volatile-*`), Redis deletes keys when memory runs short:
//!   an evicted claim lets a second holder run the effect again, an evicted
//!   outcome makes a retry run it again. Refused.
//! - **Persistence.** With neither AOF (`appendonly yes`) nor RDB snapshots
//!   (`save`), a restart forgets every key. A warning: some deployments
//!   accept that, knowingly. AOF with `appendfsync no` is a warning too.
//! - **Managed Redis** often refuses `CONFIG`. The policy and AOF are read
//!   from `INFO` first (`maxmemory_policy`, `aof_enabled`) and `CONFIG GET`
//!   only fills in the rest; what neither tells is a warning, never a
//!   refusal. A deployment that knows better skips the check
//!   (`--skip-redis-checks`, or `skip_deployment_checks` in the gateway's
//!   `[redis]` settings).
//!
//! A server that says it is a replica (`role:slave`) is refused: a store
//! pointed at it would have every write refused.
//!
//! On a cluster every master is read. Replicas are read too (a server's
//! from its `INFO replication`, a cluster's from `CLUSTER NODES`), for
//! their eviction policy: a replica promoted by a failover brings its own
//! policy with it, and one that evicts is refused as a master would be. A
//! replica that cannot be reached at the address it is known by (another
//! network, credentials of its own) is a warning.

use std::path::PathBuf;
use std::time::Duration;

use idem_core::{Error, Result};
use redis::Value;

use crate::RedisStore;
use crate::connection::RedisConnection;

/// What one node said about itself.
#[derive(Debug, Default)]
struct Settings {
    policy: Option<String>,
    aof: Option<bool>,
    appendfsync: Option<String>,
    save: Option<String>,
    /// A replica: only its eviction policy is judged.
    replica: bool,
}

/// How long reaching and reading one replica may take.
const REPLICA_TIMEOUT: Duration = Duration::from_secs(5);

/// How the deployment's other nodes are reached: the connection's own
/// settings (credentials, database, TLS and its CA) at another address.
pub(crate) struct Dialer {
    info: redis::ConnectionInfo,
    ca: Option<PathBuf>,
    url: String,
}

impl Dialer {
    pub(crate) fn new(info: redis::ConnectionInfo, ca: Option<PathBuf>, url: &str) -> Self {
        Self {
            info,
            ca,
            url: url.to_owned(),
        }
    }

    /// A connection to `addr` (`host:port`), as the store's own.
    async fn dial(&self, addr: &str) -> std::result::Result<redis::aio::MultiplexedConnection, String> {
        let (host, port) = addr
            .rsplit_once(':')
            .and_then(|(h, p)| Some((h.trim_start_matches('[').trim_end_matches(']'), p.parse::<u16>().ok()?)))
            .ok_or_else(|| format!("{addr:?} is no host:port"))?;
        let client =
            crate::tls::client(at(&self.info, host, port), self.ca.as_deref(), &self.url).map_err(|e| e.to_string())?;
        match tokio::time::timeout(REPLICA_TIMEOUT, client.get_multiplexed_async_connection()).await {
            Ok(Ok(conn)) => Ok(conn),
            Ok(Err(e)) => Err(crate::store_error(e).to_string()),
            Err(_) => Err(format!("no connection within {} s", REPLICA_TIMEOUT.as_secs())),
        }
    }
}

/// `info`'s settings (credentials, database, TLS) at `host:port`.
pub(crate) fn at(info: &redis::ConnectionInfo, host: &str, port: u16) -> redis::ConnectionInfo {
    let to = match info.addr() {
        redis::ConnectionAddr::TcpTls {
            insecure, tls_params, ..
        } => redis::ConnectionAddr::TcpTls {
            host: host.to_owned(),
            port,
            insecure: *insecure,
            tls_params: tls_params.clone(),
        },
        _ => redis::ConnectionAddr::Tcp(host.to_owned(), port),
    };
    info.clone().set_addr(to)
}

/// The replicas a server's `INFO replication` lists
/// (`slave0:ip=10.0.0.2,port=6380,state=online,…`), as `host:port`.
pub(crate) fn replicas_of_info(text: &str) -> Vec<String> {
    info_fields(text)
        .filter(|(name, _)| name.starts_with("slave") && name[5..].chars().all(|c| c.is_ascii_digit()))
        .filter_map(|(_, value)| {
            let field = |key: &str| {
                value
                    .split(',')
                    .find_map(|kv| kv.split_once('=').filter(|(k, _)| *k == key).map(|(_, v)| v))
            };
            Some(format!("{}:{}", field("ip")?, field("port")?))
        })
        .collect()
}

/// The replicas a cluster's `CLUSTER NODES` lists (flags `slave`), as
/// `host:port`.
pub(crate) fn replicas_of_cluster(text: &str) -> Vec<String> {
    text.lines()
        .filter_map(|line| {
            let mut fields = line.split_whitespace();
            let (_id, addr, flags) = (fields.next()?, fields.next()?, fields.next()?);
            let replica = flags.split(',').any(|f| f == "slave" || f == "replica");
            let addr = addr.split(['@', ',']).next()?;
            (replica && !addr.starts_with(':')).then(|| addr.to_owned())
        })
        .collect()
}

/// What a replica says of its eviction policy (`INFO memory`, then `CONFIG
/// GET`), or why it could not be asked.
async fn replica_policy(dialer: &Dialer, addr: &str) -> std::result::Result<Option<String>, String> {
    let mut conn = dialer.dial(addr).await?;
    let read = async {
        let info: redis::RedisResult<Value> = redis::cmd("INFO").arg("memory").query_async(&mut conn).await;
        if let Some(policy) = info.ok().and_then(|v| crate::text(&v)).and_then(|t| {
            info_fields(&t)
                .find(|(n, _)| *n == "maxmemory_policy")
                .map(|(_, v)| v.to_owned())
        }) {
            return Some(policy);
        }
        let config: redis::RedisResult<Value> = redis::cmd("CONFIG")
            .arg("GET")
            .arg("maxmemory-policy")
            .query_async(&mut conn)
            .await;
        config.ok().and_then(|v| config_value(&v, "maxmemory-policy"))
    };
    tokio::time::timeout(REPLICA_TIMEOUT, read)
        .await
        .map_err(|_| format!("no answer within {} s", REPLICA_TIMEOUT.as_secs()))
}

/// The `INFO` fields as name/value pairs.
fn info_fields(text: &str) -> impl Iterator<Item = (&str, &str)> {
    text.lines().filter_map(|l| l.trim().split_once(':'))
}

/// The value of a `CONFIG GET name` reply (an array of pairs in RESP2, a map
/// in RESP3).
fn config_value(reply: &Value, name: &str) -> Option<String> {
    let pairs: Vec<(&Value, &Value)> = match reply {
        Value::Array(items) => items.chunks(2).filter_map(|p| Some((p.first()?, p.get(1)?))).collect(),
        Value::Map(items) => items.iter().map(|(k, v)| (k, v)).collect(),
        _ => Vec::new(),
    };
    pairs
        .into_iter()
        .find(|(k, _)| crate::text(k).is_some_and(|k| k.eq_ignore_ascii_case(name)))
        .and_then(|(_, v)| crate::text(v))
}

impl RedisStore<RedisConnection> {
    /// Reads every master's eviction policy and persistence, refuses an
    /// eviction policy (an [`Error::Config`] naming `maxmemory-policy`), and
    /// answers the warnings (also logged): no persistence, or settings it
    /// could not read. See the module docs of the check.
    pub async fn check_deployment(&self) -> Result<Vec<String>> {
        // A store pointed at a replica writes nothing: every write is
        // refused (`READONLY`), which looks like an outage that never ends.
        for (node, reply) in self
            .conn
            .on_every_master(redis::cmd("INFO").arg("replication").clone())
            .await
        {
            let role = reply
                .ok()
                .and_then(|v| crate::text(&v))
                .and_then(|t| info_fields(&t).find(|(n, _)| *n == "role").map(|(_, v)| v.to_owned()));
            if role.as_deref() == Some("slave") {
                return Err(Error::Config(format!(
                    "Redis ({node}) is a replica (role:slave): it refuses every write; point the store at the \
                     master, or name the sentinels that follow it (redis+sentinel://host:port,…/SERVICE)"
                )));
            }
        }
        let mut nodes: Vec<(String, Settings)> = Vec::new();
        for (node, reply) in self
            .conn
            .on_every_master(redis::cmd("INFO").arg("memory").clone())
            .await
        {
            let mut s = Settings::default();
            if let Ok(text) = reply.as_ref().map(crate::text) {
                for (name, value) in info_fields(text.as_deref().unwrap_or_default()) {
                    if name == "maxmemory_policy" {
                        s.policy = Some(value.to_owned());
                    }
                }
            }
            nodes.push((node, s));
        }
        for (node, reply) in self
            .conn
            .on_every_master(redis::cmd("INFO").arg("persistence").clone())
            .await
        {
            if let Ok(text) = reply.as_ref().map(crate::text) {
                let aof = info_fields(text.as_deref().unwrap_or_default())
                    .find(|(n, _)| *n == "aof_enabled")
                    .map(|(_, v)| v == "1");
                if let Some(entry) = nodes.iter_mut().find(|(n, _)| *n == node) {
                    entry.1.aof = aof;
                }
            }
        }
        for (name, pick) in [
            ("maxmemory-policy", 0),
            ("appendonly", 1),
            ("appendfsync", 2),
            ("save", 3),
        ] {
            for (node, reply) in self
                .conn
                .on_every_master(redis::cmd("CONFIG").arg("GET").arg(name).clone())
                .await
            {
                let Ok(reply) = reply else { continue };
                let Some(value) = config_value(&reply, name) else {
                    continue;
                };
                let Some(entry) = nodes.iter_mut().find(|(n, _)| *n == node) else {
                    continue;
                };
                let s = &mut entry.1;
                match pick {
                    0 => s.policy = s.policy.take().or(Some(value)),
                    1 => s.aof = s.aof.or(Some(value == "yes")),
                    2 => s.appendfsync = Some(value),
                    _ => s.save = Some(value),
                }
            }
        }
        match self.conn.replicas().await {
            Ok(replicas) => {
                for addr in replicas {
                    let node = format!("replica {addr}");
                    let policy = match &self.dialer {
                        Some(dialer) => replica_policy(dialer, &addr).await,
                        None => Err("no way to reach it".into()),
                    };
                    let policy = policy.unwrap_or_else(|why| {
                        tracing::debug!(replica = %addr, why, "cannot read a replica's eviction policy");
                        None
                    });
                    nodes.push((
                        node,
                        Settings {
                            policy,
                            replica: true,
                            ..Settings::default()
                        },
                    ));
                }
            }
            Err(e) => tracing::debug!(error = %crate::store_error(e), "cannot list the replicas"),
        }
        judge(&nodes)
    }
}

/// The verdict on what the nodes said.
fn judge(nodes: &[(String, Settings)]) -> Result<Vec<String>> {
    let mut warnings = Vec::new();
    for (node, s) in nodes {
        match s.policy.as_deref() {
            Some("noeviction") => {}
            Some(policy) => {
                return Err(Error::Config(format!(
                    "Redis ({node}) has maxmemory-policy {policy}: it may evict keys, and an evicted key runs \
                     its effect again; set maxmemory-policy noeviction (or skip this check with \
                     --skip-redis-checks, or skip_deployment_checks = true under [redis] in the gateway's \
                     configuration)"
                )));
            }
            None if s.replica => warnings.push(format!(
                "cannot read the maxmemory-policy of Redis ({node}): it cannot be reached at that address, or \
                 refuses INFO and CONFIG GET; make sure it is noeviction, or once a failover promotes it an \
                 evicted key runs its effect again"
            )),
            None => warnings.push(format!(
                "cannot read the maxmemory-policy of Redis ({node}): INFO and CONFIG GET are refused; make sure \
                 it is noeviction, or an evicted key runs its effect again"
            )),
        }
        if s.replica {
            continue;
        }
        let rdb = s.save.as_deref().map(|save| !save.trim().is_empty());
        match (s.aof, rdb) {
            (Some(true), _) => {
                if s.appendfsync.as_deref() == Some("no") {
                    warnings.push(format!(
                        "Redis ({node}) has appendonly yes but appendfsync no: the operating system decides when \
                         claims reach the disk; use appendfsync everysec or always"
                    ));
                }
            }
            (_, Some(true)) => {}
            (Some(false), Some(false)) => warnings.push(format!(
                "Redis ({node}) keeps no copy on disk (appendonly no, save \"\"): a restart forgets every key, \
                 and each runs its effect again; set appendonly yes"
            )),
            (aof, _) => warnings.push(format!(
                "cannot confirm that Redis ({node}) persists its keys (appendonly {}, save unreadable: CONFIG GET \
                 is refused): without AOF or RDB a restart forgets every key; set appendonly yes",
                match aof {
                    Some(false) => "no",
                    _ => "unreadable",
                }
            )),
        }
    }
    for w in &warnings {
        tracing::warn!("{w}");
    }
    Ok(warnings)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(policy: Option<&str>, aof: Option<bool>, save: Option<&str>) -> (String, Settings) {
        (
            "the server".into(),
            Settings {
                policy: policy.map(str::to_owned),
                aof,
                appendfsync: None,
                save: save.map(str::to_owned),
                replica: false,
            },
        )
    }

    /// A replica that evicts is refused; one that cannot be read is a
    /// warning; a replica's persistence is not judged.
    #[test]
    fn replicas_are_judged_for_eviction_only() {
        let replica = |policy: Option<&str>| {
            (
                "replica 10.0.0.2:6380".to_owned(),
                Settings {
                    policy: policy.map(str::to_owned),
                    replica: true,
                    ..Settings::default()
                },
            )
        };
        let sound = node(Some("noeviction"), Some(true), None);
        let e = judge(&[node(Some("noeviction"), Some(true), None), replica(Some("allkeys-lru"))])
            .unwrap_err()
            .to_string();
        assert!(e.contains("replica 10.0.0.2:6380") && e.contains("allkeys-lru"), "{e}");
        assert_eq!(
            judge(&[sound, replica(Some("noeviction"))]).unwrap(),
            Vec::<String>::new()
        );
        let w = judge(&[node(Some("noeviction"), Some(true), None), replica(None)]).unwrap();
        assert!(w.len() == 1 && w[0].contains("replica 10.0.0.2:6380"), "{w:?}");
    }

    /// Replicas are found in both listings, whatever else they hold.
    #[test]
    fn replicas_are_listed() {
        let info = "# Replication\r\nrole:master\r\nconnected_slaves:2\r\n\
                    slave0:ip=127.0.0.1,port=6380,state=online,offset=42,lag=0\r\n\
                    slave1:ip=::1,port=6381,state=wait_bgsave,offset=0,lag=0\r\nmaster_repl_offset:42\r\n";
        assert_eq!(replicas_of_info(info), ["127.0.0.1:6380", "::1:6381"]);
        assert!(replicas_of_info("role:slave\r\nmaster_host:127.0.0.1\r\n").is_empty());
        let nodes = "a1 127.0.0.1:30001@40001 myself,master - 0 0 1 connected 0-5460\n\
                     b2 127.0.0.1:30004@40004,replica-host slave a1 0 1 4 connected\n\
                     c3 :0@0 slave,noaddr a1 0 1 4 disconnected\n\
                     d4 10.0.0.9:30005@40005 replica a1 0 1 4 connected\n";
        assert_eq!(replicas_of_cluster(nodes), ["127.0.0.1:30004", "10.0.0.9:30005"]);
    }

    /// Every eviction policy but noeviction is refused, naming the setting;
    /// a sound server passes without a warning; what cannot be read or is
    /// not persisted is a warning.
    #[test]
    fn the_verdict_follows_the_settings() {
        for policy in [
            "allkeys-lru",
            "allkeys-lfu",
            "allkeys-random",
            "volatile-lru",
            "volatile-lfu",
            "volatile-random",
            "volatile-ttl",
        ] {
            let e = judge(&[node(Some(policy), Some(true), None)]).unwrap_err().to_string();
            assert!(e.contains("maxmemory-policy") && e.contains(policy), "{e}");
        }
        assert_eq!(
            judge(&[node(Some("noeviction"), Some(true), None)]).unwrap(),
            Vec::<String>::new()
        );
        assert_eq!(
            judge(&[node(Some("noeviction"), Some(false), Some("3600 1"))]).unwrap(),
            Vec::<String>::new()
        );
        let w = judge(&[node(Some("noeviction"), Some(false), Some(""))]).unwrap();
        assert!(
            w.len() == 1 && w[0].contains("appendonly") && w[0].contains("save"),
            "{w:?}"
        );
        let w = judge(&[node(None, None, None)]).unwrap();
        assert!(w.len() == 2 && w[0].contains("maxmemory-policy"), "{w:?}");
    }

    /// `CONFIG GET` replies are read in both protocol versions.
    #[test]
    fn config_replies_are_read() {
        let resp2 = Value::Array(vec![
            Value::BulkString(b"save".to_vec()),
            Value::BulkString(b"3600 1".to_vec()),
        ]);
        assert_eq!(config_value(&resp2, "save").as_deref(), Some("3600 1"));
        let resp3 = Value::Map(vec![(
            Value::BulkString(b"appendonly".to_vec()),
            Value::BulkString(b"yes".to_vec()),
        )]);
        assert_eq!(config_value(&resp3, "appendonly").as_deref(), Some("yes"));
        assert_eq!(config_value(&resp3, "save"), None);
    }
}
