//! [`Share`]: how much of a key's capacity one holder takes (leases with counts).

use std::{fmt, num::NonZeroU32};

use crate::error::ConfigError;

/// How much of a key's capacity a lease takes: a key with a capacity of `N` has holders whose
/// weights sum to at most `N`, served first come first served (the head of the queue waits
/// until its whole weight fits, so a heavy request is never overtaken by lighter ones).
///
/// One mechanism gives three kinds of lease:
///
/// | lease | capacity | weight |
/// |---|---|---|
/// | one of `N` permits ([`LockLayer::permits`](crate::LockLayer::permits), [`Acquiring::permits`](crate::lease::Acquiring::permits)) | `N` | 1 (or [`Acquiring::weight`](crate::lease::Acquiring::weight)) |
/// | shared (a reader) | `N`, or [`Share::READERS`] | 1 |
/// | exclusive on a key with a capacity (a writer) | `N`, or [`Share::READERS`] | the whole capacity |
///
/// A key without a share (the default) is the plain exclusive lease: its layout in the store
/// and its cost are those of a lock with no counts. Every user of one key must agree on its
/// capacity, and take it the same way: a lease with a share asked for while a plain one holds
/// the key, or the other way round, is an error from the store (alone or in a key set), never
/// a wait or a second holder.
///
/// A store reads it from [`LockKey::share`](super::LockKey::share); a store that ignores it
/// treats every lease as exclusive, which never lets more holders in than the capacity allows,
/// but the engine refuses a share on a store that does not say it counts holders
/// ([`Capabilities::counts`](crate::store::Capabilities::counts)).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Share {
    weight: NonZeroU32,
    capacity: NonZeroU32,
}

impl Share {
    /// The capacity of a key whose leases are only shared or exclusive (no permits): readers
    /// take 1 each, a writer all of it.
    pub const READERS: u32 = u32::MAX;

    /// `weight` of `capacity`. Refused (naming the setting at fault) when either is 0 or the
    /// weight exceeds the capacity: such a lease could never be granted.
    pub fn new(weight: u32, capacity: u32) -> Result<Self, ConfigError> {
        let capacity = NonZeroU32::new(capacity).ok_or_else(|| {
            ConfigError::new(
                "permits",
                "a key needs at least 1 permit; leave permits unset for a plain lock",
            )
        })?;
        let weight = NonZeroU32::new(weight)
            .ok_or_else(|| ConfigError::new("weight", "a lease takes at least 1 permit"))?;
        if weight > capacity {
            return Err(ConfigError::new(
                "weight",
                "a lease may take at most the key's permits; it could never be granted",
            ));
        }
        Ok(Self { weight, capacity })
    }

    /// One permit of `capacity`.
    pub fn permit(capacity: u32) -> Result<Self, ConfigError> {
        Self::new(1, capacity)
    }

    /// The whole of `capacity`: excludes every other holder.
    pub fn exclusive(capacity: u32) -> Result<Self, ConfigError> {
        Self::new(capacity, capacity)
    }

    /// The weight this lease takes.
    pub fn weight(&self) -> u32 {
        self.weight.get()
    }

    /// The key's capacity.
    pub fn capacity(&self) -> u32 {
        self.capacity.get()
    }

    /// Whether this lease takes the whole capacity.
    pub fn is_exclusive(&self) -> bool {
        self.weight == self.capacity
    }
}

impl fmt::Debug for Share {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Share({} of {})", self.weight, self.capacity)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_shares_name_the_setting() {
        assert_eq!(Share::permit(0).unwrap_err().field(), "permits");
        assert_eq!(Share::new(0, 3).unwrap_err().field(), "weight");
        let over = Share::new(4, 3).unwrap_err();
        assert_eq!(over.field(), "weight");
        assert!(over.to_string().contains("never be granted"), "{over}");
        let writer = Share::exclusive(Share::READERS).unwrap();
        assert!(writer.is_exclusive());
        assert!(!Share::permit(2).unwrap().is_exclusive());
    }
}
