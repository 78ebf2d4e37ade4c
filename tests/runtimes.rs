//! One store used from several Tokio runtimes that come and go, on a real `redis-server`: no
//! operation waits for a future or task of another runtime. A runtime shut down while its
//! operations were in flight and queued, or a current-thread runtime left with its work unpolled
//! (its `block_on` returned), holds up nobody else: the other runtimes' operations on fresh keys
//! are answered as soon as Redis answers, and their background leases are renewed. The store's
//! connection works whatever became of the runtime that opened it (its I/O runs on the crate's
//! own runtime), the usual sync bridges (a runtime per request, a runtime per thread) work, a
//! background lease held across synchronous work is renewed, a guard dropped at the end of a
//! runtime's `block_on` is released, and a release awaited on a runtime that then stalls frees
//! the key for other instances during the stall, even when it waited behind another call. A
//! `Locker` and a `LockLayer` polled outside any runtime (another executor) work too, and a
//! lease held while a response body streams is renewed after the runtime that ran its handler
//! went idle or away. A script load (after `SCRIPT FLUSH`) started by a runtime that then went
//! idle holds up nobody either.
//!
//! Redis is stalled for a moment with `CLIENT PAUSE` so that the runtime that goes away has one
//! call in flight and operations queued behind it when it goes.

use std::time::{Duration, Instant};

use futures_util::future::join_all;
use tokio::runtime::{Builder, Runtime};
use tower_lock::{
    LockConfig, Locker, RedisStore, Wait,
    fence::{FencedData, data_key},
    key::LockKey,
    store::{Acquire, LockStore, StoreError, Token},
};
use tower_lock_testkit::{Proxy, RedisServer};

fn multi_thread(workers: usize) -> Runtime {
    Builder::new_multi_thread()
        .worker_threads(workers)
        .enable_all()
        .build()
        .unwrap()
}

fn current_thread() -> Runtime {
    Builder::new_current_thread().enable_all().build().unwrap()
}

/// No waiting, a long TTL, and a store timeout longer than the stall.
fn config() -> LockConfig {
    LockConfig::builder()
        .ttl(Duration::from_secs(30))
        .wait(Wait::none())
        .store_timeout(Duration::from_secs(5))
        .build()
        .unwrap()
}

/// Holds every client's commands for `ms` milliseconds.
fn stall_redis(server: &RedisServer, ms: u64) {
    let reply = server.cli(&["CLIENT", "PAUSE", &ms.to_string()]);
    assert!(reply.contains("OK"), "CLIENT PAUSE: {reply}");
}

/// A store connected on `main` (which stays driven: the connection's own I/O runs there) and
/// used once, so that its script is loaded.
fn store(server: &RedisServer, main: &Runtime) -> RedisStore {
    main.block_on(async {
        let store = RedisStore::connect(server.url()).await.unwrap();
        let locker = Locker::with_config(store.clone(), config());
        let warm = locker
            .acquire(locker.key("warm", "up").unwrap())
            .await
            .unwrap();
        warm.release().await.unwrap();
        store
    })
}

/// `n` acquires of fresh keys named `name-<i>` on `locker`, at once; each must be acquired, and
/// all within a generous bound (the operations must not wait for another runtime at all).
async fn fresh_keys_are_acquired(locker: &Locker, name: &str, n: usize) {
    let acquires = (0..n).map(|i| {
        let key = locker.key("fresh", format!("{name}-{i}")).unwrap();
        locker.acquire(key).into_future()
    });
    let answers = tokio::time::timeout(Duration::from_secs(10), join_all(acquires))
        .await
        .unwrap_or_else(|_| panic!("{name}: the acquires were not answered within 10 s"));
    for (i, answer) in answers.into_iter().enumerate() {
        let guard = answer.unwrap_or_else(|e| panic!("{name}-{i}: {e}"));
        guard.release().await.unwrap();
    }
}

/// A runtime shut down while one of its calls was in flight and nine of its operations queued
/// behind it: the store goes on for every other runtime, at once.
#[test]
fn a_runtime_shut_down_mid_batch_leaves_the_store_working() {
    let server = RedisServer::start();
    let main = multi_thread(2);
    let store = store(&server, &main);
    stall_redis(&server, 500);
    let doomed = multi_thread(1);
    let locker = Locker::with_config(store.clone(), config());
    for i in 0..10 {
        let locker = locker.clone();
        doomed.spawn(async move {
            let _ = locker
                .acquire(locker.key("doomed", i.to_string()).unwrap())
                .await;
        });
    }
    // Time for them to reach the store: one call in flight, nine queued.
    std::thread::sleep(Duration::from_millis(100));
    drop(doomed);
    main.block_on(fresh_keys_are_acquired(&locker, "main", 20));
    current_thread().block_on(fresh_keys_are_acquired(&locker, "other", 20));
}

/// A current-thread runtime whose `block_on` returned while one of its calls was in flight and
/// nine of its operations queued: nothing drives them any more, and nothing else waits for them.
#[test]
fn a_runtime_left_idle_holds_up_only_its_own_operations() {
    let server = RedisServer::start();
    let main = multi_thread(2);
    let store = store(&server, &main);
    let locker = Locker::with_config(store.clone(), config());
    stall_redis(&server, 500);
    let idle = current_thread();
    idle.block_on(async {
        for i in 0..10 {
            let locker = locker.clone();
            tokio::spawn(async move {
                let _ = locker
                    .acquire(locker.key("idle", i.to_string()).unwrap())
                    .await;
            });
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    });
    // `idle` lives on, undriven: its tasks are never polled again.
    main.block_on(fresh_keys_are_acquired(&locker, "main", 20));
    current_thread().block_on(fresh_keys_are_acquired(&locker, "other", 20));
    drop(idle);
}

/// Background leases (a `LeaseGuard`) are renewed on the runtime that acquired them: a lease of
/// one runtime is not handed to the renewal task another runtime started, which may no longer be
/// driven (or may shut down, dropping the renewals it was given).
#[test]
fn background_leases_are_renewed_whatever_became_of_another_runtime() {
    let server = RedisServer::start();
    let main = multi_thread(2);
    let store = store(&server, &main);
    let short = LockConfig::builder()
        .ttl(Duration::from_millis(300))
        .wait(Wait::none())
        .build()
        .unwrap();
    let locker = Locker::with_config(store, short);
    // The locker's first background lease, on a runtime that is then left undriven.
    let idle = current_thread();
    let first = idle.block_on(
        locker
            .acquire(locker.key("renew", "idle").unwrap())
            .into_future(),
    );
    let first = first.unwrap();
    // And one on a runtime that shuts down.
    let doomed = current_thread();
    let second = doomed.block_on(
        locker
            .acquire(locker.key("renew", "doomed").unwrap())
            .into_future(),
    );
    drop(doomed);
    drop(second);
    main.block_on(async {
        let guard = locker
            .acquire(locker.key("renew", "main").unwrap())
            .await
            .unwrap();
        // Five TTLs: only renewals keep it.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        assert!(
            !guard.lease().is_lost(),
            "{:?}",
            guard.lease().lost_reason()
        );
        guard
            .release()
            .await
            .expect("the lease ran out: it was not renewed");
    });
    drop(first);
    drop(idle);
}

/// One acquire and release of `name` on `locker`: both answered, the release `true`.
async fn cycle(locker: &Locker, name: &str) {
    let key = locker.key("cycle", name).unwrap();
    let guard = locker
        .acquire(key)
        .await
        .unwrap_or_else(|e| panic!("{name}: acquire: {e}"));
    guard
        .release()
        .await
        .unwrap_or_else(|e| panic!("{name}: release (was the lease held?): {e}"));
}

/// [`cycle`], answered within 5 s.
async fn cycle_in_time(locker: &Locker, name: &str) {
    tokio::time::timeout(Duration::from_secs(5), cycle(locker, name))
        .await
        .unwrap_or_else(|_| panic!("{name} was not answered within 5 s"));
}

/// A store connected on a runtime dropped right after (start-up code).
fn connected_on_a_dropped_runtime(server: &RedisServer) -> RedisStore {
    current_thread()
        .block_on(RedisStore::connect(server.url()))
        .unwrap()
}

/// A store connected (and used) on a current-thread runtime whose `block_on` then returned,
/// leaving it undriven: every other runtime's calls are answered, at once.
#[test]
fn a_store_connected_on_a_runtime_left_idle_serves_every_other() {
    let server = RedisServer::start();
    let creator = current_thread();
    let store = creator.block_on(async {
        let store = RedisStore::connect(server.url()).await.unwrap();
        cycle(&Locker::with_config(store.clone(), config()), "warm").await;
        store
    });
    let locker = Locker::with_config(store, config());
    let main = multi_thread(2);
    for i in 0..5 {
        main.block_on(fresh_keys_are_acquired(&locker, &format!("main-{i}"), 4));
    }
    current_thread().block_on(fresh_keys_are_acquired(&locker, "other", 4));
    drop(creator);
}

/// A runtime per request (a `block_on` bridge), dropped after it, the store connected on a
/// runtime dropped at once: every request is served.
#[test]
fn a_runtime_per_request_serves_every_request() {
    let server = RedisServer::start();
    let locker = Locker::with_config(connected_on_a_dropped_runtime(&server), config());
    for i in 0..40 {
        let runtime = current_thread();
        runtime.block_on(cycle_in_time(&locker, &format!("req-{i}")));
        drop(runtime);
    }
}

/// Worker threads, each with a current-thread runtime of its own driven only while the worker
/// is inside `block_on` (synchronous work in between): every request is served.
#[test]
fn thread_local_runtimes_serve_every_request() {
    let server = RedisServer::start();
    let locker = Locker::with_config(connected_on_a_dropped_runtime(&server), config());
    let workers: Vec<_> = (0..4)
        .map(|w| {
            let locker = locker.clone();
            std::thread::spawn(move || {
                let runtime = current_thread();
                for i in 0..10 {
                    runtime.block_on(cycle_in_time(&locker, &format!("w{w}-{i}")));
                    std::thread::sleep(Duration::from_millis(100));
                }
            })
        })
        .collect();
    for worker in workers {
        worker.join().unwrap();
    }
}

/// A background lease taken in a `block_on` bridge and held across synchronous work (its
/// runtime not driven) for three TTLs: it is renewed, so nobody else takes the key, and its
/// release finds it held. (A TTL of 1 s: at 400 ms, a machine at load 10 sometimes starved the
/// renewals' round trips past the TTL.)
#[test]
fn a_background_lease_held_across_sync_work_in_a_bridge_is_renewed() {
    let server = RedisServer::start();
    let main = multi_thread(2);
    let store = store(&server, &main);
    let short = LockConfig::builder()
        .ttl(Duration::from_secs(1))
        .wait(Wait::none())
        .build()
        .unwrap();
    let locker = Locker::with_config(store.clone(), short);
    // The locker's renewals already under way for a lease of another runtime.
    let warm = main
        .block_on(
            locker
                .acquire(locker.key("bridge", "warm").unwrap())
                .into_future(),
        )
        .unwrap();
    let bridge = current_thread();
    let guard = bridge
        .block_on(
            locker
                .acquire(locker.key("bridge", "job").unwrap())
                .into_future(),
        )
        .unwrap();
    std::thread::sleep(Duration::from_millis(3000));
    assert!(
        !guard.lease().is_lost(),
        "{:?}",
        guard.lease().lost_reason()
    );
    let elsewhere = Locker::with_config(store, config());
    let taken = main.block_on(
        elsewhere
            .acquire(elsewhere.key("bridge", "job").unwrap())
            .into_future(),
    );
    assert!(
        taken.is_err(),
        "another holder took the key: it was not renewed"
    );
    bridge
        .block_on(guard.release())
        .expect("the lease ran out: it was not renewed");
    drop(warm);
}

/// A guard dropped at the end of a request's runtime (a `block_on` bridge, the runtime dropped
/// right after): released on drop all the same, so the key is free at once, not at its TTL.
#[test]
fn a_guard_dropped_at_the_end_of_a_runtime_is_released() {
    let server = RedisServer::start();
    let main = multi_thread(2);
    let store = store(&server, &main);
    let locker = Locker::with_config(store, config());
    for (kind, runtime) in [
        ("current-thread", current_thread()),
        ("multi-thread", multi_thread(1)),
    ] {
        let key = locker.key("dropped", kind).unwrap();
        runtime.block_on(async {
            let _guard = locker.acquire(key.clone()).await.unwrap();
        });
        drop(runtime);
        // The TTL is 30 s: only the release frees it within this bound.
        let start = Instant::now();
        loop {
            match main.block_on(locker.acquire(key.clone()).into_future()) {
                Ok(guard) => {
                    main.block_on(guard.release()).unwrap();
                    break;
                }
                Err(e) if start.elapsed() < Duration::from_secs(3) => {
                    let _ = e;
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => panic!("{kind}: the key is still held 3 s after the guard dropped: {e}"),
            }
        }
    }
}

/// A lease released with `release().await` on a runtime that stalls once it has polled the
/// release (its only thread busy with synchronous work): the release is on the wire without
/// that runtime, so the key is free for other instances while the runtime stalls, and the
/// holder hears that it went through. `behind`: the release is queued behind a call of the
/// same store and runtime that Redis holds (`CLIENT PAUSE`) until 200 ms into the stall, so
/// that it can only be sent after that call ends, while its caller's runtime is not polled.
fn release_during_a_stall(behind: bool) {
    let server = RedisServer::start();
    let main = multi_thread(2);
    let store = store(&server, &main);
    // A store timeout well within the stall, which a release waiting for its caller's runtime
    // would outlast.
    let timeout = LockConfig::builder()
        .ttl(Duration::from_secs(30))
        .wait(Wait::none())
        .store_timeout(Duration::from_millis(1000))
        .build()
        .unwrap();
    let locker = Locker::with_config(store, timeout.clone());
    // Another instance's view of the key (this process's own requests for it queue behind the
    // release in its local queue, until the release's caller reads the answer).
    let other = Locker::with_config(
        main.block_on(RedisStore::connect(server.url())).unwrap(),
        timeout,
    );
    for round in 0..5 {
        let key = locker.key("stalled", round.to_string()).unwrap();
        let stalled = current_thread();
        let (freed, released) = stalled.block_on(async {
            let guard = locker.acquire(key.clone()).await.unwrap();
            let blocker = behind.then(|| {
                stall_redis(&server, 200);
                // In flight from this runtime (spawned, and run once by the yield below).
                let (locker, key) = (locker.clone(), locker.key("blocker", round.to_string()));
                tokio::spawn(async move { locker.try_acquire(key.unwrap()).await.map(drop) })
            });
            tokio::task::yield_now().await;
            let mut release = Box::pin(guard.release());
            // Polled once (on loopback, Redis may answer within that poll: then the release is
            // done before the stall).
            let first =
                std::future::poll_fn(|cx| std::task::Poll::Ready(release.as_mut().poll(cx))).await;
            // From another thread, while this runtime's thread sleeps: is the key free?
            let free = std::thread::spawn({
                let (other, key, main) = (other.clone(), key.clone(), main.handle().clone());
                move || {
                    let start = Instant::now();
                    while start.elapsed() < Duration::from_secs(1) {
                        if let Some(guard) = main.block_on(other.try_acquire(key.clone())).unwrap()
                        {
                            main.block_on(guard.release()).unwrap();
                            return true;
                        }
                        std::thread::sleep(Duration::from_millis(5));
                    }
                    false
                }
            });
            std::thread::sleep(Duration::from_millis(1500));
            let released = match first {
                std::task::Poll::Ready(released) => released,
                std::task::Poll::Pending => release.await,
            };
            if let Some(blocker) = blocker {
                blocker.await.unwrap().unwrap();
            }
            (free.join().unwrap(), released)
        });
        // The stall is 1.5 s and the TTL 30 s: only the release sent during the stall frees the
        // key within 1 s.
        assert!(
            freed,
            "round {round}: the key was still held 1 s into the stall of its releaser"
        );
        assert!(
            released.is_ok(),
            "round {round}: the release failed, with Redis healthy: {released:?}"
        );
    }
}

#[test]
fn a_release_awaited_on_a_runtime_that_then_stalls_frees_the_key_at_once() {
    release_during_a_stall(false);
}

#[test]
fn a_release_queued_behind_a_call_on_a_runtime_that_then_stalls_frees_the_key() {
    release_during_a_stall(true);
}

/// A Sentinel store connected on a current-thread runtime then left idle: its calls from every
/// other runtime are answered.
#[cfg(feature = "sentinel")]
#[test]
fn a_sentinel_store_connected_on_a_runtime_left_idle_serves_every_other() {
    use tower_lock::store::SentinelStore;
    use tower_lock_testkit::sentinel::{MASTER_NAME, SentinelSetup};

    let setup = SentinelSetup::start(Duration::from_secs(5));
    let idle = current_thread();
    let store = idle
        .block_on(async {
            let store = SentinelStore::connect(setup.sentinel_urls(), MASTER_NAME).await?;
            cycle(&Locker::with_config(store.clone(), config()), "warm").await;
            Ok::<_, tower_lock::store::StoreError>(store)
        })
        .unwrap();
    let locker = Locker::with_config(store, config());
    let main = multi_thread(2);
    for i in 0..4 {
        main.block_on(fresh_keys_are_acquired(
            &locker,
            &format!("sentinel-{i}"),
            4,
        ));
    }
    drop(idle);
}

/// Polls `future` once, in the current task, and leaves it there (neither polled again nor
/// dropped, as a future kept in a `select!` loop while another branch runs).
async fn poll_once<F: std::future::Future + Unpin>(future: &mut F) -> bool {
    std::future::poll_fn(|cx| {
        std::task::Poll::Ready(std::pin::Pin::new(&mut *future).poll(cx).is_ready())
    })
    .await
}

/// A task that polls an acquire of `name` once and then keeps it, never polling it again (as a
/// future kept in a `select!` loop while another branch runs): the acquire's wake-ups reach a
/// task that does not look at it. `queued`: Redis is paused, so that it cannot be answered.
fn park(locker: &Locker, name: &str, queued: bool) -> tokio::task::JoinHandle<()> {
    let locker = locker.clone();
    let key = locker.key("parked", name).unwrap();
    tokio::spawn(async move {
        let mut parked = Box::pin(locker.acquire(key).into_future());
        let answered = poll_once(&mut parked).await;
        assert!(!answered || !queued, "answered while Redis is paused");
        std::future::pending::<()>().await;
        drop(parked);
    })
}

/// A caller queued behind a call in flight, polled once and then not polled: the operations
/// queued after it on its runtime are answered all the same, once Redis answers.
#[test]
fn an_unpolled_queued_caller_holds_up_nobody() {
    let server = RedisServer::start();
    let main = multi_thread(2);
    let store = store(&server, &main);
    let locker = Locker::with_config(store, config());
    main.block_on(async {
        // One call in flight, held up by Redis for a moment.
        stall_redis(&server, 300);
        // Its caller keeps its guard: no release of its own comes to form the next batch.
        let first = tokio::spawn({
            let locker = locker.clone();
            async move { locker.acquire(locker.key("queued", "first").unwrap()).await }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        let parked = park(&locker, "queued", true);
        tokio::time::sleep(Duration::from_millis(20)).await;
        fresh_keys_are_acquired(&locker, "behind", 5).await;
        let first = first.await.unwrap().unwrap();
        parked.abort();
        first.release().await.unwrap();
    });
}

/// A caller whose operation went out alone, polled once and then not polled: the operations
/// after it on its runtime are answered once Redis answers.
#[test]
fn an_unpolled_lone_caller_holds_up_nobody() {
    let server = RedisServer::start();
    let main = multi_thread(2);
    let store = store(&server, &main);
    let locker = Locker::with_config(store, config());
    main.block_on(async {
        let parked = park(&locker, "lone", false);
        tokio::time::sleep(Duration::from_millis(50)).await;
        fresh_keys_are_acquired(&locker, "after", 5).await;
        parked.abort();
    });
}

/// Acquires `n` fresh keys of `name`, each given up after a millisecond, and answers how many
/// of those keys are held `within` later, at the latest (0 as soon as none is).
fn held_after_a_cancelled_storm(
    main: &Runtime,
    locker: &Locker,
    name: &str,
    n: usize,
    within: Duration,
) -> usize {
    main.block_on(async {
        let storm = (0..n).map(|i| {
            let locker = locker.clone();
            let key = locker.key(name, i.to_string()).unwrap();
            tokio::spawn(async move {
                let acquired =
                    tokio::time::timeout(Duration::from_millis(1), locker.acquire(key)).await;
                if let Ok(Ok(guard)) = acquired {
                    guard.release().await.unwrap();
                }
            })
        });
        for done in join_all(storm).await {
            done.unwrap();
        }
        let deadline = Instant::now() + within;
        loop {
            let held = join_all((0..n).map(|i| async move {
                let key = locker.key(name, i.to_string()).unwrap();
                match locker.try_acquire(key).await.unwrap() {
                    Some(guard) => {
                        guard.release().await.unwrap();
                        0
                    }
                    None => 1,
                }
            }))
            .await
            .into_iter()
            .sum::<usize>();
            if held == 0 || Instant::now() >= deadline {
                return held;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
}

/// An acquire given up while its operation waits in a batch (or while the batch's script is
/// loaded again after `NOSCRIPT`) is released by its guard at once, on the crate's runtime:
/// the operation is then left out of the batch, so that the acquire never runs after its
/// release and takes the key with a token nobody holds, for the whole TTL (30 s here).
#[test]
fn an_acquire_given_up_in_a_batch_leaves_no_key_behind() {
    let server = RedisServer::start();
    let main = multi_thread(2);
    let locker = Locker::with_config(store(&server, &main), config());
    for round in 0..3 {
        let held =
            held_after_a_cancelled_storm(&main, &locker, "storm", 1_000, Duration::from_secs(5));
        assert_eq!(held, 0, "keys held after round {round}");
        // Every call in flight meets NOSCRIPT next round, and is sent again after the load.
        let reply = server.cli(&["SCRIPT", "FLUSH"]);
        assert!(reply.contains("OK"), "SCRIPT FLUSH: {reply}");
    }
}

/// A store whose renewal of a key containing `boom` panics.
struct PanicsOnRenew(RedisStore);

impl LockStore for PanicsOnRenew {
    async fn acquire(
        &self,
        key: &LockKey,
        token: &Token,
        ttl: Duration,
    ) -> Result<Acquire, StoreError> {
        self.0.acquire(key, token, ttl).await
    }

    async fn renew(&self, key: &LockKey, token: &Token, ttl: Duration) -> Result<bool, StoreError> {
        if key.value() == b"boom" {
            panic!("a store's renewal panicked (on purpose)");
        }
        self.0.renew(key, token, ttl).await
    }

    async fn release(&self, key: &LockKey, token: &Token) -> Result<bool, StoreError> {
        self.0.release(key, token).await
    }
}

/// A panic in a locker's background renewals ends the task that renewed all its background
/// leases: every one of them is reported lost (those renewed and those still waiting for their
/// first renewal), not only the one whose renewal panicked, rather than left to expire unnoticed
/// while their holders work on.
#[test]
fn a_panic_in_background_renewals_reports_every_lease_of_the_task_lost() {
    let server = RedisServer::start();
    let main = multi_thread(2);
    let store = store(&server, &main);
    let config = LockConfig::builder()
        .ttl(Duration::from_millis(600))
        .wait(Wait::none())
        .build()
        .unwrap();
    let locker = Locker::with_config(PanicsOnRenew(store), config);
    main.block_on(async {
        let fine = locker
            .acquire(locker.key("renewed", "fine").unwrap())
            .await
            .unwrap();
        // Its first renewal falls due long after the panic: it waits in the task's queue.
        let waiting = locker
            .acquire(locker.key("renewed", "waiting").unwrap())
            .ttl(Duration::from_secs(30))
            .unwrap()
            .await
            .unwrap();
        let boom = locker
            .acquire(locker.key("renewed", "boom").unwrap())
            .await
            .unwrap();
        for (name, guard) in [("fine", &fine), ("boom", &boom), ("waiting", &waiting)] {
            let lost = tokio::time::timeout(Duration::from_secs(5), guard.lease().lost()).await;
            assert!(lost.is_ok(), "the {name} lease was not reported lost");
        }
        // Negative control: a lease on the same locker taken afterwards is renewed by a new task
        // (so the losses above were the panic's, not the store's).
        let later = locker
            .acquire(locker.key("renewed", "later").unwrap())
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(1_500)).await;
        assert!(!later.lease().is_lost(), "a later lease was lost too");
        assert!(
            later.lease().renewals() > 0,
            "a later lease was not renewed"
        );
    });
}

/// Polls `f` on this thread, outside any runtime, with a waker that unparks it.
fn block_on_plain<F: std::future::Future>(f: F) -> F::Output {
    struct Unpark(std::thread::Thread);
    impl std::task::Wake for Unpark {
        fn wake(self: std::sync::Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = std::task::Waker::from(std::sync::Arc::new(Unpark(std::thread::current())));
    let mut cx = std::task::Context::from_waker(&waker);
    let mut f = std::pin::pin!(f);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let std::task::Poll::Ready(v) = f.as_mut().poll(&mut cx) {
            return v;
        }
        assert!(Instant::now() < deadline, "outside a runtime: stalled");
        std::thread::park_timeout(Duration::from_millis(100));
    }
}

/// A store called outside any runtime (a plain executor) after its scripts were flushed: the
/// reload's timers are the crate runtime's, so the call is answered, not a panic ("there is no
/// reactor running") that every caller of its batch would share.
#[test]
fn a_store_called_outside_any_runtime_reloads_its_scripts() {
    let server = RedisServer::start();
    let main = multi_thread(1);
    let store = store(&server, &main);
    for round in 0..3 {
        assert!(server.cli(&["SCRIPT", "FLUSH"]).contains("OK"));
        let value = format!("{round}");
        let key = LockKey::new("tower-lock:", "outside", value.as_bytes(), 64).unwrap();
        let token = Token::generate().unwrap();
        block_on_plain(async {
            let got = store
                .acquire(&key, &token, Duration::from_secs(30))
                .await
                .unwrap();
            assert!(matches!(got, Acquire::Acquired { .. }), "{got:?}");
            assert!(store.release(&key, &token).await.unwrap());
        });
    }
}

/// A store connected, and a `Locker` and a `LockLayer` driven, outside any Tokio runtime (a
/// plain executor, as another runtime's would be): the engine's timers (the store timeout, the renewal tick, the wait
/// policy's pauses) are the crate runtime's, so a lease is taken, renewed past its TTL, and
/// released, a contended acquire waits and then gives up, and a locked request is served; no
/// panic ("there is no reactor running").
#[test]
fn a_locker_and_a_layer_driven_outside_any_runtime_work() {
    use tower::{Service, ServiceExt, service_fn};
    use tower_lock::{Key, LockLayer};

    let server = RedisServer::start();
    // Connected outside any runtime too.
    let store = block_on_plain(RedisStore::connect(server.url())).unwrap();
    let ttl = Duration::from_secs(1);
    let config = LockConfig::builder()
        .ttl(ttl)
        .wait(
            Wait::exponential(Duration::from_millis(10), Duration::from_millis(20))
                .unwrap()
                .deadline(Duration::from_millis(200)),
        )
        .store_timeout(Duration::from_secs(2))
        .build()
        .unwrap();
    let locker = Locker::with_config(store.clone(), config.clone());
    let key = locker.key("outside", "held").unwrap();
    block_on_plain(async {
        let guard = locker.acquire(key.clone()).await.unwrap();
        // Held for three TTLs: only renewals keep it.
        let start = Instant::now();
        while start.elapsed() < ttl * 3 {
            std::thread::sleep(Duration::from_millis(20));
            assert!(
                !guard.lease().is_lost(),
                "the lease was lost outside a runtime"
            );
        }
        let other = Locker::with_config(store.clone(), config.clone());
        let refused = other.acquire(key.clone()).await;
        assert!(refused.is_err(), "a second holder got the key: {refused:?}");
        guard.release().await.unwrap();
        other
            .acquire(key.clone())
            .await
            .unwrap()
            .release()
            .await
            .unwrap();
    });
    let layer = LockLayer::from_locker(locker.clone(), Key::path());
    let mut service = tower::ServiceBuilder::new()
        .layer(layer)
        .service(service_fn(|_: http::Request<axum::body::Body>| async {
            Ok::<_, std::convert::Infallible>(http::Response::new(axum::body::Body::empty()))
        }));
    block_on_plain(async {
        let request = http::Request::post("/items/outside/purchase")
            .body(axum::body::Body::empty())
            .unwrap();
        let response = service.ready().await.unwrap().call(request).await.unwrap();
        assert_eq!(response.status(), http::StatusCode::OK);
    });
    // The in-memory store's timers likewise.
    let memory = Locker::with_config(tower_lock::MemoryStore::new(), config);
    block_on_plain(async {
        let guard = memory.acquire(key.clone()).await.unwrap();
        assert!(memory.acquire(key.clone()).await.is_err());
        guard.release().await.unwrap();
    });
}

/// A response whose lease is held until its body ends (`hold_until_body_end`), made on a
/// runtime of its own (a runtime-per-request bridge) by a handler that outlived a renewal
/// interval (so its renewal timer was made while that runtime ran it), then streamed for three
/// TTLs on another runtime while the first is left idle, or dropped: the lease is renewed all
/// the same (handed to the background task, its renewer makes its timers again there), and the
/// key is free once the body ends.
#[test]
fn a_body_streamed_after_its_runtime_went_idle_or_away_keeps_its_lease() {
    use crate::support::LockKeys;
    use tower::{Service, ServiceExt, service_fn};
    use tower_lock::{Key, LockLayer};

    let server = RedisServer::start();
    let main = multi_thread(2);
    let store = store(&server, &main);
    let ttl = Duration::from_secs(1);
    let config = LockConfig::builder()
        .ttl(ttl)
        .wait(Wait::none())
        .build()
        .unwrap();
    let layer = LockLayer::with_config(store, Key::path(), config).hold_until_body_end(true);
    let service = tower::ServiceBuilder::new()
        .layer(layer)
        .service(service_fn(
            move |_: http::Request<axum::body::Body>| async move {
                // Longer than a renewal interval (a third of the TTL).
                tokio::time::sleep(Duration::from_millis(400)).await;
                let frames = futures_util::stream::unfold(0, |i| async move {
                    (i < 8).then_some(())?;
                    tokio::time::sleep(Duration::from_millis(400)).await;
                    Some((Ok::<_, std::io::Error>(bytes::Bytes::from("x")), i + 1))
                });
                Ok::<_, std::convert::Infallible>(http::Response::new(
                    axum::body::Body::from_stream(frames),
                ))
            },
        ));
    for dropped in [false, true] {
        let bridge = current_thread();
        let mut service = service.clone();
        let request = http::Request::post(format!("/streamed/{dropped}"))
            .body(axum::body::Body::empty())
            .unwrap();
        let response =
            bridge.block_on(async { service.ready().await.unwrap().call(request).await.unwrap() });
        assert_eq!(response.status(), http::StatusCode::OK);
        let idle = if dropped {
            drop(bridge);
            None
        } else {
            Some(bridge)
        };
        main.block_on(async {
            use http_body_util::BodyExt;
            let mut body = response.into_body();
            let mut frames = 0;
            while let Some(frame) = body.frame().await {
                frame.unwrap_or_else(|e| panic!("dropped: {dropped}: the body failed: {e}"));
                frames += 1;
                assert_eq!(
                    server.lock_keys().await.len(),
                    1,
                    "dropped: {dropped}: the key was not held at frame {frames} (its lease was \
                     not renewed)"
                );
            }
            assert_eq!(frames, 8);
            assert!(
                server.lock_keys().await.is_empty(),
                "dropped: {dropped}: the key is still held after the body ended"
            );
        });
        drop(idle);
    }
}

/// A script load started by a caller whose runtime then stops being driven (its `block_on`
/// returned with the load in flight) frees the calls waiting for it as soon as Redis has the
/// script: the load runs on the crate's runtime. Redis is reached through a proxy that delays
/// everything 200 ms each way, so that the load is in flight when that runtime goes idle, and a
/// second write reaches Redis before the load does and hears NOSCRIPT after it started. (When
/// the load was the first caller's own, the second write waited the 2 s a load may take before
/// another caller starts one: 2.5 s in all.)
#[test]
fn a_script_load_started_on_a_runtime_that_went_idle_frees_the_others() {
    let server = RedisServer::start();
    let proxy = Proxy::start(server.port());
    let main = multi_thread(2);
    let (store, guard) = main.block_on(async {
        let store = RedisStore::connect(proxy.url()).await.unwrap();
        let locker = Locker::with_config(store.clone(), config());
        let guard = locker
            .acquire(locker.key("reload", "k").unwrap())
            .await
            .unwrap();
        (store, guard)
    });
    let data = FencedData::new(store).timeout(Duration::from_secs(5));
    let lease = guard.lease().clone();
    let key = data_key("counter:", lease.keys().first().unwrap());
    assert!(server.cli(&["SCRIPT", "FLUSH"]).contains("OK"));
    proxy.latency(Duration::from_millis(200));
    let write = {
        let (data, lease, key) = (data.clone(), lease.clone(), key.clone());
        move || async move { data.batch(&lease).incr_by(&key, 1).apply().await }
    };
    // The first write reaches Redis at 200 ms, hears NOSCRIPT at 400 and starts the load, which
    // reaches Redis at 600 and answers at 800; its runtime stops being driven at 600.
    let idle = current_thread();
    let first = idle.spawn(write.clone()());
    // The second reaches Redis at 450, before the load, and hears NOSCRIPT at 650.
    let second = main.spawn(async move {
        tokio::time::sleep(Duration::from_millis(250)).await;
        let sent = Instant::now();
        let answer = write().await;
        (sent.elapsed(), answer)
    });
    idle.block_on(async { tokio::time::sleep(Duration::from_millis(600)).await });
    let (took, answer) = main.block_on(second).unwrap();
    assert!(answer.is_ok(), "{answer:?}");
    // Its NOSCRIPT, the wait for the load, and the write again: about 950 ms.
    assert!(
        took > Duration::from_millis(700),
        "the second write took {took:?}: it did not hear NOSCRIPT, so the test checked nothing"
    );
    assert!(
        took < Duration::from_millis(1800),
        "the second write waited {took:?} for the idle runtime's load"
    );
    drop(first);
    drop(idle);
    proxy.heal();
    main.block_on(guard.release()).unwrap();
}
