//! How a locked request or lease ended: the span's `outcome` field, one vocabulary for
//! `LockLayer`, `IdempotencyLayer` and `Locker`.

use crate::error::LockError;

/// The `outcome` a `lock` span closes with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// The handler finished under its lease.
    Completed,
    /// The handler finished, but the lease was lost while it ran (`OnLeaseLost::Continue`).
    CompletedLeaseLost,
    /// The inner service returned an error.
    Failed,
    /// The lease was lost and the request aborted.
    LeaseLost,
    /// The request or guard was dropped while it held (or was acquiring) the lease.
    Dropped,
    /// A background lease released by its holder.
    Released,
    /// The wait ran out while someone else held the key.
    Contended,
    /// The store failed or did not answer.
    StoreError,
    /// The key could not be derived from the request.
    BadKey,
    /// The request could not be read (its body).
    BadRequest,
    /// The handler ran and its response was recorded for replay.
    Stored,
    /// The handler ran and its response was not recorded (a retry runs it again).
    NotStored,
    /// A recorded response was replayed.
    Replayed,
    /// The key was reused for a different request (422).
    KeyReused,
}

impl Outcome {
    /// The outcome of a request that did not get its lease, or lost it.
    pub(crate) fn of(error: &LockError) -> Self {
        match error {
            LockError::Contended { .. } => Self::Contended,
            LockError::Store(_) => Self::StoreError,
            LockError::LeaseLost(_) => Self::LeaseLost,
            LockError::Key(_) => Self::BadKey,
        }
    }

    /// The span field's value.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::Completed => "completed",
            Self::CompletedLeaseLost => "completed_lease_lost",
            Self::Failed => "failed",
            Self::LeaseLost => "lease_lost",
            Self::Dropped => "dropped",
            Self::Released => "released",
            Self::Contended => "contended",
            Self::StoreError => "store_error",
            Self::BadKey => "bad_key",
            Self::BadRequest => "bad_request",
            Self::Stored => "stored",
            Self::NotStored => "not_stored",
            Self::Replayed => "replayed",
            Self::KeyReused => "key_reused",
        }
    }
}
