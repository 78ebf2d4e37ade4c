//! Renewal: the tick that keeps one lease alive ([`Renewer`]), driven either by its holder's
//! own future or by the locker's one background task ([`Background`]).

use std::{
    fmt,
    future::Future,
    pin::Pin,
    sync::{Arc, Mutex, OnceLock, PoisonError},
    task::{Context, Poll, ready},
    time::Duration,
};

use futures_util::{StreamExt, stream::FuturesUnordered};
use tokio::{
    runtime::{self, Handle},
    sync::mpsc,
    time::{Instant, Sleep, sleep_until, timeout},
};
use tracing::Span;

use crate::{
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
/// finishes before it ever waits registers no timer. A renewal that fails with a store error is
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

    fn lose(&self, reason: LostReason) -> Poll<LostReason> {
        telemetry::lost(&self.lease.key().scope_label(), reason.as_str());
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
                let scope = self.lease.key().scope_label();
                telemetry::round_trip(Op::Renew, now - sent_at);
                telemetry::renewal(&scope, matches!(result, Ok(true)));
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
                        telemetry::store_error(&scope, Op::Renew);
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
            self.in_flight = Some((
                now,
                Box::pin(async move {
                    timeout(limit, renew)
                        .await
                        .unwrap_or_else(|_| Err(StoreError::timeout(limit)))
                }),
            ));
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
/// per locker and runtime drives them all (no task per lease), started on a runtime at its
/// first such lease, and again if that task ended with its runtime. A lease is renewed on the
/// runtime that acquired it: never by a task of another runtime, which may be shut down or no
/// longer driven (a current-thread runtime whose `block_on` returned).
#[derive(Default)]
pub(crate) struct Background {
    renewers: Mutex<Vec<(runtime::Id, mpsc::UnboundedSender<Driven>)>>,
}

/// A renewer in the background task, with the span its events belong to.
struct Driven {
    renewer: Renewer,
    span: Span,
}

impl Background {
    /// Renews `renewer`'s lease in the background, on the current runtime, until it is lost, or
    /// released (see [`Lease::set_releasing`]). Without a Tokio runtime the lease is not
    /// renewed.
    pub(crate) fn drive(&self, renewer: Renewer, span: Span) {
        let Ok(handle) = Handle::try_current() else {
            tracing::warn!(
                "no Tokio runtime to renew a background lease on; it expires with its TTL"
            );
            return;
        };
        let runtime = handle.id();
        let mut driven = Driven { renewer, span };
        let mut tasks = self.renewers.lock().unwrap_or_else(PoisonError::into_inner);
        // The tasks of runtimes that shut down are gone.
        tasks.retain(|(_, sender)| !sender.is_closed());
        if let Some((_, sender)) = tasks.iter().find(|(id, _)| *id == runtime) {
            match sender.send(driven) {
                Ok(()) => return,
                // The task ended with its runtime (shutting down): start another.
                Err(mpsc::error::SendError(back)) => driven = back,
            }
        }
        let (sender, rx) = mpsc::unbounded_channel();
        let _ = sender.send(driven);
        handle.spawn(run(rx));
        tasks.retain(|(id, _)| *id != runtime);
        tasks.push((runtime, sender));
    }
}

impl fmt::Debug for Background {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let running = self
            .renewers
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .filter(|(_, tx)| !tx.is_closed())
            .count();
        f.debug_struct("Background")
            .field("runtimes", &running)
            .finish()
    }
}

/// The background task: polls each renewer as its timer or its renewal wakes it, and drops it
/// when its lease is lost or released. Ends when the locker is gone and no lease is left.
async fn run(mut rx: mpsc::UnboundedReceiver<Driven>) {
    let mut leases = FuturesUnordered::new();
    loop {
        tokio::select! {
            driven = rx.recv() => match driven {
                Some(driven) => leases.push(Renewing(Some(driven))),
                None if leases.is_empty() => return,
                None => {
                    while leases.next().await.is_some() {}
                    return;
                }
            },
            Some(()) = leases.next(), if !leases.is_empty() => {}
        }
    }
}

/// One lease in the background task: done once lost or released.
struct Renewing(Option<Driven>);

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
