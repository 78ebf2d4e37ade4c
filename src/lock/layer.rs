use std::{fmt, sync::Arc};

use tower::Layer;

use super::{service::LockService, state::LockState};
use crate::{
    config::LockConfig,
    engine::Locker,
    key::KeySource,
    response::{ProblemJson, RejectionResponse},
    store::LockStore,
};

/// Applies a per-request distributed lock to the wrapped service.
///
/// See the [crate docs](crate) for an example, the path of a request and the defaults.
///
/// Each request's key comes from the [`KeySource`]; requests with the same key run one at a
/// time across every instance that shares the store. A request that cannot get its lock within
/// the wait policy answers 409, one whose store fails answers 503, one with a bad key answers
/// 400; see [`response`](crate::response).
#[derive(Clone)]
#[must_use]
pub struct LockLayer {
    state: Arc<LockState>,
}

impl LockLayer {
    /// A layer locking on `key` in `store`, with the default [`LockConfig`].
    pub fn new(store: impl LockStore, key: impl KeySource) -> Self {
        Self::from_locker(Locker::new(store), key)
    }

    /// A layer with `config` (checked when it was built: an invalid setting is an error at
    /// start-up, never at request time).
    pub fn with_config(store: impl LockStore, key: impl KeySource, config: LockConfig) -> Self {
        Self::from_locker(Locker::with_config(store, config), key)
    }

    /// A layer sharing a [`Locker`] (its store and config) with other layers or background work.
    pub fn from_locker(locker: Locker, key: impl KeySource) -> Self {
        Self {
            state: Arc::new(LockState {
                locker,
                key: Arc::new(key),
                namespace: None,
                respond: Arc::new(ProblemJson),
            }),
        }
    }

    /// Scopes keys by this namespace instead of the request's method and route template.
    ///
    /// Layers (or routes) with the same namespace and key value exclude each other; use it when
    /// two routes touch the same resource.
    pub fn namespace(mut self, namespace: impl Into<Arc<str>>) -> Self {
        Arc::make_mut(&mut self.state).namespace = Some(namespace.into());
        self
    }

    /// Replaces the problem+json rejection responses (see [`response`](crate::response)).
    pub fn rejection_response(mut self, respond: impl RejectionResponse) -> Self {
        Arc::make_mut(&mut self.state).respond = Arc::new(respond);
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
            .field("namespace", &self.state.namespace)
            .finish_non_exhaustive()
    }
}
