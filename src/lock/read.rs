//! Reading a request body for its lock keys, for a layer whose key source reads the body
//! ([`JsonKeys`](crate::key::JsonKeys), [`BodyKeys`](crate::key::BodyKeys)).

use std::{pin::pin, sync::Arc};

use bytes::{Buf, BufMut, Bytes, BytesMut};
use http::{Request, header};
use http_body::Body;
use tower::BoxError;

use super::state::LockState;
use crate::{
    key::{KeyRejection, KeySet},
    store::BoxFuture,
};

/// A body being read: then the request, rebuilt with the same bytes, and its keys (`None`: pass
/// it through unlocked), or why it cannot be locked.
pub(crate) type Reading<B> = BoxFuture<Result<(Request<B>, Option<KeySet>), KeyRejection>>;

/// Starts reading `req`'s body, up to the layer's limit; refuses at once a body that declares
/// more (413).
pub(crate) fn read_keys<B>(
    state: Arc<LockState>,
    req: Request<B>,
) -> Result<Reading<B>, KeyRejection>
where
    B: Body + From<Bytes> + Send + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
{
    let (mut parts, body) = req.into_parts();
    let limit = state.max_body;
    let declared = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if declared.is_some_and(|len| len > limit as u64) || body.size_hint().lower() > limit as u64 {
        return Err(KeyRejection::body_too_large(limit));
    }
    Ok(Box::pin(async move {
        let bytes = collect(body, limit).await?;
        let keys = state.body_keys(&mut parts, &bytes)?;
        Ok((Request::from_parts(parts, B::from(bytes)), keys))
    }))
}

/// The body's data, up to `limit` bytes (trailers are dropped: the handler gets the bytes).
async fn collect<B>(body: B, limit: usize) -> Result<Bytes, KeyRejection>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    let mut body = pin!(body);
    let mut buf = BytesMut::new();
    while let Some(frame) = std::future::poll_fn(|cx| body.as_mut().poll_frame(cx)).await {
        let frame = frame.map_err(|error| {
            let error: BoxError = error.into();
            tracing::debug!(
                error = &*error as &dyn std::error::Error,
                "request body unreadable"
            );
            KeyRejection::invalid("the request body could not be read")
        })?;
        if let Ok(mut data) = frame.into_data() {
            if buf.len() + data.remaining() > limit {
                return Err(KeyRejection::body_too_large(limit));
            }
            while data.has_remaining() {
                let chunk = data.chunk();
                let n = chunk.len();
                buf.put_slice(chunk);
                data.advance(n);
            }
        }
    }
    Ok(buf.freeze())
}
