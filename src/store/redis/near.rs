//! Acquires sent from the caller's runtime: a driver, and a connection, on each of a few
//! multi-thread runtimes that acquire through the store.
//!
//! Through the store's own driver (on the crate's runtime, [`commit`](super::commit)) every
//! operation crosses to the crate's thread and back: two wake-ups of another thread each way.
//! An acquire is the one operation a caller always awaits on its way in, so where the caller
//! runs on a multi-thread runtime (which keeps being driven while the process serves, and whose
//! workers steal each other's tasks), its acquires go through a copy of the store whose driver
//! and connection are that runtime's: no thread is woken but the runtime's own. Everything
//! else (renewals, releases, records), which must go on when the caller's runtime stalls or is
//! gone, keeps to the crate's runtime.
//!
//! A runtime's driver is opened in the background at its first acquire (that acquire, and any
//! until the connection is open, goes through the store's own driver), and is given up when its
//! runtime is gone (its inbox closed: the operation goes through the store's own driver
//! instead). At most [`MOST`] runtimes have one at a time; the others' acquires go through the
//! store's own driver, as do a current-thread runtime's (whose driver would stop with its
//! `block_on`).
//!
//! Order: a release goes through the store's own driver, on another connection, so it can
//! overtake an acquire in flight here when the acquire's caller gave up before its answer (the
//! guard's release on drop). Such an acquire is undone here: a driver that cannot hand an
//! acquire's answer to its caller sends the release itself, on its own connection, after it.
//! Only an acquire in flight when its runtime shuts down cannot be undone; then its key is held
//! until its TTL (time, never exclusion).

use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use redis::{Client, aio::ConnectionManager};
use tokio::{
    runtime::{Handle, Id, RuntimeFlavor},
    time::Instant,
};

use super::{
    RedisStore,
    commit::Committer,
    connection::{Transport, manager_config},
};
use crate::telemetry::Chain;

/// The most runtimes with a driver of their own at once.
const MOST: usize = 4;

/// How long a runtime whose connection could not be opened waits before another try.
const RETRY_AFTER: Duration = Duration::from_secs(5);

/// The drivers of one store's queue on its callers' runtimes.
pub(super) struct Near {
    client: Arc<Client>,
    drivers: Mutex<Vec<Driver>>,
}

struct Driver {
    runtime: Id,
    state: State,
}

enum State {
    Opening,
    /// The copy of the store whose driver and connection are the runtime's.
    Open(Arc<RedisStore>),
    Failed(Instant),
}

impl Near {
    pub(super) fn new(client: Arc<Client>) -> Self {
        Self {
            client,
            drivers: Mutex::new(Vec::new()),
        }
    }

    /// For a copy of the store with a queue of its own (other settings).
    pub(super) fn again(&self) -> Self {
        Self::new(Arc::clone(&self.client))
    }

    /// The copy of `store` whose driver runs on the current runtime, if it has one open; a
    /// multi-thread runtime without one (and room for it) starts opening it.
    pub(super) fn store(self: &Arc<Self>, store: &RedisStore) -> Option<Arc<RedisStore>> {
        let runtime = Handle::try_current().ok()?;
        if runtime.runtime_flavor() != RuntimeFlavor::MultiThread {
            return None;
        }
        let id = runtime.id();
        let mut drivers = self.drivers.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(driver) = drivers.iter().find(|d| d.runtime == id) {
            match &driver.state {
                State::Open(near) if !near.committer.is_closed() => return Some(Arc::clone(near)),
                State::Failed(at) if at.elapsed() >= RETRY_AFTER => {}
                State::Open(_) => {}
                State::Opening | State::Failed(_) => return None,
            }
        }
        // Runtimes gone (their drivers' inboxes closed), and failures old enough to try again.
        drivers.retain(|d| match &d.state {
            State::Open(near) => !near.committer.is_closed(),
            State::Failed(at) => at.elapsed() < RETRY_AFTER,
            State::Opening => true,
        });
        if drivers.len() >= MOST {
            return None;
        }
        drivers.push(Driver {
            runtime: id,
            state: State::Opening,
        });
        drop(drivers);
        let (near, store) = (Arc::clone(self), store.clone());
        runtime.spawn(async move {
            // Dropped unfinished (its runtime shut down meanwhile), it leaves no entry opening
            // for ever.
            let opening = Unlist {
                near: &near,
                runtime: id,
            };
            let opened =
                ConnectionManager::new_with_config((*near.client).clone(), manager_config()).await;
            std::mem::forget(opening);
            let state = match opened {
                Ok(connection) => State::Open(Arc::new(RedisStore {
                    transport: Transport::Here(connection),
                    committer: Arc::new(Committer::here(Handle::current())),
                    ..store
                })),
                Err(error) => {
                    tracing::debug!(
                        error = %Chain(&error),
                        "cannot open a connection on this runtime; its acquires go through the \
                         crate's runtime"
                    );
                    State::Failed(Instant::now())
                }
            };
            let mut drivers = near.drivers.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(driver) = drivers.iter_mut().find(|d| d.runtime == id) {
                driver.state = state;
            }
        });
        None
    }
}

/// Takes a runtime's entry off the list when dropped.
struct Unlist<'a> {
    near: &'a Near,
    runtime: Id,
}

impl Drop for Unlist<'_> {
    fn drop(&mut self) {
        let mut drivers = self.near.drivers.lock().unwrap_or_else(|p| p.into_inner());
        drivers.retain(|d| d.runtime != self.runtime);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tower_lock_testkit::RedisServer;

    use super::super::{RedisStore, wire::Op};
    use crate::{
        key::LockKey,
        store::{Acquire, LockStore},
        token::Token,
    };

    fn key(value: &str) -> LockKey {
        LockKey::new("tower-lock:", "near", value.as_bytes(), 64).unwrap()
    }

    fn multi_thread() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap()
    }

    /// The copy of `store` whose driver is the current runtime's, once it is open (an acquire
    /// starts opening it).
    async fn near_copy(store: &RedisStore) -> Option<std::sync::Arc<RedisStore>> {
        let near = store.committer.near().expect("a connected store has near drivers");
        for _ in 0..200 {
            if let Some(copy) = near.store(store) {
                return Some(copy);
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        None
    }

    /// A multi-thread runtime's acquires go through a driver and connection of its own once
    /// it is open; a current-thread runtime's never do. When the runtime is gone, another's
    /// acquires go on (through a driver of its own in turn), and the store answers as before.
    #[test]
    fn a_multi_thread_runtime_acquires_through_a_driver_of_its_own() {
        let server = RedisServer::start();
        let ttl = Duration::from_secs(30);
        // The store's own driver starts at its first operation, on the runtime of that
        // operation in the crate's unit tests (on the crate's runtime otherwise): one that
        // lives as long as the test.
        let home = multi_thread();
        let store = home.block_on(async {
            let store = RedisStore::connect(server.url()).await.unwrap();
            let token = Token::generate().unwrap();
            store.acquire(&key("home"), &token, ttl).await.unwrap();
            store
        });
        let first = multi_thread();
        first.block_on(async {
            let token = Token::generate().unwrap();
            let answer = store.acquire(&key("a"), &token, ttl).await.unwrap();
            assert!(matches!(answer, Acquire::Acquired { .. }), "{answer:?}");
            let copy = near_copy(&store).await.expect("a driver of its own");
            let answer = store.acquire(&key("b"), &token, ttl).await.unwrap();
            assert!(matches!(answer, Acquire::Acquired { .. }), "{answer:?}");
            // Its driver took that acquire.
            assert!(copy.committer.started(), "not through the runtime's driver");
            assert!(store.release(&key("b"), &token).await.unwrap());
        });
        drop(first);

        let current = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        current.block_on(async {
            let near = store.committer.near().unwrap();
            assert!(near.store(&store).is_none());
            let token = Token::generate().unwrap();
            let answer = store.acquire(&key("c"), &token, ttl).await.unwrap();
            assert!(matches!(answer, Acquire::Acquired { .. }), "{answer:?}");
        });

        let second = multi_thread();
        second.block_on(async {
            let token = Token::generate().unwrap();
            let answer = store.acquire(&key("d"), &token, ttl).await.unwrap();
            assert!(matches!(answer, Acquire::Acquired { .. }), "{answer:?}");
            assert!(near_copy(&store).await.is_some(), "no driver of its own");
            let answer = store.acquire(&key("a"), &token, ttl).await.unwrap();
            assert!(matches!(answer, Acquire::Contended { .. }), "{answer:?}");
            let drivers = store.committer.near().unwrap().drivers.lock().unwrap();
            // Its own and `home`'s: the first runtime's is gone.
            assert_eq!(drivers.len(), 2, "the first runtime's driver is still listed");
        });
    }

    /// An acquire sent by a runtime's driver whose caller left before its answer (the guard's
    /// release, sent through the store's own driver on another connection, may overtake it)
    /// is released by that driver, on its connection, after it. Without that, nothing frees
    /// the key before its TTL here (checked by hand).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_acquire_whose_caller_left_is_released_after_it() {
        let server = RedisServer::start();
        let store = RedisStore::connect(server.url()).await.unwrap();
        let token = Token::generate().unwrap();
        let ttl = Duration::from_secs(30);
        store.acquire(&key("warm"), &token, ttl).await.unwrap();
        let copy = near_copy(&store).await.expect("a driver of its own");
        // Redis holds every client's commands for a while: the acquire is sent, and waits.
        server.cli(&["CLIENT", "PAUSE", "500", "ALL"]);
        let op = Op::Acquire {
            key: key("left"),
            token: token.clone(),
            ttl,
            place: None,
        };
        let gave_up = tokio::time::timeout(Duration::from_millis(100), copy.submit(op)).await;
        assert!(gave_up.is_err(), "answered while Redis was paused: {gave_up:?}");
        let mut conn = server.client().await;
        let started = std::time::Instant::now();
        loop {
            let exists: i64 = ::redis::cmd("EXISTS")
                .arg(key("left").as_bytes())
                .query_async(&mut conn)
                .await
                .unwrap();
            if exists == 0 && started.elapsed() > Duration::from_millis(600) {
                break;
            }
            assert!(
                started.elapsed() < Duration::from_secs(5),
                "the acquire nobody took keeps its key"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}
