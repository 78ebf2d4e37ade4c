//! Key sources that yield several values: [`KeySetSource`], and the values, [`KeyValues`].

use std::fmt;

use bytes::Bytes;
use http::request::Parts;

use super::{KeyRejection, KeySource};

/// The values a key source derived from one request: one, or several (a transfer's two
/// accounts, every SKU of a cart).
///
/// The layer turns each value into a lock key (scoped and prefixed, see the
/// [module docs](super#scoping)) and takes them all as one lease; a value given twice is one
/// key. No values at all is a 400.
#[derive(Clone, PartialEq, Eq)]
pub struct KeyValues {
    repr: Repr,
}

#[derive(Clone, PartialEq, Eq)]
enum Repr {
    One(Bytes),
    Many(Vec<Bytes>),
}

impl KeyValues {
    /// How many values.
    pub fn len(&self) -> usize {
        self.as_slice().len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.as_slice().is_empty()
    }

    /// The values, in the order the source gave them.
    pub fn as_slice(&self) -> &[Bytes] {
        match &self.repr {
            Repr::One(value) => std::slice::from_ref(value),
            Repr::Many(values) => values,
        }
    }

    /// The values, in the order the source gave them.
    pub fn iter(&self) -> std::slice::Iter<'_, Bytes> {
        self.as_slice().iter()
    }
}

impl From<Bytes> for KeyValues {
    fn from(value: Bytes) -> Self {
        Self {
            repr: Repr::One(value),
        }
    }
}

impl From<Vec<Bytes>> for KeyValues {
    fn from(values: Vec<Bytes>) -> Self {
        Self {
            repr: Repr::Many(values),
        }
    }
}

impl<const N: usize> From<[Bytes; N]> for KeyValues {
    fn from(values: [Bytes; N]) -> Self {
        Self::from(Vec::from(values))
    }
}

impl FromIterator<Bytes> for KeyValues {
    fn from_iter<I: IntoIterator<Item = Bytes>>(iter: I) -> Self {
        Self::from(iter.into_iter().collect::<Vec<_>>())
    }
}

impl<'a> IntoIterator for &'a KeyValues {
    type Item = &'a Bytes;
    type IntoIter = std::slice::Iter<'a, Bytes>;

    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

impl fmt::Debug for KeyValues {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Values may carry user data: their number only.
        f.debug_struct("KeyValues")
            .field("len", &self.len())
            .finish()
    }
}

/// Derives the values of a request's lock keys, one or several, from the request head.
///
/// Every [`KeySource`] is one (its one value); implement this trait for a source that locks
/// several resources per request, such as both accounts of a transfer. The layer takes all the
/// keys as one lease: all of them or none, in a deadlock-free order (see
/// [`KeySet`](super::KeySet)). To read the keys from the request body, see
/// [`BodyKeySource`](super::BodyKeySource).
///
/// ```
/// use bytes::Bytes;
/// use http::request::Parts;
/// use tower_lock::key::{KeyRejection, KeySetSource, KeyValues};
///
/// /// `X-Accounts: 17, 42`: lock every account named.
/// struct Accounts;
///
/// impl KeySetSource for Accounts {
///     fn keys(&self, parts: &mut Parts) -> Result<Option<KeyValues>, KeyRejection> {
///         let header = parts
///             .headers
///             .get("x-accounts")
///             .ok_or_else(|| KeyRejection::missing("`x-accounts` header"))?;
///         let list = header
///             .to_str()
///             .map_err(|_| KeyRejection::invalid("`x-accounts` is not text"))?;
///         Ok(Some(list.split(',').map(|a| Bytes::copy_from_slice(a.trim().as_bytes())).collect()))
///     }
/// }
/// ```
pub trait KeySetSource: Send + Sync + 'static {
    /// The values to lock on, `None` to pass the request through unlocked, or a rejection.
    fn keys(&self, parts: &mut Parts) -> Result<Option<KeyValues>, KeyRejection>;
}

impl<T: KeySource> KeySetSource for T {
    fn keys(&self, parts: &mut Parts) -> Result<Option<KeyValues>, KeyRejection> {
        Ok(self.key(parts)?.map(KeyValues::from))
    }
}

/// A closure that derives several values from the request head; made by
/// [`Key::from_fn_many`](super::Key::from_fn_many).
#[derive(Clone)]
pub struct FnKeys<F> {
    f: F,
}

impl<F> FnKeys<F> {
    pub(super) fn new(f: F) -> Self {
        Self { f }
    }
}

impl<F> KeySetSource for FnKeys<F>
where
    F: Fn(&Parts) -> Result<Option<KeyValues>, KeyRejection> + Send + Sync + 'static,
{
    fn keys(&self, parts: &mut Parts) -> Result<Option<KeyValues>, KeyRejection> {
        (self.f)(parts)
    }
}

impl<F> fmt::Debug for FnKeys<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("FnKeys")
    }
}

#[cfg(test)]
mod tests {
    use super::super::Key;
    use super::*;

    #[test]
    fn a_single_key_source_is_a_set_source_of_one() {
        let mut parts = http::Request::post("/p")
            .header("k", "secret-value")
            .body(())
            .unwrap()
            .into_parts()
            .0;
        let values = KeySetSource::keys(&Key::header("k"), &mut parts)
            .unwrap()
            .unwrap();
        assert_eq!(values.as_slice(), [Bytes::from("secret-value")]);
        let many = Key::from_fn_many(|_: &Parts| {
            Ok(Some(KeyValues::from([
                Bytes::from_static(b"a"),
                Bytes::from_static(b"b"),
            ])))
        });
        assert_eq!(many.keys(&mut parts).unwrap().unwrap().len(), 2);
        assert!(!format!("{values:?}").contains("secret"), "values in Debug");
    }
}
