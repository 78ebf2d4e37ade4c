//! The acquire script, and the hand-off queue it keeps: one attempt, that queues a caller that
//! will wait (the hand-off capability).

use std::{sync::Arc, time::Duration};

use super::{
    RedisStore, handoff,
    wire::{self, Op, Place},
};
use crate::{
    key::LockKey,
    store::{
        Acquire, Attempt, BoxFuture, Epoch, HandOff, LockStore, QueueWatch, StoreError,
        StoreErrorKind,
    },
    token::Token,
};

impl RedisStore {
    /// One acquire script. With hand-off on, `place` queues the caller (`None`: do not queue);
    /// `since` is the hand-off's epoch read before it (see [`Epoch`]).
    pub(super) async fn attempt(
        &self,
        key: &LockKey,
        token: &Token,
        ttl: Duration,
        place: Option<Place>,
        since: Epoch,
    ) -> Result<Answer, StoreError> {
        let op = Op::Acquire {
            key: key.clone(),
            token: token.clone(),
            ttl,
            place: place.filter(|_| self.handoff.is_some()),
        };
        let wire::Answer {
            code: answer,
            n,
            acks,
        } = self.submit(op).await?;
        if answer == 1
            && let Err(error) = self.check_acks(acks)
        {
            // Not replicated enough to survive a failover: give it back, report the failure.
            if let Err(release) = self.release(key, token).await {
                tracing::warn!(
                    error = &release as &dyn std::error::Error,
                    "releasing an unreplicated lease failed; it expires with its TTL"
                );
            }
            return Err(error);
        }
        // PTTL is -1 for a key without expiry and -2 for a key that just vanished.
        let expires_in = u64::try_from(n).ok().map(Duration::from_millis);
        Ok(match answer {
            ACQUIRED => Answer::Attempt(Attempt::Acquired {
                fencing_token: u64::try_from(n).unwrap_or(0),
            }),
            QUEUED => Answer::Attempt(Attempt::Queued { expires_in, since }),
            UNHEARD => Answer::Unheard { expires_in },
            HELD => Answer::Attempt(Attempt::Contended { expires_in }),
            code => {
                return Err(StoreError::msg(
                    StoreErrorKind::Backend,
                    format!("the acquire script answered {code}, which no version of it does"),
                ));
            }
        })
    }
}

// What an acquire answers (`acquire` in `scripts/acquire.lua`, `counted_acquire` in
// `scripts/counted.lua`), with a number: a fencing token, or the ms the holder has left.
/// Held by another holder, the caller not queued.
const HELD: i64 = 0;
/// Acquired; the number is the fencing token.
const ACQUIRED: i64 = 1;
/// Held, and the caller is queued for the hand-off.
const QUEUED: i64 = 2;
/// Held, and the caller not queued: nobody listens on its channel on this server.
const UNHEARD: i64 = 3;

/// What an acquire script answered.
pub(super) enum Answer {
    Attempt(Attempt),
    /// Held, and the caller not queued: nobody is subscribed to its channel on this server.
    Unheard {
        expires_in: Option<Duration>,
    },
}

impl Answer {
    /// The answer to a caller that does not wait.
    pub(super) fn into_acquire(self) -> Acquire {
        match self {
            Self::Attempt(Attempt::Acquired { fencing_token }) => {
                Acquire::Acquired { fencing_token }
            }
            Self::Attempt(
                Attempt::Contended { expires_in } | Attempt::Queued { expires_in, .. },
            )
            | Self::Unheard { expires_in } => Acquire::Contended { expires_in },
        }
    }
}

impl RedisStore {
    /// Queues a caller that will wait (see [`HandOff::enqueue`]).
    async fn enqueue_now(
        &self,
        key: &LockKey,
        token: &Token,
        ttl: Duration,
    ) -> Result<Attempt, StoreError> {
        let Some(handoff) = &self.handoff else {
            return Ok(self
                .attempt(key, token, ttl, None, Epoch::default())
                .await?
                .into_acquire()
                .into());
        };
        let mut resubscribed = false;
        loop {
            // Read first: any change of course of the signals after this one, the waiter hears
            // of when it registers.
            let since = handoff.epoch();
            // Queued only while this store listens: otherwise nobody would hear the hand-off.
            // (`ready` starts the subscriber again if its runtime shut down.)
            let place = handoff.ready().await.then(|| Place {
                stamp: handoff::stamp(),
                channel: handoff.channel_arc(),
                rescan: handoff.is_registered(token),
            });
            match self.attempt(key, token, ttl, place, since).await? {
                Answer::Attempt(answer) => return Ok(answer),
                // The subscription is up, but not on this server: on the one the store's
                // address named before (a failover, a virtual IP or DNS name that moved).
                // Subscribe again, and once that is up, try once more.
                Answer::Unheard { expires_in } => {
                    if resubscribed || !handoff.resubscribe() {
                        return Ok(Attempt::Contended { expires_in });
                    }
                    resubscribed = true;
                }
            }
        }
    }
}

/// The hand-off queue: stores made by [`RedisStore::connect`] (unless turned off), and
/// `SentinelStore`'s masters.
impl HandOff for RedisStore {
    fn enqueue(
        self: Arc<Self>,
        key: LockKey,
        token: Token,
        ttl: Duration,
    ) -> BoxFuture<Result<Attempt, StoreError>> {
        Box::pin(async move { self.enqueue_now(&key, &token, ttl).await })
    }

    fn queue_watch(&self, _key: &LockKey, token: &Token, since: Epoch) -> Option<QueueWatch> {
        // With replica acknowledgement, a handed-over key is confirmed (and acknowledged)
        // before the waiter runs: the release that handed it over did not wait for replicas.
        self.handoff
            .as_ref()?
            .register(token, since, self.replicas.is_some())
    }
}
