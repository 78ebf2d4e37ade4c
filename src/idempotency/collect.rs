//! Reading a handler's response body for its record, up to a limit.

use std::{
    collections::VecDeque,
    pin::Pin,
    task::{Context, Poll, ready},
};

use bytes::{Bytes, BytesMut};
use http::{HeaderMap, Response, response};
use http_body::Body;

use super::body::ResponseBody;

const POLLED_AFTER_READY: &str = "idempotency response body polled after it was read";

/// Reads a response body for its record, up to a limit.
pub(crate) struct Collect<B: Body> {
    body: Option<Pin<Box<B>>>,
    head: Option<response::Parts>,
    chunks: VecDeque<Bytes>,
    size: usize,
    limit: usize,
    trailers: Option<HeaderMap>,
}

/// What reading a response body came to.
pub(crate) enum Collected<B: Body> {
    /// The whole body, within the limit: stored.
    Whole {
        head: response::Parts,
        data: Bytes,
        trailers: Option<HeaderMap>,
    },
    /// Too large, or failed mid-way: not stored; the response goes on with what was read.
    Partial(Response<ResponseBody<B>>),
}

impl<B> Collect<B>
where
    B: Body<Data = Bytes>,
{
    pub(crate) fn new(head: response::Parts, body: B, limit: usize) -> Self {
        Self {
            body: Some(Box::pin(body)),
            head: Some(head),
            chunks: VecDeque::new(),
            size: 0,
            limit,
            trailers: None,
        }
    }

    pub(crate) fn poll(&mut self, cx: &mut Context<'_>) -> Poll<Collected<B>> {
        let reading = self.body.as_mut().expect(POLLED_AFTER_READY);
        let error = loop {
            match ready!(reading.as_mut().poll_frame(cx)) {
                None => {
                    let head = self.head.take().expect(POLLED_AFTER_READY);
                    return Poll::Ready(Collected::Whole {
                        head,
                        data: concat(std::mem::take(&mut self.chunks)),
                        trailers: self.trailers.take(),
                    });
                }
                Some(Err(error)) => {
                    tracing::debug!("response body failed: not stored");
                    break Some(error);
                }
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(data) => {
                        self.size += data.len();
                        self.chunks.push_back(data);
                        if self.size > self.limit {
                            tracing::debug!(
                                limit = self.limit,
                                "response larger than max_response_body: not stored; a retry \
                                 runs again"
                            );
                            break None;
                        }
                    }
                    Err(frame) => {
                        if let Ok(more) = frame.into_trailers() {
                            self.trailers
                                .get_or_insert_with(HeaderMap::new)
                                .extend(more);
                        }
                    }
                },
            }
        };
        let head = self.head.take().expect(POLLED_AFTER_READY);
        let rest = self.body.take().expect(POLLED_AFTER_READY);
        let chunks = std::mem::take(&mut self.chunks);
        let body = ResponseBody::prefixed(chunks, error, rest);
        Poll::Ready(Collected::Partial(Response::from_parts(head, body)))
    }
}

fn concat(mut chunks: VecDeque<Bytes>) -> Bytes {
    match chunks.len() {
        0 => Bytes::new(),
        1 => chunks.pop_front().unwrap_or_default(),
        _ => {
            let mut all = BytesMut::with_capacity(chunks.iter().map(Bytes::len).sum());
            for chunk in chunks {
                all.extend_from_slice(&chunk);
            }
            all.freeze()
        }
    }
}
