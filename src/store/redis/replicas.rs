//! Replica acknowledgement: `WAIT numreplicas timeout` after each acquire and renewal.

use std::{fmt, time::Duration};

use super::RedisStore;
use crate::store::{StoreError, StoreErrorKind};

/// `WAIT numreplicas timeout` after each acquire and renewal.
#[derive(Debug, Clone, Copy)]
pub(super) struct ReplicaAcks {
    pub(super) replicas: usize,
    pub(super) timeout: Duration,
}

/// Too few replicas acknowledged a write within the `WAIT` timeout.
#[derive(Debug)]
struct TooFewReplicas {
    wanted: usize,
    acknowledged: i64,
    timeout: Duration,
}

impl fmt::Display for TooFewReplicas {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "WAIT: {} of {} replicas acknowledged within {:?}",
            self.acknowledged, self.wanted, self.timeout
        )
    }
}

impl std::error::Error for TooFewReplicas {}

impl RedisStore {
    /// Fails with a [`TooFewReplicas`] source when `WAIT` counted fewer than asked for.
    pub(super) fn check_acks(&self, acks: Option<i64>) -> Result<(), StoreError> {
        match (self.replicas, acks) {
            (Some(want), Some(got)) if got < i64::try_from(want.replicas).unwrap_or(i64::MAX) => {
                Err(StoreError::new(
                    StoreErrorKind::Unavailable,
                    "too few Redis replicas acknowledged the lease",
                    TooFewReplicas {
                        wanted: want.replicas,
                        acknowledged: got,
                        timeout: want.timeout,
                    },
                ))
            }
            _ => Ok(()),
        }
    }
}
