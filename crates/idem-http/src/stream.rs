//! Streaming a response that is to be recorded to its first caller while it
//! is kept for the record (lease mode with `stream_responses`): the body
//! ends only after the outcome is settled, and a caller cut off sees an
//! error, never a short body taken for whole.

use axum_core::body::Body;
use bytes::Bytes;
use http::Response;
use idem_core::{Call, Record};

use crate::body::Chunk;
use crate::lease_mode::{Recording, StandIn, stand_in};
use crate::service::ByteBody;
use crate::service::{Decision, decide, first, whole_record};

/// The most bytes a declared body length may have for the body to be read
/// whole rather than streamed.
const WHOLE_BYTES: u64 = 16 * 1024;

/// Whether a response is answered whole even when responses stream: its
/// body declares an exact length of at most [`WHOLE_BYTES`] that fits the
/// record. A streamed body ends only after the record anyway, so its caller
/// sees the same response at the same moment, without frames handed from the
/// recording task to the connection one by one.
pub(crate) fn small_and_whole<B: http_body::Body>(response: &Response<B>, max_response_bytes: usize) -> bool {
    response
        .body()
        .size_hint()
        .exact()
        .is_some_and(|n| n <= WHOLE_BYTES && n <= max_response_bytes as u64)
}

/// How many frames the channel to the first caller holds; the frames behind
/// them wait in the recording task's queue, bounded in bytes.
const STREAM_FRAMES: usize = 16;

/// The frames a streamed response has read and not yet handed to its first
/// caller.
pub(crate) struct Behind {
    tx: tokio::sync::mpsc::Sender<Chunk>,
    frames: std::collections::VecDeque<http_body::Frame<Bytes>>,
    bytes: usize,
}

impl Behind {
    fn push(&mut self, frame: http_body::Frame<Bytes>) {
        self.bytes += frame.data_ref().map_or(0, Bytes::len);
        self.frames.push_back(frame);
    }

    fn pop(&mut self) -> Option<http_body::Frame<Bytes>> {
        let frame = self.frames.pop_front()?;
        self.bytes -= frame.data_ref().map_or(0, Bytes::len);
        Some(frame)
    }

    /// Sends the frames still queued, the last of them marked as the end
    /// (so the connection writes it with the end of the body), then `end`
    /// unless it was `Chunk::End` and went with the last frame.
    pub(crate) async fn finish(mut self, stall: std::time::Duration, end: Chunk) {
        let mut end = Some(end);
        while let Some(chunk) = match self.pop() {
            Some(frame) if self.frames.is_empty() && matches!(end, Some(Chunk::End)) => {
                end = None;
                Some(Chunk::Last(frame))
            }
            Some(frame) => Some(Chunk::Frame(frame)),
            None => end.take(),
        } {
            if !matches!(tokio::time::timeout(stall, self.tx.send(chunk)).await, Ok(Ok(()))) {
                return;
            }
        }
    }
}

/// Streams a response that is to be recorded to its first caller (through
/// `answer`) while keeping it for the record. The body is read at its own
/// pace while the frames the caller has not taken yet fit in
/// `max_response_bytes` (so a body that fits the record is read whole
/// however slow the caller), then at the caller's; a caller that takes
/// nothing for `stall` is cut off (its body ends in an error).
/// Returns the record and what is still to be sent to the caller once the
/// outcome is settled (its last frames and the end).
pub(crate) async fn stream_and_record<ResBody, E>(
    recording: &Recording,
    call: &Call,
    streaming: crate::layer::Streaming,
    response: Response<ResBody>,
    answer: tokio::sync::oneshot::Sender<Result<Response<Body>, E>>,
) -> (Record, Option<Behind>)
where
    ResBody: ByteBody,
{
    use http_body_util::BodyExt;

    let (rparts, rbody) = response.into_parts();
    let status = rparts.status;
    let headers = rparts.headers.clone();
    let rejected = matches!(decide(status, call), Decision::RecordRejection);
    let (tx, chunks) = tokio::sync::mpsc::channel(STREAM_FRAMES);
    let streamed = crate::body::Streamed::new(chunks, rbody.size_hint().exact());
    let mut caller = answer
        .send(Ok(first(rparts, Body::new(streamed))))
        .is_ok()
        .then(|| Behind {
            tx,
            frames: std::collections::VecDeque::new(),
            bytes: 0,
        });
    let mut tee = crate::body::Tee::new(recording.max_response_bytes);
    let mut body = std::pin::pin!(rbody);
    let mut progress = tokio::time::Instant::now();
    let queue_limit = recording.max_response_bytes.max(1);
    let teed = loop {
        let waiting = caller.as_ref().is_some_and(|c| !c.frames.is_empty());
        // A full queue waits for the caller (who is cut off after `stall`).
        let full = caller.as_ref().is_some_and(|c| c.bytes >= queue_limit);
        let sender = caller.as_ref().filter(|_| waiting).map(|c| c.tx.clone());
        tokio::select! {
            biased;
            // The body's error type need not be Send: it is turned into
            // words before anything else is awaited.
            next = body.frame(), if !full => match next.map(|r| r.map_err(|e| e.into().to_string())) {
                None => break tee.finish(),
                Some(Ok(frame)) => {
                    tee.keep(&frame);
                    // Trailers and a frame the body says is its last go out
                    // with the end, after the record.
                    let last = frame.is_trailers() || body.is_end_stream();
                    if let Some(c) = &mut caller {
                        if c.frames.is_empty() {
                            progress = tokio::time::Instant::now();
                        }
                        c.push(frame);
                    }
                    if last {
                        break tee.finish();
                    }
                }
                Some(Err(why)) => break crate::body::Teed::Failed(why),
            },
            permit = async { sender.expect("waiting").reserve_owned().await }, if waiting => {
                let c = caller.as_mut().expect("waiting");
                match permit {
                    Ok(permit) => {
                        permit.send(Chunk::Frame(c.pop().expect("waiting")));
                        progress = tokio::time::Instant::now();
                    }
                    Err(_) => caller = None,
                }
            },
            () = tokio::time::sleep_until(progress + streaming.stall), if waiting => {
                tracing::warn!(
                    stall_ms = streaming.stall.as_millis() as u64,
                    "the first caller took nothing in time; its response is cut off and the recording goes on"
                );
                caller = None;
            },
        }
    };
    let record = match teed {
        crate::body::Teed::Full(body, trailers) => {
            whole_record(status, &headers, &body, &trailers, rejected, &recording.private_headers)
        }
        crate::body::Teed::TooLarge => stand_in(recording, status, StandIn::TooLarge).0,
        crate::body::Teed::Failed(why) => {
            tracing::warn!(%why, "response body failed after the handler ran");
            // The frames read before the failure, then the error; dropping
            // the sender cuts the caller off with an error even when this
            // does not fit in time.
            if let Some(c) = caller.take() {
                c.finish(streaming.stall, Chunk::Failed(why.clone())).await;
            }
            stand_in(recording, status, StandIn::Failed(why)).0
        }
    };
    (record, caller)
}
