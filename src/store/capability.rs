//! What a store can do beyond [`LockStore`]'s four operations: [`Capabilities`], the
//! crate-private traits behind it, and [`Backend`], the engine's view of a store.

use std::{fmt, future::Future, pin::Pin, sync::Arc, task, time::Duration};

use bytes::Bytes;
use tokio::time::Instant;

use super::{Acquire, BoxFuture, LockStore, StoreError, fenced::FencedWrites};
use crate::{
    key::{KeySet, LockKey},
    token::Token,
};

/// What a store can do beyond the four operations of [`LockStore`].
///
/// | capability | what it gives | stores |
/// |---|---|---|
/// | group commit | the operations (acquires, renewals, releases) that reach the store together go to it in one call | `RedisStore` (one script per batch, or per hash slot), `ClusterStore`, `SentinelStore`, `RedlockStore` (a batch per node) |
/// | hand-off | a first-come-first-served queue per key: a release hands the key to the next waiter | `RedisStore::connect`, `SentinelStore` |
/// | release notices | waiters of this process woken by a release | `MemoryStore` |
/// | idempotency records | records written in the same atomic step as the release | `MemoryStore`, `RedisStore`, `ClusterStore`, `SentinelStore` |
/// | key sets | a lease's several keys taken (and released) in one step: all or none | `MemoryStore`, `RedisStore` (one script; per hash slot, slot by slot, where the server hashes keys to slots), `ClusterStore`, `SentinelStore`, `RedlockStore` (one script per node) |
///
/// `docs/TOPOLOGY.md` has the same matrix, with why each missing cell is missing, and
/// `tests/capabilities.rs` holds both against the stores. A store without a capability still
/// works everywhere: operations go one by one, waiters pace themselves by their wait policy, and
/// only the idempotency layer needs records (a compile-time bound,
/// [`IdempotencyStore`](crate::idempotency::IdempotencyStore)), and a lease on several keys takes them one
/// by one, in lock order, giving back what it took when one is held. The operations themselves are crate-private:
/// they carry protocol details (hand-off signals, record encodings) that change with the
/// scripts.
///
/// A store that wraps another forwards it (`self.inner.capabilities()`), and so keeps every
/// capability of what it wraps. Stores written outside this crate have none
/// ([`Capabilities::none`]), unless they wrap one of the crate's stores and forward its.
#[derive(Clone, Default)]
pub struct Capabilities {
    /// A property of the store's own transport, which the engine does not drive.
    pub(crate) group_commit: bool,
    /// The store counts a key's holders by weight (see [`Share`](crate::key::Share)): a
    /// property of its operations, which read [`LockKey::share`].
    pub(crate) counts: bool,
    pub(crate) hand_off: Option<Arc<dyn HandOff>>,
    pub(crate) release_notices: Option<Arc<dyn ReleaseNotices>>,
    pub(crate) records: Option<Arc<dyn Records>>,
    pub(crate) key_sets: Option<Arc<dyn AcquireSet>>,
    /// Fenced writes to data kept in the store (`crate::fence`): for `FencedData`, not the
    /// engine.
    pub(crate) fenced: Option<Arc<dyn FencedWrites>>,
    /// What the store's clones share, so that lockers over clones of one store know they hold
    /// the same locks (re-entry, `crate::engine::reentry`); `None`: each locker over the store
    /// is a store of its own.
    pub(crate) identity: Option<StoreId>,
}

impl Capabilities {
    /// No capability beyond the four operations (the default).
    pub fn none() -> Self {
        Self::default()
    }

    /// Whether the operations that reach the store together (acquires, renewals, releases,
    /// of any number of requests) go to it in one call: group commit.
    pub fn group_commit(&self) -> bool {
        self.group_commit
    }

    /// Whether the store admits several holders of a key with a capacity, by their weights
    /// ([`LockKey::share`]: permits, shared and exclusive leases). The engine refuses a lease
    /// with a share on a store without it.
    pub fn counts(&self) -> bool {
        self.counts
    }

    /// Whether the store queues waiters and hands a released key to the first of them.
    pub fn hand_off(&self) -> bool {
        self.hand_off.is_some()
    }

    /// Whether the store wakes this process's waiters when a key is released.
    pub fn release_notices(&self) -> bool {
        self.release_notices.is_some()
    }

    /// Whether the store keeps idempotency records, written with the release.
    pub fn idempotency_records(&self) -> bool {
        self.records.is_some()
    }

    /// Whether the store takes a lease's several keys in one step (all or none), rather than
    /// one by one with the ones taken given back when one is held.
    pub fn key_sets(&self) -> bool {
        self.key_sets.is_some()
    }
}

impl fmt::Debug for Capabilities {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Capabilities")
            .field("group_commit", &self.group_commit)
            .field("counts", &self.counts)
            .field("hand_off", &self.hand_off())
            .field("release_notices", &self.release_notices())
            .field("idempotency_records", &self.idempotency_records())
            .field("key_sets", &self.key_sets())
            .field("fenced_writes", &self.fenced.is_some())
            .finish()
    }
}

/// A first-come-first-served queue per key: a release hands the key straight to the head of
/// the queue instead of freeing it, so waiters never race each other (or the releasing
/// holder) for it.
pub(crate) trait HandOff: Send + Sync + 'static {
    /// Like [`LockStore::acquire`], for a caller that will wait: when the key is held, queues
    /// `token` ([`Attempt::Queued`]), or keeps its place if it is queued already; when the key
    /// was handed to `token`, claims it for `ttl` and answers `Acquired`. Until it acquires, a
    /// queued caller leaves the queue by releasing with its token.
    fn enqueue(
        self: Arc<Self>,
        key: LockKey,
        token: Token,
        ttl: Duration,
    ) -> BoxFuture<Result<Attempt, StoreError>>;

    /// Registers `token` to hear the hand-off of `key`, after `enqueue` answered
    /// [`Attempt::Queued`] with `since`; signals that arrived in between are delivered, and a
    /// [`Signal::Retry`] if the store's signals may have missed the waiter while the answer was
    /// on its way (see [`Epoch`]). `None`: this store cannot tell it now (its subscription is
    /// down).
    fn queue_watch(&self, key: &LockKey, token: &Token, since: Epoch) -> Option<QueueWatch>;
}

/// Announces releases to the waiters of this process.
pub(crate) trait ReleaseNotices: Send + Sync + 'static {
    /// Registers, now, for the next release of `key`.
    fn watch(&self, key: &LockKey) -> ReleaseNotice;
}

/// Idempotency records, next to the locks. Both operations are atomic in the store.
pub(crate) trait Records: Send + Sync + 'static {
    /// The record stored for `key`, if it has not expired.
    fn lookup(self: Arc<Self>, key: LockKey) -> BoxFuture<Result<Option<Bytes>, StoreError>>;

    /// Stores `record` for `retention`, fenced by `fencing_token`, and releases `key` if it
    /// holds `token` (hands it on, with hand-off), as one step. No other request may ever see
    /// the lock gone and the record missing.
    ///
    /// The record is stored unless a record with a higher fencing token is there, or another
    /// holder has the key (a newer request runs; its record is the one to keep): a response
    /// finished after its lease was lost is stored when nobody holds the key, so that a retry
    /// replays it rather than running the handler again, and never replaces a newer one.
    fn complete(
        self: Arc<Self>,
        key: LockKey,
        token: Token,
        fencing_token: u64,
        record: Bytes,
        retention: Duration,
    ) -> BoxFuture<Result<Completed, StoreError>>;
}

/// What [`Records::complete`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Completed {
    /// The record was stored.
    pub(crate) stored: bool,
    /// The key was held with the caller's token, and is released.
    pub(crate) released: bool,
}

/// Takes and gives back a lease's several keys at once.
///
/// An attempt takes every key of the set for the caller's token, or none: a caller that does
/// not get them all holds none of them as a lease. A key with a capacity
/// ([`LockKey::share`]) is taken for its weight, as a single key is, and waits in the key's one
/// queue (on a store that counts: the engine sends no share to one that does not). With hand-off on and a caller that will
/// wait, a store may queue it, and while it is queued keep for it the keys before the one it
/// waits for, in lock order (see `docs/DECISIONS.md`, "Sets of keys, and waiting for them").
pub(crate) trait AcquireSet: Send + Sync + 'static {
    /// One attempt at every key of `keys` for `token`, like [`LockStore::acquire`] for each
    /// (the caller's own token counts as free: the same attempt sent again). With `wait`, and a
    /// store that hands off, a held key queues the caller ([`SetAttempt::Queued`]). Until it
    /// acquires, a queued caller leaves the queue, and gives back what was kept for it, with
    /// [`release_set`](Self::release_set).
    fn acquire_set(
        self: Arc<Self>,
        keys: KeySet,
        token: Token,
        ttl: Duration,
        wait: bool,
    ) -> BoxFuture<Result<SetAttempt, StoreError>>;

    /// Gives back every key of `keys` held with `token` (with hand-off, each to its next
    /// waiter), and takes `token` out of their queues. Answers whether every key was held.
    fn release_set(
        self: Arc<Self>,
        keys: KeySet,
        token: Token,
    ) -> BoxFuture<Result<bool, StoreError>>;
}

/// The answer to an attempt at a set of keys.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum SetAttempt {
    /// Every key is held with the caller's token now; a fencing token per key, in lock order.
    Acquired { fencing_tokens: Vec<u64> },
    /// The key at `blocked` (in lock order) is held by another holder; the caller holds none.
    Contended {
        expires_in: Option<Duration>,
        blocked: usize,
    },
    /// The key at `blocked` is held by another holder, and the caller has a place in its
    /// hand-off queue: check again within `expires_in` if told nothing. `since`: for
    /// [`HandOff::queue_watch`].
    #[cfg_attr(not(feature = "redis"), allow(dead_code))] // constructed by the Redis stores
    Queued {
        expires_in: Option<Duration>,
        blocked: usize,
        since: Epoch,
    },
}

/// The answer to an attempt of a caller that may wait in a hand-off queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Attempt {
    /// Held with the caller's token now.
    Acquired { fencing_token: u64 },
    /// Held by another holder.
    Contended { expires_in: Option<Duration> },
    /// Held by another holder, and the caller has a place in the key's hand-off queue: check
    /// again within `expires_in` if told nothing. `since`: for [`HandOff::queue_watch`].
    #[cfg_attr(not(feature = "redis"), allow(dead_code))] // constructed by the Redis stores
    Queued {
        expires_in: Option<Duration>,
        since: Epoch,
    },
}

/// When a store's hand-off signals last changed course: a count of the times it told every
/// registered waiter to check again (its subscription broke, came back, or moved to another
/// server). Read before an attempt that may queue, and handed back with the attempt's
/// registration: a waiter whose answer ("queued") arrives after such a change was not
/// registered to hear it, and a release in between may have taken its queue entry for a dead
/// waiter's (nobody listened on its channel), so it checks again at once rather than sleep
/// until its fallback timer while the key is free.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Epoch(pub(crate) u64);

impl From<super::Acquire> for Attempt {
    fn from(answer: super::Acquire) -> Self {
        match answer {
            super::Acquire::Acquired { fencing_token } => Self::Acquired { fencing_token },
            super::Acquire::Contended { expires_in } => Self::Contended { expires_in },
        }
    }
}

/// What a queued waiter hears from its store, through [`QueueWatch::signal`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(not(feature = "redis"), allow(dead_code))] // constructed by the Redis stores
pub(crate) enum Signal {
    /// The key was handed to the waiter's token. It is held for the waiter at least until
    /// `valid_until` (or is already lost, if that has passed); the waiter confirms it with a
    /// renewal before then.
    Granted {
        fencing_token: u64,
        valid_until: Instant,
    },
    /// The waiter is next in line: the key was just handed to the waiter before it, which must
    /// confirm within `within`. If nothing else arrives by then, the waiter checks again.
    Next { within: Duration },
    /// Something may have changed (for example, the store's subscription reconnected and may
    /// have missed messages): check again now.
    Retry,
}

/// A waiter's registration with a store's hand-off queue. Dropping it unregisters.
pub(crate) struct QueueWatch(Pin<Box<dyn QueueSignals>>);

/// The source of a [`QueueWatch`]'s signals.
pub(crate) trait QueueSignals: Send {
    /// The next signal; pending until one arrives.
    fn poll_signal(self: Pin<&mut Self>, cx: &mut task::Context<'_>) -> task::Poll<Signal>;
}

impl QueueWatch {
    #[cfg_attr(not(feature = "redis"), allow(dead_code))] // constructed by the Redis stores
    pub(crate) fn new(signals: impl QueueSignals + 'static) -> Self {
        Self(Box::pin(signals))
    }

    /// Waits for the next signal.
    pub(crate) async fn signal(&mut self) -> Signal {
        std::future::poll_fn(|cx| self.0.as_mut().poll_signal(cx)).await
    }
}

impl fmt::Debug for QueueWatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("QueueWatch")
    }
}

/// A registration for the next release of one key, from [`ReleaseNotices::watch`].
///
/// Registered when created, so a release between the registration and the first poll is not
/// missed. It completes when the key may have been released; a waiter then retries at once. It
/// may complete spuriously, and may never complete (a lost message): waiters always keep a
/// fallback timer.
pub(crate) struct ReleaseNotice(Pin<Box<dyn Future<Output = ()> + Send>>);

impl ReleaseNotice {
    /// Wraps a future, already registered for the release, that completes when the key may
    /// have been released.
    pub(crate) fn new(future: impl Future<Output = ()> + Send + 'static) -> Self {
        Self(Box::pin(future))
    }
}

impl Future for ReleaseNotice {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut task::Context<'_>) -> task::Poll<()> {
        self.0.as_mut().poll(cx)
    }
}

impl fmt::Debug for ReleaseNotice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ReleaseNotice")
    }
}

/// Which store a lease was taken on: the address of what the store's clones share (its
/// connection's committer, its nodes), compared, never dereferenced. Lockers over clones of one
/// store compare equal, so that a task re-enters a lease another locker over the same store
/// took (`crate::engine::reentry`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub(crate) struct StoreId(usize);

impl StoreId {
    /// The identity of whatever `shared` points to.
    pub(crate) fn of<T: ?Sized>(shared: &Arc<T>) -> Self {
        Self(Arc::as_ptr(shared).cast::<()>() as usize)
    }
}

/// The view of a store the engine holds: its four operations, object-safe, and its
/// capabilities, resolved once when the locker is built.
pub(crate) struct Backend {
    store: Arc<dyn super::DynStore>,
    caps: Capabilities,
}

impl Backend {
    pub(crate) fn new(store: impl LockStore) -> Self {
        let mut caps = store.capabilities();
        let store: Arc<dyn super::DynStore> = Arc::new(store);
        caps.identity = Some(caps.identity.unwrap_or(StoreId::of(&store)));
        Self { store, caps }
    }

    /// Which store this is: the same for lockers over clones of one of the crate's stores.
    pub(crate) fn identity(&self) -> StoreId {
        self.caps.identity.unwrap_or_default()
    }

    /// What the store can do beyond the four operations.
    pub(crate) fn capabilities(&self) -> &Capabilities {
        &self.caps
    }

    /// One attempt; with `wait` and a store that hands off, one that queues the caller.
    pub(crate) fn attempt(
        &self,
        key: LockKey,
        token: Token,
        ttl: Duration,
        wait: bool,
    ) -> BoxFuture<Result<Attempt, StoreError>> {
        match (&self.caps.hand_off, wait) {
            (Some(hand_off), true) => Arc::clone(hand_off).enqueue(key, token, ttl),
            _ => {
                let acquire = Arc::clone(&self.store).acquire(key, token, ttl);
                Box::pin(async move { acquire.await.map(Attempt::from) })
            }
        }
    }

    /// One attempt at a set of keys: in one step where the store can (its
    /// [`key_sets`](Capabilities::key_sets)), else key by key in lock order, giving back the
    /// keys taken when one is held (and when one fails: it may have been taken).
    pub(crate) fn attempt_set(
        &self,
        keys: KeySet,
        token: Token,
        ttl: Duration,
        wait: bool,
    ) -> BoxFuture<Result<SetAttempt, StoreError>> {
        if let Some(sets) = &self.caps.key_sets {
            return Arc::clone(sets).acquire_set(keys, token, ttl, wait);
        }
        let store = Arc::clone(&self.store);
        Box::pin(async move {
            let mut fencing_tokens = Vec::with_capacity(keys.len());
            for (i, key) in keys.iter().enumerate() {
                let answer = Arc::clone(&store)
                    .acquire(key.clone(), token.clone(), ttl)
                    .await;
                let (taken, outcome) = match answer {
                    Ok(Acquire::Acquired { fencing_token }) => {
                        fencing_tokens.push(fencing_token);
                        continue;
                    }
                    Ok(Acquire::Contended { expires_in }) => (
                        i,
                        Ok(SetAttempt::Contended {
                            expires_in,
                            blocked: i,
                        }),
                    ),
                    // A failed call may still have taken its key.
                    Err(error) => (i + 1, Err(error)),
                };
                let rollback = keys.as_slice()[..taken]
                    .iter()
                    .map(|key| Arc::clone(&store).release_unbounded(key.clone(), token.clone()));
                for (key, answer) in keys
                    .iter()
                    .zip(futures_util::future::join_all(rollback).await)
                {
                    if let Err(error) = answer {
                        tracing::warn!(
                            scope = %key.scope(),
                            error = &error as &dyn std::error::Error,
                            "giving back a key of a set failed; it frees itself when its TTL runs out"
                        );
                    }
                }
                return outcome;
            }
            Ok(SetAttempt::Acquired { fencing_tokens })
        })
    }

    /// Releases every key of `keys` held with `token`: in one step where the store can, else
    /// key by key, all at once. Fails with a timeout error after `limit`.
    pub(crate) fn release_set(
        &self,
        keys: KeySet,
        token: Token,
        limit: Duration,
    ) -> BoxFuture<Result<bool, StoreError>> {
        if let Some(key) = keys.as_one() {
            return self.release(key.clone(), token, limit);
        }
        let release: BoxFuture<Result<bool, StoreError>> = match &self.caps.key_sets {
            Some(sets) => Arc::clone(sets).release_set(keys, token),
            _ => {
                let releases: Vec<_> = keys
                    .iter()
                    .map(|key| {
                        Arc::clone(&self.store).release_unbounded(key.clone(), token.clone())
                    })
                    .collect();
                Box::pin(async move {
                    let mut all = true;
                    for answer in futures_util::future::join_all(releases).await {
                        all &= answer?;
                    }
                    Ok(all)
                })
            }
        };
        Box::pin(crate::background::bounded(limit, release))
    }

    /// Registers for the next release of any of `keys` (a store that announces them).
    pub(crate) fn watch_any(&self, keys: &KeySet) -> Option<ReleaseNotice> {
        let notices = self.caps.release_notices.as_ref()?;
        if let Some(key) = keys.as_one() {
            return Some(notices.watch(key));
        }
        let watches: Vec<ReleaseNotice> = keys.iter().map(|key| notices.watch(key)).collect();
        Some(ReleaseNotice::new(async move {
            futures_util::future::select_all(watches).await;
        }))
    }

    /// Registers `token`'s waiter for the hand-off of `key` (a store that hands off), after an
    /// attempt answered "queued" with `since`.
    pub(crate) fn queue_watch(
        &self,
        key: &LockKey,
        token: &Token,
        since: Epoch,
    ) -> Option<QueueWatch> {
        self.caps.hand_off.as_ref()?.queue_watch(key, token, since)
    }

    pub(crate) fn renew(
        &self,
        key: LockKey,
        token: Token,
        ttl: Duration,
    ) -> BoxFuture<Result<bool, StoreError>> {
        Arc::clone(&self.store).renew(key, token, ttl)
    }

    /// A release that fails with a timeout error after `limit`.
    pub(crate) fn release(
        &self,
        key: LockKey,
        token: Token,
        limit: Duration,
    ) -> BoxFuture<Result<bool, StoreError>> {
        Arc::clone(&self.store).release(key, token, limit)
    }

    pub(crate) fn validity(&self, ttl: Duration) -> Duration {
        self.store.validity(ttl)
    }

    /// Whether the store counts holders by weight ([`Capabilities::counts`]).
    pub(crate) fn counts(&self) -> bool {
        self.caps.counts
    }
}
