//! Metric names and their bounded labels (the table is in the crate docs).

use std::collections::HashSet;
use std::sync::{Arc, Mutex, PoisonError};

use crate::breaker::BreakerState;

/// The label of hosts past the cap.
pub(crate) const OTHER_HOST: &str = "other";

/// A client's labels.
#[derive(Debug)]
pub(crate) struct Labels {
    pub(crate) client: String,
    cap: usize,
    hosts: Mutex<HashSet<Arc<str>>>,
}

impl Labels {
    pub(crate) fn new(client: String, cap: usize) -> Self {
        Self {
            client,
            cap,
            hosts: Mutex::new(HashSet::new()),
        }
    }

    /// The `host` label of `host`.
    pub(crate) fn host(&self, host: &str) -> String {
        let mut hosts = self.hosts.lock().unwrap_or_else(PoisonError::into_inner);
        if hosts.contains(host) {
            return host.to_owned();
        }
        if hosts.len() < self.cap {
            hosts.insert(host.into());
            return host.to_owned();
        }
        OTHER_HOST.to_owned()
    }

    pub(crate) fn attempt(&self, host: &str, outcome: &'static str) {
        metrics::counter!(
            "idem_outbound_attempts_total",
            "client" => self.client.clone(),
            "host" => host.to_owned(),
            "outcome" => outcome
        )
        .increment(1);
    }

    pub(crate) fn retry(&self, host: &str) {
        metrics::counter!(
            "idem_outbound_retries_total",
            "client" => self.client.clone(),
            "host" => host.to_owned()
        )
        .increment(1);
    }

    pub(crate) fn call(&self, host: &str, result: &'static str) {
        metrics::counter!(
            "idem_outbound_calls_total",
            "client" => self.client.clone(),
            "host" => host.to_owned(),
            "result" => result
        )
        .increment(1);
    }

    pub(crate) fn transition(&self, host: &str, to: BreakerState) {
        let host = self.host(host);
        metrics::counter!(
            "idem_outbound_breaker_transitions_total",
            "client" => self.client.clone(),
            "host" => host.clone(),
            "to" => to.as_str()
        )
        .increment(1);
        metrics::gauge!("idem_outbound_breaker_state", "client" => self.client.clone(), "host" => host).set(to.gauge());
    }

    pub(crate) fn reconcile(&self, result: &'static str) {
        metrics::counter!("idem_outbound_reconciles_total", "client" => self.client.clone(), "result" => result)
            .increment(1);
    }

    pub(crate) fn redrive(&self, result: &'static str) {
        metrics::counter!("idem_outbound_redrives_total", "client" => self.client.clone(), "result" => result)
            .increment(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_labels_are_capped() {
        let labels = Labels::new("c".into(), 2);
        assert_eq!(labels.host("http://a:80"), "http://a:80");
        assert_eq!(labels.host("http://b:80"), "http://b:80");
        assert_eq!(labels.host("http://c:80"), OTHER_HOST);
        assert_eq!(labels.host("http://a:80"), "http://a:80");
    }
}
