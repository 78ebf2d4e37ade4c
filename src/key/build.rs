//! [`Key`](crate::Key): the constructors of the built-in key sources.

#[cfg(feature = "axum")]
use std::sync::Arc;

use bytes::Bytes;
use http::request::Parts;

use super::{BodyKeys, HeaderKey, JsonKeys, KeyRejection, KeyValues, PathKey};
#[cfg(feature = "axum")]
use super::{PathParamKey, PathParamsKey};

/// Constructors for the built-in key sources.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct Key;

impl Key {
    /// Locks on the value of a request header, such as `Idempotency-Key`.
    ///
    /// A missing header is a 400 unless the source is made [`optional`](HeaderKey::optional).
    /// A header sent more than once, or sent empty, is a 400.
    ///
    /// ```
    /// use tower_lock::{Key, LockLayer, MemoryStore};
    ///
    /// # fn main() -> Result<(), tower_lock::ConfigError> {
    /// let layer = LockLayer::new(MemoryStore::new(), Key::header("x-merchant-id")?);
    /// assert!(Key::header("not a header").is_err());
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// A [`ConfigError`](crate::ConfigError) (setting `Key::header`) when `name` is not a valid
    /// header name (empty, spaces, other characters outside RFC 9110's tokens).
    pub fn header(name: impl AsRef<str>) -> Result<HeaderKey, crate::ConfigError> {
        HeaderKey::new(name.as_ref())
    }

    /// Locks on a path parameter of the matched axum route, e.g. `sku` in `/items/{sku}`,
    /// percent-decoded as axum decodes it.
    ///
    /// Path parameters exist only once axum has routed the request: add the layer with
    /// `Router::route_layer`, `Router::layer` or on a `MethodRouter`. A request that matched no
    /// route passes through unlocked, so the router's 404 stands. A route without the parameter
    /// is a 500 whose detail says so (a typo in the name), unless the source is made
    /// [`optional`](PathParamKey::optional): then its requests pass through unlocked. A layer
    /// wrapping the whole router from outside sees no parameters at all: a 500 for every
    /// request.
    #[cfg(feature = "axum")]
    pub fn path_param(name: impl Into<Arc<str>>) -> PathParamKey {
        PathParamKey::new(name.into())
    }

    /// Locks on the request path (without the query) as the router resolves it: each segment
    /// percent-decoded, so every spelling of one path takes one lock. See [`PathKey`].
    pub fn path() -> PathKey {
        PathKey::new()
    }

    /// Locks on whatever the closure computes from the request head: one value (`Bytes`,
    /// `String`, `&'static str`) or several ([`KeyValues`], `Vec<Bytes>`, `[Bytes; N]`), taken
    /// as one lease.
    ///
    /// Any such closure is a [`KeySource`](super::KeySource) already; this pins down its type, so that neither
    /// its argument nor its answer needs a written type.
    ///
    /// ```
    /// use bytes::Bytes;
    /// use tower_lock::{Key, key::KeyValues};
    ///
    /// // Lock per client account, taken from a header set by an authenticating proxy.
    /// let account = Key::from_fn(|parts| {
    ///     Ok(parts.headers.get("x-account-id").map(|v| Bytes::copy_from_slice(v.as_bytes())))
    /// });
    ///
    /// // Both accounts of a transfer, as one lease.
    /// let transfer = Key::from_fn(|parts| {
    ///     let account = |name: &str| parts.headers.get(name).map(|v| Bytes::copy_from_slice(v.as_bytes()));
    ///     Ok(account("x-from").zip(account("x-to")).map(|(a, b)| [a, b]))
    /// });
    /// # let _ = (account, transfer);
    /// ```
    pub fn from_fn<F, V>(f: F) -> F
    where
        F: Fn(&Parts) -> Result<Option<V>, KeyRejection> + Send + Sync + 'static,
        V: Into<KeyValues>,
    {
        f
    }

    /// Locks on several path parameters of the matched axum route, as one lease: both accounts
    /// of `/transfers/{from}/{to}`. See [`PathParamsKey`].
    #[cfg(feature = "axum")]
    pub fn path_params<N: Into<Arc<str>>>(names: impl IntoIterator<Item = N>) -> PathParamsKey {
        PathParamsKey::new(names.into_iter().map(Into::into))
    }

    /// Locks on fields of the JSON request body, named by a JSON pointer in which `*` stands
    /// for every element of an array (`/items/*/sku`); [`JsonKeys::and`] adds fields. The
    /// layer buffers the body, up to its
    /// [`max_request_body`](crate::LockLayer::max_request_body). A
    /// [`ConfigError`](crate::ConfigError) if `pointer` is not a JSON pointer (RFC 6901). See
    /// [`JsonKeys`].
    pub fn json(pointer: &str) -> Result<JsonKeys, crate::ConfigError> {
        JsonKeys::new(pointer)
    }

    /// Locks on what the closure reads from the request head and body: one value or several,
    /// as [`from_fn`](Self::from_fn)'s. The layer buffers the body, up to its
    /// [`max_request_body`](crate::LockLayer::max_request_body), and hands the handler the
    /// same bytes; its body type must be built from `Bytes` (`axum::body::Body` is).
    ///
    /// Neither argument nor the answer needs a written type. A [`BodyKeySource`](super::BodyKeySource) of your own
    /// (a type, not a closure) becomes a layer's source through [`BodyKeys::new`].
    ///
    /// ```
    /// use bytes::Bytes;
    /// use tower_lock::{Key, LockLayer, MemoryStore};
    ///
    /// // The order id of a plain-text body, scoped by the tenant header.
    /// let source = Key::body(|parts, body| {
    ///     let tenant = parts.headers.get("x-tenant").map(|t| t.as_bytes()).unwrap_or_default();
    ///     Ok(Some(Bytes::from([tenant, b"/", &body[..]].concat())))
    /// });
    /// let layer = LockLayer::new(MemoryStore::new(), source).namespace("order");
    /// # let _ = layer;
    /// ```
    pub fn body<F, V>(f: F) -> BodyKeys<F>
    where
        F: Fn(&Parts, &Bytes) -> Result<Option<V>, KeyRejection> + Send + Sync + 'static,
        V: Into<KeyValues>,
    {
        BodyKeys::new(f)
    }
}
