//! [`LockState`]: what every clone of a `LockService` shares: the locker, the key source, and
//! how a request's keys and rejections are made.

use std::{collections::HashSet, sync::Arc};

use bytes::Bytes;
use http::{Response, request::Parts};

use crate::{
    config::OnLeaseLost,
    engine::Locker,
    error::LockError,
    key::{KeyRejection, KeySet, KeyValues, LockKey, Share, Source},
    response::{Rejection, Respond, lock_problem},
    telemetry::Chain,
    wait::Wait,
};

/// How much of a request body a layer whose keys are in the body reads (default).
pub(crate) const DEFAULT_MAX_BODY: usize = 1 << 20;

/// What every clone of the service needs, behind one `Arc` (axum clones the service per request).
#[derive(Clone)]
pub(crate) struct LockState {
    pub(crate) locker: Locker,
    pub(super) source: Source,
    pub(super) namespace: Option<Arc<str>>,
    /// The rejection hook; `None`: the default problem+json.
    pub(super) respond: Option<Arc<Respond<LockError>>>,
    /// The most body bytes a source that reads the body gets (larger: 413).
    pub(super) max_body: usize,
    /// The keys' permits ([`LockLayer::permits`](super::LockLayer::permits)).
    pub(super) permits: Option<u32>,
    /// Which requests take their keys shared
    /// ([`LockLayer::shared_when`](super::LockLayer::shared_when)).
    pub(super) shared_when: Option<SharedWhen>,
    /// The layer's wait policy ([`LockLayer::wait`](super::LockLayer::wait)); `None`: the
    /// locker's.
    pub(super) wait: Option<Wait>,
    /// What a lost lease does to the handler
    /// ([`LockLayer::on_lease_lost`](super::LockLayer::on_lease_lost)).
    pub(super) on_lost: OnLeaseLost,
    /// Whether the lease lasts until the response body ends
    /// ([`LockLayer::hold_until_body_end`](super::LockLayer::hold_until_body_end)).
    pub(super) hold_until_body_end: bool,
}

/// A layer's choice of the requests that take their keys shared.
pub(super) type SharedWhen = Arc<dyn Fn(&Parts) -> bool + Send + Sync>;

impl LockState {
    /// The request's lock keys from its head: `Ok(None)` to pass it through unlocked.
    pub(crate) fn keys(&self, parts: &mut Parts) -> Result<Option<KeySet>, KeyRejection> {
        let values = self.source.head_keys(parts)?;
        self.key_set(parts, values)
    }

    /// `values` as the request's lock keys, scoped and counted.
    fn key_set(
        &self,
        parts: &Parts,
        values: Option<KeyValues>,
    ) -> Result<Option<KeySet>, KeyRejection> {
        values
            .map(|values| {
                self.scoped(parts, &values)
                    .map(|keys| self.counted(parts, keys))
            })
            .transpose()
    }

    /// `keys` with the share the layer takes for this request: one of the permits, shared or
    /// exclusive; the plain lease without either setting.
    fn counted(&self, parts: &Parts, keys: KeySet) -> KeySet {
        let share = match (&self.shared_when, self.permits) {
            (None, None) => return keys,
            (None, Some(permits)) => Share::permit(permits),
            (Some(shared), permits) => {
                let capacity = permits.unwrap_or(Share::READERS);
                match shared(parts) {
                    true => Share::permit(capacity),
                    false => Share::exclusive(capacity),
                }
            }
        };
        // Checked by the builder: never an error here.
        match share {
            Ok(share) => keys.map_share(|_| Some(share)),
            Err(_) => keys,
        }
    }

    /// The request's lock keys from its head and `body`: `Ok(None)` to pass it through unlocked.
    pub(crate) fn body_keys(
        &self,
        parts: &mut Parts,
        body: &Bytes,
    ) -> Result<Option<KeySet>, KeyRejection> {
        let max = self.locker.config().max_keys();
        let values = self.source.body_keys(parts, body, max)?;
        self.key_set(parts, values)
    }

    /// `values` as lock keys: each scoped and prefixed, at most `max_keys` distinct ones (a
    /// value given twice is one key, and counts once). Keys are made only up to the first value
    /// past the limit, so the keys made are bounded by the limit; a repeated value costs one
    /// lookup of its bytes, so the walk over a source's values is as long as the list the source
    /// built (a source that turns client input into values one for one bounds its input: the
    /// body sources stop at the limit themselves).
    fn scoped(&self, parts: &Parts, values: &KeyValues) -> Result<KeySet, KeyRejection> {
        let max = self.locker.config().max_keys();
        let keys = match values.as_slice() {
            [] => return Err(KeyRejection::invalid("the request names no lock key")),
            [value] => KeySet::from(self.key(parts, value)?),
            values => {
                let mut distinct = HashSet::with_capacity(values.len().min(max));
                let mut keys = Vec::with_capacity(values.len().min(max));
                for value in values {
                    if distinct.contains(&value[..]) {
                        continue;
                    }
                    if distinct.len() == max {
                        return Err(KeyRejection::invalid(format!(
                            "the request names more than {max} lock keys; the limit is {max}"
                        )));
                    }
                    distinct.insert(&value[..]);
                    keys.push(self.key(parts, value)?);
                }
                KeySet::from(keys)
            }
        };
        Ok(keys)
    }

    /// `value`'s lock key.
    fn key(&self, parts: &Parts, value: &[u8]) -> Result<LockKey, KeyRejection> {
        let config = self.locker.config();
        let method;
        let scope: [&str; 3] = match &self.namespace {
            Some(namespace) => [namespace, "", ""],
            // Readers and writers differ by method: they share a key by its route alone
            // (`* /items/{sku}`).
            None if self.shared_when.is_some() => match matched_path(parts) {
                Some(path) => ["*", " ", path],
                None => ["*", "", ""],
            },
            None => {
                method = parts.method.clone();
                match matched_path(parts) {
                    Some(path) => [method.as_str(), " ", path],
                    None => [method.as_str(), "", ""],
                }
            }
        };
        let key = LockKey::from_parts(config.key_prefix(), &scope, value, config.max_key_len())?;
        Ok(match self.namespace {
            None if self.shared_when.is_none() && !is_known_method(scope[0]) => {
                key.with_other_method(scope[0].len())
            }
            _ => key,
        })
    }

    /// The response for a rejected request, with the error in its extensions.
    pub(crate) fn reject(&self, error: LockError) -> Response<Bytes> {
        let status = error.status();
        match &error {
            LockError::Key(rejection) => {
                tracing::debug!(%status, reason = rejection.detail(), "rejected: bad lock key")
            }
            other => tracing::warn!(%status, error = %Chain(other), "request rejected"),
        }
        let mut response = match &self.respond {
            None => lock_problem(&error, status),
            Some(respond) => respond(&Rejection::new(&error, status)),
        };
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
