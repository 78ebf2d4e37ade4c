//! The one lifecycle of a held lease, for every holder: a `LockLayer` request, an
//! `IdempotencyLayer` request, a body that streams after its handler, and a [`LeaseGuard`].
//!
//! A [`Hold`] owns the lease from the moment it is acquired until it ends in exactly one way:
//! released by its holder, lost (noticed and reported), or dropped (a spawned, token-checked
//! release; or, if the process dies, expiry). It renews the lease (driven by its holder's poll,
//! or by the locker's background task), stops at `max_hold`, applies the loss policy, and
//! records the outcome on the lease's span once.
//!
//! [`LeaseGuard`]: crate::LeaseGuard

use std::{
    future::Future,
    pin::Pin,
    task::{Context, Poll},
};
use sync_wrapper::SyncWrapper;

use tracing::Span;

use super::{
    acquire::Acquired,
    release::{LetGo, Release, ReleaseOnDrop},
    renew::{RenewalSettings, Renewer},
    state::Engine,
    terms::Terms,
};
use crate::{
    config::OnLeaseLost,
    error::LostReason,
    lease::Lease,
    store::StoreError,
    telemetry::{self, Outcome},
    token::Token,
};

/// A held lease and everything that keeps or ends it.
pub(crate) struct Hold {
    lease: Lease,
    release: ReleaseOnDrop,
    renewal: Renewal,
    on_lost: OnLeaseLost,
    span: Span,
    /// The outcome is recorded (once).
    ended: bool,
}

/// Who renews the lease.
enum Renewal {
    /// The holder's own future, through [`Hold::poll_lost`] (only ever through `&mut`: the
    /// wrapper makes the hold `Sync`).
    Inline(SyncWrapper<Box<Renewer>>),
    /// The locker's background task.
    Background,
    /// Nobody: the lease is lost.
    Stopped,
}

impl Hold {
    /// Takes over a lease just acquired on `terms` (its TTL, and its holder held at most their
    /// `max_hold`; `None`: as long as it likes), and records the acquisition on `span`.
    pub(crate) fn new(acquired: Acquired, engine: &Engine, span: Span, terms: &Terms) -> Self {
        telemetry::record_acquired(
            &span,
            acquired.lease.fencing_token(),
            acquired.attempts,
            acquired.waited(),
        );
        let config = &engine.config;
        let renewer = Renewer::new(
            std::sync::Arc::clone(&engine.store),
            acquired.lease.clone(),
            acquired.release.token().clone(),
            acquired.renew_by,
            RenewalSettings {
                ttl: terms.ttl,
                interval: terms.interval,
                store_timeout: config.store_timeout(),
                max_hold: terms.max_hold,
            },
        );
        Self {
            lease: acquired.lease,
            release: acquired.release,
            renewal: Renewal::Inline(SyncWrapper::new(Box::new(renewer))),
            on_lost: terms.on_lost,
            span,
            ended: false,
        }
    }

    /// The lease, as the holder sees it.
    pub(crate) fn lease(&self) -> &Lease {
        &self.lease
    }

    /// The holder's token, for a store call that releases in its own way.
    pub(crate) fn token(&self) -> &Token {
        self.release.token()
    }

    /// The lease's span.
    pub(crate) fn span(&self) -> &Span {
        &self.span
    }

    /// Keeps the lease renewed; ready with the reason once it is lost (then renewal stops, and
    /// this stays pending). Driven by the holder's poll unless the renewal runs in the
    /// background, where it only waits for the loss.
    pub(crate) fn poll_lost(&mut self, cx: &mut Context<'_>) -> Poll<LostReason> {
        let lost = match &mut self.renewal {
            Renewal::Inline(renewer) => renewer.get_mut().poll_lost(cx),
            Renewal::Background | Renewal::Stopped => return Poll::Pending,
        };
        if lost.is_ready() {
            self.renewal = Renewal::Stopped;
        }
        lost
    }

    /// Whether a loss aborts the holder's work: with [`OnLeaseLost::Abort`], until the holder
    /// sends its first fenced batch that writes. From then on the work runs to its end, whatever happens to
    /// the lease: the batch may have landed, and the holder's own answer is the only one that
    /// can say so (the fence refuses its later batches once a newer holder touched the data).
    pub(crate) fn aborts_on_loss(&self) -> bool {
        self.on_lost == OnLeaseLost::Abort && !self.lease.has_fenced_writes()
    }

    /// Records how the holder's work ended (the first call wins).
    pub(crate) fn finish(&mut self, outcome: Outcome) {
        if !self.ended {
            self.ended = true;
            telemetry::record_end(&self.span, outcome, Some(&self.lease));
        }
    }

    /// Gives the lease back now; the caller awaits the release before answering, so a client
    /// that retries at once never meets its own lock. The outcome is recorded first
    /// ([`finish`](Self::finish)).
    pub(crate) fn release(mut self) -> Release {
        debug_assert!(
            self.ended,
            "a hold released before its outcome was recorded"
        );
        self.lease.set_releasing();
        self.release.release_now()
    }

    /// Ends the hold after a loss the holder aborts on. A lease that outlived `max_hold` is
    /// still ours: released before the holder answers (the release is returned, to await).
    /// Otherwise it is most likely not ours any more and the store may be down: the holder
    /// answers at once, and a token-checked release is spawned.
    pub(crate) fn abort(mut self, reason: LostReason) -> Option<Release> {
        self.finish(Outcome::LeaseLost);
        (reason == LostReason::MaxHold).then(|| self.release())
    }

    /// Lets go with `op` (the idempotency layer's record written with the release) instead of
    /// the store's release, now: returned to await (its first answer); after a failure it is
    /// sent again in a spawned task while the lease is valid (also if the returned future is
    /// dropped). The hold stays, for [`settle`](Self::settle) to record how that ended; never
    /// a plain release after it.
    pub(crate) fn let_go_with(&mut self, op: LetGo) -> Release {
        self.lease.set_releasing();
        self.release.let_go_with(op);
        self.release.release_now()
    }

    /// Ends the hold after [`let_go_with`](Self::let_go_with) answered: released, not ours any
    /// more, or failed (then it is being sent again, and failing that the key frees itself when
    /// its TTL runs out).
    pub(crate) fn settle(mut self, outcome: Outcome, answer: Result<bool, &StoreError>) {
        self.finish(outcome);
        if let Ok(released) = answer {
            self.release.disarm(released);
        }
    }

    /// Moves the renewal to the locker's background task: for a lease that outlives its
    /// holder's polls (a body that streams after its handler; a background lease).
    pub(crate) fn into_background(mut self, engine: &Engine) -> Self {
        if let Renewal::Inline(renewer) = std::mem::replace(&mut self.renewal, Renewal::Background)
        {
            engine
                .background
                .drive(*renewer.into_inner(), self.span.clone());
        }
        self
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        self.finish(Outcome::Dropped);
        // A background renewal stops; the armed guard spawns the release as it drops.
        self.lease.set_releasing();
    }
}

/// What a holder's work came to.
pub(crate) enum Guarded<T> {
    /// It finished.
    Done(T),
    /// The lease was lost and the policy aborts: the work is to be dropped.
    Aborted(LostReason),
}

/// Polls the holder's work under `hold`: the work first (work that is ready at once never arms
/// the renewal timer), then the renewal.
pub(crate) fn poll_guarded<F: Future>(
    work: Pin<&mut F>,
    hold: &mut Hold,
    cx: &mut Context<'_>,
) -> Poll<Guarded<F::Output>> {
    if let Poll::Ready(output) = work.poll(cx) {
        return Poll::Ready(Guarded::Done(output));
    }
    match hold.poll_lost(cx) {
        Poll::Ready(reason) if hold.aborts_on_loss() => Poll::Ready(Guarded::Aborted(reason)),
        _ => Poll::Pending,
    }
}
