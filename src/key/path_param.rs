use std::{
    future::Future,
    pin::pin,
    sync::Arc,
    task::{Context, Poll, Waker},
};

use axum::extract::{FromRequestParts, RawPathParams, rejection::RawPathParamsRejection};
use bytes::Bytes;
use http::request::Parts;

use super::{KeyRejection, KeySource};

/// Locks on a path parameter of the matched axum route.
/// Created by [`Key::path_param`](super::Key::path_param).
#[derive(Debug, Clone)]
pub struct PathParamKey {
    name: Arc<str>,
}

impl PathParamKey {
    pub(super) fn new(name: Arc<str>) -> Self {
        Self { name }
    }

    fn no_params(&self) -> KeyRejection {
        KeyRejection::misconfigured(format!(
            "the lock key is the path parameter `{}`, but the request has no path parameters: \
             it matched no route, or the LockLayer wraps the router from outside; add the \
             LockLayer with `route_layer`",
            self.name
        ))
    }
}

impl KeySource for PathParamKey {
    fn key(&self, parts: &mut Parts) -> Result<Option<Bytes>, KeyRejection> {
        // `RawPathParams` reads an extension axum's router sets; its future is ready at once.
        let mut fut = pin!(RawPathParams::from_request_parts(parts, &()));
        let params = match fut.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
            Poll::Ready(Ok(params)) => params,
            Poll::Ready(Err(RawPathParamsRejection::InvalidUtf8InPathParam(e))) => {
                return Err(KeyRejection::invalid(e.body_text()));
            }
            Poll::Ready(Err(_)) | Poll::Pending => return Err(self.no_params()),
        };
        if let Some((_, value)) = params.iter().find(|(name, _)| *name == &*self.name) {
            return Ok(Some(Bytes::copy_from_slice(value.as_bytes())));
        }
        if params.iter().next().is_none() {
            return Err(self.no_params());
        }
        Err(KeyRejection::misconfigured(format!(
            "the route has no path parameter `{}` to use as the lock key",
            self.name
        )))
    }
}
