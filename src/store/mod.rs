//! Lock stores: where leases live.
//!
//! A store implements [`LockStore`]: three atomic operations on one key, each guarded by the
//! holder's [`Token`], and how long a lease is known to last. [`MemoryStore`](crate::MemoryStore) keeps leases in
//! the process (one instance, tests, demos); [`RedisStore`] shares them between every instance
//! that talks to the same Redis; [`RedlockStore`], `ClusterStore` and `SentinelStore` are
//! built on it for other topologies.
//!
//! A store only answers; waiting, renewing on a schedule and releasing on drop are the
//! [`Locker`](crate::Locker)'s job, so a new backend is a few dozen lines. The crate's own
//! stores can do more (group commit, hand-off, release notices, idempotency records, key
//! sets): see [`Capabilities`].

mod capability;
#[cfg(feature = "cluster")]
mod cluster;
pub(crate) mod error;
#[cfg(feature = "redis")]
mod eviction;
pub(crate) mod fenced;
pub(crate) mod memory;
#[cfg(feature = "redis")]
pub(crate) mod redis;
#[cfg(feature = "redis")]
mod redlock;
#[cfg(feature = "sentinel")]
mod routed;
#[cfg(feature = "sentinel")]
mod sentinel;
#[cfg(test)]
mod tests;
#[cfg(feature = "tls")]
mod tls;

use std::{future::Future, pin::Pin, sync::Arc, time::Duration};

pub use self::capability::Capabilities;
pub(crate) use self::capability::{
    AcquireSet, Attempt, Backend, Completed, Epoch, QueueWatch, Records, ReleaseNotice,
    ReleaseNotices, SetAttempt, Signal, StoreId,
};
#[cfg(any(feature = "redis", test))]
pub(crate) use self::capability::{HandOff, QueueSignals};
#[cfg(feature = "cluster")]
pub use self::cluster::ClusterStore;
pub use self::error::{StoreError, StoreErrorKind};
#[cfg(feature = "redis")]
pub use self::eviction::Eviction;
#[cfg(feature = "redis")]
pub(crate) use self::redis::RedisStore;
#[cfg(feature = "redis")]
pub use self::redlock::RedlockStore;
#[cfg(feature = "sentinel")]
pub(crate) use self::routed::Route;
#[cfg(feature = "sentinel")]
pub use self::sentinel::SentinelStore;
#[cfg(feature = "tls")]
pub use self::tls::TlsConfig;
#[cfg(feature = "tls")]
pub(crate) use self::tls::prepare as prepare_tls;
use crate::key::LockKey;
pub use crate::token::Token;

/// The answer to an acquire attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Acquire {
    /// The key was free (or already held with the caller's token) and is now held with the
    /// caller's token.
    Acquired {
        /// Strictly greater than every fencing token handed out before for the same key, and no
        /// lower than the clock in µs since the Unix epoch when it was handed out (the crate's
        /// stores give `max(last + 1, now)`): a fenced batch on a resource whose fence has
        /// expired refuses a token older than its horizon (see `crate::fence`).
        fencing_token: u64,
    },
    /// Another holder has the key.
    Contended {
        /// How long the current holder's lease has left, when the store knows.
        expires_in: Option<Duration>,
    },
}

/// A backend that can hold leases.
///
/// Each operation must be atomic in the store:
///
/// - `acquire`: if `key` is free, set it to `token` with a time to live of `ttl` and return a new
///   fencing token; if it already holds `token` (the same acquire sent again: a client that
///   re-sends a request whose reply was lost, or a store that runs it again on a new master),
///   reset its time to live to `ttl` and return a new fencing token, since the caller never saw
///   the first; otherwise report that it is held.
/// - `renew`: if `key` holds `token`, reset its time to live to `ttl` and return `true`;
///   otherwise return `false` and change nothing.
/// - `release`: if `key` holds `token`, delete it (or, in a store that hands off, give it to the
///   next queued waiter) and return `true`; otherwise return `false` and change nothing (except
///   that a store that hands off takes `token` out of the key's queue: a waiter leaving).
///
/// Implementations write `async fn`; the futures must be `Send`.
///
/// # Never block
///
/// The crate's own runtime (one thread for the process, see `docs/ARCHITECTURE.md`) polls
/// store futures for the work nobody else polls: background renewals, releases on drop and the
/// retries of failed releases, with the `tracing` and `metrics` calls made there. None of them
/// may block (no synchronous I/O, no `std::sync` lock held long, no `block_on`): while one
/// does, every renewal and release of every store of the process waits, and leases may expire.
/// Put blocking work on [`tokio::task::spawn_blocking`] and await it.
pub trait LockStore: Send + Sync + 'static {
    /// Tries once to take `key` for `ttl`.
    fn acquire(
        &self,
        key: &LockKey,
        token: &Token,
        ttl: Duration,
    ) -> impl Future<Output = Result<Acquire, StoreError>> + Send;

    /// Extends a held lease to `ttl` from now. `Ok(false)` means the lease is not ours any more.
    fn renew(
        &self,
        key: &LockKey,
        token: &Token,
        ttl: Duration,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// Gives a held lease back. `Ok(false)` means it was not ours (any more).
    fn release(
        &self,
        key: &LockKey,
        token: &Token,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// How long a lease acquired or renewed for `ttl` is known to be held, counted from when
    /// the acquire or renew was sent: what [`Lease::time_left`](crate::Lease::time_left) reports.
    ///
    /// The default is `ttl`. A store whose servers' clocks may run faster than the caller's
    /// answers less: [`RedlockStore`] subtracts its clock drift allowance (`ttl` x 1% + 2 ms by
    /// default), which with the time the call took gives Redlock's validity time.
    fn validity(&self, ttl: Duration) -> Duration {
        ttl
    }

    /// What this store can do beyond these four operations (none, by default). A store that
    /// wraps one of the crate's stores answers with the wrapped store's, and so keeps every
    /// capability of what it wraps; see [`Capabilities`].
    fn capabilities(&self) -> Capabilities {
        Capabilities::none()
    }
}

pub(crate) type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

/// The object-safe form of [`LockStore`] that the engine holds (in a [`Backend`]), so that the
/// layers' and locker's types do not carry the store's type.
pub(crate) trait DynStore: Send + Sync + 'static {
    fn acquire(
        self: Arc<Self>,
        key: LockKey,
        token: Token,
        ttl: Duration,
    ) -> BoxFuture<Result<Acquire, StoreError>>;
    fn renew(
        self: Arc<Self>,
        key: LockKey,
        token: Token,
        ttl: Duration,
    ) -> BoxFuture<Result<bool, StoreError>>;
    /// A release that fails with a timeout error after `limit`.
    fn release(
        self: Arc<Self>,
        key: LockKey,
        token: Token,
        limit: Duration,
    ) -> BoxFuture<Result<bool, StoreError>>;
    /// A release, unbounded (the caller bounds it).
    fn release_unbounded(
        self: Arc<Self>,
        key: LockKey,
        token: Token,
    ) -> BoxFuture<Result<bool, StoreError>>;
    fn validity(&self, ttl: Duration) -> Duration;
}

impl<S: LockStore> DynStore for S {
    fn acquire(
        self: Arc<Self>,
        key: LockKey,
        token: Token,
        ttl: Duration,
    ) -> BoxFuture<Result<Acquire, StoreError>> {
        Box::pin(async move { LockStore::acquire(&*self, &key, &token, ttl).await })
    }

    fn renew(
        self: Arc<Self>,
        key: LockKey,
        token: Token,
        ttl: Duration,
    ) -> BoxFuture<Result<bool, StoreError>> {
        Box::pin(async move { LockStore::renew(&*self, &key, &token, ttl).await })
    }

    fn release(
        self: Arc<Self>,
        key: LockKey,
        token: Token,
        limit: Duration,
    ) -> BoxFuture<Result<bool, StoreError>> {
        Box::pin(async move {
            crate::background::bounded(limit, LockStore::release(&*self, &key, &token)).await
        })
    }

    fn release_unbounded(
        self: Arc<Self>,
        key: LockKey,
        token: Token,
    ) -> BoxFuture<Result<bool, StoreError>> {
        Box::pin(async move { LockStore::release(&*self, &key, &token).await })
    }

    fn validity(&self, ttl: Duration) -> Duration {
        LockStore::validity(self, ttl)
    }
}
