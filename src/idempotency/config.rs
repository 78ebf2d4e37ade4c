//! The idempotency layer's settings.

use std::time::Duration;

use http::{HeaderName, header};

use super::{fingerprint::Fingerprint, predicate::StoreWhen};
use crate::{
    config::{ConfigError, LockConfig},
    wait::Wait,
};

/// Settings of an [`IdempotencyLayer`](super::IdempotencyLayer).
///
/// Setters take and return `self`; [`IdempotencyLayer::with_config`](super::IdempotencyLayer::with_config)
/// checks them and returns a [`ConfigError`] naming the first invalid one.
///
/// | setting | default | meaning |
/// |---|---|---|
/// | [`header`](Self::header) | `idempotency-key` | the request header carrying the key |
/// | [`required`](Self::required) | `true` | a request without the header is a 400; `false` passes it through untouched |
/// | [`min_key_len`](Self::min_key_len) | 16 bytes | shorter keys are a 400 (a UUID is 36) |
/// | [`max_key_len`](Self::max_key_len) | 255 bytes | longer keys are a 400 (Stripe's limit) |
/// | [`retention`](Self::retention) | 24 h | how long a finished request's response is replayed |
/// | [`max_request_body`](Self::max_request_body) | 1 MiB | request bodies are buffered to fingerprint them; larger ones are a 413 |
/// | [`max_response_body`](Self::max_response_body) | 64 KiB | larger responses are sent but not stored: a retry runs the handler again |
/// | [`store_when`](Self::store_when) | [`NotServerError`](super::NotServerError) | which of the handler's responses are stored and replayed; a retry after any other runs the handler again |
/// | [`replay_headers`](Self::replay_headers) | `content-type`, `content-language`, `content-location`, `location`, `etag`, `last-modified`, `link` | response headers stored and replayed; all others are dropped from the record |
/// | [`namespace`](Self::namespace) | `idempotency` | key space; layers with the same namespace and principal share keys |
/// | [`fingerprint`](Self::fingerprint) | method, path, body | what a retry must repeat to be replayed (else 422) |
/// | [`lock`](Self::lock) | [`LockConfig`] with [`Wait::none`] | the lock taken while the first request runs |
///
/// The lock fails fast by default, so a concurrent duplicate gets 409 at once (as the draft
/// describes); give [`lock`](Self::lock) a waiting policy to make it wait for the first request
/// and then replay its response instead.
#[derive(Debug, Clone)]
pub struct IdempotencyConfig {
    pub(super) header: HeaderName,
    pub(super) required: bool,
    pub(super) min_key_len: usize,
    pub(super) max_key_len: usize,
    pub(super) retention: Duration,
    pub(super) max_request_body: usize,
    pub(super) max_response_body: usize,
    pub(super) store_when: StoreWhen,
    pub(super) replay_headers: Vec<HeaderName>,
    pub(super) namespace: String,
    pub(super) fingerprint: Fingerprint,
    pub(super) lock: LockConfig,
}

impl Default for IdempotencyConfig {
    fn default() -> Self {
        Self {
            header: HeaderName::from_static("idempotency-key"),
            required: true,
            min_key_len: 16,
            max_key_len: 255,
            retention: Duration::from_secs(24 * 60 * 60),
            max_request_body: 1024 * 1024,
            max_response_body: 64 * 1024,
            store_when: StoreWhen::default(),
            replay_headers: vec![
                header::CONTENT_TYPE,
                header::CONTENT_LANGUAGE,
                header::CONTENT_LOCATION,
                header::LOCATION,
                header::ETAG,
                header::LAST_MODIFIED,
                header::LINK,
            ],
            namespace: "idempotency".to_owned(),
            fingerprint: Fingerprint::default(),
            lock: LockConfig::default().wait(Wait::none()),
        }
    }
}

macro_rules! setters {
    ($($(#[$doc:meta])* $name:ident: $ty:ty => $conv:expr;)*) => {
        impl IdempotencyConfig {
            $(
                $(#[$doc])*
                #[must_use]
                pub fn $name(mut self, $name: $ty) -> Self {
                    self.$name = $conv($name);
                    self
                }
            )*
        }
    };
}

setters! {
    /// The request header carrying the key (default `idempotency-key`).
    header: HeaderName => |v| v;
    /// Whether a request without the header is a 400 (the default), or passes through
    /// untouched: no lock, no record, no buffering.
    required: bool => |v| v;
    /// Shortest accepted key, in bytes (default 16).
    min_key_len: usize => |v| v;
    /// Longest accepted key, in bytes (default 255).
    max_key_len: usize => |v| v;
    /// How long a finished request's response is kept and replayed (default 24 h, at least
    /// 1 ms). After it, the key may be used again.
    retention: Duration => |v| v;
    /// Largest request body buffered for the fingerprint, in bytes (default 1 MiB); larger
    /// bodies are answered 413 before the handler runs.
    max_request_body: usize => |v| v;
    /// Largest response body stored for replay, in bytes (default 64 KiB). A larger response
    /// is sent as it is, but not stored: a retry runs the handler again.
    max_response_body: usize => |v| v;
    /// Which of the handler's responses are stored and replayed, decided on the response head
    /// (default [`NotServerError`](super::NotServerError): all but 5xx). A response it refuses
    /// is sent as it is and not stored: a retry with the same key runs the handler again. See
    /// [`StorePredicate`](super::StorePredicate) for the built-ins ([`NotError`](super::NotError)
    /// leaves out 4xx too, [`Always`](super::Always) stores 5xx as well) and closures.
    store_when: impl super::StorePredicate => StoreWhen::new;
    /// Response headers stored and replayed (matched case-insensitively); the others are not
    /// stored at all.
    replay_headers: impl IntoIterator<Item = HeaderName> => |v: _| Vec::from_iter(v);
    /// The key space (default `idempotency`). Keys are scoped by this and by the principal,
    /// not by route: the route is part of the fingerprint instead, so reusing a key on another
    /// route is a 422.
    namespace: impl Into<String> => Into::into;
    /// What a retry must repeat to be replayed.
    fingerprint: Fingerprint => |v| v;
    /// The lock's settings: TTL, renewal, wait policy, key prefix, statuses.
    lock: LockConfig => |v| v;
}

impl IdempotencyConfig {
    /// Checks every setting; [`IdempotencyLayer::with_config`](super::IdempotencyLayer::with_config)
    /// calls this for you.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.min_key_len == 0 {
            return Err(ConfigError::new(
                "min_key_len",
                "the shortest key must be at least 1 byte",
            ));
        }
        if self.max_key_len < self.min_key_len {
            return Err(ConfigError::new(
                "max_key_len",
                "the longest key must not be shorter than the shortest",
            ));
        }
        if self.retention < Duration::from_millis(1) {
            return Err(ConfigError::new(
                "retention",
                "the retention must be at least 1 ms",
            ));
        }
        self.lock.validate()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_limits_checked() {
        IdempotencyConfig::default().validate().unwrap();
        let err = IdempotencyConfig::default()
            .min_key_len(0)
            .validate()
            .unwrap_err();
        assert_eq!(err.field(), "min_key_len");
        let err = IdempotencyConfig::default()
            .min_key_len(20)
            .max_key_len(10)
            .validate()
            .unwrap_err();
        assert_eq!(err.field(), "max_key_len");
        let err = IdempotencyConfig::default()
            .retention(Duration::ZERO)
            .validate()
            .unwrap_err();
        assert_eq!(err.field(), "retention");
        let err = IdempotencyConfig::default()
            .lock(LockConfig::default().ttl(Duration::from_millis(1)))
            .validate()
            .unwrap_err();
        assert_eq!(err.field(), "ttl");
    }
}
