//! Batched renewals: the renewals of one locker that fall due within a short window go to the
//! store together (in one call where the store batches renewals: see
//! [`Capabilities`](crate::store::Capabilities)), so a process holding
//! thousands of leases renews them in a few round trips instead of one each.

use std::{
    fmt,
    sync::{Arc, OnceLock},
    time::Duration,
};

use tokio::{
    runtime::Handle,
    sync::{mpsc, oneshot},
    time::sleep,
};

use crate::{
    key::LockKey,
    store::{Backend, BoxFuture, StoreError, StoreErrorKind},
    token::Token,
};

/// How long the first renewal of a batch waits for others. Small against any renewal interval
/// (the lease's validity is counted from before the wait, so it only errs on the safe side).
const WINDOW: Duration = Duration::from_millis(2);

/// The most renewals sent in one round trip.
const MAX_BATCH: usize = 512;

struct Job {
    key: LockKey,
    token: Token,
    ttl: Duration,
    reply: oneshot::Sender<Result<bool, StoreError>>,
}

/// Collects renewals for one store; a task started at the first renewal sends them in batches,
/// and ends when the last handle is dropped.
pub(crate) struct RenewalBatcher {
    store: Arc<Backend>,
    jobs: OnceLock<mpsc::UnboundedSender<Job>>,
}

impl RenewalBatcher {
    pub(crate) fn new(store: Arc<Backend>) -> Self {
        Self {
            store,
            jobs: OnceLock::new(),
        }
    }

    /// Renews one lease, in the next batch. Without a Tokio runtime to run the batcher on, the
    /// renewal goes to the store on its own.
    pub(crate) fn renew(
        &self,
        key: LockKey,
        token: Token,
        ttl: Duration,
    ) -> BoxFuture<Result<bool, StoreError>> {
        let jobs = match self.jobs.get() {
            Some(jobs) => jobs,
            None => match Handle::try_current() {
                Ok(handle) => self.jobs.get_or_init(|| {
                    let (tx, rx) = mpsc::unbounded_channel();
                    handle.spawn(run(Arc::clone(&self.store), rx));
                    tx
                }),
                Err(_) => return self.store.renew(key, token, ttl),
            },
        };
        let (reply, answer) = oneshot::channel();
        let job = Job {
            key,
            token,
            ttl,
            reply,
        };
        if let Err(mpsc::error::SendError(job)) = jobs.send(job) {
            return self.store.renew(job.key, job.token, job.ttl);
        }
        Box::pin(async move {
            answer.await.unwrap_or_else(|_| {
                Err(StoreError::msg(
                    StoreErrorKind::Unavailable,
                    "the renewal batcher stopped before answering",
                ))
            })
        })
    }
}

impl fmt::Debug for RenewalBatcher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RenewalBatcher")
            .field("started", &self.jobs.get().is_some())
            .finish()
    }
}

async fn run(store: Arc<Backend>, mut jobs: mpsc::UnboundedReceiver<Job>) {
    while let Some(first) = jobs.recv().await {
        let mut batch = vec![first];
        let window = sleep(WINDOW);
        tokio::pin!(window);
        while batch.len() < MAX_BATCH {
            tokio::select! {
                biased;
                job = jobs.recv() => match job {
                    Some(job) => batch.push(job),
                    None => break,
                },
                () = &mut window => break,
            }
        }
        // Sent from a task of its own, so the next batch collects while this one is in flight.
        tokio::spawn(send(Arc::clone(&store), batch));
    }
}

async fn send(store: Arc<Backend>, mut batch: Vec<Job>) {
    // One locker renews with one TTL, but keep the contract: one store call per TTL.
    while let Some(ttl) = batch.first().map(|job| job.ttl) {
        let (same, rest): (Vec<Job>, Vec<Job>) = batch.into_iter().partition(|j| j.ttl == ttl);
        batch = rest;
        let leases = same
            .iter()
            .map(|job| (job.key.clone(), job.token.clone()))
            .collect();
        let answers = store.renew_many(leases, ttl).await;
        for (job, answer) in same.into_iter().zip(answers) {
            // A renewer that gave up (timed out, or its request ended) no longer listens.
            let _ = job.reply.send(answer);
        }
    }
}
