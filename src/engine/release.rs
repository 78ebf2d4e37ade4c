//! Giving a lease back: now (a [`Release`] the owner awaits) or on drop (one spawned on the
//! crate's own runtime, which outlives the runtime the guard was dropped on).
//!
//! Either way a release (or the holder's own way of letting go: the idempotency layer's record
//! written with the release) that fails is sent again, in a task on the crate's runtime, for as
//! long as the lease is valid: it is token-checked, so sending it twice is safe, and given up it
//! would leave the key locked until its TTL (or, for a record, let a retry run the handler
//! again).
//! The owner awaits only the first answer. See
//! `docs/DECISIONS.md`, "A failed release or completion is sent again while the lease is valid".

use std::{
    fmt,
    future::Future,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll, ready},
    time::Duration,
};

use tokio::time::Instant;

use super::local::Turns;
use crate::{
    background::{self, bounded, sleep},
    key::{KeySet, LockKey},
    lease::Lease,
    store::{Backend, BoxFuture, StoreError, StoreErrorKind},
    telemetry::{self, Chain, Op},
    token::Token,
};

/// The first pause before a failed release is sent again; it doubles up to [`RETRY_MAX`].
const RETRY_FIRST: Duration = Duration::from_millis(50);

/// The longest pause between two sends of a failed release.
const RETRY_MAX: Duration = Duration::from_millis(500);

/// A holder's own way of letting go of its lease, in place of the store's release: an
/// operation that releases the key only if it holds the holder's token (so that it may be sent
/// again), answering whether it did. The idempotency layer's record-and-release is one.
#[derive(Clone)]
pub(crate) struct LetGo(Arc<dyn Fn() -> BoxFuture<Result<bool, StoreError>> + Send + Sync>);

impl LetGo {
    pub(crate) fn new(
        op: impl Fn() -> BoxFuture<Result<bool, StoreError>> + Send + Sync + 'static,
    ) -> Self {
        Self(Arc::new(op))
    }
}

impl fmt::Debug for LetGo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("LetGo")
    }
}

/// Whether sending a release again may succeed: not for credentials, TLS or settings that
/// time does not fix.
fn worth_again(error: &StoreError) -> bool {
    !matches!(
        error.kind(),
        StoreErrorKind::Authentication
            | StoreErrorKind::Tls
            | StoreErrorKind::Config
            | StoreErrorKind::Entropy
            | StoreErrorKind::Misused
    )
}

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
    /// The lease once held: its end (as renewals extend it) bounds the release's retries.
    lease: Option<Lease>,
    /// Before that, when what the latest attempt may have taken runs out.
    until: Instant,
    /// The holder's own way of letting go, if not the store's release.
    op: Option<LetGo>,
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
            lease: None,
            until: Instant::now(),
            op: None,
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

    /// Arms the guard for an attempt that may take the key until `until` (sent now, with its
    /// TTL's validity): a failed release is sent again until then.
    pub(crate) fn arm_until(&mut self, until: Instant) {
        self.armed = true;
        self.until = self.until.max(until);
    }

    /// Takes this request's turns at its keys in the process-local queues.
    pub(crate) fn set_turns(&mut self, turns: Turns) {
        self.turns = Some(turns);
    }

    /// The lease is held since `at`: the release records the hold time, and the waiters behind
    /// this request in the process's queues are told of the lease.
    pub(crate) fn held(&mut self, at: Instant, lease: &Lease) {
        self.held_since = Some(at);
        self.lease = Some(lease.clone());
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

    /// An attempt goes to the store: the waiters behind this request in the process's queues
    /// that give up meanwhile wait for its answer.
    pub(crate) fn asking(&self) {
        if let Some(turns) = &self.turns {
            turns.asking();
        }
    }

    /// The store failed the attempt: the waiters behind this request in the process's queues
    /// that give up answer with this failure (503), not as if the key were held.
    pub(crate) fn failed(&self, error: &StoreError) {
        if let Some(turns) = &self.turns {
            turns.failed(error);
        }
    }

    /// Sends a release in a task of its own, keeping this request's place in the process's
    /// queue, and goes on with `token`: for a waiter that outlasts a store error, so that no
    /// hand-off message for the old token (given away by that release) is taken for its own.
    pub(crate) fn release_and_renew_token(&mut self, token: Token) {
        let turns = self.turns.take();
        let release = self.release_now();
        background::spawn(async move {
            let _ = release.await;
        });
        self.turns = turns;
        self.token = token;
    }

    /// Disarms the guard without releasing: the caller has released the lease by other means
    /// (`released`), or learnt it was no longer held. Counted like a release in the metrics.
    pub(crate) fn disarm(&mut self, released: bool) {
        self.armed = false;
        if let Some(since) = self.held_since.take() {
            telemetry::released(self.key().scope(), Ok(released), since.elapsed());
        }
    }

    /// Lets go with `op` instead of the store's release, from now on (this release, and the
    /// one the guard would send when dropped).
    pub(crate) fn let_go_with(&mut self, op: LetGo) {
        self.op = Some(op);
    }

    /// Disarms the guard and returns the release, for the caller to await: its first answer. A
    /// release that fails is sent again, in a task on the crate's runtime, while the lease is
    /// valid.
    ///
    /// If that future is dropped before it finishes (the client hung up while the response
    /// future was releasing), a fallback guard inside it spawns the release again.
    pub(crate) fn release_now(&mut self) -> Release {
        self.armed = false;
        let fallback = ReleaseOnDrop {
            store: Arc::clone(&self.store),
            keys: self.keys.clone(),
            token: self.token.clone(),
            timeout: self.timeout,
            armed: self.fallback,
            held_since: None,
            fallback: false,
            turns: None,
            lease: None,
            until: self
                .lease
                .as_ref()
                .map_or(self.until, |lease| lease.valid_until().max(self.until)),
            op: self.op.clone(),
        };
        Release {
            release: fallback.send(),
            fallback,
            turns: self.turns.take(),
            held_since: self.held_since.take(),
            sent_at: None,
        }
    }

    /// One send of the release (or of the holder's own way of letting go), bounded by the
    /// store timeout.
    fn send(&self) -> BoxFuture<Result<bool, StoreError>> {
        match &self.op {
            None => self
                .store
                .release_set(self.keys.clone(), self.token.clone(), self.timeout),
            Some(op) => {
                let (call, limit) = ((op.0)(), self.timeout);
                Box::pin(bounded(limit, call))
            }
        }
    }

    /// After the first send failed with `error`: the release sent again, with growing pauses,
    /// until one answers or `until` (the lease's end) would pass; the last answer. `None` if
    /// there is no time for another, or sending again cannot help. Owns what it sends: for a
    /// spawned task.
    fn again(&self, error: &StoreError) -> Option<BoxFuture<Result<bool, StoreError>>> {
        if !worth_again(error) || Instant::now() + RETRY_FIRST >= self.until {
            return None;
        }
        let sender = ReleaseOnDrop {
            store: Arc::clone(&self.store),
            keys: self.keys.clone(),
            token: self.token.clone(),
            timeout: self.timeout,
            armed: false,
            held_since: None,
            fallback: false,
            turns: None,
            lease: None,
            until: self.until,
            op: self.op.clone(),
        };
        Some(Box::pin(async move {
            let mut pause = RETRY_FIRST;
            loop {
                sleep(pause).await;
                let answer = sender.send().await;
                pause = (pause * 2).min(RETRY_MAX);
                match &answer {
                    Err(error) if worth_again(error) && Instant::now() + pause < sender.until => {
                        tracing::debug!(
                            error = %Chain(error),
                            "lease release failed again; sending it again while the lease is valid"
                        );
                    }
                    _ => return answer,
                }
            }
        }))
    }
}

impl Drop for ReleaseOnDrop {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        // On the crate's runtime: the current one may be dropped, or stop being driven, as soon
        // as this returns (a guard dropped at the end of a `block_on`).
        let release = self.release_now();
        background::spawn(async move {
            let _ = release.await;
        });
    }
}

/// A release in flight, from [`ReleaseOnDrop::release_now`]: the store's release (bounded by
/// the store timeout), then this process's turns at the keys passed on, the round trip and the
/// hold time recorded, and a failure logged. A failure is answered at once, and the release is
/// sent again, in a task on the crate's runtime, while the lease is valid. Dropped before it
/// answers, its armed fallback sends the release again in such a task.
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
        // Only now may the next request of this process try the keys: the key is free, or the
        // store failed, and its answer to that request is as good as ours.
        drop(this.turns.take());
        telemetry::round_trip(Op::Release, sent_at.elapsed());
        let key = this.fallback.key().clone();
        if let Err(error) = &result
            && let Some(again) = this.fallback.again(error)
        {
            tracing::debug!(
                scope = %key.scope(),
                error = %Chain(error),
                "lease release failed; sending it again while the lease is valid"
            );
            let held_since = this.held_since.take();
            // On the crate's runtime, like a release on drop: the caller's may go away.
            background::spawn(async move { settle(&key, held_since, &again.await) });
            return Poll::Ready(result);
        }
        settle(&key, this.held_since.take(), &result);
        Poll::Ready(result)
    }
}

/// Logs how a release ended (after any sends again) and records it in the metrics.
fn settle(key: &LockKey, held_since: Option<Instant>, result: &Result<bool, StoreError>) {
    match result {
        Ok(released) => tracing::debug!(released, "lease released"),
        Err(error) => {
            telemetry::store_error(key.scope(), Op::Release);
            tracing::warn!(
                scope = %key.scope(),
                error = %Chain(error),
                "lease release failed for as long as the lease was valid; the key frees itself \
                 when its TTL runs out"
            );
        }
    }
    if let Some(since) = held_since {
        telemetry::released(
            key.scope(),
            result.as_ref().map(|r| *r).map_err(|_| ()),
            since.elapsed(),
        );
    }
}

/// The first key of a lease's set (a lease holds at least one).
fn first(keys: &KeySet) -> &LockKey {
    keys.first().expect("a lease holds at least one key")
}
