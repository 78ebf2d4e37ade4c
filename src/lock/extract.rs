//! The axum extractor for [`Lease`].

use axum::{
    extract::{FromRequestParts, OptionalFromRequestParts},
    response::{IntoResponse, Response},
};
use http::{StatusCode, request::Parts};

use crate::lease::Lease;

impl<S: Send + Sync> FromRequestParts<S> for Lease {
    type Rejection = MissingLease;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        parts
            .extensions
            .get::<Lease>()
            .cloned()
            .ok_or(MissingLease { _priv: () })
    }
}

/// `Option<Lease>`: `None` on requests the layer passed through unlocked (an optional key
/// source answered "no key"), or on routes without the layer.
impl<S: Send + Sync> OptionalFromRequestParts<S> for Lease {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(
        parts: &mut Parts,
        _state: &S,
    ) -> Result<Option<Self>, Self::Rejection> {
        Ok(parts.extensions.get::<Lease>().cloned())
    }
}

/// Rejection of the [`Lease`] extractor: the request did not pass through a
/// [`LockLayer`](crate::LockLayer) that locked it. A server bug, so a 500.
#[derive(Debug)]
pub struct MissingLease {
    _priv: (),
}

impl MissingLease {
    const MESSAGE: &'static str = "The `Lease` extractor found no lease: this route is not wrapped \
        in a `tower_lock::LockLayer`, or its key source passed the request through unlocked. Add \
        `.route_layer(LockLayer::new(..))` to the route, or extract `Option<Lease>`.";
}

impl MissingLease {
    /// 500: a route that extracts a lease without the layer is the server's mistake.
    pub fn status(&self) -> StatusCode {
        StatusCode::INTERNAL_SERVER_ERROR
    }

    /// The `application/problem+json` response (type
    /// [`#layer-missing`](crate::response#layer-missing)); the detail names the fix.
    pub fn problem(&self) -> http::Response<bytes::Bytes> {
        crate::response::layer_missing(Self::MESSAGE)
    }
}

impl IntoResponse for MissingLease {
    fn into_response(self) -> Response {
        tracing::error!("{}", Self::MESSAGE);
        self.problem().map(axum::body::Body::from)
    }
}

impl std::fmt::Display for MissingLease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(Self::MESSAGE)
    }
}

impl std::error::Error for MissingLease {}
