//! Group commit: the operations that reach one store while its call is in flight wait for it,
//! and go to Redis together, in one script call, in the order they came.
//!
//! Each store (and each copy of it with other settings) has one driver: a task on the crate's
//! runtime (`crate::background`), started by the store's first operation, that owns the
//! store's queue. A caller puts its operation in the driver's inbox (a channel) with a one-shot
//! channel for its answer, and awaits the answer; nothing else. The driver sends what waits in
//! its inbox as one batch (at most [`MAX_BATCH`] operations), and while that call is in flight
//! the next operations wait in the inbox: so under load a store sends Redis one script call
//! per round trip, whatever the number of requests, and each operation's share of Redis's
//! per-command cost (reading, parsing, dispatch, the reply) falls with the batch's size; a
//! lone operation goes out at once, with no wait.
//!
//! Everything a call needs runs on the crate's runtime, so no operation waits for a caller to
//! be polled: a caller's runtime that stalls, shuts down or is left idle holds up nobody, not
//! even its own operations (a release it awaits is on the wire while it stalls).
//!
//! Order is kept by the inbox, first in first out: a release or completion always goes after
//! the acquire of its token, since it comes after it and one call is in flight at a time. An
//! operation whose caller gave up before its call was sent (or sent again after `NOSCRIPT`) is
//! left out of it (its caller's one-shot channel is closed): the release its guard sends then
//! finds nothing to undo. A release is sent all the same: it frees only what its token holds.
//! A call in flight whose callers have all left is dropped (looked at every [`LEFT_CHECK`]),
//! so that a call the connection holds up (a stalled server, a reconnection that does not
//! answer) holds up the calls behind it no longer than its callers wait; what it wrote stays
//! ahead of the next call on that connection.
//!
//! Through a bb8 pool, a few calls go at once ([`Committer::POOL_WINDOW`]), each on its own
//! connection, so that a stalled checkout does not hold up the others; a release or completion
//! whose acquire is in one of them waits for that call to end, with everything behind it. Only
//! a call dropped with its callers gone can then be overtaken, on another connection, by the
//! release of an acquire it wrote: the key is held until its TTL, which costs time, never
//! exclusion (`tests/protocol_model.rs a_release_that_overtakes_its_attempt_on_a_pool`).
//!
//! No lock, atomic or waker of the crate's own: the channels are Tokio's, and the driver's
//! state is its task's alone.

use std::{
    borrow::Cow,
    sync::{Arc, OnceLock, atomic::Ordering},
    time::Duration,
};

use futures_util::{StreamExt, stream::FuturesUnordered};
use redis::{Script, Value};
use tokio::sync::{mpsc, oneshot};

use super::{
    RedisStore,
    wire::{Answer, Answers, DONE, NOT_HELD, Op, UNREADABLE, answer_of, is_cross_slot},
};
use crate::{
    store::{StoreError, StoreErrorKind},
    token::Token,
};

/// The most operations in one script call: a bound on how long one call keeps Redis busy.
const MAX_BATCH: usize = 256;

/// How often a call in flight checks whether any of its callers still waits for it.
const LEFT_CHECK: Duration = Duration::from_millis(50);

/// The queue of one store (shared by its clones): the inbox of its driver, started at the
/// first operation. Dropped with the store's last clone, it closes the inbox, and the driver
/// ends once its calls in flight are answered.
pub(super) struct Committer {
    /// The most calls in flight at once: 1 on one connection (Redis answers in order, and a
    /// stalled call stalls the connection anyway), more through a pool, whose connections
    /// answer independently.
    window: usize,
    inbox: OnceLock<mpsc::UnboundedSender<Queued>>,
}

/// An operation and where its answer goes.
struct Queued {
    op: Op,
    reply: oneshot::Sender<Result<Answer, StoreError>>,
}

impl Queued {
    /// Whether it is left out: its caller gave up, and it is not a release (a release frees
    /// only what its token holds, so it goes whoever waits for its answer: a release on drop
    /// that timed out behind a stalled call still frees the key its late acquire took).
    fn left(&self) -> bool {
        self.reply.is_closed() && !matches!(self.op, Op::Release { .. })
    }
}

/// The operations of one call: a lone operation's (most calls) without a list.
type Ops = smallvec::SmallVec<[Queued; 1]>;

impl Committer {
    /// The calls a pool store keeps in flight before operations queue for a batch.
    #[cfg(feature = "bb8")]
    pub(super) const POOL_WINDOW: usize = 4;

    pub(super) fn new(window: usize) -> Self {
        Self {
            window: window.max(1),
            inbox: OnceLock::new(),
        }
    }

    pub(super) fn window(&self) -> usize {
        self.window
    }

    /// Puts `queued` in the driver's inbox, starting the driver for `store` if it is the
    /// first.
    fn queue(&self, store: &RedisStore, queued: Queued) -> Result<(), StoreError> {
        let no_runtime = || {
            StoreError::msg(
                StoreErrorKind::Backend,
                "the lock operation was not sent: no Tokio runtime runs the store's calls",
            )
        };
        let inbox = match self.inbox.get() {
            Some(inbox) => inbox,
            None => {
                let (sender, inbox) = mpsc::unbounded_channel();
                // The driver's copy of the store has a queue of its own, never used: holding
                // this one would keep its inbox open for ever.
                let store = RedisStore {
                    committer: Arc::new(Self::new(self.window)),
                    ..store.clone()
                };
                let queue = Queue {
                    inbox,
                    window: self.window,
                    next: None,
                    unsettled: Vec::new(),
                };
                // Without a runtime to run on, nothing is kept: a later operation tries again.
                if !crate::background::spawn(drive(store, queue)) {
                    return Err(no_runtime());
                }
                // Two first operations at once each started a driver: the one set first is
                // the store's, the other's ends with its inbox, now dropped.
                let _ = self.inbox.set(sender);
                self.inbox.get().ok_or_else(no_runtime)?
            }
        };
        inbox.send(queued).map_err(|_| no_runtime())
    }
}

/// What the driver takes operations from.
struct Queue {
    inbox: mpsc::UnboundedReceiver<Queued>,
    window: usize,
    /// An operation taken from the inbox and not sent yet: through a pool, the release or
    /// completion of an acquire in a call in flight, which waits (with everything behind it)
    /// until that call ends.
    next: Option<Queued>,
    /// Through a pool, the tokens of the acquires in the calls in flight.
    unsettled: Vec<Token>,
}

impl Queue {
    /// The next operation to send, if one waits and may go now; the operations of callers who
    /// gave up are dropped on the way.
    fn take(&mut self) -> Option<Queued> {
        loop {
            let queued = match self.next.take() {
                Some(queued) => queued,
                None => self.inbox.try_recv().ok()?,
            };
            if queued.left() {
                continue;
            }
            if self.window > 1
                && let Op::Release { token, .. } | Op::Complete { token, .. } = &queued.op
                && self.unsettled.contains(token)
            {
                self.next = Some(queued);
                return None;
            }
            return Some(queued);
        }
    }

    /// The next batch: what waits, in order, up to [`MAX_BATCH`] (empty if nothing may go).
    fn batch(&mut self) -> Ops {
        let mut ops = Ops::new();
        while ops.len() < MAX_BATCH
            && let Some(queued) = self.take()
        {
            ops.push(queued);
        }
        ops
    }

    /// A call that carried `acquired` has ended (through a pool).
    fn settled(&mut self, acquired: &[Token]) {
        for token in acquired {
            if let Some(i) = self.unsettled.iter().position(|t| t == token) {
                self.unsettled.swap_remove(i);
            }
        }
    }
}

/// Ends once every caller of `ops` has left (looked at every [`LEFT_CHECK`]): a call the
/// connection holds up (a stalled server, a reconnection that does not answer) is then dropped,
/// so that it holds up the calls behind it no longer than its callers wait. What it wrote stays
/// ahead of what the next call writes on that connection.
async fn all_left(ops: &[Queued]) {
    loop {
        tokio::time::sleep(LEFT_CHECK).await;
        if ops.iter().all(|queued| queued.reply.is_closed()) {
            return;
        }
    }
}

/// The tokens of the acquires among `ops`.
fn acquires(ops: &[Queued]) -> impl Iterator<Item = &Token> {
    ops.iter().filter_map(|queued| match &queued.op {
        Op::Acquire { token, .. } => Some(token),
        _ => None,
    })
}

/// The driver: sends batches while it has room for a call (one, but through a pool), and waits
/// for an operation or for a call to end; ends when every clone of its store is gone and its
/// calls are answered.
async fn drive(store: RedisStore, mut queue: Queue) {
    let store = &store;
    if queue.window == 1 {
        // One call at a time: what comes meanwhile waits in the inbox for the next batch.
        while let Some(queued) = queue.inbox.recv().await {
            queue.next = Some(queued);
            let ops = queue.batch();
            if !ops.is_empty() {
                store.answer(ops).await;
            }
        }
        return;
    }
    let mut flights = FuturesUnordered::new();
    let mut open = true;
    loop {
        while flights.len() < queue.window {
            let ops = queue.batch();
            if ops.is_empty() {
                break;
            }
            let acquired: Vec<Token> = acquires(&ops).cloned().collect();
            queue.unsettled.extend(acquired.iter().cloned());
            flights.push(async move {
                store.answer(ops).await;
                acquired
            });
        }
        let room = flights.len() < queue.window && queue.next.is_none();
        tokio::select! {
            biased;
            Some(acquired) = flights.next(), if !flights.is_empty() => queue.settled(&acquired),
            queued = queue.inbox.recv(), if open && room => match queued {
                Some(queued) => queue.next = Some(queued),
                None => open = false,
            },
            else => break,
        }
    }
}

impl RedisStore {
    /// Runs `op` in the store's next call: at once when nothing is in flight.
    pub(super) async fn submit(&self, op: Op) -> Result<Answer, StoreError> {
        let (reply, answer) = oneshot::channel();
        self.committer.queue(self, Queued { op, reply })?;
        answer.await.unwrap_or_else(|_| {
            Err(StoreError::msg(
                StoreErrorKind::Backend,
                "the lock call ended without an answer (its runtime shut down)",
            ))
        })
    }

    /// Sends `ops` as one script call (one per hash slot on a server that hashes keys to
    /// slots), and gives each caller its answer; or drops the call once every one of its
    /// callers has left (a call the connection holds up would hold up every call behind it).
    async fn answer(&self, ops: Ops) {
        let answers = tokio::select! {
            biased;
            answers = self.answers(&ops) => answers,
            () = all_left(&ops) => return,
        };
        for (i, queued) in ops.into_iter().enumerate() {
            let _ = queued.reply.send(answers.get(i).clone());
        }
    }

    /// The answers of `ops`, in order, from one script call (one per hash slot on a server
    /// that hashes keys to slots).
    async fn answers(&self, ops: &[Queued]) -> Answers {
        let n = ops.len();
        if !self.slot_bound.load(Ordering::Relaxed) {
            // Refused before it ran, by a server that hashes keys to slots (a cluster-mode
            // server behind a plain connection): from now on, one call per slot, with the
            // fencing counter of each slot.
            // (Its operations whose callers left have answers of their own.)
            let cross_slot =
                |a: &Result<Answer, StoreError>| matches!(a, Err(e) if is_cross_slot(e));
            let answers = match ops {
                [queued] => self.call_one(queued).await,
                _ => self.call(&ops.iter().collect::<Vec<_>>()).await,
            };
            if !answers.iter().any(cross_slot) {
                return answers;
            }
            tracing::debug!(
                "the Redis server hashes keys to slots; batches go one script call per slot from \
                 now on"
            );
            self.slot_bound.store(true, Ordering::Relaxed);
        }
        if let [queued] = ops {
            return self.call_one(queued).await;
        }
        // By slot, each slot's operations in their order; the slots' calls at once.
        let mut groups: Vec<(u16, Vec<usize>)> = Vec::new();
        for (i, queued) in ops.iter().enumerate() {
            let slot = queued.op.key().slot();
            match groups.iter_mut().find(|(s, _)| *s == slot) {
                Some((_, members)) => members.push(i),
                None => groups.push((slot, vec![i])),
            }
        }
        let calls = groups.iter().map(|(_, members)| {
            let group: Vec<&Queued> = members.iter().map(|&i| &ops[i]).collect();
            async move { self.call(&group).await }
        });
        let answered = futures_util::future::join_all(calls).await;
        let mut out: Vec<Option<Result<Answer, StoreError>>> = (0..n).map(|_| None).collect();
        for ((_, members), answers) in groups.iter().zip(answered) {
            for (&i, answer) in members.iter().zip(answers.iter()) {
                out[i] = Some(answer.clone());
            }
        }
        Answers::from_fn(n, |i| {
            out[i]
                .take()
                .unwrap_or_else(|| Err(StoreError::msg(StoreErrorKind::Backend, UNREADABLE)))
        })
    }

    /// A lone operation: a renewal or release with the server's native compare command where
    /// it has one (and nothing else in flight to keep in order), else the batch script.
    async fn call_one(&self, queued: &Queued) -> Answers {
        let answer = |code| {
            Answers::One(Ok(Answer {
                code,
                n: 0,
                acks: None,
            }))
        };
        let native = match &queued.op {
            // A key with a capacity holds a set of holders: the script counts them.
            op if op.key().share().is_some() => Ok(None),
            Op::Renew { key, token, ttl } => self.native_renew(key, token, *ttl).await,
            Op::Release { key, token } => self.native_release(key, token).await,
            _ => Ok(None),
        };
        match native {
            Ok(Some(done)) => answer(if done { DONE } else { NOT_HELD }),
            Ok(None) => self.call(&[queued]).await,
            Err(error) => Answers::One(Err(error)),
        }
    }

    /// One `EVALSHA` of the batch script for `ops` (and `WAIT`, with replica acknowledgement
    /// on and an acquire or renewal among them), but for the operations whose callers left:
    /// checked as it is sent, and again if it is sent again after `NOSCRIPT`.
    async fn call(&self, ops: &[&Queued]) -> Answers {
        let live = |ops: &[&Queued]| -> Cow<'static, [usize]> {
            // A lone operation's caller, still there (the common case): no list to make.
            if let [queued] = ops
                && !queued.left()
            {
                return Cow::Borrowed(&[0]);
            }
            (0..ops.len()).filter(|&i| !ops[i].left()).collect()
        };
        let every = |answer: Result<Answer, StoreError>| Answers::every(ops.len(), answer);
        let mut sent = live(ops);
        if sent.is_empty() {
            return every(Err(left()));
        }
        let replicate = sent.iter().any(|&i| ops[i].op.replicates());
        let script = self.script_for(ops);
        let eval = self.batch_cmd(script, sent.iter().map(|&i| &ops[i].op));
        let again = |_| {
            sent = live(ops);
            (!sent.is_empty()).then(|| self.batch_cmd(script, sent.iter().map(|&i| &ops[i].op)))
        };
        let answer: Result<Option<(Vec<Value>, _)>, StoreError> =
            self.invoke_cmd_again(script, eval, again, replicate).await;
        match answer {
            Ok(Some((values, acks))) if values.len() == 2 * sent.len() => {
                // In order: the sent operations' answers, and the others' (left) in between.
                let mut sent = sent.iter().copied().zip(values.chunks_exact(2)).peekable();
                Answers::from_fn(ops.len(), |i| match sent.next_if(|&(at, _)| at == i) {
                    Some((_, pair)) => answer_of(&pair[0], &pair[1], acks),
                    None => Err(left()),
                })
            }
            Ok(Some(_)) => every(Err(StoreError::msg(
                StoreErrorKind::Backend,
                "the lock script answered for the wrong number of operations",
            ))),
            Ok(None) => every(Err(left())),
            Err(error) => every(Err(error)),
        }
    }

    /// The batch script for a call of `ops`: the one that also counts holders when any of
    /// them is on a key with a capacity (a subset sent again after `NOSCRIPT` keeps it).
    fn script_for(&self, ops: &[&Queued]) -> &Script {
        match ops.iter().any(|queued| queued.op.key().share().is_some()) {
            true => &self.scripts.counted,
            false => &self.scripts.ops,
        }
    }
}

/// The answer of an operation not sent because its caller left (read by nobody): one message
/// for the process, not one allocated per call.
fn left() -> StoreError {
    static MESSAGE: OnceLock<Arc<str>> = OnceLock::new();
    let message = MESSAGE.get_or_init(|| "the lock operation was not sent: its caller left".into());
    StoreError::msg(StoreErrorKind::Backend, Arc::clone(message))
}
