use std::{any::TypeId, fmt, sync::Arc, time::Duration};

use bytes::Bytes;
use http::Response;
use tower::Layer;

use crate::response::Rejection;

use super::{
    config::IdempotencyConfig,
    principal::{Principal, SharedKeySpace},
    service::IdempotencyService,
    state::IdempotencyState,
    store::IdempotencyStore,
};
use crate::{config::OnLeaseLost, engine::Locker, error::ConfigError, store::Records, wait::Wait};

/// Applies `Idempotency-Key` semantics to the wrapped service: one run per key, and the
/// first response replayed to every retry.
///
/// See the [module docs](super) for an example, the path of a request and the responses.
/// The layer takes its own lock on each key (it does not need a [`LockLayer`](crate::LockLayer)
/// beside it) and stores records in the same store.
///
/// # A principal, or a shared key space on purpose
///
/// Keys are scoped by the [`Principal`] the layer is built with, so that one client is never
/// served another's stored response. There is no default: name the principal (a closure over
/// what authentication put into the extensions), or opt in to one key space for every client
/// with [`SharedKeySpace`](super::SharedKeySpace).
///
/// ```
/// use bytes::Bytes;
/// use http::request::Parts;
/// use tower_lock::{IdempotencyLayer, MemoryStore, idempotency::SharedKeySpace};
///
/// #[derive(Clone)]
/// struct Tenant(String);
///
/// let scoped = IdempotencyLayer::new(MemoryStore::new(), |parts: &Parts| {
///     parts.extensions.get::<Tenant>().map(|t| Bytes::from(t.0.clone()))
/// });
/// let shared = IdempotencyLayer::new(MemoryStore::new(), SharedKeySpace);
/// # let _ = (scoped, shared);
/// ```
///
/// A layer without either does not compile:
///
/// ```compile_fail,E0061
/// use tower_lock::{IdempotencyLayer, MemoryStore};
///
/// let layer = IdempotencyLayer::new(MemoryStore::new());
/// ```
#[derive(Clone)]
#[must_use]
pub struct IdempotencyLayer {
    state: Arc<IdempotencyState>,
}

impl IdempotencyLayer {
    /// A layer over `store` whose keys are scoped by `principal`, with the default
    /// [`IdempotencyConfig`]. See [above](Self#a-principal-or-a-shared-key-space-on-purpose).
    pub fn new<S: IdempotencyStore>(store: S, principal: impl Principal) -> Self {
        Self::with_config(store, principal, IdempotencyConfig::default())
    }

    /// A layer whose keys are scoped by `principal`, with `config` (checked when it was built:
    /// an invalid setting is an error at start-up, never at request time).
    pub fn with_config<S: IdempotencyStore, P: Principal>(
        store: S,
        principal: P,
        config: IdempotencyConfig,
    ) -> Self {
        let locker = Locker::with_config(store, config.lock.clone());
        let records = locker.engine().store.capabilities().records.clone();
        // An `IdempotencyStore` keeps records: sealed, implemented by such stores only.
        let records = records.expect("an IdempotencyStore keeps idempotency records");
        Self::build(locker, principal, config, records)
    }

    /// A layer that takes its locks with `locker`, its keys scoped by `principal`: one store,
    /// one set of process-local queues and one renewal task with the
    /// [`LockLayer`](crate::LockLayer)s and background work built on the same locker, as
    /// [`LockLayer::from_locker`](crate::LockLayer::from_locker) shares them. The lock settings
    /// are the locker's (a waiting policy makes a concurrent duplicate wait for the first
    /// request's record rather than answer 409 at once); the others are the defaults of
    /// [`IdempotencyConfig`].
    ///
    /// ```
    /// use tower_lock::{IdempotencyLayer, LockConfig, Locker, MemoryStore, Wait};
    /// use tower_lock::idempotency::SharedKeySpace;
    ///
    /// let locker = Locker::with_config(
    ///     MemoryStore::new(),
    ///     LockConfig::builder().wait(Wait::none()).build()?,
    /// );
    /// let layer = IdempotencyLayer::from_locker(locker.clone(), SharedKeySpace)?;
    /// assert_eq!(layer.config().lock().wait(), &Wait::none());
    /// # Ok::<(), tower_lock::ConfigError>(())
    /// ```
    ///
    /// # Errors
    ///
    /// A [`ConfigError`] (field `store`) when the locker's store keeps no idempotency records
    /// ([`RedlockStore`](crate::store::RedlockStore), a store outside this crate; see
    /// [`Capabilities::idempotency_records`](crate::store::Capabilities::idempotency_records)):
    /// [`new`](Self::new) and [`with_config`](Self::with_config) refuse such a store at compile
    /// time, through [`IdempotencyStore`]; a `Locker` does not carry its store's type.
    pub fn from_locker(locker: Locker, principal: impl Principal) -> Result<Self, ConfigError> {
        let mut config = IdempotencyConfig::default();
        config.lock = locker.config().clone();
        let records = locker.engine().store.capabilities().records.clone();
        let records = records.ok_or_else(|| {
            ConfigError::new(
                "store",
                "the locker's store keeps no idempotency records (a RedlockStore, or a store \
                 written outside tower-lock): use a RedisStore, ClusterStore, SentinelStore or \
                 MemoryStore",
            )
        })?;
        Ok(Self::build(locker, principal, config, records))
    }

    fn build<P: Principal>(
        locker: Locker,
        principal: P,
        config: IdempotencyConfig,
        records: Arc<dyn Records>,
    ) -> Self {
        let shared_key_space = TypeId::of::<P>() == TypeId::of::<SharedKeySpace>();
        Self {
            state: Arc::new(IdempotencyState {
                locker,
                records,
                config,
                principal: Arc::new(principal),
                shared_key_space,
                respond: None,
                wait: None,
                ttl: None,
                on_lost: OnLeaseLost::Abort,
            }),
        }
    }

    /// How a request waits for a key another request holds: this layer's policy instead of its
    /// locker's (the config's [`lock`](IdempotencyConfig::lock) settings: [`Wait::none`] for a
    /// layer from [`new`](Self::new) or [`with_config`](Self::with_config) with the default
    /// config, so that a concurrent duplicate answers 409 at once; the locker's own policy for
    /// one [`from_locker`](Self::from_locker)). A waiting policy makes a duplicate wait for the
    /// first request's record, then replays it. [`config`](Self::config) still shows the
    /// locker's policy.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_lock::{IdempotencyLayer, MemoryStore, Wait};
    /// use tower_lock::idempotency::SharedKeySpace;
    ///
    /// # fn main() -> Result<(), tower_lock::ConfigError> {
    /// let layer = IdempotencyLayer::new(MemoryStore::new(), SharedKeySpace)
    ///     .wait(Wait::constant(Duration::from_millis(50))?);
    /// # Ok(()) }
    /// ```
    pub fn wait(mut self, wait: Wait) -> Self {
        Arc::make_mut(&mut self.state).wait = Some(wait);
        self
    }

    /// Holds each request's lease with this TTL instead of its locker's
    /// ([`LockConfig::ttl`](crate::LockConfig::ttl), 10 s by default), renewed every third of
    /// it while the handler runs: how long a crashed instance's key stays locked.
    ///
    /// # Errors
    ///
    /// A [`ConfigError`] (setting `ttl`) under 10 ms or over 365 days.
    pub fn ttl(mut self, ttl: Duration) -> Result<Self, ConfigError> {
        crate::config::check_ttl(ttl)?;
        Arc::make_mut(&mut self.state).ttl = Some(ttl);
        Ok(self)
    }

    /// What a lease lost while the handler runs does to it: by default
    /// ([`OnLeaseLost::Abort`]) the handler is dropped and the client gets 503, unless it has
    /// sent a [fenced write](crate::fence) (then it runs to its end); with
    /// [`OnLeaseLost::Continue`] it runs on. Either way the record is stored only when no
    /// newer request holds the key (see the [module docs](super)).
    pub fn on_lease_lost(mut self, on_lost: OnLeaseLost) -> Self {
        Arc::make_mut(&mut self.state).on_lost = on_lost;
        self
    }

    /// Builds the responses of the requests the layer answers itself with `respond` instead of
    /// problem+json. It gets the [`Rejection`]: the [`IdempotencyError`](super::IdempotencyError),
    /// the status the layer assigns, the `Retry-After` the default sends, and the default
    /// response. The layer puts the error into the extensions of whatever it returns.
    pub fn rejection_response<F>(mut self, respond: F) -> Self
    where
        F: Fn(&Rejection<'_, super::IdempotencyError>) -> Response<Bytes> + Send + Sync + 'static,
    {
        Arc::make_mut(&mut self.state).respond = Some(Arc::new(respond));
        self
    }

    /// The settings in force.
    pub fn config(&self) -> &IdempotencyConfig {
        &self.state.config
    }

    /// The locker this layer takes its locks with.
    pub fn locker(&self) -> &Locker {
        &self.state.locker
    }
}

impl<S> Layer<S> for IdempotencyLayer {
    type Service = IdempotencyService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        IdempotencyService::from_state(inner, Arc::clone(&self.state))
    }
}

impl fmt::Debug for IdempotencyLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyLayer")
            .field("config", &self.state.config)
            .field("locker", &self.state.locker)
            .field("wait", &self.state.wait)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use std::{convert::Infallible, sync::Arc, time::Duration};

    use bytes::Bytes;
    use http::{Request, Response, StatusCode};
    use http_body_util::Full;
    use tokio::{sync::Notify, time::Instant};
    use tower::{Layer, ServiceExt, service_fn};

    use super::IdempotencyLayer;
    use crate::{MemoryStore, Wait, idempotency::SharedKeySpace};

    fn payment() -> Request<Full<Bytes>> {
        Request::post("/payments")
            .header("idempotency-key", "8e03978e-40d5-43e8-bc93-6894a57f9324")
            .body(Full::new(Bytes::new()))
            .unwrap()
    }

    /// A concurrent duplicate's status and how long it took to be answered, while the first
    /// request with its key is still running.
    async fn duplicate(layer: IdempotencyLayer) -> (StatusCode, Duration) {
        let done = Arc::new(Notify::new());
        let running = Arc::new(Notify::new());
        let (first_done, first_running) = (Arc::clone(&done), Arc::clone(&running));
        let service = layer.layer(service_fn(move |_: Request<Full<Bytes>>| {
            let (done, running) = (Arc::clone(&first_done), Arc::clone(&first_running));
            async move {
                running.notify_one();
                done.notified().await;
                Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
            }
        }));
        let mut first = tokio::spawn(service.clone().oneshot(payment()));
        tokio::select! {
            () = running.notified() => {}
            answered = &mut first => panic!("the first request was answered: {:?}", answered.unwrap().map(|r| r.status())),
        }
        let start = Instant::now();
        let status = service.oneshot(payment()).await.unwrap().status();
        let waited = start.elapsed();
        done.notify_one();
        assert_eq!(first.await.unwrap().unwrap().status(), StatusCode::OK);
        (status, waited)
    }

    /// The layer's wait policy replaces its locker's: by default (`Wait::none()`) a concurrent
    /// duplicate answers 409 at once; with a waiting policy it waits that policy's deadline
    /// out first (paused time).
    #[tokio::test(start_paused = true)]
    async fn a_layers_wait_replaces_its_lockers() {
        let layer = || IdempotencyLayer::new(MemoryStore::new(), SharedKeySpace);
        let (status, waited) = duplicate(layer()).await;
        assert_eq!(status, StatusCode::CONFLICT);
        assert!(
            waited < Duration::from_millis(100),
            "the default fails fast: {waited:?}"
        );
        let waits = Wait::constant(Duration::from_millis(50))
            .unwrap()
            .deadline(Duration::from_secs(1));
        let (status, waited) = duplicate(layer().wait(waits)).await;
        assert_eq!(status, StatusCode::CONFLICT);
        assert!(waited >= Duration::from_secs(1), "waited: {waited:?}");
    }
}
