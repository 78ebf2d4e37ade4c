//! Fenced writes as a store runs them: a plan of reads and writes, applied in one atomic step
//! only if each resource's fence allows it. The public face is [`crate::fence`]; this is the
//! part a store implements ([`FencedWrites`], a capability).

use std::{sync::Arc, time::Duration};

use bytes::Bytes;

use super::{BoxFuture, StoreError};

/// What one operation of an applied batch answered.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Reply {
    /// A read that found nothing (`get` of a missing key, `hget` of a missing field).
    Nil,
    /// A read's value.
    Data(Bytes),
    /// A number: the counter after `incr_by`, the list's length after `rpush`, how many keys
    /// `del` removed, how many fields `hset` added.
    Int(i64),
    /// A write with nothing to report (`set`).
    Done,
}

impl Reply {
    /// The value a read found, if any.
    pub fn data(&self) -> Option<&Bytes> {
        match self {
            Self::Data(data) => Some(data),
            _ => None,
        }
    }

    /// The number a write answered with, if any.
    pub fn int(&self) -> Option<i64> {
        match self {
            Self::Int(n) => Some(*n),
            _ => None,
        }
    }
}

/// One operation of a plan, on one data key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum DataOp {
    Get {
        key: Bytes,
    },
    HGet {
        key: Bytes,
        field: Bytes,
    },
    Set {
        key: Bytes,
        value: Bytes,
        /// The value's time to live; `None`: kept until written again.
        ttl: Option<Duration>,
    },
    Del {
        key: Bytes,
    },
    HSet {
        key: Bytes,
        field: Bytes,
        value: Bytes,
    },
    IncrBy {
        key: Bytes,
        delta: i64,
    },
    RPush {
        key: Bytes,
        value: Bytes,
    },
}

impl DataOp {
    pub(crate) fn key(&self) -> &Bytes {
        match self {
            Self::Get { key }
            | Self::HGet { key, .. }
            | Self::Set { key, .. }
            | Self::Del { key }
            | Self::HSet { key, .. }
            | Self::IncrBy { key, .. }
            | Self::RPush { key, .. } => key,
        }
    }

    /// Whether it changes the data (a batch of reads only raises a fence only where the
    /// resource has one, or the reads found something).
    pub(crate) fn writes(&self) -> bool {
        !matches!(self, Self::Get { .. } | Self::HGet { .. })
    }
}

/// A batch as a store applies it: each resource's fence key with the token that guards it,
/// then the operations, in order, and the fences' horizon.
#[derive(Debug, Clone, Default)]
pub(crate) struct Plan {
    pub(crate) fences: Vec<(Bytes, u64)>,
    pub(crate) ops: Vec<DataOp>,
    /// How long a fence is kept after the last batch that touched it (at least as long as the
    /// data a batch sets with a time to live), and how old a token a resource without a fence
    /// still admits (see [`crate::fence`], "Fences expire").
    pub(crate) horizon: Duration,
}

impl Plan {
    /// The longest time to live a `set` of the plan gives its value.
    pub(crate) fn longest_ttl(&self) -> Option<Duration> {
        self.ops
            .iter()
            .filter_map(|op| match op {
                DataOp::Set { ttl, .. } => *ttl,
                _ => None,
            })
            .max()
    }
}

/// What a fence outlives the last batch that touched it by, beyond its horizon: room for the
/// store's expiry to run late, and for tokens handed out a little ahead of the clock.
pub(crate) const FENCE_SLACK: Duration = Duration::from_secs(1);

/// What a store did with a plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Applied {
    /// Every operation applied, with its reply; each fence raised to its token (see
    /// [`FencedWrites::apply`]).
    Done(Vec<Reply>),
    /// The fence at `resource` (an index into the plan's fences) is higher than its token:
    /// nothing was applied.
    Stale { resource: usize, fence: u64 },
    /// An operation cannot apply (a key of another type, a counter that is not a whole number
    /// or would overflow), or the keys cannot go in one step (several hash slots where the
    /// server hashes keys to slots): nothing was applied.
    Invalid { reason: String },
}

/// Applies fenced batches, each in one atomic step.
pub(crate) trait FencedWrites: Send + Sync + 'static {
    /// Applies `plan` in one atomic step: when every fence's stored value is at most its token
    /// (a resource without a fence: when its token is no older than the horizon, see
    /// [`crate::fence`]), checks that every operation can apply, then applies them all and
    /// raises each fence to its token, if the plan writes, or the fence exists, or a read found
    /// something (a batch that only reads what does not exist leaves nothing behind); a fence
    /// so written expires a horizon (and [`FENCE_SLACK`]) after this batch, or when the
    /// longest-lived value it guards does, whichever is later. Otherwise changes nothing. A
    /// plan without fences (an unfenced batch) checks no token and raises no fence.
    fn apply(self: Arc<Self>, plan: Plan) -> BoxFuture<Result<Applied, StoreError>>;
}
