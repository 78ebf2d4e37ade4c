//! [`LockLayer`]: a distributed lock around each request.
//!
//! See the [crate docs](crate) for an example and the path of a request.

mod body;
#[cfg(feature = "axum")]
mod extract;
mod future;
mod layer;
mod service;
mod state;

#[cfg(feature = "axum")]
pub use self::extract::MissingLease;
pub use self::{
    body::ResponseBody, future::ResponseFuture, layer::LockLayer, service::LockService,
};
