//! Group commit on a real `redis-server`: operations that reach one store together go in one
//! script call, and each still gets its own answer (acquired, held by another, refused by
//! Redis), fencing tokens keep increasing across calls, and exclusion holds (with its negative
//! control) while requests share calls.

use std::{
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use futures_util::future::join_all;
use tower_lock::{LockConfig, LockError, Locker, RedisStore, Wait};
use tower_lock_testkit::{RedisServer, calls_of};

fn no_wait() -> LockConfig {
    LockConfig::builder()
        .ttl(Duration::from_secs(30))
        .wait(Wait::none())
        .build()
        .unwrap()
}

fn waiting() -> LockConfig {
    LockConfig::builder()
        .ttl(Duration::from_secs(30))
        .wait(
            Wait::exponential(Duration::from_millis(1), Duration::from_millis(10))
                .unwrap()
                .deadline(Duration::from_secs(20)),
        )
        .build()
        .unwrap()
}

/// A locker on `server` (no waiting) that has taken and released one key, so that its script
/// is loaded and its hand-off subscription is up.
async fn warmed_up(server: &RedisServer) -> Locker {
    let locker = Locker::with_config(RedisStore::connect(server.url()).await.unwrap(), no_wait());
    let warm = locker
        .acquire(locker.key("batch", "warm").unwrap())
        .await
        .unwrap();
    warm.release().await.unwrap();
    locker
}

/// Twenty acquires fired together, five of them on keys another holder has: the fifteen free
/// keys are acquired and the five answer contended, each for itself, in fewer script calls than
/// keys (they shared calls).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_operation_of_a_batch_gets_its_own_answer() {
    let server = RedisServer::start();
    let other = Locker::with_config(RedisStore::connect(server.url()).await.unwrap(), no_wait());
    let mut held = Vec::new();
    for i in 0..5 {
        held.push(
            other
                .acquire(other.key("batch", format!("k{i}")).unwrap())
                .await
                .unwrap(),
        );
    }
    let locker = warmed_up(&server).await;
    let before = calls_of(&server, "evalsha").await;
    // Redis holds scripts for a moment, so that the first call is still in flight when the
    // others are polled, unless this process stalls for longer than the pause: they queue
    // behind it.
    server.cli(&["CLIENT", "PAUSE", "200", "WRITE"]);
    let answers = join_all((0..20).map(|i| {
        locker
            .acquire(locker.key("batch", format!("k{i}")).unwrap())
            .into_future()
    }))
    .await;
    let scripts = calls_of(&server, "evalsha").await - before;
    for (i, answer) in answers.iter().enumerate() {
        match answer {
            Ok(_) => assert!(i >= 5, "k{i} is held by another, yet acquired"),
            Err(LockError::Contended { .. }) => assert!(i < 5, "k{i} is free, yet contended"),
            Err(other) => panic!("k{i}: {other:?}"),
        }
    }
    assert!(
        scripts < 10,
        "{scripts} script calls for 20 acquires: not batched"
    );
    for answer in answers.into_iter().flatten() {
        answer.release().await.unwrap();
    }
    for guard in held {
        guard.release().await.unwrap();
    }
}

/// A key Redis refuses to lock (it holds a list) fails alone: the acquires in the same call on
/// good keys succeed, and the error says what Redis said, not the token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operation_redis_refuses_fails_alone() {
    let server = RedisServer::start();
    let locker = warmed_up(&server).await;
    let bad = locker.key("batch", "bad").unwrap();
    let mut conn = server.client().await;
    let _: () = redis::cmd("RPUSH")
        .arg(bad.as_bytes())
        .arg("not a lock")
        .query_async(&mut conn)
        .await
        .unwrap();
    for round in 0..3 {
        let mut keys: Vec<_> = (0..10)
            .map(|i| locker.key("batch", format!("good-{round}-{i}")).unwrap())
            .collect();
        keys.insert(5, bad.clone());
        let answers = join_all(
            keys.into_iter()
                .map(|key| locker.acquire(key).into_future()),
        )
        .await;
        for (i, answer) in answers.into_iter().enumerate() {
            if i == 5 {
                let error = answer.expect_err("a list is not a lock");
                let text = format!("{error:?} {}", tower_lock_error_chain(&error));
                assert!(matches!(error, LockError::Store(_)), "{text}");
                assert!(text.contains("WRONGTYPE"), "{text}");
            } else {
                let guard = answer.unwrap_or_else(|e| panic!("good key {i}: {e:?}"));
                guard.release().await.unwrap();
            }
        }
    }
}

fn tower_lock_error_chain(error: &dyn std::error::Error) -> String {
    let mut out = error.to_string();
    let mut source = error.source();
    while let Some(e) = source {
        out.push_str(": ");
        out.push_str(&e.to_string());
        source = e.source();
    }
    out
}

/// Many holders of one key, through three stores (three "instances") whose calls carry other
/// keys' operations too: the fencing tokens, in the order the holders held the key, strictly
/// increase.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fencing_tokens_increase_across_batches() {
    let server = RedisServer::start();
    let mut lockers = Vec::new();
    for _ in 0..3 {
        lockers.push(Locker::with_config(
            RedisStore::connect(server.url()).await.unwrap(),
            waiting(),
        ));
    }
    let order = Arc::new(tokio::sync::Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for t in 0..12 {
        let locker = lockers[t % 3].clone();
        let order = Arc::clone(&order);
        tasks.push(tokio::spawn(async move {
            for n in 0..15 {
                // Traffic on keys of their own, so that calls carry several operations.
                let own = locker.acquire(locker.key("noise", format!("{t}-{n}")).unwrap());
                let hot = locker.acquire(locker.key("hot", "one").unwrap());
                let (own, hot) = tokio::join!(own, hot);
                let hot = hot.unwrap();
                order.lock().await.push(hot.fencing_token());
                hot.release().await.unwrap();
                own.unwrap().release().await.unwrap();
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    let tokens = order.lock().await;
    assert_eq!(tokens.len(), 12 * 15);
    for pair in tokens.windows(2) {
        assert!(pair[0] < pair[1], "fencing tokens out of order: {pair:?}");
    }
}

/// Exclusion while requests share calls: 40 workers on 4 hot keys, through two stores, each doing
/// a non-atomic read-modify-write under the lease, lose no update; the server ran fewer script
/// calls than lock operations. The same load without the lock loses updates.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exclusion_holds_while_requests_share_calls() {
    let server = RedisServer::start();
    let stores = [
        RedisStore::connect(server.url()).await.unwrap(),
        RedisStore::connect(server.url()).await.unwrap(),
    ];
    let lockers: Vec<Locker> = stores
        .iter()
        .map(|s| Locker::with_config(s.clone(), waiting()))
        .collect();
    let counters: Arc<Vec<AtomicU64>> = Arc::new((0..4).map(|_| AtomicU64::new(0)).collect());
    let rounds = 25u64;
    let run = |locked: bool| {
        let counters = Arc::clone(&counters);
        let lockers = lockers.clone();
        async move {
            let tasks: Vec<_> = (0..40)
                .map(|w| {
                    let counters = Arc::clone(&counters);
                    let locker = lockers[w % 2].clone();
                    tokio::spawn(async move {
                        for _ in 0..rounds {
                            let k = w % 4;
                            let guard = if locked {
                                Some(
                                    locker
                                        .acquire(locker.key("rmw", k.to_string()).unwrap())
                                        .await
                                        .unwrap(),
                                )
                            } else {
                                None
                            };
                            let read = counters[k].load(Ordering::SeqCst);
                            tokio::time::sleep(Duration::from_micros(200)).await;
                            counters[k].store(read + 1, Ordering::SeqCst);
                            if let Some(guard) = guard {
                                guard.release().await.unwrap();
                            }
                        }
                    })
                })
                .collect();
            for task in tasks {
                task.await.unwrap();
            }
        }
    };
    let before = calls_of(&server, "evalsha").await;
    run(true).await;
    let scripts = calls_of(&server, "evalsha").await - before;
    let total: u64 = counters.iter().map(|c| c.load(Ordering::SeqCst)).sum();
    assert_eq!(total, 40 * rounds, "lost updates under the lock");
    // Two operations (acquire, release) per locked update, at least; fewer calls than that.
    assert!(
        scripts < 2 * 40 * rounds,
        "{scripts} script calls for {} operations: no call was shared",
        2 * 40 * rounds
    );
    // Negative control: the same load without the lock loses updates.
    for c in counters.iter() {
        c.store(0, Ordering::SeqCst);
    }
    run(false).await;
    let total: u64 = counters.iter().map(|c| c.load(Ordering::SeqCst)).sum();
    assert!(
        total < 40 * rounds,
        "no update lost without the lock: the test cannot fail"
    );
}
