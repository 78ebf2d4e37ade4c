use std::{
    fmt,
    marker::PhantomData,
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
use crate::{
    key::{BodyKeySource, BodyKeys, IntoKeys, JsonKeys, KeySource},
    store::LockStore,
};

/// Middleware that locks each request's keys around the inner service.
///
/// Created by [`LockLayer`]; see the [crate docs](crate) for how a request flows through it.
/// `K` is the layer's: the key source's type. A [`KeySource`] reads the request head, and
/// the service takes any body; [`JsonKeys`] and [`BodyKeys`] read the body too, which must
/// then be built from `Bytes`.
pub struct LockService<S, K> {
    inner: S,
    state: Arc<LockState>,
    _keys: PhantomData<fn() -> K>,
}

impl<S, K: IntoKeys> LockService<S, K> {
    /// Wraps `inner` with the default config (see [`LockLayer::new`]).
    pub fn new(inner: S, store: impl LockStore, keys: K) -> Self {
        tower::Layer::layer(&LockLayer::new(store, keys), inner)
    }

    /// A [`LockLayer`] with the default config, the usual way to build this service.
    pub fn layer(store: impl LockStore, keys: K) -> LockLayer<K> {
        LockLayer::new(store, keys)
    }
}

impl<S, K> LockService<S, K> {
    pub(crate) fn from_state(inner: S, state: Arc<LockState>) -> Self {
        Self {
            inner,
            state,
            _keys: PhantomData,
        }
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

/// Keys from the head: the request goes on as it came, whatever its body.
impl<S, K, ReqBody, ResBody> Service<Request<ReqBody>> for LockService<S, K>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone,
    K: KeySource,
{
    type Response = Response<ResponseBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<S, ReqBody>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqBody>) -> Self::Future {
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

impl<S, K> LockService<S, K> {
    /// [`Service::call`] for a source that reads the body: the body is read (up to
    /// `max_request_body`) before anything else, then handed to the inner service as the same
    /// bytes.
    fn call_reading<ReqBody, ResBody>(
        &mut self,
        req: Request<ReqBody>,
    ) -> ResponseFuture<S, ReqBody>
    where
        S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone,
        ReqBody: Body + From<Bytes> + Send + 'static,
        ReqBody::Data: Send,
        ReqBody::Error: Into<BoxError>,
    {
        let state = Arc::clone(&self.state);
        match read_keys(Arc::clone(&state), req) {
            Ok(read) => ResponseFuture::reading(state, read, self.take_ready()),
            Err(rejection) => ResponseFuture::rejected(state.reject(rejection.into())),
        }
    }
}

/// Keys from fields of the JSON body: the body is read first (up to `max_request_body`), then
/// handed to the inner service as the same bytes.
impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for LockService<S, JsonKeys>
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
        self.call_reading(req)
    }
}

/// Keys from the head and the body: the body is read first (up to `max_request_body`), then
/// handed to the inner service as the same bytes.
impl<S, F, ReqBody, ResBody> Service<Request<ReqBody>> for LockService<S, BodyKeys<F>>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone,
    F: BodyKeySource,
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
        self.call_reading(req)
    }
}

impl<S: Clone, K> Clone for LockService<S, K> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            state: Arc::clone(&self.state),
            _keys: PhantomData,
        }
    }
}

impl<S: fmt::Debug, K> fmt::Debug for LockService<S, K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockService")
            .field("inner", &self.inner)
            .field("locker", &self.state.locker)
            .finish_non_exhaustive()
    }
}
