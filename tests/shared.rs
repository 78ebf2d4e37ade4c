//! Shared/exclusive leases on real Redis: readers share a key, a writer excludes everyone, first
//! come first served across processes (a writer queued behind readers is not starved by readers
//! that keep coming; readers that come after a queued writer wait for it), key sets that mix the
//! two, and the layer's per-request choice.

use crate::support;

use std::{
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use axum::{
    Router,
    body::Body,
    http::{Method, Request, StatusCode},
    routing::get,
};
use support::{LockKeys, handoff_subscriptions, processes, send};
use tower_lock::{Key, LockLayer, Locker, RedisStore, Wait, key::KeySet};
use tower_lock_testkit::RedisServer;

/// Who is inside one resource: readers and writers, and whether a writer ever had company.
#[derive(Default)]
struct Room {
    readers: AtomicUsize,
    writers: AtomicUsize,
    most_readers: AtomicUsize,
    broken: AtomicBool,
}

impl Room {
    async fn read(&self, work: Duration) {
        let now = self.readers.fetch_add(1, Ordering::SeqCst) + 1;
        self.most_readers.fetch_max(now, Ordering::SeqCst);
        if self.writers.load(Ordering::SeqCst) > 0 {
            self.broken.store(true, Ordering::SeqCst);
        }
        tokio::time::sleep(work).await;
        self.readers.fetch_sub(1, Ordering::SeqCst);
    }

    async fn write(&self, work: Duration) {
        if self.writers.fetch_add(1, Ordering::SeqCst) > 0
            || self.readers.load(Ordering::SeqCst) > 0
        {
            self.broken.store(true, Ordering::SeqCst);
        }
        tokio::time::sleep(work).await;
        if self.readers.load(Ordering::SeqCst) > 0 {
            self.broken.store(true, Ordering::SeqCst);
        }
        self.writers.fetch_sub(1, Ordering::SeqCst);
    }

    /// Asserts that no writer ever had company (another writer or a reader).
    fn assert_writers_were_alone(&self) {
        assert!(!self.broken.load(Ordering::SeqCst), "a writer had company");
    }

    /// Asserts that readers were ever inside together.
    fn assert_readers_shared(&self) {
        assert!(
            self.most_readers.load(Ordering::SeqCst) > 1,
            "readers never shared"
        );
    }
}

/// 30 requests from three processes, every fifth a writer; `locked: false` takes no lease.
async fn mixed_load(lockers: &[Locker], locked: bool) -> Arc<Room> {
    let room = Arc::new(Room::default());
    let mut tasks = Vec::new();
    for i in 0..30 {
        let locker = lockers[i % lockers.len()].clone();
        let room = Arc::clone(&room);
        tasks.push(tokio::spawn(async move {
            let key = locker.key("items", "sku-1").unwrap();
            let writer = i % 5 == 0;
            let acquire = locker.acquire(key);
            let guard = match (locked, writer) {
                (false, _) => None,
                (true, true) => Some(acquire.exclusive().unwrap().await.unwrap()),
                (true, false) => Some(acquire.shared().unwrap().await.unwrap()),
            };
            match writer {
                true => room.write(Duration::from_millis(30)).await,
                false => room.read(Duration::from_millis(30)).await,
            }
            if let Some(guard) = guard {
                guard.release().await.unwrap();
            }
        }));
        tokio::time::sleep(Duration::from_millis(3)).await;
    }
    for task in tasks {
        task.await.unwrap();
    }
    room
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readers_share_and_a_writer_is_alone() {
    let server = RedisServer::start();
    let lockers = processes(&server, 3).await;
    let room = mixed_load(&lockers, true).await;
    room.assert_writers_were_alone();
    room.assert_readers_shared();
    assert!(server.lock_keys().await.is_empty(), "keys left behind");
    // The negative control: the same load unlocked puts a writer with others.
    let room = mixed_load(&lockers, false).await;
    assert!(
        room.broken.load(Ordering::SeqCst),
        "the load never broke exclusion"
    );
}

/// Readers keep coming from two processes, so that at any moment one reads; a writer that
/// asks meanwhile gets in while they still come, rather than after the stream ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writer_is_not_starved_by_a_stream_of_readers() {
    let server = RedisServer::start();
    let lockers = processes(&server, 3).await;
    let key = lockers[0].key("items", "sku-1").unwrap();
    let stream_until = Instant::now() + Duration::from_secs(3);
    let room = Arc::new(Room::default());
    let mut readers = Vec::new();
    for locker in &lockers[..2] {
        let (locker, key, room) = (locker.clone(), key.clone(), Arc::clone(&room));
        readers.push(tokio::spawn(async move {
            let mut tasks = Vec::new();
            while Instant::now() < stream_until {
                let (locker, key, room) = (locker.clone(), key.clone(), Arc::clone(&room));
                tasks.push(tokio::spawn(async move {
                    let guard = locker.acquire(key).shared().unwrap().await.unwrap();
                    room.read(Duration::from_millis(120)).await;
                    guard.release().await.unwrap();
                }));
                tokio::time::sleep(Duration::from_millis(40)).await;
            }
            for task in tasks {
                task.await.unwrap();
            }
        }));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let guard = lockers[2].acquire(key).exclusive().unwrap().await.unwrap();
    let got_in = Instant::now();
    room.write(Duration::from_millis(20)).await;
    guard.release().await.unwrap();
    assert!(
        got_in + Duration::from_millis(500) < stream_until,
        "the writer waited for the readers to stop"
    );
    for task in readers {
        task.await.unwrap();
    }
    room.assert_writers_were_alone();
    assert!(server.lock_keys().await.is_empty(), "keys left behind");
}

/// A reader that comes after a queued writer waits for it, though it would fit beside the
/// reader that holds the key now.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readers_behind_a_queued_writer_wait_for_it() {
    let server = RedisServer::start();
    let lockers = processes(&server, 3).await;
    let key = lockers[0].key("items", "sku-1").unwrap();
    let first = lockers[0]
        .acquire(key.clone())
        .shared()
        .unwrap()
        .await
        .unwrap();
    let order = Arc::new(Mutex::new(Vec::new()));
    let writer = tokio::spawn({
        let (locker, key, order) = (lockers[1].clone(), key.clone(), Arc::clone(&order));
        async move {
            let guard = locker.acquire(key).exclusive().unwrap().await.unwrap();
            order.lock().unwrap().push("writer");
            tokio::time::sleep(Duration::from_millis(50)).await;
            order.lock().unwrap().push("writer done");
            guard.release().await.unwrap();
        }
    });
    support::wait_until_queued(&server, key.as_bytes(), 1, "the writer").await;
    let reader = tokio::spawn({
        let (locker, key, order) = (lockers[2].clone(), key.clone(), Arc::clone(&order));
        async move {
            let guard = locker.acquire(key).shared().unwrap().await.unwrap();
            order.lock().unwrap().push("reader");
            guard.release().await.unwrap();
        }
    });
    tokio::time::sleep(Duration::from_millis(150)).await;
    assert!(
        order.lock().unwrap().is_empty(),
        "{:?}",
        order.lock().unwrap()
    );
    first.release().await.unwrap();
    writer.await.unwrap();
    reader.await.unwrap();
    assert_eq!(*order.lock().unwrap(), ["writer", "writer done", "reader"]);
}

/// Sets over overlapping keys, some shared and some exclusive, taken at once from two
/// processes: every one is served (no cycle of waits), and no writer of a key has company.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn key_sets_mix_shared_and_exclusive_without_deadlock() {
    let server = RedisServer::start();
    let lockers = processes(&server, 2).await;
    let rooms: Arc<Vec<Room>> = Arc::new((0..3).map(|_| Room::default()).collect());
    let names = ["a", "b", "c"];
    let sets: [&[usize]; 4] = [&[0, 1], &[1, 2], &[2, 0], &[0, 1, 2]];
    let mut tasks = Vec::new();
    for i in 0..24 {
        let locker = lockers[i % 2].clone();
        let rooms = Arc::clone(&rooms);
        let members = sets[i % 4];
        tasks.push(tokio::spawn(async move {
            let keys = KeySet::new(
                members
                    .iter()
                    .map(|&m| locker.key("items", names[m]).unwrap()),
            );
            let writer = i % 3 == 0;
            let acquire = locker.acquire(keys);
            let guard = match writer {
                true => acquire.exclusive().unwrap().await.unwrap(),
                false => acquire.shared().unwrap().await.unwrap(),
            };
            let work = Duration::from_millis(15);
            let visits = members.iter().map(|&m| {
                let rooms = Arc::clone(&rooms);
                async move {
                    match writer {
                        true => rooms[m].write(work).await,
                        false => rooms[m].read(work).await,
                    }
                }
            });
            futures_util::future::join_all(visits).await;
            guard.release().await.unwrap();
        }));
    }
    for task in tasks {
        tokio::time::timeout(Duration::from_secs(60), task)
            .await
            .expect("a cycle of waits")
            .unwrap();
    }
    for room in rooms.iter() {
        room.assert_writers_were_alone();
    }
    assert!(server.lock_keys().await.is_empty(), "keys left behind");
}

/// The layer takes `GET`s shared and anything else exclusive, on one key per route whatever
/// the method: two reads run together, a write alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_layer_takes_reads_shared_and_writes_exclusive() {
    let server = RedisServer::start();
    let store = RedisStore::connect(server.url()).await.unwrap();
    handoff_subscriptions(&server, 1).await;
    let room = Arc::new(Room::default());
    let layer = LockLayer::new(store, Key::path_param("sku"))
        .shared_when(|parts| parts.method == Method::GET)
        .unwrap();
    let handler = |room: Arc<Room>, writer: bool| async move {
        match writer {
            true => room.write(Duration::from_millis(80)).await,
            false => room.read(Duration::from_millis(80)).await,
        }
        "ok"
    };
    let app = Router::new()
        .route(
            "/items/{sku}",
            get({
                let room = Arc::clone(&room);
                move || handler(room, false)
            })
            .post({
                let room = Arc::clone(&room);
                move || handler(room, true)
            }),
        )
        .route_layer(layer);
    let request = |method: Method| {
        Request::builder()
            .method(method)
            .uri("/items/sku-1")
            .body(Body::empty())
            .unwrap()
    };
    let mut tasks = Vec::new();
    for i in 0..8 {
        let app = app.clone();
        let method = if i % 4 == 3 {
            Method::POST
        } else {
            Method::GET
        };
        tasks.push(tokio::spawn(async move {
            send(&app, request(method)).await.status()
        }));
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    for task in tasks {
        assert_eq!(task.await.unwrap(), StatusCode::OK);
    }
    room.assert_writers_were_alone();
    room.assert_readers_shared();
}

/// Every user of a key takes it the same way: taken plain while a lease with a share holds it,
/// or with a share while a plain lease holds it, alone or in a set, the acquire is an error
/// naming the mistake (`StoreErrorKind::Misused`: a 500 from the layer), never a wait for a lease that cannot come nor a
/// second holder. Once the first lease is gone, the key may be taken the other way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_taken_both_ways_is_an_error() {
    let server = RedisServer::start();
    let lockers = processes(&server, 2).await;
    let key = lockers[0].key("items", "k").unwrap();
    let other = lockers[0].key("items", "j").unwrap();
    let chain = |error: &dyn std::error::Error| {
        let mut text = error.to_string();
        let mut source = error.source();
        while let Some(s) = source {
            text = format!("{text}: {s}");
            source = s.source();
        }
        text
    };
    let reader = lockers[0]
        .acquire(key.clone())
        .shared()
        .unwrap()
        .await
        .unwrap();
    for keys in [
        KeySet::from(key.clone()),
        KeySet::from([key.clone(), other.clone()]),
    ] {
        let error = lockers[1]
            .acquire(keys)
            .wait(Wait::none())
            .await
            .expect_err("taken plain beside a reader");
        let text = chain(&error);
        assert!(text.contains("WRONGTYPE"), "{text}");
        assert_eq!(error.status(), StatusCode::INTERNAL_SERVER_ERROR, "{text}");
    }
    reader.release().await.unwrap();
    let plain = lockers[0].acquire(key.clone()).await.unwrap();
    for keys in [
        KeySet::from(key.clone()),
        KeySet::from([key.clone(), other.clone()]),
    ] {
        let started = Instant::now();
        let error = lockers[1]
            .acquire(keys)
            .shared()
            .unwrap()
            .await
            .expect_err("taken shared beside a plain lease");
        let text = chain(&error);
        assert!(text.contains("same way"), "{text}");
        let tower_lock::LockError::Store(store) = &error else {
            panic!("{text}")
        };
        assert_eq!(store.kind(), tower_lock::store::StoreErrorKind::Misused);
        // Alone or in a set, the store's error says what Redis refused in the same words.
        assert!(
            text.contains("Redis refused the lock operation: WRONGTYPE tower-lock:"),
            "{text}"
        );
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "waited {:?} for a lease that cannot come",
            started.elapsed()
        );
    }
    plain.release().await.unwrap();
    let reader = lockers[1]
        .acquire(key.clone())
        .shared()
        .unwrap()
        .await
        .unwrap();
    reader.release().await.unwrap();
    assert!(server.lock_keys().await.is_empty(), "keys left behind");
}
