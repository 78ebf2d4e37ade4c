//! Metrics (through the `metrics` facade, feature `metrics`) and log helpers.
//!
//! Every function is a no-op without the feature. Labels are bounded: the key's scope label
//! (method and route template, or namespace; a method outside the standard set shows as
//! `_OTHER`, see [`LockKey::scope_label`]), an operation or outcome name; never the key's value.

use std::{
    error::Error,
    fmt,
    hash::{BuildHasher, RandomState},
    sync::OnceLock,
    time::Duration,
};

use tracing::{Span, field::Empty};

use crate::{config::KeyDisplay, key::LockKey};

/// The `lock` span of one locked request or background lease.
///
/// Fields: `scope` (its label: a method outside the standard set shows as `_OTHER`, and then
/// `method_original` holds it), `key` (per [`KeyDisplay`]), and, recorded as they become known,
/// `fencing_token`, `attempts`, `wait_ms`, `renewals`, `hold_ms`, `outcome`. Never the token.
pub(crate) fn span(key: &LockKey, display: KeyDisplay) -> Span {
    let span = tracing::info_span!(
        "lock",
        scope = &*key.scope_label(),
        method_original = key.other_method(),
        key = Empty,
        outcome = Empty,
        fencing_token = Empty,
        attempts = Empty,
        wait_ms = Empty,
        renewals = Empty,
        hold_ms = Empty,
    );
    if !span.is_disabled() {
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
    }
    span
}

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// Records an acquisition on the current span.
pub(crate) fn record_acquired(fencing_token: u64, attempts: u32, waited: Duration) {
    let span = Span::current();
    span.record("fencing_token", fencing_token);
    span.record("attempts", attempts);
    span.record("wait_ms", ms(waited));
}

/// The span's `outcome` for a request that did not get its lease.
pub(crate) fn outcome(error: &crate::LockError) -> &'static str {
    match error {
        crate::LockError::Contended { .. } => "contended",
        crate::LockError::Store(_) => "store_error",
        crate::LockError::LeaseLost(_) => "lease_lost",
        crate::LockError::Key(_) => "bad_key",
    }
}

/// Records the end of a lease on the current span.
pub(crate) fn record_end(outcome: &'static str, lease: Option<&crate::Lease>) {
    let span = Span::current();
    span.record("outcome", outcome);
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
    fn name(self) -> &'static str {
        match self {
            Self::Acquire => "acquire",
            Self::Renew => "renew",
            Self::Release => "release",
        }
    }
}

#[cfg(feature = "metrics")]
mod imp {
    use super::*;
    use metrics::{counter, gauge, histogram};

    pub(crate) fn round_trip(op: Op, took: Duration) {
        histogram!("tower_lock_store_round_trip_seconds", "operation" => op.name()).record(took);
    }

    pub(crate) fn acquired(scope: &str, waited: Duration) {
        counter!("tower_lock_acquired_total", "scope" => scope.to_owned()).increment(1);
        histogram!("tower_lock_wait_seconds", "scope" => scope.to_owned(), "outcome" => "acquired")
            .record(waited);
        gauge!("tower_lock_leases_held", "scope" => scope.to_owned()).increment(1.0);
    }

    pub(crate) fn contended(scope: &str, waited: Duration) {
        counter!("tower_lock_contended_total", "scope" => scope.to_owned()).increment(1);
        histogram!("tower_lock_wait_seconds", "scope" => scope.to_owned(), "outcome" => "contended")
            .record(waited);
    }

    pub(crate) fn store_error(scope: &str, op: Op) {
        counter!(
            "tower_lock_store_errors_total",
            "scope" => scope.to_owned(),
            "operation" => op.name()
        )
        .increment(1);
    }

    pub(crate) fn renewal(scope: &str, ok: bool) {
        let result = if ok { "ok" } else { "failed" };
        counter!("tower_lock_renewals_total", "scope" => scope.to_owned(), "result" => result)
            .increment(1);
    }

    pub(crate) fn lost(scope: &str, reason: &'static str) {
        counter!("tower_lock_leases_lost_total", "scope" => scope.to_owned(), "reason" => reason)
            .increment(1);
    }

    pub(crate) fn released(scope: &str, result: Result<bool, ()>, held: Duration) {
        match result {
            Ok(true) => {
                counter!("tower_lock_released_total", "scope" => scope.to_owned()).increment(1)
            }
            // The key was no longer ours (the lease was lost or expired): nothing to count.
            Ok(false) => {}
            Err(()) => counter!("tower_lock_release_errors_total", "scope" => scope.to_owned())
                .increment(1),
        }
        histogram!("tower_lock_hold_seconds", "scope" => scope.to_owned()).record(held);
        gauge!("tower_lock_leases_held", "scope" => scope.to_owned()).decrement(1.0);
    }
}

#[cfg(not(feature = "metrics"))]
#[allow(clippy::missing_const_for_fn)]
mod imp {
    use super::*;

    pub(crate) fn round_trip(_: Op, _: Duration) {}
    pub(crate) fn acquired(_: &str, _: Duration) {}
    pub(crate) fn contended(_: &str, _: Duration) {}
    pub(crate) fn store_error(_: &str, _: Op) {}
    pub(crate) fn renewal(_: &str, _: bool) {}
    pub(crate) fn lost(_: &str, _: &'static str) {}
    pub(crate) fn released(_: &str, _: Result<bool, ()>, _: Duration) {}
}

pub(crate) use imp::*;
