//! One server or a cluster, chosen when connecting: what the `idem`
//! command and the gateway use, since their store is given as a URL.

use idem_core::{Error, Result};
use redis::aio::{ConnectionLike, ConnectionManager};
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{MultipleNodeRoutingInfo, RoutingInfo};
use redis::{Cmd, Pipeline, RedisFuture, Value};

use crate::sentinel::SentinelConnection;
use crate::{RedisStore, store_error};

/// A connection to one Redis server or to a Redis Cluster
/// ([`RedisStore::connect_any`] picks one).
#[derive(Clone)]
pub enum RedisConnection {
    /// One server, reconnecting as needed.
    Single(ConnectionManager),
    /// A cluster: commands go to the node that serves their slot.
    Cluster(ClusterConnection),
    /// The master Redis Sentinel names for a service, found again after a
    /// failover.
    Sentinel(SentinelConnection),
}

impl ConnectionLike for RedisConnection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Self::Single(c) => c.req_packed_command(cmd),
            Self::Cluster(c) => c.req_packed_command(cmd),
            Self::Sentinel(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Self::Single(c) => c.req_packed_commands(cmd, offset, count),
            Self::Cluster(c) => c.req_packed_commands(cmd, offset, count),
            Self::Sentinel(c) => c.req_packed_commands(cmd, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Self::Single(c) => c.get_db(),
            Self::Cluster(c) => c.get_db(),
            Self::Sentinel(c) => c.get_db(),
        }
    }
}

impl RedisConnection {
    /// Sends `cmd` to the server, or to every master of the cluster, and
    /// answers each node's reply (a node's error is that node's `Err`).
    pub(crate) async fn on_every_master(&self, cmd: Cmd) -> Vec<(String, redis::RedisResult<Value>)> {
        match self {
            Self::Single(c) => {
                let mut c = c.clone();
                vec![("the server".to_owned(), cmd.query_async::<Value>(&mut c).await)]
            }
            Self::Sentinel(c) => {
                let mut c = c.clone();
                let reply = cmd.query_async::<Value>(&mut c).await;
                let node = c
                    .master()
                    .map_or_else(|| "the master".to_owned(), |m| format!("master {m}"));
                vec![(node, reply)]
            }
            Self::Cluster(c) => {
                let mut c = c.clone();
                let routing = RoutingInfo::MultiNode((MultipleNodeRoutingInfo::AllMasters, None));
                match c.route_command(cmd, routing).await {
                    Ok(Value::Map(replies)) => replies
                        .into_iter()
                        .map(|(node, reply)| {
                            let node = crate::text(&node).unwrap_or_else(|| "a master".to_owned());
                            let reply = match reply {
                                Value::ServerError(e) => Err(e.into()),
                                other => Ok(other),
                            };
                            (format!("master {node}"), reply)
                        })
                        .collect(),
                    Ok(other) => vec![("the cluster".to_owned(), Ok(other))],
                    Err(e) => vec![("the cluster".to_owned(), Err(e))],
                }
            }
        }
    }
}

impl RedisConnection {
    /// The addresses (`host:port`) of the deployment's replicas, as the
    /// deployment reports them: a server's `INFO replication`, a cluster's
    /// `CLUSTER NODES`.
    pub(crate) async fn replicas(&self) -> redis::RedisResult<Vec<String>> {
        match self {
            Self::Single(_) | Self::Sentinel(_) => {
                let mut c = self.clone();
                let info: Value = redis::cmd("INFO").arg("replication").query_async(&mut c).await?;
                Ok(crate::deployment::replicas_of_info(
                    &crate::text(&info).unwrap_or_default(),
                ))
            }
            Self::Cluster(_) => {
                // Every master's view, joined: a node that joined a moment
                // ago is known to some masters before the others.
                let mut replicas = Vec::new();
                let mut first_error = None;
                for (_, reply) in self.on_every_master(redis::cmd("CLUSTER").arg("NODES").clone()).await {
                    match reply {
                        Ok(nodes) => {
                            let text = crate::text(&nodes).unwrap_or_default();
                            for replica in crate::deployment::replicas_of_cluster(&text) {
                                if !replicas.contains(&replica) {
                                    replicas.push(replica);
                                }
                            }
                        }
                        Err(e) => first_error = first_error.or(Some(e)),
                    }
                }
                match first_error {
                    Some(e) if replicas.is_empty() => Err(e),
                    _ => Ok(replicas),
                }
            }
        }
    }
}

impl RedisStore<RedisConnection> {
    /// Connects to what `urls` names: one `redis://` URL (a server, or a
    /// node of a cluster: a node with `cluster_enabled:1` in `INFO` makes
    /// this a cluster connection seeded by it), several separated by
    /// commas (the seed nodes of a cluster), or a `redis+sentinel://` URL
    /// (the master Redis Sentinel names: [`RedisStore::connect_sentinel`]).
    pub async fn connect_any(urls: &str) -> Result<Self> {
        if crate::sentinel::is_sentinel_url(urls.trim()) {
            return Self::connect_sentinel(urls.trim()).await;
        }
        let seeds: Vec<&str> = urls.split(',').map(str::trim).filter(|u| !u.is_empty()).collect();
        match seeds.as_slice() {
            [] => Err(Error::Config("no Redis URL given".into())),
            [one] => {
                let single = RedisStore::connect(one).await?;
                if is_cluster_node(&single.conn).await {
                    let cluster = RedisStore::connect_cluster(&[one]).await?;
                    Ok(RedisStore::new(RedisConnection::Cluster(cluster.conn))
                        .on_cluster()
                        .with_dialer(cluster.dialer))
                } else {
                    Ok(RedisStore::new(RedisConnection::Single(single.conn)).with_dialer(single.dialer))
                }
            }
            many => {
                let cluster = RedisStore::connect_cluster(many).await?;
                Ok(RedisStore::new(RedisConnection::Cluster(cluster.conn))
                    .on_cluster()
                    .with_dialer(cluster.dialer))
            }
        }
    }

    /// Connects to the master that the sentinels a `redis+sentinel://` URL
    /// names (`redis+sentinel://[user:password@]host:port,…/SERVICE[/DB]`,
    /// `rediss+sentinel://` for TLS) serve for its service, and to the next
    /// master after a failover; see [`SentinelConnection`]. Fails at once
    /// if no sentinel names a master that answers as one.
    pub async fn connect_sentinel(url: &str) -> Result<Self> {
        let (conn, dialer) = SentinelConnection::connect(url, crate::RESPONSE_TIMEOUT).await?;
        Ok(RedisStore::new(RedisConnection::Sentinel(conn)).with_dialer(Some(std::sync::Arc::new(dialer))))
    }

    /// Whether this is a cluster connection.
    pub fn is_cluster(&self) -> bool {
        matches!(self.conn, RedisConnection::Cluster(_))
    }
}

/// Whether the server says it runs in cluster mode (a server that refuses
/// `INFO` is taken for a single server: commands for other slots would then
/// fail with `MOVED`, loudly).
async fn is_cluster_node(conn: &ConnectionManager) -> bool {
    let mut conn = conn.clone();
    let info: redis::RedisResult<Value> = redis::cmd("INFO").arg("cluster").query_async(&mut conn).await;
    match info {
        Ok(v) => crate::text(&v).is_some_and(|t| t.lines().any(|l| l.trim() == "cluster_enabled:1")),
        Err(e) => {
            tracing::debug!(error = %store_error(e), "INFO cluster refused; taking the server for a single one");
            false
        }
    }
}
