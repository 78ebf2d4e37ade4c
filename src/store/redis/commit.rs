//! Group commit: the operations that reach one store while a call is in flight wait for it, and
//! go to Redis together, in one script call, in the order they came.
//!
//! A lone operation goes out at once, from its caller's own future: no timer, no task hop, no
//! added latency when the store is idle. While it is in flight, others queue; when it is
//! answered, one task takes the queue over and sends it as one batch, then the next, until the
//! queue is empty. So under load a store sends Redis one script call per round trip, whatever
//! the number of requests, and each operation's share of Redis's per-command cost (reading,
//! parsing, dispatch, the reply) falls with the batch's size.
//!
//! Order is kept: on one connection, one call at a time, operations in arrival order within
//! it. An acquire whose caller gave up before its batch was sent is left out; once sent, its
//! release (which the caller's guard sends) comes in a later call, after it. Through a bb8
//! pool, a few calls go at once ([`Committer::POOL_WINDOW`]), each on its own connection, so
//! that a stalled checkout does not hold up the others; a release may then overtake its own
//! acquire if the caller gave up on it while it was in flight, as it could before batching,
//! and the key is then held until its TTL (checked under the protocol model,
//! `tests/protocol_model.rs a_release_that_overtakes_its_attempt_on_a_pool`: it costs time,
//! never exclusion or order).

use std::{
    sync::{Arc, Mutex, PoisonError, atomic::Ordering},
    time::Duration,
};

use bytes::Bytes;
use redis::{Cmd, ErrorKind, RedisError, ServerErrorKind, Value};
use tokio::{runtime::Handle, sync::oneshot};

use super::{
    RedisStore,
    keys::{CompanionKeys, ms, record_key, shared_fence},
};
use crate::{
    key::LockKey,
    store::{StoreError, StoreErrorKind},
    token::Token,
};

/// The most operations in one script call: a bound on how long one call keeps Redis busy.
const MAX_BATCH: usize = 256;

/// One lock operation.
pub(super) enum Op {
    Acquire {
        key: LockKey,
        token: Token,
        ttl: Duration,
        /// With hand-off: where the caller joins the queue, `None` to not queue.
        place: Option<Place>,
    },
    Release {
        key: LockKey,
        token: Token,
    },
    Renew {
        key: LockKey,
        token: Token,
        ttl: Duration,
    },
    Complete {
        key: LockKey,
        token: Token,
        record: Bytes,
        keep: Duration,
    },
}

/// Where a waiter joins a hand-off queue: its entry is its token, `stamp` and `channel`.
pub(super) struct Place {
    pub(super) stamp: [u8; 16],
    pub(super) channel: Arc<str>,
    /// A later attempt, which may find the waiter queued already.
    pub(super) rescan: bool,
}

impl Op {
    fn key(&self) -> &LockKey {
        match self {
            Self::Acquire { key, .. }
            | Self::Release { key, .. }
            | Self::Renew { key, .. }
            | Self::Complete { key, .. } => key,
        }
    }

    /// Whether replicas must acknowledge it (`WAIT`).
    fn replicates(&self) -> bool {
        matches!(self, Self::Acquire { .. } | Self::Renew { .. })
    }
}

/// What the script answered for one operation: for an acquire, its code and number (see
/// `scripts/acquire.lua`); for the others, 1 or 0. `acks`: the replicas that acknowledged
/// the batch, when `WAIT` was sent.
#[derive(Debug, Clone, Copy)]
pub(super) struct Answer {
    pub(super) code: i64,
    pub(super) n: i64,
    pub(super) acks: Option<i64>,
}

/// The queue of one store (shared by its clones).
pub(super) struct Committer {
    /// The most calls in flight at once: 1 on one connection (Redis answers in order, and a
    /// stalled call stalls the connection anyway), more through a pool, whose connections
    /// answer independently, so that one stalled checkout or connection does not hold up the
    /// others.
    window: usize,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// Calls in flight: lone operations sent from their callers' futures, and the task
    /// sending the queue (one, while `driving`).
    in_flight: usize,
    driving: bool,
    queue: Vec<Queued>,
}

struct Queued {
    op: Op,
    reply: oneshot::Sender<Result<Answer, StoreError>>,
}

impl Committer {
    /// The calls a pool store keeps in flight before operations queue for a batch.
    #[cfg(feature = "bb8")]
    pub(super) const POOL_WINDOW: usize = 4;

    pub(super) fn new(window: usize) -> Self {
        Self {
            window: window.max(1),
            state: Mutex::default(),
        }
    }

    pub(super) fn window(&self) -> usize {
        self.window
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A call ended: starts the task that sends the queue if there is one to send and nobody
    /// sending it.
    fn ended(&self, store: &RedisStore) {
        let mut state = self.state();
        state.in_flight -= 1;
        if state.queue.is_empty() || state.driving {
            return;
        }
        match Handle::try_current() {
            Ok(handle) => {
                state.driving = true;
                state.in_flight += 1;
                drop(state);
                handle.spawn(drive(store.clone()));
            }
            // No runtime to send it on (it is shutting down): the queued callers hear that.
            Err(_) => state.queue.clear(),
        }
    }
}

impl RedisStore {
    /// Runs `op`: at once when nothing is in flight, else in the next batch.
    pub(super) async fn submit(&self, op: Op) -> Result<Answer, StoreError> {
        enum Turn {
            Lead(Op),
            Queued(oneshot::Receiver<Result<Answer, StoreError>>),
        }
        let turn = {
            let mut state = self.committer.state();
            // Behind a queue, an operation joins it, so that operations go in arrival order.
            if state.in_flight >= self.committer.window || !state.queue.is_empty() {
                let (reply, answer) = oneshot::channel();
                state.queue.push(Queued { op, reply });
                Turn::Queued(answer)
            } else {
                state.in_flight += 1;
                Turn::Lead(op)
            }
        };
        match turn {
            Turn::Lead(op) => {
                let lead = Lead { store: self };
                let mut answers = self.send(vec![op]).await;
                drop(lead);
                answers.pop().expect("one answer for one operation")
            }
            Turn::Queued(answer) => answer.await.unwrap_or_else(|_| {
                Err(StoreError::msg(
                    StoreErrorKind::Unavailable,
                    "the lock store's batch was dropped before it was answered",
                ))
            }),
        }
    }
}

/// Ends a lone operation's call, answered or dropped, and hands the queue to a task that sends
/// it, if there is one.
struct Lead<'a> {
    store: &'a RedisStore,
}

impl Drop for Lead<'_> {
    fn drop(&mut self) {
        self.store.committer.ended(self.store);
    }
}

/// Sends the queue, one batch after the other, until it is empty.
async fn drive(store: RedisStore) {
    /// The task dropped (its runtime shut down): whoever queued hears it, and the next
    /// operation starts afresh.
    struct Stop<'a>(&'a RedisStore);
    impl Drop for Stop<'_> {
        fn drop(&mut self) {
            let mut state = self.0.committer.state();
            state.driving = false;
            state.in_flight -= 1;
            state.queue.clear();
        }
    }
    let stop = Stop(&store);
    loop {
        let batch: Vec<Queued> = {
            let mut state = store.committer.state();
            // Callers that gave up (dropped) before their batch was sent are left out.
            state.queue.retain(|q| !q.reply.is_closed());
            if state.queue.is_empty() {
                state.driving = false;
                state.in_flight -= 1;
                std::mem::forget(stop);
                return;
            }
            let n = state.queue.len().min(MAX_BATCH);
            state.queue.drain(..n).collect()
        };
        let (ops, mut replies): (Vec<Op>, Vec<_>) =
            batch.into_iter().map(|q| (q.op, q.reply)).unzip();
        // A call nobody waits for any more (every caller gave up: its deadline passed, a stalled
        // server) is abandoned, so that it does not hold up the operations behind it. Its
        // callers' guards have sent their releases, which come after it.
        let answers = tokio::select! {
            answers = store.send(ops) => answers,
            () = all_gone(&mut replies) => continue,
        };
        for (reply, answer) in replies.into_iter().zip(answers) {
            let _ = reply.send(answer);
        }
        // Lets the callers just answered queue their next operations before the next batch
        // leaves, so that they go together rather than trickle out in small batches.
        tokio::task::yield_now().await;
    }
}

/// Completes once every reply's receiver is gone.
async fn all_gone(replies: &mut [oneshot::Sender<Result<Answer, StoreError>>]) {
    for reply in replies {
        reply.closed().await;
    }
}

impl RedisStore {
    /// Sends `ops` as one script call (one per hash slot on a server that hashes keys to
    /// slots); an answer for each, in order.
    async fn send(&self, ops: Vec<Op>) -> Vec<Result<Answer, StoreError>> {
        let n = ops.len();
        if !self.slot_bound.load(Ordering::Relaxed) {
            let answers = if n == 1 {
                vec![self.call_one(&ops[0]).await]
            } else {
                self.call(&ops).await
            };
            // Refused before it ran, by a server that hashes keys to slots (a cluster-mode
            // server behind a plain connection): from now on, one call per slot, with the
            // fencing counter of each slot.
            if !answers
                .iter()
                .all(|a| matches!(a, Err(e) if is_cross_slot(e)))
            {
                return answers;
            }
            tracing::debug!(
                "the Redis server hashes keys to slots; batches go one script call per slot from \
                 now on"
            );
            self.slot_bound.store(true, Ordering::Relaxed);
        }
        if n == 1 {
            return vec![self.call_one(&ops[0]).await];
        }
        // By slot, each slot's operations in their order; the slots' calls at once.
        let mut groups: Vec<(u16, Vec<usize>)> = Vec::new();
        for (i, op) in ops.iter().enumerate() {
            let slot = op.key().slot();
            match groups.iter_mut().find(|(s, _)| *s == slot) {
                Some((_, members)) => members.push(i),
                None => groups.push((slot, vec![i])),
            }
        }
        let mut slots: Vec<Option<Op>> = ops.into_iter().map(Some).collect();
        let calls = groups.iter().map(|(_, members)| {
            let group: Vec<Op> = members
                .iter()
                .map(|&i| slots[i].take().expect("once"))
                .collect();
            async move { self.call(&group).await }
        });
        let answered = futures_util::future::join_all(calls).await;
        let mut out: Vec<Option<Result<Answer, StoreError>>> = (0..n).map(|_| None).collect();
        for ((_, members), answers) in groups.iter().zip(answered) {
            for (&i, answer) in members.iter().zip(answers) {
                out[i] = Some(answer);
            }
        }
        out.into_iter()
            .map(|a| a.expect("every operation answered"))
            .collect()
    }

    /// A lone operation: a renewal or release with the server's native compare command where
    /// it has one (and nothing else in flight to keep in order), else the batch script.
    async fn call_one(&self, op: &Op) -> Result<Answer, StoreError> {
        let answer = |code| Answer {
            code,
            n: 0,
            acks: None,
        };
        match op {
            Op::Renew { key, token, ttl } => {
                if let Some(renewed) = self.native_renew(key, token, *ttl).await? {
                    return Ok(answer(i64::from(renewed)));
                }
            }
            Op::Release { key, token } => {
                if let Some(released) = self.native_release(key, token).await? {
                    return Ok(answer(i64::from(released)));
                }
            }
            _ => {}
        }
        self.call(std::slice::from_ref(op))
            .await
            .pop()
            .expect("one answer for one operation")
    }

    /// One `EVALSHA` of the batch script for `ops` (and `WAIT`, with replica acknowledgement
    /// on and an acquire or renewal among them).
    async fn call(&self, ops: &[Op]) -> Vec<Result<Answer, StoreError>> {
        let handoff = self.handoff.is_some();
        // One fencing counter for the whole server unless it hashes keys to slots: a batch of
        // acquires then reads and writes one counter (per prefix), not one per slot.
        let slot_bound = self.slot_bound.load(Ordering::Relaxed);
        let mut shared: Vec<(&[u8], Vec<u8>)> = Vec::new();
        if !slot_bound {
            for op in ops {
                let prefix = op.key().prefix();
                if !shared.iter().any(|(p, _)| *p == prefix) {
                    shared.push((prefix, shared_fence(prefix)));
                }
            }
        }
        let companions: Vec<Option<CompanionKeys>> = ops
            .iter()
            .map(|op| match op {
                Op::Acquire { key, .. } => Some(CompanionKeys::new(key)),
                Op::Release { key, .. } | Op::Complete { key, .. } if handoff => {
                    Some(CompanionKeys::new(key))
                }
                _ => None,
            })
            .collect();
        let records: Vec<Option<Vec<u8>>> = ops
            .iter()
            .map(|op| match op {
                Op::Complete { key, .. } => Some(record_key(key)),
                _ => None,
            })
            .collect();
        let mut keys: Vec<&[u8]> = Vec::with_capacity(ops.len() * 4);
        for ((op, companions), record) in ops.iter().zip(&companions).zip(&records) {
            keys.push(op.key().as_bytes());
            if let Some(record) = record {
                keys.push(record);
            }
            if let Some(companions) = companions {
                let fence: &[u8] = if slot_bound {
                    companions.fence()
                } else {
                    let prefix = op.key().prefix();
                    let (_, name) = shared
                        .iter()
                        .find(|(p, _)| *p == prefix)
                        .expect("every prefix of the batch has its counter");
                    name
                };
                match op {
                    Op::Acquire { .. } => {
                        keys.push(fence);
                        if handoff {
                            keys.push(companions.queue());
                        }
                    }
                    _ => keys.extend([fence, companions.queue()]),
                }
            }
        }
        let size = 96 + keys.iter().map(|k| k.len()).sum::<usize>() + ops.len() * 96;
        let mut eval = Cmd::with_capacity(6 + keys.len() + ops.len() * 6, size);
        eval.arg("EVALSHA")
            .arg(self.scripts.ops.get_hash())
            .arg(keys.len());
        for key in &keys {
            eval.arg(*key);
        }
        eval.arg(if handoff { "1" } else { "0" })
            .arg(&*ms(self.claim_window))
            .arg(&*ms(self.fence_retention));
        for op in ops {
            match op {
                Op::Acquire {
                    token, ttl, place, ..
                } => {
                    eval.arg("a").arg(token.as_bytes()).arg(&*ms(*ttl));
                    match place {
                        Some(place) => eval
                            .arg(&place.stamp[..])
                            .arg(place.channel.as_bytes())
                            .arg(if place.rescan { "1" } else { "0" }),
                        None => eval.arg("").arg("").arg("0"),
                    };
                }
                Op::Release { token, .. } => {
                    eval.arg("r").arg(token.as_bytes());
                }
                Op::Renew { token, ttl, .. } => {
                    eval.arg("n").arg(token.as_bytes()).arg(&*ms(*ttl));
                }
                Op::Complete {
                    token,
                    record,
                    keep,
                    ..
                } => {
                    eval.arg("c")
                        .arg(token.as_bytes())
                        .arg(&record[..])
                        .arg(&*ms(*keep));
                }
            }
        }
        let replicate = ops.iter().any(Op::replicates);
        let answer: Result<(Vec<Value>, Option<i64>), StoreError> =
            self.invoke_cmd(&self.scripts.ops, eval, replicate).await;
        match answer {
            Ok((values, acks)) if values.len() == 2 * ops.len() => values
                .chunks_exact(2)
                .map(|pair| answer_of(&pair[0], &pair[1], acks))
                .collect(),
            Ok(_) => {
                let error = StoreError::msg(
                    StoreErrorKind::Backend,
                    "the lock script answered for the wrong number of operations",
                );
                vec![Err(error); ops.len()]
            }
            Err(error) => vec![Err(error); ops.len()],
        }
    }
}

/// One operation's answer in the batch script's reply: its code and number, or (code -1)
/// Redis's refusal of that operation alone.
fn answer_of(code: &Value, n: &Value, acks: Option<i64>) -> Result<Answer, StoreError> {
    let code = match code {
        Value::Int(code) => *code,
        _ => return Err(StoreError::msg(StoreErrorKind::Backend, UNREADABLE)),
    };
    match n {
        Value::Int(n) if code >= 0 => Ok(Answer { code, n: *n, acks }),
        Value::BulkString(message) if code == -1 => Err(StoreError::msg(
            StoreErrorKind::Backend,
            format!(
                "Redis refused the lock operation: {}",
                String::from_utf8_lossy(message)
            ),
        )),
        _ => Err(StoreError::msg(StoreErrorKind::Backend, UNREADABLE)),
    }
}

const UNREADABLE: &str = "the lock script's answer could not be read";

/// Whether `error` is Redis refusing a script over keys of several hash slots.
pub(super) fn is_cross_slot(error: &StoreError) -> bool {
    std::error::Error::source(error)
        .and_then(|source| source.downcast_ref::<RedisError>())
        .is_some_and(|e| e.kind() == ErrorKind::Server(ServerErrorKind::CrossSlot))
}
