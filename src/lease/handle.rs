//! What a holder sees of its lock.

use std::{
    fmt,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU8, AtomicU32, AtomicU64, AtomicUsize, Ordering},
    },
    time::{Duration, SystemTime},
};

use futures_util::task::AtomicWaker;
use tokio::{sync::Notify, time::Instant};

use crate::{
    error::LostReason,
    key::{KeySet, LockKey},
};

/// A held lock, as the request handler (or background task) sees it.
///
/// The layer puts a `Lease` into the request extensions; with the `axum` feature it is an
/// extractor (`lease: Lease`, or `Option<Lease>` on routes where the layer may pass requests
/// through). Cheap to clone: clones observe the same lease.
///
/// A lease holds one key or a set of them ([`keys`](Self::keys)), each with a fencing token
/// of its own ([`fencing_tokens`](Self::fencing_tokens)); they were taken together and are
/// renewed, lost and released together. [`key`](Self::key) and
/// [`fencing_token`](Self::fencing_token) are those of the first key in lock order: of the
/// only key, for a lease on one.
///
/// ```
/// # #[cfg(feature = "axum")] {
/// use axum::{extract::Path, http::StatusCode};
/// use tower_lock::Lease;
///
/// async fn purchase(lease: Lease, Path(sku): Path<String>) -> Result<String, StatusCode> {
///     // Pass the fencing token to the database so it can refuse writes from a stale holder.
///     let token = lease.fencing_token();
///     if lease.is_lost() {
///         return Err(StatusCode::SERVICE_UNAVAILABLE);
///     }
///     Ok(format!("bought {sku} under fencing token {token}"))
/// }
/// # }
/// ```
#[derive(Clone)]
pub struct Lease {
    inner: Arc<Inner>,
}

struct Inner {
    keys: KeySet,
    fences: Fences,
    acquired_at: Instant,
    acquired_at_system: SystemTime,
    /// Nanoseconds after `acquired_at` when the lease runs out, as last confirmed by the store.
    valid_until: AtomicU64,
    /// 0 while held, else `LostReason` as 1 + its index.
    lost: AtomicU8,
    renewals: AtomicU32,
    /// Set when its holder sends the release: renewals stop, and a "not held" answer to one
    /// already on its way is the release's doing, not a loss.
    releasing: AtomicBool,
    notify: Notify,
    /// The background renewal of this lease, woken when its holder releases it.
    on_release: AtomicWaker,
    /// Set when a fenced batch that writes is first sent under this lease: from then on a loss
    /// no longer aborts its holder (the fence decides whether each write lands; `crate::fence`).
    fenced: AtomicBool,
    /// Whether a fenced batch under it was refused as stale.
    refused: AtomicBool,
    /// The nested guards on this lease (re-entries of its holder's task) still alive: when the
    /// holder releases while one is, that guard's lease has ended under it, and is marked lost.
    nested: AtomicUsize,
}

const REASONS: [LostReason; 3] = [
    LostReason::NotHeld,
    LostReason::Expired,
    LostReason::MaxHold,
];

/// The fencing tokens of a lease's keys, in the keys' lock order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Fences {
    One(u64),
    Many(Box<[u64]>),
}

impl Fences {
    pub(crate) fn as_slice(&self) -> &[u64] {
        match self {
            Self::One(token) => std::slice::from_ref(token),
            Self::Many(tokens) => tokens,
        }
    }

    /// The first key's.
    pub(crate) fn first(&self) -> u64 {
        self.as_slice().first().copied().unwrap_or(0)
    }
}

impl From<u64> for Fences {
    fn from(token: u64) -> Self {
        Self::One(token)
    }
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

impl Lease {
    /// A lease on `keys` just acquired at `acquired_at` for `ttl`, with a fencing token per key.
    pub(crate) fn new(
        keys: impl Into<KeySet>,
        fences: impl Into<Fences>,
        acquired_at: Instant,
        ttl: Duration,
    ) -> Self {
        let (keys, fences) = (keys.into(), fences.into());
        debug_assert_eq!(keys.len(), fences.as_slice().len());
        Self {
            inner: Arc::new(Inner {
                keys,
                fences,
                acquired_at,
                acquired_at_system: SystemTime::now(),
                valid_until: AtomicU64::new(nanos(ttl)),
                lost: AtomicU8::new(0),
                renewals: AtomicU32::new(0),
                releasing: AtomicBool::new(false),
                notify: Notify::new(),
                on_release: AtomicWaker::new(),
                fenced: AtomicBool::new(false),
                refused: AtomicBool::new(false),
                nested: AtomicUsize::new(0),
            }),
        }
    }

    /// The key this lease holds: for a lease on several keys, the first in lock order (see
    /// [`keys`](Self::keys)).
    pub fn key(&self) -> &LockKey {
        self.inner
            .keys
            .first()
            .expect("a lease holds at least one key")
    }

    /// Every key this lease holds, in lock order.
    pub fn keys(&self) -> &KeySet {
        &self.inner.keys
    }

    /// The fencing token: strictly greater than the token of every earlier holder of this key.
    ///
    /// Pass it with every write the lock protects, and have the storage refuse a write whose
    /// token is lower than the highest it has seen: then a holder that stalled past its lease
    /// (a GC pause, a network partition) cannot overwrite its successor's work.
    ///
    /// For a lease on several keys, each key has a token of its own, and this is the first
    /// key's ([`key`](Self::key)): fence the write to each resource with its own key's token,
    /// from [`fencing_tokens`](Self::fencing_tokens) or [`fencing_token_of`](Self::fencing_token_of).
    pub fn fencing_token(&self) -> u64 {
        self.inner.fences.first()
    }

    /// Each key with its fencing token, in lock order.
    ///
    /// ```
    /// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
    /// use tower_lock::{Locker, MemoryStore};
    ///
    /// let locker = Locker::new(MemoryStore::new());
    /// let guard = locker
    ///     .acquire([locker.key("accounts", "alice")?, locker.key("accounts", "bob")?])
    ///     .await?;
    /// for (key, token) in guard.fencing_tokens() {
    ///     println!("write {:?} with fencing token {token}", key.value());
    /// }
    /// # Ok(()) }
    /// ```
    pub fn fencing_tokens(&self) -> impl ExactSizeIterator<Item = (&LockKey, u64)> + '_ {
        self.inner
            .keys
            .iter()
            .zip(self.inner.fences.as_slice().iter().copied())
    }

    /// The fencing token of `key`, if this lease holds it.
    pub fn fencing_token_of(&self, key: &LockKey) -> Option<u64> {
        let i = self.inner.keys.position(key)?;
        self.inner.fences.as_slice().get(i).copied()
    }

    /// The key this lease holds for `value` (the value it was derived from, as
    /// [`LockKey::value`] gives it), if any: for a lease on several keys, to find one
    /// resource's key and fencing token without searching [`keys`](Self::keys).
    ///
    /// ```
    /// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
    /// use tower_lock::{Locker, MemoryStore};
    ///
    /// let locker = Locker::new(MemoryStore::new());
    /// let guard = locker
    ///     .acquire([locker.key("accounts", "alice")?, locker.key("accounts", "bob")?])
    ///     .await?;
    /// let bob = guard.key_for("bob").expect("the lease holds bob");
    /// let token = guard.fencing_token_of(bob);
    /// # assert!(token.is_some());
    /// # let both = locker
    /// #     .acquire([locker.key("accounts", "carol")?, locker.key("cards", "carol")?])
    /// #     .await?;
    /// # assert!(both.key_for("carol").is_none(), "two scopes hold carol");
    /// # Ok(()) }
    /// ```
    ///
    /// `None` as well when the lease holds that value in more than one scope (keys of
    /// different namespaces with equal values): which resource was meant is not the lease's to
    /// guess; look through [`keys`](Self::keys) for the key of the scope you want.
    pub fn key_for(&self, value: impl AsRef<[u8]>) -> Option<&LockKey> {
        let value = value.as_ref();
        let mut matching = self.inner.keys.iter().filter(|key| key.value() == value);
        let key = matching.next()?;
        matching.next().is_none().then_some(key)
    }

    /// When the lease was acquired (wall clock).
    pub fn acquired_at(&self) -> SystemTime {
        self.inner.acquired_at_system
    }

    /// How long the lease has been held.
    pub fn held_for(&self) -> Duration {
        self.inner.acquired_at.elapsed()
    }

    /// How long the lease is known to last without another renewal: zero once lost.
    ///
    /// Measured from when the last successful renewal (or the acquisition) was *sent*, so it
    /// errs on the short side.
    pub fn time_left(&self) -> Duration {
        if self.is_lost() {
            return Duration::ZERO;
        }
        self.valid_until().saturating_duration_since(Instant::now())
    }

    /// How many times the lease has been renewed.
    pub fn renewals(&self) -> u32 {
        self.inner.renewals.load(Ordering::Relaxed)
    }

    /// `true` once the lease is known to be lost.
    pub fn is_lost(&self) -> bool {
        self.lost_reason().is_some()
    }

    /// Why the lease was lost, if it was.
    pub fn lost_reason(&self) -> Option<LostReason> {
        match self.inner.lost.load(Ordering::Acquire) {
            0 => None,
            n => REASONS.get(usize::from(n) - 1).copied(),
        }
    }

    /// Completes when the lease is lost (never, if it is kept and released normally).
    ///
    /// Useful with `tokio::select!` to stop work the moment the lock is gone.
    pub async fn lost(&self) -> LostReason {
        loop {
            let notified = self.inner.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(reason) = self.lost_reason() {
                return reason;
            }
            notified.await;
        }
    }

    /// Whether a fenced batch that writes ([`crate::fence`]) has been sent under this lease.
    ///
    /// Once one has, the layers no longer abort the holder when the lease is lost: the write
    /// may have landed, and only the holder's own answer can say whether it did (the fence
    /// refuses its writes once a newer holder has touched the resource).
    pub fn has_fenced_writes(&self) -> bool {
        self.inner.fenced.load(Ordering::Acquire)
    }

    /// Marks that a fenced write is about to be sent under this lease.
    pub(crate) fn mark_fenced(&self) {
        self.inner.fenced.store(true, Ordering::Release);
    }

    /// Marks that a fenced batch under this lease was refused as stale: a newer holder has
    /// touched the resource, so what this holder answers is not the resource's answer (the
    /// idempotency layer stores no record of it).
    pub(crate) fn mark_refused(&self) {
        self.inner.refused.store(true, Ordering::Release);
    }

    /// Whether a fenced batch under this lease was refused as stale.
    pub(crate) fn was_refused(&self) -> bool {
        self.inner.refused.load(Ordering::Acquire)
    }

    /// When the lease was acquired (the process's clock).
    pub(crate) fn acquired_instant(&self) -> Instant {
        self.inner.acquired_at
    }

    pub(crate) fn valid_until(&self) -> Instant {
        self.inner.acquired_at
            + Duration::from_nanos(self.inner.valid_until.load(Ordering::Relaxed))
    }

    /// Records a successful renewal sent at `sent_at`.
    pub(crate) fn renewed(&self, sent_at: Instant, ttl: Duration) {
        let until = nanos(sent_at.saturating_duration_since(self.inner.acquired_at) + ttl);
        self.inner.valid_until.fetch_max(until, Ordering::Relaxed);
        self.inner.renewals.fetch_add(1, Ordering::Relaxed);
    }

    /// Marks the lease as being released by its holder: renewals stop (a background renewal
    /// is woken to leave), and a "not held" answer to one already on its way is no loss.
    pub(crate) fn set_releasing(&self) {
        self.inner.releasing.store(true, Ordering::Release);
        self.inner.on_release.wake();
        if self.inner.nested.load(Ordering::Acquire) > 0 {
            // A nested guard outlived the hold it re-entered (kept past the handler, or moved
            // into a spawned task): for it the lease is gone.
            self.mark_lost(LostReason::NotHeld);
        }
    }

    /// Counts a nested guard on this lease, until [`leave_nested`](Self::leave_nested).
    pub(crate) fn enter_nested(&self) {
        self.inner.nested.fetch_add(1, Ordering::AcqRel);
    }

    /// A nested guard on this lease is gone.
    pub(crate) fn leave_nested(&self) {
        self.inner.nested.fetch_sub(1, Ordering::AcqRel);
    }

    /// Registers the waker of this lease's background renewal, woken by
    /// [`set_releasing`](Self::set_releasing).
    pub(crate) fn on_release(&self, waker: &std::task::Waker) {
        self.inner.on_release.register(waker);
    }

    /// Whether its holder has sent the release.
    pub(crate) fn is_releasing(&self) -> bool {
        self.inner.releasing.load(Ordering::Acquire)
    }

    /// Marks the lease lost (the first reason wins) and wakes everyone waiting in [`lost`](Self::lost).
    pub(crate) fn mark_lost(&self, reason: LostReason) -> LostReason {
        let code = REASONS
            .iter()
            .position(|r| *r == reason)
            .map_or(1, |i| i as u8 + 1);
        match self
            .inner
            .lost
            .compare_exchange(0, code, Ordering::AcqRel, Ordering::Acquire)
        {
            Ok(_) => {
                self.inner.notify.notify_waiters();
                reason
            }
            Err(_) => self.lost_reason().unwrap_or(reason),
        }
    }
}

impl fmt::Debug for Lease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lease")
            .field("keys", &self.inner.keys)
            .field("fencing_tokens", &self.inner.fences.as_slice())
            .field("time_left", &self.time_left())
            .field("lost", &self.lost_reason())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn time_left_renewal_and_loss() {
        let key = LockKey::new("p:", "s", b"v", 8).unwrap();
        let lease = Lease::new(key, 7, Instant::now(), Duration::from_secs(3));
        assert_eq!(lease.fencing_token(), 7);
        assert_eq!(lease.time_left(), Duration::from_secs(3));
        tokio::time::advance(Duration::from_secs(1)).await;
        assert_eq!(lease.time_left(), Duration::from_secs(2));
        lease.renewed(Instant::now(), Duration::from_secs(3));
        assert_eq!(lease.time_left(), Duration::from_secs(3));
        assert_eq!(lease.renewals(), 1);

        let waiter = tokio::spawn({
            let lease = lease.clone();
            async move { lease.lost().await }
        });
        tokio::task::yield_now().await;
        assert!(!lease.is_lost());
        assert_eq!(lease.mark_lost(LostReason::NotHeld), LostReason::NotHeld);
        assert_eq!(
            lease.mark_lost(LostReason::MaxHold),
            LostReason::NotHeld,
            "first reason wins"
        );
        assert_eq!(waiter.await.unwrap(), LostReason::NotHeld);
        assert_eq!(lease.time_left(), Duration::ZERO);
        assert_eq!(
            lease.lost().await,
            LostReason::NotHeld,
            "lost() after the fact is ready"
        );
    }

    #[test]
    fn a_lease_on_several_keys_has_a_token_per_key() {
        let keys: KeySet = ["b", "a", "c"]
            .iter()
            .map(|v| LockKey::new("p:", "s", v.as_bytes(), 8).unwrap())
            .collect();
        let tokens: Vec<u64> = (0..keys.len() as u64).map(|i| 10 + i).collect();
        let lease = Lease::new(
            keys.clone(),
            Fences::Many(tokens.clone().into()),
            Instant::now(),
            Duration::from_secs(1),
        );
        assert_eq!(lease.keys(), &keys);
        assert_eq!(lease.key(), keys.first().unwrap());
        assert_eq!(lease.fencing_token(), 10, "the first key's");
        let pairs: Vec<(LockKey, u64)> = lease
            .fencing_tokens()
            .map(|(k, t)| (k.clone(), t))
            .collect();
        assert_eq!(pairs.len(), 3);
        for (key, token) in pairs {
            assert_eq!(lease.fencing_token_of(&key), Some(token));
        }
        let other = LockKey::new("p:", "s", b"z", 8).unwrap();
        assert_eq!(lease.fencing_token_of(&other), None);
    }
}
