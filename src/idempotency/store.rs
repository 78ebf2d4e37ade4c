//! Which stores keep records: next to the locks, in the same store.

use crate::store::LockStore;

/// A [`LockStore`] that also keeps idempotency records, next to its locks: the stores the
/// [`IdempotencyLayer`](crate::IdempotencyLayer) runs on.
///
/// Implemented for [`MemoryStore`](crate::MemoryStore), [`RedisStore`](crate::RedisStore)
/// (one Lua script writes the record and releases the lock), and the stores built on it
/// (`ClusterStore`, `SentinelStore`). Sealed: a record must be written in the same atomic
/// step that releases the lock, which only the store's own scripts can promise, so it cannot
/// be implemented outside this crate (a wrapper around one of these stores keeps their
/// records through [`LockStore::capabilities`], but is not an `IdempotencyStore` itself).
pub trait IdempotencyStore: LockStore + Clone + sealed::Sealed {}

#[allow(unreachable_pub)]
pub mod sealed {
    /// Keeps [`IdempotencyStore`](super::IdempotencyStore) to this crate's stores.
    pub trait Sealed {}
}

macro_rules! keeps_records {
    ($($(#[$attr:meta])* $store:ty,)*) => {
        $(
            $(#[$attr])*
            impl sealed::Sealed for $store {}
            $(#[$attr])*
            impl IdempotencyStore for $store {}
        )*
    };
}

keeps_records! {
    crate::MemoryStore,
    #[cfg(feature = "redis")]
    crate::RedisStore,
    #[cfg(feature = "cluster")]
    crate::store::ClusterStore,
    #[cfg(feature = "sentinel")]
    crate::store::SentinelStore,
}
