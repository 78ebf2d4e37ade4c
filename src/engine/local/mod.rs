//! In-process coalescing: requests of one process that want the same key queue here, first come
//! first served, and only the head of the queue contends in the store.
//!
//! Two effects: a process sends one contender per key to Redis however many of its requests
//! wait, and a waiter behind a holder of the same process is woken the moment that holder
//! releases, not by a timer.
//!
//! A key with a capacity (leases with counts, see [`Share`](crate::key::Share)) lets several
//! contenders of the process through at once, as many as their weights fit: its queue is a
//! semaphore of the key's capacity, first come first served, whose head waits for its whole
//! weight (so a writer is not overtaken by readers that come after it). A plain key's has one
//! permit, and so is the mutex it always was.
//!
//! A lease on several keys takes its turns at them one after the other, in lock order (see
//! [`KeySet`]), keeping the turns it has while it waits for the next: every request of the
//! process takes turns in that one order, so no two of them wait for each other in a cycle,
//! and a set is served in its turn at each key like any single-key request, however many of
//! those follow it (see `docs/DECISIONS.md`, "Sets of keys, and waiting for them").
//!
//! The head of a key's queue publishes what it knows of the key's holder: its own lease once it
//! holds the key, or the remaining TTL the store reported for another holder. A waiter that
//! gives up here is told that, so its 409's `Retry-After` is the holder's remaining lease, as it
//! would be had it asked the store itself. It also publishes that it is asking the store, and
//! that the store failed: a waiter whose deadline passes while the head's call is on its way
//! waits for its answer (at most a store timeout from when it was sent), and one whose turn
//! never came because the store did not answer gives up with that failure (503), not as if
//! someone held the key (409). A set that holds its turn at a key while it waits in this process
//! for its turn at a later one publishes that it waits there: a waiter behind it that gives up
//! answers as a waiter at that later key would.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex, PoisonError, Weak},
    time::Duration,
};

use tokio::{
    sync::{Notify, Semaphore},
    time::Instant,
};

use crate::{
    background::{sleep_until, timeout_at},
    key::{KeySet, LockKey},
    lease::Lease,
    store::StoreError,
};

/// The local queues of one [`Locker`](crate::Locker), one per key in use.
#[derive(Debug, Default)]
pub(crate) struct LocalQueues {
    // A key's entry lives while anyone holds or waits for its turn.
    queues: Mutex<HashMap<LockKey, Arc<Entry>>>,
}

/// One key's queue, and what its head knows of the key's holder.
#[derive(Debug)]
struct Entry {
    /// Tokio's semaphore queues its waiters in FIFO order, the head waiting for its whole
    /// weight; holding permits is holding the turn (a turn forgets the permits it takes and
    /// adds them back when dropped: the semaphore lives in the entry, not in an allocation of
    /// its own). As many permits as the key's capacity, as
    /// the first contender of the entry's life saw it (1 for a plain key).
    turn: Semaphore,
    capacity: u32,
    /// Published by the turn's holder, read by a waiter that gives up.
    holder: Mutex<Holder>,
    /// Told whenever the holder is published, for a waiter that waits for the head's answer.
    published: Notify,
}

/// What the head of a key's queue knows of the key's holder.
#[derive(Debug, Default)]
enum Holder {
    /// The head has not asked the store yet.
    #[default]
    Unknown,
    /// The head's first call is on its way, sent then.
    Asking { since: Instant },
    /// The store failed the head's last call (or did not answer it in time). Kept when the turn
    /// passes on, until the next head asks: it is about the store, not about the head.
    Failing(StoreError),
    /// The store told the head that someone else holds the key, until about then.
    Elsewhere { until: Instant },
    /// The head holds the key: its lease, kept up to date by its renewals.
    Head(Lease),
    /// The head is a set waiting in this process for its turn at a later key (in lock order),
    /// whose queue this is: what its head knows stands for this key too. (Weak: a key's entry
    /// is forgotten when nobody holds or waits for its turn.)
    Behind(Weak<Entry>),
}

impl Entry {
    fn new(capacity: u32) -> Self {
        // Only a 32-bit target's limit is below `u32::MAX` (the readers' capacity).
        let capacity = capacity.min(u32::try_from(Semaphore::MAX_PERMITS).unwrap_or(u32::MAX));
        Self {
            turn: Semaphore::new(capacity as usize),
            capacity,
            holder: Mutex::default(),
            published: Notify::new(),
        }
    }

    fn holder(&self) -> std::sync::MutexGuard<'_, Holder> {
        self.holder.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Publishes what the head knows now, and tells the waiters waiting for it.
    fn publish(&self, holder: Holder) {
        *self.holder() = holder;
        self.published.notify_waiters();
    }
}

/// This request's turn at a key, within the process. Dropping it passes the turn on.
#[derive(Debug)]
pub(crate) struct Turn {
    key: LockKey,
    queues: Arc<LocalQueues>,
    // `None` only while dropping.
    entry: Option<Arc<Entry>>,
    /// Whether it holds its permits (taken, forgotten, added back when dropped).
    held: bool,
    /// The permits of the key's queue this turn takes (1 for a plain key).
    weight: u32,
}

/// A waiter that gave up in the local queue: how long the key's holder has left, as far as the
/// head of the queue knows (`None` if it has not heard from the store yet); or, when its turn
/// never came because the store did not answer the head, that failure.
#[derive(Debug, Clone)]
pub(crate) enum GaveUp {
    Held { holder_left: Option<Duration> },
    Unavailable(StoreError),
}

/// Table capacity (entries) above which a mostly empty table is shrunk.
const SHRINK_ABOVE: usize = 1024;

impl LocalQueues {
    /// Waits for this process's turn at `key`, or gives up when the deadline passes first. A
    /// head whose call to the store is on its way then is given until `store_timeout` after it
    /// sent it to answer, so that the waiter gives up with what the store said.
    #[cfg(test)]
    pub(crate) async fn turn(
        self: &Arc<Self>,
        key: &LockKey,
        deadline: Option<Instant>,
        store_timeout: Duration,
    ) -> Result<Turn, GaveUp> {
        let mut turn = self.join(key);
        if !turn.try_take() {
            turn.wait(deadline, store_timeout).await?;
        }
        Ok(turn)
    }

    /// Joins `key`'s queue, without its turn yet. Constructed before waiting, so that giving up
    /// (or being dropped) still cleans the entry.
    fn join(self: &Arc<Self>, key: &LockKey) -> Turn {
        let (weight, capacity) = key
            .share()
            .map_or((1, 1), |share| (share.weight(), share.capacity()));
        let key = key.clone();
        let entry = {
            let mut queues = self.queues.lock().unwrap_or_else(PoisonError::into_inner);
            Arc::clone(
                queues
                    .entry(key.clone())
                    .or_insert_with(|| Arc::new(Entry::new(capacity))),
            )
        };
        // Users of one key agree on its capacity; one that does not takes at most all of it.
        let weight = weight.min(entry.capacity);
        Turn {
            key,
            queues: Arc::clone(self),
            entry: Some(entry),
            held: false,
            weight,
        }
    }

    /// Waits for this process's turn at every key of `keys`, one after the other in lock order,
    /// or gives up when the deadline passes first (then the turns it had are passed on).
    pub(crate) async fn turns(
        self: &Arc<Self>,
        keys: &KeySet,
        deadline: Option<Instant>,
        store_timeout: Duration,
    ) -> Result<Turns, GaveUp> {
        let mut turns = Turns::default();
        for key in keys {
            let mut turn = self.join(key);
            if !turn.try_take() {
                turns.behind(&turn);
                turn.wait(deadline, store_timeout).await?;
            }
            turns.push(turn);
        }
        Ok(turns)
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.queues.lock().unwrap().len()
    }

    #[cfg(test)]
    fn capacity(&self) -> usize {
        self.queues.lock().unwrap().capacity()
    }
}

impl Turn {
    fn entry(&self) -> &Entry {
        self.entry
            .as_deref()
            .expect("a turn has its entry until dropped")
    }

    /// Takes the turn if it is free now.
    fn try_take(&mut self) -> bool {
        let taken = self
            .entry()
            .turn
            .try_acquire_many(self.weight)
            .map(|permits| {
                permits.forget();
            });
        self.held = taken.is_ok();
        self.held
    }

    /// Waits for the turn, or gives up when the deadline passes first.
    async fn wait(
        &mut self,
        deadline: Option<Instant>,
        store_timeout: Duration,
    ) -> Result<(), GaveUp> {
        let entry = Arc::clone(
            self.entry
                .as_ref()
                .expect("a turn has its entry until dropped"),
        );
        // Never closed, so acquiring fails only by the deadline.
        let permits = match deadline {
            Some(deadline) => {
                match timeout_at(deadline, entry.turn.acquire_many(self.weight)).await {
                    Ok(Ok(permits)) => permits,
                    _ => return Err(self.gave_up(store_timeout).await),
                }
            }
            None => match entry.turn.acquire_many(self.weight).await {
                Ok(permits) => permits,
                Err(_) => return Err(self.gave_up(store_timeout).await),
            },
        };
        permits.forget();
        self.held = true;
        Ok(())
    }

    /// The queue whose head's knowledge stands for this key: this one, or the one a set at the
    /// head of this one waits in (and so on: each later in lock order, so never a cycle).
    fn waited_on(&self) -> Arc<Entry> {
        let mut entry = Arc::clone(
            self.entry
                .as_ref()
                .expect("a turn has its entry until dropped"),
        );
        loop {
            let next = match &*entry.holder() {
                Holder::Behind(next) => next.upgrade(),
                _ => None,
            };
            match next {
                Some(next) => entry = next,
                None => return entry,
            }
        }
    }

    /// Why a waiter whose deadline passed gives up, from what the queue's head published: the
    /// holder's time left; or the store's failure, waiting first for the answer to a call the
    /// head has on its way (until `store_timeout` after it was sent: then it failed). Behind a
    /// set that waits in this process for a later key, from what that key's head published.
    async fn gave_up(&self, store_timeout: Duration) -> GaveUp {
        loop {
            let entry = self.waited_on();
            // Registered before reading, so that a publication in between is not missed.
            let published = entry.published.notified();
            let asked_at = match &*entry.holder() {
                Holder::Unknown => return GaveUp::Held { holder_left: None },
                // Changed since: follow it again.
                Holder::Behind(next) if next.strong_count() > 0 => continue,
                Holder::Behind(_) => return GaveUp::Held { holder_left: None },
                Holder::Elsewhere { until } => {
                    let holder_left = Some(until.saturating_duration_since(Instant::now()));
                    return GaveUp::Held { holder_left };
                }
                Holder::Head(lease) => {
                    let holder_left = Some(lease.time_left());
                    return GaveUp::Held { holder_left };
                }
                Holder::Failing(error) => return GaveUp::Unavailable(error.clone()),
                Holder::Asking { since } => *since,
            };
            let timed_out = asked_at + store_timeout;
            if Instant::now() >= timed_out {
                return GaveUp::Unavailable(StoreError::timeout(store_timeout));
            }
            tokio::select! {
                () = published => {}
                () = sleep_until(timed_out) => {}
            }
        }
    }

    /// The head sends a call to the store: a waiter that gives up meanwhile waits for its
    /// answer. (What the head knew of another holder stands until the answer.)
    pub(crate) fn asking(&self) {
        let entry = self.entry();
        let mut holder = entry.holder();
        if matches!(
            *holder,
            Holder::Unknown | Holder::Failing(_) | Holder::Behind(_)
        ) {
            *holder = Holder::Asking {
                since: Instant::now(),
            };
        }
    }

    /// The store answered the head that the key is held by someone else for `expires_in`.
    pub(crate) fn held_elsewhere(&self, expires_in: Option<Duration>) {
        match expires_in {
            Some(expires_in) => self.entry().publish(Holder::Elsewhere {
                until: Instant::now() + expires_in,
            }),
            None => self.answered(),
        }
    }

    /// The store answered the head, and said nothing of another holder of this key: what the
    /// head knew of one stands; that it was asking, or that the store failed, does not.
    fn answered(&self) {
        let entry = self.entry();
        let mut holder = entry.holder();
        if matches!(*holder, Holder::Asking { .. } | Holder::Failing(_)) {
            *holder = Holder::Unknown;
        }
        drop(holder);
        entry.published.notify_waiters();
    }

    /// The head's call failed: a waiter that gives up answers with this failure.
    pub(crate) fn failed(&self, error: &StoreError) {
        self.entry().publish(Holder::Failing(error.clone()));
    }

    /// The head acquired the key: a waiter that gives up is told this lease's time left.
    pub(crate) fn acquired(&self, lease: &Lease) {
        self.entry().publish(Holder::Head(lease.clone()));
    }
}

/// A request's turns at the keys of its lease, in lock order. Dropping them passes them on.
#[derive(Debug, Default)]
pub(crate) struct Turns {
    // The first apart, so that a lease on one key allocates nothing here.
    first: Option<Turn>,
    rest: Vec<Turn>,
}

impl Turns {
    fn push(&mut self, turn: Turn) {
        if self.first.is_none() {
            self.first = Some(turn);
        } else {
            self.rest.push(turn);
        }
    }

    fn all(&self) -> impl Iterator<Item = &Turn> {
        self.first.iter().chain(&self.rest)
    }

    /// The set waits in this process for its turn at `next`'s key (later in lock order than
    /// those it has): published at the keys it has, unless a failure of the store stands there.
    fn behind(&self, next: &Turn) {
        let next = next.entry.as_ref().map_or_else(Weak::new, Arc::downgrade);
        for turn in self.all() {
            let entry = turn.entry();
            if !matches!(*entry.holder(), Holder::Failing(_)) {
                entry.publish(Holder::Behind(next.clone()));
            }
        }
    }

    /// A call goes to the store for every key.
    pub(crate) fn asking(&self) {
        self.all().for_each(Turn::asking);
    }

    /// The store answered that the key at `blocked` (in lock order) is held by someone else,
    /// for `expires_in`: told to the waiters behind this request at that key (and that the
    /// store answered, to those at the others).
    pub(crate) fn held_elsewhere(&self, blocked: usize, expires_in: Option<Duration>) {
        for (i, turn) in self.all().enumerate() {
            if i == blocked {
                turn.held_elsewhere(expires_in);
            } else {
                turn.answered();
            }
        }
    }

    /// The store failed the call for every key.
    pub(crate) fn failed(&self, error: &StoreError) {
        self.all().for_each(|turn| turn.failed(error));
    }

    /// Every key is held by `lease`: a waiter at any of them that gives up is told its time left.
    pub(crate) fn acquired(&self, lease: &Lease) {
        self.all().for_each(|turn| turn.acquired(lease));
    }
}

impl Drop for Turns {
    fn drop(&mut self) {
        // Passed on in the reverse of the order they were taken.
        while let Some(turn) = self.rest.pop() {
            drop(turn);
        }
    }
}

impl Drop for Turn {
    fn drop(&mut self) {
        // Only the holder of the turn publishes: it forgets what it knew of the holder before
        // passing the turn on, so the next head starts from `Unknown`; a failure of the store
        // stands until the next head asks it. Waiting waiters are told either way.
        if self.held {
            let entry = self.entry();
            let mut holder = entry.holder();
            if !matches!(*holder, Holder::Failing(_)) {
                *holder = Holder::Unknown;
            }
            drop(holder);
            entry.published.notify_waiters();
        }
        // Pass the turn on first, then forget the key if nobody else holds or waits for it
        // (every holder and waiter keeps a clone of the entry, taken under this same lock).
        if std::mem::take(&mut self.held) {
            self.entry().turn.add_permits(self.weight as usize);
        }
        let mut queues = self
            .queues
            .queues
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        drop(self.entry.take());
        if queues
            .get(&self.key)
            .is_some_and(|q| Arc::strong_count(q) == 1)
        {
            queues.remove(&self.key);
            // A burst of distinct keys grew the table: give the memory back once it is mostly
            // empty, rather than keeping the burst's size for good.
            if queues.capacity() > SHRINK_ABOVE && queues.len() * 8 < queues.capacity() {
                let keep = queues.len() * 2;
                queues.shrink_to(keep);
            }
        }
    }
}

#[cfg(test)]
mod tests;
