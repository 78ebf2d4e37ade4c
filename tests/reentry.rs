//! Re-entry on real Redis: a handler behind `LockLayer` whose code takes `Locker::acquire` on
//! the key its request holds gets a lease on the same hold at once (same fencing token), and
//! releasing it does not end the request's lease; a spawned task is another holder; a shared
//! holder re-enters shared, not exclusive.

use crate::support;

use std::{
    num::NonZeroU32,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use axum::{
    Router,
    body::Body,
    extract::Path,
    http::{Method, Request, Response, StatusCode},
    response::IntoResponse,
    routing::{MethodRouter, get},
};
use support::{LockKeys, body_json, handoff_subscriptions, send};
use tower_lock::{
    Key, Lease, LockConfig, LockError, LockLayer, Locker, RedisStore, Wait, key::LockKey,
};
use tower_lock_testkit::RedisServer;

/// Two permits (a count is a `NonZeroU32`: 0 does not compile).
const TWO: NonZeroU32 = NonZeroU32::new(2).unwrap();

async fn locker(server: &RedisServer) -> Locker {
    let store = RedisStore::connect(server.url()).await.unwrap();
    handoff_subscriptions(server, 1).await;
    Locker::new(store)
}

fn half_a_second() -> Wait {
    Wait::constant(Duration::from_millis(50))
        .unwrap()
        .deadline(Duration::from_millis(500))
}

/// The layer before `/items/{sku}`: the SKU's key in the `items` namespace.
fn items_layer(locker: Locker) -> LockLayer {
    LockLayer::from_locker(locker, Key::path_param("sku")).namespace("items")
}

/// `/items/{sku}` answered by `route` behind `layer`.
fn items_app(route: MethodRouter, layer: LockLayer) -> Router {
    Router::new()
        .route("/items/{sku}", route)
        .route_layer(layer)
}

/// A GET handler that runs `work` with a clone of `locker` and the SKU's key in the `items`
/// namespace: the key its request holds, taken again as the handler's own code would.
fn get_with_item_key<F, Fut>(locker: &Locker, work: F) -> MethodRouter
where
    F: Fn(Locker, LockKey) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output: IntoResponse> + Send + 'static,
{
    let locker = locker.clone();
    get(move |Path(sku): Path<String>| {
        let key = locker.key("items", &sku).unwrap();
        work(locker.clone(), key)
    })
}

/// Sends `GET /items/sku-1` through `app`.
async fn get_sku_1(app: &Router) -> Response<Body> {
    send(
        app,
        Request::get("/items/sku-1").body(Body::empty()).unwrap(),
    )
    .await
}

/// What a nested acquire found: how long it took, its fencing token, or its error.
type Nested = Result<(Duration, u64), String>;

/// The scenario: `/items/{sku}` behind the layer; the handler calls a function that
/// takes the SKU's key with a 500 ms deadline. It returns at once with the request's fencing
/// token; released, the request still holds the key (another process cannot take it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nested_acquire_in_the_handler_re_enters_the_requests_lease() {
    let server = RedisServer::start();
    let locker = locker(&server).await;
    let other = Locker::new(RedisStore::connect(server.url()).await.unwrap());
    let seen: Arc<Mutex<Option<(Nested, bool)>>> = Arc::default();
    let app = items_app(
        get({
            let (locker, other, seen) = (locker.clone(), other.clone(), Arc::clone(&seen));
            move |Path(sku): Path<String>, lease: Lease| async move {
                let started = Instant::now();
                let key = locker.key("items", &sku).unwrap();
                let nested = match locker.acquire(key.clone()).wait(half_a_second()).await {
                    Ok(guard) => {
                        let found = (started.elapsed(), guard.fencing_token());
                        guard.release().await.unwrap();
                        Ok(found)
                    }
                    Err(error) => Err(error.to_string()),
                };
                // Released, the nested lease leaves the request's lease held: another
                // process (here, another task: this one would re-enter) cannot take it.
                let taken = tokio::spawn(async move {
                    other.acquire(key).try_acquire().await.unwrap().is_some()
                })
                .await
                .unwrap();
                *seen.lock().unwrap() = Some((nested, taken));
                assert!(!lease.is_lost());
                lease.fencing_token().to_string()
            }
        }),
        items_layer(locker),
    );
    let response = get_sku_1(&app).await;
    assert_eq!(response.status(), StatusCode::OK);
    let outer: u64 = String::from_utf8(
        axum::body::to_bytes(response.into_body(), 1024)
            .await
            .unwrap()
            .to_vec(),
    )
    .unwrap()
    .parse()
    .unwrap();
    let (nested, taken) = seen.lock().unwrap().take().unwrap();
    let (took, token) = nested.expect("the nested acquire failed");
    assert!(
        took < Duration::from_millis(200),
        "waited {took:?} for itself"
    );
    assert_eq!(token, outer, "another fencing token: not the same hold");
    assert!(!taken, "the nested release ended the request's lease");
}

/// A task the handler spawns is another task: it does not hold the request's lease, and waits
/// for it like any other holder (here, until its deadline).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spawned_task_does_not_re_enter() {
    let server = RedisServer::start();
    let locker = locker(&server).await;
    let app = items_app(
        get_with_item_key(&locker, |locker, key| async move {
            let spawned = tokio::spawn({
                let locker = locker.clone();
                async move { locker.acquire(key).wait(half_a_second()).await.map(drop) }
            });
            match spawned.await.unwrap() {
                Err(LockError::Contended { .. }) => "contended",
                Err(_) => "failed",
                Ok(()) => "acquired",
            }
        }),
        items_layer(locker),
    );
    let response = get_sku_1(&app).await;
    let body = axum::body::to_bytes(response.into_body(), 1024)
        .await
        .unwrap();
    assert_eq!(&body[..], b"contended");
}

/// A request that holds its key shared re-enters it shared at once; an exclusive acquire of
/// the same key is no re-entry (a reader cannot become the writer): it could only wait for
/// its own request, and fails at once with a configuration error. `Locker::run` re-enters the
/// same way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_holder_re_enters_shared_only() {
    let server = RedisServer::start();
    let locker = locker(&server).await;
    let shared_on_get = items_layer(locker.clone())
        .shared_when(|parts| parts.method == Method::GET)
        .unwrap();
    let app = items_app(
        get_with_item_key(&locker, |locker, key| async move {
            let started = Instant::now();
            let shared = locker
                .acquire(key.clone())
                .shared()
                .unwrap()
                .wait(half_a_second())
                .await;
            let shared_took = started.elapsed();
            let started = Instant::now();
            let exclusive = locker
                .acquire(key)
                .exclusive()
                .unwrap()
                .wait(half_a_second())
                .await;
            serde_json::json!({
                "shared": shared.is_ok(),
                "shared_ms": shared_took.as_millis() as u64,
                "exclusive_refused": matches!(exclusive, Err(LockError::Config(_))),
                "exclusive_ms": started.elapsed().as_millis() as u64,
            })
            .to_string()
        }),
        shared_on_get,
    );
    let response = get_sku_1(&app).await;
    assert_eq!(response.status(), StatusCode::OK);
    let body = body_json(response).await;
    assert_eq!(body["shared"], true, "{body}");
    assert!(body["shared_ms"].as_u64().unwrap() < 200, "{body}");
    assert_eq!(body["exclusive_refused"], true, "{body}");
    assert!(body["exclusive_ms"].as_u64().unwrap() < 200, "{body}");

    // `Locker::run`'s work re-enters its own lease.
    let config = LockConfig::builder().wait(half_a_second()).build().unwrap();
    let locker = Locker::with_config(RedisStore::connect(server.url()).await.unwrap(), config);
    let key = locker.key("jobs", "nightly").unwrap();
    let inner = locker
        .run(key.clone(), {
            let (locker, key) = (locker.clone(), key.clone());
            async move {
                let started = Instant::now();
                let guard = locker.acquire(key).await.unwrap();
                assert!(started.elapsed() < Duration::from_millis(200));
                guard.fencing_token()
            }
        })
        .await
        .unwrap();
    assert!(inner > 0);
    // Released by the run's end, not by the nested guard's.
    assert!(locker.try_acquire(key).await.unwrap().is_some());
}

/// A nested guard kept past the hold it re-entered (returned from `run`'s work, as it could be
/// moved into a spawned task) is lost once its holder releases: it no longer says the key is
/// held while another process holds it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nested_guard_kept_past_its_holder_is_lost() {
    let server = RedisServer::start();
    let locker = locker(&server).await;
    let other = Locker::new(RedisStore::connect(server.url()).await.unwrap());
    let key = locker.key("items", "sku-1").unwrap();
    let nested = locker
        .run(key.clone(), {
            let (locker, key) = (locker.clone(), key.clone());
            async move { locker.acquire(key).await.unwrap() }
        })
        .await
        .unwrap();
    let taken = other.acquire(key).try_acquire().await.unwrap();
    assert!(taken.is_some(), "the holder's release did not free the key");
    assert!(
        nested.lease().is_lost(),
        "a nested guard outlived its holder"
    );
    assert!(
        matches!(nested.release().await, Err(LockError::LeaseLost(_))),
        "released as if still held"
    );
    // Negative control: a nested guard dropped within its holder's work loses nothing.
    let key = locker.key("items", "sku-2").unwrap();
    let outer_kept = locker
        .run(key.clone(), {
            let (locker, key) = (locker.clone(), key.clone());
            async move {
                let nested = locker.acquire(key).await.unwrap();
                let token = nested.fencing_token();
                nested.release().await.unwrap();
                token
            }
        })
        .await;
    assert!(outer_kept.is_ok(), "{outer_kept:?}");
}

/// A nested acquire that asks for more of a key than its task holds (that key with another,
/// more permits than it holds, exclusive over shared) could only wait for itself: it fails at
/// once with a configuration error, even under a wait policy with no deadline, rather than
/// waiting (here, forever).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nested_acquire_of_more_than_is_held_fails_at_once() {
    let server = RedisServer::start();
    let locker = locker(&server).await;
    let forever = Wait::constant(Duration::from_millis(50)).unwrap().forever();
    let (one, two) = (
        locker.key("items", "sku-1").unwrap(),
        locker.key("items", "sku-2").unwrap(),
    );
    let answers = tokio::time::timeout(
        Duration::from_secs(5),
        locker.run(one.clone(), {
            let locker = locker.clone();
            async move {
                let started = Instant::now();
                let set = locker
                    .acquire(tower_lock::key::KeySet::new([one, two.clone()]))
                    .wait(forever)
                    .await
                    .map(drop);
                // Another key alone is no re-entry, and is taken as usual.
                let other = locker.acquire(two).await.map(drop);
                (started.elapsed(), set, other)
            }
        }),
    )
    .await
    .expect("the nested acquire waited for its own holder")
    .unwrap();
    let (took, set, other) = answers;
    assert!(matches!(set, Err(LockError::Config(_))), "{set:?}");
    assert!(other.is_ok(), "{other:?}");
    assert!(took < Duration::from_secs(2), "took {took:?}");
    // More permits than held, when the key has no room for both.
    let key = locker.key("provider", "acct-1").unwrap();
    let heavier = tokio::time::timeout(
        Duration::from_secs(5),
        locker.acquire(key.clone()).permits(TWO).unwrap().run({
            let locker = locker.clone();
            async move {
                locker
                    .acquire(key)
                    .permits(TWO)
                    .unwrap()
                    .weight(TWO)
                    .unwrap()
                    .wait(Wait::constant(Duration::from_millis(50)).unwrap().forever())
                    .await
                    .map(drop)
            }
        }),
    )
    .await
    .expect("the nested acquire waited for its own holder");
    assert!(
        matches!(heavier, Ok(Err(LockError::Config(_)))),
        "{heavier:?}"
    );
}

/// Re-entry is per store: a task that holds a key on one store holds nothing on another with
/// the same key bytes (a nested acquire there takes that store's lock, and waits for whoever
/// holds it); lockers over clones of one store re-enter each other's leases.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn re_entry_is_per_store() {
    let server = RedisServer::start();
    let store = RedisStore::connect(server.url()).await.unwrap();
    handoff_subscriptions(&server, 1).await;
    let redis = Locker::new(store.clone());
    let clone = Locker::new(store);
    let local = Locker::new(tower_lock::MemoryStore::new());
    let other = Locker::new(RedisStore::connect(server.url()).await.unwrap());
    let key = redis.key("accounts", "acct-1").unwrap();
    let in_redis = local
        .run(key.clone(), {
            let (redis, key) = (redis.clone(), key.clone());
            async move {
                let guard = redis.acquire(key.clone()).await.unwrap();
                let held = tokio::spawn(async move {
                    other.acquire(key).try_acquire().await.unwrap().is_none()
                })
                .await
                .unwrap();
                drop(guard);
                held
            }
        })
        .await
        .unwrap();
    assert!(
        in_redis,
        "the Redis lock was not taken under a memory store's lease"
    );
    // Nested in a Redis lease, through a locker over a clone of its store: at once.
    let started = Instant::now();
    let nested = redis
        .run(
            key.clone(),
            async move { clone.acquire(key).await.map(drop) },
        )
        .await
        .unwrap();
    assert!(nested.is_ok(), "{nested:?}");
    assert!(started.elapsed() < Duration::from_secs(1));
}

/// `Locker::run` re-entered in a handler whose layer continues after a loss
/// (`OnLeaseLost::Continue`) still drops its work the moment the lease is lost, as a `run` of
/// its own does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nested_run_is_dropped_when_the_lease_is_lost() {
    let server = RedisServer::start();
    let store = RedisStore::connect(server.url()).await.unwrap();
    handoff_subscriptions(&server, 1).await;
    let locker = Locker::with_config(
        store,
        LockConfig::builder()
            .ttl(Duration::from_millis(900))
            .build()
            .unwrap(),
    );
    let seen: Arc<Mutex<Option<Result<(), LockError>>>> = Arc::default();
    let app = items_app(
        get({
            let (locker, seen) = (locker.clone(), Arc::clone(&seen));
            move |Path(sku): Path<String>| async move {
                let key = locker.key("items", &sku).unwrap();
                let ran = locker
                    .run(key, tokio::time::sleep(Duration::from_secs(30)))
                    .await;
                *seen.lock().unwrap() = Some(ran);
                "done"
            }
        }),
        items_layer(locker).on_lease_lost(tower_lock::config::OnLeaseLost::Continue),
    );
    let request = tokio::spawn({
        let app = app.clone();
        async move { get_sku_1(&app).await }
    });
    // Held: then lost, its key deleted (as a restart without persistence would).
    let mut conn = server.client().await;
    let deadline = Instant::now() + Duration::from_secs(5);
    let keys = loop {
        let keys = server.lock_keys().await;
        if !keys.is_empty() || Instant::now() > deadline {
            break keys;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(!keys.is_empty(), "the request never held its key");
    for key in keys {
        let _: i64 = redis::cmd("DEL")
            .arg(key)
            .query_async(&mut conn)
            .await
            .unwrap();
    }
    let answered = tokio::time::timeout(Duration::from_secs(10), request).await;
    assert!(
        answered.is_ok(),
        "the nested run's work was not dropped at the loss"
    );
    let ran = seen.lock().unwrap().take();
    assert!(matches!(ran, Some(Err(LockError::LeaseLost(_)))), "{ran:?}");
}

/// Behind `IdempotencyLayer` too: a handler that acquires its request's own key (read from its
/// `Lease`) re-enters the request's lease at once, with its fencing token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_behind_the_idempotency_layer_re_enters_its_lease() {
    let server = RedisServer::start();
    let locker = locker(&server).await;
    let app = Router::new()
        .route(
            "/payments",
            axum::routing::post({
                let locker = locker.clone();
                move |lease: Lease| async move {
                    let started = Instant::now();
                    let nested = locker
                        .acquire(lease.key().clone())
                        .wait(half_a_second())
                        .await;
                    serde_json::json!({
                        "same_token": nested.as_ref().ok().map(|g| g.fencing_token())
                            == Some(lease.fencing_token()),
                        "ms": started.elapsed().as_millis() as u64,
                    })
                    .to_string()
                }
            }),
        )
        .route_layer(
            tower_lock::IdempotencyLayer::from_locker(
                locker,
                tower_lock::idempotency::SharedKeySpace,
            )
            .unwrap(),
        );
    let request = Request::post("/payments")
        .header("idempotency-key", "\"reentry-test-key-0001\"")
        .body(Body::empty())
        .unwrap();
    let response = send(&app, request).await;
    assert_eq!(response.status(), StatusCode::OK);
    let body = body_json(response).await;
    assert_eq!(body["same_token"], true, "{body}");
    assert!(body["ms"].as_u64().unwrap() < 300, "{body}");
}
