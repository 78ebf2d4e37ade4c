//! The principal that scopes idempotency keys: named when the layer is built.

use bytes::Bytes;
use http::request::Parts;

/// Who a request is made for: the scope of its idempotency keys.
///
/// Two principals using the same key value never see each other's records, so one client cannot
/// be served another's response by sending its key (and body). Return a tenant or API-key id that
/// an authenticating layer put into the request extensions; `None` means the request reached the
/// layer without one, an ordering misconfiguration answered 500 (`#idempotency-principal-missing`).
///
/// Every [`IdempotencyLayer`](super::IdempotencyLayer) is built with one; there is no default.
/// An empty id is the shared key space of [`SharedKeySpace`]: never return one for a client.
/// A service whose clients may share one key space says so with [`SharedKeySpace`].
///
/// Implemented for closures `Fn(&Parts) -> Option<Bytes>`:
///
/// ```
/// use bytes::Bytes;
/// use http::request::Parts;
/// use tower_lock::{IdempotencyLayer, MemoryStore};
///
/// #[derive(Clone)]
/// struct AccountId(String);
///
/// let layer = IdempotencyLayer::new(MemoryStore::new(), |parts: &Parts| {
///     let AccountId(id) = parts.extensions.get::<AccountId>()?;
///     Some(Bytes::from(id.clone()))
/// });
/// # let _ = layer;
/// ```
pub trait Principal: Send + Sync + 'static {
    /// The principal's id (any bytes), or `None` if the request has none (500).
    fn principal(&self, parts: &Parts) -> Option<Bytes>;
}

impl<F> Principal for F
where
    F: Fn(&Parts) -> Option<Bytes> + Send + Sync + 'static,
{
    fn principal(&self, parts: &Parts) -> Option<Bytes> {
        self(parts)
    }
}

/// The [`Principal`] that puts every request in one key space: any client that sends another
/// client's key, with the same method, path and body, is served that client's stored response.
///
/// Choose it only where that cannot matter: a service with a single client, or an internal
/// caller that is the only one to see its keys. A service with several clients names the one a
/// request is made for instead (a closure over what authentication put into the extensions; see
/// [`Principal`]).
///
/// ```
/// use tower_lock::{IdempotencyLayer, MemoryStore, idempotency::SharedKeySpace};
///
/// // One caller only: the batch importer.
/// let layer = IdempotencyLayer::new(MemoryStore::new(), SharedKeySpace);
/// # let _ = layer;
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SharedKeySpace;

impl Principal for SharedKeySpace {
    fn principal(&self, _parts: &Parts) -> Option<Bytes> {
        Some(Bytes::new())
    }
}
