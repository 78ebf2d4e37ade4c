//! [`Locker`]: the engine's public face, and the state its leases share.

use std::{fmt, future::Future, sync::Arc, time::Duration};

use tracing::{Instrument, Span};

use super::{
    acquire::acquire, acquiring::Acquiring, guard::LeaseGuard, hold::Hold, state::Engine,
    terms::Terms,
};
use crate::{
    config::LockConfig,
    error::LockError,
    key::{KeyRejection, KeySet, LockKey},
    store::{Backend, LockStore},
};

/// Acquires, renews and releases leases on one store with one [`LockConfig`].
///
/// [`LockLayer`](crate::LockLayer) uses a `Locker` per request. Use one directly for work that is
/// not an HTTP request: a job that must run on one instance at a time, a leader election.
/// [`acquire`](Self::acquire) waits by the configured [`Wait`](crate::Wait) policy and returns a
/// [`LeaseGuard`] that renews in the background and releases on drop;
/// [`try_acquire`](Self::try_acquire) does not wait; [`run`](Self::run) runs a future under a
/// lease and cancels it if the lease is lost. Each takes one key or several: a [`KeySet`],
/// taken as one lease (all of them or none, in a deadlock-free order, a fencing token per key).
/// Per call, [`acquire`](Self::acquire)'s builder sets another wait policy, TTL, or longest hold
/// ([`Acquiring`]).
///
/// ```
/// use std::time::Duration;
/// use tower_lock::{LockConfig, Locker, MemoryStore, Wait};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let config = LockConfig::builder()
///     .ttl(Duration::from_secs(5))
///     .wait(Wait::constant(Duration::from_millis(500))?.forever())
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
///
/// A transfer between two accounts, both locked as one lease, whatever order other transfers
/// name them in:
///
/// ```
/// # use tower_lock::{Locker, MemoryStore};
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let locker = Locker::new(MemoryStore::new());
/// let (from, to) = (locker.key("accounts", "alice")?, locker.key("accounts", "bob")?);
/// let moved = locker
///     .run([from.clone(), to.clone()], async {
///         // Debit `from`, credit `to`: nothing else touches either account meanwhile.
///         5
///     })
///     .await?;
/// assert_eq!(moved, 5);
/// // Free again: taken at once, without waiting.
/// let guard = locker.try_acquire([to, from]).await?.expect("free");
/// assert_eq!(guard.keys().len(), 2);
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

    /// Acquires `keys` (one [`LockKey`], or several: anything that makes a [`KeySet`]) as one
    /// lease, waiting by the configured policy, and keeps it renewed in the background (on the
    /// crate's own runtime, whether or not the caller's runtime is driven meanwhile) until the
    /// guard is released or dropped; a lease that is lost is reported lost
    /// ([`Lease::is_lost`](crate::Lease::is_lost)).
    ///
    /// Await it as it is, or set another wait policy, TTL or longest hold for this call first
    /// (see [`Acquiring`]). Unlike requests, background leases are not bounded by `max_hold`
    /// unless the call sets one, and with a [`Wait::forever`](crate::Wait::forever) policy
    /// store errors are waited out (logged at warn) rather than returned. Needs a Tokio
    /// runtime.
    ///
    /// # Re-entry
    ///
    /// A task that holds a lease re-enters it: inside a handler behind [`LockLayer`] (or the
    /// work of [`run`](Self::run)), and anything it awaits in that task, an acquire of keys the
    /// lease holds (the same key bytes: the same prefix, namespace and value, through any
    /// locker over the same store or a clone of it) returns at once with a guard on the same
    /// hold and fencing token, whose release or drop leaves the outer lease held; the outer
    /// holder releases it. A nested guard kept past its holder's release (returned from the
    /// work, or moved into a spawned task) is lost then. The same bytes on another store are
    /// another lock, taken as usual. What the task [`spawn`](tokio::spawn)s runs in another
    /// task and is another holder: its acquire waits for the lease like any other request's. A
    /// held shared lease (or one permit) is re-entered by an acquire asking for no more of the
    /// key (shared, or as many permits). An acquire that asks for more of a held key than the
    /// task holds (that key with others, more permits than the key has room for beside the
    /// task's, exclusive over shared) could only wait for its own holder: it fails at once with
    /// [`LockError::Config`](crate::LockError::Config). A [`LeaseGuard`] kept in a variable is
    /// not re-entered by the code after it: run that code through [`run`](Self::run), whose
    /// work, re-entered, is still dropped the moment the lease is lost.
    ///
    /// [`LockLayer`]: crate::LockLayer
    pub fn acquire(&self, keys: impl Into<KeySet>) -> Acquiring {
        Acquiring::new(
            self.clone(),
            keys.into(),
            Terms::of(&self.engine.config, None),
        )
    }

    /// Acquires `keys` as one lease if they are all free now, without waiting: `Ok(None)` when
    /// one is held. See [`Acquiring::try_acquire`] to set a TTL or longest hold for the call.
    pub async fn try_acquire(
        &self,
        keys: impl Into<KeySet>,
    ) -> Result<Option<LeaseGuard>, LockError> {
        self.acquire(keys).try_acquire().await
    }

    /// Runs `work` under a lease on `keys`: acquires them (waiting by the configured policy),
    /// runs `work` while the lease is renewed, releases it, and returns what `work` returned.
    ///
    /// If the lease is lost meanwhile, `work` is dropped at once (whatever the config's
    /// [`OnLeaseLost`](crate::config::OnLeaseLost)) and the answer is [`LockError::LeaseLost`], unless
    /// `work` has sent a [fenced write](crate::fence): then it runs to its end, its later
    /// fenced writes refused if a newer holder was there, and its output is the answer. The
    /// renewal runs in the awaiting task, as the work is polled: work that blocks its thread
    /// (run it with [`spawn_blocking`](tokio::task::spawn_blocking) instead) is not renewed
    /// meanwhile, and a lease that its release finds gone answers [`LockError::LeaseLost`] too,
    /// though the work ended (it may have overlapped another holder's). See
    /// [`Acquiring::run`] to set a wait policy, TTL or longest hold for the call.
    pub async fn run<F: Future>(
        &self,
        keys: impl Into<KeySet>,
        work: F,
    ) -> Result<F::Output, LockError> {
        self.acquire(keys).run(work).await
    }

    /// Runs `work` under a lease on `keys` if they are all free now, without waiting: `Ok(None)`,
    /// `work` never started, when one is held (another instance is doing it); else what
    /// [`run`](Self::run) answers, in `Some`. The one call for work that one instance at a time
    /// should do, such as a scheduled job that every instance starts:
    ///
    /// ```
    /// use tower_lock::{Locker, MemoryStore};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let locker = Locker::new(MemoryStore::new());
    /// let nightly = locker.key("jobs", "nightly")?;
    /// match locker.try_run(nightly, async { "report sent" }).await? {
    ///     Some(outcome) => println!("{outcome}"),
    ///     None => println!("another instance runs the job"),
    /// }
    /// # Ok(()) }
    /// ```
    ///
    /// See [`Acquiring::try_run`] to set a TTL or longest hold for the call.
    pub async fn try_run<F: Future>(
        &self,
        keys: impl Into<KeySet>,
        work: F,
    ) -> Result<Option<F::Output>, LockError> {
        self.acquire(keys).try_run(work).await
    }

    /// Acquires `keys` on `terms` for a holder in `span`: the one way every holder (request,
    /// body, background work) gets its [`Hold`]. A holder that does not get it records the
    /// outcome itself (the idempotency layer decides it only after a record lookup).
    pub(crate) fn hold(
        &self,
        keys: KeySet,
        span: Span,
        terms: Terms,
    ) -> impl Future<Output = Result<Hold, LockError>> + Send + 'static {
        let engine = Arc::clone(&self.engine);
        async move {
            let acquired = acquire(Arc::clone(&engine), keys, terms.clone())
                .instrument(span.clone())
                .await?;
            Ok(Hold::new(acquired, &engine, span, &terms))
        }
    }

    /// The config's terms for a holder held at most `max_hold`.
    pub(crate) fn terms(&self, max_hold: Option<Duration>) -> Terms {
        Terms::of(&self.engine.config, max_hold)
    }

    /// The shared state, for a guard that keeps it alive.
    pub(crate) fn shared(&self) -> &Arc<Engine> {
        &self.engine
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
