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
//! On a cluster every master is read.

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
            None => warnings.push(format!(
                "cannot read the maxmemory-policy of Redis ({node}): INFO and CONFIG GET are refused; make sure \
                 it is noeviction, or an evicted key runs its effect again"
            )),
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
            },
        )
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
