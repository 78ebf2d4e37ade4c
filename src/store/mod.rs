//! Lock stores: where leases live.
//!
//! A store implements [`LockStore`]: three atomic operations on one key, each guarded by the
//! holder's [`Token`]. [`MemoryStore`] keeps leases in the process (one instance, tests, demos);
//! [`RedisStore`] shares them between every instance that talks to the same Redis.
//!
//! A store only answers; waiting, renewing on a schedule and releasing on drop are the
//! [`Locker`](crate::Locker)'s job, so a new backend is a few dozen lines.

#[cfg(feature = "cluster")]
mod cluster;
mod handoff;
mod memory;
mod redis;
mod redlock;
#[cfg(feature = "sentinel")]
mod sentinel;
mod slot;
mod watch;

use std::{error::Error as StdError, fmt, future::Future, pin::Pin, sync::Arc, time::Duration};

use tokio::time::Instant;

#[cfg(feature = "cluster")]
pub use self::cluster::ClusterStore;
pub use self::memory::MemoryStore;
pub use self::redis::RedisStore;
pub(crate) use self::redis::{lock_script, lock_script_source, script_source};
pub use self::redlock::RedlockStore;
#[cfg(feature = "sentinel")]
pub use self::sentinel::SentinelStore;
pub use self::watch::ReleaseWatch;
pub(crate) use self::watch::Releases;
use crate::{key::LockKey, token::Token};

/// The answer to an acquire attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Acquire {
    /// The key was free and is now held with the caller's token.
    Acquired {
        /// Strictly greater than every fencing token handed out before for the same key.
        fencing_token: u64,
    },
    /// Another holder has the key.
    Held {
        /// How long the current holder's lease has left, when the store knows.
        expires_in: Option<Duration>,
    },
    /// Another holder has the key, and the caller now has a place in the key's wait queue
    /// (only from [`LockStore::enqueue`]): a release will hand the key to the caller's token,
    /// announced on the caller's [`QueueWatch`]. Until the caller acquires, it must
    /// [`release`](LockStore::release) with its token to leave the queue.
    Queued {
        /// How long until the caller should check again if it hears nothing: the holder's
        /// remaining lease, or less.
        expires_in: Option<Duration>,
    },
}

/// What a queued waiter hears from its store, through [`QueueWatch::signal`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Signal {
    /// The key was handed to the waiter's token. It is held for the waiter at least until
    /// `valid_until` (or is already lost, if that has passed); the waiter confirms it with a
    /// renewal before then.
    Granted {
        /// The lease's fencing token.
        fencing_token: u64,
        /// A lower bound on when the handed-over lease runs out, unless renewed.
        valid_until: Instant,
    },
    /// The waiter is next in line: the key was just handed to the waiter before it, which must
    /// confirm within `within`. If nothing else arrives by then, the waiter checks again.
    Next {
        /// The hand-off's claim window.
        within: Duration,
    },
    /// Something may have changed (for example, the store's subscription reconnected and may
    /// have missed messages): check again now.
    Retry,
}

/// A waiter's registration with a store's hand-off queue, made by [`LockStore::queue_watch`]
/// once an attempt answered [`Acquire::Queued`]. Dropping it unregisters.
pub struct QueueWatch(Pin<Box<dyn QueueSignals>>);

/// The source of a [`QueueWatch`]'s signals.
pub trait QueueSignals: Send {
    /// The next signal; pending until one arrives.
    fn poll_signal(
        self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Signal>;
}

impl QueueWatch {
    /// Wraps a source of signals.
    pub fn new(signals: impl QueueSignals + 'static) -> Self {
        Self(Box::pin(signals))
    }

    /// Waits for the next signal.
    pub async fn signal(&mut self) -> Signal {
        std::future::poll_fn(|cx| self.0.as_mut().poll_signal(cx)).await
    }
}

impl fmt::Debug for QueueWatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("QueueWatch")
    }
}

/// A backend that can hold leases.
///
/// Each operation must be atomic in the store:
///
/// - `acquire`: if `key` is free, set it to `token` with a time to live of `ttl` and return a new
///   fencing token; otherwise report that it is held.
/// - `renew`: if `key` holds `token`, reset its time to live to `ttl` and return `true`;
///   otherwise return `false` and change nothing.
/// - `release`: if `key` holds `token`, delete it (or, in a store that hands off, give it to the
///   next queued waiter) and return `true`; otherwise return `false` and change nothing (except
///   that a store that hands off takes `token` out of the key's queue: a waiter leaving).
///
/// Implementations write `async fn`; the futures must be `Send`.
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

    /// Extends several held leases to `ttl` from now, answering for each as
    /// [`renew`](Self::renew) would. The default renews them concurrently; a store that can do
    /// it in one round trip overrides it ([`RedisStore`] sends one script for the whole batch).
    /// The locker batches the renewals that fall due within a couple of milliseconds.
    fn renew_many(
        &self,
        leases: &[(LockKey, Token)],
        ttl: Duration,
    ) -> impl Future<Output = Vec<Result<bool, StoreError>>> + Send {
        futures_util::future::join_all(
            leases
                .iter()
                .map(move |(key, token)| self.renew(key, token, ttl)),
        )
    }

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

    /// Registers, now, for the next release of `key`, so that a waiter can retry the moment the
    /// holder lets go rather than when its timer fires. `None` (the default): this store cannot
    /// tell, and waiters pace their retries by the [`Wait`](crate::Wait) policy alone.
    ///
    /// With a watch, a waiter sleeps until the watch fires or the holder's lease would run out
    /// (or its deadline comes), whichever is first: a lost notification costs at most one TTL.
    fn watch(&self, key: &LockKey) -> Option<ReleaseWatch> {
        let _ = key;
        None
    }

    /// Registers `token` to hear the hand-off of `key`, after [`enqueue`](Self::enqueue)
    /// answered [`Acquire::Queued`]. The store must deliver signals that arrived in between.
    /// `None` (the default): this store does not hand off.
    fn queue_watch(&self, key: &LockKey, token: &Token) -> Option<QueueWatch> {
        let _ = (key, token);
        None
    }

    /// Like [`acquire`](Self::acquire), for a caller that will wait: when the key is held, a
    /// store that hands off queues `token` ([`Acquire::Queued`]), or keeps its place if it is
    /// queued already, and when the key was handed to `token`, claims it (for `ttl`) and
    /// answers `Acquired`. The default is `acquire`.
    ///
    /// A store that hands off keeps a first-come-first-served queue per key: a release gives
    /// the key straight to the head of the queue instead of freeing it, so waiters never race
    /// each other (or the releasing holder) for it. [`RedisStore`] does, by default.
    fn enqueue(
        &self,
        key: &LockKey,
        token: &Token,
        ttl: Duration,
    ) -> impl Future<Output = Result<Acquire, StoreError>> + Send {
        self.acquire(key, token, ttl)
    }
}

pub(crate) type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

/// The object-safe form of [`LockStore`] that the layer and locker hold, so that their types do
/// not carry the store's type.
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
    fn renew_many(
        self: Arc<Self>,
        leases: Vec<(LockKey, Token)>,
        ttl: Duration,
    ) -> BoxFuture<Vec<Result<bool, StoreError>>>;
    /// A release that fails with a timeout error after `limit`.
    fn release(
        self: Arc<Self>,
        key: LockKey,
        token: Token,
        limit: Duration,
    ) -> BoxFuture<Result<bool, StoreError>>;
    fn validity(&self, ttl: Duration) -> Duration;
    fn watch(&self, key: &LockKey) -> Option<ReleaseWatch>;
    fn queue_watch(&self, key: &LockKey, token: &Token) -> Option<QueueWatch>;
    fn enqueue(
        self: Arc<Self>,
        key: LockKey,
        token: Token,
        ttl: Duration,
    ) -> BoxFuture<Result<Acquire, StoreError>>;
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

    fn renew_many(
        self: Arc<Self>,
        leases: Vec<(LockKey, Token)>,
        ttl: Duration,
    ) -> BoxFuture<Vec<Result<bool, StoreError>>> {
        Box::pin(async move { LockStore::renew_many(&*self, &leases, ttl).await })
    }

    fn release(
        self: Arc<Self>,
        key: LockKey,
        token: Token,
        limit: Duration,
    ) -> BoxFuture<Result<bool, StoreError>> {
        Box::pin(async move {
            tokio::time::timeout(limit, LockStore::release(&*self, &key, &token))
                .await
                .unwrap_or_else(|_| Err(StoreError::timeout(limit)))
        })
    }

    fn validity(&self, ttl: Duration) -> Duration {
        LockStore::validity(self, ttl)
    }

    fn watch(&self, key: &LockKey) -> Option<ReleaseWatch> {
        LockStore::watch(self, key)
    }

    fn queue_watch(&self, key: &LockKey, token: &Token) -> Option<QueueWatch> {
        LockStore::queue_watch(self, key, token)
    }

    fn enqueue(
        self: Arc<Self>,
        key: LockKey,
        token: Token,
        ttl: Duration,
    ) -> BoxFuture<Result<Acquire, StoreError>> {
        Box::pin(async move { LockStore::enqueue(&*self, &key, &token, ttl).await })
    }
}

/// What kind of failure a [`StoreError`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum StoreErrorKind {
    /// The store did not answer in time.
    Timeout,
    /// The store could not be reached, or the connection broke.
    Unavailable,
    /// The store answered with an error or an unexpected reply.
    Backend,
    /// No randomness was available to draw a lock token.
    Entropy,
}

/// A lock store failed to answer. The layer turns it into a 503 with `Retry-After`.
///
/// The underlying error is kept as the [`source`](std::error::Error::source).
#[derive(Clone)]
pub struct StoreError {
    kind: StoreErrorKind,
    message: Arc<str>,
    source: Option<Arc<dyn StdError + Send + Sync>>,
}

impl StoreError {
    /// An error of `kind` caused by `source`.
    pub fn new(
        kind: StoreErrorKind,
        message: impl Into<Arc<str>>,
        source: impl Into<Box<dyn StdError + Send + Sync>>,
    ) -> Self {
        Self {
            kind,
            message: message.into(),
            source: Some(Arc::from(source.into())),
        }
    }

    /// An error of `kind` with no underlying cause.
    pub fn msg(kind: StoreErrorKind, message: impl Into<Arc<str>>) -> Self {
        Self {
            kind,
            message: message.into(),
            source: None,
        }
    }

    pub(crate) fn timeout(after: Duration) -> Self {
        Self::msg(
            StoreErrorKind::Timeout,
            format!("the lock store did not answer within {after:?}"),
        )
    }

    pub(crate) fn entropy(source: getrandom::Error) -> Self {
        Self::new(
            StoreErrorKind::Entropy,
            "the operating system could not provide randomness for a lock token",
            Box::<dyn StdError + Send + Sync>::from(source.to_string()),
        )
    }

    /// What kind of failure this is.
    pub fn kind(&self) -> StoreErrorKind {
        self.kind
    }
}

impl fmt::Debug for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StoreError")
            .field("kind", &self.kind)
            .field("message", &self.message)
            .field("source", &self.source)
            .finish()
    }
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl StdError for StoreError {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        self.source
            .as_deref()
            .map(|e| e as &(dyn StdError + 'static))
    }
}
