//! A least-privilege Redis user: the ACL rule that docs/TOPOLOGY.md gives for a
//! `RedisStore::connect` store is enough for everything the crate sends (acquire, queueing,
//! hand-off, renewal, release, a waiter that gives up, idempotency records; for one key and for a
//! set of them), and Redis refuses
//! nothing (`ACL LOG` stays empty). Without the `PUBSUB NUMSUB` the hand-off asks, a release
//! that hands over fails: the rule is not wider than it needs to be there. Leases with counts
//! need the sorted set commands the docs add, and are refused without them.

use crate::support;

use std::{num::NonZeroU32, time::Duration};

use axum::{
    Router,
    body::Body,
    http::{Request, StatusCode},
    routing::post,
};
use support::{handoff_subscriptions, keys_matching, send};
use tower_lock::{
    IdempotencyLayer, LeaseGuard, LockConfig, LockError, Locker, RedisStore, Wait, key::LockKey,
    lease::Acquiring, store::Eviction,
};
use tower_lock_testkit::RedisServer;

/// Two permits (a count is a `NonZeroU32`: 0 does not compile).
const TWO: NonZeroU32 = NonZeroU32::new(2).unwrap();

/// The rule, as docs/TOPOLOGY.md gives it ("A least-privilege user"), after `ACL SETUSER <name>`.
const RULE: &str = "on >s3cret resetkeys ~tower-lock:* resetchannels &tower-lock:handoff:* \
    -@all +evalsha +script|load +info +subscribe \
    +get +set +del +pexpire +pttl +time +llen +lpop +rpush +lindex +lrange +lrem \
    +publish +pubsub|numsub";

/// What leases with counts (permits, shared and exclusive leases) add to `RULE`, for a key's
/// holders, as docs/TOPOLOGY.md gives it.
const COUNTS: &str = " +type +zadd +zrem +zscore +zrange +zremrangebyscore +zrangebyscore +zcard +hset +hmget +hincrby";

const USER: &str = "locker";

/// Creates `USER` with `rule` on `server`, as its administrator.
async fn create_user(server: &RedisServer, rule: &str) {
    let mut admin = server.client().await;
    let mut setuser = redis::cmd("ACL");
    setuser.arg("SETUSER").arg(USER);
    for part in rule.split_whitespace() {
        setuser.arg(part);
    }
    let () = setuser.query_async(&mut admin).await.unwrap();
    let () = redis::cmd("ACL")
        .arg("LOG")
        .arg("RESET")
        .query_async(&mut admin)
        .await
        .unwrap();
}

/// What Redis refused, from `ACL LOG`: one "<reason> <object>" line per entry.
async fn refused(server: &RedisServer) -> Vec<String> {
    let mut admin = server.client().await;
    let log: Vec<redis::Value> = redis::cmd("ACL")
        .arg("LOG")
        .query_async(&mut admin)
        .await
        .unwrap();
    log.into_iter()
        .map(|entry| {
            let fields: Vec<(String, redis::Value)> = redis::from_redis_value(entry).unwrap();
            let field = |name: &str| {
                fields
                    .iter()
                    .find(|(k, _)| k == name)
                    .and_then(|(_, v)| redis::from_redis_value::<String>(v.clone()).ok())
                    .unwrap_or_default()
            };
            format!("{} {}", field("reason"), field("object"))
        })
        .collect()
}

/// A Redis server on which `USER` has `rule`, and two stores (two processes, as far as Redis
/// can tell) logged in as `USER`.
async fn stores_under(rule: &str) -> (RedisServer, RedisStore, RedisStore) {
    let server = RedisServer::start();
    create_user(&server, rule).await;
    let url = format!("redis://{USER}:s3cret@127.0.0.1:{}/", server.port());
    let a = RedisStore::connect(url.as_str()).await.unwrap();
    let b = RedisStore::connect(url.as_str()).await.unwrap();
    handoff_subscriptions(&server, 2).await;
    (server, a, b)
}

/// Asserts that `turns` failed with a store error: Redis refused one of its commands.
fn assert_refused(turns: Result<(), LockError>) {
    let error = turns.expect_err("Redis should have refused a command");
    assert!(matches!(error, LockError::Store(_)), "{error:?}");
}

fn locker(store: RedisStore, ttl: Duration, wait: Wait) -> Locker {
    Locker::with_config(
        store,
        LockConfig::builder().ttl(ttl).wait(wait).build().unwrap(),
    )
}

fn key(locker: &Locker) -> LockKey {
    locker.key("acl", "hot").unwrap()
}

/// How long the lockers that queue wait: long enough for any hand-over here.
fn patiently() -> Wait {
    Wait::constant(Duration::from_secs(5))
        .unwrap()
        .deadline(Duration::from_secs(10))
}

/// Asserts that an acquire of `keys` on `store` (by a locker that waits at most 300 ms), queued
/// behind a holder, gives up: `Contended`. `who` names it in the message.
async fn assert_gives_up<K: Into<tower_lock::key::KeySet>>(
    store: &RedisStore,
    keys: impl FnOnce(&Locker) -> K,
    who: &str,
) {
    let quitter = locker(
        store.clone(),
        Duration::from_secs(10),
        Wait::constant(Duration::from_secs(5))
            .unwrap()
            .deadline(Duration::from_millis(300)),
    );
    match quitter.acquire(keys(&quitter)).await {
        Err(LockError::Contended { .. }) => {}
        other => panic!("expected {who} to give up, got {other:?}"),
    }
}

/// Releases `held` once `queued` (an acquire of what it holds, by a locker whose TTL is short
/// enough to renew within 700 ms) has had 200 ms to queue behind it; answers how many times the
/// lease `queued` was handed renewed in the 700 ms it kept it.
async fn hand_over(held: LeaseGuard, queued: Acquiring) -> Result<u32, LockError> {
    let next = tokio::spawn(async move {
        let guard = queued.await?;
        tokio::time::sleep(Duration::from_millis(700)).await;
        let renewals = guard.lease().renewals();
        guard.release().await?;
        Ok::<u32, LockError>(renewals)
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    held.release().await?;
    next.await.unwrap()
}

/// Acquire, queue, hand over, renew, release; and a waiter that gives up (leaving the queue).
/// Answers the first error.
async fn take_turns(a: &RedisStore, b: &RedisStore) -> Result<(), LockError> {
    let wait = patiently();
    let holder = locker(a.clone(), Duration::from_secs(10), wait.clone());
    let held = holder.acquire(key(&holder)).await?;
    // Queued behind the holder, then handed the key by its release; a TTL short enough that it
    // renews (with a claim window of 1 s, the first renewal is due within about 330 ms).
    let waiter = locker(b.clone(), Duration::from_millis(600), wait);
    let renewals = hand_over(held, waiter.acquire(key(&waiter))).await?;
    assert!(renewals >= 1, "the handed-over lease was never renewed");
    // A waiter that gives up while queued takes itself out of the queue.
    let holder = locker(a.clone(), Duration::from_secs(10), Wait::none());
    let held = holder.acquire(key(&holder)).await?;
    assert_gives_up(b, key, "the waiter").await;
    held.release().await?;
    take_turns_with_sets(a, b).await
}

/// The same for a lease on three keys: queued for the held one (keeping the keys before it),
/// handed it, renewed, released; and a set that gives up while queued (leaving the queue,
/// giving back what it kept). Answers the first error.
async fn take_turns_with_sets(a: &RedisStore, b: &RedisStore) -> Result<(), LockError> {
    let wait = patiently();
    let holder = locker(a.clone(), Duration::from_secs(10), wait.clone());
    let held = holder.acquire(key(&holder)).await?;
    let waiter = locker(b.clone(), Duration::from_millis(600), wait);
    let set = |locker: &Locker| -> Vec<LockKey> {
        ["cold", "hot", "warm"]
            .iter()
            .map(|v| locker.key("acl", v).unwrap())
            .collect()
    };
    let renewals = hand_over(held, waiter.acquire(set(&waiter))).await?;
    assert!(renewals >= 1, "the set was never renewed");
    let held = holder.acquire(key(&holder)).await?;
    assert_gives_up(b, set, "the set").await;
    held.release().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_documented_acl_rule_is_enough() {
    let (server, a, b) = stores_under(RULE).await;
    assert_eq!(a.eviction().await.unwrap(), Eviction::Never);
    take_turns(&a, &b).await.unwrap();
    // Idempotency records: the first request runs, the retry is replayed from Redis.
    let app = Router::new()
        .route("/payments", post(|| async { "charged" }))
        .route_layer(IdempotencyLayer::new(
            a.clone(),
            tower_lock::idempotency::SharedKeySpace,
        ));
    for _ in 0..2 {
        let request = Request::post("/payments")
            .header("idempotency-key", "\"acl-test-key-0001\"")
            .body(Body::empty())
            .unwrap();
        assert_eq!(send(&app, request).await.status(), StatusCode::OK);
    }
    assert_eq!(refused(&server).await, Vec::<String>::new());
    let records = keys_matching(&server, "tower-lock:*").await;
    assert!(
        records.iter().all(
            |k| support::is_record_key(k.as_bytes()) || support::is_fence_counter(k.as_bytes())
        ),
        "lock keys left behind: {records:?}"
    );
}

/// The negative control: the same rule without `+pubsub|numsub`. Acquiring still works; the
/// attempt that queues a waiter (it checks that the waiter's process listens on this server)
/// and the release that hands the key over are refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_pubsub_numsub_hand_off_is_refused() {
    let (server, a, b) = stores_under(&RULE.replace(" +pubsub|numsub", "")).await;
    // Queueing and handing over are refused.
    assert_refused(take_turns(&a, &b).await);
    let refused = refused(&server).await;
    assert!(
        refused.iter().any(|r| r.contains("pubsub|numsub")),
        "{refused:?}"
    );
}

/// `+info` is optional: without it the stores connect all the same (the eviction policy they
/// read at connect is unknown, the native compare commands are not detected) and everything
/// else works; Redis refuses only the `INFO`s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_info_the_stores_connect_and_the_eviction_policy_is_unknown() {
    let (server, a, b) = stores_under(&RULE.replace(" +info", "")).await;
    assert_eq!(a.eviction().await.unwrap(), Eviction::Unknown);
    take_turns(&a, &b).await.unwrap();
    let refused = refused(&server).await;
    assert!(
        !refused.is_empty(),
        "INFO was not refused: the test shows nothing"
    );
    assert!(refused.iter().all(|r| r.ends_with(" info")), "{refused:?}");
}

/// Leases with counts as `USER`: two permits held at once across the two stores, a third
/// request queued and handed a permit by a release, renewed, released; then a reader and a
/// writer of one key taking turns, and two readers of a set of counted keys. Answers the first
/// error.
async fn take_turns_with_counts(a: &RedisStore, b: &RedisStore) -> Result<(), LockError> {
    let wait = patiently();
    let first = locker(a.clone(), Duration::from_secs(10), wait.clone());
    let second = locker(b.clone(), Duration::from_secs(10), wait.clone());
    let key = |locker: &Locker| locker.key("acl", "counted").unwrap();
    let one = first.acquire(key(&first)).permits(TWO).unwrap().await?;
    let two = second.acquire(key(&second)).permits(TWO).unwrap().await?;
    let waiter = locker(b.clone(), Duration::from_millis(600), wait.clone());
    let renewals = hand_over(one, waiter.acquire(key(&waiter)).permits(TWO).unwrap()).await?;
    assert!(renewals >= 1, "the handed-over permit was never renewed");
    two.release().await?;
    let reader = first.acquire(key(&first)).shared().unwrap().await?;
    let writer = second.acquire(key(&second)).exclusive().unwrap();
    let writing = tokio::spawn(async move {
        writer.await?.release().await?;
        Ok::<(), LockError>(())
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    reader.release().await?;
    writing.await.unwrap()?;
    // A set of counted keys (the counted set scripts), held shared while another reader shares it.
    let set = |locker: &Locker| -> Vec<LockKey> {
        ["counted", "counted-too"]
            .iter()
            .map(|v| locker.key("acl", v).unwrap())
            .collect()
    };
    let readers = first.acquire(set(&first)).shared().unwrap().await?;
    let also = second.acquire(set(&second)).shared().unwrap().await?;
    also.release().await?;
    readers.release().await?;
    Ok(())
}

/// The rule with what counts add is enough for leases with counts: Redis refuses nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_documented_acl_rule_is_enough_for_counts() {
    let (server, a, b) = stores_under(&format!("{RULE}{COUNTS}")).await;
    take_turns_with_counts(&a, &b).await.unwrap();
    assert_eq!(refused(&server).await, Vec::<String>::new());
}

/// The negative control: without what counts add, the first counted acquire is refused (and
/// reported as a store error), while the plain lease works as above.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_sorted_set_commands_counts_are_refused() {
    let (server, a, b) = stores_under(RULE).await;
    // Counted leases are refused.
    assert_refused(take_turns_with_counts(&a, &b).await);
    assert!(!refused(&server).await.is_empty(), "Redis refused nothing");
}
