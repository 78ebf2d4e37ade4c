//! How an acquire answers a store error, without a network: a store that asks to be asked again
//! (`StoreErrorKind::TryAgain`, Redis Cluster's `TRYAGAIN` during a slot migration) is retried
//! on the wait policy's schedule until the deadline, then answers 503 as other store errors do;
//! any other store error still answers 503 at once. Time is paused (virtual).

use std::{
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use axum::{
    Router,
    body::Body,
    http::{Request, StatusCode, header},
    routing::post,
};
use tokio::time::Instant;
use tower::ServiceExt;
use tower_lock::{
    Key, LockConfig, LockError, LockLayer, Locker, MemoryStore, Wait,
    key::LockKey,
    store::{Acquire, LockStore, StoreError, StoreErrorKind, Token},
};

/// A `MemoryStore` that refuses its next `refuse` acquires with an error of `kind`, and counts
/// acquires and releases.
#[derive(Clone)]
struct Refusing {
    inner: MemoryStore,
    kind: StoreErrorKind,
    refuse: Arc<AtomicUsize>,
    acquires: Arc<AtomicUsize>,
    releases: Arc<AtomicUsize>,
}

impl Refusing {
    fn new(kind: StoreErrorKind, refuse: usize) -> Self {
        Self {
            inner: MemoryStore::new(),
            kind,
            refuse: Arc::new(AtomicUsize::new(refuse)),
            acquires: Arc::default(),
            releases: Arc::default(),
        }
    }

    fn acquires(&self) -> usize {
        self.acquires.load(Ordering::SeqCst)
    }

    fn releases(&self) -> usize {
        self.releases.load(Ordering::SeqCst)
    }
}

impl LockStore for Refusing {
    async fn acquire(
        &self,
        key: &LockKey,
        token: &Token,
        ttl: Duration,
    ) -> Result<Acquire, StoreError> {
        self.acquires.fetch_add(1, Ordering::SeqCst);
        let refused = self
            .refuse
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        if refused {
            return Err(StoreError::msg(self.kind, "refused, for now"));
        }
        self.inner.acquire(key, token, ttl).await
    }

    async fn renew(&self, key: &LockKey, token: &Token, ttl: Duration) -> Result<bool, StoreError> {
        self.inner.renew(key, token, ttl).await
    }

    async fn release(&self, key: &LockKey, token: &Token) -> Result<bool, StoreError> {
        self.releases.fetch_add(1, Ordering::SeqCst);
        self.inner.release(key, token).await
    }
}

fn config(wait: Wait) -> LockConfig {
    LockConfig::builder().wait(wait).build().unwrap()
}

fn bounded() -> Wait {
    Wait::exponential(Duration::from_millis(10), Duration::from_millis(200))
        .unwrap()
        .deadline(Duration::from_secs(2))
}

#[tokio::test(start_paused = true)]
async fn try_again_is_retried_within_the_deadline() {
    let store = Refusing::new(StoreErrorKind::TryAgain, 3);
    let locker = Locker::with_config(store.clone(), config(bounded()));
    let guard = locker
        .acquire(locker.key("t", "k").unwrap())
        .await
        .expect("acquired once the store stopped refusing");
    assert_eq!(store.acquires(), 4);
    // A refused attempt wrote nothing: nothing to release.
    assert_eq!(store.releases(), 0);
    guard.release().await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn try_again_until_the_deadline_answers_503() {
    let store = Refusing::new(StoreErrorKind::TryAgain, usize::MAX);
    let layer = LockLayer::with_config(store.clone(), Key::path(), config(bounded()));
    let app = Router::new()
        .route("/jobs/1", post(|| async { "ran" }))
        .layer(layer);
    let started = Instant::now();
    let response = app
        .oneshot(Request::post("/jobs/1").body(Body::empty()).unwrap())
        .await
        .unwrap();
    let waited = started.elapsed();
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(response.headers().contains_key(header::RETRY_AFTER));
    assert!(
        waited >= Duration::from_secs(2),
        "answered before the deadline: {waited:?}"
    );
    assert!(store.acquires() > 5, "{} attempts", store.acquires());
    let error = response.extensions().get::<LockError>();
    assert!(
        matches!(error, Some(LockError::Store(e)) if e.kind() == StoreErrorKind::TryAgain),
        "{error:?}"
    );
}

/// The negative control: any other store error answers 503 at once, after one attempt.
#[tokio::test(start_paused = true)]
async fn other_store_errors_answer_at_once() {
    for kind in [
        StoreErrorKind::Unavailable,
        StoreErrorKind::Timeout,
        StoreErrorKind::Backend,
        StoreErrorKind::Authentication,
        StoreErrorKind::Tls,
        StoreErrorKind::Config,
    ] {
        let store = Refusing::new(kind, 1);
        let locker = Locker::with_config(store.clone(), config(bounded()));
        let started = Instant::now();
        match locker.acquire(locker.key("t", "k").unwrap()).await {
            Err(LockError::Store(error)) => assert_eq!(error.kind(), kind),
            other => panic!("{kind:?}: expected a store error, got {other:?}"),
        }
        assert_eq!(store.acquires(), 1, "{kind:?}");
        assert_eq!(started.elapsed(), Duration::ZERO, "{kind:?}");
    }
}

/// Waiting forever (background work), a refusal keeps the token: nothing is released (other
/// store errors send a release and start over with a new token).
#[tokio::test(start_paused = true)]
async fn waiting_forever_a_refusal_sends_no_release() {
    let store = Refusing::new(StoreErrorKind::TryAgain, 3);
    let locker = Locker::with_config(store.clone(), config(wait_forever()));
    let guard = locker.acquire(locker.key("t", "k").unwrap()).await.unwrap();
    tokio::task::yield_now().await;
    assert_eq!((store.acquires(), store.releases()), (4, 0));
    guard.release().await.unwrap();

    // The negative control: an outage on the same path does send releases.
    let store = Refusing::new(StoreErrorKind::Unavailable, 3);
    let locker = Locker::with_config(store.clone(), config(wait_forever()));
    let guard = locker.acquire(locker.key("t", "k").unwrap()).await.unwrap();
    // Those releases run on the crate's own runtime, in real time (this test's clock is
    // paused): waited for, a while at most.
    let started = std::time::Instant::now();
    while store.releases() < 3 && started.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!((store.acquires(), store.releases()), (4, 3));
    guard.release().await.unwrap();
}

fn wait_forever() -> Wait {
    Wait::constant(Duration::from_millis(10)).unwrap().forever()
}
