//! Reading request bodies so that early answers reach the client.
//!
//! Many clients (Python's `http.client`, most SDKs) write the whole request
//! body before they read anything. If the server answers early (413, or 400
//! for a bad key) and closes the connection with body bytes still unread, the
//! kernel resets it and the client sees a broken pipe instead of the answer.
//! So before an early answer the rest of the body is read and discarded, up to
//! a bound in bytes and in time; beyond the bound the connection is closed.

use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::{HeaderMap, StatusCode, header};
use http_body_util::BodyExt;
use idem_core::BoxError;

use crate::problem::{Problem, slugs};

/// How much of a request body is read and discarded before an early answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Drain {
    /// The most bytes read in all (default 8 MiB).
    pub(crate) max_bytes: u64,
    /// The longest time spent reading (default 10 s).
    pub(crate) timeout: Duration,
}

impl Default for Drain {
    fn default() -> Self {
        Self {
            max_bytes: 8 << 20,
            timeout: Duration::from_secs(10),
        }
    }
}

impl Drain {
    /// Reads and discards `body` until it ends, `max_bytes` have been read
    /// (counting `already` bytes read before) or the timeout passes.
    pub(crate) async fn discard<B>(&self, body: B, already: u64)
    where
        B: http_body::Body<Data = Bytes> + Send,
    {
        let max = self.max_bytes;
        let read = async move {
            let mut body = std::pin::pin!(body);
            let mut total = already;
            while total <= max {
                let next = body.frame().await.and_then(Result::ok);
                match next {
                    Some(frame) => {
                        if let Some(data) = frame.data_ref() {
                            total += data.len() as u64;
                        }
                    }
                    None => return,
                }
            }
        };
        if tokio::time::timeout(self.timeout, read).await.is_err() {
            tracing::debug!("stopped draining a request body at the time limit");
        }
    }

    /// Reads a request body of at most `limit` bytes. Beyond it, 413: the
    /// rest of the body is drained first (unless its declared length is
    /// over the drain bound) so the client can read the answer.
    pub(crate) async fn read_request<B>(&self, body: B, headers: &HeaderMap, limit: usize) -> Result<Bytes, Problem>
    where
        B: http_body::Body<Data = Bytes> + Send,
        B::Error: Into<BoxError>,
    {
        let too_large = || {
            Problem::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                slugs::BODY_TOO_LARGE,
                "Request body too large",
            )
            .with_detail(format!("the request body exceeds the limit of {limit} bytes"))
        };
        let declared = headers
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        if let Some(n) = declared
            && n > limit as u64
        {
            if n <= self.max_bytes {
                self.discard(body, 0).await;
            }
            return Err(too_large());
        }
        let mut body = std::pin::pin!(body);
        let mut buf = BytesMut::new();
        loop {
            let next = body.frame().await.map(|r| r.map_err(Into::<BoxError>::into));
            match next {
                None => return Ok(buf.freeze()),
                Some(Ok(frame)) => {
                    let Ok(data) = frame.into_data() else { continue };
                    if buf.len() + data.len() > limit {
                        let read = (buf.len() + data.len()) as u64;
                        drop(buf);
                        self.discard(body, read).await;
                        return Err(too_large());
                    }
                    buf.extend_from_slice(&data);
                }
                Some(Err(e)) if timed_out(&*e) => {
                    return Err(Problem::new(
                        StatusCode::REQUEST_TIMEOUT,
                        slugs::BODY_TIMEOUT,
                        "Request body timed out",
                    )
                    .with_detail(format!("the request body stopped arriving: {e}; nothing was applied")));
                }
                Some(Err(e)) => {
                    return Err(Problem::new(
                        StatusCode::BAD_REQUEST,
                        slugs::BODY_UNREADABLE,
                        "Request body unreadable",
                    )
                    .with_detail(format!("the request body could not be read: {e}")));
                }
            }
        }
    }
}

/// Whether a body error is, or was caused by, an I/O error of kind
/// `TimedOut`: a read timeout of the server's, which the client may retry.
fn timed_out(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut next = Some(e);
    while let Some(e) = next {
        if e.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::TimedOut)
        {
            return true;
        }
        next = e.source();
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum_core::body::Body;

    #[tokio::test]
    async fn bounded_reads() {
        let d = Drain::default();
        let h = HeaderMap::new();
        assert_eq!(d.read_request(Body::from("abc"), &h, 3).await.unwrap(), "abc");
        let e = d.read_request(Body::from("abcd"), &h, 3).await.unwrap_err();
        assert_eq!(e.status(), StatusCode::PAYLOAD_TOO_LARGE);
        let mut h = HeaderMap::new();
        h.insert(header::CONTENT_LENGTH, "4".parse().unwrap());
        let e = d.read_request(Body::from("abcd"), &h, 3).await.unwrap_err();
        assert_eq!(e.status(), StatusCode::PAYLOAD_TOO_LARGE);
    }

    /// A body that fails with a timed-out read is a 408; any other failure a 400.
    #[tokio::test]
    async fn a_timed_out_body_is_408() {
        let d = Drain::default();
        let h = HeaderMap::new();
        let failing = |kind| {
            let chunks: Vec<Result<Bytes, std::io::Error>> =
                vec![Ok(Bytes::from_static(b"ab")), Err(std::io::Error::new(kind, "stalled"))];
            Body::from_stream(futures_util::stream::iter(chunks))
        };
        let e = d
            .read_request(failing(std::io::ErrorKind::TimedOut), &h, 10)
            .await
            .unwrap_err();
        assert_eq!(e.status(), StatusCode::REQUEST_TIMEOUT);
        let e = d
            .read_request(failing(std::io::ErrorKind::Other), &h, 10)
            .await
            .unwrap_err();
        assert_eq!(e.status(), StatusCode::BAD_REQUEST);
    }
}
