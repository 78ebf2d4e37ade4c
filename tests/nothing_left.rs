//! Nothing left behind, nothing revealed: what the crate writes to Redis for a year of traffic.
//!
//! Through the payments example on a real Redis, from outside: after hundreds of payments with
//! distinct keys and secret-looking account ids, every key the crate wrote has an expiry, and
//! no key name holds a caller's id or idempotency key; a key the IETF draft's syntax refuses is
//! a 400. Then, on the library, the two fence rules that make expiry safe: a holder paused for
//! longer than a fence's horizon is refused when it resumes (with a negative control: the same
//! pause with the horizon out of the way lets its stale write in), and a holder whose fenced
//! write was refused leaves no idempotency record to replay.

use crate::instances;

use std::{
    collections::BTreeMap,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering::SeqCst},
    },
    time::{Duration, Instant},
};

use axum::{
    Router,
    body::Body,
    http::{Request, StatusCode},
    response::IntoResponse,
    routing::post,
};
use instances::{Instance, example_binary};
use tokio::sync::Notify;
use tower::ServiceExt;
use tower_lock::{
    IdempotencyLayer, Lease, LockConfig, Locker, MemoryStore, RedisStore,
    config::OnLeaseLost,
    fence::{FenceError, FencedData, data_key},
    idempotency::{IdempotencyConfig, SharedKeySpace},
};
use tower_lock_testkit::{RedisServer, http::Http};

/// Every key in `redis` with its time to live in ms (`-1`: none), by `SCAN`.
async fn every_key(redis: &RedisServer) -> BTreeMap<Vec<u8>, i64> {
    let mut conn = redis.client().await;
    let mut keys = BTreeMap::new();
    let mut cursor = 0u64;
    loop {
        let (next, batch): (u64, Vec<Vec<u8>>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("COUNT")
            .arg(1000)
            .query_async(&mut conn)
            .await
            .unwrap();
        for key in batch {
            let ttl: i64 = redis::cmd("PTTL")
                .arg(&key)
                .query_async(&mut conn)
                .await
                .unwrap();
            keys.insert(key, ttl);
        }
        if next == 0 {
            return keys;
        }
        cursor = next;
    }
}

/// Deletes the one key matching `pattern` (as an expiry or an eviction would).
async fn delete_the_one_key(redis: &RedisServer, pattern: &str) {
    let mut conn = redis.client().await;
    let keys: Vec<Vec<u8>> = redis::cmd("KEYS")
        .arg(pattern)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(keys.len(), 1, "{pattern}: {keys:?}");
    let _: () = redis::cmd("DEL")
        .arg(&keys[0])
        .query_async(&mut conn)
        .await
        .unwrap();
}

/// The example's own journal of charges (`GET /payments` reads it): data the example keeps on
/// purpose, not a key of the crate's.
const JOURNAL: &[u8] = b"payments:log";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn payments_leave_only_expiring_keys_and_no_caller_id_in_names() {
    let redis = RedisServer::start();
    // At `info`, the example logs each payment it creates.
    let payments = Instance::start_binary(
        example_binary("payments"),
        &redis.url(),
        &[("RUST_LOG", "info")],
    );
    let mut http = Http::new(payments.port);

    // 200 payments with distinct keys, from 20 accounts whose ids are secrets (API keys), and a
    // retry of every tenth (a replay).
    let account = |i: usize| format!("sk_live_{:024x}", 0x5ec7e7_u128 * (i as u128 % 20 + 1));
    let key = |i: usize| format!("order-{i:04}-f81d4fae7dec11d0a76500a0c91e6bf6");
    let body = r#"{"amount": 1250, "currency": "EUR"}"#;
    for i in 0..200 {
        let (account, key) = (account(i), key(i));
        let headers = [("x-account", &account[..]), ("idempotency-key", &key[..])];
        let sent = http
            .request_with("POST", "/payments", Some(body), &headers)
            .await
            .unwrap();
        assert_eq!(sent.status, 201, "{}", String::from_utf8_lossy(&sent.body));
        if i % 10 == 0 {
            let replay = http
                .request_with("POST", "/payments", Some(body), &headers)
                .await
                .unwrap();
            assert_eq!(replay.status, 201);
            assert_eq!(replay.header("idempotent-replayed"), Some("true"));
        }
    }

    let keys = every_key(&redis).await;
    // Each payment leaves its record, its payment and the payment's fence, at least.
    assert!(keys.len() >= 600, "{} keys", keys.len());
    let secrets: Vec<String> = (0..20).map(account).chain((0..200).map(key)).collect();
    for (name, ttl) in &keys {
        let shown = String::from_utf8_lossy(name);
        if &name[..] != JOURNAL {
            assert!(*ttl > 0, "{shown} has no expiry (PTTL {ttl})");
        }
        for secret in &secrets {
            assert!(!shown.contains(secret), "{shown} shows {secret}");
        }
        assert!(!shown.contains("sk_live"), "{shown} shows a caller's id");
    }
    let fences = keys
        .keys()
        .filter(|k| k.windows(11).any(|w| w == b"data-fence:"))
        .count();
    assert!(fences >= 200, "{fences} fences");

    // A key a proxy could split (a list), or join: 400, problem+json, nothing written.
    for bad in [
        "key,with,commas,longer-than-twenty-chars",
        "order;version=2-0123456789abcdef",
    ] {
        let refused = http
            .request_with(
                "POST",
                "/payments",
                Some(body),
                &[("x-account", "acct_1"), ("idempotency-key", bad)],
            )
            .await
            .unwrap();
        assert_eq!(refused.status, 400, "{bad}");
        assert_eq!(
            refused.header("content-type"),
            Some("application/problem+json")
        );
    }
    assert_eq!(
        every_key(&redis).await.len(),
        keys.len(),
        "a refused key wrote"
    );
    // Nor does the log show a caller's id.
    let log = payments.output();
    assert!(log.contains("payment created"), "{log}");
    assert!(!log.contains("sk_live"), "the log shows a caller's id");
}

/// [`paused_past_the_horizon`] with the fence left to expire (2.5 s): asserts that the stale
/// holder's write is refused as stale and the newer holder's sale stands; `case` names the case.
async fn assert_refused_after_the_fence_expired(
    data: FencedData,
    lockers: [Locker; 2],
    case: &str,
) {
    let (write, stock) =
        paused_past_the_horizon(data, lockers, Duration::from_millis(2_500), None).await;
    assert!(
        matches!(write, Err(FenceError::Stale { .. })),
        "{case}: {write:?}"
    );
    assert_eq!(stock, b"4", "{case}: the newer holder's sale stands");
}

/// A holder paused past its lease and past its resource's fence's horizon: refused when it
/// resumes, though the fence that a newer holder raised has expired. `horizon` is the handle's;
/// `drop_fence` deletes the fence at once (as eviction or an operator might) instead of waiting
/// for it to expire. The stale holder and the newer one are two instances (two lockers on the
/// store). Returns what the stale holder's write got, and the stock left.
async fn paused_past_the_horizon(
    data: FencedData,
    [paused, locker]: [Locker; 2],
    wait_for_expiry: Duration,
    drop_fence: Option<&RedisServer>,
) -> (Result<(), FenceError>, Vec<u8>) {
    let key = locker.key("sku", "apple").unwrap();
    let stock = data_key("stock:", &key);
    // The stale holder: takes the key, reads, and stops renewing at 150 ms, as a pause stops
    // renewals; its 300 ms lease runs out while it holds its guard.
    let stale = paused
        .acquire(key.clone())
        .ttl(Duration::from_millis(300))
        .unwrap()
        .max_hold(Duration::from_millis(150))
        .unwrap()
        .await
        .unwrap();
    data.batch(&stale).get(&stock).apply().await.unwrap();
    tokio::time::sleep(Duration::from_millis(450)).await;
    // A newer holder sells and lets go.
    let newer = locker.acquire(key.clone()).await.unwrap();
    data.batch(&newer).set(&stock, "4").apply().await.unwrap();
    newer.release().await.unwrap();
    match drop_fence {
        Some(redis) => delete_the_one_key(redis, "*}data-fence:*").await,
        None => tokio::time::sleep(wait_for_expiry).await,
    }
    // The stale holder resumes and writes what it computed from its read.
    let write = data.batch(&stale).set(&stock, "9").apply().await;
    drop(stale);
    let read = data.unfenced_batch().get(&stock).apply().await.unwrap();
    (
        write.map(|_| ()),
        read.data(0).map(|v| v.to_vec()).unwrap_or_default(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_paused_past_the_horizon_is_refused_after_its_fence_expired() {
    let redis = RedisServer::start();
    let store = RedisStore::connect(redis.url()).await.unwrap();
    let locker = Locker::new(store.clone());
    // A 1 s horizon: the fence is kept 2 s (horizon and slack) after the newer holder's write.
    let data = FencedData::new(store.clone())
        .horizon(Duration::from_secs(1))
        .unwrap();
    let lockers = [Locker::new(store.clone()), locker.clone()];
    assert_refused_after_the_fence_expired(data, lockers, "the stale write after the horizon")
        .await;
    assert!(
        every_key(&redis)
            .await
            .keys()
            .all(|k| !k.windows(11).any(|w| w == b"data-fence:")),
        "the fence expired"
    );

    // The same on the in-memory data, whose rule is the highest expired fence's token.
    let memory = MemoryStore::new();
    let lockers = [Locker::new(memory.clone()), Locker::new(memory)];
    let data = FencedData::in_memory()
        .horizon(Duration::from_secs(1))
        .unwrap();
    assert_refused_after_the_fence_expired(data, lockers, "in memory").await;

    // A fresh holder after the fence expired writes: the horizon refuses only old tokens.
    let fresh = locker
        .acquire(locker.key("sku", "apple").unwrap())
        .await
        .unwrap();
    let data = FencedData::new(store.clone())
        .horizon(Duration::from_secs(1))
        .unwrap();
    let stock = data_key("stock:", fresh.key());
    data.batch(&fresh).set(&stock, "3").apply().await.unwrap();
}

/// The negative control: with the fence gone and a horizon longer than the pause, the stale
/// write lands over the newer holder's. What refused it above is the horizon, not luck.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_horizon_an_expired_fence_lets_a_stale_write_in() {
    let redis = RedisServer::start();
    let store = RedisStore::connect(redis.url()).await.unwrap();
    let data = FencedData::new(store.clone())
        .horizon(Duration::from_secs(3600))
        .unwrap();
    let lockers = [Locker::new(store.clone()), Locker::new(store)];
    let (write, stock) = paused_past_the_horizon(data, lockers, Duration::ZERO, Some(&redis)).await;
    assert!(write.is_ok(), "{write:?}");
    assert_eq!(stock, b"9", "the stale write landed: an update was lost");
}

/// The stale-409 sequence: request A is paused past its lease; a retry B takes the key and
/// writes the payment (raising the fence), then fails (502) after the write, storing no record;
/// A resumes, its write is refused (409 `#stale-write`). A's 409 must not become the key's
/// stored answer: the next retry runs, and finds B's payment.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_stale_write_is_never_the_keys_stored_answer() {
    let redis = RedisServer::start();
    let store = RedisStore::connect(redis.url()).await.unwrap();
    let data = FencedData::new(store.clone());
    let a_read = Arc::new(Notify::new());
    let a_resume = Arc::new(Notify::new());
    let calls = Arc::new(AtomicUsize::new(0));
    let handler = {
        let (data, a_read, a_resume) = (data.clone(), a_read.clone(), a_resume.clone());
        let calls = calls.clone();
        move |lease: Lease| {
            let (data, a_read, a_resume) = (data.clone(), a_read.clone(), a_resume.clone());
            let call = calls.fetch_add(1, SeqCst);
            async move {
                let payment = data_key("payment:", lease.key());
                let found = data.batch(&lease).get(&payment).apply().await.unwrap();
                if found.data(0).is_some() {
                    return (StatusCode::CREATED, "found the payment made before").into_response();
                }
                if call == 0 {
                    // A: found nothing; now paused, past its lease.
                    a_read.notify_one();
                    a_resume.notified().await;
                }
                match data.batch(&lease).set(&payment, "paid").apply().await {
                    // B: the charge landed, then a downstream call failed: no record.
                    Ok(_) if call == 1 => {
                        (StatusCode::BAD_GATEWAY, "charged; the receipt failed").into_response()
                    }
                    Ok(_) => (StatusCode::CREATED, "charged").into_response(),
                    Err(refused) => refused.into_response(),
                }
            }
        }
    };
    let config = IdempotencyConfig::builder()
        .lock(
            LockConfig::builder()
                .ttl(Duration::from_millis(300))
                .build()
                .unwrap(),
        )
        .build()
        .unwrap();
    // Two instances on one Redis: A on the first, B and the retry on the second.
    let instance = |store: RedisStore| {
        Router::new()
            .route("/payments", post(handler.clone()))
            .route_layer(
                IdempotencyLayer::with_config(store, SharedKeySpace, config.clone())
                    .on_lease_lost(OnLeaseLost::Continue),
            )
    };
    let app = instance(store);
    let other = instance(RedisStore::connect(redis.url()).await.unwrap());
    let pay = || {
        Request::post("/payments")
            .header(
                "idempotency-key",
                "\"9f1c2a7e-5d1b-4c1e-9a3e-6b7d8c9e0f11\"",
            )
            .body(Body::from("{}"))
            .unwrap()
    };
    let a = tokio::spawn(app.clone().oneshot(pay()));
    a_read.notified().await;
    // A's lease is lost, as in a pause past its TTL: its lock key goes (expired, say).
    delete_the_one_key(&redis, "tower-lock:{*}[0-9]*").await;
    let started = Instant::now();
    let b = loop {
        let b = other.clone().oneshot(pay()).await.unwrap();
        if b.status() != StatusCode::CONFLICT || started.elapsed() > Duration::from_secs(5) {
            break b;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(b.status(), StatusCode::BAD_GATEWAY, "B wrote, then failed");
    a_resume.notify_one();
    let a = a.await.unwrap().unwrap();
    assert_eq!(a.status(), StatusCode::CONFLICT, "A's write was refused");
    // The next retry runs the handler (no replay of A's 409), and finds B's payment.
    let retry = other.clone().oneshot(pay()).await.unwrap();
    assert!(
        retry.headers().get("idempotent-replayed").is_none(),
        "A's stale 409 was stored and replayed"
    );
    assert_eq!(retry.status(), StatusCode::CREATED);
    let body = axum::body::to_bytes(retry.into_body(), 1024).await.unwrap();
    assert_eq!(&body[..], b"found the payment made before");
    assert_eq!(calls.load(SeqCst), 3);
}

/// Every store's tokens follow the clock, so that a fence's horizon judges them alike: leases of
/// the in-memory store fence data kept in Redis (the inventory example with `STOCK_URL` and no
/// `REDIS_URL`). A first write to a resource without a fence is applied, and a holder paused past
/// the horizon is refused there too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_memory_leases_fence_data_in_redis() {
    let redis = RedisServer::start();
    let data = FencedData::new(RedisStore::connect(redis.url()).await.unwrap())
        .horizon(Duration::from_secs(1))
        .unwrap();
    let memory = MemoryStore::new();
    let locker = Locker::new(memory.clone());
    let guard = locker
        .acquire(locker.key("sku", "fig").unwrap())
        .await
        .unwrap();
    let stock = data_key("stock:", guard.key());
    data.batch(&guard).set(&stock, "5").apply().await.unwrap();
    guard.release().await.unwrap();
    let lockers = [Locker::new(memory.clone()), Locker::new(memory)];
    assert_refused_after_the_fence_expired(data, lockers, "the stale write after the horizon")
        .await;
}
