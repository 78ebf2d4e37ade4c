//! The lock's settings: [`LockConfig`], its builder, their defaults and their validation.

use std::time::Duration;

use crate::{error::ConfigError, wait::Wait};

/// The longest duration a setting may hold (TTLs, holds, timeouts, retention): 365 days. A
/// longer one would overflow the clock's arithmetic (`Duration::MAX` for "for ever") or the
/// store's expiry in milliseconds.
pub(crate) const MAX_DURATION: Duration = Duration::from_secs(365 * 24 * 60 * 60);

/// `duration` as the setting `field`, refused above [`MAX_DURATION`].
pub(crate) fn at_most_a_year(field: &'static str, duration: Duration) -> Result<(), ConfigError> {
    match duration <= MAX_DURATION {
        true => Ok(()),
        false => Err(ConfigError::new(
            field,
            "must be at most 365 days (leave it unset, or use `None` where the setting takes \
             one, for no limit)",
        )),
    }
}

/// `ttl` as a lease's TTL: refused under 10 ms (a renewal every third of it could not keep
/// up) or over 365 days.
pub(crate) fn check_ttl(ttl: Duration) -> Result<(), ConfigError> {
    if ttl < Duration::from_millis(10) {
        return Err(ConfigError::new("ttl", "the TTL must be at least 10 ms"));
    }
    at_most_a_year("ttl", ttl)
}

/// What happens to a request whose lease is lost while its handler runs: a layer's setting
/// ([`LockLayer::on_lease_lost`](crate::LockLayer::on_lease_lost),
/// [`IdempotencyLayer::on_lease_lost`](crate::IdempotencyLayer::on_lease_lost)). Work run by a
/// [`Locker`](crate::Locker) is always dropped (see [`Locker::run`](crate::Locker::run)).
///
/// A lease is lost when a renewal finds the key no longer holds our token (it expired during a
/// stall, or someone deleted it), when renewals keep failing until the lease runs out, or when
/// the request outlives [`LockConfig::max_hold`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Deserialize, serde::Serialize),
    serde(rename_all = "snake_case")
)]
#[non_exhaustive]
pub enum OnLeaseLost {
    /// Drop the handler's future at once and answer 503 (the default): nothing more runs
    /// without the lock. Except once the handler has sent a [fenced write](crate::fence) that
    /// writes: it may have landed, so the handler runs to its end and its own answer (200, or
    /// 409 for a write the fence refused) goes out, never a 503 that says nothing was done.
    #[default]
    Abort,
    /// Let the handler finish; [`Lease::is_lost`](crate::Lease::is_lost) and
    /// [`Lease::lost`](crate::Lease::lost) tell it, so it can stop or fence its writes.
    Continue,
}

/// How a lock key's value appears in tracing spans.
///
/// Keys may carry user data (an email, an account number), so by default spans show a keyed hash:
/// stable within one process (requests on the same key can be correlated), meaningless outside
/// it. The lock token never appears, whatever this says.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Deserialize, serde::Serialize),
    serde(rename_all = "snake_case")
)]
#[non_exhaustive]
pub enum KeyDisplay {
    /// A 64-bit SipHash of the value under a per-process random key, in hex (the default).
    #[default]
    Hashed,
    /// The value itself (lossy UTF-8).
    Plain,
    /// Nothing.
    Hidden,
}

/// The lock's settings, shared by [`Locker`](crate::Locker) and the layers built on it: how a
/// lease is taken, kept and named. Valid by construction.
///
/// What a layer does with the request around its lease is the layer's own
/// ([`LockLayer::on_lease_lost`](crate::LockLayer::on_lease_lost),
/// [`LockLayer::hold_until_body_end`](crate::LockLayer::hold_until_body_end), its
/// [`rejection_response`](crate::LockLayer::rejection_response) for other statuses than the
/// [`response`](crate::response) module's); see the [`LockLayer`](crate::LockLayer) docs.
///
/// Built with [`LockConfig::builder`], whose [`build`](LockConfigBuilder::build) checks every
/// setting and returns a [`ConfigError`] naming the first invalid one, so a bad value fails at
/// start-up, never at request time. The getters have the settings' plain names.
///
/// | setting | default | meaning |
/// |---|---|---|
/// | [`ttl`](Self::ttl) | 10 s | lease time to live; a crashed holder's key frees itself after this |
/// | [`renew_interval`](Self::renew_interval) | ttl / 3 | how often a running request extends its lease |
/// | [`wait`](Self::wait) | exponential 10..200 ms, jitter, 2 s deadline | retry policy for a held key |
/// | [`max_hold`](Self::max_hold) | 5 min | no request holds a lease longer, renewals or not |
/// | [`store_timeout`](Self::store_timeout) | 1 s | bound on each renew and release, and the least time an acquire attempt gets |
/// | [`key_prefix`](Self::key_prefix) | `tower-lock:` | prepended to every key |
/// | [`max_key_len`](Self::max_key_len) | 512 bytes | longer key values are a 400 |
/// | [`max_keys`](Self::max_keys) | 64 | the most keys one lease may hold; more are a 400 |
/// | [`key_display`](Self::key_display) | [`KeyDisplay::Hashed`] | how keys appear in spans |
///
/// ```
/// use std::time::Duration;
/// use tower_lock::{LockConfig, Wait};
///
/// let config = LockConfig::builder()
///     .ttl(Duration::from_secs(30))
///     .wait(Wait::none())
///     .build()?;
/// assert_eq!(config.renew_interval(), Duration::from_secs(10));
/// # Ok::<(), tower_lock::ConfigError>(())
/// ```
///
/// With the `serde` feature both the config and its builder deserialize from any serde format
/// (the config checks what it reads); durations are whole milliseconds in fields ending `_ms`,
/// and every field is optional:
///
/// ```toml
/// ttl_ms = 30000
/// key_prefix = "shop:lock:"
/// [wait]
/// policy = "exponential"   # or "none", "constant" (delay_ms), "fixed" (delays_ms)
/// initial_ms = 5
/// max_ms = 100
/// deadline_ms = 1000
/// ```
#[derive(Debug, Clone, Default, PartialEq)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Deserialize, serde::Serialize),
    serde(try_from = "LockConfigBuilder", into = "LockConfigBuilder")
)]
pub struct LockConfig {
    settings: Settings,
}

/// Builds a [`LockConfig`]; see its docs for the settings and their defaults.
///
/// Setters take and return `self`; nothing is checked until [`build`](Self::build).
#[derive(Debug, Clone, Default, PartialEq)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Deserialize, serde::Serialize),
    serde(transparent)
)]
#[must_use]
pub struct LockConfigBuilder {
    settings: Settings,
}

#[derive(Debug, Clone, PartialEq)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Deserialize, serde::Serialize),
    serde(default, deny_unknown_fields)
)]
struct Settings {
    #[cfg_attr(
        feature = "serde",
        serde(rename = "ttl_ms", with = "crate::serde_ms::ms")
    )]
    ttl: Duration,
    #[cfg_attr(
        feature = "serde",
        serde(rename = "renew_interval_ms", with = "crate::serde_ms::opt_ms")
    )]
    renew_interval: Option<Duration>,
    wait: Wait,
    #[cfg_attr(
        feature = "serde",
        serde(rename = "max_hold_ms", with = "crate::serde_ms::ms")
    )]
    max_hold: Duration,
    #[cfg_attr(
        feature = "serde",
        serde(rename = "store_timeout_ms", with = "crate::serde_ms::ms")
    )]
    store_timeout: Duration,
    key_prefix: String,
    max_key_len: usize,
    max_keys: usize,
    key_display: KeyDisplay,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            ttl: Duration::from_secs(10),
            renew_interval: None,
            wait: Wait::default(),
            max_hold: Duration::from_secs(5 * 60),
            store_timeout: Duration::from_secs(1),
            key_prefix: "tower-lock:".to_owned(),
            max_key_len: 512,
            max_keys: 64,
            key_display: KeyDisplay::Hashed,
        }
    }
}

/// One line per setting: the builder's setter and the config's getter, with one doc.
macro_rules! settings {
    ($($(#[$doc:meta])* $name:ident: $ty:ty => $conv:expr, get $get:ty => $read:expr;)*) => {
        impl LockConfigBuilder {
            $(
                $(#[$doc])*
                pub fn $name(mut self, $name: $ty) -> Self {
                    self.settings.$name = $conv($name);
                    self
                }
            )*
        }

        impl LockConfig {
            $(
                $(#[$doc])*
                pub fn $name(&self) -> $get {
                    let read: fn(&Settings) -> $get = $read;
                    read(&self.settings)
                }
            )*
        }
    };
}

settings! {
    /// Lease time to live (at least 10 ms, at most 365 days; default 10 s).
    ttl: Duration => |v| v, get Duration => |s| s.ttl;
    /// How often to renew while a request runs; shorter than the TTL (default TTL / 3).
    renew_interval: Duration => Some, get Duration => |s| s.renew_interval.unwrap_or(s.ttl / 3);
    /// The retry policy for a held key.
    wait: Wait => |v| v, get &Wait => |s| &s.wait;
    /// The longest any one request may hold its lease (default 5 min, at most 365 days).
    max_hold: Duration => |v| v, get Duration => |s| s.max_hold;
    /// Bound on each renew and release round trip, and the least time an acquire attempt gets
    /// even when the wait deadline is shorter, so `Wait::none()` still has time for one try
    /// (default 1 s). A [`RedisStore`](crate::RedisStore) made by `connect` also gives each
    /// command at most 2 s of silence from Redis (its connection's own response timeout: the
    /// call then fails as timed out), so above 2 s this bounds nothing more there. At most
    /// 365 days.
    store_timeout: Duration => |v| v, get Duration => |s| s.store_timeout;
    /// Prepended to every key, to keep this service's locks apart in a shared Redis (default
    /// `tower-lock:`).
    key_prefix: impl Into<String> => Into::into, get &str => |s| s.key_prefix.as_str();
    /// Longest accepted key value, in bytes (default 512).
    max_key_len: usize => |v| v, get usize => |s| s.max_key_len;
    /// The most keys one lease may hold: a request whose key source names more is a 400, a
    /// [`Locker`](crate::Locker) acquire of more an error (default 64).
    max_keys: usize => |v| v, get usize => |s| s.max_keys;
    /// How keys appear in tracing spans (default hashed: keys may carry user data).
    key_display: KeyDisplay => |v| v, get KeyDisplay => |s| s.key_display;
}

impl LockConfig {
    /// A builder starting from the defaults.
    pub fn builder() -> LockConfigBuilder {
        LockConfigBuilder::default()
    }

    /// A builder starting from these settings, to derive another config.
    pub fn to_builder(&self) -> LockConfigBuilder {
        LockConfigBuilder {
            settings: self.settings.clone(),
        }
    }
}

impl LockConfigBuilder {
    /// Checks every setting and returns the config, or the first invalid setting.
    pub fn build(self) -> Result<LockConfig, ConfigError> {
        self.settings.validate()?;
        Ok(LockConfig {
            settings: self.settings,
        })
    }
}

impl TryFrom<LockConfigBuilder> for LockConfig {
    type Error = ConfigError;

    fn try_from(builder: LockConfigBuilder) -> Result<Self, ConfigError> {
        builder.build()
    }
}

impl From<LockConfig> for LockConfigBuilder {
    fn from(config: LockConfig) -> Self {
        Self {
            settings: config.settings,
        }
    }
}

impl Settings {
    fn validate(&self) -> Result<(), ConfigError> {
        check_ttl(self.ttl)?;
        at_most_a_year("max_hold", self.max_hold)?;
        at_most_a_year("store_timeout", self.store_timeout)?;
        let renew = self.renew_interval.unwrap_or(self.ttl / 3);
        if renew.is_zero() || renew >= self.ttl {
            return Err(ConfigError::new(
                "renew_interval",
                "the renewal interval must be above 0 and shorter than the TTL, or the lease \
                 expires before it is renewed",
            ));
        }
        if self.max_hold.is_zero() {
            return Err(ConfigError::new(
                "max_hold",
                "the longest hold must be above 0",
            ));
        }
        if self.store_timeout.is_zero() {
            return Err(ConfigError::new(
                "store_timeout",
                "the store timeout must be above 0",
            ));
        }
        if self.key_prefix.contains(['{', '}']) {
            return Err(ConfigError::new(
                "key_prefix",
                "the key prefix must not contain `{` or `}` (the key's hash tag starts after it)",
            ));
        }
        if self.max_key_len == 0 {
            return Err(ConfigError::new(
                "max_key_len",
                "the key length limit must be above 0",
            ));
        }
        if self.max_keys == 0 {
            return Err(ConfigError::new(
                "max_keys",
                "the most keys a lease may hold must be above 0",
            ));
        }
        self.wait.validate()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid() {
        let config = LockConfig::default();
        assert_eq!(LockConfig::builder().build().unwrap(), config);
        assert_eq!(config.renew_interval(), Duration::from_secs(10) / 3);
        assert_eq!(config.to_builder().build().unwrap(), config);
    }

    #[test]
    fn invalid_settings_name_their_field() {
        let b = LockConfig::builder;
        let cases = [
            (b().ttl(Duration::ZERO), "ttl"),
            (
                b().renew_interval(Duration::from_secs(10)),
                "renew_interval",
            ),
            (b().renew_interval(Duration::ZERO), "renew_interval"),
            (b().max_hold(Duration::ZERO), "max_hold"),
            (b().store_timeout(Duration::ZERO), "store_timeout"),
            (b().key_prefix("a{b"), "key_prefix"),
            (b().max_key_len(0), "max_key_len"),
            (b().max_keys(0), "max_keys"),
        ];
        for (builder, field) in cases {
            let err = builder.build().unwrap_err();
            assert_eq!(err.field(), field);
            assert!(err.to_string().contains(field), "{err}");
        }
    }

    #[cfg(feature = "serde")]
    #[test]
    fn deserializes_with_defaults_and_rejects_unknown_fields() {
        let config: LockConfig = serde_json::from_str(
            r#"{"ttl_ms": 3000, "key_display": "plain",
                "wait": {"policy": "fixed", "delays_ms": [5, 10], "deadline_ms": 100}}"#,
        )
        .unwrap();
        assert_eq!(config.ttl(), Duration::from_secs(3));
        assert_eq!(config.key_display(), KeyDisplay::Plain);
        assert_eq!(
            config.wait(),
            &Wait::fixed([5, 10].map(Duration::from_millis))
                .unwrap()
                .deadline(Duration::from_millis(100))
        );
        assert_eq!(config.key_prefix(), "tower-lock:");
        assert!(serde_json::from_str::<LockConfig>(r#"{"tll_ms": 1}"#).is_err());
        // A layer's settings are not the lock's: a file that still has them says so.
        let layer_setting = r#"{"on_lease_lost": "continue"}"#;
        assert!(serde_json::from_str::<LockConfig>(layer_setting).is_err());
        let invalid = serde_json::from_str::<LockConfig>(r#"{"ttl_ms": 1}"#).unwrap_err();
        assert!(invalid.to_string().contains("`ttl`"), "{invalid}");
        let builder: LockConfigBuilder = serde_json::from_str(r#"{"ttl_ms": 1}"#).unwrap();
        assert_eq!(builder.build().unwrap_err().field(), "ttl");
        // A wait read from a file is checked as `Wait::constant` checks one, in a config or
        // alone (for a layer's or a call's `wait`).
        let busy = r#"{"policy": "constant", "delay_ms": 0}"#;
        let in_config = format!(r#"{{"wait": {busy}}}"#);
        let refused = serde_json::from_str::<LockConfig>(&in_config).unwrap_err();
        assert!(refused.to_string().contains("wait.delay"), "{refused}");
        let refused = serde_json::from_str::<Wait>(busy).unwrap_err();
        assert!(refused.to_string().contains("wait.delay"), "{refused}");
        let fine = r#"{"policy": "constant", "delay_ms": 10}"#;
        assert!(serde_json::from_str::<Wait>(fine).is_ok());
        let round: LockConfig =
            serde_json::from_str(&serde_json::to_string(&config).unwrap()).unwrap();
        assert_eq!(round, config);
        let none: LockConfig = serde_json::from_str(r#"{"wait": {"policy": "none"}}"#).unwrap();
        assert_eq!(
            none.wait(),
            &Wait::none(),
            "deadline_ms omitted is the policy's default"
        );
        let forever: LockConfig = serde_json::from_str(
            r#"{"wait": {"policy": "constant", "delay_ms": 5, "forever": true}}"#,
        )
        .unwrap();
        assert_eq!(forever.wait().total(), None);
    }
}
