//! In-process coalescing: requests of one process that want the same key queue here, first come
//! first served, and only the head of the queue contends in the store.
//!
//! Two effects: a process sends one contender per key to Redis however many of its requests
//! wait, and a waiter behind a holder of the same process is woken the moment that holder
//! releases, not by a timer.
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
//! would be had it asked the store itself.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex, PoisonError},
    time::Duration,
};

use tokio::{
    sync::{Mutex as FairMutex, OwnedMutexGuard},
    time::{Instant, timeout_at},
};

use crate::{
    key::{KeySet, LockKey},
    lease::Lease,
};

/// The local queues of one [`Locker`](crate::Locker), one per key in use.
#[derive(Debug, Default)]
pub(crate) struct LocalQueues {
    // A key's entry lives while anyone holds or waits for its turn.
    queues: Mutex<HashMap<Arc<[u8]>, Arc<Entry>>>,
}

/// One key's queue, and what its head knows of the key's holder.
#[derive(Debug, Default)]
struct Entry {
    /// Tokio's mutex queues its waiters in FIFO order; holding it is holding the turn.
    turn: Arc<FairMutex<()>>,
    /// Published by the turn's holder, read by a waiter that gives up.
    holder: Mutex<Holder>,
}

/// What the head of a key's queue knows of the key's holder.
#[derive(Debug, Default)]
enum Holder {
    /// The head has not heard from the store yet.
    #[default]
    Unknown,
    /// The store told the head that someone else holds the key, until about then.
    Elsewhere { until: Instant },
    /// The head holds the key: its lease, kept up to date by its renewals.
    Head(Lease),
}

impl Entry {
    fn holder(&self) -> std::sync::MutexGuard<'_, Holder> {
        self.holder.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// This request's turn at a key, within the process. Dropping it passes the turn on.
#[derive(Debug)]
pub(crate) struct Turn {
    key: Arc<[u8]>,
    queues: Arc<LocalQueues>,
    // `None` only while dropping.
    entry: Option<Arc<Entry>>,
    guard: Option<OwnedMutexGuard<()>>,
}

/// A waiter that gave up in the local queue: how long the key's holder has left, as far as the
/// head of the queue knows (`None` if it has not heard from the store yet).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct GaveUp {
    pub(crate) holder_left: Option<Duration>,
}

/// Table capacity (entries) above which a mostly empty table is shrunk.
const SHRINK_ABOVE: usize = 1024;

impl LocalQueues {
    /// Waits for this process's turn at `key`, or gives up when the deadline passes first.
    pub(crate) async fn turn(
        self: &Arc<Self>,
        key: &LockKey,
        deadline: Option<Instant>,
    ) -> Result<Turn, GaveUp> {
        let key = key.shared();
        let entry = {
            let mut queues = self.queues.lock().unwrap_or_else(PoisonError::into_inner);
            Arc::clone(queues.entry(key.clone()).or_default())
        };
        let queue = Arc::clone(&entry.turn);
        // Constructed first, so that giving up (or being dropped) still cleans the entry.
        let mut turn = Turn {
            key,
            queues: Arc::clone(self),
            entry: Some(entry),
            guard: None,
        };
        let guard = match Arc::clone(&queue).try_lock_owned() {
            Ok(guard) => guard,
            Err(_) => match deadline {
                Some(deadline) => match timeout_at(deadline, queue.lock_owned()).await {
                    Ok(guard) => guard,
                    Err(_) => {
                        return Err(GaveUp {
                            holder_left: turn.holder_left(),
                        });
                    }
                },
                None => queue.lock_owned().await,
            },
        };
        turn.guard = Some(guard);
        Ok(turn)
    }

    /// Waits for this process's turn at every key of `keys`, one after the other in lock order,
    /// or gives up when the deadline passes first (then the turns it had are passed on).
    pub(crate) async fn turns(
        self: &Arc<Self>,
        keys: &KeySet,
        deadline: Option<Instant>,
    ) -> Result<Turns, GaveUp> {
        let mut turns = Turns::default();
        for key in keys {
            turns.push(self.turn(key, deadline).await?);
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

    /// The holder's time left, as the queue's head last published it.
    fn holder_left(&self) -> Option<Duration> {
        match &*self.entry().holder() {
            Holder::Unknown => None,
            Holder::Elsewhere { until } => Some(until.saturating_duration_since(Instant::now())),
            Holder::Head(lease) => Some(lease.time_left()),
        }
    }

    /// The store answered the head that the key is held by someone else for `expires_in`.
    pub(crate) fn held_elsewhere(&self, expires_in: Option<Duration>) {
        if let Some(expires_in) = expires_in {
            *self.entry().holder() = Holder::Elsewhere {
                until: Instant::now() + expires_in,
            };
        }
    }

    /// The head acquired the key: a waiter that gives up is told this lease's time left.
    pub(crate) fn acquired(&self, lease: &Lease) {
        *self.entry().holder() = Holder::Head(lease.clone());
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

    fn get(&self, i: usize) -> Option<&Turn> {
        match i {
            0 => self.first.as_ref(),
            i => self.rest.get(i - 1),
        }
    }

    /// The store answered that the key at `blocked` (in lock order) is held by someone else,
    /// for `expires_in`: told to the waiters behind this request at that key.
    pub(crate) fn held_elsewhere(&self, blocked: usize, expires_in: Option<Duration>) {
        if let Some(turn) = self.get(blocked) {
            turn.held_elsewhere(expires_in);
        }
    }

    /// Every key is held by `lease`: a waiter at any of them that gives up is told its time left.
    pub(crate) fn acquired(&self, lease: &Lease) {
        for turn in self.first.iter().chain(&self.rest) {
            turn.acquired(lease);
        }
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
        // Only the holder of the turn publishes: it forgets what it knew before passing the
        // turn on, so the next head starts from `Unknown`.
        if self.guard.is_some() {
            *self.entry().holder() = Holder::Unknown;
        }
        // Pass the turn on first, then forget the key if nobody else holds or waits for it
        // (every holder and waiter keeps a clone of the entry, taken under this same lock).
        drop(self.guard.take());
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
mod tests {
    use super::*;
    use std::time::Duration;

    fn key(v: &str) -> LockKey {
        LockKey::new("p:", "s", v.as_bytes(), 64).unwrap()
    }

    #[tokio::test(start_paused = true)]
    async fn first_come_first_served_and_cleaned_up() {
        let queues = Arc::new(LocalQueues::default());
        let first = queues.turn(&key("k"), None).await.unwrap();
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut waiters = Vec::new();
        for i in 0..5 {
            let (queues, order) = (Arc::clone(&queues), Arc::clone(&order));
            waiters.push(tokio::spawn(async move {
                let _turn = queues.turn(&key("k"), None).await.unwrap();
                order.lock().unwrap().push(i);
                tokio::time::sleep(Duration::from_millis(1)).await;
            }));
            tokio::task::yield_now().await;
        }
        // A waiter that gives up leaves the queue without blocking the rest.
        let deadline = Instant::now() + Duration::from_millis(5);
        assert!(queues.turn(&key("k"), Some(deadline)).await.is_err());
        assert!(queues.turn(&key("other"), Some(deadline)).await.is_ok());
        drop(first);
        for waiter in waiters {
            waiter.await.unwrap();
        }
        assert_eq!(*order.lock().unwrap(), [0, 1, 2, 3, 4]);
        assert_eq!(queues.len(), 0, "entries left behind");
    }

    #[tokio::test]
    async fn a_burst_of_keys_gives_its_memory_back() {
        let queues = Arc::new(LocalQueues::default());
        let mut turns = Vec::new();
        for i in 0..5000 {
            turns.push(queues.turn(&key(&i.to_string()), None).await.unwrap());
        }
        assert!(queues.capacity() >= 5000);
        drop(turns);
        assert_eq!(queues.len(), 0);
        assert!(
            queues.capacity() <= 2 * SHRINK_ABOVE,
            "kept {} entries' room",
            queues.capacity()
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_waiter_dropped_while_queued_leaves_no_entry() {
        let queues = Arc::new(LocalQueues::default());
        let holder = queues.turn(&key("k"), None).await.unwrap();
        let waiter = tokio::spawn({
            let queues = Arc::clone(&queues);
            async move { queues.turn(&key("k"), None).await.map(drop) }
        });
        tokio::task::yield_now().await;
        waiter.abort();
        let _ = waiter.await;
        drop(holder);
        assert_eq!(queues.len(), 0, "the dropped waiter's entry stayed behind");
    }

    #[tokio::test(start_paused = true)]
    async fn sets_take_their_turns_in_lock_order_and_never_wait_in_a_cycle() {
        let queues = Arc::new(LocalQueues::default());
        let (a, b, c) = (key("a"), key("b"), key("c"));
        let ab = KeySet::from([a.clone(), b.clone()]);
        let bc = KeySet::from([c.clone(), b.clone()]);
        let ba = KeySet::from([b.clone(), a.clone()]);
        // Many sets over overlapping keys, each named in its own order, and single keys: all
        // are served, however they interleave.
        let served = Arc::new(Mutex::new(0));
        let mut tasks = Vec::new();
        for i in 0..30 {
            let keys = [ab.clone(), bc.clone(), ba.clone(), KeySet::from(b.clone())][i % 4].clone();
            let (queues, served) = (Arc::clone(&queues), Arc::clone(&served));
            tasks.push(tokio::spawn(async move {
                let turns = queues.turns(&keys, None).await.unwrap();
                tokio::time::sleep(Duration::from_millis(1)).await;
                drop(turns);
                *served.lock().unwrap() += 1;
            }));
        }
        for task in tasks {
            tokio::time::timeout(Duration::from_secs(60), task)
                .await
                .expect("a cycle of waits")
                .unwrap();
        }
        assert_eq!(*served.lock().unwrap(), 30);
        assert_eq!(queues.len(), 0, "entries left behind");

        // A set waiting behind a holder of one key keeps its place there: single-key
        // requests that come after it wait behind it.
        let holder = queues.turn(&b, None).await.unwrap();
        let order = Arc::new(Mutex::new(Vec::new()));
        let set = tokio::spawn({
            let (queues, order, ab) = (Arc::clone(&queues), Arc::clone(&order), ab.clone());
            async move {
                let _turns = queues.turns(&ab, None).await.unwrap();
                order.lock().unwrap().push("set");
            }
        });
        tokio::task::yield_now().await;
        let single = tokio::spawn({
            let (queues, order, b) = (Arc::clone(&queues), Arc::clone(&order), b.clone());
            async move {
                let _turn = queues.turn(&b, None).await.unwrap();
                order.lock().unwrap().push("single");
            }
        });
        tokio::task::yield_now().await;
        drop(holder);
        set.await.unwrap();
        single.await.unwrap();
        assert_eq!(*order.lock().unwrap(), ["set", "single"]);

        // A set that gives up passes on the turns it had.
        let holder = queues.turn(&b, None).await.unwrap();
        let soon = Some(Instant::now() + Duration::from_millis(5));
        let gave_up = queues.turns(&ab, soon).await;
        assert!(gave_up.is_err());
        assert!(
            queues.turn(&a, soon).await.is_ok(),
            "the set kept its turn at a"
        );
        drop(holder);
        assert_eq!(queues.len(), 0, "entries left behind");
    }

    #[tokio::test(start_paused = true)]
    async fn a_waiter_that_gives_up_hears_the_holders_time_left() {
        let queues = Arc::new(LocalQueues::default());
        let soon = || Some(Instant::now() + Duration::from_millis(5));
        let head = queues.turn(&key("k"), None).await.unwrap();
        // The head has not heard from the store yet.
        let gave_up = queues.turn(&key("k"), soon()).await.unwrap_err();
        assert_eq!(gave_up.holder_left, None);
        // The store told the head that another process holds the key for 4 s more.
        head.held_elsewhere(Some(Duration::from_secs(4)));
        tokio::time::advance(Duration::from_secs(1)).await;
        let gave_up = queues.turn(&key("k"), soon()).await.unwrap_err();
        assert_eq!(
            gave_up.holder_left,
            Some(Duration::from_secs(3) - Duration::from_millis(5))
        );
        // An answer without a TTL keeps what the head knew.
        head.held_elsewhere(None);
        assert!(
            queues
                .turn(&key("k"), soon())
                .await
                .unwrap_err()
                .holder_left
                .is_some()
        );
        // The head acquired: its own lease, renewals included.
        let lease = Lease::new(key("k"), 1, Instant::now(), Duration::from_secs(10));
        head.acquired(&lease);
        tokio::time::advance(Duration::from_secs(2)).await;
        lease.renewed(Instant::now(), Duration::from_secs(10));
        let gave_up = queues.turn(&key("k"), soon()).await.unwrap_err();
        assert_eq!(
            gave_up.holder_left,
            Some(Duration::from_secs(10) - Duration::from_millis(5))
        );
        // The next head starts from nothing.
        drop(head);
        let next = queues.turn(&key("k"), None).await.unwrap();
        let gave_up = queues.turn(&key("k"), soon()).await.unwrap_err();
        assert_eq!(gave_up.holder_left, None);
        drop(next);
        assert_eq!(queues.len(), 0, "entries left behind");
    }
}
