//! Fenced data in this process ([`FencedData::in_memory`](super::FencedData::in_memory)): the
//! same checks as the Redis script, under one mutex.
//!
//! Fences and values set with a time to live expire as in Redis. A resource without a fence
//! refuses a token below the highest of every fence that has expired (`floor`): the process's
//! own form of the horizon rule, exact where the Redis script's is bounded by the clock (a
//! fence that expired was raised by a token issued a horizon ago or more, so a token below it
//! is older still).

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use bytes::Bytes;

use crate::store::{
    BoxFuture, StoreError,
    fenced::{Applied, DataOp, FENCE_SLACK, FencedWrites, Plan, Reply},
};

#[derive(Debug, Default)]
pub(super) struct MemoryData {
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    keys: HashMap<Bytes, Value>,
    /// When the keys set with a time to live expire.
    expiries: HashMap<Bytes, Instant>,
    fences: HashMap<Bytes, Fence>,
    /// The highest token of a fence that expired: a resource without a fence refuses a token
    /// below it.
    floor: u64,
    /// When expired keys and fences are next swept out (those a batch names go at once).
    next_sweep: Option<Instant>,
}

#[derive(Debug, Clone, Copy)]
struct Fence {
    token: u64,
    expires: Instant,
}

/// How often expired keys and fences nobody names are swept out.
const SWEEP_EVERY: Duration = Duration::from_secs(1);

#[derive(Debug)]
enum Value {
    Str(Bytes),
    Hash(HashMap<Bytes, Bytes>),
    List(Vec<Bytes>),
}

/// What a key will hold once the operations before the one being checked have run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    None,
    Str,
    Hash,
    List,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::Str => "string",
            Self::Hash => "hash",
            Self::List => "list",
        }
    }
}

impl State {
    fn kind(&self, key: &Bytes) -> Kind {
        match self.keys.get(key) {
            None => Kind::None,
            Some(Value::Str(_)) => Kind::Str,
            Some(Value::Hash(_)) => Kind::Hash,
            Some(Value::List(_)) => Kind::List,
        }
    }

    fn int(&self, key: &Bytes) -> Option<i64> {
        match self.keys.get(key) {
            None => Some(0),
            Some(Value::Str(s)) => redis_int(s),
            _ => None,
        }
    }

    /// Why `ops` cannot all apply, if they cannot (nothing is changed).
    fn check(&self, ops: &[DataOp]) -> Option<String> {
        // Per key: what it will hold, and the counter's value where known.
        let mut planned: HashMap<&Bytes, (Kind, Option<Option<i64>>)> = HashMap::new();
        for (i, op) in ops.iter().enumerate() {
            let key = op.key();
            let (kind, counter) = planned
                .get(key)
                .copied()
                .unwrap_or_else(|| (self.kind(key), None));
            let refuse = |what: &str| {
                Some(format!(
                    "operation {} of the batch cannot apply: {what}",
                    i + 1
                ))
            };
            let next = match op {
                DataOp::Get { .. } if !matches!(kind, Kind::Str | Kind::None) => {
                    return refuse(&format!("GET of a key that holds a {}", kind.name()));
                }
                DataOp::Get { .. } => (kind, counter),
                DataOp::HGet { .. } | DataOp::HSet { .. }
                    if !matches!(kind, Kind::Hash | Kind::None) =>
                {
                    return refuse(&format!(
                        "a hash operation on a key that holds a {}",
                        kind.name()
                    ));
                }
                DataOp::HGet { .. } => (kind, counter),
                DataOp::HSet { .. } => (Kind::Hash, None),
                DataOp::Set { value, .. } => (Kind::Str, Some(redis_int(value))),
                DataOp::Del { .. } => (Kind::None, Some(Some(0))),
                DataOp::IncrBy { delta, .. } => {
                    if !matches!(kind, Kind::Str | Kind::None) {
                        return refuse(&format!("INCRBY of a key that holds a {}", kind.name()));
                    }
                    let Some(value) = counter.unwrap_or_else(|| self.int(key)) else {
                        return refuse("INCRBY of a value that is not a whole number");
                    };
                    let Some(sum) = value.checked_add(*delta) else {
                        return refuse("INCRBY would overflow");
                    };
                    (Kind::Str, Some(Some(sum)))
                }
                DataOp::RPush { .. } if !matches!(kind, Kind::List | Kind::None) => {
                    return refuse(&format!("RPUSH to a key that holds a {}", kind.name()));
                }
                DataOp::RPush { .. } => (Kind::List, None),
            };
            planned.insert(key, next);
        }
        None
    }

    /// Applies `op`, which [`check`](Self::check) found applicable.
    fn run(&mut self, op: DataOp) -> Reply {
        match op {
            DataOp::Get { key } => match self.keys.get(&key) {
                Some(Value::Str(value)) => Reply::Data(value.clone()),
                _ => Reply::Nil,
            },
            DataOp::HGet { key, field } => match self.keys.get(&key) {
                Some(Value::Hash(hash)) => {
                    hash.get(&field).cloned().map_or(Reply::Nil, Reply::Data)
                }
                _ => Reply::Nil,
            },
            DataOp::Set { key, value, ttl } => {
                match ttl {
                    Some(ttl) => self.expiries.insert(key.clone(), Instant::now() + ttl),
                    None => self.expiries.remove(&key),
                };
                self.keys.insert(key, Value::Str(value));
                Reply::Done
            }
            DataOp::Del { key } => {
                self.expiries.remove(&key);
                Reply::Int(i64::from(self.keys.remove(&key).is_some()))
            }
            DataOp::HSet { key, field, value } => match self.keys.get_mut(&key) {
                Some(Value::Hash(hash)) => {
                    Reply::Int(i64::from(hash.insert(field, value).is_none()))
                }
                // Checked before: the key is missing.
                _ => {
                    self.keys
                        .insert(key, Value::Hash(HashMap::from([(field, value)])));
                    Reply::Int(1)
                }
            },
            DataOp::IncrBy { key, delta } => {
                let sum = self.int(&key).unwrap_or(0).saturating_add(delta);
                self.keys
                    .insert(key, Value::Str(Bytes::from(sum.to_string())));
                Reply::Int(sum)
            }
            DataOp::RPush { key, value } => match self.keys.get_mut(&key) {
                Some(Value::List(list)) => {
                    list.push(value);
                    Reply::Int(list.len() as i64)
                }
                // Checked before: the key is missing.
                _ => {
                    self.keys.insert(key, Value::List(vec![value]));
                    Reply::Int(1)
                }
            },
        }
    }

    /// Drops `key`'s value if it has expired.
    fn expire_key(&mut self, key: &Bytes, now: Instant) {
        if self.expiries.get(key).is_some_and(|&at| at <= now) {
            self.expiries.remove(key);
            self.keys.remove(key);
        }
    }

    /// `key`'s fence, unless it has expired (then its token joins the floor).
    fn fence(&mut self, key: &Bytes, now: Instant) -> Option<u64> {
        let fence = *self.fences.get(key)?;
        if fence.expires > now {
            return Some(fence.token);
        }
        self.fences.remove(key);
        self.floor = self.floor.max(fence.token);
        None
    }

    /// Sweeps out every expired key and fence, at most once per [`SWEEP_EVERY`]: nothing is
    /// kept past its expiry for long, whether a batch names it again or not.
    fn sweep(&mut self, now: Instant) {
        if self.next_sweep.is_some_and(|at| at > now) {
            return;
        }
        self.next_sweep = Some(now + SWEEP_EVERY);
        let expired: Vec<Bytes> = (self.expiries.iter())
            .filter(|&(_, &at)| at <= now)
            .map(|(key, _)| key.clone())
            .collect();
        for key in expired {
            self.expire_key(&key, now);
        }
        let floor = &mut self.floor;
        self.fences.retain(|_, fence| {
            let live = fence.expires > now;
            if !live {
                *floor = (*floor).max(fence.token);
            }
            live
        });
    }

    fn apply(&mut self, plan: Plan) -> Applied {
        let now = Instant::now();
        self.sweep(now);
        for op in &plan.ops {
            self.expire_key(op.key(), now);
        }
        let mut found_fences = Vec::with_capacity(plan.fences.len());
        for (i, (fence_key, token)) in plan.fences.iter().enumerate() {
            let fence = self.fence(fence_key, now);
            match fence {
                Some(fence) if fence > *token => return Applied::Stale { resource: i, fence },
                None if self.floor > *token => {
                    return Applied::Stale {
                        resource: i,
                        fence: self.floor,
                    };
                }
                _ => found_fences.push(fence),
            }
        }
        if let Some(reason) = self.check(&plan.ops) {
            return Applied::Invalid { reason };
        }
        let writes = plan.ops.iter().any(DataOp::writes);
        let keep = (plan.horizon + FENCE_SLACK).max(plan.longest_ttl().unwrap_or_default());
        let replies: Vec<Reply> = plan.ops.into_iter().map(|op| self.run(op)).collect();
        let found = replies.iter().any(|r| matches!(r, Reply::Data(_)));
        for ((fence_key, token), fence) in plan.fences.into_iter().zip(found_fences) {
            if fence.is_none() && !writes && !found {
                continue;
            }
            let expires = self
                .fences
                .get(&fence_key)
                .map_or(now + keep, |f| f.expires.max(now + keep));
            let token = fence.map_or(token, |fence| fence.max(token));
            self.fences.insert(fence_key, Fence { token, expires });
        }
        Applied::Done(replies)
    }
}

/// A counter's value as `INCRBY` reads it: decimal digits with an optional `-`, no `+`, no
/// leading zero, no `-0`; anything else is not a whole number (the script refuses the same).
fn redis_int(value: &[u8]) -> Option<i64> {
    let digits = value.strip_prefix(b"-").unwrap_or(value);
    let canonical = value == b"0" || digits.first().is_some_and(|d| (b'1'..=b'9').contains(d));
    canonical
        .then(|| std::str::from_utf8(value).ok()?.parse().ok())
        .flatten()
}

impl FencedWrites for MemoryData {
    fn apply(self: Arc<Self>, plan: Plan) -> BoxFuture<Result<Applied, StoreError>> {
        // Every update checks before it writes: a poisoned lock is still consistent.
        let applied = self
            .state
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .apply(plan);
        Box::pin(std::future::ready(Ok(applied)))
    }
}
