use std::{
    fmt,
    sync::Arc,
    task::{Context, Poll},
};

use bytes::Bytes;
use http::{Request, Response, header};
use http_body::Body;
use tower::{BoxError, Service};

use super::{
    body::ResponseBody,
    error::IdempotencyError,
    future::{Begun, ResponseFuture},
    layer::IdempotencyLayer,
    principal::Principal,
    state::IdempotencyState,
    store::IdempotencyStore,
};

/// Middleware giving each request with an `Idempotency-Key` one run and a replayed response.
///
/// Created by [`IdempotencyLayer`]; see the [module docs](super) for how a request flows.
///
/// The request body is buffered (to fingerprint it) and handed to the inner service as the same
/// body type, rebuilt with `From<Bytes>` (which `axum::body::Body` implements).
#[derive(Clone)]
pub struct IdempotencyService<S> {
    inner: S,
    state: Arc<IdempotencyState>,
}

impl<S> IdempotencyService<S> {
    /// Wraps `inner`, scoping keys by `principal`, with the default config (see
    /// [`IdempotencyLayer::new`]).
    pub fn new<St: IdempotencyStore>(inner: S, store: St, principal: impl Principal) -> Self {
        tower::Layer::layer(&IdempotencyLayer::new(store, principal), inner)
    }

    pub(crate) fn from_state(inner: S, state: Arc<IdempotencyState>) -> Self {
        Self { inner, state }
    }

    /// An [`IdempotencyLayer`] with the default config, the usual way to build this service.
    pub fn layer<St: IdempotencyStore>(store: St, principal: impl Principal) -> IdempotencyLayer {
        IdempotencyLayer::new(store, principal)
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

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for IdempotencyService<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone,
    ReqBody: Body + From<Bytes>,
    ReqBody::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes>,
{
    type Response = Response<ResponseBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<S, ReqBody, ResBody>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqBody>) -> Self::Future {
        let (parts, body) = req.into_parts();
        let state = Arc::clone(&self.state);
        let (key, idempotency_key) = match state.begin(&parts) {
            Ok(Some(keys)) => keys,
            Ok(None) => {
                return ResponseFuture::passthrough(
                    state,
                    self.inner.call(Request::from_parts(parts, body)),
                );
            }
            Err(error) => {
                let response = state.reject(error);
                return ResponseFuture::rejected(state, response);
            }
        };
        let limit = state.config.max_request_body;
        let declared = parts
            .headers
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
        if declared.is_some_and(|len| len > limit as u64) || body.size_hint().lower() > limit as u64
        {
            let response = state.reject(IdempotencyError::BodyTooLarge { limit });
            return ResponseFuture::rejected(state, response);
        }
        // Hand the future the instance that was polled ready.
        let clone = self.inner.clone();
        let service = std::mem::replace(&mut self.inner, clone);
        ResponseFuture::reading(
            state,
            Begun {
                service,
                parts,
                key,
                idempotency_key,
            },
            body,
        )
    }
}

impl<S: fmt::Debug> fmt::Debug for IdempotencyService<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyService")
            .field("inner", &self.inner)
            .field("config", &self.state.config)
            .finish_non_exhaustive()
    }
}
