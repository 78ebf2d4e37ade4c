//! Batched renewal: the renewals that fall due together in one script (one per hash slot on a
//! server that hashes keys to slots).

use std::{
    sync::{Arc, atomic::Ordering},
    time::Duration,
};

use futures_util::future::join_all;
use redis::{ErrorKind, RedisError, ServerErrorKind};

use super::{RedisStore, keys::ms};
use crate::{
    key::LockKey,
    store::{BoxFuture, LockStore, RenewMany, StoreError, StoreErrorKind},
    token::Token,
};

impl RenewMany for RedisStore {
    fn renew_many(
        self: Arc<Self>,
        leases: Vec<(LockKey, Token)>,
        ttl: Duration,
    ) -> BoxFuture<Vec<Result<bool, StoreError>>> {
        Box::pin(async move { self.renew_many_now(&leases, ttl).await })
    }
}

impl RedisStore {
    /// One script for the whole batch (and one `WAIT`, with replica acknowledgement on); on a
    /// server that hashes keys to slots (a cluster, or a cluster-mode server), one script per
    /// slot, all sent at once.
    async fn renew_many_now(
        &self,
        leases: &[(LockKey, Token)],
        ttl: Duration,
    ) -> Vec<Result<bool, StoreError>> {
        if let [(key, token)] = leases {
            return vec![self.renew(key, token, ttl).await];
        }
        if !self.slot_bound.load(Ordering::Relaxed) {
            let all: Vec<&(LockKey, Token)> = leases.iter().collect();
            match self.renew_batch(&all, ttl).await {
                // Refused before it ran: a cluster-mode server. Split by slot from now on.
                Err(error) if is_cross_slot(&error) => {
                    tracing::debug!(
                        "the Redis server hashes keys to slots; batched renewals go one script \
                         per slot from now on"
                    );
                    self.slot_bound.store(true, Ordering::Relaxed);
                }
                Err(error) => return vec![Err(error); leases.len()],
                Ok(answers) => return answers,
            }
        }
        self.renew_by_slot(leases, ttl).await
    }
}

impl RedisStore {
    /// Renews `leases` with one script (`WAIT` after it, with replica acknowledgement on). The
    /// outer error is the script's (nothing was renewed); the inner ones are per lease.
    async fn renew_batch(
        &self,
        leases: &[&(LockKey, Token)],
        ttl: Duration,
    ) -> Result<Vec<Result<bool, StoreError>>, StoreError> {
        let keys: Vec<&[u8]> = leases.iter().map(|(key, _)| key.as_bytes()).collect();
        let ttl = ms(ttl);
        let mut args: Vec<&[u8]> = Vec::with_capacity(leases.len() + 1);
        args.push(&ttl);
        args.extend(leases.iter().map(|(_, token)| token.as_bytes()));
        let (renewed, acks): (Vec<i64>, _) = self
            .invoke(&self.scripts.renew_many, &keys, &args, true)
            .await?;
        if renewed.len() != leases.len() {
            return Err(StoreError::msg(
                StoreErrorKind::Backend,
                "the batch renewal script answered for the wrong number of leases",
            ));
        }
        let replicated = self.check_acks(acks);
        Ok(renewed
            .into_iter()
            .map(|n| match n {
                1 => replicated.clone().map(|()| true),
                _ => Ok(false),
            })
            .collect())
    }

    /// Renews `leases` one script per hash slot (a lone lease of its slot as
    /// [`renew`](LockStore::renew) would), all sent at once: pipelined on one connection, or
    /// each to its slot's master in a cluster. Answers in the order of `leases`.
    async fn renew_by_slot(
        &self,
        leases: &[(LockKey, Token)],
        ttl: Duration,
    ) -> Vec<Result<bool, StoreError>> {
        let mut order: Vec<(usize, &(LockKey, Token))> = leases.iter().enumerate().collect();
        order.sort_by_key(|(_, (key, _))| key.slot());
        let groups: Vec<Vec<(usize, &(LockKey, Token))>> = order
            .chunk_by(|(_, (a, _)), (_, (b, _))| a.slot() == b.slot())
            .map(<[_]>::to_vec)
            .collect();
        let answers = join_all(groups.iter().map(|group| async move {
            let leases: Vec<&(LockKey, Token)> = group.iter().map(|(_, lease)| *lease).collect();
            match leases[..] {
                [(key, token)] => vec![self.renew(key, token, ttl).await],
                _ => self
                    .renew_batch(&leases, ttl)
                    .await
                    .unwrap_or_else(|error| vec![Err(error); leases.len()]),
            }
        }))
        .await;
        let mut out: Vec<Option<Result<bool, StoreError>>> = vec![None; leases.len()];
        for (group, answers) in groups.iter().zip(answers) {
            for ((index, _), answer) in group.iter().zip(answers) {
                out[*index] = Some(answer);
            }
        }
        out.into_iter()
            .map(|answer| {
                answer.unwrap_or_else(|| {
                    Err(StoreError::msg(
                        StoreErrorKind::Backend,
                        "a batched renewal went unanswered",
                    ))
                })
            })
            .collect()
    }
}

/// Whether Redis refused a script because its keys hash to several slots (`CROSSSLOT`).
pub(super) fn is_cross_slot(error: &StoreError) -> bool {
    std::error::Error::source(error)
        .and_then(|source| source.downcast_ref::<RedisError>())
        .is_some_and(|e| e.kind() == ErrorKind::Server(ServerErrorKind::CrossSlot))
}
