//! Key sets: a lease's several keys taken and released in one script (`acquire_set.lua`,
//! `release_set.lua`); where the server hashes keys to slots (a cluster), one script per slot,
//! slot by slot in lock order, giving back the slots taken when one is held.
//!
//! With hand-off, a set that will wait is queued for the first key it cannot have, keeping the
//! keys before it in lock order (see `docs/DECISIONS.md`, "Sets of keys, and waiting for
//! them"); one script per slot never queues.

use std::{
    sync::{Arc, atomic::Ordering},
    time::Duration,
};

use futures_util::future::join_all;

use super::{
    RedisStore, handoff,
    keys::{CompanionKeys, ms},
    wire::{Place, is_cross_slot},
};
use crate::{
    key::{KeySet, LockKey},
    store::{AcquireSet, BoxFuture, Epoch, SetAttempt, StoreError, StoreErrorKind},
    token::Token,
};

/// What `acquire_set.lua` answered.
enum Answer {
    Acquired(Vec<u64>),
    /// Held (code 0), queued (2), or held and not queued because nobody listens here (3), at
    /// the key at `blocked` (from 0).
    Held {
        code: i64,
        expires_in: Option<Duration>,
        blocked: usize,
    },
}

/// Each key's weight and capacity, as the counted set scripts read them after their own
/// arguments (`0` and `0` for a plain key); `None` for a set of plain keys, which the plain
/// scripts take.
fn shares(keys: &[LockKey]) -> Option<Vec<String>> {
    keys.iter().any(|key| key.share().is_some()).then(|| {
        keys.iter()
            .flat_map(|key| key.share().map_or([0, 0], |s| [s.weight(), s.capacity()]))
            .map(|n| n.to_string())
            .collect()
    })
}

/// Each key, its fencing counter and, with `queues`, its hand-off queue: the keys of the set
/// scripts.
fn script_keys<'a>(
    keys: &'a [LockKey],
    companions: &'a [CompanionKeys],
    queues: bool,
) -> Vec<&'a [u8]> {
    let mut script_keys: Vec<&[u8]> = Vec::with_capacity(keys.len() * 3);
    for (key, companions) in keys.iter().zip(companions) {
        script_keys.push(key.as_bytes());
        script_keys.push(companions.fence());
        if queues {
            script_keys.push(companions.queue());
        }
    }
    script_keys
}

impl RedisStore {
    /// One `acquire_set.lua` over `keys` (the whole set, or the keys of one slot), or
    /// `acquire_set_counted.lua` where a key has a capacity. With hand-off on, `place` queues a
    /// caller that will wait.
    async fn set_script(
        &self,
        keys: &[LockKey],
        token: &Token,
        ttl: Duration,
        place: Option<&Place>,
    ) -> Result<Answer, StoreError> {
        let handoff = self.handoff.is_some();
        // The counter single-key acquires use too, so that a key's tokens come from one counter
        // however it is taken.
        let slot_bound = self.slot_bound.load(Ordering::Relaxed);
        let companions: Vec<CompanionKeys> = keys
            .iter()
            .map(|key| CompanionKeys::new(key, slot_bound))
            .collect();
        let script_keys = script_keys(keys, &companions, handoff);
        let (ttl_ms, retention, claim) = (ms(ttl), ms(self.fence_retention), ms(self.claim_window));
        let shares = shares(keys);
        let mut args: Vec<&[u8]> = vec![token.as_bytes(), &ttl_ms, &retention];
        if shares.is_some() {
            args.push(if handoff { b"1" } else { b"0" });
        }
        if handoff || shares.is_some() {
            args.push(&claim);
            match place.filter(|_| handoff) {
                Some(place) => {
                    args.push(&place.stamp);
                    args.push(place.channel.as_bytes());
                    args.push(if place.rescan { b"1" } else { b"0" });
                }
                None => args.extend([&b""[..], b"", b"0"]),
            }
        }
        let script = match &shares {
            Some(shares) => {
                args.extend(shares.iter().map(String::as_bytes));
                &self.scripts.acquire_set_counted
            }
            None => &self.scripts.acquire_set,
        };
        let (answer, acks): (Vec<i64>, _) = self.invoke(script, &script_keys, &args, true).await?;
        let malformed = || {
            StoreError::msg(
                StoreErrorKind::Backend,
                "the key set script answered in an unexpected shape",
            )
        };
        match answer.as_slice() {
            [1, fences @ ..] if fences.len() == keys.len() && fences.iter().all(|&f| f > 0) => {
                if let Err(error) = self.check_acks(acks) {
                    // Not replicated enough to survive a failover: give them back.
                    if let Err(release) = self.release_keys(keys, token).await {
                        tracing::warn!(
                            error = &release as &dyn std::error::Error,
                            "releasing an unreplicated lease failed; it expires with its TTL"
                        );
                    }
                    return Err(error);
                }
                Ok(Answer::Acquired(
                    fences.iter().map(|&f| f.unsigned_abs()).collect(),
                ))
            }
            &[code @ (0 | 2 | 3), n, i] if (1..=keys.len() as i64).contains(&i) => {
                Ok(Answer::Held {
                    code,
                    // PTTL is -1 for a key without expiry and -2 for a key that just vanished.
                    expires_in: u64::try_from(n).ok().map(Duration::from_millis),
                    blocked: (i - 1) as usize,
                })
            }
            _ => Err(malformed()),
        }
    }

    /// One `release_set.lua` over `keys` (`release_set_counted.lua` where a key has a
    /// capacity): how many were held with `token`.
    async fn release_keys(&self, keys: &[LockKey], token: &Token) -> Result<usize, StoreError> {
        let handoff = self.handoff.is_some();
        let slot_bound = self.slot_bound.load(Ordering::Relaxed);
        let shares = shares(keys);
        if let Some(shares) = &shares {
            return self.release_counted(keys, token, shares, slot_bound).await;
        }
        let companions: Vec<CompanionKeys> = if handoff {
            keys.iter()
                .map(|key| CompanionKeys::new(key, slot_bound))
                .collect()
        } else {
            Vec::new()
        };
        let mut script_keys: Vec<&[u8]> = Vec::with_capacity(keys.len() * 3);
        for (i, key) in keys.iter().enumerate() {
            script_keys.push(key.as_bytes());
            if let Some(companions) = companions.get(i) {
                script_keys.push(companions.fence());
                script_keys.push(companions.queue());
            }
        }
        let extra = [ms(self.claim_window), ms(self.fence_retention)];
        let mut args: Vec<&[u8]> = vec![token.as_bytes()];
        if handoff {
            args.push(&extra[0]);
            args.push(&extra[1]);
        }
        let (released, _): (i64, _) = self
            .invoke(&self.scripts.release_set, &script_keys, &args, false)
            .await?;
        released_count(released)
    }

    /// [`release_keys`](Self::release_keys) of a set with a key with a capacity: every key
    /// with its fencing counter (and queue, with hand-off), then each key's `shares`.
    async fn release_counted(
        &self,
        keys: &[LockKey],
        token: &Token,
        shares: &[String],
        slot_bound: bool,
    ) -> Result<usize, StoreError> {
        let handoff = self.handoff.is_some();
        let companions: Vec<CompanionKeys> = keys
            .iter()
            .map(|key| CompanionKeys::new(key, slot_bound))
            .collect();
        let script_keys = script_keys(keys, &companions, handoff);
        let extra = [ms(self.claim_window), ms(self.fence_retention)];
        let mut args: Vec<&[u8]> = vec![
            token.as_bytes(),
            if handoff { b"1" } else { b"0" },
            &extra[0],
            &extra[1],
        ];
        args.extend(shares.iter().map(String::as_bytes));
        let (released, _): (i64, _) = self
            .invoke(
                &self.scripts.release_set_counted,
                &script_keys,
                &args,
                false,
            )
            .await?;
        released_count(released)
    }

    /// One attempt at `keys`; see [`AcquireSet::acquire_set`]. For `RedlockStore`'s nodes too
    /// (which never wait in a queue).
    pub(crate) async fn acquire_set_now(
        &self,
        keys: &KeySet,
        token: &Token,
        ttl: Duration,
        wait: bool,
    ) -> Result<SetAttempt, StoreError> {
        if !self.slot_bound.load(Ordering::Relaxed) {
            match self.whole_set(keys, token, ttl, wait).await {
                // Refused before it ran: a cluster-mode server. Slot by slot from now on.
                Err(error) if is_cross_slot(&error) => {
                    tracing::debug!(
                        "the Redis server hashes keys to slots; key sets go one script per slot \
                         from now on"
                    );
                    self.slot_bound.store(true, Ordering::Relaxed);
                }
                answer => return answer,
            }
        }
        self.slot_by_slot(keys, token, ttl).await
    }

    /// The whole set in one script, queued (with hand-off, and `wait`) while this store
    /// listens for hand-offs, as a single key is.
    async fn whole_set(
        &self,
        keys: &KeySet,
        token: &Token,
        ttl: Duration,
        wait: bool,
    ) -> Result<SetAttempt, StoreError> {
        let handoff = self.handoff.as_ref().filter(|_| wait);
        let mut resubscribed = false;
        loop {
            // As for one key (`enqueue_now`): read before the attempt.
            let since = handoff.map_or_else(Epoch::default, |h| h.epoch());
            let place = match handoff {
                Some(handoff) => handoff.ready().await.then(|| Place {
                    stamp: handoff::stamp(),
                    channel: handoff.channel_arc(),
                    rescan: handoff.is_registered(token),
                }),
                None => None,
            };
            return Ok(
                match self
                    .set_script(keys.as_slice(), token, ttl, place.as_ref())
                    .await?
                {
                    Answer::Acquired(fencing_tokens) => SetAttempt::Acquired { fencing_tokens },
                    Answer::Held {
                        code: 2,
                        expires_in,
                        blocked,
                    } => SetAttempt::Queued {
                        expires_in,
                        blocked,
                        since,
                    },
                    // Subscribed, but not on this server (an address that moved): subscribe
                    // again, and once that is up, try once more.
                    Answer::Held { code: 3, .. }
                        if !resubscribed && handoff.is_some_and(|h| h.resubscribe()) =>
                    {
                        resubscribed = true;
                        continue;
                    }
                    Answer::Held {
                        expires_in,
                        blocked,
                        ..
                    } => SetAttempt::Contended {
                        expires_in,
                        blocked,
                    },
                },
            );
        }
    }

    /// One script per hash slot, slot by slot in lock order; when a slot's keys are held (or
    /// its script fails), the slots taken before it are given back.
    async fn slot_by_slot(
        &self,
        keys: &KeySet,
        token: &Token,
        ttl: Duration,
    ) -> Result<SetAttempt, StoreError> {
        let groups: Vec<(usize, &[LockKey])> = keys.by_slot().collect();
        let mut fencing_tokens = Vec::with_capacity(keys.len());
        for (taken, &(start, group)) in groups.iter().enumerate() {
            let (undo, outcome) = match self.set_script(group, token, ttl, None).await {
                Ok(Answer::Acquired(fences)) => {
                    fencing_tokens.extend(fences);
                    continue;
                }
                Ok(Answer::Held {
                    expires_in,
                    blocked,
                    ..
                }) => (
                    taken,
                    Ok(SetAttempt::Contended {
                        expires_in,
                        blocked: start + blocked,
                    }),
                ),
                // A failed script may still have run.
                Err(error) => (taken + 1, Err(error)),
            };
            let rollback = groups[..undo]
                .iter()
                .map(|(_, group)| self.release_keys(group, token));
            for answer in join_all(rollback).await {
                if let Err(error) = answer {
                    tracing::warn!(
                        error = &error as &dyn std::error::Error,
                        "giving back the keys of a set failed; they free themselves when their \
                         TTL runs out"
                    );
                }
            }
            return outcome;
        }
        Ok(SetAttempt::Acquired { fencing_tokens })
    }

    /// Releases every key of `keys` held with `token`; see [`AcquireSet::release_set`].
    pub(crate) async fn release_set_now(
        &self,
        keys: &KeySet,
        token: &Token,
    ) -> Result<bool, StoreError> {
        if !self.slot_bound.load(Ordering::Relaxed) {
            match self.release_keys(keys.as_slice(), token).await {
                Err(error) if is_cross_slot(&error) => {
                    self.slot_bound.store(true, Ordering::Relaxed);
                }
                answer => return answer.map(|released| released == keys.len()),
            }
        }
        let releases = keys
            .by_slot()
            .map(|(_, group)| self.release_keys(group, token));
        let mut released = 0;
        let mut failed = None;
        for answer in join_all(releases).await {
            match answer {
                Ok(n) => released += n,
                Err(error) => {
                    failed.get_or_insert(error);
                }
            }
        }
        match failed {
            Some(error) => Err(error),
            None => Ok(released == keys.len()),
        }
    }
}

impl AcquireSet for RedisStore {
    fn acquire_set(
        self: Arc<Self>,
        keys: KeySet,
        token: Token,
        ttl: Duration,
        wait: bool,
    ) -> BoxFuture<Result<SetAttempt, StoreError>> {
        Box::pin(async move { self.acquire_set_now(&keys, &token, ttl, wait).await })
    }

    fn release_set(
        self: Arc<Self>,
        keys: KeySet,
        token: Token,
    ) -> BoxFuture<Result<bool, StoreError>> {
        Box::pin(async move { self.release_set_now(&keys, &token).await })
    }
}

/// A set release's answer: how many keys it released (a negative count, which no version of
/// the script answers, is an error).
fn released_count(released: i64) -> Result<usize, StoreError> {
    usize::try_from(released).map_err(|_| {
        StoreError::msg(
            StoreErrorKind::Backend,
            format!("the key set release script answered {released}, which no version of it does"),
        )
    })
}
