//! `POST /orders` of `examples/inventory.rs`, on real processes: orders of several SKUs and
//! single purchases, sent to separately started instances that share the lock store and the
//! stock, on every topology the example runs on (in memory, one Redis, Redlock, Redis Cluster);
//! and reads (`GET /items/{sku}?work_ms=N`), which share a SKU with each other and never with
//! a purchase, first come first served.
//!
//! Every sale is a deliberately non-atomic read-modify-write, so the books show whether two
//! holders of one SKU overlapped: each SKU's 200s, taken in fencing-token order, must each leave
//! exactly the stock before them minus their quantity, and the final stock must be the initial
//! stock minus every 200's quantity. `LOCK=off` is the negative control.

use crate::instances;

use std::{
    collections::BTreeMap,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use instances::{Instance, get_stock, set_stock};
use tower_lock_testkit::{RedisServer, http::Http};

/// Where the instances keep their locks and their stock.
enum Topology {
    /// One process (`MemoryStore`): one instance only.
    Memory,
    Redis(RedisServer),
    /// Three independent masters.
    Redlock(Vec<RedisServer>),
    #[cfg(feature = "cluster")]
    Cluster(tower_lock_testkit::RedisCluster),
}

impl Topology {
    fn redis() -> Self {
        Self::Redis(RedisServer::start())
    }

    fn redlock() -> Self {
        Self::Redlock((0..3).map(|_| RedisServer::start()).collect())
    }

    #[cfg(feature = "cluster")]
    fn cluster() -> Self {
        Self::Cluster(tower_lock_testkit::RedisCluster::start(3, 0))
    }

    fn name(&self) -> &'static str {
        match self {
            Self::Memory => "memory",
            Self::Redis(_) => "redis",
            Self::Redlock(_) => "redlock",
            #[cfg(feature = "cluster")]
            Self::Cluster(_) => "cluster",
        }
    }

    /// `n` instances, or the one an in-memory store allows.
    fn count(&self, n: usize) -> usize {
        match self {
            Self::Memory => 1,
            _ => n,
        }
    }

    /// Starts an instance on this topology, with `env` on top.
    fn start(&self, env: &[(&str, &str)]) -> Instance {
        let join = |urls: Vec<String>| urls.join(",");
        let mut all: Vec<(String, String)> = match self {
            Self::Memory => vec![],
            Self::Redis(server) => vec![("REDIS_URL".into(), server.url())],
            Self::Redlock(nodes) => vec![
                ("LOCK_STORE".into(), "redlock".into()),
                (
                    "REDIS_URLS".into(),
                    join(nodes.iter().map(RedisServer::url).collect()),
                ),
            ],
            #[cfg(feature = "cluster")]
            Self::Cluster(cluster) => vec![
                ("LOCK_STORE".into(), "cluster".into()),
                ("REDIS_URLS".into(), join(cluster.urls())),
            ],
        };
        all.extend(env.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())));
        let all: Vec<(&str, &str)> = all.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        Instance::start_env(&all)
    }

    /// `n` instances (one in memory), each with `env`.
    fn start_many(&self, n: usize, env: &[(&str, &str)]) -> Vec<Instance> {
        (0..self.count(n)).map(|_| self.start(env)).collect()
    }
}

/// An order's body: `{"items": [{"sku": .., "qty": ..}, ..]}`, lines as given.
fn order_body(lines: &[(String, u64)]) -> String {
    let items: Vec<serde_json::Value> = lines
        .iter()
        .map(|(sku, qty)| serde_json::json!({ "sku": sku, "qty": qty }))
        .collect();
    serde_json::json!({ "items": items }).to_string()
}

fn lines(skus: &[(&str, u64)]) -> Vec<(String, u64)> {
    skus.iter().map(|(s, q)| ((*s).to_owned(), *q)).collect()
}

async fn post_order(http: &mut Http, lines: &[(String, u64)], work_ms: u64) -> Sold {
    let reply = http
        .request(
            "POST",
            &format!("/orders?work_ms={work_ms}"),
            Some(&order_body(lines)),
        )
        .await
        .expect("POST /orders");
    Sold::of(&reply, lines)
}

async fn purchase(http: &mut Http, sku: &str, work_ms: u64) -> Sold {
    let reply = http
        .request(
            "POST",
            &format!("/items/{sku}/purchase?work_ms={work_ms}"),
            None,
        )
        .await
        .expect("POST purchase");
    Sold::of(&reply, &lines(&[(sku, 1)]))
}

/// One order's or purchase's answer, as the books need it.
#[derive(Debug, Clone)]
struct Sold {
    status: u16,
    /// The quantity of each SKU asked for (an order's lines merged).
    asked: BTreeMap<String, u64>,
    /// Per SKU, from a 200: the stock left, and the fencing token (`None` without the lock).
    left: BTreeMap<String, (u64, Option<u64>)>,
    retry_after: Option<String>,
    content_type: Option<String>,
    json: serde_json::Value,
}

impl Sold {
    fn of(reply: &tower_lock_testkit::http::Reply, lines: &[(String, u64)]) -> Self {
        let mut asked = BTreeMap::new();
        for (sku, qty) in lines {
            *asked.entry(sku.clone()).or_default() += qty;
        }
        let json = reply.json();
        let mut left = BTreeMap::new();
        if reply.status == 200 {
            if let Some(items) = json["items"].as_array() {
                for item in items {
                    let sku = item["sku"].as_str().expect("an item's sku").to_owned();
                    let token = json["fencing_tokens"][&sku].as_u64();
                    left.insert(sku, (item["stock"].as_u64().expect("stock"), token));
                }
            } else {
                let sku = json["sku"].as_str().expect("a purchase's sku").to_owned();
                let stock = json["stock"].as_u64().expect("stock");
                left.insert(sku, (stock, json["fencing_token"].as_u64()));
            }
        }
        Self {
            status: reply.status,
            asked,
            left,
            retry_after: reply.header("retry-after").map(str::to_owned),
            content_type: reply.header("content-type").map(str::to_owned),
            json,
        }
    }
}

/// What the books say about a set of sales.
#[derive(Debug, Default)]
struct Books {
    /// Per SKU: how much the 200s sold beyond what the final stock shows (updates lost).
    lost: BTreeMap<String, u64>,
    /// 200s that, in fencing-token order, did not leave the previous stock minus their
    /// quantity (two holders overlapped), or shared a token.
    unfenced: Vec<String>,
}

impl Books {
    fn clean(&self) -> bool {
        self.lost.values().all(|&n| n == 0) && self.unfenced.is_empty()
    }
}

/// Checks each SKU's final stock against its 200s, and, with `fenced`, the 200s in
/// fencing-token order against each other.
async fn audit(initial: &BTreeMap<String, u64>, sales: &[Sold], port: u16, fenced: bool) -> Books {
    let mut books = Books::default();
    for (sku, &start) in initial {
        let mut oks: Vec<(Option<u64>, u64, u64)> = sales
            .iter()
            .filter(|s| s.status == 200)
            .filter_map(|s| {
                let (left, token) = *s.left.get(sku)?;
                Some((token, s.asked[sku], left))
            })
            .collect();
        let sold: u64 = oks.iter().map(|(_, qty, _)| qty).sum();
        let end = get_stock(port, sku).await.expect("a SKU vanished");
        assert!(
            end + sold >= start,
            "{sku}: the stock fell from {start} to {end}, but the 200s sold only {sold}: a \
             refused order changed the stock"
        );
        books
            .lost
            .insert(sku.clone(), (end + sold).saturating_sub(start));
        if fenced {
            oks.sort_by_key(|(token, ..)| *token);
            let mut stock = start;
            let mut last = 0;
            for (token, qty, left) in oks {
                let token = token.unwrap_or(0);
                if token <= last || stock.checked_sub(qty) != Some(left) {
                    books.unfenced.push(format!(
                        "{sku}: token {token} (after {last}) sold {qty} of {stock} and left {left}"
                    ));
                }
                (stock, last) = (left, token);
            }
        }
    }
    books
}

/// The SKUs of the exclusion load, and their stock: `d` runs out partway (so orders are
/// refused with 422 under contention too), the others do not.
fn shop() -> BTreeMap<String, u64> {
    [("a", 10_000), ("b", 10_000), ("c", 10_000), ("d", 40)]
        .into_iter()
        .map(|(s, n)| (s.to_owned(), n))
        .collect()
}

/// One request of the exclusion load.
#[derive(Debug, Clone)]
enum Sale {
    Purchase(String),
    /// The lines as sent: 2 or 3 SKUs in a random order, sometimes one of them twice.
    Order(Vec<(String, u64)>),
}

/// `n` requests from `seed`: a third single purchases, the rest orders.
fn load(n: usize, seed: u64) -> Vec<(Sale, u64)> {
    let mut rng = fastrand::Rng::with_seed(seed);
    let skus: Vec<String> = shop().into_keys().collect();
    (0..n)
        .map(|_| {
            let work_ms = rng.u64(0..4);
            let mut picked = skus.clone();
            rng.shuffle(&mut picked);
            if rng.u8(0..3) == 0 {
                return (Sale::Purchase(picked.swap_remove(0)), work_ms);
            }
            picked.truncate(rng.usize(2..=3));
            let mut lines: Vec<(String, u64)> =
                picked.iter().map(|s| (s.clone(), rng.u64(1..=2))).collect();
            if rng.u8(0..4) == 0 {
                let again = lines[rng.usize(..lines.len())].0.clone();
                lines.push((again, 1));
            }
            (Sale::Order(lines), work_ms)
        })
        .collect()
}

/// Sends `sales` over `ports` (round robin over `clients` connections), all at once.
async fn run_load(ports: &[u16], sales: Vec<(Sale, u64)>, clients: usize) -> Vec<Sold> {
    let sales = Arc::new(sales);
    let next = Arc::new(AtomicUsize::new(0));
    let mut workers = Vec::new();
    for w in 0..clients {
        let (sales, next) = (Arc::clone(&sales), Arc::clone(&next));
        let port = ports[w % ports.len()];
        workers.push(tokio::spawn(async move {
            let mut http = Http::new(port);
            let mut out = Vec::new();
            loop {
                let i = next.fetch_add(1, Ordering::SeqCst);
                let Some((sale, work_ms)) = sales.get(i) else {
                    break;
                };
                let sold = tokio::time::timeout(Duration::from_secs(30), async {
                    match sale {
                        Sale::Purchase(sku) => purchase(&mut http, sku, *work_ms).await,
                        Sale::Order(lines) => post_order(&mut http, lines, *work_ms).await,
                    }
                })
                .await
                .expect("a sale hung for 30 s");
                out.push(sold);
            }
            out
        }));
    }
    let mut sold = Vec::new();
    for worker in workers {
        sold.extend(worker.await.expect("a client panicked"));
    }
    sold
}

/// Requests of the exclusion load.
const SALES: usize = 240;

/// Orders and purchases from separately started instances, at once, with and without the lock:
/// answers what the books say, and the statuses.
async fn exclusion_run(topology: &Topology, lock: &str) -> (Books, BTreeMap<u16, usize>) {
    let instances = topology.start_many(
        3,
        &[
            ("LOCK", lock),
            ("LOCK_WAIT_MS", "20000"),
            ("LOCK_TTL_MS", "5000"),
        ],
    );
    let ports: Vec<u16> = instances.iter().map(|i| i.port).collect();
    let initial = shop();
    for (sku, stock) in &initial {
        set_stock(ports[0], sku, *stock).await;
    }
    let sold = run_load(&ports, load(SALES, 18), 12).await;
    let mut statuses = BTreeMap::new();
    for s in &sold {
        *statuses.entry(s.status).or_default() += 1;
        if s.status == 200 && lock == "off" {
            assert!(
                s.left.values().all(|(_, token)| token.is_none()),
                "a fencing token without the lock: {}",
                s.json
            );
        }
    }
    let books = audit(&initial, &sold, ports[0], lock == "on").await;
    for instance in &instances {
        instance.assert_no_panic();
    }
    (books, statuses)
}

/// With the lock: no update lost on any SKU, every SKU's 200s in fencing-token order each
/// leave the stock before them minus their quantity, every order either sold all its lines or
/// none (422 when `d` ran out), and nothing else but 200 and 422.
async fn exclusion(topology: Topology) {
    let (books, statuses) = exclusion_run(&topology, "on").await;
    let name = topology.name();
    assert!(books.clean(), "{name}: {books:?}");
    assert_eq!(
        statuses.keys().copied().collect::<Vec<_>>(),
        [200, 422],
        "{name}: {statuses:?}"
    );
    assert!(statuses[&200] > SALES / 2, "{name}: {statuses:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn orders_and_purchases_exclude_each_other_in_memory() {
    exclusion(Topology::Memory).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn orders_and_purchases_exclude_each_other_on_redis() {
    exclusion(Topology::redis()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn orders_and_purchases_exclude_each_other_on_redlock() {
    exclusion(Topology::redlock()).await;
}

#[cfg(feature = "cluster")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn orders_and_purchases_exclude_each_other_on_a_cluster() {
    exclusion(Topology::cluster()).await;
}

/// The negative control: the same load with `LOCK=off` loses updates, so the books above can
/// catch an overlap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_lock_orders_and_purchases_lose_updates() {
    let (books, statuses) = exclusion_run(&Topology::redis(), "off").await;
    let lost: u64 = books.lost.values().sum();
    assert!(
        lost > 0,
        "no update lost without the lock: {books:?}, {statuses:?}"
    );
}

/// The answer to an order, and every way an order is refused, changing no stock: 422 when a
/// SKU is short of its quantity (naming it), 404 for an unknown SKU, 400 for a bad body, 413
/// for a body too large; the same SKU twice is one line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_order_sells_every_line_or_none() {
    let topology = Topology::redis();
    let instance = topology.start(&[("LOCK_WAIT_MS", "0")]);
    let port = instance.port;
    let mut http = Http::new(port);
    for (sku, stock) in [("apple", 5), ("pear", 1), ("plum", 7)] {
        set_stock(port, sku, stock).await;
    }
    let unchanged = || async {
        for (sku, stock) in [("apple", 5), ("pear", 1), ("plum", 7)] {
            assert_eq!(get_stock(port, sku).await, Some(stock), "{sku} changed");
        }
    };

    let short = post_order(
        &mut http,
        &lines(&[("apple", 2), ("pear", 2), ("plum", 1)]),
        0,
    )
    .await;
    assert_eq!(short.status, 422, "{}", short.json);
    assert_eq!(
        short.content_type.as_deref(),
        Some("application/problem+json")
    );
    let detail = short.json["detail"].as_str().unwrap();
    assert!(
        detail.contains("`pear`") && !detail.contains("`apple`"),
        "{detail}"
    );
    unchanged().await;

    let unknown = post_order(&mut http, &lines(&[("apple", 1), ("kiwi", 1)]), 0).await;
    assert_eq!(unknown.status, 404, "{}", unknown.json);
    unchanged().await;

    for body in [
        r#"{"items": []}"#,
        r#"{"items": [{"sku": "apple", "qty": 0}]}"#,
        r#"{"items": [{"sku": "apple", "qty": -1}]}"#,
        r#"{"items": [{"sku": "apple"}]}"#,
        r#"{"items": [{"qty": 1}]}"#,
        r#"{"items": [{"sku": 7, "qty": 1}]}"#,
        r#"{"items": [{"sku": "apple", "qty": 1}, {"sku": "pear", "qty": 0}]}"#,
        r#"{}"#,
        r#"not json"#,
        "",
    ] {
        let reply = http.request("POST", "/orders", Some(body)).await.unwrap();
        assert_eq!(reply.status, 400, "{body}: {:?}", reply.json());
        assert_eq!(
            reply.header("content-type"),
            Some("application/problem+json"),
            "{body}"
        );
    }
    let huge = order_body(&lines(&[(&"x".repeat(70 * 1024), 1)]));
    let reply = http.request("POST", "/orders", Some(&huge)).await.unwrap();
    assert_eq!(reply.status, 413, "{:?}", reply.json());
    // The server closes a connection whose request body it did not read.
    http = Http::new(port);
    let reply = http
        .request(
            "POST",
            "/orders?work_ms=99999999",
            Some(&order_body(&lines(&[("apple", 1)]))),
        )
        .await
        .unwrap();
    assert_eq!(reply.status, 400, "{:?}", reply.json());
    unchanged().await;

    // Sold: every line, in the order the body first names them, the two `plum` lines as one.
    let sold = post_order(
        &mut http,
        &lines(&[("plum", 1), ("apple", 2), ("plum", 3), ("pear", 1)]),
        0,
    )
    .await;
    assert_eq!(sold.status, 200, "{}", sold.json);
    let items: Vec<(&str, u64)> = sold.json["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| (i["sku"].as_str().unwrap(), i["stock"].as_u64().unwrap()))
        .collect();
    assert_eq!(items, [("plum", 3), ("apple", 3), ("pear", 0)]);
    let tokens = sold.json["fencing_tokens"].as_object().unwrap();
    let named: Vec<&str> = tokens.keys().map(String::as_str).collect();
    assert_eq!(named, ["apple", "pear", "plum"]);
    assert!(tokens.values().all(|t| t.as_u64().is_some_and(|t| t > 0)));
    for (sku, stock) in [("apple", 3), ("pear", 0), ("plum", 3)] {
        assert_eq!(get_stock(port, sku).await, Some(stock));
    }
    // A purchase of one of its SKUs afterwards takes a later token for it.
    let after = purchase(&mut http, "apple", 0).await;
    assert_eq!(after.status, 200);
    assert!(after.left["apple"].1 > tokens["apple"].as_u64());
    instance.assert_no_panic();
}

/// Two orders naming the same SKUs in opposite orders, sent together from two instances again
/// and again, each holding its locks for 300 ms: both orders answer 200 every round, within
/// about the time the other (and a few purchases) hold, far inside the 10 s wait deadline.
///
/// Where a waiting order keeps what it has (its turns in one process; its place, and the keys
/// before it, in a store's hand-off queue), a third instance sells the middle SKU, `b`, back to
/// back meanwhile. That stream is what makes a deadlock possible: each order finds `b` taken and
/// waits for it, with the SKUs it already has kept for it. Taken in the order each names them,
/// one order would keep `a` and the other `c`, and each, once it has `b`, would wait for what
/// the other keeps (with the sort taken out of `KeySet::new`, rounds run into the 10 s
/// deadline). Taken in lock order, the one every process agrees on, they never wait for each
/// other in a cycle. Where waiting keeps nothing (Redlock, a cluster: an attempt that finds a
/// key held gives back what it took), there is no such cycle to fall into, and no queue to
/// keep a waiter's turn either: a process whose own requests take `b` back to back would keep
/// the orders of other processes waiting (see `docs/DECISIONS.md`, "Sets of keys, and waiting
/// for them"), so there the orders run without the stream.
async fn opposite_orders(topology: Topology) {
    let name = topology.name();
    let queued = matches!(topology, Topology::Memory | Topology::Redis(_));
    let instances = topology.start_many(3, &[("LOCK_WAIT_MS", "10000")]);
    let ports: Vec<u16> = instances.iter().map(|i| i.port).collect();
    let (first, second, third) = (ports[0], ports[1 % ports.len()], ports[2 % ports.len()]);
    for sku in ["a", "b", "c"] {
        set_stock(first, sku, 100_000).await;
    }
    let stop = Arc::new(AtomicBool::new(false));
    let mut stream = Vec::new();
    for _ in 0..if queued { 2 } else { 0 } {
        let stop = Arc::clone(&stop);
        stream.push(tokio::spawn(async move {
            let mut http = Http::new(third);
            let mut sales = Vec::new();
            while !stop.load(Ordering::SeqCst) {
                sales.push(purchase(&mut http, "b", 30).await);
            }
            sales
        }));
    }
    let forth = lines(&[("a", 1), ("b", 1), ("c", 1)]);
    let back = lines(&[("c", 1), ("b", 1), ("a", 1)]);
    let mut sales = Vec::new();
    for round in 0..4 {
        let started = Instant::now();
        let one = tokio::spawn({
            let forth = forth.clone();
            async move { post_order(&mut Http::new(first), &forth, 300).await }
        });
        let two = tokio::spawn({
            let back = back.clone();
            async move { post_order(&mut Http::new(second), &back, 300).await }
        });
        let (one, two) = (one.await.unwrap(), two.await.unwrap());
        let took = started.elapsed();
        assert_eq!(
            (one.status, two.status),
            (200, 200),
            "{name}: round {round}, after {took:?}: {} {}",
            one.json,
            two.json
        );
        assert!(
            took < Duration::from_secs(3),
            "{name}: round {round} took {took:?} for two orders of 300 ms"
        );
        sales.extend([one, two]);
    }
    stop.store(true, Ordering::SeqCst);
    for client in stream {
        let purchases = client.await.unwrap();
        assert!(
            purchases.iter().all(|s| s.status == 200),
            "{name}: a purchase refused"
        );
        sales.extend(purchases);
    }
    let initial = ["a", "b", "c"].map(|s| (s.to_owned(), 100_000)).into();
    let books = audit(&initial, &sales, first, true).await;
    assert!(books.clean(), "{name}: {books:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn orders_in_opposite_orders_never_deadlock_in_memory() {
    opposite_orders(Topology::Memory).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn orders_in_opposite_orders_never_deadlock_on_redis() {
    opposite_orders(Topology::redis()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn orders_in_opposite_orders_never_deadlock_on_redlock() {
    opposite_orders(Topology::redlock()).await;
}

#[cfg(feature = "cluster")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn orders_in_opposite_orders_never_deadlock_on_a_cluster() {
    opposite_orders(Topology::cluster()).await;
}

/// An order holding `a` (and `b`) for 1.5 s: on an instance that does not wait, a purchase of
/// `a` answers 409 with `Retry-After`, and so does an order of `a` and `c`, which keeps none of
/// them (a purchase of `c` right after goes through); on an instance that waits, a purchase of
/// `a` waits for the order, answers after it, and sells from the stock the order left.
async fn an_order_makes_a_purchase_wait(topology: Topology) {
    let name = topology.name();
    let patient = topology.start(&[("LOCK_WAIT_MS", "10000")]);
    let hasty = topology.start(&[("LOCK_WAIT_MS", "0")]);
    for sku in ["a", "b", "c"] {
        set_stock(patient.port, sku, 50).await;
    }
    let mut sales = Vec::new();
    let order = tokio::spawn({
        let port = patient.port;
        async move {
            let sold = post_order(&mut Http::new(port), &lines(&[("b", 1), ("a", 2)]), 1500).await;
            (sold, Instant::now())
        }
    });
    // Until the order holds `a`, a purchase of it goes through: keep those in the books.
    let mut http = Http::new(hasty.port);
    let started = Instant::now();
    let refused = loop {
        let sold = purchase(&mut http, "a", 0).await;
        if sold.status == 409 {
            break sold;
        }
        assert_eq!(sold.status, 200, "{name}: {}", sold.json);
        sales.push(sold);
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "{name}: the order never held `a`"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    assert!(
        refused.retry_after.is_some(),
        "{name}: a 409 without Retry-After"
    );
    let partly = post_order(&mut http, &lines(&[("c", 1), ("a", 1)]), 0).await;
    assert_eq!(partly.status, 409, "{name}: {}", partly.json);
    let free = purchase(&mut http, "c", 0).await;
    assert_eq!(free.status, 200, "{name}: the refused order kept `c`");
    sales.push(free);

    let waited = purchase(&mut Http::new(patient.port), "a", 0).await;
    let answered = Instant::now();
    let (order, order_done) = order.await.unwrap();
    assert_eq!((order.status, waited.status), (200, 200), "{name}");
    assert!(
        answered >= order_done,
        "{name}: the purchase did not wait for the order"
    );
    assert_eq!(
        waited.left["a"].0 + 1,
        order.left["a"].0,
        "{name}: the purchase did not sell from the stock the order left"
    );
    sales.extend([order, waited]);
    let initial = ["a", "b", "c"].map(|s| (s.to_owned(), 50)).into();
    let books = audit(&initial, &sales, patient.port, true).await;
    assert!(books.clean(), "{name}: {books:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_order_makes_a_purchase_wait_on_redis() {
    an_order_makes_a_purchase_wait(Topology::redis()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_order_makes_a_purchase_wait_on_redlock() {
    an_order_makes_a_purchase_wait(Topology::redlock()).await;
}

#[cfg(feature = "cluster")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_order_makes_a_purchase_wait_on_a_cluster() {
    an_order_makes_a_purchase_wait(Topology::cluster()).await;
}

/// Purchases of `a` back to back from six clients over three instances keep `a` taken without
/// a gap (each waits its turn: `LOCK_WAIT_MS=20000`); an order of `a` and `b` from a fourth
/// instance, which waits at most 5 s, gets its turn well inside that, and the stream goes on.
async fn an_order_is_not_starved(topology: Topology) {
    let name = topology.name();
    let stream = topology.start_many(3, &[("LOCK_WAIT_MS", "20000")]);
    let buyer = match topology {
        Topology::Memory => None,
        _ => Some(topology.start(&[("LOCK_WAIT_MS", "5000")])),
    };
    let buyer_port = buyer.as_ref().map_or(stream[0].port, |b| b.port);
    for sku in ["a", "b"] {
        set_stock(stream[0].port, sku, 100_000).await;
    }
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicUsize::new(0));
    let mut clients = Vec::new();
    for c in 0..6 {
        let port = stream[c % stream.len()].port;
        let (stop, done) = (Arc::clone(&stop), Arc::clone(&done));
        clients.push(tokio::spawn(async move {
            let mut http = Http::new(port);
            let mut sales = Vec::new();
            while !stop.load(Ordering::SeqCst) {
                sales.push(purchase(&mut http, "a", 20).await);
                done.fetch_add(1, Ordering::SeqCst);
            }
            sales
        }));
    }
    let started = Instant::now();
    while done.load(Ordering::SeqCst) < 10 {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "{name}: the stream never ran"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let started = Instant::now();
    let order = post_order(&mut Http::new(buyer_port), &lines(&[("b", 1), ("a", 1)]), 0).await;
    let waited = started.elapsed();
    let during = done.load(Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(200)).await;
    stop.store(true, Ordering::SeqCst);
    let mut sales = vec![order.clone()];
    for client in clients {
        sales.extend(client.await.unwrap());
    }
    assert_eq!(
        order.status, 200,
        "{name}: starved for {waited:?}: {}",
        order.json
    );
    assert!(
        waited < Duration::from_millis(2500),
        "{name}: waited {waited:?}"
    );
    assert!(
        sales.iter().all(|s| s.status == 200),
        "{name}: a purchase of the stream was refused"
    );
    assert!(
        done.load(Ordering::SeqCst) > during,
        "{name}: the stream stopped"
    );
    let initial = ["a", "b"].map(|s| (s.to_owned(), 100_000)).into();
    let books = audit(&initial, &sales, stream[0].port, true).await;
    assert!(books.clean(), "{name}: {books:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_order_is_not_starved_by_purchases_in_memory() {
    an_order_is_not_starved(Topology::Memory).await;
}

/// With hand-off (`RedisStore::connect`), the order queues for `a` like any purchase.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_order_is_not_starved_by_purchases_on_redis() {
    an_order_is_not_starved(Topology::redis()).await;
}

// ---------------------------------------------------------------------------------------------
// Reads: `GET /items/{sku}?work_ms=N` holds a shared lease on the SKU for N ms, then reads.

/// `GET /items/{sku}?work_ms={work_ms}`: the status and the stock read, and when it answered.
async fn read(port: u16, sku: &str, work_ms: u64) -> (u16, Option<u64>, Instant) {
    let reply = Http::new(port)
        .request("GET", &format!("/items/{sku}?work_ms={work_ms}"), None)
        .await
        .expect("GET /items");
    (reply.status, reply.json()["stock"].as_u64(), Instant::now())
}

/// Three reads of one SKU holding it 400 ms each, sent at once (over the instances there are):
/// they run together, so all three answer in about 400 ms, far from the 1.2 s they would take
/// one after the other; a purchase sent after them still sells.
async fn reads_overlap(topology: Topology) {
    let name = topology.name();
    let instances = topology.start_many(3, &[("LOCK_WAIT_MS", "10000")]);
    let ports: Vec<u16> = instances.iter().map(|i| i.port).collect();
    set_stock(ports[0], "apple", 5).await;
    let started = Instant::now();
    let reads: Vec<_> = (0..3)
        .map(|i| tokio::spawn(read(ports[i % ports.len()], "apple", 400)))
        .collect();
    for r in reads {
        let (status, stock, done) = r.await.unwrap();
        assert_eq!((status, stock), (200, Some(5)), "{name}");
        assert!(
            done - started >= Duration::from_millis(400),
            "{name}: a read did not hold its lease for work_ms"
        );
    }
    let took = started.elapsed();
    assert!(
        took < Duration::from_millis(1000),
        "{name}: three reads of 400 ms took {took:?}: they did not share the SKU"
    );
    let sold = purchase(&mut Http::new(ports[0]), "apple", 0).await;
    assert_eq!(sold.status, 200, "{name}: {}", sold.json);
    for instance in &instances {
        instance.assert_no_panic();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_of_a_sku_overlap_in_memory() {
    reads_overlap(Topology::Memory).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_of_a_sku_overlap_on_redis() {
    reads_overlap(Topology::redis()).await;
}

/// What a reader, a purchase and a second reader of one SKU saw, sent in that order (each
/// from its own instance where there are several): the first reader holds the SKU for 1 s, the
/// purchase comes 200 ms in and works 600 ms, the second reader (holding it 0 ms) 500 ms in.
/// Without the lock, the purchase writes at about 800 ms: after the second read, before the
/// first reader answers.
struct Interleaving {
    first: (u16, Option<u64>, Instant),
    purchase: (Sold, Instant),
    second: (u16, Option<u64>, Instant),
}

async fn reader_purchase_reader(topology: &Topology, lock: &str) -> Interleaving {
    let instances = topology.start_many(3, &[("LOCK", lock), ("LOCK_WAIT_MS", "10000")]);
    let ports: Vec<u16> = instances.iter().map(|i| i.port).collect();
    let port = |i: usize| ports[i % ports.len()];
    set_stock(port(0), "apple", 5).await;
    let first = tokio::spawn(read(port(0), "apple", 1000));
    tokio::time::sleep(Duration::from_millis(200)).await;
    let buyer = port(1);
    let purchase = tokio::spawn(async move {
        let sold = purchase(&mut Http::new(buyer), "apple", 600).await;
        (sold, Instant::now())
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let second = read(port(2), "apple", 0).await;
    let seen = Interleaving {
        first: first.await.unwrap(),
        purchase: purchase.await.unwrap(),
        second,
    };
    for instance in &instances {
        instance.assert_no_panic();
    }
    seen
}

/// A purchase waits for the reader that holds the SKU (the reader reads the stock from before
/// it, and the purchase ends well after the reader), and a reader that comes after the queued
/// purchase waits for it, though it would fit beside the first reader: it reads the stock the
/// purchase left.
async fn a_purchase_waits_for_readers(topology: Topology) {
    let name = topology.name();
    let seen = reader_purchase_reader(&topology, "on").await;
    let (sold, sold_at) = seen.purchase;
    assert_eq!(seen.first.0, 200, "{name}");
    assert_eq!(
        seen.first.1,
        Some(5),
        "{name}: the first reader read after the purchase"
    );
    assert_eq!(sold.status, 200, "{name}: {}", sold.json);
    assert_eq!(sold.left["apple"].0, 4, "{name}");
    assert!(
        sold_at >= seen.first.2 + Duration::from_millis(150),
        "{name}: the purchase ended {:?} after the reader: it did not wait for it",
        sold_at.saturating_duration_since(seen.first.2)
    );
    assert_eq!(
        (seen.second.0, seen.second.1),
        (200, Some(4)),
        "{name}: the second reader did not wait for the purchase queued before it"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_purchase_waits_for_readers_and_later_readers_wait_for_it_in_memory() {
    a_purchase_waits_for_readers(Topology::Memory).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_purchase_waits_for_readers_and_later_readers_wait_for_it_on_redis() {
    a_purchase_waits_for_readers(Topology::redis()).await;
}

/// The negative control: with `LOCK=off` the purchase does not wait for the reader (it ends
/// before the reader does), and the second reader does not wait for the purchase (it reads
/// the stock from before it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_lock_reads_and_purchases_interleave() {
    let seen = reader_purchase_reader(&Topology::redis(), "off").await;
    let (sold, sold_at) = seen.purchase;
    assert_eq!(sold.status, 200, "{}", sold.json);
    assert!(
        sold_at < seen.first.2,
        "the purchase waited without the lock"
    );
    assert_eq!((seen.second.0, seen.second.1), (200, Some(5)));
}

/// `work_ms` of a read: a whole number of ms, at most the purchases' cap (60000); anything
/// else is a 400 problem, and an unknown SKU is still a 404.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_with_a_bad_work_ms_is_a_400() {
    let instance = Topology::Memory.start(&[]);
    let mut http = Http::new(instance.port);
    set_stock(instance.port, "apple", 5).await;
    for query in ["work_ms=abc", "work_ms=-1", "work_ms=60001", "work_ms=1.5"] {
        let reply = http
            .request("GET", &format!("/items/apple?{query}"), None)
            .await
            .unwrap();
        assert_eq!(reply.status, 400, "{query}: {:?}", reply.json());
        assert_eq!(
            reply.header("content-type"),
            Some("application/problem+json"),
            "{query}"
        );
    }
    let reply = http
        .request("GET", "/items/kiwi?work_ms=5", None)
        .await
        .unwrap();
    assert_eq!(reply.status, 404);
    let reply = http
        .request("GET", "/items/apple?work_ms=5", None)
        .await
        .unwrap();
    assert_eq!(
        (reply.status, reply.json()["stock"].as_u64()),
        (200, Some(5))
    );
    instance.assert_no_panic();
}
