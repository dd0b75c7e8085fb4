//! Bounded reading of response bodies.

use std::pin::Pin;
use std::task::{Context, Poll};

use axum_core::body::Body;
use bytes::{Bytes, BytesMut};
use http_body::Frame;
use http_body_util::BodyExt;
use idem_core::BoxError;

/// A response body read up to a limit.
pub(crate) enum Collected {
    /// The whole body.
    Full(Bytes),
    /// Over the limit: the body, still whole, to stream on.
    TooLarge(Body),
    /// The body failed mid-stream.
    Failed(String),
}

pub(crate) async fn collect_response<B>(body: B, limit: usize) -> Collected
where
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let mut body = Box::pin(body);
    let mut buf = BytesMut::new();
    loop {
        match body.frame().await {
            None => return Collected::Full(buf.freeze()),
            Some(Ok(frame)) => {
                let Ok(data) = frame.into_data() else { continue };
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
