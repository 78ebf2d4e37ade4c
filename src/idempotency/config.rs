//! The idempotency layer's settings.

use std::time::Duration;

use http::{HeaderName, header};

use super::{fingerprint::Fingerprint, predicate::StoreWhen};
use crate::{config::LockConfig, error::ConfigError, wait::Wait};

/// Settings of an [`IdempotencyLayer`](crate::IdempotencyLayer): valid by construction.
///
/// Built with [`IdempotencyConfig::builder`], whose [`build`](IdempotencyConfigBuilder::build)
/// checks every setting and returns a [`ConfigError`] naming the first invalid one. The getters
/// have the settings' plain names.
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
/// | [`store_when`](Self::store_when) | [`NotRejected`](super::NotRejected) | which of the handler's responses are stored and replayed; a retry after any other runs the handler again |
/// | [`replay_headers`](Self::replay_headers) | `content-type`, `content-language`, `content-location`, `location`, `etag`, `last-modified`, `link` | response headers stored and replayed; all others are dropped from the record |
/// | [`namespace`](Self::namespace) | `idempotency` | key space; layers with the same namespace and principal share keys |
/// | [`fingerprint`](Self::fingerprint) | method, path, query, media type, body | what a retry must repeat to be replayed (else 422) |
/// | [`lock`](Self::lock) | [`LockConfig`] with [`Wait::none`] | the lock taken while the first request runs |
///
/// The lock fails fast by default, so a concurrent duplicate gets 409 at once (as the draft
/// describes); give [`lock`](Self::lock) a waiting policy to make it wait for the first request
/// and then replay its response instead.
///
/// ```
/// use std::time::Duration;
/// use tower_lock::{LockConfig, Wait, idempotency::IdempotencyConfig};
///
/// let config = IdempotencyConfig::builder()
///     .retention(Duration::from_secs(3600))
///     .lock(LockConfig::builder().wait(Wait::constant(Duration::from_millis(50))?).build()?)
///     .build()?;
/// assert_eq!(config.retention(), Duration::from_secs(3600));
/// # Ok::<(), tower_lock::ConfigError>(())
/// ```
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
            lock: LockConfig::builder()
                .wait(Wait::none())
                .build()
                .expect("the default lock config with Wait::none() is valid"),
        }
    }
}

/// Builds an [`IdempotencyConfig`]; see its docs for the settings and their defaults.
///
/// Setters take and return `self`; nothing is checked until [`build`](Self::build).
#[derive(Debug, Clone, Default)]
#[must_use]
pub struct IdempotencyConfigBuilder {
    config: IdempotencyConfig,
}

impl IdempotencyConfig {
    /// A builder starting from the defaults.
    pub fn builder() -> IdempotencyConfigBuilder {
        IdempotencyConfigBuilder::default()
    }

    /// A builder starting from these settings, to derive another config.
    pub fn to_builder(&self) -> IdempotencyConfigBuilder {
        IdempotencyConfigBuilder {
            config: self.clone(),
        }
    }
}

impl IdempotencyConfigBuilder {
    /// Checks every setting and returns the config, or the first invalid setting.
    pub fn build(self) -> Result<IdempotencyConfig, ConfigError> {
        self.config.validate()?;
        Ok(self.config)
    }
}

/// One line per setting: the builder's setter and the config's getter, with one doc.
macro_rules! settings {
    ($($(#[$doc:meta])* $name:ident: $ty:ty => $conv:expr, get $get:ty => $read:expr;)*) => {
        impl IdempotencyConfigBuilder {
            $(
                $(#[$doc])*
                pub fn $name(mut self, $name: $ty) -> Self {
                    self.config.$name = $conv($name);
                    self
                }
            )*
        }

        impl IdempotencyConfig {
            $(
                $(#[$doc])*
                pub fn $name(&self) -> $get {
                    let read: fn(&Self) -> $get = $read;
                    read(self)
                }
            )*
        }
    };
}

settings! {
    /// The request header carrying the key (default `idempotency-key`).
    header: HeaderName => |v| v, get &HeaderName => |c| &c.header;
    /// Whether a request without the header is a 400 (the default), or passes through
    /// untouched: no lock, no record, no buffering.
    required: bool => |v| v, get bool => |c| c.required;
    /// Shortest accepted key, in bytes (default 16).
    min_key_len: usize => |v| v, get usize => |c| c.min_key_len;
    /// Longest accepted key, in bytes (default 255).
    max_key_len: usize => |v| v, get usize => |c| c.max_key_len;
    /// How long a finished request's response is kept and replayed (default 24 h, at least
    /// 1 ms, at most 365 days). After it, the key may be used again.
    retention: Duration => |v| v, get Duration => |c| c.retention;
    /// Largest request body buffered for the fingerprint, in bytes (default 1 MiB); larger
    /// bodies are answered 413 before the handler runs.
    max_request_body: usize => |v| v, get usize => |c| c.max_request_body;
    /// Largest response body stored for replay, in bytes (default 64 KiB). A larger response
    /// is sent as it is, but not stored: a retry runs the handler again.
    max_response_body: usize => |v| v, get usize => |c| c.max_response_body;
    /// Which of the handler's responses are stored and replayed, decided on the response head
    /// (default [`NotRejected`](super::NotRejected): all but 5xx and the 4xx that refuse a
    /// request before it runs, such as a body that does not parse). A response it refuses is
    /// sent as it is and not stored: a retry with the same key runs the handler again. See
    /// [`StorePredicate`](super::StorePredicate) for the built-ins
    /// ([`NotServerError`](super::NotServerError) stores every 4xx, [`NotError`](super::NotError)
    /// none, [`Always`](super::Always) 5xx as well) and closures.
    store_when: impl super::StorePredicate => StoreWhen::new, get &dyn super::StorePredicate => |c| c.store_when.predicate();
    /// Response headers stored and replayed (matched case-insensitively); the others are not
    /// stored at all.
    replay_headers: impl IntoIterator<Item = HeaderName> => |v: _| Vec::from_iter(v),
        get &[HeaderName] => |c| &c.replay_headers;
    /// The key space (default `idempotency`). Keys are scoped by this and by the principal,
    /// not by route: the route is part of the fingerprint instead, so reusing a key on another
    /// route is a 422.
    namespace: impl Into<String> => Into::into, get &str => |c| c.namespace.as_str();
    /// What a retry must repeat to be replayed.
    fingerprint: Fingerprint => |v| v, get &Fingerprint => |c| &c.fingerprint;
    /// The lock's settings: TTL, renewal, wait policy, key prefix, statuses.
    lock: LockConfig => |v| v, get &LockConfig => |c| &c.lock;
}

impl IdempotencyConfig {
    fn validate(&self) -> Result<(), ConfigError> {
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
        crate::config::at_most_a_year("retention", self.retention)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_limits_checked() {
        let config = IdempotencyConfig::builder().build().unwrap();
        assert_eq!(config.lock().wait(), &Wait::none());
        let b = IdempotencyConfig::builder;
        assert_eq!(
            b().min_key_len(0).build().unwrap_err().field(),
            "min_key_len"
        );
        let err = b().min_key_len(20).max_key_len(10).build().unwrap_err();
        assert_eq!(err.field(), "max_key_len");
        let err = b().retention(Duration::ZERO).build().unwrap_err();
        assert_eq!(err.field(), "retention");
        let lock = LockConfig::builder().ttl(Duration::from_millis(1)).build();
        assert_eq!(lock.unwrap_err().field(), "ttl");
    }
}
