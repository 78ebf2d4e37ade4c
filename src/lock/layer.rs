use std::{fmt, num::NonZeroU32, sync::Arc, time::Duration};

use bytes::Bytes;
use http::Response;
use tower::Layer;

use super::{
    service::LockService,
    state::{DEFAULT_MAX_BODY, LockState},
};
use crate::{
    config::{LockConfig, OnLeaseLost},
    engine::{Locker, cannot_count},
    error::ConfigError,
    key::{IntoKeys, Scope},
    response::Rejection,
    store::LockStore,
    wait::Wait,
};

/// Applies a per-request distributed lock to the wrapped service.
///
/// See the [module docs](super) for an example, and the [crate docs](crate) for the path of a
/// request and the defaults.
///
/// Each request's keys come from the key source; requests that share a key run one at a time
/// across every instance that shares the store. A request whose source names several keys
/// (both accounts of a transfer, every SKU of a cart) takes them all as one lease. A request
/// that cannot get its lock within the wait policy answers 409, one whose store fails answers
/// 503, one with a bad key answers 400; see [`response`](crate::response).
///
/// Any source goes ([`IntoKeys`]): a [`KeySource`](crate::key::KeySource) reads the head;
/// [`Key::json`](crate::Key::json) and [`Key::body`](crate::Key::body) read the body too, which
/// the layer then buffers, up to [`max_request_body`](Self::max_request_body), and hands on as
/// the same bytes (see [`LockService`] for the body types that allows). The layer's type is
/// the same whatever the source, so it can be named in a struct field.
#[must_use]
#[derive(Clone)]
pub struct LockLayer {
    state: Arc<LockState>,
}

impl LockLayer {
    /// A layer locking on `keys` in `store`, with the default [`LockConfig`].
    pub fn new(store: impl LockStore, keys: impl IntoKeys) -> Self {
        Self::from_locker(Locker::new(store), keys)
    }

    /// A layer with `config` (checked when it was built: an invalid setting is an error at
    /// start-up, never at request time).
    pub fn with_config(store: impl LockStore, keys: impl IntoKeys, config: LockConfig) -> Self {
        Self::from_locker(Locker::with_config(store, config), keys)
    }

    /// A layer sharing a [`Locker`] (its store and config) with other layers or background
    /// work. Layers that share a locker also share its process-local queues: their requests
    /// for the same key take turns in this process before they contend in the store.
    pub fn from_locker(locker: Locker, keys: impl IntoKeys) -> Self {
        Self {
            state: Arc::new(LockState {
                locker,
                scope: keys.default_scope(),
                source: keys.into_source(),
                respond: None,
                max_body: DEFAULT_MAX_BODY,
                permits: None,
                shared_when: None,
                wait: None,
                ttl: None,
                on_lost: OnLeaseLost::Abort,
                hold_until_body_end: false,
            }),
        }
    }

    /// How a request waits for a held key: this layer's policy instead of its locker's
    /// ([`LockConfig::wait`], by default exponential for 2 s). [`Wait::none`] fails fast: a
    /// held key answers 409 at once.
    ///
    /// ```
    /// use tower_lock::{Key, LockLayer, MemoryStore, Wait};
    ///
    /// let layer = LockLayer::new(MemoryStore::new(), Key::path()).wait(Wait::none());
    /// ```
    pub fn wait(mut self, wait: Wait) -> Self {
        Arc::make_mut(&mut self.state).wait = Some(wait);
        self
    }

    /// Holds each request's lease with this TTL instead of its locker's
    /// ([`LockConfig::ttl`], 10 s by default), renewed every third of it while the handler
    /// runs: how long the key of an instance that crashed stays locked.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_lock::{Key, LockLayer, MemoryStore, Wait};
    ///
    /// # fn main() -> Result<(), tower_lock::ConfigError> {
    /// let layer = LockLayer::new(MemoryStore::new(), Key::path())
    ///     .wait(Wait::none())
    ///     .ttl(Duration::from_secs(10))?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// A [`ConfigError`] (setting `ttl`) under 10 ms or over 365 days.
    pub fn ttl(mut self, ttl: Duration) -> Result<Self, ConfigError> {
        crate::config::check_ttl(ttl)?;
        Arc::make_mut(&mut self.state).ttl = Some(ttl);
        Ok(self)
    }

    /// What a lease lost while the handler runs does to the request (a stall past the TTL, a
    /// key deleted behind the holder, renewals failing until the lease ran out, or
    /// [`max_hold`](LockConfig::max_hold) reached): by default ([`OnLeaseLost::Abort`]) the
    /// handler's future is dropped and the client gets 503 (`#lease-lost`), unless the handler
    /// has sent a [fenced write](crate::fence) that writes (then it runs to its end: its write
    /// may have landed); with [`OnLeaseLost::Continue`] the handler runs on, and
    /// [`Lease::is_lost`](crate::Lease::is_lost) tells it.
    ///
    /// ```
    /// use tower_lock::{Key, LockLayer, MemoryStore, config::OnLeaseLost};
    ///
    /// let layer = LockLayer::new(MemoryStore::new(), Key::path())
    ///     .on_lease_lost(OnLeaseLost::Continue);
    /// ```
    pub fn on_lease_lost(mut self, on_lost: OnLeaseLost) -> Self {
        Arc::make_mut(&mut self.state).on_lost = on_lost;
        self
    }

    /// Keeps the lease, and renews it, until the response body has been streamed to its end,
    /// not only until the handler returns: for handlers that stream (default `false`). The
    /// lease is released when the body ends, fails or is dropped. A lease lost while the body
    /// streams (the status is sent by then) does not stop it, whatever
    /// [`on_lease_lost`](Self::on_lease_lost) says: fence the writes the body makes.
    pub fn hold_until_body_end(mut self, hold: bool) -> Self {
        Arc::make_mut(&mut self.state).hold_until_body_end = hold;
        self
    }

    /// Scopes keys by this namespace instead of the source's default: layers with the same
    /// namespace and key value exclude each other, and share [fenced data](crate::fence).
    ///
    /// By default a key is scoped by the kind of resource its source names, never by the
    /// method (see the [key module](crate::key#scoping)): a path parameter by the route up to
    /// it (`/accounts/{id}` for both `POST /accounts/{id}` and `POST /accounts/{id}/withdraw`),
    /// a header by its name, JSON fields by their pointers, a whole path by its route. Name a namespace when two sources
    /// name one resource (an account id from the path on one route and from a JSON field on
    /// another), or when one route's locks must not be another's.
    ///
    /// ```
    /// use tower_lock::{Key, LockLayer, MemoryStore};
    ///
    /// # fn main() -> Result<(), tower_lock::ConfigError> {
    /// let store = MemoryStore::new();
    /// // `POST /withdrawals` (an `x-account` header) and `POST /transfers`
    /// // (`{"from": .., "to": ..}`) on one account exclude each other.
    /// let withdraw = LockLayer::new(store.clone(), Key::header("x-account")?).namespace("account");
    /// let transfer = LockLayer::new(store, Key::json("/from")?.and("/to")?).namespace("account");
    /// # Ok(()) }
    /// ```
    pub fn namespace(mut self, namespace: impl Into<Arc<str>>) -> Self {
        Arc::make_mut(&mut self.state).scope = Scope::Named(namespace.into());
        self
    }

    /// Builds the responses of refused requests with `respond` instead of the problem+json of
    /// the [`response`](crate::response) module. It gets the [`Rejection`]: the error, its
    /// status ([`LockError::status`](crate::LockError::status)), the `Retry-After` the default
    /// sends, and the default response (see the [module docs](crate::response) for an example
    /// that keeps the status and `Retry-After` with a body of its own, and
    /// [`Rejection::with_status`] to answer another status). The layer puts the
    /// [`LockError`](crate::LockError) into the extensions of whatever it returns.
    pub fn rejection_response<F>(mut self, respond: F) -> Self
    where
        F: Fn(&Rejection<'_>) -> Response<Bytes> + Send + Sync + 'static,
    {
        Arc::make_mut(&mut self.state).respond = Some(Arc::new(respond));
        self
    }

    /// Lets up to `permits` requests with the same key run at once, across every instance
    /// that shares the store, rather than one: a per-key concurrency limit (a payment
    /// provider's few concurrent charges per merchant). Each request takes one permit, with
    /// its own lease, renewal and fencing token; a holder that dies frees its permit when its
    /// TTL runs out. Waiters are served first come first served (through the store's hand-off
    /// queue: no polling). A request that gets none within the wait policy answers 429 Too Many
    /// Requests with `Retry-After` and a problem+json body
    /// (`#permits-exhausted`).
    ///
    /// ```
    /// use std::num::NonZeroU32;
    /// use tower_lock::{Key, LockLayer, MemoryStore};
    ///
    /// # fn main() -> Result<(), tower_lock::ConfigError> {
    /// let four = NonZeroU32::new(4).unwrap();
    /// let layer = LockLayer::new(MemoryStore::new(), Key::header("x-merchant-id")?).permits(four)?;
    /// # Ok(()) }
    /// ```
    ///
    /// A number of permits is never 0 (no request could ever run): that does not compile.
    ///
    /// ```compile_fail,E0308
    /// # use tower_lock::{Key, LockLayer, MemoryStore};
    /// let layer = LockLayer::new(MemoryStore::new(), Key::path()).permits(0);
    /// ```
    ///
    /// With [`shared_when`](Self::shared_when), a shared request takes one permit and any
    /// other all of them. A key keeps the number its holders named: a request that names
    /// another while the key is held (another layer's `permits` on the same key) is refused
    /// with a store error that says so (500, `#lock-key-misused`), never admitted by its own
    /// count; to change a key's number in a rolling deploy, change its namespace too.
    ///
    /// # Errors
    ///
    /// A [`ConfigError`] (setting `permits`), at start-up, when the store cannot count a key's
    /// holders ([`RedlockStore`](crate::store::RedlockStore), a store written outside this
    /// crate; see [`Capabilities::counts`](crate::store::Capabilities::counts)): such a layer
    /// could only refuse every request.
    pub fn permits(mut self, permits: NonZeroU32) -> Result<Self, ConfigError> {
        self.check_counts("permits")?;
        Arc::make_mut(&mut self.state).permits = Some(permits.get());
        Ok(self)
    }

    /// Takes a request's keys shared when `shared` says so (a reader), exclusive otherwise (a
    /// writer): readers run together, a writer alone; first come first served, so a writer
    /// queued behind readers is not starved by readers that keep coming, and readers that
    /// come after a queued writer wait for it. A key set may mix shared and exclusive
    /// requests' keys, deadlock-free (every set takes its keys in one order).
    ///
    /// Readers and writers of a resource differ by method, and share its keys: the default
    /// scope names the resource, not the method (see [`namespace`](Self::namespace)). With
    /// [`permits`](Self::permits), a reader takes one permit and a writer all of them.
    ///
    /// ```
    /// use http::Method;
    /// use tower_lock::{Key, LockLayer, MemoryStore};
    ///
    /// # fn main() -> Result<(), tower_lock::ConfigError> {
    /// let layer = LockLayer::new(MemoryStore::new(), Key::path())
    ///     .shared_when(|parts| parts.method == Method::GET)?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// A [`ConfigError`] (setting `shared_when`), at start-up, when the store cannot count a
    /// key's holders (as [`permits`](Self::permits)).
    pub fn shared_when(
        mut self,
        shared: impl Fn(&http::request::Parts) -> bool + Send + Sync + 'static,
    ) -> Result<Self, ConfigError> {
        self.check_counts("shared_when")?;
        Arc::make_mut(&mut self.state).shared_when = Some(Arc::new(shared));
        Ok(self)
    }

    fn check_counts(&self, setting: &'static str) -> Result<(), ConfigError> {
        match self.state.locker.engine().store.counts() {
            true => Ok(()),
            false => Err(cannot_count(setting)),
        }
    }

    /// The most bytes of a request body the layer reads for its keys (default 1 MiB), when its
    /// source reads the body ([`Key::json`](crate::Key::json), [`Key::body`](crate::Key::body));
    /// a source that reads the head reads no body. A larger body answers 413, checked against
    /// `Content-Length` before anything is read.
    pub fn max_request_body(mut self, bytes: usize) -> Self {
        Arc::make_mut(&mut self.state).max_body = bytes;
        self
    }

    /// The locker this layer acquires with.
    pub fn locker(&self) -> &Locker {
        &self.state.locker
    }
}

impl<S> Layer<S> for LockLayer {
    type Service = LockService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        LockService::from_state(inner, Arc::clone(&self.state))
    }
}

impl fmt::Debug for LockLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockLayer")
            .field("locker", &self.state.locker)
            .field("scope", &self.state.scope)
            .field("permits", &self.state.permits)
            .field("shared_when", &self.state.shared_when.is_some())
            .field("wait", &self.state.wait)
            .field("ttl", &self.state.ttl)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use std::{convert::Infallible, time::Duration};

    use bytes::Bytes;
    use http::{Request, Response, StatusCode};
    use http_body_util::Full;
    use tokio::time::Instant;
    use tower::{Layer, ServiceExt, service_fn};

    use super::LockLayer;
    use crate::{Key, Locker, MemoryStore, Wait};

    /// How long a request for a key `locker` holds took to be answered, and its status.
    async fn refused_after(layer: LockLayer) -> (StatusCode, Duration) {
        let service = layer.layer(service_fn(|_: Request<Full<Bytes>>| async {
            Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
        }));
        let request = Request::post("/items")
            .header("x-sku", "sku-1")
            .body(Full::new(Bytes::new()))
            .unwrap();
        let start = Instant::now();
        let response = service.oneshot(request).await.unwrap();
        (response.status(), start.elapsed())
    }

    /// A layer's wait policy replaces its locker's: with `Wait::none()` a held key answers 409
    /// at once, where the locker's default policy waits its deadline out first (paused time).
    #[tokio::test(start_paused = true)]
    async fn a_layers_wait_replaces_its_lockers() {
        let locker = Locker::new(MemoryStore::new());
        let key = locker.key("items", "sku-1").unwrap();
        let held = locker.acquire(key).await.unwrap();
        let layer = || {
            LockLayer::from_locker(locker.clone(), Key::header("x-sku").unwrap()).namespace("items")
        };
        let (status, waited) = refused_after(layer()).await;
        assert_eq!(status, StatusCode::CONFLICT);
        assert!(
            waited >= Duration::from_secs(1),
            "the default waits: {waited:?}"
        );
        let (status, waited) = refused_after(layer().wait(Wait::none())).await;
        assert_eq!(status, StatusCode::CONFLICT);
        assert!(
            waited < Duration::from_millis(100),
            "failed fast: {waited:?}"
        );
        held.release().await.unwrap();
    }
}
