//! Key sets on Redlock: the set taken on each node in one script, and a quorum on the set.

use std::{sync::Arc, time::Duration};

use futures_util::future::join_all;
use tokio::time::Instant;

use super::{RedlockStore, no_quorum, too_slow};
use crate::{
    background::timeout,
    key::KeySet,
    store::{AcquireSet, BoxFuture, SetAttempt, StoreError},
    token::Token,
};

impl RedlockStore {
    /// Releases `keys` on the nodes at `indices`, at once; failures are left to the TTL.
    async fn release_set_on(&self, indices: &[usize], keys: &KeySet, token: &Token, ttl: Duration) {
        let limit = self.timeout_for(ttl);
        join_all(indices.iter().map(|&i| {
            let node = &self.nodes[i];
            async move {
                let _ = timeout(limit, node.release_set_now(keys, token)).await;
            }
        }))
        .await;
    }
}

/// A set is held when a quorum of nodes granted all of it within the validity time: each node
/// takes the set in one script (all of it or none), so a quorum on the set is a quorum on each
/// key. Each key's fencing token is the largest among the quorum's nodes, as for one key.
impl AcquireSet for RedlockStore {
    fn acquire_set(
        self: Arc<Self>,
        keys: KeySet,
        token: Token,
        ttl: Duration,
        _wait: bool,
    ) -> BoxFuture<Result<SetAttempt, StoreError>> {
        Box::pin(async move {
            let start = Instant::now();
            let answers = self
                .on_all(ttl, |node| node.acquire_set_now(&keys, &token, ttl, false))
                .await;
            let validity = self.validity_since(start, ttl);
            let (mut granted, mut held, mut errors, mut undo) = (vec![], vec![], vec![], vec![]);
            for (i, answer) in answers.into_iter().enumerate() {
                match answer {
                    Ok(SetAttempt::Acquired { fencing_tokens }) => {
                        granted.push(fencing_tokens);
                        undo.push(i);
                    }
                    Ok(
                        SetAttempt::Contended {
                            expires_in,
                            blocked,
                        }
                        | SetAttempt::Queued {
                            expires_in,
                            blocked,
                            ..
                        },
                    ) => held.push((expires_in, blocked)),
                    // A timed-out or failed call may still have taken the keys.
                    Err(error) => {
                        errors.push(error);
                        undo.push(i);
                    }
                }
            }
            let quorum = self.quorum();
            if granted.len() >= quorum && !validity.is_zero() {
                let fencing_tokens = (0..keys.len())
                    .map(|k| {
                        granted
                            .iter()
                            .filter_map(|fences| fences.get(k).copied())
                            .max()
                            .unwrap_or(0)
                    })
                    .collect();
                return Ok(SetAttempt::Acquired { fencing_tokens });
            }
            self.release_set_on(&undo, &keys, &token, ttl).await;
            if granted.len() >= quorum {
                return Err(too_slow(ttl));
            }
            if !held.is_empty() && granted.len() + held.len() >= quorum {
                // Enough nodes answered, and some of them for another holder: contention.
                let expires_in = held.iter().filter_map(|(e, _)| *e).max();
                let blocked = held.iter().map(|(_, b)| *b).min().unwrap_or(0);
                return Ok(SetAttempt::Contended {
                    expires_in,
                    blocked,
                });
            }
            let answered = granted.len() + held.len();
            Err(no_quorum(errors, answered, self.nodes.len(), quorum))
        })
    }

    fn release_set(
        self: Arc<Self>,
        keys: KeySet,
        token: Token,
    ) -> BoxFuture<Result<bool, StoreError>> {
        Box::pin(async move {
            let answers = self
                .on_all(Duration::from_secs(10), |node| {
                    node.release_set_now(&keys, &token)
                })
                .await;
            let (mut released, mut errors) = (false, vec![]);
            for answer in answers {
                match answer {
                    Ok(all) => released |= all,
                    Err(error) => errors.push(error),
                }
            }
            if released || errors.is_empty() {
                return Ok(released);
            }
            let answered = self.nodes.len() - errors.len();
            Err(no_quorum(errors, answered, self.nodes.len(), self.quorum()))
        })
    }
}
