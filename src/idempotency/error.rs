//! Why the idempotency layer answered instead of the handler.

use std::{error::Error as StdError, sync::Arc};

use http::StatusCode;

use crate::{config::LockConfig, error::LockError, response::status_for};

/// Why a request was answered by the [`IdempotencyLayer`](super::IdempotencyLayer) itself.
///
/// The layer turns each into a response (see [`IdempotencyResponse`](super::IdempotencyResponse))
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
    /// The [`Principal`](super::Principal) found none for this request, or an empty id (500: an
    /// authenticating layer should have run first).
    #[error("the request has no principal to scope its idempotency key by")]
    MissingPrincipal,
    /// The [`Principal`](super::Principal) refused the request as the client's mistake (401 or
    /// 400, as the rejection says).
    #[error("the request's caller was refused: {0}")]
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

    /// The status the layer answers with, given the lock's config (for 409 and 503).
    pub(crate) fn status(&self, lock: &LockConfig) -> StatusCode {
        match self {
            Self::MissingKey | Self::InvalidKey(_) | Self::BodyUnreadable(_) => {
                StatusCode::BAD_REQUEST
            }
            Self::KeyReused => StatusCode::UNPROCESSABLE_ENTITY,
            Self::BodyTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            Self::MissingPrincipal => StatusCode::INTERNAL_SERVER_ERROR,
            Self::PrincipalRejected(rejection) => rejection.status(),
            Self::Lock(error) => status_for(
                error,
                lock.contended_status(),
                lock.unavailable_status(),
                lock.limited_status(),
            ),
        }
    }
}

impl From<super::PrincipalRejection> for IdempotencyError {
    fn from(rejection: super::PrincipalRejection) -> Self {
        if rejection.is_client_error() {
            Self::PrincipalRejected(rejection)
        } else {
            Self::MissingPrincipal
        }
    }
}

impl From<LockError> for IdempotencyError {
    fn from(e: LockError) -> Self {
        Self::Lock(e)
    }
}
