//! [`KeySet`]: the lock keys of one lease, in lock order.

use std::{fmt, sync::Arc};

use super::{LockKey, Share};

/// The keys one lease holds: one or several [`LockKey`]s, without repeats, in *lock order*.
///
/// Lock order is one total order every process agrees on: by the key's Redis Cluster hash slot,
/// then by its bytes. Every store takes a set's keys in this order (a cluster, slot by slot),
/// and a process's requests take their turns at keys in it, so two sets that overlap never wait
/// for each other in a cycle. A key given twice is one key.
///
/// Build one from a key, an array, a `Vec` or an iterator of keys:
///
/// ```
/// use tower_lock::{Locker, MemoryStore, key::KeySet};
///
/// let locker = Locker::new(MemoryStore::new());
/// let from = locker.key("accounts", "alice")?;
/// let to = locker.key("accounts", "bob")?;
/// let set = KeySet::from([to.clone(), from.clone(), to]);
/// assert_eq!(set.len(), 2);
/// assert!(set.contains(&from));
/// # Ok::<(), tower_lock::key::KeyRejection>(())
/// ```
///
/// A set may be empty; acquiring an empty set is refused (a [`KeyRejection`](super::KeyRejection)).
/// Cheap to clone.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct KeySet {
    repr: Repr,
}

#[derive(Clone, PartialEq, Eq, Hash)]
enum Repr {
    /// One key: no allocation beyond the key's own.
    One(LockKey),
    /// None, or two and more, sorted and without repeats.
    Many(Arc<[LockKey]>),
}

/// The stronger of two asks of one key (see [`KeySet::new`]); `None`: both plain.
fn stronger(a: Option<Share>, b: Option<Share>) -> Option<Share> {
    let exclusive = |capacity: u32| Share::exclusive(capacity).ok();
    match (a, b) {
        (None, None) => None,
        (Some(s), None) | (None, Some(s)) => exclusive(s.capacity()).or(Some(s)),
        (Some(a), Some(b)) if a == b => Some(a),
        (Some(a), Some(b)) if a.capacity() != b.capacity() => {
            exclusive(a.capacity().max(b.capacity())).or(Some(a))
        }
        (Some(a), Some(b)) => Some(if b.weight() > a.weight() { b } else { a }),
    }
}

/// The lock order of two keys: by hash slot, then bytes.
fn lock_order(a: &LockKey, b: &LockKey) -> std::cmp::Ordering {
    (a.slot(), a.as_bytes()).cmp(&(b.slot(), b.as_bytes()))
}

impl KeySet {
    /// The set of `keys`, in lock order, each once. A key named more than once with different
    /// shares is taken with the strongest of them: exclusive over shared, the larger weight of
    /// one capacity, exclusive of the larger capacity when capacities differ, and exclusive of
    /// its capacity when one ask is plain and another has a share (so that one holder asking to
    /// read and to write a key writes it; a plain and a counted ask of one key are still the
    /// key taken both ways, an error once another holder takes it the other way).
    pub fn new(keys: impl IntoIterator<Item = LockKey>) -> Self {
        let mut keys: Vec<LockKey> = keys.into_iter().collect();
        if keys.len() == 1 {
            let key = keys.pop().expect("one key");
            return Self::from(key);
        }
        keys.sort_by(lock_order);
        keys.dedup_by(|later, kept| {
            if later != kept {
                return false;
            }
            if let Some(share) = stronger(kept.share(), later.share()) {
                *kept = kept.clone().with_share(share);
            }
            true
        });
        match keys.len() {
            1 => Self::from(keys.pop().expect("one key")),
            _ => Self {
                repr: Repr::Many(keys.into()),
            },
        }
    }

    /// How many keys.
    pub fn len(&self) -> usize {
        self.as_slice().len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.as_slice().is_empty()
    }

    /// The keys, in lock order.
    pub fn as_slice(&self) -> &[LockKey] {
        match &self.repr {
            Repr::One(key) => std::slice::from_ref(key),
            Repr::Many(keys) => keys,
        }
    }

    /// The keys, in lock order.
    pub fn iter(&self) -> std::slice::Iter<'_, LockKey> {
        self.as_slice().iter()
    }

    /// The first key in lock order, if any.
    pub fn first(&self) -> Option<&LockKey> {
        self.as_slice().first()
    }

    /// Whether `key` is one of them.
    pub fn contains(&self, key: &LockKey) -> bool {
        self.position(key).is_some()
    }

    /// Where `key` is in lock order, if it is one of them.
    pub fn position(&self, key: &LockKey) -> Option<usize> {
        self.as_slice()
            .binary_search_by(|k| lock_order(k, key))
            .ok()
    }

    /// The one key of a set of one.
    pub(crate) fn as_one(&self) -> Option<&LockKey> {
        match &self.repr {
            Repr::One(key) => Some(key),
            Repr::Many(_) => None,
        }
    }

    /// Whether a key of the set has a capacity ([`LockKey::share`]).
    pub(crate) fn counted(&self) -> bool {
        self.iter().any(|key| key.share().is_some())
    }

    /// The set with each key's share set by `share` (`None` keeps the key's own); lock order
    /// is the keys' bytes', so it stays.
    pub(crate) fn map_share(self, mut share: impl FnMut(&LockKey) -> Option<super::Share>) -> Self {
        let with = |key: &LockKey, share: Option<super::Share>| match share {
            Some(share) => key.clone().with_share(share),
            None => key.clone(),
        };
        match &self.repr {
            Repr::One(key) => Self::from(with(key, share(key))),
            Repr::Many(keys) => Self {
                repr: Repr::Many(keys.iter().map(|key| with(key, share(key))).collect()),
            },
        }
    }

    /// The keys grouped by hash slot, in lock order: each group the keys of one slot, with
    /// the position of its first key.
    #[cfg_attr(not(feature = "redis"), allow(dead_code))] // constructed by the Redis stores
    pub(crate) fn by_slot(&self) -> impl Iterator<Item = (usize, &[LockKey])> {
        let keys = self.as_slice();
        let mut start = 0;
        std::iter::from_fn(move || {
            let first = keys.get(start)?;
            let len = keys[start..]
                .iter()
                .take_while(|k| k.slot() == first.slot())
                .count();
            let group = (start, &keys[start..start + len]);
            start += len;
            Some(group)
        })
    }
}

impl From<LockKey> for KeySet {
    fn from(key: LockKey) -> Self {
        Self {
            repr: Repr::One(key),
        }
    }
}

impl From<Vec<LockKey>> for KeySet {
    fn from(keys: Vec<LockKey>) -> Self {
        Self::new(keys)
    }
}

impl<const N: usize> From<[LockKey; N]> for KeySet {
    fn from(keys: [LockKey; N]) -> Self {
        Self::new(keys)
    }
}

impl From<&[LockKey]> for KeySet {
    fn from(keys: &[LockKey]) -> Self {
        Self::new(keys.iter().cloned())
    }
}

impl FromIterator<LockKey> for KeySet {
    fn from_iter<I: IntoIterator<Item = LockKey>>(iter: I) -> Self {
        Self::new(iter)
    }
}

impl<'a> IntoIterator for &'a KeySet {
    type Item = &'a LockKey;
    type IntoIter = std::slice::Iter<'a, LockKey>;

    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

impl fmt::Debug for KeySet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(v: &str) -> LockKey {
        LockKey::new("p:", "s", v.as_bytes(), 64).unwrap()
    }

    /// A key asked twice with different shares is taken with the stronger, whatever the order
    /// it was named in (a reader and a writer of one account: the writer).
    #[test]
    fn a_key_asked_twice_is_taken_with_the_stronger_share() {
        let reader = Share::new(1, Share::READERS).unwrap();
        let writer = Share::exclusive(Share::READERS).unwrap();
        let shares = |keys: Vec<LockKey>| -> Vec<Option<Share>> {
            KeySet::new(keys).iter().map(LockKey::share).collect()
        };
        let a = key("a");
        for asked in [
            vec![a.clone().with_share(reader), a.clone().with_share(writer)],
            vec![a.clone().with_share(writer), a.clone().with_share(reader)],
            vec![a.clone(), a.clone().with_share(reader)],
            vec![a.clone().with_share(reader), a.clone()],
        ] {
            assert_eq!(shares(asked), [Some(writer)]);
        }
        let (one, two) = (Share::new(1, 3).unwrap(), Share::new(2, 3).unwrap());
        for asked in [
            vec![
                a.clone().with_share(one),
                key("b"),
                a.clone().with_share(two),
            ],
            vec![
                a.clone().with_share(two),
                key("b"),
                a.clone().with_share(one),
            ],
        ] {
            let set = KeySet::new(asked);
            assert_eq!(set.len(), 2);
            assert_eq!(set.iter().find(|k| **k == a).unwrap().share(), Some(two));
        }
        let other = Share::new(1, 5).unwrap();
        assert_eq!(
            shares(vec![a.clone().with_share(one), a.clone().with_share(other)]),
            [Some(Share::exclusive(5).unwrap())]
        );
        assert_eq!(shares(vec![a.clone(), a.clone()]), [None]);
    }

    #[test]
    fn lock_order_is_by_slot_then_bytes_each_key_once() {
        let keys: Vec<LockKey> = (0..50).map(|i| key(&format!("k{i}"))).collect();
        let mut shuffled = keys.clone();
        shuffled.reverse();
        shuffled.extend(keys.iter().take(10).cloned());
        let set = KeySet::new(shuffled);
        assert_eq!(set.len(), 50);
        for pair in set.as_slice().windows(2) {
            assert!(
                (pair[0].slot(), pair[0].as_bytes()) < (pair[1].slot(), pair[1].as_bytes()),
                "{pair:?}"
            );
        }
        // Any order in, one order out.
        assert_eq!(KeySet::new(keys.clone()), set);
        for (i, k) in set.iter().enumerate() {
            assert_eq!(set.position(k), Some(i));
        }
        assert!(!set.contains(&key("other")));
    }

    #[test]
    fn one_key_and_none() {
        let one = KeySet::from(key("a"));
        assert_eq!(one.as_one(), Some(&key("a")));
        assert_eq!(
            KeySet::from([key("a"), key("a")]),
            one,
            "a repeat is one key"
        );
        assert_eq!(one.first(), Some(&key("a")));
        let none = KeySet::new([]);
        assert!(none.is_empty() && none.first().is_none());
    }

    #[test]
    fn slot_groups_cover_the_set_in_order() {
        let set: KeySet = (0..200).map(|i| key(&format!("k{}", i % 7))).collect();
        let mut seen = 0;
        for (start, group) in set.by_slot() {
            assert_eq!(start, seen);
            assert!(group.iter().all(|k| k.slot() == group[0].slot()));
            seen += group.len();
        }
        assert_eq!(seen, set.len());
    }
}
