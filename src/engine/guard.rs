//! [`LeaseGuard`]: a lease held by background work.

use std::{fmt, ops::Deref, sync::Arc};

use tracing::Instrument;

use super::{hold::Hold, state::Engine};
use crate::{
    error::{LockError, LostReason},
    lease::Lease,
    telemetry::Outcome,
};

/// A lease held by background work: renewed by the locker's background task, released on drop.
///
/// The renewals and the release on drop run on the crate's own runtime (one thread for the
/// process), not on the runtime that acquired the lease: a guard held across synchronous work
/// in a `block_on` bridge is renewed while that runtime is not driven, and one dropped at the
/// end of a runtime's `block_on` (or outside any runtime) is released at once. A guard leaked
/// (`std::mem::forget`) keeps its lease renewed while the process lives, as a leaked mutex
/// guard keeps its lock: set a [`max_hold`](crate::lease::Acquiring::max_hold) to bound it. A guard
/// still held when the process ends (`std::process::exit`, which runs no destructor, or an
/// abort) is never released: its key stays held until its TTL. A dropped guard is released;
/// [`release`](Self::release) guards before exiting to know it was.
///
/// Derefs to [`Lease`] for the fencing token and loss status. Loss is noticed at the next
/// renewal (every `ttl / 3`), so work may run up to that long after the key was taken away:
/// fence the writes that matter with [`Lease::fencing_token`]. Prefer
/// [`release`](Self::release) at the end of the work, which waits for the store to confirm;
/// dropping the guard releases too, in a task of the crate's runtime.
///
/// A guard is `Send` and `Sync`: a background job can hold `&guard` across `.await`s in a
/// spawned task:
///
/// ```
/// use std::time::Duration;
/// use tower_lock::{Locker, MemoryStore};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let locker = Locker::new(MemoryStore::new());
/// let job = tokio::spawn(async move {
///     let key = locker.key("jobs", "nightly")?;
///     // Without waiting: `None` when another instance runs the job now.
///     let Some(guard) = locker.try_acquire(key).await? else {
///         return Ok(());
///     };
///     let lease = &guard;
///     tokio::time::sleep(Duration::from_millis(10)).await;
///     if !lease.is_lost() {
///         println!("ran under fencing token {}", lease.fencing_token());
///     }
///     guard.release().await?;
///     Ok::<(), Box<dyn std::error::Error + Send + Sync>>(())
/// });
/// job.await.unwrap().unwrap();
/// # }
/// ```
///
/// Bind the guard to a name for as long as the work runs: dropped, it releases. The type is
/// `#[must_use]`, so a guard acquired and thrown away in a statement is a warning:
///
/// ```compile_fail
/// #![deny(unused_must_use)]
/// # use tower_lock::{Locker, MemoryStore};
/// # async fn job(locker: Locker) -> Result<(), Box<dyn std::error::Error>> {
/// let key = locker.key("jobs", "nightly")?;
/// locker.acquire(key).await?; // unused `LeaseGuard` that must be used: released at once
/// // ... the job would run here without the lock.
/// # Ok(()) }
/// ```
///
/// ```
/// #![deny(unused_must_use)]
/// # use tower_lock::{Locker, MemoryStore};
/// # async fn job(locker: Locker) -> Result<(), Box<dyn std::error::Error>> {
/// let key = locker.key("jobs", "nightly")?;
/// let _guard = locker.acquire(key).await?; // held until `_guard` goes out of scope
/// // ... the job runs here under the lock.
/// # Ok(()) }
/// ```
///
/// `let _ = locker.acquire(key).await?` drops the guard at once too, and no lint can tell: `_`
/// is not a name.
#[must_use = "the lease is released when the guard is dropped: bind it to a name for as long as the work runs"]
pub struct LeaseGuard {
    // `None` only once released.
    hold: Option<Hold>,
    /// A nested acquire's lease on the hold of an acquire around it in the same task (see
    /// [`Locker::acquire`](super::Locker::acquire)): neither renewed nor released by this guard.
    nested: Option<Nested>,
    // Keeps the locker (its background task) alive as long as the lease.
    _engine: Arc<Engine>,
}

impl LeaseGuard {
    pub(crate) fn new(hold: Hold, engine: Arc<Engine>) -> Self {
        Self {
            hold: Some(hold.into_background(&engine)),
            nested: None,
            _engine: engine,
        }
    }

    /// A guard on `lease`, which an outer holder of the same task holds and releases.
    pub(crate) fn nested(lease: Lease, engine: Arc<Engine>) -> Self {
        lease.enter_nested();
        Self {
            hold: None,
            nested: Some(Nested(lease)),
            _engine: engine,
        }
    }

    /// The lease this guard holds.
    pub fn lease(&self) -> &Lease {
        match (&self.hold, &self.nested) {
            (Some(hold), _) => hold.lease(),
            (None, Some(Nested(lease))) => lease,
            (None, None) => unreachable!("a guard holds its lease until released"),
        }
    }

    /// Stops renewing and releases the lease now, and says whether it was still ours: an error
    /// when it was not, so that a `?` does not pass over a lease that ended without us.
    ///
    /// # Errors
    ///
    /// - [`LockError::LeaseLost`]: the lease was no longer held, so the work it covered may have
    ///   overlapped another holder's: its reason if the lease was already known lost
    ///   ([`Lease::lost_reason`]), else [`LostReason::NotHeld`] (the store no longer had our
    ///   token).
    /// - [`LockError::Store`]: the store failed or did not answer in time. The release is sent
    ///   again in the background while the lease is valid; failing that, the key frees itself
    ///   at its TTL.
    ///
    /// A nested guard (a re-entry of a lease its task holds) releases nothing: the outer holder
    /// does. It answers `Ok(())` while the lease is held, [`LockError::LeaseLost`] once it is
    /// lost (a nested guard kept past its holder's release is lost then, as `NotHeld`).
    pub async fn release(mut self) -> Result<(), LockError> {
        if let Some(Nested(lease)) = &self.nested {
            return match lease.lost_reason() {
                None => Ok(()),
                Some(reason) => Err(LockError::LeaseLost(reason)),
            };
        }
        let mut hold = self
            .hold
            .take()
            .expect("a guard holds its lease until released");
        // Recorded now, so that a release dropped on its way still ends the span (and
        // `hold_ms` leaves out the release's round trip).
        hold.finish(Outcome::Released);
        let span = hold.span().clone();
        let lease = hold.lease().clone();
        if hold.release().instrument(span).await? {
            Ok(())
        } else {
            let reason = lease.lost_reason().unwrap_or(LostReason::NotHeld);
            Err(LockError::LeaseLost(reason))
        }
    }
}

impl Deref for LeaseGuard {
    type Target = Lease;

    fn deref(&self) -> &Lease {
        self.lease()
    }
}

impl fmt::Debug for LeaseGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeaseGuard")
            .field(
                "lease",
                &self
                    .hold
                    .as_ref()
                    .map(Hold::lease)
                    .or(self.nested.as_ref().map(|n| &n.0)),
            )
            .field("nested", &self.nested.is_some())
            .finish()
    }
}

/// A nested guard's lease, counted on the lease while the guard lives (see
/// [`Lease::enter_nested`]).
struct Nested(Lease);

impl Drop for Nested {
    fn drop(&mut self) {
        self.0.leave_nested();
    }
}

/// A guard, the builder that makes one and the future it becomes can be shared by reference
/// across an `.await` in a spawned task (`Sync`), and moved into one (`Send`).
const _: () = {
    const fn shared<T: Send + Sync>() {}
    shared::<LeaseGuard>();
    shared::<super::Acquiring>();
    shared::<super::AcquireFuture>();
};
