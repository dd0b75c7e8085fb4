//! The stored form of a recorded HTTP response.
//!
//! Layout (all integers big-endian): the magic `IDH1`, the status (u16), the
//! header count (u32), then per header its name and value each as a u32
//! length and bytes, then the body as a u64 length and bytes. A response with
//! trailers is recorded as `IDH2`: the same, followed by the trailers in the
//! headers' layout (count, then names and values). A binary layout keeps
//! bodies byte-identical without any re-encoding.

use std::borrow::Cow;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode, header};

const MAGIC: &[u8; 4] = b"IDH1";
const MAGIC_TRAILERS: &[u8; 4] = b"IDH2";

/// Headers never recorded or replayed besides the hop-by-hop ones: framing
/// that is recomputed, and the replay marker itself.
fn is_unrecorded(name: &HeaderName) -> bool {
    matches!(name.as_str(), "content-length" | "idempotent-replayed")
}

/// A response as recorded under a key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordedResponse {
    /// The status code.
    pub status: StatusCode,
    /// The end-to-end headers.
    pub headers: HeaderMap,
    /// The body, byte for byte.
    pub body: Bytes,
    /// The trailers sent after the body (usually none).
    pub trailers: HeaderMap,
}

impl RecordedResponse {
    /// Encodes the response, dropping headers that must not be replayed: the
    /// hop-by-hop ones (see [`strip_hop_by_hop`](crate::strip_hop_by_hop)),
    /// `Content-Length` (recomputed) and `Idempotent-Replayed`.
    pub fn encode(&self) -> Vec<u8> {
        encode(self.status, &self.headers, &self.body, &self.trailers, &[])
    }

    /// Decodes a recorded response; fails on anything malformed.
    pub fn decode(bytes: &[u8]) -> Result<Self, String> {
        Self::decode_shared(Bytes::copy_from_slice(bytes))
    }

    /// Decodes a recorded response held in `bytes` without copying its body
    /// or header values: they share the buffer (a replay sends the record's
    /// own bytes). Fails on anything malformed.
    pub fn decode_shared(shared: Bytes) -> Result<Self, String> {
        let bytes: &[u8] = &shared;
        let mut r = Reader {
            bytes,
            shared: &shared,
            pos: 0,
        };
        let has_trailers = match r.take(4)? {
            m if m == MAGIC => false,
            m if m == MAGIC_TRAILERS => true,
            _ => return Err("not a recorded HTTP response".into()),
        };
        let status = u16::from_be_bytes(r.array()?);
        let status = StatusCode::from_u16(status).map_err(|e| e.to_string())?;
        let headers = r.fields()?;
        let len = u64::from_be_bytes(r.array()?);
        let len = usize::try_from(len).map_err(|e| e.to_string())?;
        let body = r.take_shared(len)?;
        let trailers = if has_trailers { r.fields()? } else { HeaderMap::new() };
        if r.pos != bytes.len() {
            return Err("trailing bytes after the recorded response".into());
        }
        Ok(Self {
            status,
            headers,
            body,
            trailers,
        })
    }

    /// The response to send for a replay: the recorded status, headers and
    /// body plus `Idempotent-Replayed: true`.
    pub fn into_replay(self) -> http::Response<axum_core::body::Body> {
        let mut response = http::Response::new(crate::body::with_trailers(self.body, self.trailers));
        *response.status_mut() = self.status;
        *response.headers_mut() = self.headers;
        response
            .headers_mut()
            .insert(crate::IDEMPOTENT_REPLAYED.clone(), HeaderValue::from_static("true"));
        response.headers_mut().remove(header::CONTENT_LENGTH);
        response
    }
}

/// Encodes a response as [`RecordedResponse::encode`] does, leaving out the
/// `private` headers too, without taking the header maps.
pub(crate) fn encode(
    status: StatusCode,
    headers: &HeaderMap,
    body: &[u8],
    trailers: &HeaderMap,
    private: &[HeaderName],
) -> Vec<u8> {
    let headers = recordable(headers, private);
    let trailers = recordable(trailers, private);
    let kept: Vec<_> = headers.iter().filter(|(n, _)| !is_unrecorded(n)).collect();
    let trailers: Vec<_> = trailers.iter().filter(|(n, _)| !is_unrecorded(n)).collect();
    let mut out = Vec::with_capacity(16 + body.len() + (kept.len() + trailers.len()) * 32);
    out.extend_from_slice(if trailers.is_empty() { MAGIC } else { MAGIC_TRAILERS });
    out.extend_from_slice(&status.as_u16().to_be_bytes());
    write_fields(&mut out, &kept);
    out.extend_from_slice(&(body.len() as u64).to_be_bytes());
    out.extend_from_slice(body);
    if !trailers.is_empty() {
        write_fields(&mut out, &trailers);
    }
    out
}

/// The fields of `fields` that may be recorded, less the unrecorded framing
/// headers (filtered by the caller). Most responses carry no hop-by-hop or
/// private header: those are borrowed as they are. Otherwise the fields are
/// copied and the headers removed from the copy.
fn recordable<'m>(fields: &'m HeaderMap, private: &[HeaderName]) -> Cow<'m, HeaderMap> {
    let clean =
        fields.keys().all(|n| !crate::headers::is_hop_by_hop(n)) && private.iter().all(|n| !fields.contains_key(n));
    if clean {
        return Cow::Borrowed(fields);
    }
    let mut fields = fields.clone();
    for name in private {
        fields.remove(name);
    }
    crate::headers::strip_hop_by_hop(&mut fields);
    Cow::Owned(fields)
}

fn write_fields(out: &mut Vec<u8>, fields: &[(&HeaderName, &HeaderValue)]) {
    out.extend_from_slice(&(fields.len() as u32).to_be_bytes());
    for (name, value) in fields {
        out.extend_from_slice(&(name.as_str().len() as u32).to_be_bytes());
        out.extend_from_slice(name.as_str().as_bytes());
        out.extend_from_slice(&(value.as_bytes().len() as u32).to_be_bytes());
        out.extend_from_slice(value.as_bytes());
    }
}

struct Reader<'a> {
    bytes: &'a [u8],
    /// The same bytes, to share slices of.
    shared: &'a Bytes,
    pos: usize,
}

impl<'a> Reader<'a> {
    /// The next `n` bytes as a slice of the shared buffer (no copy).
    fn take_shared(&mut self, n: usize) -> Result<Bytes, String> {
        let start = self.pos;
        self.take(n)?;
        Ok(self.shared.slice(start..self.pos))
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.bytes.len())
            .ok_or("truncated record")?;
        let out = &self.bytes[self.pos..end];
        self.pos = end;
        Ok(out)
    }

    fn fields(&mut self) -> Result<HeaderMap, String> {
        let count = u32::from_be_bytes(self.array()?);
        let mut fields = HeaderMap::new();
        for _ in 0..count {
            let len = u32::from_be_bytes(self.array()?) as usize;
            let name = HeaderName::from_bytes(self.take(len)?).map_err(|e| e.to_string())?;
            let len = u32::from_be_bytes(self.array()?) as usize;
            let value = HeaderValue::from_maybe_shared(self.take_shared(len)?).map_err(|e| e.to_string())?;
            fields.append(name, value);
        }
        Ok(fields)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], String> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A replay's body is the record's own bytes, not a copy of them.
    #[test]
    fn decode_shared_keeps_the_body_in_the_record() {
        let mut headers = HeaderMap::new();
        headers.insert("content-type", HeaderValue::from_static("application/json"));
        let response = RecordedResponse {
            status: StatusCode::CREATED,
            headers,
            body: Bytes::from(vec![b'x'; 4096]),
            trailers: HeaderMap::new(),
        };
        let record = Bytes::from(response.encode());
        let decoded = RecordedResponse::decode_shared(record.clone()).unwrap();
        assert_eq!(decoded, response);
        assert!(
            record.as_ptr_range().contains(&decoded.body.as_ptr()),
            "the body was copied out of the record"
        );
        assert_eq!(RecordedResponse::decode(&record).unwrap(), response);
        assert!(RecordedResponse::decode_shared(record.slice(..record.len() - 1)).is_err());
    }

    #[test]
    fn round_trips_and_drops_hop_by_hop() {
        let mut headers = HeaderMap::new();
        headers.insert("content-type", HeaderValue::from_static("application/json"));
        headers.append("x-multi", HeaderValue::from_static("a"));
        headers.append("x-multi", HeaderValue::from_static("b"));
        headers.insert("connection", HeaderValue::from_static("close, x-hop"));
        headers.insert("x-hop", HeaderValue::from_static("1"));
        headers.insert("proxy-authenticate", HeaderValue::from_static("Basic"));
        headers.insert("content-length", HeaderValue::from_static("3"));
        let r = RecordedResponse {
            status: StatusCode::CREATED,
            headers,
            body: Bytes::from_static(b"\x00\xffz"),
            trailers: HeaderMap::new(),
        };
        let back = RecordedResponse::decode(&r.encode()).unwrap();
        assert_eq!(back.status, StatusCode::CREATED);
        assert_eq!(back.body, r.body);
        assert_eq!(back.headers.get_all("x-multi").iter().count(), 2);
        assert!(back.headers.get("connection").is_none());
        assert!(back.headers.get("x-hop").is_none(), "named in Connection");
        assert!(back.headers.get("proxy-authenticate").is_none());
        assert!(back.headers.get("content-length").is_none());
    }

    // Private and hop-by-hop headers are left out of the record whether the
    // maps are borrowed as they are or copied and stripped.
    #[test]
    fn private_headers_are_left_out() {
        let mut headers = HeaderMap::new();
        headers.insert("content-type", HeaderValue::from_static("application/json"));
        headers.insert("set-cookie", HeaderValue::from_static("session=1"));
        let mut trailers = HeaderMap::new();
        trailers.insert("x-checksum", HeaderValue::from_static("abc"));
        let private = [HeaderName::from_static("set-cookie")];
        let encoded = encode(StatusCode::OK, &headers, b"{}", &trailers, &private);
        let back = RecordedResponse::decode(&encoded).unwrap();
        assert!(back.headers.get("set-cookie").is_none());
        assert_eq!(back.headers.get("content-type").unwrap(), "application/json");
        assert_eq!(back.trailers.get("x-checksum").unwrap(), "abc");
        // Nothing to leave out: the same bytes as the whole response's encoding.
        headers.remove("set-cookie");
        let clean = encode(StatusCode::OK, &headers, b"{}", &trailers, &private);
        assert_eq!(clean, encoded);
        headers.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        assert_eq!(encode(StatusCode::OK, &headers, b"{}", &trailers, &private), encoded);
    }

    #[test]
    fn trailers_round_trip_and_old_records_still_decode() {
        let mut trailers = HeaderMap::new();
        trailers.insert("grpc-status", HeaderValue::from_static("0"));
        let r = RecordedResponse {
            status: StatusCode::OK,
            headers: HeaderMap::new(),
            body: Bytes::from_static(b"ok"),
            trailers,
        };
        let encoded = r.encode();
        assert_eq!(&encoded[..4], b"IDH2");
        assert_eq!(RecordedResponse::decode(&encoded).unwrap(), r);
        let plain = RecordedResponse {
            trailers: HeaderMap::new(),
            ..r
        }
        .encode();
        assert_eq!(&plain[..4], b"IDH1", "without trailers the format is unchanged");
        assert!(RecordedResponse::decode(&plain).unwrap().trailers.is_empty());
    }

    #[test]
    fn rejects_garbage() {
        assert!(RecordedResponse::decode(b"").is_err());
        assert!(RecordedResponse::decode(b"IDH1\x00").is_err());
        let mut ok = RecordedResponse {
            status: StatusCode::OK,
            headers: HeaderMap::new(),
            body: Bytes::new(),
            trailers: HeaderMap::new(),
        }
        .encode();
        ok.push(0);
        assert!(RecordedResponse::decode(&ok).is_err());
    }
}
