//! A sequence of at most `N` items stored inline, so that a model state is one flat value:
//! cloning it is a copy and hashing it touches no heap (both happen for every step explored,
//! in a debug build).

use std::fmt;

#[derive(Clone, Copy)]
pub struct Seq<T: Copy + Default, const N: usize> {
    len: u8,
    /// Slots past `len` hold `T::default()`.
    items: [T; N],
}

impl<T: Copy + Default + PartialEq, const N: usize> PartialEq for Seq<T, N> {
    fn eq(&self, other: &Self) -> bool {
        self.as_slice() == other.as_slice()
    }
}

impl<T: Copy + Default + Eq, const N: usize> Eq for Seq<T, N> {}

impl<T: Copy + Default + std::hash::Hash, const N: usize> std::hash::Hash for Seq<T, N> {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.as_slice().hash(state);
    }
}

impl<T: Copy + Default + Ord, const N: usize> PartialOrd for Seq<T, N> {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl<T: Copy + Default + Ord, const N: usize> Ord for Seq<T, N> {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.as_slice().cmp(other.as_slice())
    }
}

impl<T: Copy + Default, const N: usize> Default for Seq<T, N> {
    fn default() -> Self {
        Self {
            len: 0,
            items: [T::default(); N],
        }
    }
}

impl<T: Copy + Default + fmt::Debug, const N: usize> fmt::Debug for Seq<T, N> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

impl<T: Copy + Default, const N: usize> Seq<T, N> {
    pub fn len(&self) -> usize {
        usize::from(self.len)
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn as_slice(&self) -> &[T] {
        &self.items[..self.len()]
    }

    pub fn as_mut_slice(&mut self) -> &mut [T] {
        let len = self.len();
        &mut self.items[..len]
    }

    pub fn iter(&self) -> std::slice::Iter<'_, T> {
        self.as_slice().iter()
    }

    pub fn iter_mut(&mut self) -> std::slice::IterMut<'_, T> {
        self.as_mut_slice().iter_mut()
    }

    pub fn push(&mut self, item: T) {
        self.insert(self.len(), item);
    }

    pub fn insert(&mut self, at: usize, item: T) {
        let len = self.len();
        assert!(len < N, "a model sequence outgrew its {N} slots");
        self.items.copy_within(at..len, at + 1);
        self.items[at] = item;
        self.len += 1;
    }

    pub fn remove(&mut self, at: usize) -> T {
        let len = self.len();
        let item = self.items[at];
        self.items.copy_within(at + 1..len, at);
        self.items[len - 1] = T::default();
        self.len -= 1;
        item
    }

    pub fn clear(&mut self) {
        *self = Self::default();
    }

    pub fn retain(&mut self, mut keep: impl FnMut(&T) -> bool) {
        let mut kept = Self::default();
        for item in self.iter() {
            if keep(item) {
                kept.push(*item);
            }
        }
        *self = kept;
    }
}

impl<T: Copy + Default + PartialEq, const N: usize> Seq<T, N> {
    pub fn contains(&self, item: &T) -> bool {
        self.as_slice().contains(item)
    }
}

impl<T: Copy + Default, const N: usize> FromIterator<T> for Seq<T, N> {
    fn from_iter<I: IntoIterator<Item = T>>(iter: I) -> Self {
        let mut seq = Self::default();
        for item in iter {
            seq.push(item);
        }
        seq
    }
}

impl<'a, T: Copy + Default, const N: usize> IntoIterator for &'a Seq<T, N> {
    type Item = &'a T;
    type IntoIter = std::slice::Iter<'a, T>;

    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

impl<T: Copy + Default, const N: usize, I: SeqIndex> std::ops::Index<I> for Seq<T, N> {
    type Output = T;

    fn index(&self, i: I) -> &T {
        &self.as_slice()[i.at()]
    }
}

impl<T: Copy + Default, const N: usize, I: SeqIndex> std::ops::IndexMut<I> for Seq<T, N> {
    fn index_mut(&mut self, i: I) -> &mut T {
        &mut self.as_mut_slice()[i.at()]
    }
}

/// Positions: processes are numbered with `u8`.
pub trait SeqIndex {
    fn at(self) -> usize;
}

impl SeqIndex for usize {
    fn at(self) -> usize {
        self
    }
}

impl SeqIndex for u8 {
    fn at(self) -> usize {
        usize::from(self)
    }
}
