//! Telemetry: the `lock` span, the one vocabulary of outcomes ([`Outcome`]), metrics (through
//! the `metrics` facade, feature `metrics`; every function a no-op without it) and log helpers.
//!
//! See `docs/OBSERVABILITY.md` for every span field, event and metric. Labels are bounded: the
//! key's scope (a namespace, a route template or a source's name, all the server's; see
//! [`LockKey::scope`]), an operation or outcome name; never the key's value.

use std::{
    error::Error,
    fmt,
    hash::{BuildHasher, RandomState},
    sync::OnceLock,
    time::Duration,
};

use tracing::{Level, Span, field::Empty, level_filters::LevelFilter};

mod metrics;
pub(crate) mod outcome;

pub(crate) use self::metrics::*;
pub(crate) use self::outcome::Outcome;
use crate::{config::KeyDisplay, key::LockKey};

/// The `lock` span of one locked request or background lease, on `key` (the first of `keys`
/// keys, for a lease on several).
///
/// Fields: `scope`, `key` (per [`KeyDisplay`]), `keys` (how many, for a lease on
/// several), and, recorded as they become known, `fencing_token`, `attempts`, `wait_ms`,
/// `renewals`, `hold_ms`, `outcome`. Never the token.
pub(crate) fn span(key: &LockKey, keys: usize, display: KeyDisplay) -> Span {
    // No subscriber takes `info` spans: no span at all. A disabled span still carries its
    // metadata, and with tracing's `log` feature on (axum's default features turn it on), its
    // fields are put together and every enter, exit and record of it goes to the `log` facade,
    // several times per request.
    if LevelFilter::current() < Level::INFO {
        return Span::none();
    }
    let span = tracing::info_span!(
        "lock",
        scope = key.scope(),
        key = Empty,
        keys = (keys > 1).then_some(keys),
        outcome = Empty,
        fencing_token = Empty,
        attempts = Empty,
        wait_ms = Empty,
        renewals = Empty,
        hold_ms = Empty,
    );
    if span.is_disabled() {
        return Span::none();
    }
    match display {
        KeyDisplay::Hashed => {
            static HASHER: OnceLock<RandomState> = OnceLock::new();
            let hash = HASHER.get_or_init(RandomState::new).hash_one(key.value());
            span.record("key", format_args!("{hash:016x}"));
        }
        KeyDisplay::Plain => {
            span.record("key", String::from_utf8_lossy(key.value()).as_ref());
        }
        KeyDisplay::Hidden => {}
    }
    span
}

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// Records an acquisition on `span`.
pub(crate) fn record_acquired(span: &Span, fencing_token: u64, attempts: u32, waited: Duration) {
    span.record("fencing_token", fencing_token);
    span.record("attempts", attempts);
    span.record("wait_ms", ms(waited));
}

/// Records on `span` why a request (or background work) did not get its lease.
pub(crate) fn record_not_acquired(span: &Span, error: &crate::LockError) {
    if let crate::LockError::Contended {
        attempts, waited, ..
    } = error
    {
        span.record("attempts", attempts);
        span.record("wait_ms", ms(*waited));
    }
    record_end(span, Outcome::of(error), None);
}

/// Records how the request or lease ended on `span`, with the lease's renewals and hold time.
pub(crate) fn record_end(span: &Span, outcome: Outcome, lease: Option<&crate::Lease>) {
    span.record("outcome", outcome.as_str());
    if let Some(lease) = lease {
        span.record("renewals", lease.renewals());
        span.record("hold_ms", ms(lease.held_for()));
    }
}

/// Displays an error with its whole source chain: `outer: inner: root`.
pub(crate) struct Chain<'a>(pub(crate) &'a (dyn Error + 'static));

impl fmt::Display for Chain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)?;
        let mut source = self.0.source();
        while let Some(error) = source {
            write!(f, ": {error}")?;
            source = error.source();
        }
        Ok(())
    }
}

/// Store operations, as the `operation` label.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Op {
    Acquire,
    Renew,
    Release,
}

impl Op {
    #[cfg_attr(not(feature = "metrics"), allow(dead_code))]
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::Acquire => "acquire",
            Self::Renew => "renew",
            Self::Release => "release",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_a_subscriber_a_lease_has_no_span() {
        // This test binary has tracing's `log` feature on (axum's default features turn it
        // on), as most applications do: a disabled span would still carry its metadata and
        // forward every enter, exit and record to the `log` facade.
        let key = LockKey::new("lock:", "orders", b"42", 512).unwrap();
        for display in [KeyDisplay::Hashed, KeyDisplay::Plain, KeyDisplay::Hidden] {
            assert!(span(&key, 1, display).is_none());
        }
    }
}
