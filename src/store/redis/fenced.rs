//! Fenced writes in Redis: one script (`scripts/fenced.lua`) checks every resource's fence,
//! checks that every operation can apply, applies them, and raises the fences, in one step.

use std::sync::{Arc, LazyLock};

use bytes::Bytes;
use redis::{Script, Value};

use super::{RedisStore, scripts::lua, wire::is_cross_slot};
use crate::{
    slot,
    store::{
        BoxFuture, StoreError, StoreErrorKind,
        fenced::{Applied, DataOp, FENCE_SLACK, FencedWrites, Plan, Reply},
    },
};

/// A duration in whole milliseconds, at least 1 (`PX 0` is an error).
fn ms(duration: std::time::Duration) -> u64 {
    (duration.as_millis().min(u128::from(u64::MAX)) as u64).max(1)
}

/// Built once: `redis::Script` hashes its source, and the store reloads it on `NOSCRIPT`.
static FENCED: LazyLock<Script> = LazyLock::new(|| Script::new(lua("fenced")));

impl RedisStore {
    async fn apply_now(&self, plan: Plan) -> Result<Applied, StoreError> {
        let mut keys: Vec<&[u8]> = Vec::with_capacity(plan.fences.len() + plan.ops.len());
        keys.extend(plan.fences.iter().map(|(key, _)| &key[..]));
        keys.extend(plan.ops.iter().map(|op| &op.key()[..]));
        if self.slot_bound.load(std::sync::atomic::Ordering::Relaxed)
            && let Some(reason) = several_slots(&keys)
        {
            return Ok(Applied::Invalid { reason });
        }
        let tokens: Vec<String> = plan.fences.iter().map(|(_, t)| t.to_string()).collect();
        // An operation's number, if it has one: a counter's delta, a value's time to live.
        let numbers: Vec<String> = plan
            .ops
            .iter()
            .map(|op| match op {
                DataOp::IncrBy { delta, .. } => delta.to_string(),
                DataOp::Set { ttl: Some(ttl), .. } => ms(*ttl).to_string(),
                _ => String::new(),
            })
            .collect();
        let count = plan.fences.len().to_string();
        // The fence is kept for the horizon and the slack, or as long as a value it guards.
        let keep = ms(plan.horizon + FENCE_SLACK).to_string();
        let horizon = (plan.horizon.as_micros().min(u128::from(u64::MAX)) as u64).to_string();
        let mut args: Vec<&[u8]> = Vec::with_capacity(3 + tokens.len() + plan.ops.len() * 3);
        args.extend([count.as_bytes(), horizon.as_bytes(), keep.as_bytes()]);
        args.extend(tokens.iter().map(|t| t.as_bytes()));
        for (op, number) in plan.ops.iter().zip(&numbers) {
            match op {
                DataOp::Get { .. } => args.push(b"g"),
                DataOp::HGet { field, .. } => args.extend([&b"hg"[..], field]),
                DataOp::Set {
                    value, ttl: None, ..
                } => args.extend([&b"s"[..], value]),
                DataOp::Set {
                    value,
                    ttl: Some(_),
                    ..
                } => args.extend([&b"sx"[..], value, number.as_bytes()]),
                DataOp::Del { .. } => args.push(b"d"),
                DataOp::HSet { field, value, .. } => args.extend([&b"hs"[..], field, value]),
                DataOp::IncrBy { .. } => args.extend([&b"i"[..], number.as_bytes()]),
                DataOp::RPush { value, .. } => args.extend([&b"p"[..], value]),
            }
        }
        // Under a fence, a read may raise it: that is a write the replicas must have too (a
        // fence lost in a failover lets an older holder write between a newer one's read and
        // write), so a fenced batch waits for them whether it writes data or not.
        let replicate = !plan.fences.is_empty() || plan.ops.iter().any(DataOp::writes);
        let answer = self.invoke::<Value>(&FENCED, &keys, &args, replicate).await;
        let (value, acks) = match answer {
            Ok(answer) => answer,
            Err(error) if is_cross_slot(&error) => {
                return Ok(Applied::Invalid {
                    reason: "the server hashes keys to slots, and the batch's keys are in more \
                             than one: give its data keys the resource's hash tag \
                             (`fence::data_key`)"
                        .into(),
                });
            }
            Err(error) => return Err(error),
        };
        if replicate && acks.is_some() {
            self.check_acks(acks)?;
        }
        read_answer(value, &plan.ops)
    }
}

/// Why `keys` cannot go in one script on a server that hashes keys to slots, if they cannot.
fn several_slots(keys: &[&[u8]]) -> Option<String> {
    let first = slot::of(keys.first()?);
    keys.iter().any(|key| slot::of(key) != first).then(|| {
        "the data store hashes keys to slots, and the batch's keys are in more than one: give \
         its data keys the resource's hash tag (`fence::data_key`), and put resources of other \
         slots in batches of their own"
            .to_owned()
    })
}

/// The script's answer, read.
fn read_answer(value: Value, ops: &[DataOp]) -> Result<Applied, StoreError> {
    let unreadable = || StoreError::msg(StoreErrorKind::Backend, UNREADABLE);
    let Value::Array(values) = value else {
        return Err(unreadable());
    };
    let mut values = values.into_iter();
    let code = match values.next() {
        Some(Value::Int(code)) => code,
        _ => return Err(unreadable()),
    };
    match code {
        1 => {
            let replies: Vec<Reply> = values
                .zip(ops)
                .map(|(value, op)| match (op, value) {
                    (DataOp::Set { .. }, _) => Ok(Reply::Done),
                    (_, Value::Nil) => Ok(Reply::Nil),
                    (_, Value::BulkString(data)) => Ok(Reply::Data(Bytes::from(data))),
                    (_, Value::Int(n)) => Ok(Reply::Int(n)),
                    _ => Err(unreadable()),
                })
                .collect::<Result<_, _>>()?;
            if replies.len() != ops.len() {
                return Err(unreadable());
            }
            Ok(Applied::Done(replies))
        }
        0 => {
            let resource = match values.next() {
                Some(Value::Int(i)) if i >= 1 => (i - 1) as usize,
                _ => return Err(unreadable()),
            };
            let fence = match values.next() {
                Some(Value::BulkString(fence)) => std::str::from_utf8(&fence)
                    .ok()
                    .and_then(|f| f.parse().ok())
                    .ok_or_else(unreadable)?,
                _ => return Err(unreadable()),
            };
            Ok(Applied::Stale { resource, fence })
        }
        -1 => {
            let op = match values.next() {
                Some(Value::Int(i)) => i,
                _ => return Err(unreadable()),
            };
            let reason = match values.next() {
                Some(Value::BulkString(reason)) => String::from_utf8_lossy(&reason).into_owned(),
                _ => return Err(unreadable()),
            };
            Ok(Applied::Invalid {
                reason: format!("operation {op} of the batch cannot apply: {reason}"),
            })
        }
        _ => Err(unreadable()),
    }
}

const UNREADABLE: &str = "the fenced-write script's answer could not be read";

impl FencedWrites for RedisStore {
    fn apply(self: Arc<Self>, plan: Plan) -> BoxFuture<Result<Applied, StoreError>> {
        Box::pin(async move { self.apply_now(plan).await })
    }
}
