use std::{
    fmt,
    sync::Arc,
    task::{Context, Poll},
};

use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use tower::{BoxError, Service};

use super::{
    body::ResponseBody, future::ResponseFuture, layer::LockLayer, read::read_keys, state::LockState,
};
use crate::{key::IntoKeys, store::LockStore};

/// Middleware that locks each request's keys around the inner service.
///
/// Created by [`LockLayer`]; see the [crate docs](crate) for how a request flows through it. A
/// source that reads the body ([`Key::json`](crate::Key::json), [`Key::body`](crate::Key::body))
/// has it read first and handed on as the same bytes, so the request body must be one that can
/// be built from `Bytes` (axum's `Body` and `http_body_util::Full<Bytes>` are; map another, such
/// as hyper's `Incoming`, to axum's `Body` first). A source that reads the head leaves the body
/// as it came.
pub struct LockService<S> {
    inner: S,
    state: Arc<LockState>,
}

impl<S> LockService<S> {
    /// Wraps `inner` with the default config (see [`LockLayer::new`]).
    pub fn new(inner: S, store: impl LockStore, keys: impl IntoKeys) -> Self {
        tower::Layer::layer(&LockLayer::new(store, keys), inner)
    }

    /// A [`LockLayer`] with the default config, the usual way to build this service.
    pub fn layer(store: impl LockStore, keys: impl IntoKeys) -> LockLayer {
        LockLayer::new(store, keys)
    }

    pub(crate) fn from_state(inner: S, state: Arc<LockState>) -> Self {
        Self { inner, state }
    }

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The inner service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Consumes `self`, returning the inner service.
    pub fn into_inner(self) -> S {
        self.inner
    }

    /// The instance that was polled ready, for the response future (see tower's docs on
    /// cloning inner services), leaving a clone in its place.
    fn take_ready(&mut self) -> S
    where
        S: Clone,
    {
        let clone = self.inner.clone();
        std::mem::replace(&mut self.inner, clone)
    }
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for LockService<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone,
    ReqBody: Body + From<Bytes> + Send + 'static,
    ReqBody::Data: Send,
    ReqBody::Error: Into<BoxError>,
{
    type Response = Response<ResponseBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<S, ReqBody>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqBody>) -> Self::Future {
        if self.state.reads_body() {
            // The body is read (up to `max_request_body`) before anything else, then handed to
            // the inner service as the same bytes.
            let state = Arc::clone(&self.state);
            return match read_keys(Arc::clone(&state), req) {
                Ok(read) => ResponseFuture::reading(state, read, self.take_ready()),
                Err(rejection) => ResponseFuture::rejected(state.reject(rejection.into())),
            };
        }
        let (mut parts, body) = req.into_parts();
        let keys = self.state.keys(&mut parts);
        let req = Request::from_parts(parts, body);
        match keys {
            Ok(None) => ResponseFuture::unlocked(self.inner.call(req)),
            Err(rejection) => ResponseFuture::rejected(self.state.reject(rejection.into())),
            Ok(Some(keys)) => {
                let inner = self.take_ready();
                ResponseFuture::acquiring(Arc::clone(&self.state), keys, inner, req)
            }
        }
    }
}

impl<S: Clone> Clone for LockService<S> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            state: Arc::clone(&self.state),
        }
    }
}

impl<S: fmt::Debug> fmt::Debug for LockService<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockService")
            .field("inner", &self.inner)
            .field("locker", &self.state.locker)
            .finish_non_exhaustive()
    }
}
