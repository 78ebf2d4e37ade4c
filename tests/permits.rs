//! N-permit leases on real Redis: at most N holders of a key at once across several processes
//! (each store and `Locker` here stands for one), a dead holder's permit freed at its TTL,
//! renewals that keep a long holder, first come first served across processes, 429 through the
//! layer, and bad settings refused with a clear error.

use crate::support;

use std::{
    num::NonZeroU32,
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use axum::{
    Router,
    body::Body,
    http::{Request, StatusCode},
    routing::post,
};
use support::{LockKeys, body_json, companion_key, handoff_subscriptions, processes, send};
use tower_lock::{
    Key, LockConfig, LockLayer, Locker, RedisStore, Wait,
    key::{LockKey, Share},
    store::{Capabilities, LockStore, RedlockStore, Token},
};
use tower_lock_testkit::RedisServer;

/// Two permits (a count is a `NonZeroU32`: 0 does not compile).
const TWO: NonZeroU32 = NonZeroU32::new(2).unwrap();

/// How many holders run at once, at most.
#[derive(Default)]
struct Inside {
    now: AtomicUsize,
    most: AtomicUsize,
}

impl Inside {
    async fn run(&self, work: Duration) {
        let now = self.now.fetch_add(1, Ordering::SeqCst) + 1;
        self.most.fetch_max(now, Ordering::SeqCst);
        tokio::time::sleep(work).await;
        self.now.fetch_sub(1, Ordering::SeqCst);
    }
}

/// 24 requests from three processes, each holding 40 ms: `permits` (or, `None`, no lock).
async fn most_at_once(lockers: &[Locker], permits: Option<NonZeroU32>) -> usize {
    let inside = Arc::new(Inside::default());
    let mut tasks = Vec::new();
    for i in 0..24 {
        let locker = lockers[i % lockers.len()].clone();
        let inside = Arc::clone(&inside);
        tasks.push(tokio::spawn(async move {
            let work = Duration::from_millis(40);
            match permits {
                Some(permits) => {
                    let key = locker.key("provider", "acct-1").unwrap();
                    let guard = locker.acquire(key).permits(permits).unwrap().await.unwrap();
                    inside.run(work).await;
                    guard.release().await.expect("the permit was lost");
                }
                None => inside.run(work).await,
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    inside.most.load(Ordering::SeqCst)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_most_n_holders_at_once_across_processes() {
    let server = RedisServer::start();
    let lockers = processes(&server, 3).await;
    let most = most_at_once(&lockers, NonZeroU32::new(3)).await;
    assert!(most <= 3, "{most} holders of 3 permits at once");
    assert_eq!(most, 3, "the permits were never all used: {most}");
    assert!(server.lock_keys().await.is_empty(), "keys left behind");
    // The negative control: the same load without the limit runs more than 3 at once.
    let unlimited = most_at_once(&lockers, None).await;
    assert!(
        unlimited > 3,
        "the load never exceeded the limit: {unlimited}"
    );
}

/// A holder that died (took its permit and never renews or releases) frees it at its TTL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_holders_permit_frees_at_its_ttl() {
    let server = RedisServer::start();
    let store = RedisStore::connect(server.url()).await.unwrap();
    let locker = processes(&server, 1).await.remove(0);
    let key = locker.key("provider", "acct-1").unwrap();
    let ttl = Duration::from_millis(400);
    let counted = key.clone().with_share(Share::permit(2).unwrap());
    for _ in 0..2 {
        let dead = Token::generate().unwrap();
        let answer = LockStore::acquire(&store, &counted, &dead, ttl)
            .await
            .unwrap();
        assert!(matches!(
            answer,
            tower_lock::store::Acquire::Acquired { .. }
        ));
    }
    assert!(
        locker
            .acquire(key.clone())
            .permits(TWO)
            .unwrap()
            .try_acquire()
            .await
            .unwrap()
            .is_none(),
        "a third holder of 2 permits"
    );
    let started = Instant::now();
    let guard = locker.acquire(key).permits(TWO).unwrap().await.unwrap();
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(250),
        "got in after {waited:?}"
    );
    guard.release().await.unwrap();
}

/// Renewals keep a holder whose work outlasts its TTL many times over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewals_keep_a_long_holder() {
    let server = RedisServer::start();
    let lockers = processes(&server, 2).await;
    let key = lockers[0].key("provider", "acct-1").unwrap();
    let ttl = Duration::from_millis(150);
    let long = lockers[0]
        .acquire(key.clone())
        .permits(NonZeroU32::MIN)
        .unwrap()
        .ttl(ttl)
        .unwrap()
        .await
        .unwrap();
    tokio::time::sleep(ttl * 6).await;
    assert!(!long.lease().is_lost());
    let other = lockers[1]
        .acquire(key.clone())
        .permits(NonZeroU32::MIN)
        .unwrap()
        .try_acquire()
        .await
        .unwrap();
    assert!(other.is_none(), "the renewed permit was taken by another");
    long.release().await.unwrap();
    let other = lockers[1]
        .acquire(key)
        .permits(NonZeroU32::MIN)
        .unwrap()
        .try_acquire()
        .await
        .unwrap();
    assert!(other.is_some());
}

/// First come first served across processes: a request for both permits, queued behind a
/// holder of one, is not overtaken by requests for one that come after it (each of which
/// would fit at once).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_heavy_request_is_not_overtaken_by_lighter_ones() {
    let server = RedisServer::start();
    let lockers = processes(&server, 3).await;
    let key = lockers[0].key("provider", "acct-1").unwrap();
    let holder = lockers[0]
        .acquire(key.clone())
        .permits(TWO)
        .unwrap()
        .await
        .unwrap();
    let order = Arc::new(Mutex::new(Vec::new()));
    let heavy = tokio::spawn({
        let (locker, key, order) = (lockers[1].clone(), key.clone(), Arc::clone(&order));
        async move {
            let guard = locker
                .acquire(key)
                .permits(TWO)
                .unwrap()
                .weight(TWO)
                .unwrap()
                .await
                .unwrap();
            order.lock().unwrap().push("heavy");
            tokio::time::sleep(Duration::from_millis(50)).await;
            guard.release().await.unwrap();
        }
    });
    // The heavy request is queued in Redis.
    support::wait_until_queued(&server, key.as_bytes(), 1, "the heavy request").await;
    let mut light = Vec::new();
    for i in 0..3 {
        let (locker, key, order) = (lockers[2 - i % 2].clone(), key.clone(), Arc::clone(&order));
        light.push(tokio::spawn(async move {
            let guard = locker.acquire(key).permits(TWO).unwrap().await.unwrap();
            order.lock().unwrap().push("light");
            guard.release().await.unwrap();
        }));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(
        order.lock().unwrap().is_empty(),
        "overtaken: {:?}",
        order.lock().unwrap()
    );
    holder.release().await.unwrap();
    heavy.await.unwrap();
    for task in light {
        task.await.unwrap();
    }
    assert_eq!(order.lock().unwrap()[0], "heavy");
    assert!(server.lock_keys().await.is_empty(), "keys left behind");
}

/// The layer: a request that finds no permit free within the wait answers 429 with
/// `Retry-After` and a problem body; under the limit, requests run together.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_layer_answers_429_when_no_permit_frees() {
    let server = RedisServer::start();
    let store = RedisStore::connect(server.url()).await.unwrap();
    handoff_subscriptions(&server, 1).await;
    let config = LockConfig::builder()
        .wait(
            Wait::constant(Duration::from_millis(50))
                .unwrap()
                .deadline(Duration::from_millis(300)),
        )
        .build()
        .unwrap();
    let layer = LockLayer::with_config(store, Key::header("x-merchant-id").unwrap(), config)
        .permits(TWO)
        .unwrap();
    let app = Router::new()
        .route(
            "/charge",
            post(|| async {
                tokio::time::sleep(Duration::from_millis(1500)).await;
                "charged"
            }),
        )
        .route_layer(layer);
    let charge = || {
        Request::post("/charge")
            .header("x-merchant-id", "m-1")
            .body(Body::empty())
            .unwrap()
    };
    let running: Vec<_> = (0..2)
        .map(|_| {
            let app = app.clone();
            tokio::spawn(async move { send(&app, charge()).await.status() })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let refused = send(&app, charge()).await;
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    let retry: u64 = refused.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=10).contains(&retry), "Retry-After: {retry}");
    assert_eq!(
        refused.headers()["content-type"],
        "application/problem+json"
    );
    let body = body_json(refused).await;
    support::assert_problem_type(&body, "#permits-exhausted");
    for task in running {
        assert_eq!(task.await.unwrap(), StatusCode::OK);
    }
}

/// Settings that could never be granted are refused when the call is built, before anything
/// is sent, with an error that names them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_settings_are_clear_errors() {
    let server = RedisServer::start();
    let locker = processes(&server, 1).await.remove(0);
    let key = locker.key("provider", "acct-1").unwrap();
    let acquire = || locker.acquire(key.clone());
    let over = acquire()
        .permits(TWO)
        .unwrap()
        .weight(NonZeroU32::new(3).unwrap())
        .unwrap_err();
    assert_eq!(over.field(), "weight");
    assert!(over.to_string().contains("never"), "{over}");
    assert_eq!(acquire().weight(TWO).unwrap_err().field(), "weight");
    let mixed = acquire().shared().unwrap().weight(TWO).unwrap_err();
    assert_eq!(mixed.field(), "weight");
    let mixed = acquire()
        .permits(TWO)
        .unwrap()
        .weight(TWO)
        .unwrap()
        .exclusive();
    assert_eq!(mixed.unwrap_err().field(), "exclusive");
    // What passes is granted: two permits' worth of weight on two permits.
    let whole = acquire().permits(TWO).unwrap().weight(TWO).unwrap().await;
    whole.unwrap().release().await.unwrap();
    // Redlock cannot count holders (a quorum of nodes each admitting N would admit more).
    let redlock =
        RedlockStore::new(vec![RedisStore::connect(server.url()).await.unwrap()]).unwrap();
    assert!(!redlock.capabilities().counts());
    let locker = Locker::new(redlock);
    let key = locker.key("provider", "acct-1").unwrap();
    let refused = locker.acquire(key).permits(TWO).unwrap_err();
    assert!(refused.to_string().contains("cannot count"), "{refused}");
    assert_eq!(refused.field(), "permits");
    assert!(!Capabilities::none().counts());
}

/// The store-level view: a key with a share is a set of holders in Redis, beside the plain
/// lock's string; and the plain lock's key is untouched by it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_counted_key_holds_its_holders() {
    let server = RedisServer::start();
    let store = RedisStore::connect(server.url()).await.unwrap();
    let key = LockKey::new("tower-lock:", "s", b"k", 64).unwrap();
    let counted = key.clone().with_share(Share::permit(3).unwrap());
    let ttl = Duration::from_secs(5);
    let tokens: Vec<Token> = (0..3).map(|_| Token::generate().unwrap()).collect();
    for token in &tokens {
        LockStore::acquire(&store, &counted, token, ttl)
            .await
            .unwrap();
    }
    let mut conn = server.client().await;
    let kind: String = redis::cmd("TYPE")
        .arg(key.as_bytes())
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(kind, "zset");
    let holders: usize = redis::cmd("ZCARD")
        .arg(key.as_bytes())
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(holders, 3);
    // The running sum of the holders' weights, beside the set and gone with it.
    let sum = companion_key(key.as_bytes(), "weight");
    // The set's TTL read first: the sum's, read after, can only be lower for it.
    let (used, capacity, set_ttl, sum_ttl): (i64, i64, i64, i64) = redis::pipe()
        .hget(&sum, "u")
        .hget(&sum, "c")
        .pttl(key.as_bytes())
        .pttl(&sum)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(
        (used, capacity),
        (3, 3),
        "the sum, and the capacity its holders named"
    );
    // Given the same TTL in one script, after the set: Redis reads its clock at each command,
    // so the sum may end a millisecond or two after the set (a sum left without its set is
    // written afresh by the next holder, never counted).
    assert!(
        sum_ttl > 0 && sum_ttl <= set_ttl + 10,
        "sum {sum_ttl} ms, set {set_ttl} ms"
    );
    assert!(
        LockStore::renew(&store, &counted, &tokens[1], ttl)
            .await
            .unwrap()
    );
    for token in &tokens {
        assert!(LockStore::release(&store, &counted, token).await.unwrap());
        assert!(!LockStore::release(&store, &counted, token).await.unwrap());
    }
    assert!(server.lock_keys().await.is_empty(), "keys left behind");
}

/// An acquire reads a counted key's running sum, not its holders; a sum that went missing beside
/// its holders (evicted alone, or a set written before the sum existed) is counted again from
/// them, and a sum left without its set counts for nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_sum_is_counted_again_and_a_stale_one_counts_nothing() {
    let server = RedisServer::start();
    // Each acquire from a process of its own, so that each asks Redis (a process counts its own
    // holders before it asks).
    let lockers = processes(&server, 3).await;
    let key = lockers[0].key("provider", "acct-1").unwrap();
    let sum = companion_key(key.as_bytes(), "weight");
    let mut conn = server.client().await;
    let turn = AtomicUsize::new(0);
    let try_one = || async {
        lockers[turn.fetch_add(1, Ordering::SeqCst) % lockers.len()]
            .acquire(key.clone())
            .permits(TWO)
            .unwrap()
            .try_acquire()
            .await
            .unwrap()
    };
    let first = try_one().await.expect("the first of 2 permits");
    let second = try_one().await.expect("the second of 2 permits");
    let _: () = redis::cmd("DEL")
        .arg(&sum)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(
        try_one().await.is_none(),
        "a third holder of 2 permits once the sum was lost"
    );
    let used: i64 = redis::cmd("HGET")
        .arg(&sum)
        .arg("u")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(used, 2, "the sum counted again from the holders");
    first.release().await.unwrap();
    second.release().await.unwrap();
    assert!(server.lock_keys().await.is_empty(), "keys left behind");
    // A sum whose set is gone (deleted by hand here; a string, as a version before capacities
    // were kept wrote it) must not hold anyone out.
    let _: () = redis::cmd("SET")
        .arg(&sum)
        .arg(2)
        .query_async(&mut conn)
        .await
        .unwrap();
    let one = try_one().await.expect("a permit beside a stale sum");
    let two = try_one()
        .await
        .expect("the second permit beside a stale sum");
    one.release().await.unwrap();
    two.release().await.unwrap();
    assert!(server.lock_keys().await.is_empty(), "keys left behind");
}

/// A key's capacity is its holders': while two processes hold permits of a key of two, a third
/// that names three is refused with an error that says so (it would admit a third holder by its
/// own count), alone or with another key, on Redis as in memory; once the holders are gone, the
/// key takes whatever capacity its next holder names. Without the check (a third holder naming
/// three), the key would have three holders at once: the test asserts it never does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_keeps_the_capacity_its_holders_named() {
    let server = RedisServer::start();
    let in_redis = processes(&server, 3).await;
    // Three lockers on one store stand for three processes: each has its own local queues.
    let memory = tower_lock::MemoryStore::new();
    let in_memory: Vec<Locker> = (0..3).map(|_| Locker::new(memory.clone())).collect();
    let three = NonZeroU32::new(3).unwrap();
    for (redis, lockers) in [(true, &in_redis), (false, &in_memory)] {
        let key = lockers[0].key("provider", "acct-capacity").unwrap();
        let other = lockers[0].key("provider", "acct-other").unwrap();
        let first = lockers[0].acquire(key.clone()).permits(TWO).unwrap().await;
        let second = lockers[1].acquire(key.clone()).permits(TWO).unwrap().await;
        let (first, second) = (first.unwrap(), second.unwrap());
        let third = lockers[2].acquire(key.clone()).permits(three).unwrap();
        let refused = third.wait(Wait::none()).await.unwrap_err();
        let text = format!("{refused}: {:?}", std::error::Error::source(&refused));
        assert!(text.contains("capacity of 2"), "redis {redis}: {text}");
        // A server's mistake, not an outage: 500, and retrying does not help.
        assert_eq!(refused.status(), StatusCode::INTERNAL_SERVER_ERROR);
        let tower_lock::LockError::Store(store) = &refused else {
            panic!("{text}")
        };
        assert_eq!(store.kind(), tower_lock::store::StoreErrorKind::Misused);
        // With another key, as one lease: refused too, and the other key left free.
        let set = lockers[2]
            .acquire([key.clone(), other.clone()])
            .permits(three)
            .unwrap()
            .wait(Wait::none())
            .await;
        assert!(set.is_err(), "redis {redis}: {set:?}");
        let free = lockers[2].try_acquire(other.clone()).await.unwrap();
        assert!(free.is_some(), "redis {redis}: the other key was left held");
        drop(free);
        // The holders' own number still admits no third.
        let held = lockers[2].acquire(key.clone()).permits(TWO).unwrap();
        assert!(held.try_acquire().await.unwrap().is_none(), "redis {redis}");
        first.release().await.unwrap();
        second.release().await.unwrap();
        // Free again: the next holder names the capacity.
        let next = lockers[2].acquire(key).permits(three).unwrap().await;
        next.unwrap().release().await.unwrap();
    }
}
