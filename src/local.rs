//! In-process coalescing: requests of one process that want the same key queue here, first come
//! first served, and only the head of the queue contends in the store.
//!
//! Two effects: a process sends one contender per key to Redis however many of its requests
//! wait, and a waiter behind a holder of the same process is woken the moment that holder
//! releases, not by a timer.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
};

use tokio::{
    sync::{Mutex as FairMutex, OwnedMutexGuard},
    time::{Instant, timeout_at},
};

use crate::key::LockKey;

/// The local queues of one [`Locker`](crate::Locker), one per key in use.
#[derive(Debug, Default)]
pub(crate) struct LocalQueues {
    // A key's entry lives while anyone holds or waits for its turn. Tokio's mutex queues its
    // waiters in FIFO order.
    queues: Mutex<HashMap<Arc<[u8]>, Queue>>,
}

/// One key's queue: tokio's mutex queues its waiters in FIFO order.
type Queue = Arc<FairMutex<()>>;

/// This request's turn at a key, within the process. Dropping it passes the turn on.
#[derive(Debug)]
pub(crate) struct Turn {
    key: Arc<[u8]>,
    queues: Arc<LocalQueues>,
    guard: Option<OwnedMutexGuard<()>>,
}

/// Table capacity (entries) above which a mostly empty table is shrunk.
const SHRINK_ABOVE: usize = 1024;

impl LocalQueues {
    /// Waits for this process's turn at `key`; `None` if the deadline passes first.
    pub(crate) async fn turn(
        self: &Arc<Self>,
        key: &LockKey,
        deadline: Option<Instant>,
    ) -> Option<Turn> {
        let key = key.shared();
        let queue = {
            let mut queues = self.queues.lock().unwrap_or_else(|p| p.into_inner());
            Arc::clone(queues.entry(key.clone()).or_default())
        };
        // Constructed first, so that giving up (or being dropped) still cleans the entry.
        let mut turn = Turn {
            key,
            queues: Arc::clone(self),
            guard: None,
        };
        let guard = match Arc::clone(&queue).try_lock_owned() {
            Ok(guard) => guard,
            Err(_) => match deadline {
                Some(deadline) => timeout_at(deadline, queue.lock_owned()).await.ok()?,
                None => queue.lock_owned().await,
            },
        };
        turn.guard = Some(guard);
        Some(turn)
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

impl Drop for Turn {
    fn drop(&mut self) {
        // Pass the turn on first, then forget the key if nobody else holds or waits for it
        // (every holder and waiter keeps a clone of the entry, taken under this same lock).
        drop(self.guard.take());
        let mut queues = self.queues.queues.lock().unwrap_or_else(|p| p.into_inner());
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
        assert!(queues.turn(&key("k"), Some(deadline)).await.is_none());
        assert!(queues.turn(&key("other"), Some(deadline)).await.is_some());
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
}
