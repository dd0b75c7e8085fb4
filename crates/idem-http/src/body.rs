//! Bounded reading of response bodies.

use std::pin::Pin;
use std::task::{Context, Poll};

use axum_core::body::Body;
use bytes::{Bytes, BytesMut};
use http::HeaderMap;
use http_body::Frame;
use http_body_util::BodyExt;
use idem_core::BoxError;

use crate::service::ByteBody;

/// A response body read up to a limit.
pub(crate) enum Collected {
    /// The whole body, and its trailers if it had any.
    Full(Bytes, HeaderMap),
    /// Over the limit: the body, still whole, to stream on.
    TooLarge(Body),
    /// The body failed mid-stream.
    Failed(String),
}

pub(crate) async fn collect_response<B>(body: B, limit: usize) -> Collected
where
    B: ByteBody,
{
    let mut body = Box::pin(body);
    let mut buf = BytesMut::new();
    let mut trailers = HeaderMap::new();
    loop {
        match body.frame().await {
            None => return Collected::Full(buf.freeze(), trailers),
            Some(Ok(frame)) => {
                let data = match frame.into_data() {
                    Ok(data) => data,
                    Err(frame) => {
                        if let Ok(more) = frame.into_trailers() {
                            trailers.extend(more);
                        }
                        continue;
                    }
                };
                if buf.len() + data.len() > limit {
                    buf.extend_from_slice(&data);
                    return Collected::TooLarge(Body::new(Prefixed {
                        prefix: Some(buf.freeze()),
                        rest: body,
                    }));
                }
                buf.extend_from_slice(&data);
            }
            Some(Err(e)) => return Collected::Failed(e.into().to_string()),
        }
    }
}

/// Bytes already read, followed by the rest of a body.
struct Prefixed<B> {
    prefix: Option<Bytes>,
    rest: Pin<Box<B>>,
}

impl<B> http_body::Body for Prefixed<B>
where
    B: http_body::Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if let Some(prefix) = self.prefix.take() {
            return Poll::Ready(Some(Ok(Frame::data(prefix))));
        }
        self.rest
            .as_mut()
            .poll_frame(cx)
            .map(|f| f.map(|r| r.map_err(Into::into)))
    }
}

/// A body read whole, with its trailers: sent as one data frame, then the
/// trailers (if any).
pub(crate) fn with_trailers(data: Bytes, trailers: HeaderMap) -> Body {
    if trailers.is_empty() {
        return Body::from(data);
    }
    Body::new(Whole {
        data: Some(data),
        trailers: Some(trailers),
    })
}

struct Whole {
    data: Option<Bytes>,
    trailers: Option<HeaderMap>,
}

impl http_body::Body for Whole {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(mut self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        if let Some(data) = self.data.take().filter(|d| !d.is_empty()) {
            return Poll::Ready(Some(Ok(Frame::data(data))));
        }
        Poll::Ready(self.trailers.take().map(|t| Ok(Frame::trailers(t))))
    }

    fn is_end_stream(&self) -> bool {
        self.data.as_ref().is_none_or(Bytes::is_empty) && self.trailers.is_none()
    }
}

/// What the recording task forwards to the first caller of a streamed
/// response.
pub(crate) enum Chunk {
    /// The next frame.
    Frame(Frame<Bytes>),
    /// The last frame: the body is whole and its outcome settled.
    Last(Frame<Bytes>),
    /// The body is whole and its outcome settled.
    End,
    /// The body failed.
    Failed(String),
}

/// The first caller's side of a streamed response: frames as the recording
/// task forwards them. It ends only on [`Chunk::End`]; a failure, or a
/// sender gone without it (the caller was left behind), cuts the response
/// off with an error, so a partial body is never taken for a whole one.
pub(crate) struct Streamed {
    chunks: tokio::sync::mpsc::Receiver<Chunk>,
    ended: bool,
    /// The handler body's exact length, when it declared one: the caller
    /// then gets a `Content-Length`, and a cut-off shows as a short body.
    exact: Option<u64>,
}

impl Streamed {
    pub(crate) fn new(chunks: tokio::sync::mpsc::Receiver<Chunk>, exact: Option<u64>) -> Self {
        Self {
            chunks,
            ended: false,
            exact,
        }
    }
}

impl http_body::Body for Streamed {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if self.ended {
            return Poll::Ready(None);
        }
        let chunk = std::task::ready!(self.chunks.poll_recv(cx));
        Poll::Ready(match chunk {
            Some(Chunk::Frame(frame)) => Some(Ok(frame)),
            Some(Chunk::Last(frame)) => {
                self.ended = true;
                Some(Ok(frame))
            }
            Some(Chunk::End) => {
                self.ended = true;
                None
            }
            Some(Chunk::Failed(why)) => {
                self.ended = true;
                Some(Err(why.into()))
            }
            None => {
                self.ended = true;
                Some(Err("the response was cut off before its end".into()))
            }
        })
    }

    fn is_end_stream(&self) -> bool {
        self.ended
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.exact.map(http_body::SizeHint::with_exact).unwrap_or_default()
    }
}

/// A response being streamed and recorded: what was kept of it so far.
pub(crate) struct Tee {
    limit: usize,
    kept: BytesMut,
    trailers: HeaderMap,
    over: bool,
}

/// How a streamed response ended, for its record.
pub(crate) enum Teed {
    /// Whole, within the limit.
    Full(Bytes, HeaderMap),
    /// Longer than the limit (it reached the first caller whole).
    TooLarge,
    /// The body failed midway.
    Failed(String),
}

impl Tee {
    pub(crate) fn new(limit: usize) -> Self {
        Self {
            limit,
            kept: BytesMut::new(),
            trailers: HeaderMap::new(),
            over: false,
        }
    }

    /// Keeps what the record needs of `frame`.
    pub(crate) fn keep(&mut self, frame: &Frame<Bytes>) {
        if let Some(data) = frame.data_ref() {
            if !self.over && self.kept.len() + data.len() > self.limit {
                self.over = true;
                self.kept = BytesMut::new();
            }
            if !self.over {
                self.kept.extend_from_slice(data);
            }
        } else if let Some(trailers) = frame.trailers_ref() {
            self.trailers.extend(trailers.clone());
        }
    }

    pub(crate) fn finish(self) -> Teed {
        if self.over {
            Teed::TooLarge
        } else {
            Teed::Full(self.kept.freeze(), self.trailers)
        }
    }
}
