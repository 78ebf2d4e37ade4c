use std::{fmt, sync::Arc};

use bytes::Bytes;
use http::{Response, StatusCode, request::Parts};
use tower::Layer;

use super::service::LockService;
use crate::{
    config::LockConfig,
    engine::Locker,
    error::LockError,
    key::{KeyRejection, KeySource, LockKey},
    response::{ProblemJson, RejectionResponse, status_for},
    store::LockStore,
    telemetry::Chain,
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

/// What every clone of the service needs, behind one `Arc` (axum clones the service per request).
#[derive(Clone)]
pub(crate) struct LockState {
    pub(crate) locker: Locker,
    key: Arc<dyn KeySource>,
    namespace: Option<Arc<str>>,
    respond: Arc<dyn RejectionResponse>,
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

impl LockState {
    /// The request's lock key: `Ok(None)` to pass it through unlocked.
    pub(crate) fn key(&self, parts: &mut Parts) -> Result<Option<LockKey>, KeyRejection> {
        let Some(value) = self.key.key(parts)? else {
            return Ok(None);
        };
        let config = self.locker.config();
        let method;
        let scope: [&str; 3] = match &self.namespace {
            Some(namespace) => [namespace, "", ""],
            None => {
                method = parts.method.clone();
                match matched_path(parts) {
                    Some(path) => [method.as_str(), " ", path],
                    None => [method.as_str(), "", ""],
                }
            }
        };
        let key = LockKey::from_parts(config.key_prefix(), &scope, &value, config.max_key_len())?;
        Ok(Some(match self.namespace {
            None if !is_known_method(scope[0]) => key.with_other_method(scope[0].len()),
            _ => key,
        }))
    }

    /// The response for a rejected request, with the error in its extensions.
    pub(crate) fn reject(&self, error: LockError) -> Response<Bytes> {
        let config = self.locker.config();
        let status: StatusCode = status_for(
            &error,
            config.contended_status(),
            config.unavailable_status(),
        );
        match &error {
            LockError::Key(rejection) => {
                tracing::debug!(%status, reason = rejection.detail(), "rejected: bad lock key")
            }
            other => tracing::warn!(%status, error = %Chain(other), "request rejected"),
        }
        let mut response = self.respond.response(&error, status);
        response.extensions_mut().insert(error);
        response
    }
}

/// The methods that telemetry shows by name: RFC 9110's, `PATCH` (RFC 5789) and `QUERY`, the
/// set OpenTelemetry's HTTP conventions call "known". Any other, client-chosen, shows as
/// `_OTHER`, so that labels stay bounded. Case-sensitive, as methods are.
fn is_known_method(method: &str) -> bool {
    matches!(
        method,
        "GET"
            | "HEAD"
            | "POST"
            | "PUT"
            | "DELETE"
            | "CONNECT"
            | "OPTIONS"
            | "TRACE"
            | "PATCH"
            | "QUERY"
    )
}

/// `METHOD /route/{template}` under axum, `METHOD` alone elsewhere.
/// The route template axum matched, part of the default scope (`"POST /items/{sku}"`).
fn matched_path(parts: &Parts) -> Option<&str> {
    #[cfg(feature = "axum")]
    if let Some(path) = parts.extensions.get::<axum::extract::MatchedPath>() {
        return Some(path.as_str());
    }
    let _ = parts;
    None
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
