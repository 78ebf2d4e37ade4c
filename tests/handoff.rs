//! Hand-off between processes on Redis: a waiter queues in Redis, and the holder's release hands
//! the key straight to the head of the queue (`RedisStore::handoff`, on by default). Each store
//! here stands for a separate process (its own connections, its own `Locker`). The store's
//! crate-private queue operations on their own are tested in the crate
//! (`src/store/tests/redis.rs`), and the locker's side of a hand-off after a store error in
//! `src/engine/tests.rs`.

use crate::support;

use std::{
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use support::{LockKeys, handoff_subscriptions};
use tower_lock::{
    LockConfig, LockError, Locker, RedisStore, Wait,
    key::{LockKey, Share},
    store::{LockStore, Token},
};
use tower_lock_testkit::{Proxy, RedisServer, calls_of, redis_cli};

/// A wait policy whose timer would make any timer-woken waiter take seconds.
fn slow_timer() -> Wait {
    Wait::constant(Duration::from_secs(5))
        .unwrap()
        .deadline(Duration::from_secs(30))
}

fn locker(store: RedisStore, wait: Wait) -> Locker {
    Locker::with_config(store, LockConfig::builder().wait(wait).build().unwrap())
}

fn key(locker: &Locker) -> LockKey {
    locker.key("handoff", "hot").unwrap()
}

fn queue_key(key: &LockKey) -> Vec<u8> {
    support::queue_key(key.as_bytes())
}

/// Stores whose hand-off subscriptions are up (they subscribe in the background at connect).
async fn stores(server: &RedisServer, n: usize) -> Vec<RedisStore> {
    let mut out = Vec::new();
    for _ in 0..n {
        out.push(RedisStore::connect(server.url()).await.unwrap());
    }
    handoff_subscriptions(server, n).await;
    out
}

/// The same, with a claim window of `window`.
async fn stores_claiming(server: &RedisServer, n: usize, window: Duration) -> Vec<RedisStore> {
    let stores = stores(server, n).await;
    stores
        .into_iter()
        .map(|s| s.claim_window(window).unwrap())
        .collect()
}

async fn queue_len(server: &RedisServer, key: &LockKey) -> usize {
    let mut conn = server.client().await;
    redis::cmd("LLEN")
        .arg(queue_key(key))
        .query_async(&mut conn)
        .await
        .unwrap()
}

/// Waits until `n` waiters are queued for `key`.
async fn queued(server: &RedisServer, key: &LockKey, n: usize) {
    let started = Instant::now();
    while queue_len(server, key).await != n {
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "expected {n} queued waiters, found {}",
            queue_len(server, key).await
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// How long a second process waits for a key the first releases after 20 ms.
async fn second_process_waits(
    holder: RedisStore,
    waiter: RedisStore,
    server: &RedisServer,
) -> Duration {
    let wait = Wait::constant(Duration::from_millis(700))
        .unwrap()
        .deadline(Duration::from_secs(30));
    let (holder, waiter) = (locker(holder, wait.clone()), locker(waiter, wait));
    let held = holder.acquire(key(&holder)).await.unwrap();
    let started = Instant::now();
    let second = tokio::spawn(async move {
        let guard = waiter.acquire(key(&waiter)).await.unwrap();
        let token = guard.fencing_token();
        guard.release().await.unwrap();
        token
    });
    tokio::time::sleep(Duration::from_millis(20)).await;
    let first_token = held.fencing_token();
    held.release().await.unwrap();
    let second_token = second.await.unwrap();
    assert!(second_token > first_token, "fencing tokens must increase");
    assert!(server.lock_keys().await.is_empty(), "keys left behind");
    started.elapsed()
}

/// The release hands the key to the waiting process at once: no timer involved.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_release_hands_the_key_to_the_waiting_process() {
    let server = RedisServer::start();
    let [one, two] = <[RedisStore; 2]>::try_from(stores(&server, 2).await).unwrap();
    let took = second_process_waits(one, two, &server).await;
    assert!(
        took < Duration::from_millis(400),
        "woken by the 700 ms timer, not the hand-off: {took:?}"
    );
}

/// The negative control: without hand-off the waiter only retries on its 700 ms timer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_handoff_waiters_use_their_timer() {
    let server = RedisServer::start();
    let one = RedisStore::connect(server.url())
        .await
        .unwrap()
        .handoff(false)
        .unwrap();
    let two = RedisStore::connect(server.url())
        .await
        .unwrap()
        .handoff(false)
        .unwrap();
    let took = second_process_waits(one, two, &server).await;
    assert!(took >= Duration::from_millis(600), "{took:?}");
}

/// Waiters in five processes get the key in the order they asked for it, and each costs two
/// commands: the attempt that queued it and its release (which hands the key on).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn processes_take_turns_in_arrival_order() {
    let server = RedisServer::start();
    let mut all = stores(&server, 6).await;
    let holder = locker(all.remove(0), slow_timer());
    let k = key(&holder);
    // Every store loads its scripts once, outside the count.
    for store in &all {
        let warm = locker(store.clone(), slow_timer());
        warm.acquire(warm.key("warm", "up").unwrap())
            .await
            .unwrap()
            .release()
            .await
            .unwrap();
    }
    let held = holder.acquire(k.clone()).await.unwrap();
    let before = calls_of(&server, "evalsha").await;
    let order = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for (i, store) in all.into_iter().enumerate() {
        let (waiter, order) = (locker(store, slow_timer()), Arc::clone(&order));
        tasks.push(tokio::spawn(async move {
            let guard = waiter.acquire(key(&waiter)).await.unwrap();
            order.lock().unwrap().push(i);
            tokio::time::sleep(Duration::from_millis(5)).await;
            guard.release().await.unwrap();
        }));
        queued(&server, &k, i + 1).await;
    }
    let started = Instant::now();
    held.release().await.unwrap();
    for task in tasks {
        task.await.unwrap();
    }
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "a waiter waited for its 5 s timer: {:?}",
        started.elapsed()
    );
    assert_eq!(
        *order.lock().unwrap(),
        [0, 1, 2, 3, 4],
        "not first come first served"
    );
    let commands = calls_of(&server, "evalsha").await - before;
    // The holder's release, then per waiter: the queuing attempt and the release.
    assert_eq!(
        commands,
        1 + 5 * 2,
        "hand-offs cost more commands than expected"
    );
    assert!(server.lock_keys().await.is_empty(), "keys left behind");
}

/// A waiter that gives up (deadline) or is dropped mid-queue leaves the queue: the waiters
/// behind it are not held up by a hand-off to nobody.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn departed_waiters_leave_the_queue() {
    let server = RedisServer::start();
    // A long claim window: a hand-off to a departed waiter would show as a 5 s stall.
    let all = stores_claiming(&server, 5, Duration::from_secs(5)).await;
    let holder = locker(all[0].clone(), slow_timer());
    let k = key(&holder);
    let held = holder.acquire(k.clone()).await.unwrap();
    let order = Arc::new(Mutex::new(Vec::new()));
    let patient = |store: RedisStore, who: &'static str| {
        let (waiter, order) = (locker(store, slow_timer()), Arc::clone(&order));
        tokio::spawn(async move {
            let guard = waiter.acquire(key(&waiter)).await.unwrap();
            order.lock().unwrap().push(who);
            tokio::time::sleep(Duration::from_millis(5)).await;
            guard.release().await.unwrap();
        })
    };
    let first = patient(all[1].clone(), "first");
    queued(&server, &k, 1).await;
    // Gives up after 300 ms.
    let hasty = locker(
        all[2].clone(),
        Wait::constant(Duration::from_secs(5))
            .unwrap()
            .deadline(Duration::from_millis(300)),
    );
    let hasty = tokio::spawn(async move { hasty.acquire(key(&hasty)).await.map(drop) });
    queued(&server, &k, 2).await;
    // Dropped while queued (its client went away).
    let dropped = locker(all[3].clone(), slow_timer());
    let dropped = tokio::spawn(async move { dropped.acquire(key(&dropped)).await.map(drop) });
    queued(&server, &k, 3).await;
    let last = patient(all[4].clone(), "last");
    queued(&server, &k, 4).await;
    dropped.abort();
    assert!(matches!(
        hasty.await.unwrap(),
        Err(LockError::Contended { .. })
    ));
    queued(&server, &k, 2).await;
    let started = Instant::now();
    held.release().await.unwrap();
    first.await.unwrap();
    last.await.unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "the queue stalled behind a departed waiter: {:?}",
        started.elapsed()
    );
    assert_eq!(*order.lock().unwrap(), ["first", "last"]);
    assert!(
        server.lock_keys().await.is_empty(),
        "keys or queue left behind"
    );
}

/// A queue entry, as a waiter of another process would leave it: a token, a stamp, a channel.
fn entry(token: &str, channel: &str) -> String {
    format!("{token}0000000000000000{channel}")
}

async fn push_entries(server: &RedisServer, key: &LockKey, entries: &[String]) {
    let mut conn = server.client().await;
    for e in entries {
        let _: () = redis::cmd("RPUSH")
            .arg(queue_key(key))
            .arg(e)
            .query_async(&mut conn)
            .await
            .unwrap();
    }
}

/// Holds a key with two dead waiters' entries queued behind it (nobody subscribed to their
/// channels) and a live waiter behind those, with a 5 s claim window; releases it and answers
/// how long the live waiter took to get the key. Checks that nothing is left behind.
async fn past_two_dead_waiters(server: &RedisServer) -> Duration {
    let all = stores_claiming(server, 2, Duration::from_secs(5)).await;
    let holder = locker(all[0].clone(), slow_timer());
    let k = key(&holder);
    let held = holder.acquire(k.clone()).await.unwrap();
    let dead = [
        entry(
            "deaddeaddeaddeaddeaddeaddeaddead",
            "tower-lock:handoff:gone1",
        ),
        entry(
            "deadbeefdeadbeefdeadbeefdeadbeef",
            "tower-lock:handoff:gone2",
        ),
    ];
    push_entries(server, &k, &dead).await;
    let waiter = locker(all[1].clone(), slow_timer());
    let next = tokio::spawn(async move {
        let guard = waiter.acquire(key(&waiter)).await.unwrap();
        guard.release().await.unwrap();
    });
    queued(server, &k, 3).await;
    let started = Instant::now();
    held.release().await.unwrap();
    next.await.unwrap();
    let took = started.elapsed();
    assert!(server.lock_keys().await.is_empty(), "keys left behind");
    assert_eq!(queue_len(server, &k).await, 0, "dead entries left queued");
    took
}

/// Two waiters whose processes died while queued (nobody listens on their channels any more)
/// are skipped by the release: the live waiter behind them gets the key at once, not after a
/// claim window each (5 s here), nor after the holder's TTL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crashed_waiters_are_skipped() {
    let server = RedisServer::start();
    let took = past_two_dead_waiters(&server).await;
    assert!(
        took < Duration::from_secs(2),
        "the crashed waiters stalled the queue: {took:?}"
    );
}

/// A pattern subscriber whose pattern matches the waiters' channels (a debugging `PSUBSCRIBE *`,
/// or a tool watching `tower-lock:*`) does not pass for a crashed waiter's process: the live
/// waiter behind two dead ones still gets the key at once, not after a 5 s claim window each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pattern_subscriber_does_not_hide_crashed_waiters() {
    let server = RedisServer::start();
    let mut watcher = redis::Client::open(server.url())
        .unwrap()
        .get_async_pubsub()
        .await
        .unwrap();
    watcher.psubscribe("*").await.unwrap();
    let took = past_two_dead_waiters(&server).await;
    assert!(
        took < Duration::from_secs(2),
        "the pattern subscriber made the crashed waiters look alive: {took:?}"
    );
    drop(watcher);
}

/// A free key whose queue holds only waiters whose processes died (the holder's lease ran out
/// meanwhile) goes to the next caller at once, even one that will not wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_free_key_with_only_dead_waiters_is_taken() {
    let server = RedisServer::start();
    let all = stores(&server, 1).await;
    let caller = locker(all[0].clone(), Wait::none());
    let k = key(&caller);
    let dead = entry(
        "deaddeaddeaddeaddeaddeaddeaddead",
        "tower-lock:handoff:gone",
    );
    push_entries(&server, &k, &[dead]).await;
    let guard = caller.acquire(k.clone()).await.unwrap();
    assert_eq!(
        queue_len(&server, &k).await,
        0,
        "the dead entry is still queued"
    );
    guard.release().await.unwrap();
    assert!(server.lock_keys().await.is_empty(), "keys left behind");
}

/// Holds a key with a hung waiter's entry queued behind it (its process subscribed to its
/// channel, deaf to what arrives there), then the entries `between`, then a live waiter, with a
/// claim window of 300 ms; releases it and answers how long the live waiter took to get the
/// key. Checks that nothing is left behind.
async fn past_a_hung_waiter(server: &RedisServer, between: &[String]) -> Duration {
    let all = stores_claiming(server, 2, Duration::from_millis(300)).await;
    let holder = locker(all[0].clone(), slow_timer());
    let k = key(&holder);
    let held = holder.acquire(k.clone()).await.unwrap();
    let mut hung = redis::Client::open(server.url())
        .unwrap()
        .get_async_pubsub()
        .await
        .unwrap();
    hung.subscribe("tower-lock:handoff:hung").await.unwrap();
    let mut entries = vec![entry(
        "deaddeaddeaddeaddeaddeaddeaddead",
        "tower-lock:handoff:hung",
    )];
    entries.extend_from_slice(between);
    push_entries(server, &k, &entries).await;
    let waiter = locker(all[1].clone(), slow_timer());
    let next = tokio::spawn(async move {
        let guard = waiter.acquire(key(&waiter)).await.unwrap();
        guard.release().await.unwrap();
    });
    queued(server, &k, entries.len() + 1).await;
    let started = Instant::now();
    held.release().await.unwrap();
    next.await.unwrap();
    let took = started.elapsed();
    assert!(server.lock_keys().await.is_empty(), "keys left behind");
    drop(hung);
    took
}

/// A waiter whose process hangs while queued (still subscribed, never claiming) is handed the
/// key and delays the next waiter by one claim window (told it is next, the next one checks
/// again then), not by the holder's TTL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_waiter_costs_one_claim_window() {
    let server = RedisServer::start();
    let took = past_a_hung_waiter(&server, &[]).await;
    assert!(
        took >= Duration::from_millis(250),
        "the hung waiter's claim window was skipped: {took:?}"
    );
    // The holder's TTL is 10 s and the waiter's timer 5 s.
    assert!(
        took < Duration::from_secs(3),
        "the hung waiter stalled the queue: {took:?}"
    );
}

/// The same with a crashed waiter between the hung one and the live one: the release tells the
/// live waiter that it is next (the crashed one cannot hear it), so it still costs one claim
/// window, not the live waiter's timer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crashed_waiter_behind_a_hung_one_is_not_told_it_is_next() {
    let server = RedisServer::start();
    let dead = entry(
        "deadbeefdeadbeefdeadbeefdeadbeef",
        "tower-lock:handoff:gone",
    );
    let took = past_a_hung_waiter(&server, &[dead]).await;
    assert!(
        took < Duration::from_secs(3),
        "the live waiter was never told it is next: {took:?}"
    );
}

/// Two hung waiters in a row: the release tells the two waiters behind the new holder that they
/// are next, so the live waiter behind the second hung one checks again after the first's claim
/// window, hands the key on to the second, and takes it after that one's: two claim windows,
/// not the live waiter's timer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hung_waiters_in_a_row_cost_two_claim_windows() {
    let server = RedisServer::start();
    let second = entry(
        "deadbeefdeadbeefdeadbeefdeadbeef",
        "tower-lock:handoff:hung",
    );
    let took = past_a_hung_waiter(&server, &[second]).await;
    assert!(
        took >= Duration::from_millis(500),
        "a hung waiter's claim window was skipped: {took:?}"
    );
    assert!(
        took < Duration::from_secs(3),
        "two hung waiters stalled the queue: {took:?}"
    );
}

/// A lost hand-off message (here: the queue deleted, so the release frees the key instead)
/// costs the waiter at most the holder's remaining TTL, not its whole wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_handoff_costs_at_most_the_ttl() {
    let server = RedisServer::start();
    let all = stores(&server, 2).await;
    let config = LockConfig::builder()
        .ttl(Duration::from_millis(800))
        .wait(
            Wait::constant(Duration::from_secs(20))
                .unwrap()
                .deadline(Duration::from_secs(30)),
        )
        .build()
        .unwrap();
    let holder = Locker::with_config(all[0].clone(), config.clone());
    let waiter = Locker::with_config(all[1].clone(), config);
    let k = key(&holder);
    let held = holder.acquire(k.clone()).await.unwrap();
    let started = Instant::now();
    let next = tokio::spawn(async move {
        let guard = waiter.acquire(key(&waiter)).await.unwrap();
        guard.release().await.unwrap();
    });
    queued(&server, &k, 1).await;
    let mut conn = server.client().await;
    let _: () = redis::cmd("DEL")
        .arg(queue_key(&k))
        .query_async(&mut conn)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(20)).await;
    held.release().await.unwrap();
    next.await.unwrap();
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(300),
        "woken without a hand-off? {took:?}"
    );
    assert!(
        took < Duration::from_secs(3),
        "the lost hand-off cost more than the TTL: {took:?}"
    );
}

/// A waiter whose subscription broke while queued still gets the key promptly: the hand-off
/// message is lost (and its claim window passes), but the store's new subscription has every
/// waiter check again, which finds the key free and first in line for it: about the
/// resubscription delay (1 s), not the holder's TTL (3 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_subscription_still_gets_the_handoff() {
    let server = RedisServer::start();
    let all = stores_claiming(&server, 2, Duration::from_millis(300)).await;
    let config = LockConfig::builder()
        .ttl(Duration::from_secs(3))
        .wait(
            Wait::constant(Duration::from_secs(20))
                .unwrap()
                .deadline(Duration::from_secs(30)),
        )
        .build()
        .unwrap();
    let holder = Locker::with_config(all[0].clone(), config.clone());
    let waiter = Locker::with_config(all[1].clone(), config);
    let k = key(&holder);
    let held = holder.acquire(k.clone()).await.unwrap();
    let next = tokio::spawn(async move {
        let guard = waiter.acquire(key(&waiter)).await.unwrap();
        let lease = guard.lease().clone();
        tokio::time::sleep(Duration::from_millis(50)).await;
        guard.release().await.unwrap();
        lease
    });
    queued(&server, &k, 1).await;
    // Both processes lose their subscriptions; the release's message goes nowhere.
    redis_cli(&[
        "-p",
        &server.port().to_string(),
        "CLIENT",
        "KILL",
        "TYPE",
        "pubsub",
    ]);
    tokio::time::sleep(Duration::from_millis(50)).await;
    let started = Instant::now();
    held.release().await.unwrap();
    let lease = next.await.unwrap();
    let took = started.elapsed();
    assert!(!lease.is_lost());
    assert!(
        took < Duration::from_millis(2500),
        "waited for the holder's TTL instead of checking after resubscribing: {took:?}"
    );
    assert!(server.lock_keys().await.is_empty(), "keys left behind");
}

/// A queued waiter whose process loses its subscription polls on its wait policy (100 ms here)
/// until it can queue again: the holder's release just after the break (0 to 10 ms) frees the
/// key, and the waiter takes it at its next poll, long before its store subscribes again (1 s
/// after the break). Before: its check at the break answered "held" (nobody to hear a hand-off,
/// so not queued), and it went back to waiting on the dead subscription until the
/// resubscription told it to check again, about 1 s after each release.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queued_waiter_whose_subscription_broke_polls_until_it_can_queue_again() {
    let server = RedisServer::start();
    let all = stores(&server, 2).await;
    let config = LockConfig::builder()
        .ttl(Duration::from_secs(10))
        .wait(
            Wait::constant(Duration::from_millis(100))
                .unwrap()
                .deadline(Duration::from_secs(30)),
        )
        .build()
        .unwrap();
    let holder = Locker::with_config(all[0].clone(), config.clone());
    let waiter = Locker::with_config(all[1].clone(), config);
    let k = key(&holder);
    let port = server.port().to_string();
    let mut late = Vec::new();
    for after in [0, 1, 3, 10] {
        handoff_subscriptions(&server, 2).await;
        let held = holder.acquire(k.clone()).await.unwrap();
        let waiting = waiter.clone();
        let next = tokio::spawn(async move {
            let guard = waiting.acquire(key(&waiting)).await.unwrap();
            let at = Instant::now();
            guard.release().await.unwrap();
            at
        });
        queued(&server, &k, 1).await;
        redis_cli(&["-p", &port, "CLIENT", "KILL", "TYPE", "pubsub"]);
        tokio::time::sleep(Duration::from_millis(after)).await;
        held.release().await.unwrap();
        let released = Instant::now();
        let took = next.await.unwrap().saturating_duration_since(released);
        if took >= Duration::from_millis(700) {
            late.push((after, took));
        }
    }
    assert!(
        late.is_empty(),
        "waited for the resubscription instead of polling (ms from the break to the release, \
         then the wait after it): {late:?}"
    );
    assert!(server.lock_keys().await.is_empty(), "keys left behind");
}

/// The registration gap: a waiter (a single key, or a set with the held key in it) whose
/// attempt queued it while its process listened, but whose answer ("queued") reaches it only
/// after its store's subscription broke and came back (held in the fault proxy, as a stalled
/// runtime, retransmits or a slow `WAIT` would hold it). The holder's release in between found
/// nobody listening on the waiter's channel and dropped its entry as a dead waiter's, freeing
/// the key; the resubscription told only the waiters already registered to check again.
/// Answers how long after the answer arrived the waiter got the key.
async fn acquired_after_a_late_queued_answer(set: bool, ttl: Duration) -> Duration {
    let server = RedisServer::start();
    let proxy = Proxy::start(server.port());
    let holder = RedisStore::connect(server.url()).await.unwrap();
    let waiter = RedisStore::connect(proxy.url()).await.unwrap();
    handoff_subscriptions(&server, 2).await;
    let config = LockConfig::builder()
        .ttl(ttl)
        .wait(
            Wait::constant(Duration::from_secs(30))
                .unwrap()
                .deadline(Duration::from_secs(60)),
        )
        .build()
        .unwrap();
    let holder = Locker::with_config(holder, config.clone());
    let waiter = Locker::with_config(waiter, config);
    let hot = key(&holder);
    let keys: Vec<LockKey> = if set {
        vec![hot.clone(), holder.key("handoff", "other").unwrap()]
    } else {
        vec![hot.clone()]
    };
    // The scripts are on the server already (the proxy would hold a `NOSCRIPT` instead).
    let warm = [
        holder.key("handoff", "a").unwrap(),
        holder.key("handoff", "b").unwrap(),
    ];
    holder.acquire(warm).await.unwrap().release().await.unwrap();
    let held = holder.acquire(hot.clone()).await.unwrap();
    // The waiter's attempt runs; its answer waits in the proxy.
    proxy.hold_replies_after(hot.as_bytes());
    let next = tokio::spawn(async move {
        let guard = waiter.acquire(keys).await.unwrap();
        let at = Instant::now();
        guard.release().await.unwrap();
        at
    });
    queued(&server, &hot, 1).await;
    assert!(proxy.holding_replies());
    // The waiter's process loses its subscription (the holder's too).
    redis_cli(&[
        "-p",
        &server.port().to_string(),
        "CLIENT",
        "KILL",
        "TYPE",
        "pubsub",
    ]);
    // Nobody listens on the waiter's channel: the release drops its entry and frees the key.
    held.release().await.unwrap();
    assert_eq!(queue_len(&server, &hot).await, 0);
    // The subscriptions come back (a second later), and have their registered waiters check
    // again; then the answer arrives (within the connection's 2 s response timeout).
    handoff_subscriptions(&server, 2).await;
    proxy.release_replies();
    let answered = Instant::now();
    let acquired = next.await.unwrap();
    assert!(server.lock_keys().await.is_empty(), "keys left behind");
    acquired.saturating_duration_since(answered)
}

/// The registration gap, for one key: the waiter checks again as soon as its answer arrives,
/// and takes the free key, rather than sleep until its fallback timer (the holder's TTL when
/// it queued, 10 s). Before registration compared the store's epoch: 10 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queued_answer_that_arrives_after_a_resubscription_checks_again() {
    let took = acquired_after_a_late_queued_answer(false, Duration::from_secs(10)).await;
    assert!(
        took < Duration::from_secs(2),
        "the waiter slept on its fallback timer while the key was free: {took:?}"
    );
}

/// The same for a set (TTL 30 s: a queued set checks again every renewal interval, 10 s).
/// Before: 10 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_set_whose_queued_answer_arrives_after_a_resubscription_checks_again() {
    let took = acquired_after_a_late_queued_answer(true, Duration::from_secs(30)).await;
    assert!(
        took < Duration::from_secs(2),
        "the set slept on its fallback timer while its keys were free: {took:?}"
    );
}

/// A store used from another runtime after the one it was connected in shut down keeps its
/// subscription (it runs on a thread of its own, not as a task of that runtime): waiters of
/// three such processes still queue, in arrival order, and each is handed the key by the release
/// before it, not woken by its 5 s timer.
#[test]
fn a_store_that_outlives_its_runtime_keeps_its_subscription() {
    let server = RedisServer::start();
    let runtime = || {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap()
    };
    let first = runtime();
    let all = first.block_on(stores(&server, 4));
    drop(first);
    runtime().block_on(async {
        // The subscriptions did not go with the first runtime.
        assert_eq!(handoff_subscriptions(&server, 4).await.len(), 4);
        // The data connections did (the redis crate runs each connection's I/O on the runtime
        // that opened it): each store's first call fails, and its connection manager
        // reconnects then. Not what this test is about.
        for store in &all {
            reconnect(store).await;
        }
        let mut all = all.into_iter();
        let holder = locker(all.next().unwrap(), slow_timer());
        let k = key(&holder);
        let held = holder.acquire(k.clone()).await.unwrap();
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for (i, store) in all.enumerate() {
            let (waiter, order) = (locker(store, slow_timer()), Arc::clone(&order));
            tasks.push(tokio::spawn(async move {
                let guard = waiter.acquire(key(&waiter)).await.unwrap();
                order.lock().unwrap().push(i);
                tokio::time::sleep(Duration::from_millis(5)).await;
                guard.release().await.unwrap();
            }));
            queued(&server, &k, i + 1).await;
        }
        let started = Instant::now();
        held.release().await.unwrap();
        for task in tasks {
            task.await.unwrap();
        }
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "a waiter waited for its 5 s timer: {:?}",
            started.elapsed()
        );
        assert_eq!(
            *order.lock().unwrap(),
            [0, 1, 2],
            "not first come first served"
        );
        assert!(server.lock_keys().await.is_empty(), "keys left behind");
    });
}

/// Calls `store` until a call succeeds, for at most 5 s.
async fn reconnect(store: &RedisStore) {
    let k = LockKey::new("tower-lock:", "warm", b"up", 64).unwrap();
    let token = Token::generate().unwrap();
    let started = Instant::now();
    while let Err(error) = store.acquire(&k, &token, Duration::from_secs(1)).await {
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "the store never reconnected: {error}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    store.release(&k, &token).await.unwrap();
}

/// The hand-off channels subscribed on `server` now.
async fn handoff_channels(server: &RedisServer) -> Vec<String> {
    let mut conn = server.client().await;
    redis::cmd("PUBSUB")
        .arg("CHANNELS")
        .arg("tower-lock:handoff:*")
        .query_async(&mut conn)
        .await
        .unwrap()
}

/// The store's address moves to another server (a virtual IP or a DNS name after a failover):
/// its data connection breaks and reconnects there, while its subscription, still open, stays
/// on the old server. Its waiter is not queued where nobody would hear its hand-off (the release
/// would skip it as a crashed waiter's, leaving it to its 5 s timer): the store subscribes
/// again, through the moved address, and the waiter is queued and handed the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_subscription_follows_an_address_that_moved() {
    let (old, new) = (RedisServer::start(), RedisServer::start());
    let address = Proxy::start(old.port());
    let moving = RedisStore::connect(address.url()).await.unwrap();
    handoff_subscriptions(&old, 1).await;
    let holder = locker(stores(&new, 1).await.remove(0), slow_timer());
    address.redirect(new.port());
    // The old server drops its clients but the subscriber (as a demoted master may).
    redis_cli(&[
        "-p",
        &old.port().to_string(),
        "CLIENT",
        "KILL",
        "TYPE",
        "normal",
    ]);
    reconnect(&moving).await;
    assert_eq!(
        handoff_channels(&new).await.len(),
        1,
        "subscribed on the new server already"
    );

    let k = key(&holder);
    let held = holder.acquire(k.clone()).await.unwrap();
    let waiter = locker(moving, slow_timer());
    let next = tokio::spawn(async move {
        let guard = waiter.acquire(key(&waiter)).await.unwrap();
        let fencing_token = guard.fencing_token();
        guard.release().await.unwrap();
        fencing_token
    });
    queued(&new, &k, 1).await;
    // Its subscription is on the new server now, where its entry is.
    assert_eq!(handoff_channels(&new).await.len(), 2);
    let (started, first) = (Instant::now(), held.fencing_token());
    held.release().await.unwrap();
    let fencing_token = next.await.unwrap();
    assert!(fencing_token > first);
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "the waiter was skipped and woken by its 5 s timer: {:?}",
        started.elapsed()
    );
    assert!(new.lock_keys().await.is_empty(), "keys left behind");
}

/// Four processes taking one key 25 times each: never two holders at once, every acquisition
/// costs at most three commands, and nothing is left behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn contended_processes_exclude_each_other_cheaply() {
    let server = RedisServer::start();
    let all = stores(&server, 4).await;
    let overlaps = run_contenders(&server, all, true).await;
    assert_eq!(overlaps, 0, "two holders at once");
    assert!(
        server.lock_keys().await.is_empty(),
        "keys or queue left behind"
    );
}

/// The negative control: the same load without the lock overlaps.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn contended_processes_without_the_lock_overlap() {
    let server = RedisServer::start();
    let all = stores(&server, 4).await;
    let overlaps = run_contenders(&server, all, false).await;
    assert!(
        overlaps > 0,
        "the load never overlapped: the test cannot fail"
    );
}

/// Runs 4 x 25 critical sections of 2 ms on one key; returns how many found another inside.
async fn run_contenders(server: &RedisServer, all: Vec<RedisStore>, lock: bool) -> u64 {
    let wait = Wait::exponential(Duration::from_millis(1), Duration::from_millis(20))
        .unwrap()
        .deadline(Duration::from_secs(30));
    let lockers: Vec<Locker> = all.into_iter().map(|s| locker(s, wait.clone())).collect();
    for l in &lockers {
        let guard = l.acquire(l.key("warm", "up").unwrap()).await.unwrap();
        guard.release().await.unwrap();
    }
    let before = calls_of(server, "evalsha").await;
    let inside = Arc::new(AtomicBool::new(false));
    let overlaps = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for l in lockers {
        let (inside, overlaps) = (Arc::clone(&inside), Arc::clone(&overlaps));
        tasks.push(tokio::spawn(async move {
            for _ in 0..25 {
                let guard = if lock {
                    Some(l.acquire(key(&l)).await.unwrap())
                } else {
                    None
                };
                if inside.swap(true, Ordering::SeqCst) {
                    overlaps.fetch_add(1, Ordering::SeqCst);
                }
                tokio::time::sleep(Duration::from_millis(2)).await;
                inside.store(false, Ordering::SeqCst);
                if let Some(guard) = guard {
                    guard.release().await.unwrap();
                }
                tokio::task::yield_now().await;
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    if lock {
        let commands = calls_of(server, "evalsha").await - before;
        assert!(
            commands <= 3 * 100,
            "{commands} commands for 100 acquisitions (more than 3 each)"
        );
    }
    overlaps.load(Ordering::SeqCst)
}

/// When a holder's lease runs out with waiters queued, a newcomer that finds the key free does
/// not take it past them: its attempt hands the key to the head of the queue instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_newcomer_does_not_barge_past_the_queue() {
    let server = RedisServer::start();
    let all = stores(&server, 3).await;
    let holder = locker(all[0].clone(), slow_timer());
    let k = key(&holder);
    let held = holder.acquire(k.clone()).await.unwrap();
    let waiter = locker(all[1].clone(), slow_timer());
    let queued_waiter = tokio::spawn(async move {
        let guard = waiter.acquire(key(&waiter)).await.unwrap();
        let fencing_token = guard.fencing_token();
        guard.release().await.unwrap();
        fencing_token
    });
    queued(&server, &k, 1).await;
    // The holder's lease vanishes (as if it expired); its process keeps quiet.
    let mut conn = server.client().await;
    let _: () = redis::cmd("DEL")
        .arg(k.as_bytes())
        .query_async(&mut conn)
        .await
        .unwrap();
    let started = Instant::now();
    let newcomer = locker(all[2].clone(), Wait::none());
    assert!(
        matches!(
            newcomer.acquire(key(&newcomer)).await,
            Err(LockError::Contended { .. })
        ),
        "the newcomer took the key past a queued waiter"
    );
    let fencing_token = queued_waiter.await.unwrap();
    assert!(fencing_token > held.fencing_token());
    // Handed over by the newcomer's attempt, not found by the waiter's 10 s fallback.
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    assert!(
        matches!(held.release().await, Err(LockError::LeaseLost(_))),
        "the lost lease was released"
    );
    assert!(server.lock_keys().await.is_empty(), "keys left behind");
}

/// A queued waiter keeps to its wait policy: a fixed list of delays bounds its wait (not only
/// the deadline), and giving up takes it out of the queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fixed_schedule_bounds_a_queued_wait() {
    let server = RedisServer::start();
    let all = stores(&server, 2).await;
    let holder = locker(all[0].clone(), slow_timer());
    let k = key(&holder);
    let held = holder.acquire(k.clone()).await.unwrap();
    let waiter = locker(
        all[1].clone(),
        Wait::fixed([Duration::from_millis(50), Duration::from_millis(50)]).unwrap(),
    );
    let started = Instant::now();
    let answer = waiter.acquire(key(&waiter)).await;
    let took = started.elapsed();
    assert!(
        matches!(answer, Err(LockError::Contended { .. })),
        "{answer:?}"
    );
    // The schedule is 100 ms; the default deadline 2 s, the holder's TTL 10 s.
    assert!(took < Duration::from_millis(1500), "{took:?}");
    queued(&server, &k, 0).await;
    held.release().await.unwrap();
    assert!(server.lock_keys().await.is_empty(), "keys left behind");
}

// ---------------------------------------------------------------------------------------------
// Sets of keys and the queue.

/// Loops holding `key` for `hold` through `locker` until `stop`; answers how many times it
/// held it.
fn stream(
    locker: Locker,
    key: LockKey,
    hold: Duration,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<u64> {
    tokio::spawn(async move {
        let mut held = 0;
        while !stop.load(Ordering::SeqCst) {
            let guard = locker.acquire(key.clone()).await.unwrap();
            tokio::time::sleep(hold).await;
            guard.release().await.unwrap();
            held += 1;
        }
        held
    })
}

/// How the keys of a set are taken: plain, each with a capacity (a writer of keys readers
/// share), or `hot` with a capacity and the other key plain.
#[derive(Clone, Copy)]
enum Keys {
    Plain,
    Counted,
    Mixed,
}

/// A writer of a key readers share: all of its capacity.
fn writer() -> Share {
    Share::exclusive(Share::READERS).unwrap()
}

/// A reader of a key readers share.
fn reader() -> Share {
    Share::new(1, Share::READERS).unwrap()
}

/// How a set of `hot` and another key fares against three processes that take `hot` in turns,
/// back to back, through the queue (the key is never free: each release hands it to the next):
/// the set's locker on `set_store`, its keys (and the stream's) taken as `keys` says.
async fn set_against_a_stream(
    server: &RedisServer,
    set_store: RedisStore,
    keys: Keys,
) -> Result<Duration, LockError> {
    let all = stores(server, 3).await;
    let stop = Arc::new(AtomicBool::new(false));
    let mut hot = LockKey::new("tower-lock:", "handoff", b"hot", 64).unwrap();
    let mut other = LockKey::new("tower-lock:", "handoff", b"other", 64).unwrap();
    match keys {
        Keys::Plain => {}
        Keys::Counted => (hot, other) = (hot.with_share(writer()), other.with_share(writer())),
        Keys::Mixed => hot = hot.with_share(writer()),
    }
    let streams: Vec<_> = all
        .into_iter()
        .map(|s| {
            stream(
                locker(s, slow_timer()),
                hot.clone(),
                Duration::from_millis(20),
                Arc::clone(&stop),
            )
        })
        .collect();
    // The stream is under way: two waiters queued behind the holder.
    queued(server, &hot, 2).await;
    let set_locker = locker(
        set_store,
        Wait::exponential(Duration::from_millis(1), Duration::from_millis(20))
            .unwrap()
            .deadline(Duration::from_secs(3)),
    );
    let started = Instant::now();
    let answer = match set_locker.acquire([other.clone(), hot.clone()]).await {
        Ok(guard) => {
            let waited = started.elapsed();
            assert_eq!(guard.keys().len(), 2);
            guard.release().await.unwrap();
            Ok(waited)
        }
        Err(error) => Err(error),
    };
    stop.store(true, Ordering::SeqCst);
    for s in streams {
        assert!(s.await.unwrap() > 0);
    }
    answer
}

/// A set waits in the queue of the key it cannot have, like a single key: a stream of
/// processes taking that key in turns, back to back, serves it in its turn.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_set_takes_its_turn_in_the_queue() {
    let server = RedisServer::start();
    let set_store = RedisStore::connect(server.url()).await.unwrap();
    handoff_subscriptions(&server, 1).await;
    let waited = set_against_a_stream(&server, set_store, Keys::Plain)
        .await
        .unwrap();
    assert!(waited < Duration::from_secs(1), "waited {waited:?}");
}

/// The same with keys with a capacity (a writer of keys readers share), and with a set that
/// mixes one with a plain key: the set takes its turn in the key's one queue, as a single key
/// with a capacity does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_set_over_counted_keys_takes_its_turn_in_the_queue() {
    for keys in [Keys::Counted, Keys::Mixed] {
        let server = RedisServer::start();
        let set_store = RedisStore::connect(server.url()).await.unwrap();
        handoff_subscriptions(&server, 1).await;
        let waited = set_against_a_stream(&server, set_store, keys)
            .await
            .unwrap();
        assert!(waited < Duration::from_secs(1), "waited {waited:?}");
    }
}

/// The negative control for `a_set_over_counted_keys_takes_its_turn_in_the_queue`: the same
/// set over keys with a capacity, not queued (a store without hand-off), gives up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_set_over_counted_keys_that_does_not_queue_is_starved() {
    let server = RedisServer::start();
    let set_store = RedisStore::connect(server.url())
        .await
        .unwrap()
        .handoff(false)
        .unwrap();
    let answer = set_against_a_stream(&server, set_store, Keys::Counted).await;
    assert!(
        matches!(answer, Err(LockError::Contended { .. })),
        "{answer:?}"
    );
}

/// First come, first served between a set and single keys with a capacity: a set that wants
/// `hot` whole (a writer) is queued behind a reader; a reader of `hot` that comes after it
/// would fit beside the first, but waits behind the set, and a writer of `hot` after that
/// waits too. Released, the reader hands `hot` to the set, then the set to the reader and the
/// writer in turn.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queued_set_over_counted_keys_is_not_overtaken() {
    let server = RedisServer::start();
    let all = stores(&server, 4).await;
    let lockers: Vec<Locker> = all.into_iter().map(|s| locker(s, slow_timer())).collect();
    let hot = lockers[0].key("handoff", "hot").unwrap();
    let other = lockers[0].key("handoff", "other").unwrap();
    let holder = lockers[0]
        .acquire(hot.clone().with_share(reader()))
        .await
        .unwrap();
    let order = Arc::new(Mutex::new(Vec::new()));
    let take = |locker: &Locker, keys: tower_lock::key::KeySet, name: &'static str| {
        let (locker, order) = (locker.clone(), Arc::clone(&order));
        tokio::spawn(async move {
            let guard = locker.acquire(keys).await.unwrap();
            order.lock().unwrap().push(name);
            tokio::time::sleep(Duration::from_millis(50)).await;
            order.lock().unwrap().push(name);
            guard.release().await.unwrap();
        })
    };
    let set = tower_lock::key::KeySet::from([
        other.clone().with_share(writer()),
        hot.clone().with_share(writer()),
    ]);
    let set_task = take(&lockers[1], set, "set");
    queued(&server, &hot, 1).await;
    let reader_task = take(
        &lockers[2],
        hot.clone().with_share(reader()).into(),
        "reader",
    );
    queued(&server, &hot, 2).await;
    let writer_task = take(
        &lockers[3],
        hot.clone().with_share(writer()).into(),
        "writer",
    );
    queued(&server, &hot, 3).await;
    assert!(
        order.lock().unwrap().is_empty(),
        "{:?}",
        order.lock().unwrap()
    );
    holder.release().await.unwrap();
    for task in [set_task, reader_task, writer_task] {
        tokio::time::timeout(Duration::from_secs(5), task)
            .await
            .expect("a waiter was never served")
            .unwrap();
    }
    assert_eq!(
        *order.lock().unwrap(),
        ["set", "set", "reader", "reader", "writer", "writer"]
    );
    let left = server.lock_keys().await;
    assert!(left.is_empty(), "left behind: {left:?}");
}

/// The negative control for `a_set_takes_its_turn_in_the_queue`: a set that does not queue (a
/// store without hand-off, trying on its timer) never finds the key free, and gives up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_set_that_does_not_queue_is_starved() {
    let server = RedisServer::start();
    let set_store = RedisStore::connect(server.url())
        .await
        .unwrap()
        .handoff(false)
        .unwrap();
    let answer = set_against_a_stream(&server, set_store, Keys::Plain).await;
    assert!(
        matches!(answer, Err(LockError::Contended { .. })),
        "{answer:?}"
    );
}

/// A set waiting for its second key (in lock order) keeps the first for itself: a process that
/// wants the first key meanwhile waits behind the set, and gets it when the set is done. Once
/// the set has both it runs, and releasing hands each key on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_set_keeps_the_keys_before_the_one_it_waits_for() {
    let server = RedisServer::start();
    let all = stores(&server, 3).await;
    let lockers: Vec<Locker> = all.into_iter().map(|s| locker(s, slow_timer())).collect();
    let set = tower_lock::key::KeySet::from([
        lockers[0].key("handoff", "x").unwrap(),
        lockers[0].key("handoff", "y").unwrap(),
    ]);
    let (first, second) = (set.as_slice()[0].clone(), set.as_slice()[1].clone());
    let holder = lockers[0].acquire(second.clone()).await.unwrap();
    let order = Arc::new(Mutex::new(Vec::new()));
    let set_task = tokio::spawn({
        let (locker, order, set) = (lockers[1].clone(), Arc::clone(&order), set.clone());
        async move {
            let guard = locker.acquire(set).await.unwrap();
            order.lock().unwrap().push("set");
            guard.release().await.unwrap();
        }
    });
    queued(&server, &second, 1).await;
    // The first key is the set's now: its token, not free.
    let mut conn = server.client().await;
    let kept: Option<Vec<u8>> = redis::cmd("GET")
        .arg(first.as_bytes())
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(kept.is_some(), "the set did not keep the first key");
    let single_task = tokio::spawn({
        let (locker, order, first) = (lockers[2].clone(), Arc::clone(&order), first.clone());
        async move {
            let guard = locker.acquire(first).await.unwrap();
            order.lock().unwrap().push("single");
            guard.release().await.unwrap();
        }
    });
    queued(&server, &first, 1).await;
    holder.release().await.unwrap();
    tokio::time::timeout(Duration::from_secs(5), set_task)
        .await
        .unwrap()
        .unwrap();
    tokio::time::timeout(Duration::from_secs(5), single_task)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(*order.lock().unwrap(), ["set", "single"]);
    let left = server.lock_keys().await;
    assert!(left.is_empty(), "left behind: {left:?}");
}

/// A set that gives up while queued leaves the queue and gives back the keys it kept: the
/// process waiting behind it for one of them gets it at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_set_that_gives_up_hands_on_what_it_kept() {
    let server = RedisServer::start();
    let all = stores(&server, 3).await;
    let lockers: Vec<Locker> = all.into_iter().map(|s| locker(s, slow_timer())).collect();
    let set = tower_lock::key::KeySet::from([
        lockers[0].key("handoff", "x").unwrap(),
        lockers[0].key("handoff", "y").unwrap(),
    ]);
    let (first, second) = (set.as_slice()[0].clone(), set.as_slice()[1].clone());
    let _holder = lockers[0].acquire(second.clone()).await.unwrap();
    let giving_up = tokio::spawn({
        let (locker, set) = (lockers[1].clone(), set.clone());
        async move {
            locker
                .acquire(set)
                .wait(
                    Wait::constant(Duration::from_secs(5))
                        .unwrap()
                        .deadline(Duration::from_millis(600)),
                )
                .await
        }
    });
    queued(&server, &second, 1).await;
    let started = Instant::now();
    let single = lockers[2].acquire(first).await.unwrap();
    let waited = started.elapsed();
    assert!(
        matches!(giving_up.await.unwrap(), Err(LockError::Contended { .. })),
        "the set did not give up"
    );
    // Handed on by the set's release when it gave up (at 600 ms), not by a timer.
    assert!(waited < Duration::from_secs(2), "waited {waited:?}");
    assert_eq!(
        queue_len(&server, &second).await,
        0,
        "the set stayed queued"
    );
    single.release().await.unwrap();
}
