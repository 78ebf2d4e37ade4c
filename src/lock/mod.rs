//! [`LockLayer`](crate::LockLayer): a distributed lock around each request.
//!
//! The layer derives a key from each request (a [`KeySource`](crate::key::KeySource)), takes a
//! lease on it through its [`Locker`](crate::Locker) before the inner service runs, keeps it
//! renewed while the service runs, and releases it when the response is ready (or, with
//! [`hold_until_body_end`](crate::LockLayer::hold_until_body_end), when the body has been
//! streamed), or when the request is dropped. See the [crate docs](crate) for the path of a
//! request, the responses and the defaults.
//!
//! ```
//! # #[cfg(feature = "axum")] {
//! use axum::{Router, extract::Path, routing::post};
//! use tower_lock::{Key, Lease, LockLayer, MemoryStore};
//!
//! async fn purchase(lease: Lease, Path(sku): Path<String>) -> String {
//!     format!("bought {sku} under fencing token {}", lease.fencing_token())
//! }
//!
//! let app: Router = Router::new()
//!     .route("/items/{sku}/purchase", post(purchase))
//!     .route_layer(LockLayer::new(MemoryStore::new(), Key::path_param("sku")));
//! # }
//! ```
//!
//! # `layer` or `route_layer`
//!
//! Under axum, add the layer with `Router::route_layer` or `Router::layer` (or on a
//! `MethodRouter`). Either way it runs after routing: [`Key::path_param`](crate::Key::path_param) sees the parameters
//! and keys are scoped by the matched route up to the parameter (`/items/{sku}`). What differs
//! is what else it wraps:
//!
//! - `Router::layer` also wraps the router's fallback. A request that matched no route reaches
//!   the key source with no route template: [`Key::path_param`](crate::Key::path_param) passes it through unlocked, so
//!   the router's 404 (or your fallback) answers. Other sources key it like any request, so a
//!   required header missing on an unknown path is a 400.
//! - Both wrap every route of the router: a route without the parameter (`/health` beside
//!   `/items/{sku}`) is a 500 from [`Key::path_param`](crate::Key::path_param), taken for a typo in the name, unless the
//!   source is [`optional`](crate::key::PathParamKey::optional).
//! - A request whose path matched but whose method did not goes to the method router's 405
//!   fallback, which `Router::layer`, `Router::route_layer` and `MethodRouter::layer` wrap too;
//!   axum gives the layer no sign of it, so it is keyed like any request of the resource (it
//!   waits while a `POST` holds the SKU). Only `MethodRouter::route_layer` leaves that fallback
//!   out.
//! - A service nested with `nest_service` gets no route template from axum either: under a
//!   layer of the outer router, [`Key::path_param`](crate::Key::path_param) passes its requests through (add the layer
//!   inside the nested router instead).
//!
//! A layer wrapping the whole router from outside (`ServiceBuilder` around the `Router`) runs
//! before routing: no path parameters ([`Key::path_param`](crate::Key::path_param) answers 500);
//! other sources work there as anywhere.
//!
//! Order it inside timeouts and outside anything that must run under the lock. A
//! `TimeoutLayer` outside it bounds wait plus handler; when it fires, the future is dropped and
//! the lease is released in a spawned task.
//!
//! # A lease lost while the handler runs
//!
//! A lease can be lost under a running handler (a pause past its TTL, a store that forgot it):
//! by default ([`OnLeaseLost::Abort`](crate::config::OnLeaseLost)) the handler is dropped and the client
//! gets 503 `#lease-lost`, which tells it that nothing was done. That is only true while the
//! handler has written nothing, so the answer follows what the handler wrote:
//!
//! | the lease is lost | the handler | the client gets |
//! |---|---|---|
//! | before its first [fenced write](crate::fence) | is dropped | 503 `#lease-lost`: nothing was written |
//! | after it | runs to its end; its later fenced writes are refused if a newer holder was there | the handler's answer: 200 when its writes landed, 409 `#stale-write` when the fence refused them (nothing written), 503 `#data-store-unavailable` when the store did not answer (they may have) |
//!
//! Writes the crate does not see (another database written directly, an unfenced batch) do not
//! change the rule: fence them, or use [`OnLeaseLost::Continue`](crate::config::OnLeaseLost) and check
//! [`Lease::is_lost`](crate::Lease::is_lost) before each.
//!

mod body;
#[cfg(feature = "axum")]
mod extract;
mod future;
pub(crate) mod layer;
mod read;
mod service;
mod state;

#[cfg(feature = "axum")]
pub use self::extract::MissingLease;
pub use self::{body::ResponseBody, future::ResponseFuture, service::LockService};
