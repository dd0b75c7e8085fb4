//! Per-operation policy: retention, in-flight twins, what consumes a key, leases.

use std::time::Duration;

use crate::error::{Error, Result};

/// What a duplicate does when it arrives while the first request with its key
/// is still running.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InFlight {
    /// Wait up to `max_ms` for the first to finish, then replay its outcome
    /// (or report [`Error::InFlight`] if it has not finished by then).
    Wait {
        /// The longest wait, in milliseconds.
        max_ms: u64,
    },
    /// Report [`Error::InFlight`] at once.
    Reject,
}

/// Which outcomes consume a key. Faults and transient errors never do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Consume {
    /// Only a committed success (the default). A rejection rolls back and
    /// leaves the key unused, so the caller may retry it later.
    Success,
    /// A success, or a final (non-retryable) rejection. The rejection is
    /// recorded and replayed, while the work's own writes stay rolled back.
    SuccessOrFinalRejection,
}

/// How idempotent calls of one operation behave.
///
/// ```
/// use idem_core::{Policy, InFlight};
/// // Payouts: keys kept for 7 days, twins rejected at once.
/// let payouts = Policy::default()
///     .with_ttl_secs(7 * 24 * 3600)
///     .with_in_flight(InFlight::Reject);
/// assert_eq!(payouts.ttl_secs(), 604_800);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Policy {
    ttl_secs: u64,
    in_flight: InFlight,
    consume: Consume,
    lease_ms: u64,
    retry_after_ms: u64,
    max_record_bytes: usize,
}

impl Default for Policy {
    /// 24-hour keys, twins wait up to 10 s, only success consumes a key,
    /// 30-second leases, a 1 s retry hint, records up to 1 MiB.
    fn default() -> Self {
        Self {
            ttl_secs: 24 * 3600,
            in_flight: InFlight::Wait { max_ms: 10_000 },
            consume: Consume::Success,
            lease_ms: 30_000,
            retry_after_ms: 1_000,
            max_record_bytes: 1 << 20,
        }
    }
}

impl Policy {
    /// How long a key is kept after it is claimed; a key older than this is
    /// treated as absent and executes anew.
    pub fn with_ttl_secs(mut self, ttl_secs: u64) -> Self {
        self.ttl_secs = ttl_secs;
        self
    }

    /// What an in-flight twin does.
    pub fn with_in_flight(mut self, in_flight: InFlight) -> Self {
        self.in_flight = in_flight;
        self
    }

    /// Which outcomes consume a key.
    pub fn with_consume(mut self, consume: Consume) -> Self {
        self.consume = consume;
        self
    }

    /// How long a lease-mode claim is held before another claimer may take
    /// it over.
    pub fn with_lease_ms(mut self, lease_ms: u64) -> Self {
        self.lease_ms = lease_ms;
        self
    }

    /// The retry hint given with [`Error::InFlight`].
    pub fn with_retry_after_ms(mut self, retry_after_ms: u64) -> Self {
        self.retry_after_ms = retry_after_ms;
        self
    }

    /// The largest outcome that may be recorded.
    pub fn with_max_record_bytes(mut self, max_record_bytes: usize) -> Self {
        self.max_record_bytes = max_record_bytes;
        self
    }

    /// The key lifetime in seconds.
    pub fn ttl_secs(&self) -> u64 {
        self.ttl_secs
    }

    /// The in-flight behaviour.
    pub fn in_flight(&self) -> InFlight {
        self.in_flight
    }

    /// What consumes a key.
    pub fn consume(&self) -> Consume {
        self.consume
    }

    /// The lease length in milliseconds.
    pub fn lease_ms(&self) -> u64 {
        self.lease_ms
    }

    /// The retry hint in milliseconds.
    pub fn retry_after_ms(&self) -> u64 {
        self.retry_after_ms
    }

    /// The record size limit in bytes.
    pub fn max_record_bytes(&self) -> usize {
        self.max_record_bytes
    }

    /// The longest an in-flight twin waits.
    pub fn max_wait(&self) -> Duration {
        match self.in_flight {
            InFlight::Wait { max_ms } => Duration::from_millis(max_ms),
            InFlight::Reject => Duration::ZERO,
        }
    }

    pub(crate) fn ttl_ms(&self) -> i64 {
        i64::try_from(self.ttl_secs.saturating_mul(1000)).unwrap_or(i64::MAX)
    }

    /// The lease actually granted: a claim never outlives its key, so the
    /// lease is at most the TTL.
    /// The lease length in effect: `lease_ms`, capped at the TTL.
    pub fn effective_lease_ms(&self) -> u64 {
        u64::try_from(self.lease_ms_i64()).unwrap_or(0)
    }

    pub(crate) fn lease_ms_i64(&self) -> i64 {
        i64::try_from(self.lease_ms).unwrap_or(i64::MAX).min(self.ttl_ms())
    }

    /// Checks that the policy is coherent: a positive TTL (at most ten years)
    /// and a positive lease. A lease longer than the TTL is cut to the TTL.
    pub fn validate(&self) -> Result<()> {
        if self.ttl_secs == 0 {
            return Err(Error::Config("ttl_secs must be positive".into()));
        }
        if self.ttl_secs > 10 * 365 * 24 * 3600 {
            return Err(Error::Config("ttl_secs must be at most ten years".into()));
        }
        if self.lease_ms == 0 {
            return Err(Error::Config("lease_ms must be positive".into()));
        }
        Ok(())
    }
}
