//! [`FencedData`]: where the data behind the locks lives, and the stores it can live in.

use std::{fmt, sync::Arc, time::Duration};

use super::{batch::Batch, memory::MemoryData};
use crate::{
    key::LockKey,
    lease::Lease,
    store::{LockStore, fenced::FencedWrites},
};

/// The default bound on one batch's round trip.
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(1);

/// The default horizon of a fence: a day, as long as the idempotency records of the same
/// requests are kept by default.
pub(super) const DEFAULT_HORIZON: Duration = Duration::from_secs(24 * 60 * 60);

/// A handle on the data a lock protects, written through fenced batches.
///
/// Made from a store of this crate that can apply a batch atomically ([`FencedStore`]: a
/// [`RedisStore`](crate::RedisStore), a `SentinelStore`'s master, a `ClusterStore` slot), or
/// in memory for one process ([`in_memory`](Self::in_memory)). The data may live on another
/// server than the locks: connect a store for it (`RedisStore::connect(data_url)`) and make
/// the handle from that. Cheap to clone; clones share the connection.
///
/// See the [module docs](super) for what a fence guarantees and an example.
#[derive(Clone)]
pub struct FencedData {
    backend: Arc<dyn FencedWrites>,
    timeout: Duration,
    horizon: Duration,
    kind: &'static str,
}

impl FencedData {
    /// Data kept in `store`'s server (or master, or cluster).
    pub fn new(store: impl FencedStore) -> Self {
        let backend = store
            .capabilities()
            .fenced
            .expect("every FencedStore applies fenced writes");
        Self {
            backend,
            timeout: DEFAULT_TIMEOUT,
            horizon: DEFAULT_HORIZON,
            kind: std::any::type_name_of_val(&store)
                .rsplit("::")
                .next()
                .unwrap_or("store"),
        }
    }

    /// Data kept in this process, with the same checks: for one instance, tests and demos.
    pub fn in_memory() -> Self {
        Self {
            backend: Arc::new(MemoryData::default()),
            timeout: DEFAULT_TIMEOUT,
            horizon: DEFAULT_HORIZON,
            kind: "memory",
        }
    }

    /// The longest a batch waits for its answer (default 1 s); then it fails with
    /// [`FenceError::Store`](super::FenceError::Store) (and may still land).
    #[must_use]
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// How long a fence outlives the last batch that touched it (default a day), and so how old
    /// a lease's token may be and still write a resource whose fence has expired.
    ///
    /// A fence is kept for the horizon after each batch that touches it (or as long as the
    /// longest-lived value a batch set with [`Batch::set_with_ttl`], if longer); then it
    /// expires, and the resource holds no key of the lock's. A batch on a resource without a
    /// fence refuses, as [`FenceError::Stale`](super::FenceError::Stale), every token older
    /// than the horizon (tokens follow the lock server's clock): so a holder paused for longer
    /// than the horizon is refused whether its resource's fence is still there or not, and
    /// never writes. The other side: a lease held for longer than the horizon, whose resource
    /// nobody touched for a whole horizon, is refused too. Keep the horizon above the longest
    /// a lease is held between two batches on one resource, and the same on every instance
    /// that writes the data (an instance with a longer horizon than the one that wrote a fence
    /// admits tokens the fence would have refused, for the difference).
    ///
    /// See the [module docs](super#fences-expire).
    ///
    /// # Errors
    ///
    /// A [`ConfigError`](crate::ConfigError) (setting `horizon`) for 0 (every batch would be
    /// refused as stale) or over 365 days (past any lease, and past what the store's expiries
    /// count: 365 days is the longest).
    pub fn horizon(mut self, horizon: Duration) -> Result<Self, crate::ConfigError> {
        if horizon.is_zero() {
            return Err(crate::ConfigError::new(
                "horizon",
                "a horizon of 0 would refuse every batch as stale",
            ));
        }
        crate::config::at_most_a_year("horizon", horizon)?;
        self.horizon = horizon;
        Ok(self)
    }

    /// A batch fenced by every key of `lease`, each with its own fencing token: applied only if
    /// no holder with a newer token of any of those keys has touched its resource since.
    ///
    /// For a lease on one key, that key's token guards the batch. For a lease on several (an
    /// order of several SKUs), the batch checks and raises every key's fence: use
    /// [`batch_on`](Self::batch_on) for a batch that touches only some of them.
    pub fn batch(&self, lease: &Lease) -> Batch {
        let fences = lease
            .fencing_tokens()
            .map(|(k, t)| (k.clone(), t))
            .collect();
        Batch::new(self.clone(), fences, Some(lease.clone()))
    }

    /// A batch fenced by the given keys of `lease` only, each with its own token. A key the
    /// lease does not hold, or no key at all, makes the batch fail with
    /// [`FenceError::Invalid`](super::FenceError::Invalid) when applied.
    pub fn batch_on<'a>(
        &self,
        lease: &Lease,
        resources: impl IntoIterator<Item = &'a LockKey>,
    ) -> Batch {
        let mut fences = Vec::new();
        let mut missing = None;
        for key in resources {
            match lease.fencing_token_of(key) {
                Some(token) => fences.push((key.clone(), token)),
                None => missing = Some(key.clone()),
            }
        }
        let empty = fences.is_empty();
        let batch = Batch::new(self.clone(), fences, Some(lease.clone()));
        match missing {
            Some(key) => batch.fail(format!(
                "the lease does not hold the lock key {key:?}, so it has no fencing token for it"
            )),
            // No resource, no fence: it would apply unchecked, as an unfenced batch.
            None if empty => batch.fail(
                "a fenced batch names no resource, so no token would check it; name at least \
                 one key of the lease (or use `unfenced_batch` for writes outside any lease)"
                    .to_owned(),
            ),
            None => batch,
        }
    }

    /// A batch applied atomically without any fence: it checks no token and raises no fence.
    ///
    /// For writes made outside any lease (an administrative reset, a migration), and for a
    /// demonstration of what fencing prevents. A holder's writes belong in
    /// [`batch`](Self::batch).
    pub fn unfenced_batch(&self) -> Batch {
        Batch::new(self.clone(), Vec::new(), None)
    }

    pub(super) fn backend(&self) -> &Arc<dyn FencedWrites> {
        &self.backend
    }

    pub(super) fn batch_timeout(&self) -> Duration {
        self.timeout
    }

    pub(super) fn fence_horizon(&self) -> Duration {
        self.horizon.min(crate::config::MAX_DURATION)
    }
}

impl fmt::Debug for FencedData {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FencedData")
            .field("store", &self.kind)
            .field("timeout", &self.timeout)
            .field("horizon", &self.horizon)
            .finish()
    }
}

/// A store that can keep fenced data: it checks every fence of a batch and applies the batch
/// in one atomic step.
///
/// Implemented for [`RedisStore`](crate::RedisStore) (one Lua script), `SentinelStore` (on the
/// master it follows; a batch is never sent again after a failover, since its first run may
/// have landed) and `ClusterStore` (a batch's keys must share one hash slot: see
/// [`data_key`](super::data_key)). Not for [`RedlockStore`](crate::store::RedlockStore): its masters
/// are independent, and no step is atomic across them; keep the data on one Redis (or a
/// Sentinel or cluster) and fence it with the Redlock lease's tokens. Sealed: the check and the
/// writes must be one step in the store, which only the crate's own scripts can promise.
pub trait FencedStore: LockStore + sealed::Sealed {}

#[allow(unreachable_pub)]
pub mod sealed {
    /// Keeps [`FencedStore`](super::FencedStore) to this crate's stores.
    pub trait Sealed {}
}

macro_rules! keeps_fenced_data {
    ($($(#[$attr:meta])* $store:ty,)*) => {
        $(
            $(#[$attr])*
            impl sealed::Sealed for $store {}
            $(#[$attr])*
            impl FencedStore for $store {}
        )*
    };
}

keeps_fenced_data! {
    #[cfg(feature = "redis")]
    crate::RedisStore,
    #[cfg(feature = "cluster")]
    crate::store::ClusterStore,
    #[cfg(feature = "sentinel")]
    crate::store::SentinelStore,
}
