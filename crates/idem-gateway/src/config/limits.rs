//! The bounds on time, sizes and connections: read timeouts, the upstream
//! timeout, the Redis deployment check's period, connections and buffered
//! bytes.

use super::{Config, ConfigError};

impl Config {
    /// Checks the bounds on time, sizes and connections.
    pub(super) fn check_limits(&self) -> Result<(), ConfigError> {
        for (name, secs) in [
            ("header_read_timeout_secs", self.header_read_timeout_secs),
            ("body_read_timeout_secs", self.body_read_timeout_secs),
            ("body_total_timeout_secs", self.body_total_timeout_secs),
            ("upstream_timeout_secs", self.upstream_timeout_secs),
        ] {
            if secs == 0 || secs > 3600 {
                return Err(ConfigError(format!("{name} must be between 1 and 3600, not {secs}")));
            }
        }
        if self.redis.deployment_check_secs > 86_400 {
            return Err(ConfigError(format!(
                "[redis] deployment_check_secs must be at most 86400 (0: only at start), not {}",
                self.redis.deployment_check_secs
            )));
        }
        if self.redis.replica_acks > 16 {
            return Err(ConfigError(format!(
                "[redis] replica_acks must be at most 16 (0: none), not {}",
                self.redis.replica_acks
            )));
        }
        if self.redis.replica_acks > 0 && !(1..=4000).contains(&self.redis.replica_ack_timeout_ms) {
            return Err(ConfigError(format!(
                "[redis] replica_ack_timeout_ms must be between 1 and 4000, not {}",
                self.redis.replica_ack_timeout_ms
            )));
        }
        if self.max_connections == 0 || self.max_connections > 1_000_000 {
            return Err(ConfigError(format!(
                "max_connections must be between 1 and 1000000, not {}",
                self.max_connections
            )));
        }
        if self.max_buffered_bytes < self.max_request_bytes {
            return Err(ConfigError(format!(
                "max_buffered_bytes ({}) must be at least max_request_bytes ({}): a request of the largest \
                 accepted size could never be served",
                self.max_buffered_bytes, self.max_request_bytes
            )));
        }
        Ok(())
    }
}
