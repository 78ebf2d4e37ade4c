//! Outsider probes of the runtime-class change (crate-owned thread). Throwaway.
use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use futures_util::future::join_all;
use tokio::runtime::{Builder, Runtime};
use tower_lock::{
    LockConfig, Locker, RedisStore, Token, Wait,
    key::LockKey,
    store::{Acquire, LockStore, StoreError},
};
use tower_lock_testkit::RedisServer;

fn mt(n: usize) -> Runtime {
    Builder::new_multi_thread()
        .worker_threads(n)
        .enable_all()
        .build()
        .unwrap()
}
fn ct() -> Runtime {
    Builder::new_current_thread().enable_all().build().unwrap()
}
fn cfg(ttl_ms: u64) -> LockConfig {
    LockConfig::builder()
        .ttl(Duration::from_millis(ttl_ms))
        .wait(Wait::none())
        .store_timeout(Duration::from_secs(5))
        .build()
        .unwrap()
}
fn free(rt: &Runtime, locker: &Locker, ns: &str, v: &str) -> bool {
    rt.block_on(async {
        match locker
            .try_acquire(locker.key(ns, v).unwrap())
            .await
            .unwrap()
        {
            Some(g) => {
                g.release().await.unwrap();
                true
            }
            None => false,
        }
    })
}

/// A user's store around RedisStore: renew may block the thread or panic, for chosen keys.
#[derive(Clone)]
struct Hostile {
    inner: RedisStore,
    block_ms: Arc<AtomicUsize>,
    panic_on: &'static str,
}
impl LockStore for Hostile {
    async fn acquire(
        &self,
        key: &LockKey,
        token: &Token,
        ttl: Duration,
    ) -> Result<Acquire, StoreError> {
        self.inner.acquire(key, token, ttl).await
    }
    async fn renew(&self, key: &LockKey, token: &Token, ttl: Duration) -> Result<bool, StoreError> {
        let name = String::from_utf8_lossy(key.as_bytes()).to_string();
        if !self.panic_on.is_empty() && name.contains(self.panic_on) {
            panic!("hostile store: renew of {name}");
        }
        let ms = self.block_ms.swap(0, Ordering::SeqCst);
        if ms > 0 {
            eprintln!(
                "hostile store: blocking the renewing thread {:?} for {ms} ms",
                std::thread::current().name()
            );
            std::thread::sleep(Duration::from_millis(ms as u64));
        }
        self.inner.renew(key, token, ttl).await
    }
    async fn release(&self, key: &LockKey, token: &Token) -> Result<bool, StoreError> {
        self.inner.release(key, token).await
    }
}

/// A panic in a user's store renew (polled on the crate's thread) kills the locker's one
/// renewal task: other background leases of that locker stop being renewed, and are they
/// reported lost?
#[test]
fn panic_in_renewal_task() {
    let server = RedisServer::start();
    let rt = mt(2);
    let store = rt.block_on(RedisStore::connect(server.url())).unwrap();
    let hostile = Hostile {
        inner: store.clone(),
        block_ms: Arc::new(AtomicUsize::new(0)),
        panic_on: "boom",
    };
    let locker = Locker::with_config(hostile, cfg(300));
    let other = Locker::with_config(store.clone(), cfg(300));
    let a = rt
        .block_on(locker.acquire(locker.key("p", "ok").unwrap()))
        .unwrap();
    let b = rt
        .block_on(locker.acquire(locker.key("p", "boom").unwrap()))
        .unwrap();
    std::thread::sleep(Duration::from_millis(1200));
    let a_free = free(&rt, &other, "p", "ok");
    eprintln!(
        "after 4 TTLs: A is_lost={} reason={:?} renewals={} ; A's key free to another client: {a_free}",
        a.lease().is_lost(),
        a.lease().lost_reason(),
        a.lease().renewals()
    );
    let lost_woke = rt.block_on(async {
        tokio::time::timeout(Duration::from_millis(500), a.lease().lost())
            .await
            .is_ok()
    });
    eprintln!(
        "A lost().await woke: {lost_woke}; B is_lost={}",
        b.lease().is_lost()
    );
    // A later lease of the same locker: renewed by a new task?
    let c = rt
        .block_on(locker.acquire(locker.key("p", "later").unwrap()))
        .unwrap();
    std::thread::sleep(Duration::from_millis(1200));
    eprintln!(
        "later lease C: is_lost={} renewals={}",
        c.lease().is_lost(),
        c.lease().renewals()
    );
    // Does the crate's thread still serve other stores?
    let t = Instant::now();
    let ok = free(&rt, &other, "p", "fresh");
    eprintln!(
        "other store after the panic: fresh key acquired={ok} in {:?}",
        t.elapsed()
    );
    std::mem::forget(b);
}

/// User code blocking on the crate's thread (a store's renew doing sync I/O) stalls every
/// RedisStore in the process, and other lockers' background leases.
#[test]
fn blocking_on_crate_thread_stalls_everyone() {
    let server = RedisServer::start();
    let rt = mt(2);
    let store = rt.block_on(RedisStore::connect(server.url())).unwrap();
    let unrelated = rt.block_on(RedisStore::connect(server.url())).unwrap();
    let hostile = Hostile {
        inner: store.clone(),
        block_ms: Arc::new(AtomicUsize::new(0)),
        panic_on: "",
    };
    let block = hostile.block_ms.clone();
    let locker = Locker::with_config(hostile, cfg(300));
    let other = Locker::with_config(unrelated, cfg(900));
    let bg = rt
        .block_on(other.acquire(other.key("u", "bg").unwrap()))
        .unwrap();
    let _g = rt
        .block_on(locker.acquire(locker.key("h", "x").unwrap()))
        .unwrap();
    block.store(3000, Ordering::SeqCst);
    std::thread::sleep(Duration::from_millis(250)); // the renewal (at ~100 ms) is now blocking
    let t = Instant::now();
    let r = rt.block_on(other.try_acquire(other.key("u", "fresh").unwrap()));
    eprintln!(
        "unrelated store, unrelated locker, during the block: acquire = {:?} took {:?}",
        r.as_ref().map(|g| g.is_some()),
        t.elapsed()
    );
    drop(r);
    std::thread::sleep(Duration::from_millis(500));
    eprintln!(
        "unrelated background lease (ttl 900ms): is_lost={} reason={:?}",
        bg.lease().is_lost(),
        bg.lease().lost_reason()
    );
}

/// Guard dropped, then the process exits (as `main` returning does): is the key released?
#[test]
fn exit_after_drop() {
    if let Ok(url) = std::env::var("PROBE_CHILD_URL") {
        let rt = ct();
        let store = rt.block_on(RedisStore::connect(url)).unwrap();
        let locker = Locker::with_config(store, cfg(30_000));
        let g = rt
            .block_on(locker.acquire(locker.key("exit", "dropped").unwrap()))
            .unwrap();
        let h = rt
            .block_on(locker.acquire(locker.key("exit", "held").unwrap()))
            .unwrap();
        let _h = h;
        drop(g);
        std::process::exit(0);
    }
    let server = RedisServer::start();
    let status = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["exit_after_drop", "--exact", "--nocapture"])
        .env("PROBE_CHILD_URL", server.url())
        .status()
        .unwrap();
    assert!(status.success());
    let rt = ct();
    let store = rt.block_on(RedisStore::connect(server.url())).unwrap();
    let locker = Locker::with_config(store, cfg(30_000));
    eprintln!(
        "child exited: key dropped before exit free={} ; key held at exit free={}",
        free(&rt, &locker, "exit", "dropped"),
        free(&rt, &locker, "exit", "held")
    );
    eprintln!("keys: {}", server.cli(&["KEYS", "*exit*"]));
}

/// A lease held in a bridge across sync work while Redis is paused past its TTL.
#[test]
fn loss_reported_in_bridge() {
    let server = RedisServer::start();
    let bridge = ct();
    let store = bridge.block_on(RedisStore::connect(server.url())).unwrap();
    let locker = Locker::with_config(store, cfg(600));
    let g = bridge
        .block_on(locker.acquire(locker.key("b", "lease").unwrap()))
        .unwrap();
    // A waiter on the caller's runtime, parked, its runtime not driven during the sync work.
    let lease = g.lease().clone();
    let woke = Arc::new(AtomicBool::new(false));
    let w2 = woke.clone();
    let t2 = std::thread::spawn(move || {
        ct().block_on(async move {
            let r = tokio::time::timeout(Duration::from_secs(5), lease.lost()).await;
            eprintln!("lost().await on another current-thread runtime: {r:?}");
            w2.store(r.is_ok(), Ordering::SeqCst);
        })
    });
    std::thread::sleep(Duration::from_millis(100));
    let reply = server.cli(&["CLIENT", "PAUSE", "2500"]);
    eprintln!("CLIENT PAUSE: {reply}");
    std::thread::sleep(Duration::from_millis(3000)); // sync work
    eprintln!(
        "after pause: is_lost={} reason={:?}",
        g.lease().is_lost(),
        g.lease().lost_reason()
    );
    let r = bridge.block_on(async {
        tokio::time::timeout(Duration::from_millis(200), g.lease().lost()).await
    });
    eprintln!("bridge lost().await: {r:?}");
    t2.join().unwrap();
    eprintln!("woken: {}", woke.load(Ordering::SeqCst));
}

/// 10,000 background leases and 2,000 drop-releases at once on one thread.
#[test]
fn many_leases() {
    let server = RedisServer::start();
    let rt = mt(2);
    let store = rt.block_on(RedisStore::connect(server.url())).unwrap();
    let n: usize = std::env::var("PN")
        .map(|v| v.parse().unwrap())
        .unwrap_or(10_000);
    let ttl: u64 = std::env::var("PTTL")
        .map(|v| v.parse().unwrap())
        .unwrap_or(1000);
    let locker = Locker::with_config(store, cfg(ttl));
    let t = Instant::now();
    let guards: Vec<_> = rt.block_on(join_all(
        (0..n).map(|i| locker.acquire(locker.key("m", i.to_string()).unwrap())),
    ));
    let guards: Vec<_> = guards.into_iter().map(|g| g.unwrap()).collect();
    eprintln!(
        "{n} (ttl {ttl} ms) acquired in {:?}; lost already: {}",
        t.elapsed(),
        guards.iter().filter(|g| g.lease().is_lost()).count()
    );
    let drops: Vec<_> = rt.block_on(join_all(
        (0..std::env::var("PD")
            .map(|v| v.parse().unwrap())
            .unwrap_or(2000))
            .map(|i| locker.acquire(locker.key("d", i.to_string()).unwrap())),
    ));
    eprintln!(
        "drop guards acquired at {:?}; lost so far {}",
        t.elapsed(),
        guards.iter().filter(|g| g.lease().is_lost()).count()
    );
    let t = Instant::now();
    if std::env::var("PREL").is_ok() {
        let drops: Vec<_> = drops.into_iter().map(|g| g.unwrap()).collect();
        rt.block_on(join_all(drops.into_iter().map(|g| g.release())));
        eprintln!("explicit releases answered in {:?}", t.elapsed());
    } else {
        drop(drops);
    }
    eprintln!("drop(2,000 guards) itself took {:?}", t.elapsed());
    let mut left = String::new();
    for _ in 0..50 {
        std::thread::sleep(Duration::from_millis(20));
        left = server.cli(&["EVAL", "return #redis.call('KEYS', '*d*')", "0"]);
        eprintln!("   {:?} left {left:?}", t.elapsed());
        if left.trim() == "0" || left.contains("(integer) 0") {
            break;
        }
    }
    eprintln!(
        "2,000 drop-releases: keys left {left:?} after {:?}",
        t.elapsed()
    );
    for _ in 0..8 {
        std::thread::sleep(Duration::from_millis(ttl / 2));
        let lost = guards.iter().filter(|g| g.lease().is_lost()).count();
        let exp = guards
            .iter()
            .filter(|g| {
                matches!(
                    g.lease().lost_reason(),
                    Some(tower_lock::LostReason::Expired)
                )
            })
            .count();
        eprintln!(
            "  t+{:?}: lost {lost} (expired {exp}), renewals total {}",
            t.elapsed(),
            guards
                .iter()
                .map(|g| u64::from(g.lease().renewals()))
                .sum::<u64>()
        );
    }
    let lost = guards.iter().filter(|g| g.lease().is_lost()).count();
    let min_renew = guards.iter().map(|g| g.lease().renewals()).min().unwrap();
    eprintln!("after 4 s (4 TTLs): lost {lost} of 10,000; min renewals {min_renew}");
    let released = rt.block_on(join_all(guards.into_iter().map(|g| g.release())));
    let not_held = released.iter().filter(|r| !matches!(r, Ok(true))).count();
    eprintln!("release: {not_held} not held / failed");
}

fn bench(rt: &Runtime, locker: &Locker, tag: &str) {
    // Sequential latency.
    let n = 2000;
    let t = Instant::now();
    rt.block_on(async {
        for i in 0..n {
            let g = locker
                .acquire(locker.key("s", format!("{tag}{}", i % 7)).unwrap())
                .await
                .unwrap();
            g.release().await.unwrap();
        }
    });
    eprintln!("{tag}: sequential cycle mean {:?}", t.elapsed() / n);
    // 50 concurrent, 3 s.
    let ops = Arc::new(AtomicUsize::new(0));
    let t = Instant::now();
    rt.block_on(async {
        join_all((0..50).map(|w| {
            let locker = locker.clone();
            let ops = ops.clone();
            let tag = tag.to_owned();
            tokio::spawn(async move {
                let key = locker.key("c", format!("{tag}{w}")).unwrap();
                while t.elapsed() < Duration::from_secs(3) {
                    let g = locker.acquire(key.clone()).await.unwrap();
                    g.release().await.unwrap();
                    ops.fetch_add(1, Ordering::Relaxed);
                }
            })
        }))
        .await
    });
    eprintln!(
        "{tag}: 50 concurrent, {:.0} cycles/s",
        ops.load(Ordering::Relaxed) as f64 / t.elapsed().as_secs_f64()
    );
}

/// connect() (I/O on the crate's thread) vs from_multiplexed (driver on the caller's runtime).
#[test]
fn throughput_side_by_side() {
    let server = RedisServer::start();
    let rt = mt(2);
    let crate_io = rt.block_on(RedisStore::connect(server.url())).unwrap();
    let own = rt.block_on(async {
        let c = tower_lock::redis::Client::open(server.url()).unwrap();
        RedisStore::from_multiplexed(c.get_multiplexed_async_connection().await.unwrap())
    });
    for round in 0..2 {
        bench(
            &rt,
            &Locker::with_config(crate_io.clone(), cfg(30_000)),
            &format!("crate-thread{round}"),
        );
        bench(
            &rt,
            &Locker::with_config(own.clone(), cfg(30_000)),
            &format!("own-runtime{round}"),
        );
    }
}

/// 1,000 acquires cancelled by a 1 ms timeout: stuck lane, keys left locked?
#[test]
fn cancel_storm() {
    let server = RedisServer::start();
    let rt = mt(2);
    let store = rt.block_on(RedisStore::connect(server.url())).unwrap();
    let locker = Locker::with_config(store, cfg(30_000));
    let got = Arc::new(AtomicUsize::new(0));
    let mut mon = std::process::Command::new("redis-cli")
        .args(["-p", &server.port().to_string(), "monitor"])
        .stdout(std::fs::File::create("/tmp/probe_mon.txt").unwrap())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(200));
    rt.block_on(async {
        join_all((0..1000).map(|i| {
            let locker = locker.clone();
            let got = got.clone();
            tokio::spawn(async move {
                if let Ok(Ok(g)) = tokio::time::timeout(
                    Duration::from_millis(1),
                    locker.acquire(locker.key("x", i.to_string()).unwrap()),
                )
                .await
                {
                    got.fetch_add(1, Ordering::Relaxed);
                    g.release().await.unwrap();
                }
            })
        }))
        .await
    });
    std::thread::sleep(Duration::from_millis(300));
    mon.kill().unwrap();
    let _ = mon.wait();
    eprintln!(
        "leaked keys: {}",
        server.cli(&["KEYS", "*:x:*"]).replace('\n', " ")
    );
    for ms in [300u64, 1700] {
        std::thread::sleep(Duration::from_millis(ms));
        let left = server.cli(&["EVAL", "local n=0 local m=0 for _,k in ipairs(redis.call('KEYS', '*:x:*')) do n=n+1 m=redis.call('PTTL',k) end return {n,m}", "0"]);
        eprintln!(
            "acquired in time: {}; lock keys left (count, a pttl) {:?}",
            got.load(Ordering::Relaxed),
            left.replace('\n', " ")
        );
    }
    let t = Instant::now();
    let ok = free(&rt, &locker, "x", "fresh-after");
    eprintln!("fresh acquire after storm ok={ok} in {:?}", t.elapsed());
    // Same storm, one key: how long is it blocked?
    let key_free = (0..200)
        .filter(|_| {
            let _ = rt.block_on(async {
                tokio::time::timeout(
                    Duration::from_micros(300),
                    locker.acquire(locker.key("y", "one").unwrap()),
                )
                .await
            });
            free(&rt, &locker, "y", "one")
        })
        .count();
    eprintln!("single key: free after a cancelled acquire in {key_free} of 200 tries; y keys now: {}", server.cli(&["EVAL", "local r={} for _,k in ipairs(redis.call('KEYS', '*:y:*')) do r[#r+1]=k r[#r+1]=redis.call('PTTL',k) end return r", "0"]).replace('\n', " "));
}

/// shutdown_timeout(0) with a guard held by a task, and mid-acquire.
#[test]
fn shutdown_timeout_zero() {
    let server = RedisServer::start();
    let main = mt(2);
    let store = main.block_on(RedisStore::connect(server.url())).unwrap();
    let locker = Locker::with_config(store, cfg(30_000));
    let doomed = mt(1);
    let l = locker.clone();
    doomed.spawn(async move {
        let _g = l.acquire(l.key("sd", "held").unwrap()).await.unwrap();
        tokio::time::sleep(Duration::from_secs(60)).await;
    });
    std::thread::sleep(Duration::from_millis(200));
    doomed.shutdown_timeout(Duration::ZERO);
    std::thread::sleep(Duration::from_millis(100));
    eprintln!(
        "guard held by a task at shutdown_timeout(0): key free 100ms later = {}",
        free(&main, &locker, "sd", "held")
    );
    // Mid-acquire.
    server.cli(&["CLIENT", "PAUSE", "400"]);
    let doomed = mt(1);
    let l = locker.clone();
    doomed.spawn(async move {
        let _g = l.acquire(l.key("sd", "mid").unwrap()).await;
        eprintln!("mid acquire answered: {:?}", _g.is_ok());
    });
    std::thread::sleep(Duration::from_millis(100));
    doomed.shutdown_timeout(Duration::ZERO);
    std::thread::sleep(Duration::from_millis(500));
    eprintln!("acquire in flight at shutdown_timeout(0): key free after = {} (ttl 30 s) pttl={}", free(&main, &locker, "sd", "mid"), server.cli(&["EVAL", "local k=redis.call('KEYS','*sd*mid*') if #k==0 then return -9 end return redis.call('PTTL', k[1])", "0"]));
}

/// A guard dropped with no Tokio runtime anywhere on the thread, its runtime gone.
#[test]
fn drop_outside_any_runtime() {
    let server = RedisServer::start();
    let rt = ct();
    let store = rt.block_on(RedisStore::connect(server.url())).unwrap();
    let locker = Locker::with_config(store, cfg(30_000));
    let g = rt
        .block_on(locker.acquire(locker.key("n", "k").unwrap()))
        .unwrap();
    drop(rt);
    let lease = g.lease().clone();
    std::thread::spawn(move || drop(g)).join().unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let lost = futures_util::FutureExt::now_or_never(lease.lost());
    let rt = ct();
    eprintln!(
        "dropped outside any runtime: key free 200 ms later = {}; lost() now = {lost:?}",
        free(&rt, &locker, "n", "k")
    );
}
