//! A finished request's stored response, and its encoding.

use bytes::{Buf, BufMut, Bytes, BytesMut};
use http::{HeaderName, HeaderValue, Response, StatusCode};

/// Leads every encoded record; a change of layout changes it.
const MAGIC: &[u8; 4] = b"TLI1";

/// What is stored for a finished request: its fingerprint and its response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Record {
    pub(crate) fingerprint: [u8; 32],
    pub(crate) status: StatusCode,
    pub(crate) headers: Vec<(HeaderName, HeaderValue)>,
    pub(crate) body: Bytes,
}

impl Record {
    /// `MAGIC`, fingerprint, status (u16), header count (u16), each header as name length (u16),
    /// name, value length (u32), value; then the body to the end.
    pub(crate) fn encode(&self) -> Bytes {
        let headers: usize = self
            .headers
            .iter()
            .map(|(n, v)| 6 + n.as_str().len() + v.len())
            .sum();
        let mut out = BytesMut::with_capacity(4 + 32 + 4 + headers + self.body.len());
        out.put_slice(MAGIC);
        out.put_slice(&self.fingerprint);
        out.put_u16(self.status.as_u16());
        out.put_u16(u16::try_from(self.headers.len()).unwrap_or(u16::MAX));
        for (name, value) in self.headers.iter().take(usize::from(u16::MAX)) {
            out.put_u16(name.as_str().len() as u16);
            out.put_slice(name.as_str().as_bytes());
            out.put_u32(value.len() as u32);
            out.put_slice(value.as_bytes());
        }
        out.put_slice(&self.body);
        out.freeze()
    }

    /// `None` for anything that is not a record this version wrote.
    pub(crate) fn decode(mut raw: Bytes) -> Option<Self> {
        fn take(raw: &mut Bytes, n: usize) -> Option<Bytes> {
            (raw.remaining() >= n).then(|| raw.split_to(n))
        }
        if take(&mut raw, 4)?.as_ref() != MAGIC {
            return None;
        }
        let fingerprint = take(&mut raw, 32)?.as_ref().try_into().ok()?;
        let status = StatusCode::from_u16(take(&mut raw, 2)?.get_u16()).ok()?;
        let count = take(&mut raw, 2)?.get_u16();
        let mut headers = Vec::with_capacity(usize::from(count));
        for _ in 0..count {
            let len = take(&mut raw, 2)?.get_u16();
            let name = HeaderName::from_bytes(&take(&mut raw, usize::from(len))?).ok()?;
            let len = take(&mut raw, 4)?.get_u32();
            let value = HeaderValue::from_maybe_shared(take(&mut raw, len as usize)?).ok()?;
            headers.push((name, value));
        }
        Some(Self {
            fingerprint,
            status,
            headers,
            body: raw,
        })
    }

    /// The replayed response, marked `Idempotent-Replayed: true`.
    pub(crate) fn replay(self) -> Response<Bytes> {
        let mut response = Response::new(self.body);
        *response.status_mut() = self.status;
        let headers = response.headers_mut();
        for (name, value) in self.headers {
            headers.append(name, value);
        }
        headers.insert(
            HeaderName::from_static("idempotent-replayed"),
            HeaderValue::from_static("true"),
        );
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_garbage() {
        let record = Record {
            fingerprint: [7; 32],
            status: StatusCode::CREATED,
            headers: vec![
                (
                    http::header::CONTENT_TYPE,
                    HeaderValue::from_static("application/json"),
                ),
                (http::header::LINK, HeaderValue::from_static("</a>")),
                (http::header::LINK, HeaderValue::from_static("</b>")),
            ],
            body: Bytes::from_static(b"{\"id\":1}"),
        };
        let encoded = record.encode();
        assert_eq!(Record::decode(encoded.clone()).unwrap(), record);
        for cut in 0..40 {
            assert_eq!(Record::decode(encoded.slice(..cut)), None, "cut at {cut}");
        }
        assert_eq!(Record::decode(Bytes::from_static(b"something else")), None);
        let replayed = record.replay();
        assert_eq!(replayed.status(), 201);
        assert_eq!(replayed.headers()["idempotent-replayed"], "true");
        assert_eq!(replayed.headers().get_all("link").iter().count(), 2);
        assert_eq!(replayed.body(), "{\"id\":1}");
    }
}
