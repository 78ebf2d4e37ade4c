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
/// For anything else, write a closure and build the layer with [`Key::body`](super::Key::body),
/// or implement this trait and build it with [`BodyKeys::new`]:
///
/// ```
/// use bytes::Bytes;
/// use http::request::Parts;
/// use tower_lock::{LockLayer, MemoryStore, key::{BodyKeySource, BodyKeys, KeyRejection, KeyValues}};
///
/// /// One SKU per line of a plain-text body.
/// struct Lines;
///
/// impl BodyKeySource for Lines {
///     fn keys(&self, _parts: &Parts, body: &Bytes) -> Result<Option<KeyValues>, KeyRejection> {
///         let text = std::str::from_utf8(body)
///             .map_err(|_| KeyRejection::invalid("the body is not UTF-8"))?;
///         Ok(Some(text.lines().map(|l| Bytes::copy_from_slice(l.trim().as_bytes())).collect()))
///     }
/// }
///
/// let layer = LockLayer::new(MemoryStore::new(), BodyKeys::new(Lines)).namespace("sku");
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

impl<F, V> BodyKeySource for F
where
    F: Fn(&Parts, &Bytes) -> Result<Option<V>, KeyRejection> + Send + Sync + 'static,
    V: Into<KeyValues>,
{
    fn keys(&self, parts: &Parts, body: &Bytes) -> Result<Option<KeyValues>, KeyRejection> {
        Ok(self(parts, body)?.map(Into::into))
    }
}

/// A [`BodyKeySource`] as a layer's key source: a layer built with it reads the request body
/// for its keys. Made by [`Key::body`](super::Key::body) from a closure, or by
/// [`new`](Self::new) from a source of your own.
#[derive(Clone)]
pub struct BodyKeys<S> {
    source: S,
}

impl<S: BodyKeySource> BodyKeys<S> {
    /// `source` as a layer's key source.
    pub fn new(source: S) -> Self {
        Self { source }
    }
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
