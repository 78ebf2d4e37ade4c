use std::{
    future::Future,
    pin::pin,
    sync::Arc,
    task::{Context, Poll, Waker},
};

use axum::extract::{
    FromRequestParts, MatchedPath, RawPathParams, rejection::RawPathParamsRejection,
};
use bytes::Bytes;
use http::request::Parts;

use super::{KeyRejection, KeySource, KeyValues, into::sealed::Routed};

/// Locks on a path parameter of the matched axum route.
/// Created by [`Key::path_param`](super::Key::path_param).
///
/// | the request | answer |
/// |---|---|
/// | matched a route with the parameter | lock on its percent-decoded value |
/// | matched a route without it | 500 (a typo), or unlocked when [`optional`](Self::optional) |
/// | matched no route (the router's fallback answers) | unlocked: the router's 404 stands |
/// | the parameter is not UTF-8 once percent-decoded | 400 |
/// | was never routed (the layer wraps the router from outside) | 500 |
///
/// axum's router keeps the parameters in an extension its extractor reads only from a
/// `&mut Parts`. A layer built with this source reads them in place; a source of your own
/// that calls this one's [`KeySource::keys`] (on a `&Parts`) makes it read them from a copy
/// of the request's extensions, which costs that copy, and answers the same.
#[derive(Debug, Clone)]
pub struct PathParamKey {
    name: Arc<str>,
    optional: bool,
}

impl PathParamKey {
    pub(super) fn new(name: Arc<str>) -> Self {
        Self {
            name,
            optional: false,
        }
    }

    /// Passes requests of routes that have no such parameter through unlocked, instead of
    /// answering 500.
    ///
    /// For a layer that wraps routes with and without the parameter (`Router::layer` over
    /// `/items/{sku}` and `/health`). Without it, a route lacking the parameter is taken for a
    /// typo in its name.
    #[must_use]
    pub fn optional(mut self) -> Self {
        self.optional = true;
        self
    }
}

/// The request's path parameters, percent-decoded by axum's router: `None` if no axum router
/// has routed the request, a 400 if a parameter is not UTF-8 once decoded.
pub(super) fn path_params(parts: &mut Parts) -> Result<Option<RawPathParams>, KeyRejection> {
    // `RawPathParams` reads an extension axum's router sets (a type private to axum, hence the
    // `&mut Parts`); its future is ready at once.
    let mut fut = pin!(RawPathParams::from_request_parts(parts, &()));
    match fut.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(Ok(params)) => Ok(Some(params)),
        Poll::Ready(Err(RawPathParamsRejection::InvalidUtf8InPathParam(e))) => {
            Err(KeyRejection::invalid(e.body_text()))
        }
        Poll::Ready(Err(_)) | Poll::Pending => Ok(None),
    }
}

/// [`path_params`] from a shared head: read from a scratch head that holds a copy of the
/// request's extensions (the only part axum's extractor reads). What a source called from
/// [`KeySource::keys`] pays; a layer built with the source itself reads the request's own.
pub(super) fn path_params_of(parts: &Parts) -> Result<Option<RawPathParams>, KeyRejection> {
    let mut scratch = http::Request::new(()).into_parts().0;
    scratch.extensions = parts.extensions.clone();
    path_params(&mut scratch)
}

impl PathParamKey {
    /// The parameter's value among `params` (`None`: no axum router routed the request).
    fn value(
        &self,
        parts: &Parts,
        params: Option<&RawPathParams>,
    ) -> Result<Option<Bytes>, KeyRejection> {
        let Some(params) = params else {
            // A request without a path (`CONNECT host:port`) cannot match any route.
            if parts.uri.path().is_empty() {
                return Ok(None);
            }
            return Err(KeyRejection::misconfigured(format!(
                "the lock key is the path parameter `{}`, but no axum router has routed the \
                 request: the LockLayer wraps the router from outside; add it with \
                 `route_layer` or `layer` on the router",
                self.name
            )));
        };
        if let Some((_, value)) = params.iter().find(|(name, _)| *name == &*self.name) {
            return Ok(Some(Bytes::copy_from_slice(value.as_bytes())));
        }
        // Routed, but with no matched route: the router's fallback (a 404) is answering, or a
        // service nested with `nest_service` (axum marks both alike). Nothing to lock.
        if parts.extensions.get::<MatchedPath>().is_none() || self.optional {
            return Ok(None);
        }
        Err(KeyRejection::misconfigured(format!(
            "the route has no path parameter `{}` to use as the lock key (if some routes under \
             this layer have none, make the key source `optional`)",
            self.name
        )))
    }
}

/// Called from a source of your own, this reads the parameters from a copy of the request's
/// extensions (axum's extractor needs `&mut Parts`); a layer built with the source itself
/// reads them in place, without the copy.
impl KeySource for PathParamKey {
    fn keys(&self, parts: &Parts) -> Result<Option<KeyValues>, KeyRejection> {
        let params = path_params_of(parts)?;
        Ok(self.value(parts, params.as_ref())?.map(KeyValues::from))
    }
}

impl Routed for PathParamKey {
    fn keys_routed(&self, parts: &mut Parts) -> Result<Option<KeyValues>, KeyRejection> {
        let params = path_params(parts)?;
        Ok(self.value(parts, params.as_ref())?.map(KeyValues::from))
    }
}

/// Locks on several path parameters of the matched axum route at once (both accounts of
/// `/transfers/{from}/{to}`), as one lease. Created by
/// [`Key::path_params`](super::Key::path_params).
///
/// Each parameter is read as [`PathParamKey`] reads one; a request that matched no route passes
/// through unlocked, and a route without one of the parameters is a 500 unless the source is
/// [`optional`](Self::optional). Called from a source of your own, it reads the parameters
/// from a copy of the request's extensions, as [`PathParamKey`] does.
#[derive(Debug, Clone)]
pub struct PathParamsKey {
    params: Vec<PathParamKey>,
}

impl PathParamsKey {
    pub(super) fn new(names: impl IntoIterator<Item = Arc<str>>) -> Self {
        Self {
            params: names.into_iter().map(PathParamKey::new).collect(),
        }
    }

    /// Passes requests of routes that lack one of the parameters through unlocked, instead of
    /// answering 500.
    #[must_use]
    pub fn optional(mut self) -> Self {
        for param in &mut self.params {
            param.optional = true;
        }
        self
    }
}

impl PathParamKey {
    /// The parameter's name, for the layer's default scope.
    pub(super) fn name(&self) -> Arc<str> {
        Arc::clone(&self.name)
    }
}

impl PathParamsKey {
    /// The parameters' names, for the layer's default scope.
    pub(super) fn names(&self) -> impl Iterator<Item = Arc<str>> + '_ {
        self.params.iter().map(PathParamKey::name)
    }

    /// The parameters' values among `params` (`None`: no axum router routed the request).
    fn values(
        &self,
        parts: &Parts,
        params: Option<&RawPathParams>,
    ) -> Result<Option<KeyValues>, KeyRejection> {
        let mut values = Vec::with_capacity(self.params.len());
        for param in &self.params {
            match param.value(parts, params)? {
                Some(value) => values.push(value),
                None => return Ok(None),
            }
        }
        if values.is_empty() {
            return Err(KeyRejection::misconfigured(
                "`Key::path_params` was given no parameter names",
            ));
        }
        Ok(Some(values.into()))
    }
}

/// Called from a source of your own, this reads the parameters from a copy of the request's
/// extensions, as [`PathParamKey`]'s does.
impl KeySource for PathParamsKey {
    fn keys(&self, parts: &Parts) -> Result<Option<KeyValues>, KeyRejection> {
        let params = path_params_of(parts)?;
        self.values(parts, params.as_ref())
    }
}

impl Routed for PathParamsKey {
    fn keys_routed(&self, parts: &mut Parts) -> Result<Option<KeyValues>, KeyRejection> {
        let params = path_params(parts)?;
        self.values(parts, params.as_ref())
    }
}
