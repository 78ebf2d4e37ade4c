//! [`Acquiring`]: one call's acquire, with the wait policy, TTL and longest hold it asks for.

use std::{
    fmt,
    future::Future,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
    time::Duration,
};

use tracing::Instrument;

use super::{
    guard::LeaseGuard,
    hold::{Guarded, poll_guarded},
    locker::Locker,
    terms::Terms,
};
use crate::{
    error::LockError,
    key::KeySet,
    telemetry::{self, Outcome},
    wait::Wait,
};

/// An acquire on a [`Locker`], from [`Locker::acquire`]: a future of a [`LeaseGuard`]. Before
/// it is awaited, it can be told what this call asks for instead of the locker's settings.
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
///     .wait(Wait::constant(Duration::from_millis(50)).deadline(Duration::from_secs(30)))
///     .ttl(Duration::from_secs(60))
///     .max_hold(Duration::from_secs(3600))
///     .await?;
/// # drop(guard); Ok(()) }
/// ```
///
/// The guard is released when dropped: `let _ = locker.acquire(key).await?` releases at once.
#[must_use = "an acquire does nothing until awaited (or `run`, or `try_once`)"]
pub struct Acquiring {
    state: State,
}

enum State {
    /// Not polled yet: what it will ask for.
    Start(Option<Request>),
    Running(Pin<Box<dyn Future<Output = Result<LeaseGuard, LockError>> + Send>>),
}

struct Request {
    locker: Locker,
    keys: KeySet,
    terms: Terms,
}

impl Acquiring {
    pub(super) fn new(locker: Locker, keys: KeySet, terms: Terms) -> Self {
        Self {
            state: State::Start(Some(Request {
                locker,
                keys,
                terms,
            })),
        }
    }

    /// What it asks for, until it is first polled.
    fn request(&mut self) -> Option<&mut Request> {
        match &mut self.state {
            State::Start(request) => request.as_mut(),
            State::Running(_) => None,
        }
    }

    fn take(self) -> Request {
        match self.state {
            State::Start(Some(request)) => request,
            _ => panic!("an `Acquiring` used after it was polled"),
        }
    }

    /// Waits for the keys by this policy instead of the locker's.
    pub fn wait(mut self, wait: Wait) -> Self {
        if let Some(r) = self.request() {
            r.terms = r.terms.clone().with_wait(wait);
        }
        self
    }

    /// Holds the lease with this time to live (at least 10 ms) instead of the locker's,
    /// renewed every third of it.
    pub fn ttl(mut self, ttl: Duration) -> Self {
        if let Some(r) = self.request() {
            r.terms = r.terms.clone().with_ttl(ttl);
        }
        self
    }

    /// Holds the lease at most this long, renewals or not: then it is reported lost
    /// ([`LostReason::MaxHold`](crate::LostReason::MaxHold)) and no longer renewed, and
    /// [`run`](Self::run) cancels its work and releases the keys. Background leases have no
    /// longest hold unless a call sets one.
    pub fn max_hold(mut self, max_hold: Duration) -> Self {
        if let Some(r) = self.request() {
            r.terms.max_hold = Some(max_hold);
        }
        self
    }

    /// Acquires the keys if they are all free now, without waiting (whatever the wait policy):
    /// `Ok(None)` when one is held.
    pub async fn try_once(self) -> Result<Option<LeaseGuard>, LockError> {
        match self.wait(Wait::none()).await {
            Ok(guard) => Ok(Some(guard)),
            Err(LockError::Contended { .. }) => Ok(None),
            Err(error) => Err(error),
        }
    }

    /// Runs `work` under the lease; see [`Locker::run`].
    pub async fn run<F: Future>(self, work: F) -> Result<F::Output, LockError> {
        let Request {
            locker,
            keys,
            terms,
        } = self.take();
        let span = lease_span(&locker, &keys);
        let mut hold = match locker.hold(keys, span.clone(), terms).await {
            Ok(hold) => hold.aborting(),
            Err(error) => {
                telemetry::record_not_acquired(&span, &error);
                return Err(error);
            }
        };
        let mut work = Box::pin(work);
        let guarded = std::future::poll_fn(|cx| poll_guarded(work.as_mut(), &mut hold, cx))
            .instrument(span.clone())
            .await;
        match guarded {
            Guarded::Done(output) => {
                hold.finish(if hold.lease().is_lost() {
                    Outcome::CompletedLeaseLost
                } else {
                    Outcome::Completed
                });
                // A failed release is logged by the release; the TTL frees the keys.
                let _ = hold.release().instrument(span).await;
                Ok(output)
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
}

impl Future for Acquiring {
    type Output = Result<LeaseGuard, LockError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        if let State::Start(request) = &mut self.state {
            let Request {
                locker,
                keys,
                terms,
            } = request
                .take()
                .expect("an `Acquiring` polled after it was taken");
            let span = lease_span(&locker, &keys);
            let hold = locker.hold(keys, span.clone(), terms);
            let engine = Arc::clone(locker.shared());
            self.state = State::Running(Box::pin(async move {
                match hold.await {
                    Ok(hold) => Ok(LeaseGuard::new(hold, engine)),
                    Err(error) => {
                        telemetry::record_not_acquired(&span, &error);
                        Err(error)
                    }
                }
            }));
        }
        match &mut self.state {
            State::Running(acquire) => acquire.as_mut().poll(cx),
            State::Start(_) => unreachable!("started above"),
        }
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
        match &self.state {
            State::Start(Some(request)) => f
                .debug_struct("Acquiring")
                .field("keys", &request.keys)
                .field("terms", &request.terms)
                .finish_non_exhaustive(),
            _ => f.debug_struct("Acquiring").finish_non_exhaustive(),
        }
    }
}
