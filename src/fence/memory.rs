//! Fenced data in this process ([`FencedData::in_memory`](super::FencedData::in_memory)): the
//! same checks as the Redis script, under one mutex.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
};

use bytes::Bytes;

use crate::store::{
    BoxFuture, StoreError,
    fenced::{Applied, DataOp, FencedWrites, Plan, Reply},
};

#[derive(Debug, Default)]
pub(super) struct MemoryData {
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    keys: HashMap<Bytes, Value>,
    fences: HashMap<Bytes, u64>,
}

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
            DataOp::Set { key, value } => {
                self.keys.insert(key, Value::Str(value));
                Reply::Done
            }
            DataOp::Del { key } => Reply::Int(i64::from(self.keys.remove(&key).is_some())),
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

    fn apply(&mut self, plan: Plan) -> Applied {
        for (i, (fence_key, token)) in plan.fences.iter().enumerate() {
            if let Some(&fence) = self.fences.get(fence_key)
                && fence > *token
            {
                return Applied::Stale { resource: i, fence };
            }
        }
        if let Some(reason) = self.check(&plan.ops) {
            return Applied::Invalid { reason };
        }
        let writes = plan.ops.iter().any(DataOp::writes);
        let replies: Vec<Reply> = plan.ops.into_iter().map(|op| self.run(op)).collect();
        let found = replies.iter().any(|r| matches!(r, Reply::Data(_)));
        for (fence_key, token) in plan.fences {
            match self.fences.get_mut(&fence_key) {
                Some(fence) => *fence = (*fence).max(token),
                None if writes || found => {
                    self.fences.insert(fence_key, token);
                }
                None => {}
            }
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
