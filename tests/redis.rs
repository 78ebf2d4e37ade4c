//! The behaviour suite on a real `redis-server`, plus Redis-only behaviour: outages, restarts,
//! scripts, round trips, transports. Each test starts its own server on a free loopback port.

mod suite;
mod support;

use std::time::{Duration, Instant};

use axum::http::StatusCode;
use support::{
    Backend, Captured, Counter, LockKeys, Redis, body_json, counter_app, purchase, send,
};
use tower_lock::{
    Key, LockConfig, LockLayer, RedisStore, Wait,
    config::OnLeaseLost,
    store::{LockStore, Token},
};
use tower_lock_testkit::{RedisServer, one_node_cluster};

suite::single_key_tests!(Redis::new());
suite::set_tests!(Redis::new());

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn own_token_acquires_again_without_handoff() {
    suite::own_token_acquires_again(support::NoHandoff(RedisServer::start())).await;
}

async fn delete_lock_keys(backend: Redis) -> Redis {
    support::delete_the_held_key(&backend.0).await;
    backend
}

async fn steal_lock_keys(backend: Redis) -> Redis {
    let keys = backend.0.lock_keys().await;
    support::give_key_to_someone_else(&backend.0, &keys[0]).await;
    backend
}

/// A set one of whose keys is deleted behind the holder is lost as a whole: the order aborts
/// with 503 at the next renewal (its handler dropped), and the keys it still held are released
/// then, not left for their TTL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_set_with_a_key_deleted_behind_it_is_lost_and_gives_back_the_rest() {
    let backend = Redis::new();
    let config = LockConfig::builder()
        .ttl(Duration::from_millis(300))
        .wait(Wait::none())
        .build()
        .unwrap();
    let locker = tower_lock::Locker::with_config(backend.store().await, config);
    let shop = support::Shop::new(["a", "b", "c"]);
    let app = support::shop_app(std::sync::Arc::clone(&shop), Some(locker));
    let running = tokio::spawn({
        let app = app.clone();
        async move { send(&app, support::order(&["c", "a", "b"], 5_000)).await }
    });
    suite::wait_until(|| {
        shop.skus["b"]
            .inside
            .load(std::sync::atomic::Ordering::SeqCst)
            == 1
    })
    .await;
    let keys = backend.0.lock_keys().await;
    assert_eq!(keys.len(), 3, "the order's three keys");
    support::delete_key(&backend.0, &keys[1]).await;
    let deleted = Instant::now();
    let response = running.await.unwrap();
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(
        deleted.elapsed() < Duration::from_millis(1000),
        "noticed late"
    );
    let body = body_json(response).await;
    support::assert_problem_type(&body, "#lease-lost");
    let finished: usize = shop
        .skus
        .values()
        .map(|c| c.finished.load(std::sync::atomic::Ordering::SeqCst))
        .sum();
    assert_eq!(finished, 0, "the handler ran on");
    // Well inside the 300 ms TTL of the two keys still held when it aborted.
    let started = Instant::now();
    while !backend.0.lock_keys().await.is_empty() {
        assert!(
            started.elapsed() < Duration::from_millis(150),
            "keys left behind: {:?}",
            backend.0.lock_keys().await
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_deleted_behind_the_holder_aborts() {
    suite::lease_loss(Redis::new(), OnLeaseLost::Abort, delete_lock_keys).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_taken_over_behind_the_holder_continues_and_reports() {
    suite::lease_loss(Redis::new(), OnLeaseLost::Continue, steal_lock_keys).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_restarted_empty_under_a_holder_is_noticed() {
    suite::lease_loss(
        Redis::new(),
        OnLeaseLost::Abort,
        |mut backend: Redis| async move {
            tokio::task::spawn_blocking(move || {
                backend.0.restart();
                backend
            })
            .await
            .unwrap()
        },
    )
    .await;
}

/// Redis killed mid-run: 503 within the wait deadline (no hang); service resumes after restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_killed_then_restarted() {
    let mut backend = Redis::new();
    let deadline = Duration::from_millis(500);
    let config = LockConfig::builder()
        .wait(Wait::default().deadline(deadline))
        .build()
        .unwrap();
    let layer = LockLayer::with_config(backend.store().await, Key::path_param("sku"), config);
    let app = counter_app(Counter::new(), Some(layer));
    assert_eq!(send(&app, purchase("k", 0)).await.status(), StatusCode::OK);

    backend.0.kill();
    for i in 0..5 {
        let started = Instant::now();
        let response = send(&app, purchase(&format!("k{i}"), 0)).await;
        let took = started.elapsed();
        assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(response.headers()["retry-after"], "1");
        let body = body_json(response).await;
        support::assert_problem_type(&body, "#lock-store-unavailable");
        // The store timeout (1 s) is the floor of an attempt; never the 30 s of a pool default.
        assert!(
            took < deadline + Duration::from_millis(1500),
            "503 after {took:?}"
        );
    }

    backend.0.restart();
    let started = Instant::now();
    loop {
        match send(&app, purchase("k", 0)).await.status() {
            StatusCode::OK => break,
            StatusCode::SERVICE_UNAVAILABLE if started.elapsed() < Duration::from_secs(10) => {
                tokio::time::sleep(Duration::from_millis(50)).await
            }
            other => panic!("did not recover after the restart: {other}"),
        }
    }
}

/// A stalled Redis (`CLIENT PAUSE`): 503 within the wait deadline plus the store timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_redis_answers_503_in_bounded_time() {
    let backend = Redis::new();
    let config = LockConfig::builder()
        .wait(Wait::default().deadline(Duration::from_millis(300)))
        .store_timeout(Duration::from_millis(200))
        .build()
        .unwrap();
    let layer = LockLayer::with_config(backend.store().await, Key::path_param("sku"), config);
    let app = counter_app(Counter::new(), Some(layer));
    assert_eq!(send(&app, purchase("k", 0)).await.status(), StatusCode::OK);
    let mut conn = backend.0.client().await;
    let _: () = redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(2000)
        .query_async(&mut conn)
        .await
        .unwrap();
    let started = Instant::now();
    let status = send(&app, purchase("k2", 0)).await.status();
    let took = started.elapsed();
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(took < Duration::from_millis(1200), "503 after {took:?}");
}

/// `SCRIPT FLUSH` (or a restart) does not break anything: `EVALSHA` falls back and reloads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scripts_reload_after_flush() {
    let backend = Redis::new();
    let app = warm_app(&backend).await;
    flush_scripts(&backend).await;
    assert_eq!(send(&app, purchase("k", 0)).await.status(), StatusCode::OK);
    assert!(backend.0.lock_keys().await.is_empty());
}

/// After `SCRIPT FLUSH` every request in flight meets NOSCRIPT at once; they share the reload
/// instead of each sending its own `SCRIPT LOAD` (about one per request before).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_in_flight_share_one_script_reload() {
    let backend = Redis::new();
    let app = warm_app(&backend).await;
    flush_scripts(&backend).await;
    let mut conn = backend.0.client().await;
    let before = calls_of(&mut conn, "script|load").await;
    let n = 100;
    let requests: Vec<_> = (0..n)
        .map(|i| {
            let app = app.clone();
            tokio::spawn(async move { send(&app, purchase(&format!("k{i}"), 0)).await.status() })
        })
        .collect();
    for request in requests {
        assert_eq!(request.await.unwrap(), StatusCode::OK);
    }
    let loaded = calls_of(&mut conn, "script|load").await - before;
    // One script (acquires and releases go in batches of the same script), loaded once, or
    // twice if a request met NOSCRIPT after the first load's reply. Before: about one load
    // per request.
    assert!(
        (1..=2).contains(&loaded),
        "{loaded} SCRIPT LOADs for {n} requests"
    );
    assert!(backend.0.lock_keys().await.is_empty());
}

/// A locked route on `backend` (default config), with its scripts loaded by one request.
async fn warm_app(backend: &Redis) -> axum::Router {
    let layer = LockLayer::new(backend.store().await, Key::path_param("sku"));
    let app = counter_app(Counter::new(), Some(layer));
    assert_eq!(
        send(&app, purchase("warm-up", 0)).await.status(),
        StatusCode::OK
    );
    app
}

/// Empties `backend`'s script cache (`SCRIPT FLUSH`, as a restart would).
async fn flush_scripts(backend: &Redis) {
    let mut conn = backend.0.client().await;
    let _: () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query_async(&mut conn)
        .await
        .unwrap();
}

/// How many times the server behind `conn` has run the command `name` (`INFO commandstats`).
async fn calls_of(conn: &mut redis::aio::MultiplexedConnection, name: &str) -> u64 {
    command_calls(conn)
        .await
        .into_iter()
        .find(|(command, _)| command == name)
        .map_or(0, |(_, calls)| calls)
}

async fn command_calls(conn: &mut redis::aio::MultiplexedConnection) -> Vec<(String, u64)> {
    support::info(conn, "commandstats")
        .await
        .lines()
        .filter_map(|line| {
            let rest = line.strip_prefix("cmdstat_")?;
            let (name, stats) = rest.split_once(':')?;
            let calls = stats.split(',').find_map(|kv| kv.strip_prefix("calls="))?;
            Some((name.to_owned(), calls.parse().ok()?))
        })
        .collect()
}

/// Exactly two client commands per uncontended request: one EVALSHA to acquire, one to release.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_round_trips_per_uncontended_request() {
    let backend = Redis::new();
    let app = warm_app(&backend).await;
    let mut conn = backend.0.client().await;
    let before: std::collections::HashMap<_, _> =
        command_calls(&mut conn).await.into_iter().collect();
    let n = 50;
    for i in 0..n {
        assert_eq!(
            send(&app, purchase(&format!("k{i}"), 0)).await.status(),
            StatusCode::OK
        );
    }
    let after = command_calls(&mut conn).await;
    let delta = |name: &str| {
        after.iter().find(|(n, _)| n == name).map_or(0, |(_, c)| *c)
            - before.get(name).copied().unwrap_or(0)
    };
    assert_eq!(delta("evalsha"), 2 * n, "{after:?}");
    for name in ["ping", "eval", "script|load", "script", "exists", "pttl"] {
        assert_eq!(
            delta(name),
            0,
            "unexpected {name} from the client: {after:?}"
        );
    }
}

/// The bb8 pool transport works too, with the recommended builder.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pool_transport() {
    let server = RedisServer::start();
    let manager = bb8_redis::RedisConnectionManager::new(server.url()).unwrap();
    let pool = RedisStore::pool_builder()
        .max_size(4)
        .build(manager)
        .await
        .unwrap();
    let config = LockConfig::builder().wait(Wait::none()).build().unwrap();
    let layer = LockLayer::with_config(RedisStore::from_pool(pool), Key::path_param("sku"), config);
    let counter = Counter::new();
    let app = counter_app(std::sync::Arc::clone(&counter), Some(layer));
    support::assert_one_holder_at_a_time(&app, &counter).await;
}

/// Every key in the server, whatever its prefix.
async fn every_key(conn: &mut redis::aio::MultiplexedConnection) -> Vec<Vec<u8>> {
    redis::cmd("KEYS").arg("*").query_async(conn).await.unwrap()
}

/// Only the holder's token renews or releases; fencing tokens keep increasing even after the
/// counter key is gone; keys never leave the prefix, whatever bytes the value holds; released
/// locks leave nothing behind but the one fencing counter. (Keys queued for and handed over,
/// through the crate-private hand-off queue: `src/store/tests/redis.rs`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_semantics() {
    use tower_lock::{key::LockKey, store::Acquire};
    let backend = Redis::new();
    let store = backend.store().await;
    let ttl = Duration::from_secs(5);
    let key = LockKey::new("tower-lock:", "POST /x/{id}", b"\x00\xff{}:\r\n", 64).unwrap();
    let (a, b) = (Token::generate().unwrap(), Token::generate().unwrap());
    let Acquire::Acquired { fencing_token: f1 } = store.acquire(&key, &a, ttl).await.unwrap()
    else {
        panic!("not acquired")
    };
    let Acquire::Contended {
        expires_in: Some(left),
    } = store.acquire(&key, &b, ttl).await.unwrap()
    else {
        panic!("acquired twice")
    };
    assert!(left <= ttl && left > ttl / 2);
    assert!(!store.renew(&key, &b, ttl).await.unwrap());
    assert!(!store.release(&key, &b).await.unwrap());
    assert!(store.renew(&key, &a, ttl).await.unwrap());
    assert!(store.release(&key, &a).await.unwrap());
    assert!(!store.release(&key, &a).await.unwrap(), "released twice");

    let mut conn = backend.0.client().await;
    let keys = every_key(&mut conn).await;
    assert!(
        keys.len() == 1 && support::is_fence_counter(&keys[0]),
        "only the slot's fencing counter is left: {keys:?}"
    );
    let counter = keys[0].clone();
    let _: () = redis::cmd("DEL")
        .arg(&keys[0])
        .query_async(&mut conn)
        .await
        .unwrap();
    let Acquire::Acquired { fencing_token: f2 } = store.acquire(&key, &b, ttl).await.unwrap()
    else {
        panic!("not acquired")
    };
    assert!(
        f2 > f1,
        "fencing token went back after the counter expired: {f1} then {f2}"
    );
    let Acquire::Contended { .. } = store.acquire(&key, &a, ttl).await.unwrap() else {
        panic!()
    };
    assert!(store.release(&key, &b).await.unwrap());
    let Acquire::Acquired { fencing_token: f3 } = store.acquire(&key, &a, ttl).await.unwrap()
    else {
        panic!("not acquired")
    };
    assert!(f3 > f2);
    // The lock key holds the token with a TTL; the counter has a retention TTL.
    let pttl: i64 = redis::cmd("PTTL")
        .arg(key.as_bytes())
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(pttl > 0 && pttl <= 5000);
    let fence_ttl: i64 = redis::cmd("PTTL")
        .arg(&counter)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(fence_ttl > 3_600_000, "fence retention {fence_ttl}");
    assert!(store.release(&key, &a).await.unwrap());
    // A counter that comes back behind the tokens already handed out (a failover to a replica
    // that missed the last writes, a restart from an older snapshot) does not hand them out
    // again: tokens follow the server clock.
    let _: () = redis::cmd("SET")
        .arg(&counter)
        .arg(f3 - 1_000_000)
        .query_async(&mut conn)
        .await
        .unwrap();
    let Acquire::Acquired { fencing_token } = store.acquire(&key, &a, ttl).await.unwrap() else {
        panic!("not acquired")
    };
    assert!(fencing_token > f3, "{fencing_token} after {f3}");
    assert!(store.release(&key, &a).await.unwrap());
}

/// Two services over two connections: the lock excludes across them, not just within one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instances_exclude_each_other() {
    let backend = Redis::new();
    let config = LockConfig::builder().wait(Wait::none()).build().unwrap();
    let counter = Counter::new();
    let one = counter_app(
        std::sync::Arc::clone(&counter),
        Some(LockLayer::with_config(
            backend.store().await,
            Key::path_param("sku"),
            config.clone(),
        )),
    );
    let two = counter_app(
        Counter::new(),
        Some(LockLayer::with_config(
            backend.store().await,
            Key::path_param("sku"),
            config,
        )),
    );
    let running = tokio::spawn({
        let one = one.clone();
        async move { send(&one, purchase("k", 500)).await.status() }
    });
    suite::wait_until(|| counter.inside.load(std::sync::atomic::Ordering::SeqCst) == 1).await;
    assert_eq!(
        send(&two, purchase("k", 0)).await.status(),
        StatusCode::CONFLICT
    );
    assert_eq!(
        send(&two, purchase("other", 0)).await.status(),
        StatusCode::OK
    );
    assert_eq!(running.await.unwrap(), StatusCode::OK);
    assert_eq!(send(&two, purchase("k", 0)).await.status(), StatusCode::OK);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_killed_under_a_holder_expires_the_lease() {
    suite::lease_loss(
        Redis::new(),
        OnLeaseLost::Abort,
        |mut backend: Redis| async move {
            backend.0.kill();
            backend
        },
    )
    .await;
}

/// The lock token never leaves the process: not in any response, header or log line, even at
/// trace level and through contention and release.
#[tokio::test(flavor = "current_thread")]
async fn token_never_in_responses_or_logs() {
    let logs = Captured::default();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::TRACE)
        .with_writer(logs.clone())
        .finish();
    // The global default (the only one in this binary), so that callsites first hit by other
    // tests' threads still log here.
    tracing::subscriber::set_global_default(subscriber).unwrap();

    let backend = Redis::new();
    let config = LockConfig::builder()
        .wait(Wait::none())
        .ttl(Duration::from_millis(300))
        .build()
        .unwrap();
    let layer = LockLayer::with_config(backend.store().await, Key::path_param("sku"), config);
    let counter = Counter::new();
    let app = counter_app(std::sync::Arc::clone(&counter), Some(layer));
    let running = tokio::spawn({
        let app = app.clone();
        async move { send(&app, purchase("k", 400)).await }
    });
    suite::wait_until(|| counter.inside.load(std::sync::atomic::Ordering::SeqCst) == 1).await;
    let keys = backend.0.lock_keys().await;
    let mut conn = backend.0.client().await;
    let token: Vec<u8> = redis::cmd("GET")
        .arg(&keys[0])
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(token.len(), 32);

    let mut seen = Vec::new();
    let contended = send(&app, purchase("k", 0)).await;
    assert_eq!(contended.status(), StatusCode::CONFLICT);
    let ok = running.await.unwrap();
    assert_eq!(ok.status(), StatusCode::OK);
    for response in [contended, ok] {
        for (name, value) in response.headers() {
            seen.extend_from_slice(name.as_str().as_bytes());
            seen.extend_from_slice(value.as_bytes());
        }
        seen.extend_from_slice(
            &axum::body::to_bytes(response.into_body(), 1 << 20)
                .await
                .unwrap(),
        );
    }
    let logged = logs.0.lock().unwrap().clone();
    assert!(
        !logged.is_empty(),
        "nothing was logged; the check would be vacuous"
    );
    let contains = |hay: &[u8]| hay.windows(token.len()).any(|w| w == &token[..]);
    assert!(!contains(&seen), "the token is in a response");
    assert!(!contains(&logged), "the token is in the logs");
}

/// Renewals that fall due together go to Redis together: hundreds of leases, a few round trips.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewals_are_batched() {
    let backend = Redis::new();
    let config = support::ttl_config(Duration::from_millis(300));
    let locker = tower_lock::Locker::with_config(backend.store().await, config);
    let mut guards = Vec::new();
    for i in 0..300 {
        let key = locker.key("batch", i.to_string()).unwrap();
        guards.push(locker.acquire(key).await.unwrap());
    }
    let mut conn = backend.0.client().await;
    let renewals = |guards: &[tower_lock::LeaseGuard]| -> u64 {
        guards.iter().map(|g| u64::from(g.renewals())).sum()
    };
    let (commands_before, renewals_before) =
        (calls_of(&mut conn, "evalsha").await, renewals(&guards));
    tokio::time::sleep(Duration::from_millis(800)).await;
    let (commands_after, renewals_after) =
        (calls_of(&mut conn, "evalsha").await, renewals(&guards));
    assert!(guards.iter().all(|g| !g.is_lost()), "a lease was lost");
    let (commands, renewed) = (
        commands_after - commands_before,
        renewals_after - renewals_before,
    );
    assert!(renewed >= 600, "only {renewed} renewals in 800 ms");
    // One round trip per renewal without batching; leases acquired one after the other fall due
    // spread over ~100 ms, so 2 ms windows gather a dozen or so each.
    assert!(
        commands * 5 <= renewed,
        "{commands} round trips for {renewed} renewals: not batched"
    );
    for guard in guards {
        guard.release().await.unwrap();
    }
}

/// A cluster-mode server reached through a plain connection (a managed "cluster mode, one
/// shard" Redis, one node owning every slot) refuses a script over keys of several slots
/// (CROSSSLOT): batched renewals of leases in different slots go one script per slot, so a
/// locker whose leases expire without them keeps every lease. (The store's batch itself, each
/// lease answered for itself: `src/store/tests/redis.rs`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batched_renewals_on_a_cluster_mode_server() {
    use tower_lock::Locker;

    let server = one_node_cluster();
    // Leases of 300 ms, renewed every 100 ms in batches, for a second: none is lost.
    let config = support::ttl_config(Duration::from_millis(300));
    let store = RedisStore::connect(server.url()).await.unwrap();
    let locker = Locker::with_config(store, config);
    let guards = futures_util::future::join_all((0..40).map(|i| {
        locker
            .acquire(locker.key("batch", i.to_string()).unwrap())
            .into_future()
    }))
    .await;
    let guards: Vec<_> = guards.into_iter().map(Result::unwrap).collect();
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(guards.iter().all(|g| !g.is_lost()), "a lease was lost");
    let renewals: u32 = guards.iter().map(|g| g.renewals()).sum();
    assert!(renewals >= 40 * 5, "only {renewals} renewals in 1 s");
    for guard in guards {
        guard.release().await.unwrap();
    }
}

/// A key value a client chooses to spell another key's companion is a lock of its own. Under the
/// earlier layout (`<lock key>:queue`), `sku-685:queue` under the namespace `audit` was exactly
/// the lock key of `sku-685`'s hand-off queue (the two values share a hash tag): holding it made
/// every acquire of `sku-685` fail with `WRONGTYPE` after its `SET NX` had taken the key, and its
/// release fail the same way, so the key stayed locked for a TTL after every attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_value_that_spells_another_keys_queue_is_a_lock_of_its_own() {
    let server = RedisServer::start();
    let config = LockConfig::builder().wait(Wait::none()).build().unwrap();
    let locker =
        tower_lock::Locker::with_config(RedisStore::connect(server.url()).await.unwrap(), config);
    let spelled = locker
        .acquire(locker.key("audit", "sku-685:queue").unwrap())
        .await
        .unwrap();
    for _ in 0..3 {
        let victim = locker
            .acquire(locker.key("audit", "sku-685").unwrap())
            .await
            .unwrap();
        victim.release().await.unwrap();
    }
    spelled.release().await.unwrap();
    assert!(server.lock_keys().await.is_empty(), "keys left behind");
}

/// Every way to build a store on `server`: `connect`, a caller's `ConnectionManager`,
/// `MultiplexedConnection` and bb8 pool (which do not ask the server whether it hashes keys to
/// slots), and Redlock's lazily connected node.
async fn every_constructor(server: &RedisServer) -> Vec<(&'static str, Box<dyn LockStoreDyn>)> {
    let client = redis::Client::open(server.url()).unwrap();
    let manager = redis::aio::ConnectionManager::new(client.clone())
        .await
        .unwrap();
    let multiplexed = client.get_multiplexed_async_connection().await.unwrap();
    let pool = RedisStore::pool_builder()
        .max_size(2)
        .build(bb8_redis::RedisConnectionManager::new(server.url()).unwrap())
        .await
        .unwrap();
    vec![
        (
            "connect",
            Box::new(RedisStore::connect(server.url()).await.unwrap()),
        ),
        (
            "from_connection_manager",
            Box::new(RedisStore::from_connection_manager(manager)),
        ),
        (
            "from_multiplexed",
            Box::new(RedisStore::from_multiplexed(multiplexed)),
        ),
        ("from_pool", Box::new(RedisStore::from_pool(pool))),
        (
            "redlock (lazy)",
            Box::new(
                tower_lock::store::RedlockStore::connect([server.url()])
                    .await
                    .unwrap(),
            ),
        ),
    ]
}

/// The two calls the test needs of any store, object-safe.
trait LockStoreDyn {
    fn fence(&self, key: &tower_lock::key::LockKey) -> futures_util::future::BoxFuture<'_, u64>;
}

impl<S: LockStore + Sync> LockStoreDyn for S {
    fn fence(&self, key: &tower_lock::key::LockKey) -> futures_util::future::BoxFuture<'_, u64> {
        let key = key.clone();
        Box::pin(async move {
            let token = Token::generate().unwrap();
            let fence = match self.acquire(&key, &token, Duration::from_secs(10)).await {
                Ok(tower_lock::store::Acquire::Acquired { fencing_token }) => fencing_token,
                other => panic!("not acquired: {other:?}"),
            };
            assert!(self.release(&key, &token).await.unwrap());
            fence
        })
    }
}

/// One key's fencing tokens come from one counter, whichever constructor made the store and
/// whether or not it has learnt that the server hashes keys to slots. On a cluster-mode server
/// reached through a plain connection, a store that was not told (a caller's connection, manager
/// or pool, Redlock's lazy connect) used the server-wide counter for a key in that counter's
/// own slot (no `CROSSSLOT` to teach it otherwise) while `connect`'s store used the slot's: with
/// the server-wide counter ahead (as after the server's clock stepped back), that key's tokens
/// went backwards from one store to the next, and within one store once it learnt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_key_one_fencing_counter_whatever_made_the_store() {
    for (what, server) in [
        ("plain", RedisServer::start()),
        ("cluster mode", one_node_cluster()),
    ] {
        // A key in the slot of the server-wide counter, `tower-lock:fence`.
        let shared_slot = tower_lock_testkit::key_slot(b"tower-lock:fence");
        let key = (0..)
            .map(|n| {
                tower_lock::key::LockKey::new(
                    "tower-lock:",
                    "fence",
                    format!("k{n}").as_bytes(),
                    64,
                )
                .unwrap()
            })
            .find(|key| tower_lock_testkit::key_slot(key.as_bytes()) == shared_slot)
            .unwrap();
        // The server-wide counter far ahead of the clock.
        let ahead = (std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_micros() as u64)
            + 1_000_000_000_000;
        let set = server.cli(&["SET", "tower-lock:fence", &ahead.to_string()]);
        assert!(set.contains("OK"), "{set}");
        let stores = every_constructor(&server).await;
        let mut last = 0;
        for round in ["before learning", "after learning"] {
            for (name, store) in &stores {
                let fence = store.fence(&key).await;
                assert!(
                    fence > last,
                    "{what} server, {name}, {round}: token {fence} after {last}"
                );
                last = fence;
            }
            // Every store meets a key of another slot: those that did not know learn now.
            let other =
                tower_lock::key::LockKey::new("tower-lock:", "fence", b"elsewhere", 64).unwrap();
            assert_ne!(tower_lock_testkit::key_slot(other.as_bytes()), shared_slot);
            for (_, store) in &stores {
                store.fence(&other).await;
            }
        }
    }
}
