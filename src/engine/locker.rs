//! [`Locker`]: the engine's public face, and the state its leases share.

use std::{fmt, future::Future, sync::Arc, time::Duration};

use tracing::{Instrument, Span};

use super::{acquire::acquire, guard::LeaseGuard, hold::Hold, state::Engine};
use crate::{
    config::LockConfig,
    error::LockError,
    key::{KeyRejection, LockKey},
    store::{Backend, LockStore},
    telemetry,
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
/// let config = LockConfig::builder()
///     .ttl(Duration::from_secs(5))
///     .wait(Wait::constant(Duration::from_millis(500)).forever())
///     .build()?;
/// let locker = Locker::with_config(MemoryStore::new(), config);
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
    engine: Arc<Engine>,
}

impl Locker {
    /// A locker over `store` with the default [`LockConfig`].
    pub fn new(store: impl LockStore) -> Self {
        Self::with_config(store, LockConfig::default())
    }

    /// A locker over `store` with `config`.
    pub fn with_config(store: impl LockStore, config: LockConfig) -> Self {
        Self {
            engine: Arc::new(Engine::new(Backend::new(store), config)),
        }
    }

    /// The settings in force.
    pub fn config(&self) -> &LockConfig {
        &self.engine.config
    }

    /// Builds the key for `value` in `namespace`, with the configured prefix and length limit.
    pub fn key(&self, namespace: &str, value: impl AsRef<[u8]>) -> Result<LockKey, KeyRejection> {
        let config = &self.engine.config;
        LockKey::new(
            config.key_prefix(),
            namespace,
            value.as_ref(),
            config.max_key_len(),
        )
    }

    /// Acquires `key`, waiting by the configured policy, and keeps it renewed in the
    /// background until the guard is released or dropped.
    ///
    /// Unlike requests, background leases are not bounded by `max_hold`, and with a
    /// [`Wait::forever`](crate::Wait::forever) policy store errors are waited out (logged at
    /// warn) rather than returned. Needs a Tokio runtime.
    pub async fn acquire(&self, key: LockKey) -> Result<LeaseGuard, LockError> {
        let span = telemetry::span(&key, self.engine.config.key_display());
        match self.hold(key, span.clone(), None).await {
            Ok(hold) => Ok(LeaseGuard::new(hold, Arc::clone(&self.engine))),
            Err(error) => {
                telemetry::record_not_acquired(&span, &error);
                Err(error)
            }
        }
    }

    /// Acquires `key` for a holder in `span`, held at most `max_hold`: the one way every holder
    /// (request, body, background work) gets its [`Hold`]. A holder that does not get it records
    /// the outcome itself (the idempotency layer decides it only after a record lookup).
    pub(crate) fn hold(
        &self,
        key: LockKey,
        span: Span,
        max_hold: Option<Duration>,
    ) -> impl Future<Output = Result<Hold, LockError>> + Send + 'static {
        let engine = Arc::clone(&self.engine);
        async move {
            let acquired = acquire(Arc::clone(&engine), key)
                .instrument(span.clone())
                .await?;
            Ok(Hold::new(acquired, &engine, span, max_hold))
        }
    }

    /// The state this locker's leases share.
    pub(crate) fn engine(&self) -> &Engine {
        &self.engine
    }
}

impl fmt::Debug for Locker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Locker")
            .field("config", &self.engine.config)
            .finish_non_exhaustive()
    }
}
