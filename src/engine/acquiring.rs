//! [`Acquiring`]: one call's acquire, with the wait policy, TTL and longest hold it asks for,
//! and the [`AcquireFuture`] it becomes when awaited.

use std::{
    fmt,
    future::{Future, IntoFuture},
    num::NonZeroU32,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
    time::Duration,
};
use sync_wrapper::SyncWrapper;

use tracing::Instrument;

use super::{
    guard::LeaseGuard,
    hold::{Guarded, poll_guarded},
    locker::Locker,
    reentry::{Held, Reentry, reentry},
    terms::Terms,
};
use crate::{
    error::{ConfigError, LockError, LostReason},
    key::{KeySet, Share},
    telemetry::{self, Outcome},
    wait::Wait,
};

/// An acquire on a [`Locker`], from [`Locker::acquire`]: a builder of what this call asks for
/// instead of the locker's settings, awaited for a [`LeaseGuard`] (it is [`IntoFuture`]: the
/// future is an [`AcquireFuture`]), or finished with [`try_acquire`](Self::try_acquire) or
/// [`run`](Self::run). Each of them takes the builder, so none can be called twice and no
/// setting can come too late.
///
/// ```
/// use std::time::Duration;
/// use tower_lock::{Locker, MemoryStore, Wait};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let locker = Locker::new(MemoryStore::new());
/// let key = locker.key("jobs", "reindex")?;
/// let guard = locker
///     .acquire(key)
///     .wait(Wait::constant(Duration::from_millis(50))?.deadline(Duration::from_secs(30)))
///     .ttl(Duration::from_secs(60))?
///     .max_hold(Duration::from_secs(3600))?
///     .await?;
/// # drop(guard); Ok(()) }
/// ```
///
/// The guard is released when dropped: `let _ = locker.acquire(key).await?` releases at once.
///
/// The builder is not itself a future: what was polled cannot be told more, or finished
/// another way.
///
/// ```compile_fail
/// # use std::{future::Future, pin::Pin, task::Poll};
/// # use tower_lock::{Locker, MemoryStore};
/// # async fn job(locker: Locker) -> Result<(), Box<dyn std::error::Error>> {
/// let mut acquiring = locker.acquire(locker.key("jobs", "reindex")?);
/// std::future::poll_fn(|cx| {
///     let _ = Pin::new(&mut acquiring).poll(cx); // `Acquiring` is not a future
///     Poll::Ready(())
/// })
/// .await;
/// acquiring.run(async {}).await?;
/// # Ok(()) }
/// ```
#[must_use = "an acquire does nothing until awaited (or `run`, or `try_acquire`)"]
pub struct Acquiring {
    locker: Locker,
    keys: KeySet,
    terms: Terms,
    counts: Counts,
}

/// What share of its keys' capacity the call asked for (nothing: the plain lease).
#[derive(Debug, Clone, Copy, Default)]
struct Counts {
    permits: Option<u32>,
    weight: Option<u32>,
    mode: Option<Mode>,
}

#[derive(Debug, Clone, Copy)]
enum Mode {
    Shared,
    Exclusive,
}

impl Counts {
    /// The share each key is taken with: `Ok(None)` for the plain lease.
    /// (The setters refuse a weight without permits, over them, or beside a mode.)
    fn share(self) -> Result<Option<Share>, ConfigError> {
        let capacity = self.permits.unwrap_or(Share::READERS);
        match (self.mode, self.permits, self.weight) {
            (None, None, _) => Ok(None),
            (None, Some(permits), weight) => Share::new(weight.unwrap_or(1), permits).map(Some),
            (Some(Mode::Shared), ..) => Share::new(1, capacity).map(Some),
            (Some(Mode::Exclusive), ..) => Share::exclusive(capacity).map(Some),
        }
    }

    /// `keys` with the share asked for.
    fn apply(self, keys: KeySet) -> Result<KeySet, ConfigError> {
        Ok(match self.share()? {
            Some(share) => keys.map_share(|_| Some(share)),
            None => keys,
        })
    }
}

impl Acquiring {
    pub(super) fn new(locker: Locker, keys: KeySet, terms: Terms) -> Self {
        Self {
            locker,
            keys,
            terms,
            counts: Counts::default(),
        }
    }

    /// Waits for the keys by this policy instead of the locker's.
    pub fn wait(mut self, wait: Wait) -> Self {
        self.terms = self.terms.with_wait(wait);
        self
    }

    /// Holds the lease with this time to live instead of the locker's, renewed every third of
    /// it.
    ///
    /// # Errors
    ///
    /// A [`ConfigError`] (setting `ttl`) under 10 ms or over 365 days.
    pub fn ttl(mut self, ttl: Duration) -> Result<Self, ConfigError> {
        crate::config::check_ttl(ttl)?;
        self.terms = self.terms.with_ttl(ttl);
        Ok(self)
    }

    /// Holds the lease at most this long, renewals or not: then it is reported lost
    /// ([`LostReason::MaxHold`](crate::lease::LostReason::MaxHold)) and no longer renewed, and
    /// [`run`](Self::run) cancels its work and releases the keys. Background leases have no
    /// longest hold unless a call sets one.
    ///
    /// # Errors
    ///
    /// A [`ConfigError`] (setting `max_hold`) for 0 or over 365 days.
    pub fn max_hold(mut self, max_hold: Duration) -> Result<Self, ConfigError> {
        if max_hold.is_zero() {
            return Err(ConfigError::new(
                "max_hold",
                "the longest hold must be above 0",
            ));
        }
        crate::config::at_most_a_year("max_hold", max_hold)?;
        self.terms.max_hold = Some(max_hold);
        Ok(self)
    }

    /// Takes one of the keys' `permits` (or [`weight`](Self::weight) of them) instead of the
    /// whole key: at most `permits` holders at once across every process that shares the
    /// store, each with its own lease, renewal and fencing token, served first come first
    /// served (a request is never overtaken by a lighter one that came after it). A key keeps
    /// the number its holders named: an acquire that names another while the key is held is
    /// refused ([`LockError::Store`] of kind [`Misused`](crate::store::StoreErrorKind::Misused)).
    /// When none frees within the wait, the error is [`LockError::Contended`] with `permits` set (the layer's 429;
    /// [`LockError::is_permits_exhausted`]).
    ///
    /// ```
    /// use std::num::NonZeroU32;
    /// use tower_lock::{Locker, MemoryStore};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let locker = Locker::new(MemoryStore::new());
    /// let two = NonZeroU32::new(2).unwrap();
    /// let key = locker.key("provider", "acct-1")?;
    /// let first = locker.acquire(key.clone()).permits(two)?.await?;
    /// let second = locker.acquire(key.clone()).permits(two)?.await?;
    /// assert!(locker.acquire(key).permits(two)?.try_acquire().await?.is_none());
    /// # drop((first, second)); Ok(()) }
    /// ```
    ///
    /// 0 permits does not compile.
    ///
    /// # Errors
    ///
    /// A [`ConfigError`] (setting `permits`), before anything is sent, when the store cannot
    /// count holders ([`RedlockStore`](crate::store::RedlockStore), a store outside this
    /// crate; see [`Capabilities::counts`](crate::store::Capabilities::counts)).
    pub fn permits(mut self, permits: NonZeroU32) -> Result<Self, ConfigError> {
        self.check_counts("permits")?;
        self.counts.permits = Some(permits.get());
        Ok(self)
    }

    /// Takes this many of the keys' [`permits`](Self::permits) (default 1), for work that needs
    /// more than one share of the limit.
    ///
    /// # Errors
    ///
    /// A [`ConfigError`] (setting `weight`) unless [`permits`](Self::permits) was set first and
    /// `weight` is at most that many, or after [`shared`](Self::shared) or
    /// [`exclusive`](Self::exclusive) (a reader takes one permit, a writer all of them).
    pub fn weight(mut self, weight: NonZeroU32) -> Result<Self, ConfigError> {
        let refused = |why: &str| Err(ConfigError::new("weight", why.to_owned()));
        match (self.counts.permits, self.counts.mode) {
            (_, Some(_)) => refused(
                "a shared lease takes 1 permit and an exclusive one all of them: set no weight",
            ),
            (None, None) => refused("a weight is a number of permits: set `permits` first"),
            (Some(permits), None) if weight.get() > permits => {
                refused("the weight is more than the key's permits: it could never be granted")
            }
            (Some(_), None) => {
                self.counts.weight = Some(weight.get());
                Ok(self)
            }
        }
    }

    /// Takes the keys shared (a reader): with other shared leases, never with an
    /// [`exclusive`](Self::exclusive) one, first come first served, so that a writer queued
    /// behind readers is not starved by readers that keep coming, and readers queued behind a
    /// writer wait for it. With [`permits`](Self::permits), one of them.
    ///
    /// # Errors
    ///
    /// A [`ConfigError`] (setting `shared`) when the store cannot count holders (as
    /// [`permits`](Self::permits)), or after [`weight`](Self::weight).
    pub fn shared(self) -> Result<Self, ConfigError> {
        self.with_mode(Mode::Shared, "shared")
    }

    /// Takes the keys exclusive of [`shared`](Self::shared) leases (a writer): all of their
    /// capacity. A plain lease (neither) does not count holders, so a writer of a key that
    /// readers share must say this.
    ///
    /// # Errors
    ///
    /// As [`shared`](Self::shared) (setting `exclusive`).
    pub fn exclusive(self) -> Result<Self, ConfigError> {
        self.with_mode(Mode::Exclusive, "exclusive")
    }

    fn with_mode(mut self, mode: Mode, setting: &'static str) -> Result<Self, ConfigError> {
        self.check_counts(setting)?;
        if self.counts.weight.is_some() {
            return Err(ConfigError::new(
                setting,
                "a shared lease takes 1 permit and an exclusive one all of them: set no weight",
            ));
        }
        self.counts.mode = Some(mode);
        Ok(self)
    }

    fn check_counts(&self, setting: &'static str) -> Result<(), ConfigError> {
        match self.locker.engine().store.counts() {
            true => Ok(()),
            false => Err(super::cannot_count(setting)),
        }
    }

    /// Acquires the keys if they are all free now, without waiting (whatever the wait policy):
    /// `Ok(None)` when one is held.
    pub async fn try_acquire(self) -> Result<Option<LeaseGuard>, LockError> {
        match self.wait(Wait::none()).await {
            Ok(guard) => Ok(Some(guard)),
            Err(LockError::Contended { .. }) => Ok(None),
            Err(error) => Err(error),
        }
    }

    /// Runs `work` under the lease if the keys are all free now, without waiting (whatever the
    /// wait policy): `Ok(None)`, `work` never started, when one is held; else what
    /// [`run`](Self::run) answers, in `Some`. See [`Locker::try_run`].
    pub async fn try_run<F: Future>(self, work: F) -> Result<Option<F::Output>, LockError> {
        match self.wait(Wait::none()).run(work).await {
            Ok(output) => Ok(Some(output)),
            Err(LockError::Contended { .. }) => Ok(None),
            Err(error) => Err(error),
        }
    }

    /// Runs `work` under the lease; see [`Locker::run`].
    pub async fn run<F: Future>(self, work: F) -> Result<F::Output, LockError> {
        let (locker, keys, terms) = self.asked()?;
        let store = locker.shared().store.identity();
        match reentry(&keys, store) {
            // Re-entered by its holder: the work runs under the hold around it, and is dropped
            // the moment that hold is lost, as a `run` of its own would be.
            Reentry::Covered(lease) => {
                let work = std::pin::pin!(work);
                return tokio::select! {
                    biased;
                    reason = lease.lost() => Err(LockError::LeaseLost(reason)),
                    output = work => Ok(output),
                };
            }
            Reentry::Blocked => return Err(waits_for_itself().into()),
            Reentry::Fresh => {}
        }
        let span = lease_span(&locker, &keys);
        let mut hold = match locker.hold(keys, span.clone(), terms).await {
            Ok(hold) => hold,
            Err(error) => {
                telemetry::record_not_acquired(&span, &error);
                return Err(error);
            }
        };
        let mut work = Box::pin(Held::within_current(hold.lease().clone(), store).scope(work));
        let guarded = std::future::poll_fn(|cx| poll_guarded(work.as_mut(), &mut hold, cx))
            .instrument(span.clone())
            .await;
        match guarded {
            Guarded::Done(output) => {
                let lease = hold.lease().clone();
                // Read before the release, which ends the lease (nested guards then read it lost).
                let lost = lease.lost_reason();
                hold.finish(if lost.is_some() {
                    Outcome::CompletedLeaseLost
                } else {
                    Outcome::Completed
                });
                // A failed release is logged by the release, and sent again; the TTL frees the
                // keys.
                let released = hold.release().instrument(span).await;
                // Lost before the work ended, or found gone at its release (the work kept its
                // task from renewing past the TTL): the work may have overlapped another
                // holder's, so its output is not the answer, unless fences judged its writes.
                let lost = lost.or(matches!(released, Ok(false)).then_some(LostReason::NotHeld));
                match lost {
                    Some(reason) if !lease.has_fenced_writes() => Err(LockError::LeaseLost(reason)),
                    _ => Ok(output),
                }
            }
            Guarded::Aborted(reason) => {
                // Cancelled: nothing more runs without the lock.
                drop(work);
                if let Some(release) = hold.abort(reason) {
                    let _ = release.instrument(span).await;
                }
                Err(LockError::LeaseLost(reason))
            }
        }
    }

    /// The locker, the keys with the share asked for, and the terms.
    fn asked(self) -> Result<(Locker, KeySet, Terms), ConfigError> {
        let keys = self.counts.apply(self.keys)?;
        Ok((self.locker, keys, self.terms))
    }

    /// The acquire, run when first polled (so that a re-entry is judged by the task that awaits
    /// it).
    async fn acquire(self) -> Result<LeaseGuard, LockError> {
        let (locker, keys, terms) = self.asked()?;
        let engine = Arc::clone(locker.shared());
        // Re-entered by its holder (this task holds the keys): a guard on the same hold.
        match reentry(&keys, locker.shared().store.identity()) {
            Reentry::Covered(lease) => return Ok(LeaseGuard::nested(lease, engine)),
            Reentry::Blocked => return Err(waits_for_itself().into()),
            Reentry::Fresh => {}
        }
        let span = lease_span(&locker, &keys);
        match locker.hold(keys, span.clone(), terms).await {
            Ok(hold) => Ok(LeaseGuard::new(hold, engine)),
            Err(error) => {
                telemetry::record_not_acquired(&span, &error);
                Err(error)
            }
        }
    }
}

impl IntoFuture for Acquiring {
    type Output = Result<LeaseGuard, LockError>;
    type IntoFuture = AcquireFuture;

    fn into_future(self) -> AcquireFuture {
        AcquireFuture {
            inner: SyncWrapper::new(Box::pin(self.acquire())),
        }
    }
}

/// The future an [`Acquiring`] becomes when awaited: a [`LeaseGuard`] once the keys are held.
///
/// Dropped before it is ready, it acquires nothing: an acquire already sent is released.
#[must_use = "futures do nothing unless you `.await` or poll them"]
pub struct AcquireFuture {
    /// Polled only through `&mut`: the wrapper makes the future `Sync`.
    inner: SyncWrapper<Acquire>,
}

/// The acquire once started.
type Acquire = Pin<Box<dyn Future<Output = Result<LeaseGuard, LockError>> + Send>>;

impl Future for AcquireFuture {
    type Output = Result<LeaseGuard, LockError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.inner.get_mut().as_mut().poll(cx)
    }
}

impl fmt::Debug for AcquireFuture {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AcquireFuture").finish_non_exhaustive()
    }
}

/// The `lock` span of a lease on `keys` (disabled for a set without keys, which is refused).
fn lease_span(locker: &Locker, keys: &KeySet) -> tracing::Span {
    match keys.first() {
        Some(key) => telemetry::span(key, keys.len(), locker.config().key_display()),
        None => tracing::Span::none(),
    }
}

impl fmt::Debug for Acquiring {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Acquiring")
            .field("keys", &self.keys)
            .field("terms", &self.terms)
            .field("counts", &self.counts)
            .finish_non_exhaustive()
    }
}

/// A nested acquire that asks for more of a key than its task holds: it could only wait for
/// its own holder.
fn waits_for_itself() -> ConfigError {
    ConfigError::new(
        "keys",
        "this task already holds one of these keys (a nested acquire within its holder) and \
         asks for more of it than it holds (that key with others, more weight, or exclusive \
         over shared), which it could only wait for; take every key in the outer acquire, or \
         take this one outside it",
    )
}

#[cfg(test)]
mod tests {
    use std::{
        sync::{
            Arc,
            atomic::{AtomicBool, Ordering},
        },
        time::Duration,
    };

    use crate::{LockError, Locker, MemoryStore, error::LostReason};

    /// `try_run` starts the work only where it gets the lease, at once, and releases it after.
    #[tokio::test]
    async fn try_run_runs_the_work_only_where_it_gets_the_lease() {
        let locker = Locker::new(MemoryStore::new());
        let key = locker.key("jobs", "nightly").unwrap();
        let held = locker.acquire(key.clone()).await.unwrap();
        let started = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&started);
        let elsewhere = locker
            .try_run(
                key.clone(),
                async move { flag.store(true, Ordering::SeqCst) },
            )
            .await
            .unwrap();
        assert!(elsewhere.is_none(), "the key is held: not run");
        assert!(!started.load(Ordering::SeqCst), "the work never started");
        held.release().await.unwrap();
        let ran = locker.try_run(key.clone(), async { 7 }).await.unwrap();
        assert_eq!(ran, Some(7));
        assert!(
            locker.try_acquire(key).await.unwrap().is_some(),
            "released after the work"
        );
    }

    /// Work that blocks its thread past the TTL is not renewed: its release finds the lease
    /// gone, and the answer is `LeaseLost`, not the work's output (another holder may have run
    /// meanwhile).
    #[tokio::test(flavor = "current_thread")]
    async fn work_that_outlived_its_lease_is_not_an_answer() {
        let locker = Locker::new(MemoryStore::new());
        let key = locker.key("jobs", "nightly").unwrap();
        let ran = locker
            .acquire(key.clone())
            .ttl(Duration::from_millis(100))
            .unwrap()
            .try_run(async {
                std::thread::sleep(Duration::from_millis(400));
                "report sent"
            })
            .await;
        assert!(
            matches!(ran, Err(LockError::LeaseLost(LostReason::NotHeld))),
            "{ran:?}"
        );
        let ran = locker.try_run(key, async { "report sent" }).await.unwrap();
        assert_eq!(ran, Some("report sent"), "renewed while polled: the answer");
    }
}
