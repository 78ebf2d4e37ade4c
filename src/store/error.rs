//! [`StoreError`]: a store failed to answer.

use std::{error::Error as StdError, fmt, sync::Arc, time::Duration};

/// What kind of failure a [`StoreError`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum StoreErrorKind {
    /// The store did not answer in time.
    Timeout,
    /// The store could not be reached, or the connection broke.
    Unavailable,
    /// The store answered with an error or an unexpected reply.
    Backend,
    /// The store refused the operation without running it, and asked for it to be sent again
    /// shortly: a Redis Cluster slot being migrated answers `TRYAGAIN` to a script whose keys
    /// are split between its two masters (the lock key of a free lock is always missing). An
    /// acquire that meets it waits and tries again, within its wait deadline, as it would for
    /// a held key; at the deadline it answers as other store errors do (503).
    TryAgain,
    /// No randomness was available to draw a lock token.
    Entropy,
    /// The store refused the credentials: a wrong password or user name, a disabled user
    /// (`WRONGPASS`), or none given to a server that requires one (`NOAUTH`). Retrying does
    /// not help; the message never contains the credentials.
    Authentication,
    /// TLS with the store failed: its certificate is not signed by a trusted CA, names another
    /// host, or has expired; it refused the client certificate, or asked for one that was not
    /// given (mutual TLS); the port does not speak TLS; or the TLS settings themselves (a CA
    /// bundle, a client certificate or key) could not be read or used. Retrying does not help.
    Tls,
    /// The connection settings are invalid: a URL that does not parse, or TLS settings for a
    /// `redis://` URL (which would not use them). Retrying does not help.
    Config,
    /// The key is taken another way than its holders took it: plain against a lease with a
    /// share (permits, shared or exclusive), or with another number of permits. Every user of a
    /// key must take it the same way; retrying does not help (two routes or calls disagree: a
    /// layer answers 500, `#lock-key-misused`).
    Misused,
}

/// A lock store failed to answer. The layer turns it into a 503 with `Retry-After`.
///
/// The underlying error is kept as the [`source`](std::error::Error::source).
#[derive(Clone)]
pub struct StoreError {
    kind: StoreErrorKind,
    message: Arc<str>,
    source: Option<Arc<dyn StdError + Send + Sync>>,
}

impl StoreError {
    /// An error of `kind` caused by `source`.
    pub fn new(
        kind: StoreErrorKind,
        message: impl Into<Arc<str>>,
        source: impl Into<Box<dyn StdError + Send + Sync>>,
    ) -> Self {
        Self {
            kind,
            message: message.into(),
            source: Some(Arc::from(source.into())),
        }
    }

    /// An error of `kind` with no underlying cause.
    pub fn msg(kind: StoreErrorKind, message: impl Into<Arc<str>>) -> Self {
        Self {
            kind,
            message: message.into(),
            source: None,
        }
    }

    pub(crate) fn timeout(after: Duration) -> Self {
        Self::msg(
            StoreErrorKind::Timeout,
            format!("the lock store did not answer within {after:?}"),
        )
    }

    pub(crate) fn entropy(source: getrandom::Error) -> Self {
        Self::new(
            StoreErrorKind::Entropy,
            "the operating system could not provide randomness for a lock token",
            Box::<dyn StdError + Send + Sync>::from(source.to_string()),
        )
    }

    /// What kind of failure this is.
    pub fn kind(&self) -> StoreErrorKind {
        self.kind
    }

    /// 503: the store failed or did not answer; the request may be retried.
    pub fn status(&self) -> http::StatusCode {
        http::StatusCode::SERVICE_UNAVAILABLE
    }

    /// The `application/problem+json` response for this error (type `#lock-store-unavailable`,
    /// `Retry-After: 1`). It says nothing of the store's message, which may name its address.
    pub fn problem(&self) -> http::Response<bytes::Bytes> {
        crate::response::lock_problem(&crate::LockError::Store(self.clone()), self.status())
    }

    /// This error, as the reason connecting to `target` ("the Redis server at host:port")
    /// failed: its kind, and a message that says both.
    #[cfg_attr(not(feature = "redis"), allow(dead_code))] // constructed by the Redis stores
    pub(crate) fn while_connecting(self, target: &str) -> Self {
        Self {
            kind: self.kind,
            message: format!("cannot connect to {target}: {}", self.message).into(),
            source: self.source,
        }
    }
}

impl fmt::Debug for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StoreError")
            .field("kind", &self.kind)
            .field("message", &self.message)
            .field("source", &self.source)
            .finish()
    }
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl StdError for StoreError {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        self.source
            .as_deref()
            .map(|e| e as &(dyn StdError + 'static))
    }
}
