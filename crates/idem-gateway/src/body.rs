//! Request bodies with read timeouts: a caller that stops sending its body
//! does not hold its connection (and the request's task) for ever.
//!
//! Only the time spent waiting for the caller counts: a body nobody reads
//! for a while (the upstream has not asked for more) is not the caller's
//! fault. Two bounds: the longest single wait for the next bytes, and all
//! waits of one body together (a body trickled in just under the first
//! bound is still cut off). Either ends the body with an I/O error of kind
//! `TimedOut`, which the idempotency layer answers with 408 and the proxy
//! with 408 as well.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Bytes;
use http_body::{Body, Frame, SizeHint};
use tokio::time::{Instant, Sleep};

/// The error a timed-out body ends with (inside an `io::Error` of kind
/// `TimedOut`).
#[derive(Debug)]
pub(crate) struct SlowBody {
    waited: Duration,
    total: bool,
}

impl std::fmt::Display for SlowBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.total {
            write!(f, "the request body took over {} s to arrive", self.waited.as_secs())
        } else {
            write!(f, "no request body bytes arrived for {} s", self.waited.as_secs())
        }
    }
}

impl std::error::Error for SlowBody {}

/// Whether an error is, or was caused by, a [`SlowBody`].
pub(crate) fn is_slow_body(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut next = Some(e);
    while let Some(e) = next {
        if e.is::<SlowBody>() {
            return true;
        }
        if let Some(io) = e.downcast_ref::<std::io::Error>()
            && io.get_ref().is_some_and(|inner| inner.is::<SlowBody>())
        {
            return true;
        }
        next = e.source();
    }
    false
}

/// The read bounds of request bodies.
#[derive(Debug, Clone, Copy)]
pub(crate) struct BodyTimeouts {
    /// The longest wait for the next bytes.
    pub(crate) idle: Duration,
    /// All waits together.
    pub(crate) total: Duration,
}

/// A request body bounded by [`BodyTimeouts`].
pub(crate) struct TimedBody<B> {
    inner: B,
    bounds: BodyTimeouts,
    /// The wait in progress: when it began, and its deadline.
    waiting: Option<(Instant, Pin<Box<Sleep>>)>,
    /// The waits that ended, together.
    waited: Duration,
    failed: bool,
}

impl<B> TimedBody<B> {
    pub(crate) fn new(inner: B, bounds: BodyTimeouts) -> Self {
        Self {
            inner,
            bounds,
            waiting: None,
            waited: Duration::ZERO,
            failed: false,
        }
    }
}

impl<B> Body for TimedBody<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    type Data = Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = &mut *self;
        if this.failed {
            return Poll::Ready(None);
        }
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(frame) => {
                if let Some((began, _)) = this.waiting.take() {
                    this.waited += began.elapsed();
                }
                Poll::Ready(frame.map(|f| f.map_err(Into::into)))
            }
            Poll::Pending => {
                let bounds = this.bounds;
                let waited = this.waited;
                let (began, deadline) = this.waiting.get_or_insert_with(|| {
                    let now = Instant::now();
                    let left = bounds.total.saturating_sub(waited);
                    (now, Box::pin(tokio::time::sleep_until(now + bounds.idle.min(left))))
                });
                if deadline.as_mut().poll(cx).is_pending() {
                    return Poll::Pending;
                }
                let this_wait = began.elapsed();
                this.failed = true;
                let total = this.waited + this_wait >= bounds.total;
                let slow = SlowBody {
                    waited: if total { bounds.total } else { this_wait },
                    total,
                };
                tracing::debug!(%slow, "request body timed out");
                Poll::Ready(Some(Err(Box::new(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    slow,
                )))))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.failed || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    /// A body of three chunks, each after `gap`.
    fn trickle(gap: Duration) -> impl Body<Data = Bytes, Error = std::io::Error> + Unpin {
        let stream = futures_util::stream::unfold(0, move |n| async move {
            if n == 3 {
                return None;
            }
            tokio::time::sleep(gap).await;
            Some((Ok::<_, std::io::Error>(Frame::data(Bytes::from_static(b"ab"))), n + 1))
        });
        http_body_util::StreamBody::new(Box::pin(stream))
    }

    /// An idle bound of `idle_secs` and a total bound of `total_secs`.
    fn bounds(idle_secs: u64, total_secs: u64) -> BodyTimeouts {
        BodyTimeouts {
            idle: Duration::from_secs(idle_secs),
            total: Duration::from_secs(total_secs),
        }
    }

    /// Reads a [`trickle`] with gaps of `gap_secs` through a [`TimedBody`]
    /// within `bounds`: the bytes read, or the timeout's message.
    async fn read_trickle(gap_secs: u64, bounds: BodyTimeouts) -> Result<usize, String> {
        let body = TimedBody::new(trickle(Duration::from_secs(gap_secs)), bounds);
        body.collect().await.map(|c| c.to_bytes().len()).map_err(|e| {
            assert!(is_slow_body(&*e), "{e}");
            e.to_string()
        })
    }

    /// A body whose bytes keep coming within both bounds is read whole.
    #[tokio::test(start_paused = true)]
    async fn a_steady_body_is_read() {
        assert_eq!(read_trickle(9, bounds(10, 60)).await, Ok(6));
    }

    /// One wait past the idle bound ends the body with a timeout.
    #[tokio::test(start_paused = true)]
    async fn a_stalled_body_times_out() {
        let e = read_trickle(11, bounds(10, 60)).await.unwrap_err();
        assert!(e.contains("for 10 s"), "{e}");
    }

    /// Waits under the idle bound that add up past the total bound end the body too.
    #[tokio::test(start_paused = true)]
    async fn a_trickled_body_times_out() {
        let e = read_trickle(9, bounds(10, 20)).await.unwrap_err();
        assert!(e.contains("over 20 s"), "{e}");
    }

    /// Time nobody spends reading the body does not count.
    #[tokio::test(start_paused = true)]
    async fn unread_time_does_not_count() {
        let mut body = TimedBody::new(http_body_util::Full::new(Bytes::from_static(b"abc")), bounds(10, 10));
        tokio::time::sleep(Duration::from_secs(3600)).await;
        let frame = body.frame().await.unwrap().unwrap();
        assert_eq!(frame.into_data().unwrap(), "abc");
    }
}
