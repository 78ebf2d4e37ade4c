//! [`FenceError`]: why a fenced batch was not applied.

use std::sync::Arc;

use bytes::Bytes;
use http::{HeaderValue, Response, StatusCode, header};

use crate::{key::LockKey, response::problem, store::StoreError};

/// A fenced batch was not applied, or may not have been.
///
/// With the `axum` feature it is a response, so a handler can `?` it: [`Stale`](Self::Stale)
/// answers 409 (`#stale-write`), [`Store`](Self::Store) 503 (`#data-store-unavailable`, with
/// `Retry-After: 1`), [`Invalid`](Self::Invalid) 500 (`#fenced-write-invalid`); each an
/// `application/problem+json` body, as the layers answer (see [`crate::response`]). Without
/// axum, [`problem`](Self::problem) builds the same response.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum FenceError {
    /// A holder with a newer fencing token has read or written `resource` since: this lease is
    /// stale (it was lost, and the key taken again), and **nothing of the batch was applied**.
    /// Answer 409, never 200: the request's work did not land.
    #[error(
        "a newer holder has touched the resource (its fence is {fence}, this lease's token \
         {fencing_token}); nothing was written"
    )]
    #[non_exhaustive]
    Stale {
        /// The lock key whose token was refused.
        resource: LockKey,
        /// This lease's token for it.
        fencing_token: u64,
        /// The highest token that touched the resource.
        fence: u64,
    },
    /// The data store failed or did not answer in time. A batch whose answer was lost **may
    /// have been applied**: answer 503, and say so.
    #[error("the data store failed; the batch may or may not have been applied")]
    Store(#[source] StoreError),
    /// The batch cannot be applied, and nothing was: a key of another type than its operation
    /// needs, a counter that is not a whole number, keys of several hash slots on a cluster, a
    /// resource the lease does not hold. A bug to fix, not a condition to retry.
    #[error("the fenced batch cannot be applied: {0}")]
    Invalid(Arc<str>),
}

impl FenceError {
    /// Whether the batch was certainly not applied: true but for [`Store`](Self::Store).
    pub fn nothing_applied(&self) -> bool {
        !matches!(self, Self::Store(_))
    }

    /// The status the problem response has: 409, 503 or 500.
    pub fn status(&self) -> StatusCode {
        match self {
            Self::Stale { .. } => StatusCode::CONFLICT,
            Self::Store(_) => StatusCode::SERVICE_UNAVAILABLE,
            Self::Invalid(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The `application/problem+json` response for this error (what
    /// `axum::response::IntoResponse` answers). It names no key, token or store internals.
    pub fn problem(&self) -> Response<Bytes> {
        let (kind, title, detail) = match self {
            Self::Stale { .. } => (
                "stale-write",
                "Stale write refused",
                "the lock on this resource was lost while the request ran, and a newer request \
                 has used the resource since; nothing of this request was written",
            ),
            Self::Store(_) => (
                "data-store-unavailable",
                "Data store unavailable",
                "the data store failed or did not answer in time; the request's write may or \
                 may not have been applied",
            ),
            Self::Invalid(_) => (
                "fenced-write-invalid",
                "Fenced write invalid",
                "the server's write cannot be applied to the data as stored; nothing was written",
            ),
        };
        let mut response = problem(self.status(), kind, title, detail);
        if let Self::Store(_) = self {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(1));
        }
        response
    }
}

impl From<StoreError> for FenceError {
    fn from(error: StoreError) -> Self {
        Self::Store(error)
    }
}

/// The [`problem`](FenceError::problem), so that a handler can `?` a fenced batch.
#[cfg(feature = "axum")]
impl axum::response::IntoResponse for FenceError {
    fn into_response(self) -> axum::response::Response {
        self.problem().map(axum::body::Body::from)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::StoreErrorKind;

    #[test]
    fn problems() {
        let key = LockKey::new("t:", "sku", b"apple", 64).unwrap();
        let stale = FenceError::Stale {
            resource: key,
            fencing_token: 4,
            fence: 7,
        };
        let response = stale.problem();
        assert_eq!(response.status(), 409);
        let body: serde_json::Value = serde_json::from_slice(response.body()).unwrap();
        assert!(body["type"].as_str().unwrap().ends_with("#stale-write"));
        assert!(
            !String::from_utf8_lossy(response.body()).contains("apple"),
            "the key's value leaks"
        );
        assert!(stale.nothing_applied());

        let store = FenceError::from(StoreError::msg(StoreErrorKind::Timeout, "secret"));
        let response = store.problem();
        assert_eq!(response.status(), 503);
        assert_eq!(response.headers()[header::RETRY_AFTER], "1");
        assert!(!String::from_utf8_lossy(response.body()).contains("secret"));
        assert!(!store.nothing_applied());

        let invalid = FenceError::Invalid("WRONGTYPE".into());
        assert_eq!(invalid.problem().status(), 500);
    }
}
