//! The call driver: the retry schedule one logical call walks, its
//! deadline, and how its last failure ends the call.

use std::future::Future;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use backon::Retryable;
use tokio::time::Instant;

use super::OutboundResponse;
use super::failure::Failure;
use crate::config::{Jitter, OutboundConfig};
use crate::error::{OutboundError, Result};
use crate::metrics::Labels;

/// The shortest wait a call the breaker refused is deferred by (a probe in
/// flight says "now" until it ends).
const MIN_BREAKER_WAIT: Duration = Duration::from_secs(1);

/// The configured delays, each spread by the jitter: the schedule `backon`
/// walks.
#[derive(Debug)]
pub(crate) struct Schedule {
    delays: std::vec::IntoIter<Duration>,
    jitter: Jitter,
}

impl Schedule {
    pub(crate) fn new(config: &OutboundConfig) -> Self {
        Self {
            delays: config.retry_delays.clone().into_iter(),
            jitter: config.jitter,
        }
    }
}

impl Iterator for Schedule {
    type Item = Duration;

    fn next(&mut self) -> Option<Duration> {
        self.delays.next().map(|d| self.jitter.apply(d))
    }
}

/// What the attempts of one call learnt of the vendor, across attempts.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct CallState {
    /// When the first send that may have reached the vendor started.
    pub(crate) reached_at_ms: Option<i64>,
    /// When the last send that may have reached the vendor started (at
    /// least the first one known): a vendor's "not applied" is trusted only
    /// once that send has settled.
    pub(crate) last_sent_at_ms: Option<i64>,
    /// When the vendor said it had not applied the call, if nothing may
    /// have reached it since.
    pub(crate) not_applied_at_ms: Option<i64>,
}

/// `now + by`, saturating far in the future instead of overflowing.
pub(crate) fn instant_after(by: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(by)
        .unwrap_or_else(|| now + Duration::from_secs(100 * 365 * 24 * 3600))
}

/// Runs one logical call: `attempt(timeout)` until a success, a final
/// failure, the end of the schedule or the deadline. Waits honour a
/// `Retry-After` (or a breaker's open period) when it is longer than the
/// scheduled delay, and never reach past the deadline: a wait that would
/// ends the call at once (a server's `Retry-After` then ends it as
/// `RetryLater`). `state` is what the attempts recorded of the vendor.
pub(crate) async fn drive<F, Fut>(
    config: &OutboundConfig,
    labels: &Labels,
    host_label: &str,
    state: &Mutex<CallState>,
    mut attempt: F,
) -> Result<OutboundResponse>
where
    F: FnMut(Duration) -> Fut,
    Fut: Future<Output = Result<OutboundResponse, Failure>>,
{
    let deadline = instant_after(config.deadline);
    let attempts = AtomicU32::new(0);
    let mut gave_up: Option<String> = None;
    let mut retry_later: Option<Duration> = None;
    let result = (|| {
        attempts.fetch_add(1, Ordering::Relaxed);
        let remaining = deadline.saturating_duration_since(Instant::now());
        attempt(config.attempt_timeout.min(remaining))
    })
    .retry(Schedule::new(config))
    .sleep(tokio::time::sleep)
    .when(Failure::transient)
    .adjust(|failure, next| {
        let Some(scheduled) = next else {
            gave_up = Some(format!("no retries left ({} configured)", config.retry_delays.len()));
            // A breaker's refusal sent nothing: the call is for later, never
            // a dead letter.
            if let Failure::CircuitOpen { retry_in, .. } = failure {
                retry_later = Some((*retry_in).max(MIN_BREAKER_WAIT));
            }
            return None;
        };
        let wait = failure.wait_hint().map_or(scheduled, |hint| hint.max(scheduled));
        if Instant::now().checked_add(wait).is_none_or(|at| at >= deadline) {
            gave_up = Some(format!(
                "the next attempt, in {} ms, would be past the {} ms deadline",
                wait.as_millis(),
                config.deadline.as_millis()
            ));
            match failure {
                Failure::Status {
                    status: 429 | 503,
                    retry_after: Some(after),
                    ..
                } => retry_later = Some(*after),
                Failure::CircuitOpen { retry_in, .. } => retry_later = Some((*retry_in).max(MIN_BREAKER_WAIT)),
                _ => {}
            }
            return None;
        }
        Some(wait)
    })
    .notify(|failure, wait| {
        labels.retry(host_label);
        tracing::info!(error = %failure, wait_ms = wait.as_millis() as u64, "outbound attempt failed; retrying");
    })
    .await;
    let attempts = attempts.into_inner();
    let CallState {
        reached_at_ms: first_reached_at_ms,
        not_applied_at_ms,
        ..
    } = *state.lock().unwrap_or_else(PoisonError::into_inner);
    match result {
        Ok(response) => Ok(OutboundResponse { attempts, ..response }),
        Err(Failure::Invalid(why)) => Err(OutboundError::Invalid(why)),
        Err(Failure::Held(reason)) => Err(OutboundError::Unknown {
            attempts,
            reason,
            first_reached_at_ms,
            sent_under: None,
        }),
        Err(Failure::Stopped(reason)) => Err(OutboundError::Stopped {
            // The attempt the guard stopped was not made.
            attempts: attempts.saturating_sub(1),
            reason,
            first_reached_at_ms,
        }),
        Err(failure @ Failure::Status { .. }) if !failure.transient() => {
            let Failure::Status { status, body, .. } = failure else {
                unreachable!("matched as a status")
            };
            Err(OutboundError::Rejected {
                status,
                body,
                attempts,
                first_reached_at_ms,
            })
        }
        Err(failure) => {
            let last_error = match gave_up {
                Some(why) => format!("{failure}; {why}"),
                None => failure.to_string(),
            };
            match retry_later {
                Some(after) => Err(OutboundError::RetryLater {
                    after,
                    attempts,
                    last_error,
                    first_reached_at_ms,
                    sent_under: None,
                }),
                None => Err(OutboundError::Exhausted {
                    attempts,
                    last_error,
                    first_reached_at_ms,
                    not_applied_at_ms,
                    sent_under: None,
                }),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use reqwest::header::HeaderMap;

    use super::*;
    use crate::breaker::BreakerState;

    fn config(delays_ms: &[u64], deadline_ms: u64) -> OutboundConfig {
        OutboundConfig {
            retry_delays: delays_ms.iter().copied().map(Duration::from_millis).collect(),
            jitter: Jitter::None,
            deadline: Duration::from_millis(deadline_ms),
            attempt_timeout: Duration::from_secs(10),
            ..OutboundConfig::default()
        }
    }

    fn ok() -> OutboundResponse {
        OutboundResponse {
            status: 201,
            headers: HeaderMap::new(),
            body: b"{}".to_vec(),
            body_truncated: false,
            attempts: 0,
            reconciled: false,
        }
    }

    fn status(status: u16, retry_after_secs: Option<u64>) -> Failure {
        Failure::Status {
            status,
            body: b"no".to_vec(),
            retry_after: retry_after_secs.map(Duration::from_secs),
            in_flight: false,
        }
    }

    /// Runs `drive` over scripted answers; answers what it returned, and
    /// when (on the paused clock) each attempt started with which timeout.
    async fn run(
        config: &OutboundConfig,
        script: Vec<Result<OutboundResponse, Failure>>,
    ) -> (Result<OutboundResponse>, Vec<(Duration, Duration)>) {
        let labels = Labels::new("test".into(), 4);
        let start = Instant::now();
        let script = Mutex::new(script.into_iter());
        let seen = Mutex::new(Vec::new());
        let state = Mutex::new(CallState::default());
        let result = drive(config, &labels, "h", &state, |timeout| {
            seen.lock().unwrap().push((start.elapsed(), timeout));
            let next = script.lock().unwrap().next().unwrap_or(Err(status(503, None)));
            async move { next }
        })
        .await;
        (result, seen.into_inner().unwrap())
    }

    fn secs(s: f64) -> Duration {
        Duration::from_secs_f64(s)
    }

    /// The schedule is the configured list, then the call gives up with
    /// attempts = delays + 1.
    #[tokio::test(start_paused = true)]
    async fn the_schedule_is_the_configured_list() {
        let c = config(&[500, 2000, 5000, 30_000], 60_000);
        let (result, seen) = run(&c, vec![]).await;
        let starts: Vec<_> = seen.iter().map(|s| s.0).collect();
        assert_eq!(starts, [0.0, 0.5, 2.5, 7.5, 37.5].map(secs));
        match result {
            Err(OutboundError::Exhausted {
                attempts, last_error, ..
            }) => {
                assert_eq!(attempts, 5);
                assert!(last_error.starts_with("HTTP 503: no"), "{last_error}");
                assert!(last_error.contains("no retries left"), "{last_error}");
            }
            other => panic!("{other:?}"),
        }
    }

    /// Success after failures answers the attempts made.
    #[tokio::test(start_paused = true)]
    async fn success_after_retries_counts_its_attempts() {
        let c = config(&[100, 100, 100], 60_000);
        let script = vec![
            Err(status(500, None)),
            Err(Failure::Network("reset".into())),
            Err(status(408, None)),
            Ok(ok()),
        ];
        let (result, _) = run(&c, script).await;
        assert_eq!(result.unwrap().attempts, 4);
    }

    /// A final 4xx is not retried.
    #[tokio::test(start_paused = true)]
    async fn final_rejections_are_not_retried() {
        for code in [400, 404, 409, 422, 301] {
            let (result, seen) = run(&config(&[100, 100], 60_000), vec![Err(status(code, None))]).await;
            assert_eq!(seen.len(), 1);
            match result {
                Err(OutboundError::Rejected {
                    status, body, attempts, ..
                }) => {
                    assert_eq!((status, body.as_slice(), attempts), (code, &b"no"[..], 1));
                }
                other => panic!("{other:?}"),
            }
        }
    }

    /// A 409 with Retry-After (another attempt with this key is in flight at
    /// the vendor) is waited out and sent again with the same key.
    #[tokio::test(start_paused = true)]
    async fn an_in_flight_conflict_is_retried_after_its_wait() {
        let (result, seen) = run(&config(&[100, 100], 60_000), vec![Err(status(409, Some(2))), Ok(ok())]).await;
        assert_eq!(result.unwrap().attempts, 2);
        assert_eq!(seen.len(), 2);
        assert!(seen[1].0 >= Duration::from_secs(2), "{seen:?}");
        // Still in flight when the retries run out: given up, not rejected.
        let (result, _) = run(
            &config(&[100], 60_000),
            vec![Err(status(409, Some(1))), Err(status(409, Some(1)))],
        )
        .await;
        assert!(
            matches!(result, Err(OutboundError::Exhausted { attempts: 2, .. })),
            "{result:?}"
        );
    }

    /// A Retry-After longer than the scheduled delay is waited in full; a
    /// shorter one does not shorten the schedule.
    #[tokio::test(start_paused = true)]
    async fn retry_after_is_honoured() {
        let c = config(&[500, 500], 60_000);
        let script = vec![Err(status(429, Some(3))), Err(status(503, Some(0))), Ok(ok())];
        let (result, seen) = run(&c, script).await;
        assert_eq!(result.unwrap().attempts, 3);
        let starts: Vec<_> = seen.iter().map(|s| s.0).collect();
        assert_eq!(starts, [0.0, 3.0, 3.5].map(secs));
    }

    /// A Retry-After past the deadline ends the call at once, no sleep, as "retry later" with the wait asked for (not a dead end).
    #[tokio::test(start_paused = true)]
    async fn retry_after_past_the_deadline_gives_up_at_once() {
        let c = config(&[500, 2000], 10_000);
        let start = Instant::now();
        let (result, seen) = run(&c, vec![Err(status(429, Some(60)))]).await;
        assert_eq!(start.elapsed(), Duration::ZERO);
        assert_eq!(seen.len(), 1);
        match result {
            Err(OutboundError::RetryLater {
                attempts: 1,
                after,
                last_error,
                ..
            }) => {
                assert_eq!(after, Duration::from_secs(60));
                assert!(last_error.contains("Retry-After 60s"), "{last_error}");
                assert!(last_error.contains("past the 10000 ms deadline"), "{last_error}");
            }
            other => panic!("{other:?}"),
        }
    }

    /// The deadline also cuts the schedule, and each attempt's timeout.
    #[tokio::test(start_paused = true)]
    async fn the_deadline_bounds_waits_and_attempts() {
        let mut c = config(&[1000, 1000, 1000, 1000], 2500);
        c.attempt_timeout = Duration::from_secs(2);
        let (result, seen) = run(&c, vec![]).await;
        assert_eq!(
            seen,
            [(secs(0.0), secs(2.0)), (secs(1.0), secs(1.5)), (secs(2.0), secs(0.5))]
        );
        assert_eq!(result.unwrap_err().attempts(), 3);
    }

    /// A breaker refusal waits for the end of the open period when it is
    /// longer than the scheduled delay.
    #[tokio::test(start_paused = true)]
    async fn an_open_breaker_is_waited_out() {
        let c = config(&[100, 100], 60_000);
        let open = Failure::CircuitOpen {
            host: "http://v:80".into(),
            state: BreakerState::Open,
            retry_in: Duration::from_secs(5),
        };
        let (result, seen) = run(&c, vec![Err(open), Ok(ok())]).await;
        assert_eq!(result.unwrap().attempts, 2);
        assert_eq!(seen[1].0, secs(5.0));
    }

    /// A jittered schedule stays within its band around the list.
    #[test]
    fn jittered_schedules_follow_the_list() {
        let c = OutboundConfig::default();
        for _ in 0..100 {
            let delays: Vec<_> = Schedule::new(&c).collect();
            assert_eq!(delays.len(), 4);
            for (d, base) in delays.iter().zip(&c.retry_delays) {
                assert!(*d >= *base * 4 / 5 && *d <= *base * 6 / 5, "{d:?} vs {base:?}");
            }
        }
    }
}
