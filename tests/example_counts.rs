//! The examples' leases with counts, run as real processes on real Redis: `payments` limits
//! each account's concurrent charges across instances (`PROVIDER_CONCURRENCY`; `GET /payments`
//! shows when each charge ran, so the limit is checked from outside), with 429 and
//! `Retry-After` past `PROVIDER_WAIT_MS`.

use crate::instances;

use std::time::Duration;

use instances::{Instance, example_binary};
use tower_lock_testkit::{
    RedisServer,
    http::{Http, Reply},
};

fn payments(server: &RedisServer, env: &[(&str, &str)]) -> Instance {
    Instance::start_binary(example_binary("payments"), &server.url(), env)
}

/// `POST {path}` to the instance on `port`: a charge of 100 EUR to `account`, under
/// `idempotency_key` (a JSON string, quotes included).
async fn charge(port: u16, path: &str, idempotency_key: &str, account: &str) -> Reply {
    Http::new(port)
        .request_with(
            "POST",
            path,
            Some(r#"{"amount": 100, "currency": "EUR"}"#),
            &[("idempotency-key", idempotency_key), ("x-account", account)],
        )
        .await
        .unwrap()
}

/// 12 charges of one account, 250 ms each, sent at once to two instances; the most charges
/// `GET /payments` shows running at once, and the statuses.
async fn charges_at_once(ports: [u16; 2]) -> (usize, Vec<u16>) {
    let mut tasks = Vec::new();
    for i in 0..12 {
        let port = ports[i % 2];
        tasks.push(tokio::spawn(async move {
            let key = format!("\"charge-{i:04}-{:016x}\"", fastrand::u64(..));
            charge(port, "/payments?work_ms=250", &key, "acct-1")
                .await
                .status
        }));
    }
    let mut statuses = Vec::new();
    for task in tasks {
        statuses.push(task.await.unwrap());
    }
    let list = Http::new(ports[0])
        .request("GET", "/payments", None)
        .await
        .unwrap()
        .json();
    let spans: Vec<(u64, u64)> = list["payments"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            let (start, end) = (&p["started_at_ms"], &p["finished_at_ms"]);
            (start.as_u64().unwrap(), end.as_u64().unwrap())
        })
        .collect();
    // The most intervals that hold one instant: checked at every start.
    let most = spans
        .iter()
        .map(|&(at, _)| spans.iter().filter(|&&(s, e)| s <= at && at < e).count())
        .max()
        .unwrap_or(0);
    (most, statuses)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn payments_run_at_most_the_providers_concurrency_per_account_across_instances() {
    let server = RedisServer::start();
    let env = [("PROVIDER_CONCURRENCY", "2"), ("PROVIDER_WAIT_MS", "20000")];
    let (a, b) = (payments(&server, &env), payments(&server, &env));
    let (most, statuses) = charges_at_once([a.port, b.port]).await;
    assert!(statuses.iter().all(|&s| s == 201), "{statuses:?}");
    assert!(most <= 2, "{most} charges of one account at once");
    assert_eq!(most, 2, "the limit was never reached: {most}");
    a.assert_no_panic();
    b.assert_no_panic();
    drop((a, b));
    // The negative control: without the limit, the same load runs more at once.
    redis_flush(&server).await;
    let env = [("PROVIDER_CONCURRENCY", "0")];
    let (a, b) = (payments(&server, &env), payments(&server, &env));
    let (most, statuses) = charges_at_once([a.port, b.port]).await;
    assert!(statuses.iter().all(|&s| s == 201), "{statuses:?}");
    assert!(most > 2, "the load never exceeded the limit: {most}");
}

async fn redis_flush(server: &RedisServer) {
    let mut conn = server.client().await;
    let () = redis::cmd("FLUSHALL").query_async(&mut conn).await.unwrap();
}

/// A charge that finds no permit within `PROVIDER_WAIT_MS` answers 429 with `Retry-After` and
/// a problem body.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn payments_answer_429_when_no_permit_frees_in_time() {
    let server = RedisServer::start();
    let env = [("PROVIDER_CONCURRENCY", "1"), ("PROVIDER_WAIT_MS", "200")];
    let instance = payments(&server, &env);
    let port = instance.port;
    let long = tokio::spawn(async move {
        charge(
            port,
            "/payments?work_ms=1500",
            "\"long-charge-0000001\"",
            "acct-1",
        )
        .await
        .status
    });
    tokio::time::sleep(Duration::from_millis(400)).await;
    let refused = charge(port, "/payments", "\"second-charge-00001\"", "acct-1").await;
    assert_eq!(
        refused.status,
        429,
        "{}",
        String::from_utf8_lossy(&refused.body)
    );
    let retry: u64 = refused.header("retry-after").unwrap().parse().unwrap();
    assert!(retry >= 1);
    assert_eq!(
        refused.header("content-type"),
        Some("application/problem+json")
    );
    assert!(
        refused.json()["type"]
            .as_str()
            .unwrap()
            .ends_with("#permits-exhausted")
    );
    // Another account is not limited by acct-1's charges.
    let other = charge(port, "/payments", "\"other-charge-000001\"", "acct-2").await;
    assert_eq!(other.status, 201);
    assert_eq!(long.await.unwrap(), 201);
    instance.assert_no_panic();
}
