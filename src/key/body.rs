//! Key sources that read the request body: [`BodyKeySource`], and [`BodyKeys`], which makes
//! one (or a closure) a layer's key source.

use std::fmt;

use bytes::Bytes;
use http::request::Parts;

use super::{KeyRejection, KeyValues};

/// Derives the values of a request's lock keys from its head and its body.
///
/// A layer built with a body source buffers the request body, up to its
/// [`max_request_body`](crate::LockLayer::max_request_body) (a larger body answers 413), asks
/// the source for the keys, and hands the handler the same body. A source that cannot read its
/// keys from the body (not JSON, a field missing) rejects the request: 400.
///
/// [`Key::json`](super::Key::json) covers the common case, keys from fields of a JSON body.
/// For anything else, implement this trait (or write a closure) and build the layer with
/// [`Key::body`](super::Key::body):
///
/// ```
/// use bytes::Bytes;
/// use http::request::Parts;
/// use tower_lock::{Key, LockLayer, MemoryStore, key::{KeyRejection, KeyValues}};
///
/// // One SKU per line of a plain-text body.
/// let source = Key::body(|_parts: &Parts, body: &Bytes| {
///     let text = std::str::from_utf8(body)
///         .map_err(|_| KeyRejection::invalid("the body is not UTF-8"))?;
///     Ok(Some(text.lines().map(|l| Bytes::copy_from_slice(l.trim().as_bytes())).collect::<KeyValues>()))
/// });
/// let layer = LockLayer::new(MemoryStore::new(), source).namespace("sku");
/// # let _ = layer;
/// ```
pub trait BodyKeySource: Send + Sync + 'static {
    /// The values to lock on, `None` to pass the request through unlocked, or a rejection.
    fn keys(&self, parts: &Parts, body: &Bytes) -> Result<Option<KeyValues>, KeyRejection>;

    /// [`keys`](Self::keys) for a layer that takes at most `max` distinct keys in one lease
    /// ([`LockConfig::max_keys`](crate::LockConfig::max_keys)): a source may stop reading at
    /// the first value past `max` distinct ones and reject the request (400), so that the work
    /// a body costs is bounded by the limit, not by the body. The layer calls this one; the
    /// default calls `keys`, and the layer refuses more than `max` keys itself.
    fn keys_at_most(
        &self,
        parts: &Parts,
        body: &Bytes,
        max: usize,
    ) -> Result<Option<KeyValues>, KeyRejection> {
        let _ = max;
        self.keys(parts, body)
    }
}

impl<F> BodyKeySource for F
where
    F: Fn(&Parts, &Bytes) -> Result<Option<KeyValues>, KeyRejection> + Send + Sync + 'static,
{
    fn keys(&self, parts: &Parts, body: &Bytes) -> Result<Option<KeyValues>, KeyRejection> {
        self(parts, body)
    }
}

/// A [`BodyKeySource`] as a layer's key source; made by [`Key::body`](super::Key::body).
#[derive(Clone)]
pub struct BodyKeys<S> {
    pub(super) source: S,
}

impl<S: BodyKeySource> BodyKeySource for BodyKeys<S> {
    fn keys(&self, parts: &Parts, body: &Bytes) -> Result<Option<KeyValues>, KeyRejection> {
        self.source.keys(parts, body)
    }

    fn keys_at_most(
        &self,
        parts: &Parts,
        body: &Bytes,
        max: usize,
    ) -> Result<Option<KeyValues>, KeyRejection> {
        self.source.keys_at_most(parts, body, max)
    }
}

impl<S> fmt::Debug for BodyKeys<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("BodyKeys")
    }
}
