//! [`LockState`]: what every clone of a `LockService` shares: the locker, the key source, and
//! how a request's key and rejections are made.

use std::sync::Arc;

use bytes::Bytes;
use http::{Response, StatusCode, request::Parts};

use crate::{
    engine::Locker,
    error::LockError,
    key::{KeyRejection, KeySource, LockKey},
    response::{RejectionResponse, status_for},
    telemetry::Chain,
};

/// What every clone of the service needs, behind one `Arc` (axum clones the service per request).
#[derive(Clone)]
pub(crate) struct LockState {
    pub(crate) locker: Locker,
    pub(super) key: Arc<dyn KeySource>,
    pub(super) namespace: Option<Arc<str>>,
    pub(super) respond: Arc<dyn RejectionResponse>,
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
