//! The capabilities of a store that routes each call to another store it picks per call
//! (`SentinelStore`, which follows the master Sentinel names): [`Route`], and
//! [`Capabilities::routed`], which forwards each capability of the store calls go to now and
//! sends a call once more after a failover the route followed.

use std::{sync::Arc, time::Duration};

use bytes::Bytes;

use super::{
    AcquireSet, Attempt, BoxFuture, Capabilities, Completed, Epoch, HandOff, QueueWatch, Records,
    ReleaseNotice, ReleaseNotices, SetAttempt, StoreError, fenced::FencedWrites,
};
use crate::{
    key::{KeySet, LockKey},
    token::Token,
};

/// A store that sends each call to a store it picks per call, and may send a failed call once
/// more to another: `SentinelStore`, which follows the master Sentinel names.
/// [`Capabilities::routed`] turns it into the capabilities of whatever store it routes to, so
/// that such a wrapper keeps every capability of the stores it wraps by this one mechanism.
pub(crate) trait Route: Send + Sync + 'static {
    /// Where a call goes.
    type Target: Send + Sync + 'static;

    /// Where calls go now.
    fn current(&self) -> Self::Target;

    /// The capabilities of `target`.
    fn capabilities(target: &Self::Target) -> &Capabilities;

    /// After a call sent to `failed` ended in `error`: where to send it once more, if the route
    /// moved on (a failover), else `None`.
    fn after(&self, failed: &Self::Target, error: &StoreError) -> BoxFuture<Option<Self::Target>>;
}

impl Capabilities {
    /// The capabilities of the stores `route` sends calls to: each present when the store
    /// calls go to now has it, each call sent once more after a failover the route followed.
    pub(crate) fn routed<R: Route>(route: Arc<R>) -> Self {
        let now = route.current();
        let now = R::capabilities(&now);
        let routed = Arc::new(Routed(route));
        // Every field, so that a capability added to the crate cannot be left unrouted.
        Self {
            group_commit: now.group_commit,
            counts: now.counts,
            hand_off: now
                .hand_off
                .is_some()
                .then(|| Arc::clone(&routed) as Arc<dyn HandOff>),
            release_notices: now
                .release_notices
                .is_some()
                .then(|| Arc::clone(&routed) as Arc<dyn ReleaseNotices>),
            records: now
                .records
                .is_some()
                .then(|| Arc::clone(&routed) as Arc<dyn Records>),
            key_sets: now
                .key_sets
                .is_some()
                .then(|| Arc::clone(&routed) as Arc<dyn AcquireSet>),
            fenced: now
                .fenced
                .is_some()
                .then_some(routed as Arc<dyn FencedWrites>),
            // The routing store's own: its targets change.
            identity: None,
        }
    }
}

/// [`Capabilities::routed`]'s implementation of every capability.
struct Routed<R>(Arc<R>);

impl<R: Route> Routed<R> {
    /// Runs `call` with the capability `pick` chooses on the current target; after an error
    /// `failed` finds in its answer, once more on the target the route moved on to.
    async fn run<C: ?Sized, T>(
        &self,
        pick: impl Fn(&Capabilities) -> Option<&Arc<C>>,
        call: impl Fn(Arc<C>) -> BoxFuture<T>,
        failed: impl Fn(&T) -> Option<StoreError>,
        missing: impl FnOnce() -> T,
    ) -> T {
        let target = self.0.current();
        let Some(cap) = pick(R::capabilities(&target)).cloned() else {
            return missing();
        };
        let answer = call(cap).await;
        let Some(error) = failed(&answer) else {
            return answer;
        };
        let Some(next) = self.0.after(&target, &error).await else {
            return answer;
        };
        match pick(R::capabilities(&next)).cloned() {
            Some(cap) => call(cap).await,
            None => answer,
        }
    }
}

/// The error of a call that failed, to send it once more.
fn error_of<T>(answer: &Result<T, StoreError>) -> Option<StoreError> {
    answer.as_ref().err().cloned()
}

fn missing(what: &str) -> StoreError {
    StoreError::msg(
        super::StoreErrorKind::Backend,
        format!("the store this call was routed to cannot {what}"),
    )
}

impl<R: Route> HandOff for Routed<R> {
    fn enqueue(
        self: Arc<Self>,
        key: LockKey,
        token: Token,
        ttl: Duration,
    ) -> BoxFuture<Result<Attempt, StoreError>> {
        Box::pin(async move {
            self.run(
                |caps| caps.hand_off.as_ref(),
                |hand_off| hand_off.enqueue(key.clone(), token.clone(), ttl),
                error_of,
                || Err(missing("hand off")),
            )
            .await
        })
    }

    fn queue_watch(&self, key: &LockKey, token: &Token, since: Epoch) -> Option<QueueWatch> {
        let target = self.0.current();
        R::capabilities(&target)
            .hand_off
            .as_ref()?
            .queue_watch(key, token, since)
    }
}

impl<R: Route> ReleaseNotices for Routed<R> {
    fn watch(&self, key: &LockKey) -> ReleaseNotice {
        let target = self.0.current();
        match &R::capabilities(&target).release_notices {
            Some(notices) => notices.watch(key),
            None => ReleaseNotice::new(std::future::pending()),
        }
    }
}

impl<R: Route> Records for Routed<R> {
    fn lookup(self: Arc<Self>, key: LockKey) -> BoxFuture<Result<Option<Bytes>, StoreError>> {
        Box::pin(async move {
            self.run(
                |caps| caps.records.as_ref(),
                |records| records.lookup(key.clone()),
                error_of,
                || Err(missing("keep records")),
            )
            .await
        })
    }

    fn complete(
        self: Arc<Self>,
        key: LockKey,
        token: Token,
        fencing_token: u64,
        record: Bytes,
        retention: Duration,
    ) -> BoxFuture<Result<Completed, StoreError>> {
        Box::pin(async move {
            self.run(
                |caps| caps.records.as_ref(),
                |records| {
                    let (key, token, record) = (key.clone(), token.clone(), record.clone());
                    records.complete(key, token, fencing_token, record, retention)
                },
                error_of,
                || Err(missing("keep records")),
            )
            .await
        })
    }
}

impl<R: Route> AcquireSet for Routed<R> {
    fn acquire_set(
        self: Arc<Self>,
        keys: KeySet,
        token: Token,
        ttl: Duration,
        wait: bool,
    ) -> BoxFuture<Result<SetAttempt, StoreError>> {
        Box::pin(async move {
            self.run(
                |caps| caps.key_sets.as_ref(),
                |sets| sets.acquire_set(keys.clone(), token.clone(), ttl, wait),
                error_of,
                || Err(missing("take sets of keys")),
            )
            .await
        })
    }

    fn release_set(
        self: Arc<Self>,
        keys: KeySet,
        token: Token,
    ) -> BoxFuture<Result<bool, StoreError>> {
        Box::pin(async move {
            self.run(
                |caps| caps.key_sets.as_ref(),
                |sets| sets.release_set(keys.clone(), token.clone()),
                error_of,
                || Err(missing("take sets of keys")),
            )
            .await
        })
    }
}

/// Sent to the current target only, never again after a failover: a batch whose answer was
/// lost may have been applied, and a second run would apply its counters and appends twice.
impl<R: Route> FencedWrites for Routed<R> {
    fn apply(
        self: Arc<Self>,
        plan: super::fenced::Plan,
    ) -> BoxFuture<Result<super::fenced::Applied, StoreError>> {
        Box::pin(async move {
            self.run(
                |caps| caps.fenced.as_ref(),
                |fenced| fenced.apply(plan.clone()),
                |_| None,
                || Err(missing("write fenced data")),
            )
            .await
        })
    }
}
