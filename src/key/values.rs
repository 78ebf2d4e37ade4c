//! [`KeyValues`]: what a key source derives from a request, one value or several.

use std::fmt;

use bytes::Bytes;

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

impl From<String> for KeyValues {
    fn from(value: String) -> Self {
        Self::from(Bytes::from(value))
    }
}

impl From<&'static str> for KeyValues {
    fn from(value: &'static str) -> Self {
        Self::from(Bytes::from_static(value.as_bytes()))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_value_or_several() {
        let one = KeyValues::from(Bytes::from("secret-value"));
        assert_eq!(one.as_slice(), ["secret-value"]);
        assert_eq!(KeyValues::from("a"), KeyValues::from(String::from("a")));
        let many = KeyValues::from([Bytes::from_static(b"a"), Bytes::from_static(b"b")]);
        assert_eq!(many.len(), 2);
        assert_eq!(many.iter().collect::<Vec<_>>(), ["a", "b"]);
        assert!(!format!("{one:?}").contains("secret"), "values in Debug");
    }
}
