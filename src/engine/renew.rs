//! Renewal: the tick that keeps one lease alive ([`Renewer`]), driven either by its holder's
//! own future or by the locker's one background task ([`Background`]).

use std::{
    collections::BinaryHeap,
    fmt,
    future::Future,
    pin::Pin,
    sync::{Arc, Mutex, OnceLock, PoisonError},
    task::{Context, Poll, ready},
    time::Duration,
};

use futures_util::{StreamExt, stream::FuturesUnordered};
use tokio::{
    sync::Notify,
    time::{Instant, Sleep},
};
use tracing::Span;

use crate::{
    background::{self, bounded, sleep_until},
    error::LostReason,
    key::KeySet,
    lease::Lease,
    store::{Backend, BoxFuture, StoreError},
    telemetry::{self, Chain, Op},
    token::Token,
};

/// Shortest pause before retrying a renewal that failed with a store error.
const MIN_RETRY: Duration = Duration::from_millis(10);

/// Renews a lease every `interval` until it is lost, or until its holder releases it.
///
/// One `Sleep` is reset in place for every tick, created at the first poll: a request that
/// finishes before it ever waits registers no timer. Its timers are made where it is polled
/// (the holder's runtime, whose clock a test may pause); handed to the background task, it
/// makes them again there ([`Renewer::rehome`]). A renewal that fails with a store error is
/// retried (every quarter interval) while the lease is still valid; only a "not ours" answer,
/// the lease running out, or the max-hold cap make it lost.
pub(crate) struct Renewer {
    store: Arc<Backend>,
    lease: Lease,
    token: Token,
    ttl: Duration,
    interval: Duration,
    store_timeout: Duration,
    hold_until: Option<Instant>,
    /// When the next renewal is due.
    next_at: Instant,
    sleep: Option<Pin<Box<Sleep>>>,
    in_flight: Option<(Instant, BoxFuture<Result<bool, StoreError>>)>,
}

/// How a [`Renewer`] renews.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RenewalSettings {
    pub(crate) ttl: Duration,
    pub(crate) interval: Duration,
    pub(crate) store_timeout: Duration,
    /// The longest the lease may be held, renewals or not.
    pub(crate) max_hold: Option<Duration>,
}

/// `at`, moved earlier to the last tick of a grid shared by the process: a power of two of
/// milliseconds, at most 8 ms and at most an eighth of `interval` (none below 8 ms intervals).
/// Leases that fall due within one tick renew together, so group commit sends them in one
/// call instead of one each as their due times trickle in; each renews at most that much early.
/// Never moved to now or before (a retry due within a tick stays where it is).
fn on_grid(at: Instant, interval: Duration) -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    let epoch = *EPOCH.get_or_init(Instant::now);
    let eighth = interval.as_millis() / 8;
    if eighth == 0 || at <= epoch {
        return at;
    }
    let tick = 1u128 << eighth.min(8).ilog2();
    let since = (at - epoch).as_millis();
    let Ok(ms) = u64::try_from(since - since % tick) else {
        return at;
    };
    let earlier = epoch + Duration::from_millis(ms);
    if earlier <= Instant::now() {
        at
    } else {
        earlier
    }
}

impl Renewer {
    pub(crate) fn new(
        store: Arc<Backend>,
        lease: Lease,
        token: Token,
        renew_by: Option<Instant>,
        settings: RenewalSettings,
    ) -> Self {
        let acquired_at = lease.acquired_instant();
        let hold_until = settings.max_hold.map(|d| acquired_at + d);
        let first = on_grid(acquired_at + settings.interval, settings.interval);
        let first = renew_by.map_or(first, |by| first.min(by));
        let first = hold_until.map_or(first, |h| first.min(h));
        Self {
            store,
            lease,
            token,
            ttl: settings.ttl,
            interval: settings.interval,
            store_timeout: settings.store_timeout,
            hold_until,
            next_at: first,
            sleep: None,
            in_flight: None,
        }
    }

    fn schedule(&mut self, at: Instant) {
        let at = on_grid(at, self.interval);
        let at = self.hold_until.map_or(at, |h| at.min(h));
        self.next_at = at;
        if let Some(sleep) = &mut self.sleep {
            sleep.as_mut().reset(at);
        }
    }

    /// Forgets the timers made where the renewer was polled so far: its holder's runtime, which
    /// may be left idle (a timer of it never fires) or dropped (polling one panics) while the
    /// background task drives the renewer. The tick is made again where it is polled next; a
    /// renewal in flight, whose store timeout is such a timer, is sent again at once (the one
    /// dropped is not sent if it has not been yet).
    fn rehome(&mut self) {
        self.sleep = None;
        if self.in_flight.take().is_some() {
            self.next_at = Instant::now();
        }
    }

    fn lose(&self, reason: LostReason) -> Poll<LostReason> {
        telemetry::lost(self.lease.key().scope(), reason.as_str());
        tracing::warn!(reason = reason.as_str(), "lease lost: {reason}");
        Poll::Ready(self.lease.mark_lost(reason))
    }

    /// Pending while the lease is held; ready with the reason once it is lost. Pending for good
    /// once the holder is releasing it.
    pub(crate) fn poll_lost(&mut self, cx: &mut Context<'_>) -> Poll<LostReason> {
        loop {
            if let Some(reason) = self.lease.lost_reason() {
                return Poll::Ready(reason);
            }
            if self.lease.is_releasing() {
                return Poll::Pending;
            }
            if let Some((sent_at, fut)) = &mut self.in_flight {
                let sent_at = *sent_at;
                let result = ready!(fut.as_mut().poll(cx));
                self.in_flight = None;
                if self.lease.is_releasing() {
                    // Answered after the release went out: "not held" is the release's doing.
                    return Poll::Pending;
                }
                let now = Instant::now();
                let scope = self.lease.key().scope();
                telemetry::round_trip(Op::Renew, now - sent_at);
                telemetry::renewal(scope, matches!(result, Ok(true)));
                match result {
                    Ok(true) => {
                        self.lease.renewed(sent_at, self.store.validity(self.ttl));
                        tracing::trace!(renewals = self.lease.renewals(), "lease renewed");
                        // From when this renewal was sent, like the lease's validity: scheduled
                        // from the reply, a round trip over ttl / 3 would leave the next renewal
                        // less time than a round trip, and every lease would be lost.
                        self.schedule(sent_at + self.interval);
                    }
                    Ok(false) => return self.lose(LostReason::NotHeld),
                    Err(error) => {
                        telemetry::store_error(scope, Op::Renew);
                        let left = self.lease.valid_until().saturating_duration_since(now);
                        tracing::warn!(
                            error = %Chain(&error),
                            time_left = ?left,
                            "lease renewal failed; retrying while the lease is valid"
                        );
                        if left.is_zero() {
                            return self.lose(LostReason::Expired);
                        }
                        let retry = (self.interval / 4).max(MIN_RETRY).min(left);
                        self.schedule(now + retry);
                    }
                }
            }
            let next_at = self.next_at;
            let sleep = self
                .sleep
                .get_or_insert_with(|| Box::pin(sleep_until(next_at)));
            ready!(sleep.as_mut().poll(cx));
            let now = Instant::now();
            if self.hold_until.is_some_and(|h| now >= h) {
                return self.lose(LostReason::MaxHold);
            }
            let left = self.lease.valid_until().saturating_duration_since(now);
            if left.is_zero() {
                return self.lose(LostReason::Expired);
            }
            let limit = self.store_timeout.min(left);
            let renew = renew_keys(&self.store, self.lease.keys(), &self.token, self.ttl);
            self.in_flight = Some((now, Box::pin(bounded(limit, renew))));
        }
    }
}

/// Renews every key of a lease (they reach the store together, so group commit sends them in
/// one or two calls): `true` when every key was renewed; `false` when any was not ours
/// any more (the lease is lost, whatever the others answered); an error when none said so
/// but one failed.
fn renew_keys(
    store: &Backend,
    keys: &KeySet,
    token: &Token,
    ttl: Duration,
) -> BoxFuture<Result<bool, StoreError>> {
    if let Some(key) = keys.as_one() {
        return store.renew(key.clone(), token.clone(), ttl);
    }
    let renewals: Vec<_> = keys
        .iter()
        .map(|key| store.renew(key.clone(), token.clone(), ttl))
        .collect();
    Box::pin(async move {
        let mut failed = None;
        for answer in futures_util::future::join_all(renewals).await {
            match answer {
                Ok(true) => {}
                Ok(false) => return Ok(false),
                Err(error) => {
                    failed.get_or_insert(error);
                }
            }
        }
        failed.map_or(Ok(true), Err)
    })
}

/// The renewals of a locker's leases that nobody polls while they are held: background leases
/// ([`LeaseGuard`](crate::LeaseGuard)) and leases kept while a response body streams. One task
/// per locker drives them all (no task per lease), on the crate's own runtime
/// ([`background`]): never on the runtime that acquired the lease, which may stop being driven
/// while the lease is held (a `block_on` bridge doing synchronous work) or be dropped.
///
/// A lease handed over waits in a heap shared with the task, earliest first by when its renewer
/// first needs polling (its first renewal, or its longest hold), and joins the task's set of
/// renewing leases only then. The task sleeps until the earliest lease waiting, and is woken only
/// by one due before that. So a lease released before its first renewal (background work
/// shorter than a third of the TTL) costs a push under a lock: no message, no wake-up and poll
/// of the task, no timer of its own. Released leases are cleared from the heap when they come
/// due, or all at once when it has doubled since it was last cleared.
#[derive(Default)]
pub(crate) struct Background {
    shared: Arc<Shared>,
}

#[derive(Default)]
struct Shared {
    queue: Mutex<Queue>,
    /// Wakes the task: a lease due before the time it sleeps until, or the locker gone.
    wake: Notify,
}

#[derive(Default)]
struct Queue {
    /// Leases handed over and not due yet, earliest first.
    waiting: BinaryHeap<Waiting>,
    /// When the task looks at `waiting` next; `None` while no task runs.
    wakes_at: Option<Instant>,
    /// The locker is gone: the task takes every lease still held, and ends once they end.
    closed: bool,
    /// The size of `waiting` at which released leases are next cleared out of it.
    clear_at: usize,
    /// Orders leases due at the same instant by when they were handed over.
    handed: u64,
}

/// The least size of `waiting` at which released leases are cleared out of it.
const CLEAR_AT_LEAST: usize = 1024;

/// How long the task sleeps with no lease waiting: until woken.
const IDLE: Duration = Duration::from_secs(86_400);

/// A renewer in the background task, with the span its events belong to.
struct Driven {
    renewer: Renewer,
    span: Span,
}

/// A lease handed over and not due yet.
struct Waiting {
    due: Instant,
    handed: u64,
    driven: Driven,
}

impl Waiting {
    fn order(&self) -> (Instant, u64) {
        (self.due, self.handed)
    }
}

impl PartialEq for Waiting {
    fn eq(&self, other: &Self) -> bool {
        self.order() == other.order()
    }
}

impl Eq for Waiting {}

impl PartialOrd for Waiting {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

/// Reversed, so that the (max-)heap's top is the earliest.
impl Ord for Waiting {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        other.order().cmp(&self.order())
    }
}

impl Shared {
    fn queue(&self) -> std::sync::MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Background {
    /// Renews `renewer`'s lease in the background until it is lost, or released (see
    /// [`Lease::set_releasing`]), on the crate's runtime.
    pub(crate) fn drive(&self, mut renewer: Renewer, span: Span) {
        renewer.rehome();
        let due = renewer.next_at;
        let mut queue = self.shared.queue();
        let start = queue.wakes_at.is_none();
        if queue.waiting.len() >= queue.clear_at.max(CLEAR_AT_LEAST) {
            queue
                .waiting
                .retain(|w| !w.driven.renewer.lease.is_releasing());
            queue.clear_at = 2 * queue.waiting.len();
        }
        let handed = queue.handed;
        queue.handed += 1;
        queue.waiting.push(Waiting {
            due,
            handed,
            driven: Driven { renewer, span },
        });
        if start {
            queue.wakes_at = Some(due);
            drop(queue);
            if !background::spawn(run(Arc::clone(&self.shared))) {
                self.shared.queue().wakes_at = None;
                tracing::warn!(
                    "no Tokio runtime to renew a background lease on; it expires with its TTL"
                );
            }
        } else if queue.wakes_at.is_some_and(|at| due < at) {
            queue.wakes_at = Some(due);
            drop(queue);
            self.shared.wake.notify_one();
        }
    }
}

impl Drop for Background {
    fn drop(&mut self) {
        self.shared.queue().closed = true;
        self.shared.wake.notify_one();
    }
}

impl fmt::Debug for Background {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let queue = self.shared.queue();
        f.debug_struct("Background")
            .field("running", &queue.wakes_at.is_some())
            .field("waiting", &queue.waiting.len())
            .finish()
    }
}

/// The background task: takes the leases that come due into its set, polls each as its timer
/// or its renewal wakes it, and drops it when its lease is lost or released. Ends when the
/// locker is gone and no lease is left.
async fn run(shared: Arc<Shared>) {
    /// The task dropped (its runtime shut down, or it ended): the next lease handed over starts
    /// another, which takes the leases still waiting. Dropped by a panic, it reports the leases
    /// still waiting for their first renewal lost too, as [`Renewing`] does those it renewed:
    /// no task renews them until another lease is handed over, which may be never.
    struct Ended<'a>(&'a Shared);
    impl Drop for Ended<'_> {
        fn drop(&mut self) {
            let mut queue = self.0.queue();
            queue.wakes_at = None;
            if !std::thread::panicking() {
                return;
            }
            let waiting = std::mem::take(&mut queue.waiting);
            drop(queue);
            for Waiting { driven, .. } in waiting {
                if !driven.renewer.lease.is_releasing() {
                    let _entered = driven.span.enter();
                    tracing::error!(
                        "the background renewal task panicked; its leases are no longer renewed"
                    );
                    let _ = driven.renewer.lose(LostReason::Expired);
                }
            }
        }
    }
    let _ended = Ended(&shared);
    let mut leases = FuturesUnordered::new();
    let sleep = sleep_until(Instant::now() + IDLE);
    tokio::pin!(sleep);
    loop {
        {
            let mut queue = shared.queue();
            let now = Instant::now();
            while queue
                .waiting
                .peek()
                .is_some_and(|w| w.due <= now || queue.closed)
            {
                let Some(Waiting { driven, .. }) = queue.waiting.pop() else {
                    break;
                };
                if !driven.renewer.lease.is_releasing() {
                    leases.push(Renewing(Some(driven)));
                }
            }
            if queue.closed && leases.is_empty() {
                return;
            }
            let at = queue.waiting.peek().map_or(now + IDLE, |w| w.due);
            queue.wakes_at = Some(at);
            sleep.as_mut().reset(at);
        }
        tokio::select! {
            () = shared.wake.notified() => {}
            () = &mut sleep => {}
            Some(()) = leases.next(), if !leases.is_empty() => {}
        }
    }
}

/// One lease in the background task: done once lost or released.
struct Renewing(Option<Driven>);

impl Drop for Renewing {
    /// Dropped by a panic (of the store's renewal, or of the task): nothing renews the lease
    /// any more, so its holder is told it is lost now, rather than finding out never.
    fn drop(&mut self) {
        if let Some(driven) = self.0.take()
            && std::thread::panicking()
            && !driven.renewer.lease.is_releasing()
        {
            let _entered = driven.span.enter();
            tracing::error!(
                "the background renewal task panicked; its leases are no longer renewed"
            );
            let _ = driven.renewer.lose(LostReason::Expired);
        }
    }
}

impl Future for Renewing {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let Some(driven) = self.0.as_mut() else {
            return Poll::Ready(());
        };
        let lease = driven.renewer.lease.clone();
        // Woken when the holder releases, so that a released lease leaves the task at once.
        lease.on_release(cx.waker());
        let _entered = driven.span.enter();
        let done = driven.renewer.poll_lost(cx).is_ready() || lease.is_releasing();
        drop(_entered);
        if done {
            self.0 = None;
            return Poll::Ready(());
        }
        Poll::Pending
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{MemoryStore, key::LockKey};

    const TTL: Duration = Duration::from_secs(30);

    /// A renewer of a lease on key `n`, taken in `store` when `take`.
    async fn renewer(store: &Arc<Backend>, n: usize, take: bool) -> Renewer {
        let key = LockKey::new("p:", "s", n.to_string().as_bytes(), 64).unwrap();
        let token = Token::generate().unwrap();
        if take {
            let taken = store.attempt(key.clone(), token.clone(), TTL, false).await;
            assert!(matches!(taken, Ok(crate::store::Attempt::Acquired { .. })));
        }
        let lease = Lease::new(key, 1, Instant::now(), TTL);
        let settings = RenewalSettings {
            ttl: TTL,
            interval: TTL / 3,
            store_timeout: Duration::from_secs(1),
            max_hold: None,
        };
        Renewer::new(Arc::clone(store), lease, token, None, settings)
    }

    /// A `MemoryStore` whose renewals wait for a permit of `gate`, then answer "not held".
    struct Gated {
        inner: MemoryStore,
        gate: Arc<tokio::sync::Semaphore>,
    }

    impl crate::store::LockStore for Gated {
        async fn acquire(
            &self,
            key: &LockKey,
            token: &Token,
            ttl: Duration,
        ) -> Result<crate::store::Acquire, StoreError> {
            self.inner.acquire(key, token, ttl).await
        }

        async fn renew(&self, _: &LockKey, _: &Token, _: Duration) -> Result<bool, StoreError> {
            let _permit = self.gate.acquire().await;
            Ok(false)
        }

        async fn release(&self, key: &LockKey, token: &Token) -> Result<bool, StoreError> {
            self.inner.release(key, token).await
        }
    }

    /// A renewal sent before its holder began releasing and answered "not held" after (the
    /// release got there first) is the release's doing: the lease is not reported lost.
    #[tokio::test(start_paused = true)]
    async fn a_renewal_answered_after_the_release_began_is_not_a_loss() {
        let gate = Arc::new(tokio::sync::Semaphore::new(0));
        let store = Arc::new(Backend::new(Gated {
            inner: MemoryStore::new(),
            gate: Arc::clone(&gate),
        }));
        let mut renewer = renewer(&store, 0, true).await;
        let lease = renewer.lease.clone();
        let mut poll = || {
            let mut cx = Context::from_waker(std::task::Waker::noop());
            renewer.poll_lost(&mut cx).is_pending()
        };
        assert!(poll());
        tokio::time::advance(TTL / 3 + Duration::from_millis(10)).await;
        assert!(poll(), "the renewal is answered only once the gate opens");
        lease.set_releasing();
        gate.add_permits(1);
        assert!(poll());
        assert!(!lease.is_lost(), "{:?}", lease.lost_reason());
    }

    #[tokio::test(start_paused = true)]
    async fn leases_released_before_their_first_renewal_do_not_pile_up() {
        let store = Arc::new(Backend::new(MemoryStore::new()));
        let background = Background::default();
        let held = renewer(&store, 0, true).await;
        let lease = held.lease.clone();
        background.drive(held, Span::none());
        for n in 1..=10 * CLEAR_AT_LEAST {
            let renewer = renewer(&store, n, false).await;
            renewer.lease.set_releasing();
            background.drive(renewer, Span::none());
        }
        let waiting = background.shared.queue().waiting.len();
        assert!(waiting <= 2 * CLEAR_AT_LEAST, "{waiting} leases waiting");
        // The lease still held is renewed when it falls due; the others are gone by then.
        tokio::time::sleep(TTL / 3 + Duration::from_millis(10)).await;
        assert_eq!(lease.renewals(), 1);
        assert!(!lease.is_lost());
        assert!(background.shared.queue().waiting.is_empty());
    }
}
