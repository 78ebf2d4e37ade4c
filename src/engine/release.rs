//! Giving a lease back: now (a [`Release`] the owner awaits) or on drop (a spawned one).

use std::{
    future::Future,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll, ready},
    time::Duration,
};

use tokio::{runtime::Handle, time::Instant};

use super::local::Turns;
use crate::{
    key::{KeySet, LockKey},
    lease::Lease,
    store::{Backend, BoxFuture, StoreError},
    telemetry::{self, Chain, Op},
    token::Token,
};

/// Releases a lease when dropped, unless disarmed; never blocks and never panics.
///
/// Armed whenever an attempt may have taken a key (an acquire in flight, a place in a
/// hand-off queue, a held lease), so that a future dropped in any state leaves no key behind
/// beyond one spawned, token-checked release (of every key of the lease, in one step where
/// the store can).
pub(crate) struct ReleaseOnDrop {
    store: Arc<Backend>,
    keys: KeySet,
    token: Token,
    timeout: Duration,
    armed: bool,
    /// Set once the lease is acquired, for the hold time and the leases-held gauge.
    held_since: Option<Instant>,
    /// Whether [`release_now`](Self::release_now) arms a fallback that sends the release again
    /// if its future is dropped unfinished (false for that fallback itself, so a dying runtime
    /// cannot loop).
    fallback: bool,
    /// This request's places in the process-local queues of its keys, passed on after release.
    turns: Option<Turns>,
}

impl ReleaseOnDrop {
    /// A disarmed guard for `keys` held (or about to be tried) with `token`.
    pub(crate) fn new(store: Arc<Backend>, keys: KeySet, token: Token, timeout: Duration) -> Self {
        Self {
            store,
            keys,
            token,
            timeout,
            armed: false,
            held_since: None,
            fallback: true,
            turns: None,
        }
    }

    pub(crate) fn keys(&self) -> &KeySet {
        &self.keys
    }

    /// The first key: its scope labels the lease's metrics.
    pub(crate) fn key(&self) -> &LockKey {
        first(&self.keys)
    }

    pub(crate) fn store(&self) -> &Arc<Backend> {
        &self.store
    }

    /// The holder's token, for a store operation that releases in its own way (the
    /// idempotency layer's record-and-release script).
    pub(crate) fn token(&self) -> &Token {
        &self.token
    }

    /// Arms (an attempt may take the key) or disarms (the store said it did not) the guard.
    pub(crate) fn arm(&mut self, armed: bool) {
        self.armed = armed;
    }

    /// Takes this request's turns at its keys in the process-local queues.
    pub(crate) fn set_turns(&mut self, turns: Turns) {
        self.turns = Some(turns);
    }

    /// The lease is held since `at`: the release records the hold time, and the waiters behind
    /// this request in the process's queues are told of the lease.
    pub(crate) fn held(&mut self, at: Instant, lease: &Lease) {
        self.held_since = Some(at);
        if let Some(turns) = &self.turns {
            turns.acquired(lease);
        }
    }

    /// The store said someone else holds the key at `blocked` (in lock order), for
    /// `expires_in`: told to the waiters behind this request at that key in the process's
    /// queue, should they give up.
    pub(crate) fn held_elsewhere(&self, blocked: usize, expires_in: Option<Duration>) {
        if let Some(turns) = &self.turns {
            turns.held_elsewhere(blocked, expires_in);
        }
    }

    /// Sends a release in a task of its own, keeping this request's place in the process's
    /// queue, and goes on with `token`: for a waiter that outlasts a store error, so that no
    /// hand-off message for the old token (given away by that release) is taken for its own.
    pub(crate) fn release_and_renew_token(&mut self, token: Token) {
        let turns = self.turns.take();
        let release = self.release_now();
        if let Ok(handle) = Handle::try_current() {
            handle.spawn(release);
        }
        self.turns = turns;
        self.token = token;
    }

    /// Disarms the guard without releasing: the caller has released the lease by other means
    /// (`released`), or learnt it was no longer held. Counted like a release in the metrics.
    pub(crate) fn disarm(&mut self, released: bool) {
        self.armed = false;
        if let Some(since) = self.held_since.take() {
            telemetry::released(&self.key().scope_label(), Ok(released), since.elapsed());
        }
    }

    /// Disarms the guard and returns the release, for the caller to await.
    ///
    /// If that future is dropped before it finishes (the client hung up while the response
    /// future was releasing), a fallback guard inside it spawns the release again.
    pub(crate) fn release_now(&mut self) -> Release {
        self.armed = false;
        let limit = self.timeout;
        Release {
            release: self
                .store
                .release_set(self.keys.clone(), self.token.clone(), limit),
            fallback: ReleaseOnDrop {
                store: Arc::clone(&self.store),
                keys: self.keys.clone(),
                token: self.token.clone(),
                timeout: limit,
                armed: self.fallback,
                held_since: None,
                fallback: false,
                turns: None,
            },
            turns: self.turns.take(),
            held_since: self.held_since.take(),
            sent_at: None,
        }
    }
}

impl Drop for ReleaseOnDrop {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        // Without a runtime there is nothing to run the release on; the TTL frees the key.
        if let Ok(handle) = Handle::try_current() {
            let release = self.release_now();
            handle.spawn(release);
        }
    }
}

/// A release in flight, from [`ReleaseOnDrop::release_now`]: the store's release (bounded by
/// the store timeout), then this process's turns at the keys passed on, the round trip and the
/// hold time recorded, and a failure logged. Dropped before it finishes, its armed fallback
/// sends the release again in a spawned task.
pub(crate) struct Release {
    release: BoxFuture<Result<bool, StoreError>>,
    fallback: ReleaseOnDrop,
    turns: Option<Turns>,
    held_since: Option<Instant>,
    sent_at: Option<Instant>,
}

impl Future for Release {
    type Output = Result<bool, StoreError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = &mut *self;
        let sent_at = *this.sent_at.get_or_insert_with(Instant::now);
        let result = ready!(this.release.as_mut().poll(cx));
        this.fallback.armed = false;
        // Only now may the next request of this process try the keys.
        drop(this.turns.take());
        telemetry::round_trip(Op::Release, sent_at.elapsed());
        let key = this.fallback.key();
        match &result {
            Ok(released) => tracing::debug!(released, "lease released"),
            Err(error) => {
                telemetry::store_error(&key.scope_label(), Op::Release);
                tracing::warn!(
                    scope = %key.scope_label(),
                    error = %Chain(error),
                    "lease release failed; the key frees itself when its TTL runs out"
                );
            }
        }
        if let Some(since) = this.held_since.take() {
            telemetry::released(
                &key.scope_label(),
                result.as_ref().map(|r| *r).map_err(|_| ()),
                since.elapsed(),
            );
        }
        Poll::Ready(result)
    }
}

/// The first key of a lease's set (a lease holds at least one).
fn first(keys: &KeySet) -> &LockKey {
    keys.first().expect("a lease holds at least one key")
}
