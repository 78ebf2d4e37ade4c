//! Load + exclusion across real processes: three instances of `examples/inventory.rs` sharing
//! one `redis-server`, a bounded concurrent load of purchases (a few hot SKUs, many cold ones),
//! each a non-atomic read-modify-write. Then the books are checked.
//!
//! `TOWER_LOCK_LOAD_SCALE=N` multiplies the number of requests (the figures in
//! `docs/RELIABILITY.md` come from `TOWER_LOCK_LOAD_SCALE=20`); add `-- --nocapture` to see
//! the counts.

use crate::instances;
use crate::support;

use std::time::{Duration, Instant};

use instances::{Counts, Instance, Plan, audit, run_load, scale};
use support::LockKeys;
use tower_lock_testkit::RedisServer;

/// Default requests per run, before scaling.
const REQUESTS: usize = 1_500;
const WAIT_MS: u64 = 2_000;

fn plan(prefix: &str) -> Plan {
    let requests = REQUESTS * scale();
    // Hot SKUs run out partway through (so 422s happen under contention and overselling would
    // show); cold ones hold 1..=3 items.
    Plan::new(prefix, requests, (requests / 6) as u64, 200)
}

fn start_three(redis: &RedisServer, lock: &str) -> Vec<Instance> {
    let wait = WAIT_MS.to_string();
    (0..3)
        .map(|_| {
            Instance::start(
                &redis.url(),
                &[
                    ("LOCK", lock),
                    ("LOCK_WAIT_MS", &wait),
                    ("LOCK_TTL_MS", "5000"),
                ],
            )
        })
        .collect()
}

/// Three instances with `LOCK=lock` on `redis`, their ports, and a plan (named `lock`) whose
/// stock is seeded.
async fn seeded_three(redis: &RedisServer, lock: &str) -> (Vec<Instance>, Vec<u16>, Plan) {
    let apps = start_three(redis, lock);
    let ports: Vec<u16> = apps.iter().map(|a| a.port).collect();
    let plan = plan(lock);
    plan.seed(ports[0]).await;
    (apps, ports, plan)
}

/// Zero lost updates, no oversell, fencing tokens order every successful write, every status
/// in {200, 409, 422, 503} and every request answered within the wait deadline plus a margin.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_instances_no_lost_updates() {
    let redis = RedisServer::start();
    let (apps, ports, plan) = seeded_three(&redis, "on").await;

    let started = Instant::now();
    let outcomes = run_load(&plan, &ports, None).await;
    let took = started.elapsed();
    let counts = Counts::of(&outcomes);
    let audit = audit(&plan, &outcomes, ports[0], true).await;
    println!(
        "load with the lock: {} requests in {took:.1?} ({:.0} req/s) over 3 instances, {} \
         concurrent clients: 200={} 409={} 422={} 503={} no answer={}, max latency {:.0?}; \
         lost updates {}, oversold SKUs {}, fencing violations {}",
        counts.requests,
        counts.requests as f64 / took.as_secs_f64(),
        plan.concurrency,
        counts.get(200),
        counts.get(409),
        counts.get(422),
        counts.get(503),
        counts.no_answer,
        counts.max_latency,
        audit.lost_updates,
        audit.oversold.len(),
        audit.fencing_violations.len(),
    );

    assert_eq!(
        counts.requests, plan.requests,
        "every request is accounted for"
    );
    assert_eq!(
        counts.no_answer, 0,
        "requests without an answer: {counts:?}"
    );
    let known: usize = [200, 409, 422, 503].iter().map(|&s| counts.get(s)).sum();
    assert_eq!(known, counts.requests, "unexpected statuses: {counts:?}");
    assert_eq!(audit.lost_updates, 0, "lost updates under the lock");
    assert!(audit.oversold.is_empty(), "oversold: {:?}", audit.oversold);
    assert!(
        audit.fencing_violations.is_empty(),
        "fencing tokens do not order the writes: {:?}",
        &audit.fencing_violations[..audit.fencing_violations.len().min(10)]
    );
    // The load did contend and did run out of stock, or the checks above were vacuous.
    assert!(counts.get(200) > plan.requests / 4, "{counts:?}");
    assert!(counts.get(422) > 0, "no SKU ran out: {counts:?}");
    // Each request: at most the wait deadline, one store timeout (1 s) and the handler.
    assert!(
        counts.max_latency < Duration::from_millis(WAIT_MS + 2_500),
        "a request took {:?}",
        counts.max_latency
    );
    assert!(redis.lock_keys().await.is_empty(), "leases left behind");
    for app in &apps {
        app.assert_no_panic();
    }
}

/// The negative control: the same load with `LOCK=off` loses updates, so the test above can
/// fail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_lock_the_same_load_loses_updates() {
    let redis = RedisServer::start();
    let (apps, ports, plan) = seeded_three(&redis, "off").await;
    let outcomes = run_load(&plan, &ports, None).await;
    let counts = Counts::of(&outcomes);
    let audit = audit(&plan, &outcomes, ports[0], false).await;
    println!(
        "load without the lock: {} requests: 200={} 422={}; lost updates {}, oversold SKUs {:?}",
        counts.requests,
        counts.get(200),
        counts.get(422),
        audit.lost_updates,
        audit.oversold,
    );
    assert_eq!(counts.no_answer, 0, "{counts:?}");
    assert!(
        audit.lost_updates > 0,
        "no update lost without the lock: the load does not race"
    );
    for app in &apps {
        app.assert_no_panic();
    }
}
