use std::{
    fmt,
    sync::Arc,
    task::{Context, Poll},
};

use http::{Request, Response};
use tower::Service;

use super::{body::ResponseBody, future::ResponseFuture, layer::LockLayer, state::LockState};
use crate::{key::KeySource, store::LockStore};

/// Middleware that locks each request's key around the inner service.
///
/// Created by [`LockLayer`]; see the [crate docs](crate) for how a request flows through it.
#[derive(Clone)]
pub struct LockService<S> {
    inner: S,
    state: Arc<LockState>,
}

impl<S> LockService<S> {
    /// Wraps `inner` with the default config (see [`LockLayer::new`]).
    pub fn new(inner: S, store: impl LockStore, key: impl KeySource) -> Self {
        tower::Layer::layer(&LockLayer::new(store, key), inner)
    }

    pub(crate) fn from_state(inner: S, state: Arc<LockState>) -> Self {
        Self { inner, state }
    }

    /// A [`LockLayer`] with the default config, the usual way to build this service.
    pub fn layer(store: impl LockStore, key: impl KeySource) -> LockLayer {
        LockLayer::new(store, key)
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
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for LockService<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone,
{
    type Response = Response<ResponseBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<S, ReqBody>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqBody>) -> Self::Future {
        let (mut parts, body) = req.into_parts();
        let key = self.state.key(&mut parts);
        let req = Request::from_parts(parts, body);
        match key {
            Ok(None) => ResponseFuture::unlocked(self.inner.call(req)),
            Err(rejection) => ResponseFuture::rejected(self.state.reject(rejection.into())),
            Ok(Some(key)) => {
                // Hand the future the instance that was polled ready (see tower's docs on
                // cloning inner services).
                let clone = self.inner.clone();
                let inner = std::mem::replace(&mut self.inner, clone);
                ResponseFuture::acquiring(Arc::clone(&self.state), key, inner, req)
            }
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
