//! Errors: why a lock was not granted or not kept, and why a setting was refused.

use std::{borrow::Cow, fmt, time::Duration};

use bytes::Bytes;
use http::{Response, StatusCode};

use crate::{key::KeyRejection, store::StoreError};

/// Why a lease was lost while its holder ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum LostReason {
    /// A renewal found the key no longer holds our token: it expired during a stall, or was
    /// deleted (for example by a Redis restart without persistence).
    NotHeld,
    /// The lease's time to live ran out before a renewal succeeded: renewals kept failing (the
    /// store did not answer), or none could be sent in time (the process or its runtime was
    /// paused or starved past the TTL).
    Expired,
    /// The request held the lease for longer than [`LockConfig::max_hold`](crate::LockConfig::max_hold).
    MaxHold,
}

impl LostReason {
    /// A short snake_case name, as used in metric labels and span fields.
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::NotHeld => "not_held",
            Self::Expired => "expired",
            Self::MaxHold => "max_hold",
        }
    }
}

impl fmt::Display for LostReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::NotHeld => "the lock store no longer holds the lease",
            Self::Expired => {
                "the lease ran out before it could be renewed (the lock store did not answer, \
                 or this process was paused past its time to live)"
            }
            Self::MaxHold => "the request held the lease longer than the configured maximum",
        })
    }
}

/// A lock could not be acquired, or was lost.
///
/// The layer turns each into a response (see [`LockLayer::rejection_response`](crate::LockLayer::rejection_response))
/// and also puts the error into that response's extensions, for outer layers to inspect.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum LockError {
    /// The key was still held by someone else when the wait policy gave up (409).
    #[error("the lock is held by another holder (waited {waited:?})")]
    #[non_exhaustive]
    Contended {
        /// How long the current holder's lease has left, if known.
        expires_in: Option<Duration>,
        /// How long this request waited before giving up.
        waited: Duration,
        /// How many acquire attempts it made.
        attempts: u32,
        /// The key's permits, when the lease asked for some of a key's permits
        /// ([`LockLayer::permits`](crate::LockLayer::permits)): none was free in time, which
        /// the layer answers with 429 rather than 409.
        permits: Option<u32>,
    },
    /// The store failed or did not answer in time (503), or refused a key taken another way than
    /// its holders took it (500: [`StoreErrorKind::Misused`](crate::store::StoreErrorKind::Misused)).
    #[error("the lock store failed")]
    Store(#[source] StoreError),
    /// The request's key could not be derived (400, or 500 for a misconfigured source).
    #[error("the lock key could not be derived")]
    Key(#[source] KeyRejection),
    /// The lease was lost while the request ran, and the layer aborted it (503).
    #[error("the lease was lost: {0}")]
    LeaseLost(LostReason),
    /// What the acquire asked for can never be granted (0 permits, more permits than the key
    /// has), or the store cannot grant it (500): a bug of the caller, never of the request.
    #[error("the lease cannot be granted")]
    Config(#[source] ConfigError),
}

impl LockError {
    /// The status the layers answer this error with: 409
    /// ([`Contended`](Self::Contended)), 429 (contended for a key's permits, see
    /// [`is_permits_exhausted`](Self::is_permits_exhausted)), 503 (store failed, lease lost),
    /// 400 or 413 (a client's key or body), 500 (a misconfiguration). A layer's
    /// [`rejection_response`](crate::LockLayer::rejection_response) is the one place to answer
    /// with another.
    pub fn status(&self) -> StatusCode {
        match self {
            Self::Contended {
                permits: Some(_), ..
            } => StatusCode::TOO_MANY_REQUESTS,
            Self::Contended { .. } => StatusCode::CONFLICT,
            Self::Config(_) => StatusCode::INTERNAL_SERVER_ERROR,
            Self::Store(error) if error.kind() == crate::store::StoreErrorKind::Misused => {
                StatusCode::INTERNAL_SERVER_ERROR
            }
            Self::Store(_) | Self::LeaseLost(_) => StatusCode::SERVICE_UNAVAILABLE,
            Self::Key(rejection) => rejection.status(),
        }
    }

    /// The `application/problem+json` response for this error, with [`status`](Self::status)
    /// and `Retry-After` where it helps (the problem types are listed in
    /// [`crate::response`]). It names no key value, token or store internals.
    pub fn problem(&self) -> Response<Bytes> {
        crate::response::lock_problem(self, self.status())
    }

    /// Whether every permit of the key was taken until the wait gave up (429,
    /// `#permits-exhausted`): [`Contended`](Self::Contended) for a lease that asked for some of a
    /// key's permits.
    pub fn is_permits_exhausted(&self) -> bool {
        matches!(
            self,
            Self::Contended {
                permits: Some(_),
                ..
            }
        )
    }
}

impl From<ConfigError> for LockError {
    fn from(e: ConfigError) -> Self {
        Self::Config(e)
    }
}

impl From<StoreError> for LockError {
    fn from(e: StoreError) -> Self {
        Self::Store(e)
    }
}

impl From<KeyRejection> for LockError {
    fn from(e: KeyRejection) -> Self {
        Self::Key(e)
    }
}

/// A setting is invalid. Returned at start-up (when a config is built), never at request time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    field: &'static str,
    reason: Cow<'static, str>,
}

impl ConfigError {
    pub(crate) fn new(field: &'static str, reason: impl Into<Cow<'static, str>>) -> Self {
        Self {
            field,
            reason: reason.into(),
        }
    }

    /// The setting at fault, e.g. `"ttl"` or `"wait.factor"`.
    pub fn field(&self) -> &'static str {
        self.field
    }

    /// 500: a setting is the server's mistake, never the request's.
    pub fn status(&self) -> StatusCode {
        StatusCode::INTERNAL_SERVER_ERROR
    }

    /// The `application/problem+json` response for this error (type `#lock-misconfigured`), for
    /// a handler that builds a lease with `?`.
    pub fn problem(&self) -> Response<Bytes> {
        crate::response::lock_problem(&LockError::Config(self.clone()), self.status())
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invalid lock setting `{}`: {}", self.field, self.reason)
    }
}

impl std::error::Error for ConfigError {}

#[cfg(test)]
mod tests {
    use std::error::Error;

    use super::*;
    use crate::store::StoreErrorKind;

    /// An error and its source each say their own part once: printed as a chain (`outer:
    /// inner`, as logs do), no text comes twice.
    #[test]
    fn no_error_repeats_its_source() {
        let store = || StoreError::msg(StoreErrorKind::Unavailable, "refused");
        let errors: [Box<dyn Error>; 5] = [
            Box::new(LockError::Store(store())),
            Box::new(LockError::Key(KeyRejection::body_too_large(10))),
            Box::new(LockError::Config(ConfigError::new(
                "permits",
                "0 admit nobody",
            ))),
            Box::new(crate::fence::FenceError::Store(store())),
            Box::new(crate::idempotency::IdempotencyError::BodyUnreadable(
                std::sync::Arc::new(ConfigError::new("body", "cut short")),
            )),
        ];
        for error in &errors {
            let source = error.source().expect("a source").to_string();
            assert!(
                !error.to_string().contains(&source),
                "{error} repeats its source ({source})"
            );
        }
    }
}
