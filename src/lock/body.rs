use std::{
    fmt,
    pin::Pin,
    task::{Context, Poll, ready},
};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

use crate::engine::{Hold, Release};

pin_project! {
    /// Response body of [`LockService`](super::LockService).
    ///
    /// The inner service's body, or the body of a rejection. With
    /// [`hold_until_body_end`](crate::LockLayer::hold_until_body_end) it also holds the lease:
    /// renewed in a background task while the body streams, released when the body ends (the
    /// end is reported only after the release), errors, or is dropped.
    pub struct ResponseBody<B> {
        #[pin]
        kind: Kind<B>,
        hold: Option<BodyHold>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<B> {
        Inner {
            #[pin]
            body: B,
        },
        Full {
            data: Option<Bytes>,
        },
    }
}

/// The lease, carried from the response future into the body (renewed in the background):
/// released when the body ends, or when it is dropped.
pub(crate) struct BodyHold {
    hold: Option<Hold>,
    releasing: Option<Release>,
}

impl BodyHold {
    pub(crate) fn new(hold: Hold) -> Self {
        Self {
            hold: Some(hold),
            releasing: None,
        }
    }
}

impl<B> ResponseBody<B> {
    pub(crate) fn new(body: B) -> Self {
        Self {
            kind: Kind::Inner { body },
            hold: None,
        }
    }

    pub(crate) fn holding(body: B, hold: BodyHold) -> Self {
        Self {
            kind: Kind::Inner { body },
            hold: Some(hold),
        }
    }

    pub(crate) fn full(data: Bytes) -> Self {
        Self {
            kind: Kind::Full {
                data: (!data.is_empty()).then_some(data),
            },
            hold: None,
        }
    }
}

impl<B> Body for ResponseBody<B>
where
    B: Body,
    B::Data: From<Bytes>,
{
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let mut this = self.project();
        loop {
            if let Some(release) = this.hold.as_mut().and_then(|h| h.releasing.as_mut()) {
                let _ = ready!(Pin::new(release).poll(cx));
                *this.hold = None;
                return Poll::Ready(None);
            }
            let frame = match this.kind.as_mut().project() {
                KindProj::Inner { body } => ready!(body.poll_frame(cx)),
                KindProj::Full { data } => data.take().map(|d| Ok(Frame::data(d.into()))),
            };
            match frame {
                None => match this.hold.as_mut() {
                    Some(BodyHold {
                        hold: held @ Some(_),
                        releasing,
                    }) => {
                        *releasing = held.take().map(Hold::release);
                    }
                    _ => return Poll::Ready(None),
                },
                Some(Err(error)) => {
                    // Dropping the hold releases in a spawned task.
                    *this.hold = None;
                    return Poll::Ready(Some(Err(error)));
                }
                Some(Ok(frame)) => return Poll::Ready(Some(Ok(frame))),
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        if self.hold.is_some() {
            return false;
        }
        match &self.kind {
            Kind::Inner { body } => body.is_end_stream(),
            Kind::Full { data } => data.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Inner { body } => body.size_hint(),
            Kind::Full { data } => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
        }
    }
}

impl<B> fmt::Debug for ResponseBody<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseBody")
            .field("holds_lease", &self.hold.is_some())
            .finish_non_exhaustive()
    }
}
