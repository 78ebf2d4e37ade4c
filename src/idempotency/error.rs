//! Why the idempotency layer answered instead of the handler.

use std::{error::Error as StdError, sync::Arc};

use http::StatusCode;

use crate::error::LockError;

/// Why a request was answered by the [`IdempotencyLayer`](crate::IdempotencyLayer) itself.
///
/// The layer turns each into a response (see [`IdempotencyLayer::rejection_response`](crate::IdempotencyLayer::rejection_response))
/// and puts the error into that response's extensions, for outer layers to inspect.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum IdempotencyError {
    /// The route requires an idempotency key and the request has none (400).
    #[error("the request has no idempotency key, which this route requires")]
    MissingKey,
    /// The key is not a structured-field string or token, is too short or too long, or is
    /// sent twice (400).
    #[error("the idempotency key is invalid: {0}")]
    InvalidKey(Arc<str>),
    /// The key has a record of a request with a different fingerprint (422).
    #[error("the idempotency key was already used for a different request")]
    KeyReused,
    /// The request body is larger than the layer buffers (413).
    #[error("the request body is larger than {limit} bytes")]
    #[non_exhaustive]
    BodyTooLarge {
        /// The configured limit, in bytes.
        limit: usize,
    },
    /// The request body could not be read (400).
    #[error("the request body could not be read")]
    BodyUnreadable(#[source] Arc<dyn StdError + Send + Sync>),
    /// The [`Principal`](super::Principal) found no caller for this request, or refused it: as
    /// the server's mistake (500: `None`, an empty id, or
    /// [`PrincipalRejection::missing`](super::PrincipalRejection::missing); an authenticating
    /// layer should have run first), or as the client's (401 or 400). The rejection says which
    /// ([`status`](super::PrincipalRejection::status),
    /// [`is_client_error`](super::PrincipalRejection::is_client_error)) and carries the detail
    /// the client is sent.
    #[error("the request has no caller to scope its idempotency key by: {0}")]
    PrincipalRejected(super::PrincipalRejection),
    /// The lock was held by a request with the same key still running (409), or the store failed
    /// (503): the lock's own errors.
    #[error(transparent)]
    Lock(LockError),
}

impl IdempotencyError {
    pub(crate) fn invalid_key(detail: String) -> Self {
        Self::InvalidKey(detail.into())
    }

    /// The status the layer answers with: 400 (a missing or invalid key, an unreadable body),
    /// 422 (a key reused), 413 (a body too large), the principal rejection's own, or the lock
    /// error's ([`LockError::status`]). The layer's
    /// [`rejection_response`](crate::IdempotencyLayer::rejection_response) is the one place to
    /// answer with another.
    pub fn status(&self) -> StatusCode {
        match self {
            Self::MissingKey | Self::InvalidKey(_) | Self::BodyUnreadable(_) => {
                StatusCode::BAD_REQUEST
            }
            Self::KeyReused => StatusCode::UNPROCESSABLE_ENTITY,
            Self::BodyTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            Self::PrincipalRejected(rejection) => rejection.status(),
            Self::Lock(error) => error.status(),
        }
    }

    /// The `application/problem+json` response for this error, with [`status`](Self::status)
    /// (the problem types are listed in [`crate::response`]).
    pub fn problem(&self) -> http::Response<bytes::Bytes> {
        super::response::idempotency_problem(self, self.status())
    }
}

#[cfg(feature = "axum")]
crate::response::problem_into_response!(IdempotencyError, super::PrincipalRejection);

impl From<super::PrincipalRejection> for IdempotencyError {
    fn from(rejection: super::PrincipalRejection) -> Self {
        Self::PrincipalRejected(rejection)
    }
}

impl From<LockError> for IdempotencyError {
    fn from(e: LockError) -> Self {
        Self::Lock(e)
    }
}
