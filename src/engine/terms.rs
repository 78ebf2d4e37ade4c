//! [`Terms`]: what one acquisition asks for: the locker's settings, or the call's own.

use std::time::Duration;

use crate::{
    config::{LockConfig, OnLeaseLost},
    wait::Wait,
};

/// The TTL, renewal interval, wait policy and longest hold of one acquisition, and what a loss
/// of its lease does to the holder's work.
#[derive(Debug, Clone)]
pub(crate) struct Terms {
    pub(crate) ttl: Duration,
    pub(crate) interval: Duration,
    /// `None`: the config's.
    wait: Option<Wait>,
    pub(crate) max_hold: Option<Duration>,
    /// A layer's [`OnLeaseLost`]; a `Locker`'s work is always aborted.
    pub(crate) on_lost: OnLeaseLost,
}

impl Terms {
    /// The config's terms, held at most `max_hold` (`None`: as long as the holder likes).
    pub(crate) fn of(config: &LockConfig, max_hold: Option<Duration>) -> Self {
        Self {
            ttl: config.ttl(),
            interval: config.renew_interval(),
            wait: None,
            max_hold,
            on_lost: OnLeaseLost::Abort,
        }
    }

    /// With a layer's policy for a lost lease.
    pub(crate) fn with_on_lost(mut self, on_lost: OnLeaseLost) -> Self {
        self.on_lost = on_lost;
        self
    }

    /// With a TTL of its own (checked by its setter: `check_ttl`), renewed every third of it.
    pub(crate) fn with_ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self.interval = self.ttl / 3;
        self
    }

    /// With a wait policy of its own.
    pub(crate) fn with_wait(mut self, wait: Wait) -> Self {
        self.wait = Some(wait);
        self
    }

    /// The wait policy: the call's, or `config`'s.
    pub(crate) fn wait<'a>(&'a self, config: &'a LockConfig) -> &'a Wait {
        self.wait.as_ref().unwrap_or(config.wait())
    }
}
