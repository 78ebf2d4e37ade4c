//! Re-entry: the leases the current task holds, so that a nested acquire of a key it holds
//! returns at once with a lease on the same hold, rather than waiting for itself.
//!
//! A task-local, set by the lock and idempotency layers around every poll of the inner
//! service's future (its handler) and by [`Acquiring::run`](super::Acquiring::run) around its work: a nested
//! [`Locker::acquire`](super::Locker::acquire) in that task (in the handler, or anything it
//! awaits) finds the held lease there, if it was taken on the same store (or a clone of it:
//! the same bytes on another store are another lock). What a task spawns runs in another task,
//! without it: a spawned acquire of a held key waits for the holder like any other request.
//!
//! A nested acquire that asks for more of a held key than its task holds (that key with
//! others, more weight, or exclusive over shared) could only wait for itself: it fails at once
//! with a [`ConfigError`](crate::ConfigError) instead.

use std::{future::Future, sync::Arc};

use tokio::task::futures::TaskLocalFuture;

use crate::{
    key::{KeySet, LockKey},
    lease::Lease,
    store::StoreId,
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
    /// The store it was taken on ([`Backend::identity`](crate::store::Backend::identity)).
    store: StoreId,
    outer: Option<Held>,
}

impl Held {
    /// `lease`, taken on `store`, held by the current task within whatever it holds already.
    pub(crate) fn within_current(lease: Lease, store: StoreId) -> Self {
        let outer = HELD.try_with(Clone::clone).ok();
        Self(Arc::new(Node {
            lease,
            store,
            outer,
        }))
    }

    /// `fut`, run with this as what its task holds.
    pub(crate) fn scope<F: Future>(self, fut: F) -> TaskLocalFuture<Held, F> {
        HELD.scope(self, fut)
    }

    /// Every lease held, innermost first, with its store.
    fn leases(&self) -> impl Iterator<Item = (&Lease, StoreId)> {
        std::iter::successors(Some(&*self.0), |node| node.outer.as_ref().map(|h| &*h.0))
            .map(|node| (&node.lease, node.store))
    }
}

/// What the current task holds of a request for `keys` on `store`.
#[derive(Debug)]
pub(crate) enum Reentry {
    /// A lease it holds covers every key as asked: the nested acquire shares its hold.
    Covered(Lease),
    /// It holds one of the keys in a way that the request could only wait for.
    Blocked,
    /// Nothing it holds on that store stands in the way.
    Fresh,
}

/// The lease the current task holds on `store` that covers every key of `keys` as asked (a
/// held plain or exclusive key covers anything; a held share, a request for no more weight),
/// if any and not lost; else whether one it holds would block the request.
pub(crate) fn reentry(keys: &KeySet, store: StoreId) -> Reentry {
    HELD.try_with(|held| {
        let mut blocked = false;
        for (lease, _) in held.leases().filter(|(l, s)| *s == store && !l.is_lost()) {
            if keys.iter().all(|key| covers(lease.keys(), key)) {
                return Reentry::Covered(lease.clone());
            }
            blocked |= keys.iter().any(|key| blocks(lease.keys(), key));
        }
        if blocked {
            Reentry::Blocked
        } else {
            Reentry::Fresh
        }
    })
    .unwrap_or(Reentry::Fresh)
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

/// Whether holding `held` keeps `key` from being granted as it asks, for as long as it is held
/// (what a request not [covered](covers) would have to wait for: its own holder).
fn blocks(held: &KeySet, key: &LockKey) -> bool {
    let Some(mine) = held.position(key).map(|i| &held.as_slice()[i]) else {
        return false;
    };
    match (mine.share(), key.share()) {
        (Some(mine), Some(asked)) if !mine.is_exclusive() => {
            u64::from(mine.weight()) + u64::from(asked.weight()) > u64::from(mine.capacity())
        }
        _ => true,
    }
}
