//! The renewal tick: keeps a lease alive while its holder runs.

use std::{
    pin::Pin,
    sync::Arc,
    task::{Context, Poll, ready},
    time::Duration,
};

use tokio::{
    runtime::Handle,
    task::AbortHandle,
    time::{Instant, Sleep, sleep_until, timeout},
};
use tracing::Instrument;

use crate::{
    batch::Renewals,
    error::LostReason,
    lease::Lease,
    store::{BoxFuture, DynStore, StoreError},
    telemetry::{self, Chain, Op},
    token::Token,
};

/// Shortest pause before retrying a renewal that failed with a store error.
const MIN_RETRY: Duration = Duration::from_millis(10);

/// Renews a lease every `interval` until it is lost, or until its holder releases it (a
/// [`Watchdog`]'s lease). Polled inline by the response future, or driven by a spawned watchdog
/// task for background leases and streamed bodies.
///
/// One `Sleep` is reset in place for every tick. A renewal that fails with a store error is
/// retried (every quarter interval) while the lease is still valid; only a "not ours" answer, the
/// lease running out, or the max-hold cap make it lost.
pub(crate) struct Renewer {
    store: Arc<dyn DynStore>,
    renewals: Arc<Renewals>,
    lease: Lease,
    token: Token,
    ttl: Duration,
    interval: Duration,
    store_timeout: Duration,
    hold_until: Option<Instant>,
    /// When the next renewal is due.
    next_at: Instant,
    /// Created at the first poll: a request that finishes before it ever waits registers no timer.
    sleep: Option<Pin<Box<Sleep>>>,
    in_flight: Option<(Instant, BoxFuture<Result<bool, StoreError>>)>,
}

pub(crate) struct RenewerSettings {
    pub(crate) ttl: Duration,
    pub(crate) interval: Duration,
    pub(crate) store_timeout: Duration,
    pub(crate) max_hold: Option<Duration>,
}

impl Renewer {
    pub(crate) fn new(
        store: Arc<dyn DynStore>,
        renewals: Arc<Renewals>,
        lease: Lease,
        token: Token,
        acquired_at: Instant,
        renew_by: Option<Instant>,
        settings: RenewerSettings,
    ) -> Self {
        let hold_until = settings.max_hold.map(|d| acquired_at + d);
        let first = acquired_at + settings.interval;
        let first = renew_by.map_or(first, |by| first.min(by));
        let first = hold_until.map_or(first, |h| first.min(h));
        Self {
            store,
            renewals,
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
    /// once the holder is releasing it (see [`Watchdog::releasing`]).
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
                telemetry::round_trip(Op::Renew, now - sent_at);
                telemetry::renewal(&self.lease.key().scope_label(), matches!(result, Ok(true)));
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
                        telemetry::store_error(&self.lease.key().scope_label(), Op::Renew);
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
            let renew = self
                .renewals
                .renew(self.lease.key().clone(), self.token.clone(), self.ttl);
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

/// A [`Renewer`] in a task of its own: for background leases and streamed bodies, whose holder
/// is not polled while it works. Stopped when dropped.
pub(crate) struct Watchdog {
    task: AbortHandle,
    lease: Lease,
}

impl Watchdog {
    /// Runs `renewer` on `handle`, in `span`.
    pub(crate) fn spawn(handle: &Handle, mut renewer: Renewer, span: tracing::Span) -> Self {
        let lease = renewer.lease.clone();
        let task = handle
            .spawn(std::future::poll_fn(move |cx| renewer.poll_lost(cx).map(drop)).instrument(span))
            .abort_handle();
        Self { task, lease }
    }

    /// The holder is sending its release: renew no more, and take no "not held" for a loss.
    ///
    /// The task itself stops when the watchdog is dropped, which the holder does once the
    /// release is answered: stopping it now would schedule its cancellation next to the
    /// release's write, and can make the write wait for another worker to wake up (docs/
    /// DECISIONS.md, "The renewal task stops after the release is answered").
    pub(crate) fn releasing(&self) {
        self.lease.set_releasing();
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        // A poll already running on another worker must not take the release for a loss.
        self.lease.set_releasing();
        self.task.abort();
    }
}
