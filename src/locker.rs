//! The acquire / renew / release machinery, for the layer and for background work.

use std::{fmt, future::poll_fn, ops::Deref, sync::Arc, time::Duration};

use tokio::{
    runtime::Handle,
    task::AbortHandle,
    time::{Instant, sleep_until, timeout},
};

use crate::{
    config::{ConfigError, LockConfig},
    error::LockError,
    key::{KeyRejection, LockKey},
    lease::Lease,
    renew::{Renewer, RenewerSettings},
    store::{Acquire, BoxFuture, DynStore, LockStore, StoreError},
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
}

/// A lease just acquired: what the layer carries into the running state.
pub(crate) struct Held {
    pub(crate) lease: Lease,
    pub(crate) guard: ReleaseGuard,
    pub(crate) acquired_at: Instant,
}

impl Locker {
    /// A locker over `store` with the default [`LockConfig`].
    pub fn new(store: impl LockStore) -> Self {
        Self {
            inner: Arc::new(Inner {
                store: Arc::new(store),
                config: LockConfig::default(),
            }),
        }
    }

    /// A locker over `store` with `config`, checked now.
    pub fn with_config(store: impl LockStore, config: LockConfig) -> Result<Self, ConfigError> {
        config.validate()?;
        Ok(Self {
            inner: Arc::new(Inner {
                store: Arc::new(store),
                config,
            }),
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
        let held = self.clone().acquire_held(key).await?;
        let renewer = self.renewer(&held, None);
        let watchdog = tokio::spawn(watch(renewer)).abort_handle();
        Ok(LeaseGuard {
            lease: held.lease,
            guard: held.guard,
            watchdog,
        })
    }

    pub(crate) fn renewer(&self, held: &Held, max_hold: Option<Duration>) -> Renewer {
        let config = &self.inner.config;
        Renewer::new(
            Arc::clone(&self.inner.store),
            held.lease.clone(),
            held.guard.token.clone(),
            held.acquired_at,
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
        };
        let mut delays = None;
        let mut attempts = 0u32;
        loop {
            attempts += 1;
            let sent_at = Instant::now();
            let limit = deadline.map_or(floor, |d| d.saturating_duration_since(sent_at).max(floor));
            guard.armed = true;
            let attempt =
                Arc::clone(&guard.store).acquire(guard.key.clone(), guard.token.clone(), ttl);
            let expires_in = match timeout(limit, attempt).await {
                // A bounded wait fails fast on a store error (503); an unbounded one (background
                // work) waits through the outage. The armed guard releases in case it was sent.
                Err(_) if deadline.is_some() => return Err(StoreError::timeout(limit).into()),
                Ok(Err(error)) if deadline.is_some() => return Err(error.into()),
                Err(_) | Ok(Err(_)) => {
                    tracing::warn!(
                        scope = guard.key.scope(),
                        attempts,
                        "lock store failed while waiting forever; retrying"
                    );
                    let release = guard.release_now();
                    tokio::spawn(release);
                    None
                }
                Ok(Ok(Acquire::Acquired { fencing_token })) => {
                    tracing::debug!(scope = guard.key.scope(), attempts, "lease acquired");
                    return Ok(Held {
                        lease: Lease::new(guard.key.clone(), fencing_token, sent_at, ttl),
                        guard,
                        acquired_at: sent_at,
                    });
                }
                Ok(Ok(Acquire::Held { expires_in })) => expires_in,
            };
            guard.armed = false;
            let now = Instant::now();
            let next = delays
                .get_or_insert_with(|| config.wait_value().delays())
                .next()
                .map(|delay| now + delay);
            let wake = match (next, deadline) {
                (Some(next), Some(deadline)) if now < deadline => next.min(deadline),
                (Some(next), None) => next,
                _ => {
                    tracing::debug!(
                        scope = guard.key.scope(),
                        attempts,
                        "lease contended; giving up"
                    );
                    return Err(LockError::Contended {
                        expires_in,
                        waited: now - start,
                    });
                }
            };
            tracing::debug!(
                scope = guard.key.scope(),
                attempts,
                "lease contended; waiting"
            );
            sleep_until(wake).await;
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

async fn watch(mut renewer: Renewer) {
    poll_fn(|cx| renewer.poll_lost(cx)).await;
}

/// Releases a lease when dropped, unless disarmed; never blocks and never panics.
pub(crate) struct ReleaseGuard {
    store: Arc<dyn DynStore>,
    key: LockKey,
    token: Token,
    timeout: Duration,
    armed: bool,
}

impl ReleaseGuard {
    /// Disarms the guard and returns the release, for the caller to await.
    pub(crate) fn release_now(&mut self) -> BoxFuture<Result<bool, StoreError>> {
        self.armed = false;
        let limit = self.timeout;
        let release = Arc::clone(&self.store).release(self.key.clone(), self.token.clone());
        let scope = self.key.scope().to_owned();
        Box::pin(async move {
            let result = timeout(limit, release)
                .await
                .unwrap_or_else(|_| Err(StoreError::timeout(limit)));
            if let Err(error) = &result {
                tracing::warn!(
                    scope,
                    error = error as &dyn std::error::Error,
                    "lease release failed; the key frees itself when its TTL runs out"
                );
            }
            result
        })
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
    watchdog: AbortHandle,
}

impl LeaseGuard {
    /// The lease this guard holds.
    pub fn lease(&self) -> &Lease {
        &self.lease
    }

    /// Stops renewing and releases the lease now. `Ok(false)`: it was no longer ours.
    pub async fn release(mut self) -> Result<bool, StoreError> {
        self.watchdog.abort();
        self.guard.release_now().await
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
        self.watchdog.abort();
    }
}

impl fmt::Debug for LeaseGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeaseGuard")
            .field("lease", &self.lease)
            .finish()
    }
}
