//! The acquire script, and the hand-off queue it keeps: one attempt, that queues a caller that
//! will wait (the hand-off capability).

use std::{sync::Arc, time::Duration};

use super::{
    RedisStore, handoff,
    keys::{CompanionKeys, Ms, ms},
};
use crate::{
    key::LockKey,
    store::{Acquire, Attempt, BoxFuture, HandOff, LockStore, QueueWatch, StoreError},
    token::Token,
};

impl RedisStore {
    /// One acquire script. With hand-off on, `place` queues the caller (`None`: do not queue).
    pub(super) async fn attempt(
        &self,
        key: &LockKey,
        token: &Token,
        ttl: Duration,
        place: Option<Place<'_>>,
    ) -> Result<Answer, StoreError> {
        let companions = CompanionKeys::new(key);
        let handoff = self.handoff.is_some();
        let all_keys = [key.as_bytes(), companions.fence(), companions.queue()];
        let keys = if handoff {
            &all_keys[..]
        } else {
            &all_keys[..2]
        };
        let (ttl_ms, retention, claim) = (ms(ttl), ms(self.fence_retention), ms(self.claim_window));
        let all_args: [&[u8]; 7] = match &place {
            Some(place) => [
                token.as_bytes(),
                &ttl_ms,
                &retention,
                &claim,
                &place.stamp,
                place.channel,
                if place.rescan { b"1" } else { b"0" },
            ],
            None => [
                token.as_bytes(),
                &ttl_ms,
                &retention,
                &claim,
                b"",
                b"",
                b"0",
            ],
        };
        let args = if handoff {
            &all_args[..]
        } else {
            &all_args[..3]
        };
        let ((answer, n), acks): ((i64, i64), _) =
            self.invoke(&self.scripts.acquire, keys, args, true).await?;
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
            1 => Answer::Attempt(Attempt::Acquired {
                fencing_token: u64::try_from(n).unwrap_or(0),
            }),
            2 => Answer::Attempt(Attempt::Queued { expires_in }),
            3 => Answer::Unheard { expires_in },
            _ => Answer::Attempt(Attempt::Contended { expires_in }),
        })
    }

    /// The keys and arguments a lock script adds for the hand-off queue (none when off): the
    /// fencing counter and the queue; the claim window and the counter's retention.
    pub(super) fn handoff_keys(&self, key: &LockKey) -> Option<CompanionKeys> {
        self.handoff.as_ref()?;
        Some(CompanionKeys::new(key))
    }

    /// The arguments that go with [`handoff_keys`](Self::handoff_keys).
    pub(super) fn handoff_args(&self) -> [Ms; 2] {
        [ms(self.claim_window), ms(self.fence_retention)]
    }
}

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
            Self::Attempt(Attempt::Contended { expires_in } | Attempt::Queued { expires_in })
            | Self::Unheard { expires_in } => Acquire::Contended { expires_in },
        }
    }
}

/// Where a waiter joins a hand-off queue: its entry is its token, `stamp` and `channel`.
pub(super) struct Place<'a> {
    pub(super) stamp: [u8; 16],
    pub(super) channel: &'a [u8],
    /// A later attempt, which may find the waiter queued already.
    pub(super) rescan: bool,
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
                .attempt(key, token, ttl, None)
                .await?
                .into_acquire()
                .into());
        };
        let mut resubscribed = false;
        loop {
            // Queued only while this store listens: otherwise nobody would hear the hand-off.
            // (`ready` starts the subscriber again if its runtime shut down.)
            let place = handoff.ready().await.then(|| Place {
                stamp: handoff::stamp(),
                channel: handoff.channel().as_bytes(),
                rescan: handoff.is_registered(token),
            });
            match self.attempt(key, token, ttl, place).await? {
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

    fn queue_watch(&self, _key: &LockKey, token: &Token) -> Option<QueueWatch> {
        // With replica acknowledgement, a handed-over key is confirmed (and acknowledged)
        // before the waiter runs: the release that handed it over did not wait for replicas.
        self.handoff
            .as_ref()?
            .register(token, self.replicas.is_some())
    }
}
