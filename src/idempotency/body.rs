use std::{
    collections::VecDeque,
    fmt,
    pin::Pin,
    task::{Context, Poll, ready},
};

use bytes::Bytes;
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

pin_project! {
    /// Response body of [`IdempotencyService`](super::IdempotencyService).
    ///
    /// A replayed or rejected response's bytes; the handler's body read to its end (the
    /// response that was stored, or too large to store was not); or the handler's body as
    /// it streams, for requests passed through.
    pub struct ResponseBody<B: Body> {
        #[pin]
        kind: Kind<B, B::Error>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<B, E> {
        Full {
            data: Option<Bytes>,
            trailers: Option<HeaderMap>,
        },
        Inner {
            #[pin]
            body: B,
        },
        // What was read while trying to store it, then the rest of the body (or the error that
        // stopped the reading).
        Prefixed {
            chunks: VecDeque<Bytes>,
            error: Option<E>,
            rest: Pin<Box<B>>,
            rest_done: bool,
        },
    }
}

impl<B: Body> ResponseBody<B> {
    pub(crate) fn full(data: Bytes) -> Self {
        Self::full_with_trailers(data, None)
    }

    pub(crate) fn full_with_trailers(data: Bytes, trailers: Option<HeaderMap>) -> Self {
        Self {
            kind: Kind::Full {
                data: (!data.is_empty()).then_some(data),
                trailers,
            },
        }
    }

    pub(crate) fn inner(body: B) -> Self {
        Self {
            kind: Kind::Inner { body },
        }
    }

    /// `chunks` first, then `error` if there is one, else the rest of `rest`.
    pub(crate) fn prefixed(
        chunks: VecDeque<Bytes>,
        error: Option<B::Error>,
        rest: Pin<Box<B>>,
    ) -> Self {
        let rest_done = error.is_some();
        Self {
            kind: Kind::Prefixed {
                chunks,
                error,
                rest,
                rest_done,
            },
        }
    }
}

impl<B> Body for ResponseBody<B>
where
    B: Body<Data = Bytes>,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        match self.project().kind.project() {
            KindProj::Full { data, trailers } => Poll::Ready(match data.take() {
                Some(data) => Some(Ok(Frame::data(data))),
                None => trailers.take().map(|t| Ok(Frame::trailers(t))),
            }),
            KindProj::Inner { body } => body.poll_frame(cx),
            KindProj::Prefixed {
                chunks,
                error,
                rest,
                rest_done,
            } => {
                if let Some(chunk) = chunks.pop_front() {
                    return Poll::Ready(Some(Ok(Frame::data(chunk))));
                }
                if let Some(error) = error.take() {
                    return Poll::Ready(Some(Err(error)));
                }
                if *rest_done {
                    return Poll::Ready(None);
                }
                let frame = ready!(rest.as_mut().poll_frame(cx));
                if !matches!(frame, Some(Ok(_))) {
                    *rest_done = true;
                }
                Poll::Ready(frame)
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Full { data, trailers } => data.is_none() && trailers.is_none(),
            Kind::Inner { body } => body.is_end_stream(),
            Kind::Prefixed {
                chunks,
                error,
                rest,
                rest_done,
            } => chunks.is_empty() && error.is_none() && (*rest_done || rest.is_end_stream()),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Full { data, .. } => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
            Kind::Inner { body } => body.size_hint(),
            Kind::Prefixed {
                chunks,
                rest,
                rest_done,
                ..
            } => {
                let buffered: u64 = chunks.iter().map(|c| c.len() as u64).sum();
                if *rest_done {
                    return SizeHint::with_exact(buffered);
                }
                let rest = rest.size_hint();
                let mut hint = SizeHint::new();
                hint.set_lower(rest.lower() + buffered);
                if let Some(upper) = rest.upper() {
                    hint.set_upper(upper + buffered);
                }
                hint
            }
        }
    }
}

impl<B: Body> fmt::Debug for ResponseBody<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match &self.kind {
            Kind::Full { .. } => "full",
            Kind::Inner { .. } => "inner",
            Kind::Prefixed { .. } => "prefixed",
        };
        f.debug_struct("ResponseBody")
            .field("kind", &kind)
            .finish_non_exhaustive()
    }
}
