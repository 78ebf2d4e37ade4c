//! `SentinelStore` on a real master, replica and three sentinels on loopback (`redis-server
//! <conf> --sentinel`): the exclusion suite, a master killed and its replica promoted, and a
//! manual failover that demotes a live master.
#![cfg(feature = "sentinel")]

mod suite;
mod support;

use std::time::{Duration, Instant};

use support::{
    Backend, RedisServer,
    sentinel::{MASTER_NAME, SentinelSetup},
};
use tower_lock::{
    LockStore, SentinelStore, Token,
    key::LockKey,
    store::{Acquire, StoreErrorKind},
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

// Down after 5 s: no failover from a slow answer on a loaded machine during the suite.
suite::tests!(
    Sentinel(tokio::task::block_in_place(|| SentinelSetup::start(Duration::from_secs(5))));
    exclusion,
    own_token_acquires_again,
);

/// The negative control for `exclusion`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_lock_updates_are_lost() {
    suite::without_the_lock_updates_are_lost().await;
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
    let mut setup =
        tokio::task::block_in_place(|| SentinelSetup::start(Duration::from_millis(500)));
    let urls = setup.sentinel_urls();
    let connect = || SentinelStore::connect(urls.clone(), MASTER_NAME);
    let holder = connect().await.unwrap();
    let contender = connect().await.unwrap();
    let acked = connect()
        .await
        .unwrap()
        .wait_for_replicas(1, Duration::from_millis(500));
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
    assert!(matches!(held, Acquire::Held { .. }), "{held:?}");
    assert_eq!(contender.master_addr(), format!("127.0.0.1:{new}"));
    let late = connect().await.unwrap();
    assert_eq!(late.master_addr(), format!("127.0.0.1:{new}"));
    let held = late
        .acquire(&k, &other, Duration::from_secs(30))
        .await
        .unwrap();
    assert!(matches!(held, Acquire::Held { .. }), "{held:?}");

    // The replicated lease survived the failover.
    let held = late
        .acquire(&replicated, &other, Duration::from_secs(30))
        .await
        .unwrap();
    assert!(
        matches!(held, Acquire::Held { .. }),
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
    let setup = tokio::task::block_in_place(|| SentinelSetup::start(Duration::from_secs(5)));
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
