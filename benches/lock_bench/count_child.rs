//! The program scenario h counts (`lock_bench --count-child <case> <redis url> <cycles>
//! <count allocations: 0 or 1>`), run by the benchmark as it is, under `strace` and under
//! valgrind: one case on a current-thread runtime, and nothing else.
//!
//! - HTTP cases (`hello`, `baseline`, `baseline-scripts`, `layer`): serves scenario a's app
//!   (`http::http_app`) on a free loopback port, prints `listening on <port>`, and serves until
//!   a `POST /stop` (the benchmark sends its requests on one keep-alive connection, then that).
//! - Cycle cases (`locker`, `rslock`, and `locker-16`, `rslock-16` with 16 tasks): connects, then
//!   runs `<cycles>` acquire + release cycles on keys of their own, split over the tasks.
//!
//! It ends by printing `counted <allocations> <bytes>`: the heap allocations it made and the
//! bytes they asked for, from its start to its end (zero unless counting was asked for, so that
//! the allocator's counters add nothing to the instructions counted under valgrind).

use std::{
    io::Write as _,
    sync::{Arc, atomic::AtomicU64, atomic::Ordering},
    time::Duration,
};

use axum::routing::post;
use tokio::sync::Notify;
use tower_lock::{Locker, RedisStore};

use crate::{
    alloc::{COUNTING, allocations},
    common::TTL_MS,
    counts::Case,
    http::{self, Variant},
};

pub(crate) fn child_main(args: &[String]) {
    let [case, url, cycles, count_allocations] = args else {
        panic!("--count-child takes 4 arguments, got {args:?}");
    };
    let case = Case::from_short(case).unwrap_or_else(|| panic!("unknown case {case:?}"));
    let cycles: u64 = cycles.parse().expect("cycles");
    if count_allocations == "1" {
        COUNTING.store(true, Ordering::SeqCst);
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    rt.block_on(async {
        match case {
            Case::Http(variant) => serve(variant, url).await,
            Case::Cycles { rslock, tasks } => run_cycles(rslock, tasks, url, cycles).await,
        }
    });
    let (allocated, bytes) = allocations();
    println!("counted {allocated} {bytes}");
    rt.shutdown_timeout(Duration::from_secs(1));
}

async fn serve(variant: Variant, url: &str) {
    let stop = Arc::new(Notify::new());
    let app = http::http_app(variant, url, Arc::new(AtomicU64::new(0)))
        .await
        .route(
            "/stop",
            post({
                let stop = Arc::clone(&stop);
                move || async move {
                    stop.notify_one();
                    "stopping"
                }
            }),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind a loopback port");
    let port = listener.local_addr().expect("local addr").port();
    println!("listening on {port}");
    std::io::stdout().flush().expect("stdout");
    axum::serve(listener, app)
        .with_graceful_shutdown(async move { stop.notified().await })
        .await
        .expect("serve");
}

/// `cycles` acquire + release cycles, split over `tasks` tasks, each on keys of its own.
async fn run_cycles(rslock: bool, tasks: usize, url: &str, cycles: u64) {
    let per_task = cycles / tasks as u64;
    assert_eq!(per_task * tasks as u64, cycles, "cycles split evenly");
    let handles: Vec<_> = if rslock {
        let manager = rslock::LockManager::new(vec![url.to_owned()]);
        (0..tasks)
            .map(|task| {
                let manager = manager.clone();
                tokio::spawn(async move {
                    for n in 0..per_task {
                        let resource = format!("rslock-count:{task:02}-{n:06}");
                        let lock = manager
                            .lock(resource.as_bytes(), Duration::from_millis(TTL_MS))
                            .await
                            .expect("uncontended rslock lock");
                        manager.unlock(&lock).await;
                    }
                })
            })
            .collect()
    } else {
        let store = RedisStore::connect(url).await.expect("RedisStore::connect");
        let locker = Locker::new(store);
        (0..tasks)
            .map(|task| {
                let locker = locker.clone();
                tokio::spawn(async move {
                    for n in 0..per_task {
                        let key = locker
                            .key("bench-count", format!("{task:02}-{n:06}"))
                            .expect("key");
                        let guard = locker.acquire(key).await.expect("uncontended acquire");
                        guard.release().await.expect("release");
                    }
                })
            })
            .collect()
    };
    for handle in handles {
        handle.await.expect("cycle task panicked");
    }
}
