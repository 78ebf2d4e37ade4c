//! Group commit: the operations that reach one store while a call is in flight wait for it, and
//! go to Redis together, in one script call, in the order they came.
//!
//! A lone operation goes out at once, from its caller's own future: no timer, no task hop, no
//! added latency when the store is idle. While it is in flight, others queue; when it is
//! answered, a queued caller's own future takes the queue over and sends it as one batch (its
//! own operation among them), which every caller of the batch drives until it is answered. So
//! under load a store sends Redis one script call per round trip, whatever the number of
//! requests, and each operation's share of Redis's per-command cost (reading, parsing,
//! dispatch, the reply) falls with the batch's size.
//!
//! No task is spawned per call: each runtime that uses the store has a lane of its own (its
//! calls in flight and its queue), and a call is driven by the futures of its own callers and
//! of the callers queued behind it in its lane, on that runtime, while the connection's own I/O
//! (redis-rs's driver, reconnections) runs on the crate's runtime (`crate::background`), so that
//! no call depends on a runtime of a caller's staying alive. So no caller can hold up the others by not being polled (a future
//! kept in a `select!` while another branch runs): a call in flight is driven to its end by
//! whichever of them is polled, and when it ends every queued caller is woken, the first
//! polled forming the next batch (the others' operations among them). A runtime that shuts
//! down drops its callers, and with them its lane's calls (an idle lane is kept for its
//! runtime's next call until another lane goes idle); one that is no longer driven (a
//! current-thread runtime whose `block_on` returned) holds up its own callers only.
//!
//! Order is kept within a lane: on one connection, one call at a time, operations in arrival
//! order within it. An operation whose caller gave up before its call was sent (or sent again
//! after `NOSCRIPT`) is left out of it; a batch whose callers all gave up is abandoned. The
//! release of an acquire (which the caller's guard sends at once, from the crate's runtime,
//! through another lane) waits for the call that carries the acquire to end, so that it never
//! overtakes an acquire on its way to Redis (a call may be held up between its check and the
//! connection, by a preempted thread or a script load); else the acquire would take the key
//! with a token nobody holds, until its TTL. Through a bb8 pool, a few calls go at once
//! ([`Committer::POOL_WINDOW`]), each on its own connection, so that a stalled checkout does not
//! hold up the others; the release of an acquire still waits for the call carrying it, and
//! overtakes it only when that call was abandoned while on the wire (every one of its callers
//! gave up), the key then being held until its TTL (checked under the protocol model,
//! `tests/protocol_model.rs a_release_that_overtakes_its_attempt_on_a_pool`: it costs time,
//! never exclusion or order).
//! Lanes of several runtimes also send their calls at once, like a pool's.

use std::{
    borrow::Cow,
    collections::HashMap,
    hash::BuildHasherDefault,
    sync::{
        Arc, Mutex, MutexGuard, OnceLock, PoisonError,
        atomic::{AtomicBool, Ordering},
    },
    task::{Context, Poll, Waker},
};

use redis::{Script, Value};
use tokio::runtime::{self, Handle};

use super::{
    RedisStore,
    lock_order::{self, Inner},
    shared::{SharedCall, WeakCall},
    token_hasher::TokenHasher,
    wire::{Answer, Answers, DONE, NOT_HELD, Op, UNREADABLE, answer_of, is_cross_slot},
};
use crate::{
    store::{StoreError, StoreErrorKind},
    token::Token,
};

/// The most operations in one script call: a bound on how long one call keeps Redis busy.
const MAX_BATCH: usize = 256;

/// A call in flight: driven by whichever of its callers, or of the callers queued behind it, is
/// polled.
type Batch = SharedCall<Answers>;

/// The queue of one store (shared by its clones): a lane per Tokio runtime.
pub(super) struct Committer {
    /// The most calls of one lane in flight at once: 1 on one connection (Redis answers in
    /// order, and a stalled call stalls the connection anyway), more through a pool, whose
    /// connections answer independently, so that one stalled checkout or connection does not
    /// hold up the others.
    window: usize,
    /// Every lane. The lock order (`lock_order`): this first; under it at most one of
    /// `unsettled` and a queued caller's `Ticket::state`; neither ever held while this is taken.
    lanes: Mutex<Vec<Lane>>,
    /// The calls in flight with acquires, by token (with the call's lane and number): a release
    /// of one of those tokens waits for its call to end, since the acquire may be on its way to
    /// Redis after its caller left (and sent again after `NOSCRIPT`), and a release that
    /// overtook it would leave the key held by nobody until its TTL.
    unsettled: Mutex<Unsettled>,
}

/// [`Committer::unsettled`]: by token, hashed with [`TokenHasher`].
type Unsettled = HashMap<Token, Carrier, BuildHasherDefault<TokenHasher>>;

/// The call that carries an acquire: its lane, its number there, and the call.
type Carrier = (Option<runtime::Id>, u64, WeakCall<Answers>);

/// The calls in flight and the queue of the callers on one runtime (`None`: outside any).
struct Lane {
    runtime: Option<runtime::Id>,
    /// Its calls in flight, by number, for its queued callers to drive (weak: a call whose
    /// callers all left is abandoned).
    flights: Vec<(u64, WeakCall<Answers>)>,
    /// The number of its next call.
    next: u64,
    queue: Vec<Queued>,
}

impl Lane {
    fn is_idle(&self) -> bool {
        self.flights.is_empty() && self.queue.is_empty()
    }
}

/// The operations of one call: a lone operation's (most calls) without a list.
type Ops = smallvec::SmallVec<[Queued; 1]>;

/// An operation and its caller's place.
struct Queued {
    op: Op,
    ticket: Arc<Ticket>,
}

/// A caller's place: how to wake it while it is queued, and once its batch is formed, where its
/// answer comes from (locked only under the lanes' lock); and whether it left, after which its
/// operation is not sent (its release, which its guard sends at once, may have run already).
#[derive(Default)]
struct Ticket {
    state: Mutex<TicketState>,
    left: AtomicBool,
}

#[derive(Default)]
struct TicketState {
    waker: Option<Waker>,
    batch: Option<(Batch, usize)>,
}

impl Ticket {
    fn state(&self) -> Inner<'_, TicketState> {
        lock_order::inner(self.state.lock().unwrap_or_else(PoisonError::into_inner))
    }

    fn leave(&self) {
        self.left.store(true, Ordering::Release);
    }

    fn left(&self) -> bool {
        self.left.load(Ordering::Acquire)
    }
}

/// Marks a lone operation's caller as left when its future is dropped (after its answer too,
/// when that no longer matters).
struct Leaves(Arc<Ticket>);

impl Drop for Leaves {
    fn drop(&mut self) {
        self.0.leave();
    }
}

impl Committer {
    /// The calls a pool store keeps in flight before operations queue for a batch.
    #[cfg(feature = "bb8")]
    pub(super) const POOL_WINDOW: usize = 4;

    pub(super) fn new(window: usize) -> Self {
        Self {
            window: window.max(1),
            lanes: Mutex::default(),
            unsettled: Mutex::default(),
        }
    }

    pub(super) fn window(&self) -> usize {
        self.window
    }

    /// The lanes: taken first, never under the unsettled map or a ticket (`lock_order`).
    fn lanes(&self) -> MutexGuard<'_, Vec<Lane>> {
        lock_order::outer();
        self.lanes.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The unsettled map: under the lanes or alone, never with a ticket (`lock_order`).
    fn unsettled(&self) -> Inner<'_, Unsettled> {
        lock_order::inner(
            self.unsettled
                .lock()
                .unwrap_or_else(PoisonError::into_inner),
        )
    }

    /// The call in flight that carries the acquire of `token`, if any.
    fn carrying(&self, token: &Token) -> Option<Batch> {
        self.unsettled()
            .get(token)
            .and_then(|(_, _, call)| call.upgrade())
    }
}

/// `runtime`'s lane, made if it has none.
fn lane_of(lanes: &mut Vec<Lane>, runtime: Option<runtime::Id>) -> &mut Lane {
    let i = match lanes.iter().position(|lane| lane.runtime == runtime) {
        Some(i) => i,
        None => {
            lanes.push(Lane {
                runtime,
                flights: Vec::new(),
                next: 0,
                queue: Vec::new(),
            });
            lanes.len() - 1
        }
    };
    &mut lanes[i]
}

/// After a lane's call ended or a queued caller left: the wakers of its queued callers, if the
/// lane has room for another call (every one of them, since any may be left unpolled, and the
/// first polled takes the queue over). A lane that is idle is kept, with its lists' room, for
/// its runtime's next call (a lone operation's would otherwise make the lane and its list of
/// calls again), and the other idle lanes are removed: the runtime of one may be gone.
fn next_leaders(lanes: &mut Vec<Lane>, runtime: Option<runtime::Id>, window: usize) -> Vec<Waker> {
    let Some(i) = lanes.iter().position(|lane| lane.runtime == runtime) else {
        return Vec::new();
    };
    let lane = &mut lanes[i];
    if lane.is_idle() {
        if lanes.len() > 1 {
            lanes.retain(|lane| lane.runtime == runtime || !lane.is_idle());
        }
        return Vec::new();
    }
    if lane.flights.len() >= window {
        return Vec::new();
    }
    lane.queue
        .iter()
        .filter_map(|queued| queued.ticket.state().waker.take())
        .collect()
}

/// A call in flight, counted in its lane until it is answered or abandoned (dropped with the
/// last of its callers); then the lane's queued callers are woken to take the queue over.
struct Flight {
    committer: Arc<Committer>,
    runtime: Option<runtime::Id>,
    number: u64,
    /// The tokens of its acquires, in [`Committer::unsettled`].
    acquires: Acquires,
}

/// The tokens of a call's acquires: a lone operation's (none or one) with no list.
#[derive(Clone)]
enum Acquires {
    One(Option<Token>),
    Many(Vec<Token>),
}

impl Acquires {
    fn of(ops: &[Queued]) -> Self {
        let mut tokens = ops.iter().filter_map(|queued| match &queued.op {
            Op::Acquire { token, .. } => Some(token.clone()),
            _ => None,
        });
        match ops.len() {
            0 | 1 => Self::One(tokens.next()),
            _ => Self::Many(tokens.collect()),
        }
    }

    fn iter(&self) -> std::slice::Iter<'_, Token> {
        match self {
            Self::One(token) => token.as_slice().iter(),
            Self::Many(tokens) => tokens.iter(),
        }
    }

    fn is_empty(&self) -> bool {
        self.iter().len() == 0
    }
}

impl Drop for Flight {
    fn drop(&mut self) {
        if !self.acquires.is_empty() {
            let mut unsettled = self.committer.unsettled();
            for token in self.acquires.iter() {
                if unsettled.get(token).is_some_and(|(runtime, number, _)| {
                    *runtime == self.runtime && *number == self.number
                }) {
                    unsettled.remove(token);
                }
            }
        }
        let mut lanes = self.committer.lanes();
        if let Some(lane) = lanes.iter_mut().find(|lane| lane.runtime == self.runtime) {
            lane.flights.retain(|(number, _)| *number != self.number);
        }
        let next = next_leaders(&mut lanes, self.runtime, self.committer.window);
        drop(lanes);
        for waker in next {
            waker.wake();
        }
    }
}

impl RedisStore {
    /// Runs `op`: at once when nothing is in flight, else in the next batch.
    pub(super) async fn submit(&self, op: Op) -> Result<Answer, StoreError> {
        if let Op::Release { token, .. } | Op::Complete { token, .. } = &op {
            // After the acquire of its token, which may still be on its way.
            if let Some(call) = self.committer.carrying(token) {
                call.await;
            }
        }
        let runtime = Handle::try_current().ok().map(|handle| handle.id());
        let committer = &self.committer;
        let ticket = Arc::new(Ticket::default());
        let queued = Queued {
            op,
            ticket: Arc::clone(&ticket),
        };
        let call = {
            let mut lanes = committer.lanes();
            let lane = lane_of(&mut lanes, runtime);
            // Behind a queue, an operation joins it, so that operations go in arrival order.
            if lane.flights.len() < committer.window && lane.queue.is_empty() {
                Some(self.launch(lane, smallvec::smallvec![queued]))
            } else {
                lane.queue.push(queued);
                None
            }
        };
        match call {
            Some(call) => {
                // Sent at its first poll, below; a caller that leaves before it is sent again
                // after `NOSCRIPT` is left out then.
                let _leaves = Leaves(ticket);
                let mut call = call;
                (&mut call).await;
                call.answers()
                    .map_or_else(|| Err(left()), |answers| answers.get(0).clone())
            }
            None => {
                let mut queued = Waiting {
                    store: self,
                    runtime,
                    ticket,
                    batch: None,
                    driving: Vec::new(),
                    yielded: false,
                };
                std::future::poll_fn(|cx| queued.poll(cx)).await
            }
        }
    }

    /// A call of `ops`, in flight in `lane` from now on (sent at its first poll): its callers
    /// and the lane's queued callers drive it, whichever are polled.
    fn launch(&self, lane: &mut Lane, ops: Ops) -> Batch {
        let number = lane.next;
        lane.next += 1;
        let acquires = Acquires::of(&ops);
        let flight = Flight {
            committer: Arc::clone(&self.committer),
            runtime: lane.runtime,
            number,
            acquires: acquires.clone(),
        };
        let store = self.clone();
        let batch = SharedCall::new(async move {
            let answers = store.send(ops).await;
            drop(flight);
            answers
        });
        let weak = batch.downgrade();
        if !acquires.is_empty() {
            let mut unsettled = self.committer.unsettled();
            for token in acquires.iter() {
                unsettled.insert(token.clone(), (lane.runtime, number, weak.clone()));
            }
        }
        lane.flights.push((number, weak));
        batch
    }
}

/// A queued caller: waits for a batch, forms one when its lane has room, then drives its batch
/// with the batch's other callers. Dropped while queued, it leaves the queue.
struct Waiting<'a> {
    store: &'a RedisStore,
    runtime: Option<runtime::Id>,
    ticket: Arc<Ticket>,
    batch: Option<(Batch, usize)>,
    /// The lane's calls in flight while it waits for room, which it drives (their own callers
    /// may not be polled); kept between polls, to be woken as they progress.
    driving: Vec<Batch>,
    /// Whether it has let the other tasks of its runtime run once before forming a batch.
    yielded: bool,
}

impl Waiting<'_> {
    fn poll(&mut self, cx: &mut Context<'_>) -> Poll<Result<Answer, StoreError>> {
        loop {
            if let Some((batch, i)) = &mut self.batch {
                std::task::ready!(batch.poll_end(cx));
                let answer = batch.answers().map(|answers| answers.get(*i).clone());
                return Poll::Ready(answer.unwrap_or_else(|| Err(left())));
            }
            // Outside the lock: the last share of a call ends its flight, which takes it.
            self.driving.clear();
            let committer = &self.store.committer;
            let mut wake = Vec::new();
            {
                let mut lanes = committer.lanes();
                let mut ticket = self.ticket.state();
                if let Some(batch) = ticket.batch.take() {
                    self.batch = Some(batch);
                    continue;
                }
                let lane = lane_of(&mut lanes, self.runtime);
                if lane.flights.len() >= committer.window {
                    ticket.waker = Some(cx.waker().clone());
                    drop(ticket);
                    self.driving
                        .extend(lane.flights.iter().filter_map(|(_, call)| call.upgrade()));
                    drop(lanes);
                    // Drives the calls in flight: their callers may not be polled. One that
                    // ends makes room.
                    let mut ended = false;
                    for call in &mut self.driving {
                        ended |= call.poll_end(cx).is_ready();
                    }
                    if ended {
                        continue;
                    }
                    return Poll::Pending;
                }
                if !self.yielded {
                    // Lets the callers just answered queue their next operations before the
                    // batch leaves, so that they go together rather than trickle out in small
                    // batches.
                    self.yielded = true;
                    ticket.waker = Some(cx.waker().clone());
                    drop(ticket);
                    drop(lanes);
                    cx.waker().wake_by_ref();
                    return Poll::Pending;
                }
                drop(ticket);
                // The lane's next batch: the queue's first operations, in arrival order (its
                // callers that gave up have left it).
                let n = lane.queue.len().min(MAX_BATCH);
                let ops: Ops = lane.queue.drain(..n).collect();
                let tickets: Vec<Arc<Ticket>> = ops
                    .iter()
                    .map(|queued| Arc::clone(&queued.ticket))
                    .collect();
                let batch = self.store.launch(lane, ops);
                for (i, ticket) in tickets.iter().enumerate() {
                    if Arc::ptr_eq(ticket, &self.ticket) {
                        self.batch = Some((batch.clone(), i));
                    } else {
                        let mut state = ticket.state();
                        state.batch = Some((batch.clone(), i));
                        wake.extend(state.waker.take());
                    }
                }
                // A pool's lane may have room for the rest of the queue too.
                wake.extend(next_leaders(&mut lanes, self.runtime, committer.window));
                // Before `batch` (never its last share: its callers hold theirs).
                drop(lanes);
            }
            // Its callers drive the batch from here (each polls it to be woken with the
            // answer); the others of the lane wait for it to end.
            for waker in wake {
                waker.wake();
            }
        }
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        // In a batch not sent yet (or to be sent again after `NOSCRIPT`), its operation is left
        // out: its release may run before the batch is sent.
        self.ticket.leave();
        if self.batch.is_some() {
            // In a batch: the batch goes on while any of its callers is left.
            return;
        }
        let committer = &self.store.committer;
        let mut lanes = committer.lanes();
        // Formed while this caller was leaving: its share of the batch is dropped (after the
        // lock: the last share ends the flight, which takes the lock).
        let assigned = self.ticket.state().batch.take();
        if assigned.is_none()
            && let Some(lane) = lanes.iter_mut().find(|lane| lane.runtime == self.runtime)
        {
            // Gave up before its batch was sent: left out.
            lane.queue
                .retain(|queued| !Arc::ptr_eq(&queued.ticket, &self.ticket));
        }
        let next = next_leaders(&mut lanes, self.runtime, committer.window);
        drop(lanes);
        drop(assigned);
        for waker in next {
            waker.wake();
        }
    }
}

impl RedisStore {
    /// Sends `ops` as one script call (one per hash slot on a server that hashes keys to
    /// slots); an answer for each, in order.
    async fn send(&self, ops: Ops) -> Answers {
        let n = ops.len();
        if !self.slot_bound.load(Ordering::Relaxed) {
            // Refused before it ran, by a server that hashes keys to slots (a cluster-mode
            // server behind a plain connection): from now on, one call per slot, with the
            // fencing counter of each slot.
            // (Its operations whose callers left have answers of their own.)
            let cross_slot =
                |a: &Result<Answer, StoreError>| matches!(a, Err(e) if is_cross_slot(e));
            let answers = if n == 1 {
                self.call_one(&ops[0]).await
            } else {
                self.call(&ops).await
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
        if n == 1 {
            return self.call_one(&ops[0]).await;
        }
        // By slot, each slot's operations in their order; the slots' calls at once.
        let mut groups: Vec<(u16, Vec<usize>)> = Vec::new();
        for (i, op) in ops.iter().enumerate() {
            let slot = op.op.key().slot();
            match groups.iter_mut().find(|(s, _)| *s == slot) {
                Some((_, members)) => members.push(i),
                None => groups.push((slot, vec![i])),
            }
        }
        let mut slots: Vec<Option<Queued>> = ops.into_iter().map(Some).collect();
        let calls = groups.iter().map(|(_, members)| {
            let group: Vec<Queued> = members
                .iter()
                .map(|&i| slots[i].take().expect("once"))
                .collect();
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
            Ok(None) => self.call(std::slice::from_ref(queued)).await,
            Err(error) => Answers::One(Err(error)),
        }
    }

    /// One `EVALSHA` of the batch script for `ops` (and `WAIT`, with replica acknowledgement
    /// on and an acquire or renewal among them), but for the operations whose callers left:
    /// checked as it is sent, and again if it is sent again after `NOSCRIPT`.
    async fn call(&self, ops: &[Queued]) -> Answers {
        let live = |ops: &[Queued]| -> Cow<'static, [usize]> {
            // A lone operation's caller, still there (the common case): no list to make.
            if let [queued] = ops
                && !queued.ticket.left()
            {
                return Cow::Borrowed(&[0]);
            }
            (0..ops.len()).filter(|&i| !ops[i].ticket.left()).collect()
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
    fn script_for(&self, ops: &[Queued]) -> &Script {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::LockKey;

    /// A lane that goes idle stays for its runtime's next call; the other idle lanes (their
    /// runtimes may be gone) go then, and a busy one stays.
    #[test]
    fn one_idle_lane_is_kept() {
        let runtimes: Vec<_> = (0..3)
            .map(|_| runtime::Builder::new_current_thread().build().unwrap())
            .collect();
        let ids: Vec<_> = runtimes.iter().map(|rt| Some(rt.handle().id())).collect();
        let mut lanes = Vec::new();
        for &id in &ids {
            lane_of(&mut lanes, id);
        }
        lane_of(&mut lanes, None).next = 7;
        let busy = lane_of(&mut lanes, ids[2]);
        busy.queue.push(Queued {
            op: Op::Release {
                key: LockKey::new("p:", "s", b"k", 64).unwrap(),
                token: Token::generate().unwrap(),
            },
            ticket: Arc::default(),
        });
        assert!(next_leaders(&mut lanes, None, 1).is_empty());
        let left: Vec<_> = lanes.iter().map(|lane| lane.runtime).collect();
        assert_eq!(left, [ids[2], None]);
        assert_eq!(lanes[1].next, 7, "the idle lane kept is the caller's own");
    }
}
