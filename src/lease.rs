//! What a holder sees of its lock.

use std::{
    fmt,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU8, AtomicU32, AtomicU64, Ordering},
    },
    time::{Duration, SystemTime},
};

use futures_util::task::AtomicWaker;
use tokio::{sync::Notify, time::Instant};

use crate::{error::LostReason, key::LockKey};

/// A held lock, as the request handler (or background task) sees it.
///
/// The layer puts a `Lease` into the request extensions; with the `axum` feature it is an
/// extractor (`lease: Lease`, or `Option<Lease>` on routes where the layer may pass requests
/// through). Cheap to clone: clones observe the same lease.
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
    key: LockKey,
    fencing_token: u64,
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
}

const REASONS: [LostReason; 3] = [
    LostReason::NotHeld,
    LostReason::Expired,
    LostReason::MaxHold,
];

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

impl Lease {
    /// A lease just acquired at `acquired_at` for `ttl`.
    pub(crate) fn new(
        key: LockKey,
        fencing_token: u64,
        acquired_at: Instant,
        ttl: Duration,
    ) -> Self {
        Self {
            inner: Arc::new(Inner {
                key,
                fencing_token,
                acquired_at,
                acquired_at_system: SystemTime::now(),
                valid_until: AtomicU64::new(nanos(ttl)),
                lost: AtomicU8::new(0),
                renewals: AtomicU32::new(0),
                releasing: AtomicBool::new(false),
                notify: Notify::new(),
                on_release: AtomicWaker::new(),
            }),
        }
    }

    /// The key this lease holds.
    pub fn key(&self) -> &LockKey {
        &self.inner.key
    }

    /// The fencing token: strictly greater than the token of every earlier holder of this key.
    ///
    /// Pass it with every write the lock protects, and have the storage refuse a write whose
    /// token is lower than the highest it has seen: then a holder that stalled past its lease
    /// (a GC pause, a network partition) cannot overwrite its successor's work.
    pub fn fencing_token(&self) -> u64 {
        self.inner.fencing_token
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
            .field("key", &self.inner.key)
            .field("fencing_token", &self.inner.fencing_token)
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
}
