//! `SentinelStore` on a real master, replica and three sentinels on loopback (`redis-server
//! <conf> --sentinel`): the exclusion suite, a master killed and its replica promoted, a
//! manual failover that demotes a live master, and hand-off across a failover. The store's
//! crate-private operations across a failover (waiters queued before it queueing again,
//! batched renewals sent again to the new master) are tested in the crate,
//! `src/store/tests/sentinel.rs`.
#![cfg(feature = "sentinel")]

use crate::suite;
use crate::support;

use std::{
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use support::{Backend, LockKeys, handoff_subscriptions};
use tower_lock::{
    LockConfig, Locker, Wait,
    key::LockKey,
    store::{Acquire, LockStore, SentinelStore, StoreErrorKind, Token},
};
use tower_lock_testkit::{
    RedisServer,
    sentinel::{MASTER_NAME, SentinelSetup},
};

/// The stores of one Sentinel setup.
struct Sentinel(SentinelSetup);

impl Backend for Sentinel {
    type Store = SentinelStore;
    const NAME: &'static str = "sentinel";
    async fn store(&self) -> SentinelStore {
        SentinelStore::connect(self.0.sentinel_urls(), MASTER_NAME)
            .await
            .expect("connect through the test sentinels")
    }
}

/// Starts a master, its replica and the sentinels that watch them, which fail over once the
/// master has been down `down_after` (blocking this runtime worker meanwhile).
fn sentinels(down_after: Duration) -> SentinelSetup {
    tokio::task::block_in_place(|| SentinelSetup::start(down_after))
}

// Down after 5 s: no failover from a slow answer on a loaded machine during the suite.
suite::tests!(
    Sentinel(sentinels(Duration::from_secs(5)));
    exclusion,
    own_token_acquires_again,
);

// The negative control for `exclusion`.
suite::controls!(without_the_lock_updates_are_lost);

/// Leases on several keys, with hand-off, through the master Sentinel names.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sets_of_keys() {
    let setup = sentinels(Duration::from_secs(5));
    suite::set_tests_in_turn(Sentinel(setup)).await;
}

fn key(value: &str) -> LockKey {
    LockKey::new("tower-lock:", "t", value.as_bytes(), 64).unwrap()
}

fn acquired(answer: Acquire) -> u64 {
    match answer {
        Acquire::Acquired { fencing_token } => fencing_token,
        other => panic!("not acquired: {other:?}"),
    }
}

async fn get(server: &RedisServer, key: &LockKey) -> Option<Vec<u8>> {
    let mut conn = server.client().await;
    redis::cmd("GET")
        .arg(key.as_bytes())
        .query_async(&mut conn)
        .await
        .unwrap()
}

/// Retries `acquire` through store errors (503s while there is no master) for at most `within`.
async fn acquire_until_answered(
    store: &SentinelStore,
    key: &LockKey,
    token: &Token,
    within: Duration,
) -> Acquire {
    let started = Instant::now();
    loop {
        match store.acquire(key, token, Duration::from_secs(30)).await {
            Ok(answer) => return answer,
            Err(error) => {
                assert!(
                    started.elapsed() < within,
                    "no answer within {within:?} (master {}): {error}",
                    store.master_addr()
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// The master is killed; the sentinels promote the replica; every store, including ones
/// connected before the failover, follows: new leases are granted on the new master within
/// 10 s and are exclusive, and a lease acknowledged by the replica before the kill survives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn master_killed_replica_promoted() {
    let mut setup = sentinels(Duration::from_millis(500));
    let urls = setup.sentinel_urls();
    let connect = || SentinelStore::connect(urls.clone(), MASTER_NAME);
    let holder = connect().await.unwrap();
    let contender = connect().await.unwrap();
    let acked = connect()
        .await
        .unwrap()
        .wait_for_replicas(1, Duration::from_millis(500))
        .unwrap();
    let (old, new) = (setup.master.port(), setup.replica.port());
    assert_eq!(holder.master_addr(), format!("127.0.0.1:{old}"));

    // Acknowledged by the replica (WAIT 1) before the master dies.
    let replicated = key("replicated");
    let replicated_token = Token::generate().unwrap();
    let replicated_fence = acquired(
        acked
            .acquire(&replicated, &replicated_token, Duration::from_secs(30))
            .await
            .unwrap(),
    );

    let killed_at = Instant::now();
    setup.master.kill();
    let k = key("after-failover");
    let token = Token::generate().unwrap();
    let fence =
        acquired(acquire_until_answered(&holder, &k, &token, Duration::from_secs(10)).await);
    let followed_after = killed_at.elapsed();
    eprintln!("a new lease was granted {followed_after:?} after the master was killed");
    assert!(followed_after < Duration::from_secs(10));
    assert_eq!(holder.master_addr(), format!("127.0.0.1:{new}"));
    assert!(setup.replica.cli(&["ROLE"]).starts_with("master"));
    assert_eq!(
        get(&setup.replica, &k).await.as_deref(),
        Some(token.as_bytes())
    );
    tokio::task::block_in_place(|| setup.wait_for_master(new, Duration::from_secs(10)));

    // Exclusive: a store that was on the old master follows and is refused, so is a new one.
    let other = Token::generate().unwrap();
    let held = acquire_until_answered(&contender, &k, &other, Duration::from_secs(5)).await;
    assert!(matches!(held, Acquire::Contended { .. }), "{held:?}");
    assert_eq!(contender.master_addr(), format!("127.0.0.1:{new}"));
    let late = connect().await.unwrap();
    assert_eq!(late.master_addr(), format!("127.0.0.1:{new}"));
    let held = late
        .acquire(&k, &other, Duration::from_secs(30))
        .await
        .unwrap();
    assert!(matches!(held, Acquire::Contended { .. }), "{held:?}");

    // The replicated lease survived the failover.
    let held = late
        .acquire(&replicated, &other, Duration::from_secs(30))
        .await
        .unwrap();
    assert!(
        matches!(held, Acquire::Contended { .. }),
        "replicated lease lost: {held:?}"
    );

    // The holder renews and releases on the new master; fencing keeps increasing.
    assert!(
        holder
            .renew(&k, &token, Duration::from_secs(30))
            .await
            .unwrap()
    );
    assert!(holder.release(&k, &token).await.unwrap());
    let second = acquired(
        contender
            .acquire(&k, &other, Duration::from_secs(30))
            .await
            .unwrap(),
    );
    assert!(second > fence, "fencing went back: {fence} then {second}");
    assert!(second > replicated_fence);
    assert!(contender.release(&k, &other).await.unwrap());

    // WAIT 1 follows the store to the new master, which has no replica left: acquires fail
    // (and leave nothing behind) instead of granting unreplicated leases.
    let unreplicated = key("unreplicated");
    let error = acquire_error(&acked, &unreplicated).await;
    assert_eq!(error.kind(), StoreErrorKind::Unavailable, "{error:?}");
    assert!(error.to_string().contains("replicas"), "{error:?}");
    assert_eq!(acked.master_addr(), format!("127.0.0.1:{new}"));
    assert_eq!(get(&setup.replica, &unreplicated).await, None);
}

/// What `acquire` answers on a store that waits for a replica the new master does not have.
async fn acquire_error(store: &SentinelStore, key: &LockKey) -> tower_lock::store::StoreError {
    let token = Token::generate().unwrap();
    match store.acquire(key, &token, Duration::from_secs(30)).await {
        Err(error) => error,
        Ok(answer) => panic!("acquired without the replica's acknowledgement: {answer:?}"),
    }
}

/// `SENTINEL FAILOVER`: the replica is promoted and the live master demoted. The store notices
/// when the old master refuses writes (`READONLY`) or drops its clients, and moves on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn manual_failover_demotes_the_master() {
    let setup = sentinels(Duration::from_secs(5));
    let store = SentinelStore::connect(setup.sentinel_urls(), MASTER_NAME)
        .await
        .unwrap();
    let (old, new) = (setup.master.port(), setup.replica.port());
    assert_eq!(store.master_addr(), format!("127.0.0.1:{old}"));

    let reply = setup.sentinels[0].cli(&["SENTINEL", "FAILOVER", MASTER_NAME]);
    assert!(reply.contains("OK"), "SENTINEL FAILOVER: {reply}");
    let started = Instant::now();
    // Until the old master is demoted, leases still go to it; then the store must move.
    let mut n = 0;
    while store.master_addr() != format!("127.0.0.1:{new}") {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the store stayed on {} after the failover",
            store.master_addr()
        );
        let k = key(&format!("during-{n}"));
        n += 1;
        let token = Token::generate().unwrap();
        if let Ok(Acquire::Acquired { .. }) =
            store.acquire(&k, &token, Duration::from_secs(5)).await
        {
            let _ = store.release(&k, &token).await;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eprintln!(
        "the store followed {:?} after SENTINEL FAILOVER",
        started.elapsed()
    );

    let k = key("after-manual-failover");
    let token = Token::generate().unwrap();
    acquired(acquire_until_answered(&store, &k, &token, Duration::from_secs(5)).await);
    assert_eq!(
        get(&setup.replica, &k).await.as_deref(),
        Some(token.as_bytes())
    );
    assert!(store.release(&k, &token).await.unwrap());
}

/// Hand-off across a failover, between two processes (two stores, each with its own
/// connections and hand-off subscription). They subscribed on the master; it is killed and the
/// replica promoted; each store follows at its next call and moves its subscription to the new
/// master. Waiters of both processes then queue there and each is handed the key by the release
/// before its own, within the claim window (1 s), first come first served: no 5 s timer fires.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handoff_follows_a_killed_master() {
    let mut setup = sentinels(Duration::from_millis(500));
    let urls = setup.sentinel_urls();
    let one = SentinelStore::connect(urls.clone(), MASTER_NAME)
        .await
        .unwrap();
    let two = SentinelStore::connect(urls, MASTER_NAME).await.unwrap();
    handoff_subscriptions(&setup.master, 2).await;
    let new = format!("127.0.0.1:{}", setup.replica.port());

    setup.master.kill();
    for (i, store) in [&one, &two].into_iter().enumerate() {
        let (k, token) = (key(&format!("follow-{i}")), Token::generate().unwrap());
        acquired(acquire_until_answered(store, &k, &token, Duration::from_secs(10)).await);
        assert!(store.release(&k, &token).await.unwrap());
        assert_eq!(store.master_addr(), new);
    }
    // Both subscriptions moved with their stores.
    handoff_subscriptions(&setup.replica, 2).await;

    let wait = Wait::constant(Duration::from_secs(5))
        .unwrap()
        .deadline(Duration::from_secs(30));
    let locker = |store: &SentinelStore| {
        Locker::with_config(
            store.clone(),
            LockConfig::builder().wait(wait.clone()).build().unwrap(),
        )
    };
    let holder = locker(&one);
    let k = holder.key("handoff", "failover").unwrap();
    let held = holder.acquire(k.clone()).await.unwrap();
    // When each waiter got the key, and when it began to release it.
    let turns = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for i in 0..4 {
        let waiter = locker(if i % 2 == 0 { &two } else { &one });
        let (key, turns) = (k.clone(), Arc::clone(&turns));
        tasks.push(tokio::spawn(async move {
            let guard = waiter.acquire(key).await.unwrap();
            let got = Instant::now();
            tokio::time::sleep(Duration::from_millis(5)).await;
            turns.lock().unwrap().push((i, got, Instant::now()));
            guard.release().await.unwrap();
        }));
        let who = format!("waiter {i}");
        support::wait_until_queued(&setup.replica, k.as_bytes(), i + 1, &who).await;
    }
    let mut released = Instant::now();
    held.release().await.unwrap();
    for task in tasks {
        task.await.unwrap();
    }
    let turns = turns.lock().unwrap().clone();
    let order: Vec<usize> = turns.iter().map(|(i, _, _)| *i).collect();
    assert_eq!(order, [0, 1, 2, 3], "not first come first served");
    for (i, got, releasing) in turns {
        let waited = got - released;
        assert!(
            waited < Duration::from_secs(1),
            "waiter {i} got the key {waited:?} after the release before its own"
        );
        released = releasing;
    }
    assert!(
        setup.replica.lock_keys().await.is_empty(),
        "keys left behind"
    );
}

/// A background lookup that a runtime started, and that runtime then left undriven (a
/// current-thread runtime whose `block_on` returned) while the lookup waited for the sentinels,
/// does not stop the store from following a failover for every other runtime: lookups run on
/// the store's own thread.
#[test]
fn a_lookup_left_on_an_idle_runtime_does_not_stop_the_store_following() {
    let mut setup = SentinelSetup::start(Duration::from_millis(500));
    // The sentinels, behind proxies that can stall them.
    let proxies: Vec<_> = setup
        .sentinels
        .iter()
        .map(|s| tower_lock_testkit::proxy::Proxy::start(s.port()))
        .collect();
    let urls: Vec<String> = proxies.iter().map(|p| p.url()).collect();
    let main = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let store = main
        .block_on(SentinelStore::connect(urls, MASTER_NAME))
        .unwrap();
    let (old, new) = (setup.master.port(), setup.replica.port());
    assert_eq!(store.master_addr(), format!("127.0.0.1:{old}"));
    // A background lookup is due a second after connecting; it starts with the next call, on
    // the idle runtime, and waits for the stalled sentinels when that runtime stops.
    std::thread::sleep(Duration::from_millis(1100));
    for proxy in &proxies {
        proxy.stall();
    }
    let idle = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    idle.block_on(async {
        let k = key("idle");
        let token = Token::generate().unwrap();
        let _ = store.acquire(&k, &token, Duration::from_secs(30)).await;
        tokio::time::sleep(Duration::from_millis(200)).await;
    });
    for proxy in &proxies {
        proxy.heal();
    }
    setup.master.kill();
    setup.wait_for_master(new, Duration::from_secs(30));
    main.block_on(async {
        let k = key("after-idle-lookup");
        let token = Token::generate().unwrap();
        let answer = tokio::time::timeout(
            Duration::from_secs(20),
            acquire_until_answered(&store, &k, &token, Duration::from_secs(15)),
        )
        .await
        .expect("the store never followed the failover: its lookups wait for the idle runtime");
        acquired(answer);
    });
    assert_eq!(store.master_addr(), format!("127.0.0.1:{new}"));
    drop(idle);
}
