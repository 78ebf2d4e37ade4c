//! The acquire / renew / release machinery, for the layer and for background work.

use std::{
    fmt,
    future::Future,
    ops::Deref,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll, ready},
    time::Duration,
};

use tokio::{
    runtime::Handle,
    time::{Instant, sleep_until, timeout},
};
use tracing::Instrument;

use crate::{
    batch::Renewals,
    config::{ConfigError, LockConfig},
    error::LockError,
    key::{KeyRejection, LockKey},
    lease::Lease,
    local::{LocalQueues, Turn},
    renew::{Renewer, RenewerSettings, Watchdog},
    store::{Acquire, BoxFuture, DynStore, LockStore, Signal, StoreError, StoreErrorKind},
    telemetry::{self, Chain, Op},
    token::Token,
};

/// Acquires, renews and releases leases on one store with one [`LockConfig`].
///
/// [`LockLayer`](crate::LockLayer) uses a `Locker` per request. Use one directly for work that is
/// not an HTTP request: a job that must run on one instance at a time, a leader election.
/// [`acquire`](Self::acquire) waits by the configured [`Wait`](crate::Wait) policy and returns a
/// [`LeaseGuard`] that renews in the background and releases on drop.
///
/// ```
/// use std::time::Duration;
/// use tower_lock::{LockConfig, Locker, MemoryStore, Wait};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let config = LockConfig::default()
///     .ttl(Duration::from_secs(5))
///     .wait(Wait::constant(Duration::from_millis(500)).forever());
/// let locker = Locker::with_config(MemoryStore::new(), config)?;
///
/// let key = locker.key("jobs", "nightly-report")?;
/// let guard = locker.acquire(key).await?;
/// tokio::select! {
///     reason = guard.lost() => eprintln!("lost the lock: {reason}"),
///     _ = async { /* the job */ } => {}
/// }
/// guard.release().await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Locker {
    inner: Arc<Inner>,
}

struct Inner {
    store: Arc<dyn DynStore>,
    config: LockConfig,
    local: Arc<LocalQueues>,
    renewals: Arc<Renewals>,
}

impl Inner {
    fn new(store: Arc<dyn DynStore>, config: LockConfig) -> Self {
        // The key layout's table of hash tags, built now rather than by the first request.
        crate::slot::warm();
        Self {
            renewals: Arc::new(Renewals::new(Arc::clone(&store))),
            store,
            config,
            local: Arc::default(),
        }
    }
}

/// A lease just acquired: what the layer carries into the running state.
pub(crate) struct Held {
    pub(crate) lease: Lease,
    pub(crate) guard: ReleaseGuard,
    pub(crate) acquired_at: Instant,
    /// When the first attempt was made.
    pub(crate) requested_at: Instant,
    pub(crate) attempts: u32,
    /// When the first renewal is due, if sooner than usual: a key handed over by a release is
    /// only reserved for the claim window until that renewal confirms it.
    pub(crate) renew_by: Option<Instant>,
}

impl Locker {
    /// A locker over `store` with the default [`LockConfig`].
    pub fn new(store: impl LockStore) -> Self {
        Self {
            inner: Arc::new(Inner::new(Arc::new(store), LockConfig::default())),
        }
    }

    /// A locker over `store` with `config`, checked now.
    pub fn with_config(store: impl LockStore, config: LockConfig) -> Result<Self, ConfigError> {
        config.validate()?;
        Ok(Self {
            inner: Arc::new(Inner::new(Arc::new(store), config)),
        })
    }

    /// The settings in force.
    pub fn config(&self) -> &LockConfig {
        &self.inner.config
    }

    /// Builds the key for `value` in `namespace`, with the configured prefix and length limit.
    pub fn key(&self, namespace: &str, value: impl AsRef<[u8]>) -> Result<LockKey, KeyRejection> {
        let config = &self.inner.config;
        LockKey::new(
            config.key_prefix_value(),
            namespace,
            value.as_ref(),
            config.max_key_len_value(),
        )
    }

    /// Acquires `key`, waiting by the configured policy, and keeps it renewed in a background
    /// task until the guard is released or dropped.
    ///
    /// Unlike requests, background leases are not bounded by `max_hold`, and with a
    /// [`Wait::forever`](crate::Wait::forever) policy store errors are waited out (logged at warn)
    /// rather than returned. Needs a Tokio runtime.
    pub async fn acquire(&self, key: LockKey) -> Result<LeaseGuard, LockError> {
        let span = telemetry::span(&key, self.inner.config.key_display_value());
        let held = match self
            .clone()
            .acquire_held(key)
            .instrument(span.clone())
            .await
        {
            Ok(held) => held,
            Err(error) => {
                span.record("outcome", "not_acquired");
                return Err(error);
            }
        };
        span.in_scope(|| {
            let waited = held
                .acquired_at
                .saturating_duration_since(held.requested_at);
            telemetry::record_acquired(held.lease.fencing_token(), held.attempts, waited);
        });
        let renewer = self.renewer(&held, None);
        let watchdog = Watchdog::spawn(&Handle::current(), renewer, span.clone());
        Ok(LeaseGuard {
            lease: held.lease,
            guard: held.guard,
            watchdog,
            span,
        })
    }

    pub(crate) fn renewer(&self, held: &Held, max_hold: Option<Duration>) -> Renewer {
        let config = &self.inner.config;
        Renewer::new(
            Arc::clone(&self.inner.store),
            Arc::clone(&self.inner.renewals),
            held.lease.clone(),
            held.guard.token.clone(),
            held.acquired_at,
            held.renew_by,
            RenewerSettings {
                ttl: config.ttl_value(),
                interval: config.renew_interval_value(),
                store_timeout: config.store_timeout_value(),
                max_hold,
            },
        )
    }

    /// Tries until acquired, the wait policy gives up (409), or the store fails (503).
    ///
    /// The release guard is armed whenever an attempt may have taken the key, so dropping this
    /// future (or giving up on a timed-out attempt) schedules a token-checked release.
    pub(crate) async fn acquire_held(self, key: LockKey) -> Result<Held, LockError> {
        let config = &self.inner.config;
        let token = Token::generate().map_err(StoreError::entropy)?;
        let start = Instant::now();
        let deadline = config.wait_value().total().map(|d| start + d);
        let ttl = config.ttl_value();
        let floor = config.store_timeout_value();
        let mut guard = ReleaseGuard {
            store: Arc::clone(&self.inner.store),
            key,
            token,
            timeout: floor,
            armed: false,
            held_since: None,
            fallback: true,
            turn: None,
        };
        // Requests of this process that want the same key wait here, in order, and only the
        // first contends in the store; a holder's release wakes the next at once.
        match self.inner.local.turn(&guard.key, deadline).await {
            Ok(turn) => guard.turn = Some(turn),
            Err(gave_up) => {
                let waited = start.elapsed();
                tracing::debug!(?waited, "lease contended in this process; giving up");
                telemetry::contended(&guard.key.scope_label(), waited);
                // The holder's remaining lease, as the head of the local queue knows it: its own
                // lease, or the TTL the store reported for another holder. The head may not
                // have heard from the store yet: then the TTL, what it holds if it takes the key.
                return Err(LockError::Contended {
                    expires_in: Some(gave_up.holder_left.unwrap_or(ttl)),
                    waited,
                    attempts: 0,
                });
            }
        }
        // With a store that hands off, a waiter joins the key's queue and is handed the key by
        // the release before it; it registers to hear that once its attempt says it is queued.
        let waits = config.wait_value().waits();
        let schedule_end = config.wait_value().schedule_len().map(|d| start + d);
        let mut queue = None;
        let mut queued = false;
        let mut handed: Option<(u64, Instant)> = None;
        let mut delays = None;
        let mut attempts = 0u32;
        loop {
            if let Some((fencing_token, valid_until)) = handed.take() {
                // Handed over: reserved for us until at least `valid_until`. With enough of it
                // left, run now and let the first renewal confirm; otherwise confirm first.
                if valid_until.saturating_duration_since(Instant::now()) >= MIN_HANDED_OVER {
                    return Ok(self.handed_over(
                        guard,
                        fencing_token,
                        valid_until,
                        start,
                        attempts,
                    ));
                }
            }
            attempts += 1;
            let sent_at = Instant::now();
            let limit = deadline.map_or(floor, |d| d.saturating_duration_since(sent_at).max(floor));
            // Registered before the attempt, so a release right after it is not missed.
            let released = match queue {
                Some(_) => None,
                None => guard.store.watch(&guard.key),
            };
            guard.armed = true;
            let (store, key, token) = (
                Arc::clone(&guard.store),
                guard.key.clone(),
                guard.token.clone(),
            );
            let attempt = if waits {
                store.enqueue(key, token, ttl)
            } else {
                store.acquire(key, token, ttl)
            };
            let answer = timeout(limit, attempt)
                .await
                .unwrap_or_else(|_| Err(StoreError::timeout(limit)));
            telemetry::round_trip(Op::Acquire, sent_at.elapsed());
            // The store's refusal of this attempt, when it asked to be asked again.
            let mut refused = None;
            let expires_in = match answer {
                Ok(Acquire::Acquired { fencing_token }) => {
                    let waited = sent_at - start;
                    tracing::debug!(attempts, ?waited, "lease acquired");
                    telemetry::acquired(&guard.key.scope_label(), waited);
                    guard.held_since = Some(sent_at);
                    let lease = Lease::new(
                        guard.key.clone(),
                        fencing_token,
                        sent_at,
                        guard.store.validity(ttl),
                    );
                    guard.publish(&lease);
                    return Ok(Held {
                        lease,
                        guard,
                        acquired_at: sent_at,
                        requested_at: start,
                        attempts,
                        renew_by: None,
                    });
                }
                Ok(Acquire::Held { expires_in }) => expires_in,
                Ok(Acquire::Queued { expires_in }) => {
                    queued = true;
                    if queue.is_none() {
                        queue = guard.store.queue_watch(&guard.key, &guard.token);
                    }
                    expires_in
                }
                // Refused unrun, to be sent again shortly (a Redis Cluster slot in migration):
                // waited out like a held key, within the deadline. Nothing was written, so the
                // token and any place in the store's queue stand.
                Err(error) if error.kind() == StoreErrorKind::TryAgain => {
                    telemetry::store_error(&guard.key.scope_label(), Op::Acquire);
                    tracing::debug!(
                        attempts,
                        error = %Chain(&error),
                        "lock store asked to try again; retrying"
                    );
                    refused = Some(error);
                    None
                }
                // A bounded wait fails fast on any other store error (503). The armed guard
                // releases in case the command was executed after all (and leaves the queue).
                Err(error) if deadline.is_some() => {
                    telemetry::store_error(&guard.key.scope_label(), Op::Acquire);
                    return Err(error.into());
                }
                // An unbounded one (background work) waits through the outage.
                Err(error) => {
                    telemetry::store_error(&guard.key.scope_label(), Op::Acquire);
                    tracing::warn!(
                        attempts,
                        error = %Chain(&error),
                        "lock store failed while waiting forever; retrying"
                    );
                    // Resend a release, but keep this request's place in the local queue.
                    let turn = guard.turn.take();
                    tokio::spawn(guard.release_now());
                    guard.turn = turn;
                    // That release leaves the store's queue, or hands on a key handed to this
                    // token meanwhile: go on with a fresh token, so that no message for the old
                    // one (a hand-off given away already) can be taken for ours.
                    guard.token = Token::generate().map_err(StoreError::entropy)?;
                    queue = None;
                    queued = false;
                    handed = None;
                    None
                }
            };
            // Told to the waiters behind us in this process, should they give up.
            if let Some(turn) = &guard.turn {
                turn.held_elsewhere(expires_in);
            }
            // While queued, the key may be handed to us at any moment: stay armed, so that
            // giving up (or being dropped) leaves the queue or passes the key on.
            guard.armed = queued;
            let now = Instant::now();
            let next = delays
                .get_or_insert_with(|| config.wait_value().delays())
                .next()
                .map(|delay| now + delay);
            let wake = match (next, deadline) {
                (Some(next), Some(deadline)) if now < deadline => next.min(deadline),
                (Some(next), None) => next,
                _ => {
                    // Out of time after a refusal: answer as the refusal would (503).
                    if let Some(error) = refused {
                        tracing::debug!(attempts, "lock store still asks to try again; giving up");
                        return Err(error.into());
                    }
                    let waited = now - start;
                    tracing::debug!(attempts, ?waited, "lease contended; giving up");
                    telemetry::contended(&guard.key.scope_label(), waited);
                    return Err(LockError::Contended {
                        expires_in,
                        waited,
                        attempts,
                    });
                }
            };
            // The timer is only the fallback, for a lost message: when the holder's lease
            // would run out, or at the deadline.
            let fallback = now + expires_in.unwrap_or(ttl);
            let mut fallback = deadline.map_or(fallback, |d| fallback.min(d));
            if let Some(end) = schedule_end {
                // A finite schedule (a fixed list) bounds a queued wait too.
                fallback = fallback.min(end);
            }
            match (&mut queue, released) {
                // After a refusal, the next attempt is due by the schedule, not at a release.
                _ if refused.is_some() => sleep_until(wake).await,
                (Some(watch), _) if queued => {
                    tracing::debug!(attempts, "lease contended; queued for its hand-off");
                    loop {
                        tokio::select! {
                            signal = watch.signal() => match signal {
                                Signal::Granted { fencing_token, valid_until } => {
                                    handed = Some((fencing_token, valid_until));
                                    break;
                                }
                                // The waiter before us was just handed the key: if it never
                                // claims it (its process died), check again after the window.
                                Signal::Next { within } => {
                                    let by = Instant::now() + within + NEXT_SLACK;
                                    fallback = fallback.min(by);
                                }
                                _ => break,
                            },
                            () = sleep_until(fallback) => break,
                        }
                    }
                }
                // Woken by the release (a store that announces them).
                (_, Some(released)) => {
                    tracing::debug!(attempts, "lease contended; waiting for its release");
                    tokio::select! {
                        () = released => {}
                        () = sleep_until(fallback) => {}
                    }
                }
                _ => {
                    tracing::debug!(attempts, "lease contended; waiting");
                    sleep_until(wake).await;
                }
            }
        }
    }

    /// The lease a release handed to this waiter: held from now, reserved until `valid_until`,
    /// with the first renewal (the claim) due within a third of that.
    fn handed_over(
        &self,
        mut guard: ReleaseGuard,
        fencing_token: u64,
        valid_until: Instant,
        requested_at: Instant,
        attempts: u32,
    ) -> Held {
        let now = Instant::now();
        let left = valid_until.saturating_duration_since(now);
        let waited = now - requested_at;
        tracing::debug!(attempts, ?waited, "lease handed over");
        telemetry::acquired(&guard.key.scope_label(), waited);
        guard.held_since = Some(now);
        let lease = Lease::new(guard.key.clone(), fencing_token, now, left);
        guard.publish(&lease);
        Held {
            lease,
            guard,
            acquired_at: now,
            requested_at,
            attempts,
            renew_by: Some(now + left / 3),
        }
    }
}

impl fmt::Debug for Locker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Locker")
            .field("config", &self.inner.config)
            .finish_non_exhaustive()
    }
}

/// A key handed over by a release is run at once only with at least this much of its claim
/// window left; with less, the waiter confirms it (one more round trip) first.
const MIN_HANDED_OVER: Duration = Duration::from_millis(100);

/// Added to a claim window before the next waiter checks again, so that a claim in flight
/// lands first.
const NEXT_SLACK: Duration = Duration::from_millis(50);

/// Releases a lease when dropped, unless disarmed; never blocks and never panics.
pub(crate) struct ReleaseGuard {
    store: Arc<dyn DynStore>,
    key: LockKey,
    token: Token,
    timeout: Duration,
    armed: bool,
    /// Set once the lease is acquired, for the hold time and the leases-held gauge.
    held_since: Option<Instant>,
    /// Whether `release_now` arms a fallback that re-sends the release if its future is dropped
    /// unfinished (false for that fallback itself, so a dying runtime cannot loop).
    fallback: bool,
    /// This request's place in the process-local queue for the key, passed on after release.
    turn: Option<Turn>,
}

impl ReleaseGuard {
    /// Tells the waiters behind this request in the process's queue that it holds `lease`.
    fn publish(&self, lease: &Lease) {
        if let Some(turn) = &self.turn {
            turn.acquired(lease);
        }
    }

    /// The holder's token, for a store operation that releases in its own way (the
    /// idempotency layer's record-and-release script).
    pub(crate) fn token(&self) -> &Token {
        &self.token
    }

    /// Disarms the guard without releasing: the caller has released the lease by other means
    /// (`released`), or learnt it was no longer held. Counted like a release in the metrics.
    pub(crate) fn disarm(&mut self, released: bool) {
        self.armed = false;
        if let Some(since) = self.held_since.take() {
            telemetry::released(&self.key.scope_label(), Ok(released), since.elapsed());
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
            release: Arc::clone(&self.store).release(self.key.clone(), self.token.clone(), limit),
            fallback: ReleaseGuard {
                store: Arc::clone(&self.store),
                key: self.key.clone(),
                token: self.token.clone(),
                timeout: limit,
                armed: self.fallback,
                held_since: None,
                fallback: false,
                turn: None,
            },
            turn: self.turn.take(),
            held_since: self.held_since.take(),
            sent_at: None,
        }
    }
}

/// A release in flight, from [`ReleaseGuard::release_now`]: the store's release (bounded by the
/// store timeout), then this process's turn at the key passed on, the round trip and the hold
/// time recorded, and a failure logged. Dropped before it finishes, its armed fallback guard
/// sends the release again in a spawned task.
pub(crate) struct Release {
    release: BoxFuture<Result<bool, StoreError>>,
    fallback: ReleaseGuard,
    turn: Option<Turn>,
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
        // Only now may the next request of this process try the key.
        drop(this.turn.take());
        telemetry::round_trip(Op::Release, sent_at.elapsed());
        let key = &this.fallback.key;
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

impl Drop for ReleaseGuard {
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

/// A lease held by background work: renewed in a background task, released on drop.
///
/// Derefs to [`Lease`] for the fencing token and loss status. Loss is noticed at the next
/// renewal (every `ttl / 3`), so work may run up to that long after the key was taken away: fence
/// the writes that matter with [`Lease::fencing_token`]. Never `std::mem::forget` a guard: its
/// renewal task would keep the lease forever. Prefer
/// [`release`](Self::release) at the end of the work, which waits for the store to confirm;
/// dropping the guard releases too, in a spawned task.
pub struct LeaseGuard {
    lease: Lease,
    guard: ReleaseGuard,
    watchdog: Watchdog,
    span: tracing::Span,
}

impl LeaseGuard {
    /// The lease this guard holds.
    pub fn lease(&self) -> &Lease {
        &self.lease
    }

    /// Stops renewing and releases the lease now. `Ok(false)`: it was no longer ours.
    pub async fn release(mut self) -> Result<bool, StoreError> {
        // The renewal task stops once the release is answered (see `Watchdog::releasing`).
        self.watchdog.releasing();
        let release = self.guard.release_now().instrument(self.span.clone());
        // Recorded now, like a request's, so that a release dropped on its way still ends the
        // span (and `hold_ms` leaves out the release's round trip).
        self.span
            .in_scope(|| telemetry::record_end("released", Some(&self.lease)));
        release.await
    }
}

impl Deref for LeaseGuard {
    type Target = Lease;

    fn deref(&self) -> &Lease {
        &self.lease
    }
}

impl Drop for LeaseGuard {
    fn drop(&mut self) {
        // The watchdog stops as it drops.
        if self.guard.armed {
            self.span
                .in_scope(|| telemetry::record_end("dropped", Some(&self.lease)));
        }
    }
}

impl fmt::Debug for LeaseGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeaseGuard")
            .field("lease", &self.lease)
            .finish()
    }
}
