//! [`Batch`]: the reads and writes of one atomic, fenced step, and [`Replies`], their answers.

use std::{fmt, sync::Arc};

use bytes::Bytes;

use super::{FenceError, data::FencedData, fence_key, is_lock_namespace};
use crate::{
    key::LockKey,
    lease::Lease,
    store::fenced::{Applied, DataOp, Plan, Reply},
};

/// Reads and writes applied together in one atomic step, only if every resource's fence
/// allows it. Made by [`FencedData::batch`] (or `batch_on`, `unfenced_batch`); does nothing
/// until [`apply`](Self::apply)ed.
///
/// The operations run in the order they are added, and [`Replies`] answers each at the same
/// position. Before anything is written, every fence is checked, and every operation is
/// checked to apply (a key of the right type, a counter that is a whole number): a batch is
/// applied whole or not at all.
///
/// | operation | Redis | reply |
/// |---|---|---|
/// | [`get`](Self::get) | `GET` | [`Reply::Data`] or [`Reply::Nil`] |
/// | [`hget`](Self::hget) | `HGET` | [`Reply::Data`] or [`Reply::Nil`] |
/// | [`set`](Self::set) | `SET` | [`Reply::Done`] |
/// | [`set_with_ttl`](Self::set_with_ttl) | `SET PX` | [`Reply::Done`] |
/// | [`del`](Self::del) | `DEL` | [`Reply::Int`]: keys removed |
/// | [`hset`](Self::hset) | `HSET` | [`Reply::Int`]: fields added |
/// | [`incr_by`](Self::incr_by) | `INCRBY` | [`Reply::Int`]: the counter after it |
/// | [`rpush`](Self::rpush) | `RPUSH` | [`Reply::Int`]: the list's length after it |
#[must_use = "a batch does nothing until it is applied"]
pub struct Batch {
    data: FencedData,
    fences: Vec<(LockKey, u64)>,
    lease: Option<Lease>,
    ops: Vec<DataOp>,
    error: Option<Arc<str>>,
}

fn bytes(b: impl AsRef<[u8]>) -> Bytes {
    Bytes::copy_from_slice(b.as_ref())
}

impl Batch {
    pub(super) fn new(data: FencedData, fences: Vec<(LockKey, u64)>, lease: Option<Lease>) -> Self {
        Self {
            data,
            fences,
            lease,
            ops: Vec::new(),
            error: None,
        }
    }

    /// This batch, failing with `reason` when applied.
    pub(super) fn fail(mut self, reason: String) -> Self {
        self.error.get_or_insert(reason.into());
        self
    }

    fn op(mut self, op: DataOp) -> Self {
        self.ops.push(op);
        self
    }

    /// Reads a string value. A read under a fence raises the fence too (when the resource
    /// has one, or the value exists), so that an older holder that read before this one
    /// cannot write after it.
    pub fn get(self, key: impl AsRef<[u8]>) -> Self {
        self.op(DataOp::Get { key: bytes(key) })
    }

    /// Reads a field of a hash.
    pub fn hget(self, key: impl AsRef<[u8]>, field: impl AsRef<[u8]>) -> Self {
        self.op(DataOp::HGet {
            key: bytes(key),
            field: bytes(field),
        })
    }

    /// Sets a string value (whatever the key held before), kept until written again.
    pub fn set(self, key: impl AsRef<[u8]>, value: impl AsRef<[u8]>) -> Self {
        self.op(DataOp::Set {
            key: bytes(key),
            value: bytes(value),
            ttl: None,
        })
    }

    /// Sets a string value that expires after `ttl` (at least a millisecond, at most 365 days:
    /// `SET PX`). The batch's fences are kept at least as long, so that no value outlives the
    /// fence that guards it.
    pub fn set_with_ttl(
        self,
        key: impl AsRef<[u8]>,
        value: impl AsRef<[u8]>,
        ttl: std::time::Duration,
    ) -> Self {
        self.op(DataOp::Set {
            key: bytes(key),
            value: bytes(value),
            ttl: Some(ttl.clamp(
                std::time::Duration::from_millis(1),
                crate::config::MAX_DURATION,
            )),
        })
    }

    /// Deletes a key.
    pub fn del(self, key: impl AsRef<[u8]>) -> Self {
        self.op(DataOp::Del { key: bytes(key) })
    }

    /// Sets a field of a hash.
    pub fn hset(
        self,
        key: impl AsRef<[u8]>,
        field: impl AsRef<[u8]>,
        value: impl AsRef<[u8]>,
    ) -> Self {
        self.op(DataOp::HSet {
            key: bytes(key),
            field: bytes(field),
            value: bytes(value),
        })
    }

    /// Adds `delta` to a counter (a missing key counts as 0).
    pub fn incr_by(self, key: impl AsRef<[u8]>, delta: i64) -> Self {
        self.op(DataOp::IncrBy {
            key: bytes(key),
            delta,
        })
    }

    /// Appends a value to a list (a journal entry, say).
    pub fn rpush(self, key: impl AsRef<[u8]>, value: impl AsRef<[u8]>) -> Self {
        self.op(DataOp::RPush {
            key: bytes(key),
            value: bytes(value),
        })
    }

    /// Applies the batch: every operation, in one atomic step, or none.
    ///
    /// Fails with [`FenceError::Stale`] when a newer holder touched one of the batch's
    /// resources (nothing was applied), [`FenceError::Invalid`] when an operation cannot apply
    /// or names one of the lock's own keys (a lock key, its queue, record or fence, a fencing
    /// counter: nothing was applied), [`FenceError::Store`] when the store failed or did not
    /// answer within the handle's timeout (the batch may have been applied).
    ///
    /// From the moment a batch that writes is sent, the lease no longer aborts its holder when
    /// it is lost (see the [module docs](super#the-answer-tells-the-truth)).
    pub async fn apply(self) -> Result<Replies, FenceError> {
        if let Some(reason) = self.error {
            return Err(FenceError::Invalid(reason));
        }
        if let Some(i) = self.ops.iter().position(|op| {
            self.fences
                .iter()
                .any(|(resource, _)| is_lock_namespace(op.key(), resource))
        }) {
            return Err(FenceError::Invalid(
                format!(
                    "operation {} of the batch names one of the lock's own keys (a lock key, \
                     its queue, record or fence, or a fencing counter), not data: name data \
                     keys with another prefix than the lock keys'",
                    i + 1
                )
                .into(),
            ));
        }
        // A batch that writes may land from the moment it is sent: the holder is not aborted
        // from then on. One that only reads changes nothing a client could see.
        if let Some(lease) = &self.lease
            && self.ops.iter().any(DataOp::writes)
        {
            lease.mark_fenced();
        }
        let plan = Plan {
            fences: self
                .fences
                .iter()
                .map(|(key, token)| (fence_key(key), *token))
                .collect(),
            ops: self.ops,
            horizon: self.data.fence_horizon(),
        };
        let limit = self.data.batch_timeout();
        let applied =
            crate::background::bounded(limit, Arc::clone(self.data.backend()).apply(plan)).await?;
        match applied {
            Applied::Done(replies) => Ok(Replies(replies)),
            Applied::Stale { resource, fence } => {
                let (resource, fencing_token) = self
                    .fences
                    .into_iter()
                    .nth(resource)
                    .ok_or_else(|| FenceError::Invalid("the store named no resource".into()))?;
                if let Some(lease) = &self.lease {
                    lease.mark_refused();
                }
                tracing::debug!(
                    scope = resource.scope(),
                    fencing_token,
                    fence,
                    "fenced write refused: a newer holder touched the resource"
                );
                Err(FenceError::Stale {
                    resource,
                    fencing_token,
                    fence,
                })
            }
            Applied::Invalid { reason } => Err(FenceError::Invalid(reason.into())),
        }
    }
}

impl fmt::Debug for Batch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Batch")
            .field("fences", &self.fences)
            .field("operations", &self.ops.len())
            .finish()
    }
}

/// What each operation of an applied [`Batch`] answered, in the order they were added.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Replies(Vec<Reply>);

impl Replies {
    /// The reply of the operation at `index`.
    pub fn get(&self, index: usize) -> Option<&Reply> {
        self.0.get(index)
    }

    /// The value the read at `index` found: `None` when it found nothing (or is not a read).
    pub fn data(&self, index: usize) -> Option<&Bytes> {
        self.get(index)?.data()
    }

    /// The number the operation at `index` answered ([`Reply::Int`]).
    pub fn int(&self, index: usize) -> Option<i64> {
        self.get(index)?.int()
    }

    /// Every reply, in order.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = &Reply> + '_ {
        self.0.iter()
    }

    /// The number of replies: one per operation.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether the batch had no operations.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}
