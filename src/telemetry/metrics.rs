//! Counters, histograms and a gauge through the `metrics` facade (feature `metrics`); no-ops
//! without it. Labels are bounded: the scope label, an operation, result or reason name.

#[cfg(feature = "metrics")]
mod imp {
    use std::time::Duration;

    use metrics::{counter, gauge, histogram};

    use super::super::Op;

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
    use std::time::Duration;

    use super::super::Op;

    pub(crate) fn round_trip(_: Op, _: Duration) {}
    pub(crate) fn acquired(_: &str, _: Duration) {}
    pub(crate) fn contended(_: &str, _: Duration) {}
    pub(crate) fn store_error(_: &str, _: Op) {}
    pub(crate) fn renewal(_: &str, _: bool) {}
    pub(crate) fn lost(_: &str, _: &'static str) {}
    pub(crate) fn released(_: &str, _: Result<bool, ()>, _: Duration) {}
}

pub(crate) use self::imp::*;
