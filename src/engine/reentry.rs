//! Re-entry: the leases the current task holds, so that a nested acquire of a key it holds
//! returns at once with a lease on the same hold, rather than waiting for itself.
//!
//! A task-local, set by the lock layer around every poll of the inner service's future (its
//! handler) and by [`Acquiring::run`](super::Acquiring::run) around its work: a nested
//! [`Locker::acquire`](super::Locker::acquire) in that task (in the handler, or anything it
//! awaits) finds the held lease there. What a task spawns runs in another task, without it: a
//! spawned acquire of a held key waits for the holder like any other request.

use std::{future::Future, sync::Arc};

use tokio::task::futures::TaskLocalFuture;

use crate::{
    key::{KeySet, LockKey},
    lease::Lease,
};

tokio::task_local! {
    static HELD: Held;
}

/// The leases the current task holds, innermost first.
#[derive(Clone, Debug)]
pub(crate) struct Held(Arc<Node>);

#[derive(Debug)]
struct Node {
    lease: Lease,
    outer: Option<Held>,
}

impl Held {
    /// `lease`, held by the current task within whatever it holds already.
    pub(crate) fn within_current(lease: Lease) -> Self {
        let outer = HELD.try_with(Clone::clone).ok();
        Self(Arc::new(Node { lease, outer }))
    }

    /// `fut`, run with this as what its task holds.
    pub(crate) fn scope<F: Future>(self, fut: F) -> TaskLocalFuture<Held, F> {
        HELD.scope(self, fut)
    }

    /// Every lease held, innermost first.
    fn leases(&self) -> impl Iterator<Item = &Lease> {
        std::iter::successors(Some(&*self.0), |node| node.outer.as_ref().map(|h| &*h.0))
            .map(|node| &node.lease)
    }
}

/// The lease the current task holds that covers every key of `keys` as asked (a held plain or
/// exclusive key covers anything; a held share, a request for no more weight), if any, and not
/// lost.
pub(crate) fn held_covering(keys: &KeySet) -> Option<Lease> {
    HELD.try_with(|held| {
        held.leases()
            .find(|lease| !lease.is_lost() && keys.iter().all(|key| covers(lease.keys(), key)))
            .cloned()
    })
    .ok()
    .flatten()
}

/// Whether holding `held` covers taking `key` as it asks.
fn covers(held: &KeySet, key: &LockKey) -> bool {
    let Some(mine) = held.position(key).map(|i| &held.as_slice()[i]) else {
        return false;
    };
    match (mine.share(), key.share()) {
        (None, _) => true,
        (Some(mine), None) => mine.is_exclusive(),
        (Some(mine), Some(asked)) => mine.is_exclusive() || asked.weight() <= mine.weight(),
    }
}
