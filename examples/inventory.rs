//! An inventory service whose purchase and order endpoints cannot oversell, even though their
//! read-modify-writes of the stock are deliberately not atomic.
//!
//! `POST /items/{sku}/purchase` reads the stock, "works" for `work_ms` milliseconds, then writes
//! the stock minus one: three separate steps, so two concurrent purchases of the last item would
//! both succeed. A [`LockLayer`] keyed on the `sku` path parameter serializes purchases of the
//! same SKU across every instance that shares the lock store; purchases of different SKUs still
//! run in parallel. Run it with `LOCK=off` to see the oversell the lock prevents.
//!
//! The lock alone does not protect the stock from a holder that stalls past its lease (a long
//! pause, a partition): its lease runs out, another instance sells, and the stalled one's write
//! lands on top. So the stock is read and written through fenced writes
//! ([`tower_lock::fence`]), with the lease's fencing token: a write from a holder that a newer
//! one has overtaken is refused (409 `#stale-write`) and changes nothing, and a 200 means the
//! write landed. Run it with `FENCING=off` to see the lost update that prevents.
//!
//! `POST /orders` sells several SKUs at once, the same way: it locks every SKU of the order,
//! reads every stock, works, writes every stock. Its layer reads the SKUs from the JSON body
//! ([`Key::json`]) and takes them as one lease: all of them or none, in an order every instance
//! agrees on, so two orders that name the same SKUs in opposite orders never deadlock. It locks
//! each SKU with the same lock a purchase of that SKU takes (both layers share one [`Locker`]
//! and lock in the namespace `sku`), so orders and purchases exclude each other too.
//!
//! `GET /items/{sku}?work_ms=N` reads a SKU's stock under a *shared* lease on the same lock,
//! held `N` ms before it reads (the time a real read would take): reads of a SKU run together,
//! never with a purchase or an order of it, which take the SKU exclusively. First come, first
//! served: a purchase waits for the reads that hold the SKU, and reads that come after a
//! waiting purchase wait for it (no purchase is starved by a stream of reads). So every SKU's
//! lock is a lease with counts ([`LockLayer::shared_when`]: a reader takes 1 of its capacity,
//! a purchase or order all of it), one layout in the store for every route; with
//! `LOCK_STORE=redlock`, which cannot count holders, every route takes the plain lock, reads
//! included (one at a time). `LOCK=off` takes nothing.
//!
//! # Routes
//!
//! | route | body | answers |
//! |---|---|---|
//! | `PUT /items/{sku}` | `{"stock": N}` | 200 `{"sku","stock"}`; 400 on a bad body |
//! | `GET /items/{sku}?work_ms=N` | | 200 `{"sku","stock"}`; 404 for an unknown SKU; 400 for a `work_ms` that is not a whole number up to 60000; 409 lock held by a purchase or order past `LOCK_WAIT_MS`; 503 lock store unavailable |
//! | `POST /items/{sku}/purchase?work_ms=N` | | 200 `{"sku","stock","fencing_token"}`; 404 unknown SKU; 422 out of stock; 409 lock held (from the layer); 409 `#stale-write` (the lease was overtaken: nothing sold) |
//! | `POST /orders?work_ms=N` | `{"items": [{"sku": "a", "qty": 2}, {"sku": "b", "qty": 1}]}` | 200 `{"items": [{"sku","stock"}, ...], "fencing_tokens": {"<sku>": N, ...}}`; 400 bad body; 404 unknown SKU; 422 a SKU short of its quantity; 409 locks held (from the layer); 409 `#stale-write`; 413 body too large |
//!
//! Every error is an `application/problem+json` body `{"type","title","status","detail"}`. A
//! SKU longer than the lock's key limit (512 bytes) is a 400 for `PUT` (no purchase could ever
//! lock it) and a 404 for `GET`. Without Redis the stock holds at most `MAX_SKUS` SKUs (10,000):
//! a `PUT` of one more answers 507.
//!
//! # What a 200 means
//!
//! A purchase or order answers 200 exactly when its stock write was accepted. A write the data
//! refused (a newer holder of the SKU read or wrote it since this request's lease was granted:
//! this one was lost, and the SKU locked again) answers 409 `#stale-write` and changes nothing;
//! a write whose store did not answer, 503 `#data-store-unavailable` (it may have landed). Once
//! the write is sent, a lost lease no longer stops the request: its answer is the write's.
//! Stopped before (lease lost while it worked), it answers 503 `#lease-lost` and wrote nothing.
//! So in every interleaving the stock's decrease is the quantities answered 200, plus those of
//! a 503 `#data-store-unavailable` whose write landed (the journal has every accepted write).
//!
//! # Orders
//!
//! - **Locks.** Every SKU of the order, as one lease, with the lock `POST /items/{sku}/purchase`
//!   takes for that SKU. When they cannot all be had within `LOCK_WAIT_MS`, the answer is 409
//!   (from the layer, with `Retry-After`) and none of them is kept.
//! - **All or nothing.** Every stock is read first; if any SKU has less than its quantity, the
//!   answer is 422 naming the SKUs short, and no stock changes. Otherwise every stock is written.
//! - **The answer.** 200 with each SKU's stock left, in the order the body first names them, and
//!   each SKU's fencing token (`{}` when the route runs without the lock, `LOCK=off`).
//! - **Lines.** The same SKU twice counts as one line with the quantities added. A quantity is
//!   a whole number from 1. At most 64 SKUs per order (the lock's `max_keys`).
//! - **Bad bodies** are 400: not JSON, no `items` or none in it, an item without a `sku` (these
//!   from the layer, which reads the SKUs before the handler runs: `#invalid-lock-key`), a SKU
//!   that is not a string, a quantity missing or below 1 (`invalid-body` or `bad-request`, from
//!   the handler, once the locks are taken). A body larger than 64 KiB is 413, a missing
//!   `content-type: application/json` 415. An unknown SKU is 404, and nothing is sold.
//!
//! # Environment
//!
//! | variable | default | meaning |
//! |---|---|---|
//! | `REDIS_URL` | unset | unset: locks and stock live in this process (`MemoryStore`, `FencedData::in_memory`), so run one instance; set (e.g. `redis://127.0.0.1:6379/`): both live in Redis, so any number of instances can share them |
//! | `LOCK_STORE`, `REDIS_URLS`, `LOCK_WAIT_REPLICAS` | | other topologies: Redlock over several masters, Redis Cluster, replica acknowledgement; see `examples/common/store.rs` and `docs/TOPOLOGY.md` (the stock stays on `REDIS_URL` or the first of `REDIS_URLS`, or in the cluster: there an order's SKUs of different hash slots are written slot by slot, each step fenced, so a refusal after the first slot leaves the earlier ones written, and is logged) |
//! | `REDIS_CA_CERT` | unset | for `rediss://` URLs (built with `--features tls`): a PEM file of the CA(s) to trust instead of the system's |
//! | `REDIS_CLIENT_CERT`, `REDIS_CLIENT_KEY` | unset | PEM files of a client certificate and its key, for a Redis that requires one (mutual TLS) |
//! | `HOST` | `127.0.0.1` | address to bind |
//! | `PORT` | `3000` | port to bind |
//! | `LOCK_TTL_MS` | `10000` | lease time to live; renewed every third of it while a purchase or order runs |
//! | `LOCK_WAIT_MS` | `2000` | how long a read, purchase or order waits for held locks before answering 409; `0` fails fast |
//! | `LOCK` | `on` | `off` serves the read, purchase and order routes without the lock |
//! | `STOCK_URL` | the lock store's Redis (`REDIS_URL`, or the first of `REDIS_URLS`; the cluster with `LOCK_STORE=cluster`) | a Redis URL that holds the stock; the stock is written only through fenced writes, so it may live on another server than the locks |
//! | `FENCING` | `on` | `off` writes the stock without the token check: it shows what fencing prevents (a negative control), never for production. A write, once started, then lands even if a lost lease stops its request meanwhile (as a statement already sent to a database would), and the client is told 503 |
//! | `FENCE_HORIZON_S` | `86400` | how long a SKU's fence is kept after the last read or write of its stock ([`FencedData::horizon`]); a purchase paused for longer is refused all the same |
//! | `WRITE_JOURNAL` | unset | a Redis key name: each stock write the data accepted also appends, in the same atomic step on the stock's Redis, one JSON entry to that list (below); needs the stock on one Redis server |
//! | `INSTANCE` | the value of `PORT` | this instance's name in the journal and its logs |
//! | `HEADER_READ_TIMEOUT_MS` | `5000` | how long a client may take to send a request's head before its connection is closed |
//! | `MAX_SKUS` | `10000` | without Redis: the most SKUs the in-memory stock holds |
//! | `RUST_LOG` | `info` | log filter |
//!
//! A journal entry: `{"sku": "<sku>", "token": <fencing token>, "stock": <stock after the
//! write>, "instance": "<INSTANCE>", "request": "<x-request-id header>" or null}` (`token` is
//! `null` with `LOCK=off`; with `FENCING=off` it is the lease's, unchecked). A `PUT` (an
//! administrative reset, not fenced) appends `{"sku", "token": 0, "stock", "instance",
//! "request", "reset": true}`. An order appends one entry per SKU, in the same step as its
//! writes. A write the data refused appends nothing; the instance logs it (target `inventory`,
//! with the SKU, the token and the request id).
//!
//! Over TLS, with a private CA and a client certificate (mutual TLS):
//!
//! ```sh
//! REDIS_URL=rediss://:secret@redis.internal:6380/ REDIS_CA_CERT=ca.pem \
//!   REDIS_CLIENT_CERT=client.pem REDIS_CLIENT_KEY=client.key \
//!   cargo run --features tls --example inventory
//! ```
//!
//! The banner shows the URL as `rediss://:***@redis.internal:6380/`: no password is printed or
//! logged. A connection that fails at start-up (a wrong password, an untrusted certificate or
//! one for another host, a server that does not answer) ends the process at once with status 1
//! and a message that names the cause.
//!
//! Built with `--features metrics`, it also serves `GET /metrics` (Prometheus text format; every
//! metric is listed in `docs/OBSERVABILITY.md`).
//!
//! # Try it
//!
//! ```sh
//! LOCK_WAIT_MS=0 cargo run --example inventory
//!
//! curl -i -X PUT localhost:3000/items/apple -H 'content-type: application/json' -d '{"stock": 5}'
//!
//! # Two purchases at once: one gets the lock (200), the other finds it held (409).
//! curl -s -X POST 'localhost:3000/items/apple/purchase?work_ms=300' &
//! curl -s -X POST 'localhost:3000/items/apple/purchase?work_ms=300'; wait
//!
//! curl -s localhost:3000/items/apple          # {"sku":"apple","stock":4}
//! ```
//!
//! With the default `LOCK_WAIT_MS=2000` the second purchase waits for the first instead, and both
//! succeed one after the other. With `LOCK=off`, set the stock to 1 and run the two purchases
//! again: both answer 200 with `"stock":0`, and two items were sold from a stock of one.
//!
//! Then an order of two apples and a pear, and one the stock cannot serve:
//!
//! ```sh
//! curl -s -X PUT localhost:3000/items/pear -H 'content-type: application/json' -d '{"stock": 1}'
//! curl -s -X POST localhost:3000/orders -H 'content-type: application/json' \
//!   -d '{"items": [{"sku": "apple", "qty": 2}, {"sku": "pear", "qty": 1}]}'
//! # {"items":[{"sku":"apple","stock":2},{"sku":"pear","stock":0}],"fencing_tokens":{"apple":2,"pear":1}}
//! curl -s -X POST localhost:3000/orders -H 'content-type: application/json' \
//!   -d '{"items": [{"sku": "apple", "qty": 1}, {"sku": "pear", "qty": 1}]}'
//! # 422: not enough stock of `pear`; nothing was sold (apple's stock stays 2)
//! ```
//!
//! An order that names a SKU a purchase (or another order) holds waits for it, or answers 409
//! with `LOCK_WAIT_MS=0`, as a second purchase does.
//!
//! Reads share the SKU; a purchase waits for them (with the default `LOCK_WAIT_MS`):
//!
//! ```sh
//! curl -s 'localhost:3000/items/apple?work_ms=500' &
//! curl -s 'localhost:3000/items/apple?work_ms=500' &    # both answer after about 500 ms
//! curl -s -X POST localhost:3000/items/apple/purchase; wait  # after the two reads
//! ```
//!
//! To share the lock and the stock between instances, start Redis and two instances:
//!
//! ```sh
//! REDIS_URL=redis://127.0.0.1:6379/ PORT=3000 cargo run --example inventory
//! REDIS_URL=redis://127.0.0.1:6379/ PORT=3001 cargo run --example inventory
//! curl -s -X POST 'localhost:3000/items/apple/purchase?work_ms=300' &
//! curl -s -X POST 'localhost:3001/items/apple/purchase?work_ms=300'; wait
//! ```

use problem::{Problem, Refusal};
use std::{
    collections::{BTreeMap, HashSet},
    env,
    error::Error,
    process::ExitCode,
    sync::{Arc, Mutex, PoisonError},
    time::Duration,
};

use axum::{
    Json, Router,
    extract::{
        Path, Query, State,
        rejection::{JsonRejection, PathRejection, QueryRejection},
    },
    http::{HeaderMap, StatusCode},
    routing::{post, put},
};
use serde::{Deserialize, Serialize};
use tower_lock::{
    ConfigError, Key, Lease, LockConfig, LockLayer, Locker, Wait,
    fence::{Batch, FenceError, FencedData, data_key},
    key::LockKey,
};

#[path = "common/app.rs"]
mod app;
#[path = "common/metrics.rs"]
mod metrics;
#[path = "common/problem.rs"]
mod problem;
#[path = "common/store.rs"]
mod store;

/// The longest `work_ms` a read, purchase or order accepts.
const MAX_WORK_MS: u64 = 60_000;

/// The largest order body the lock layer reads for the order's SKUs (larger: 413).
const MAX_ORDER_BODY: usize = 64 * 1024;

/// The namespace purchases and orders lock SKUs in: one lock per SKU, whichever route takes it.
const SKU_LOCKS: &str = "sku";

/// The stock's key names: `inventory:stock:{<tag>}...:<sku>`, in the SKU's lock's hash slot.
const STOCK: &str = "inventory:stock:";

#[tokio::main]
async fn main() -> ExitCode {
    app::init_logging();
    app::exit_code(run().await)
}

async fn run() -> Result<(), Box<dyn Error>> {
    let settings = Settings::from_env()?;

    // Built (and so checked) before anything connects: a bad LOCK_TTL_MS is reported first.
    let config = LockConfig::builder()
        .ttl(settings.ttl)
        .wait(settings.wait)
        .build()?;
    // The lock layer and the stock are backed by the same kind of storage: in-process without
    // REDIS_URL, Redis with it (LOCK_STORE picks another topology: `examples/common/store.rs`).
    let chosen = store::from_env().await?;
    // One locker for both locked routes, and one namespace: a purchase and an order lock a SKU
    // with the same lock (and take their turns at it in this process in one queue).
    let locker: Locker = chosen.locker(config);
    // A SKU's lock is always taken with a share where the store counts holders (every store
    // but Redlock): readers (`GET /items/{sku}`) take 1 of its capacity, purchases and orders
    // (writers) all of it, so that every request lays the key out alike in the store. On
    // Redlock, which cannot count, every request takes the plain lock, reads included.
    let counts = !matches!(chosen.store, store::Store::Redlock(_));
    let purchase_lock = writers(
        LockLayer::from_locker(locker.clone(), Key::path_param("sku")).namespace(SKU_LOCKS),
        counts,
    )?;
    let order_lock = writers(
        LockLayer::from_locker(locker.clone(), Key::json("/items/*/sku")?)
            .namespace(SKU_LOCKS)
            .max_request_body(MAX_ORDER_BODY),
        counts,
    )?;
    let data = match (&settings.stock_url, chosen.data) {
        (Some(url), _) => {
            println!("stock in Redis at {} (STOCK_URL)", store::redacted(url));
            Some(store::Tls::from_env()?.data(url).await?)
        }
        (None, Some(data)) => {
            println!("{}", chosen.description);
            Some(data)
        }
        (None, None) => {
            println!(
                "REDIS_URL is not set: running as a single process with the in-memory lock \
                 store and in-memory stock"
            );
            None
        }
    };
    if settings.journal.is_some() && data.as_ref().is_none_or(|d| d.per_slot) {
        return Err(
            "WRITE_JOURNAL needs the stock on one Redis server (REDIS_URL or \
                    STOCK_URL), where each write and its entry are one atomic step"
                .into(),
        );
    }
    let stock = Stock {
        per_slot: data.as_ref().is_some_and(|d| d.per_slot),
        memory_skus: data
            .is_none()
            .then(|| Arc::new((Mutex::default(), settings.max_skus))),
        data: data
            .map_or_else(FencedData::in_memory, |d| d.fenced)
            .horizon(settings.fence_horizon)?,
        fencing: settings.fencing,
        journal: settings.journal.clone(),
        instance: settings.instance.clone(),
    };
    if !settings.fencing {
        println!("FENCING=off: stock writes skip the fencing-token check and can lose updates");
    }

    // The purchase and order routes are locked by their layers, reads in their handler
    // (a SKU the lock cannot take is a 404 there, never stocked); restocking is not locked.
    let (purchase_route, order_route) = if settings.lock {
        (
            post(purchase).route_layer(purchase_lock),
            post(order).route_layer(order_lock),
        )
    } else {
        println!("LOCK=off: reads, purchases and orders run without the lock and can oversell");
        (post(purchase), post(order))
    };
    let app = Router::new()
        .route("/items/{sku}", put(set_stock).get(get_stock))
        .route("/items/{sku}/purchase", purchase_route)
        .route("/orders", order_route)
        .merge(metrics::router()?)
        .fallback(|| async { Problem::not_found("no such route") })
        .method_not_allowed_fallback(|| async {
            Problem::new(
                StatusCode::METHOD_NOT_ALLOWED,
                "method-not-allowed",
                "Method not allowed",
                "this route does not take that method",
            )
        })
        .with_state(Inventory {
            stock,
            keys: locker,
            reads: match (settings.lock, counts) {
                (false, _) => Reads::Unlocked,
                (true, true) => Reads::Shared,
                (true, false) => Reads::Exclusive,
            },
        });

    let listener = tokio::net::TcpListener::bind((settings.host.as_str(), settings.port))
        .await
        .map_err(|e| format!("cannot bind {}:{}: {e}", settings.host, settings.port))?;
    println!("listening on http://{}", listener.local_addr()?);
    app::serve(listener, app, settings.header_read_timeout).await?;
    println!("stopped");
    Ok(())
}

/// `layer`, taking its keys as writers of keys readers share (the whole of each SKU's
/// capacity) where the store counts holders; the plain lock where it cannot.
fn writers(layer: LockLayer, counts: bool) -> Result<LockLayer, ConfigError> {
    match counts {
        true => layer.shared_when(|_| false),
        false => Ok(layer),
    }
}

/// What every handler shares.
#[derive(Clone)]
struct Inventory {
    stock: Stock,
    /// Makes each SKU's lock key, which names its stock too (the same key a purchase locks),
    /// and takes it for reads.
    keys: Locker,
    /// How `GET /items/{sku}` locks the SKU.
    reads: Reads,
}

/// How a read locks its SKU.
#[derive(Clone, Copy)]
enum Reads {
    /// `LOCK=off`: not at all.
    Unlocked,
    /// Shared with other reads, never with a purchase or an order.
    Shared,
    /// Exclusive, as a purchase (a store that cannot count holders: Redlock).
    Exclusive,
}

impl Inventory {
    /// The lock key of `sku`: 400 for a SKU the lock cannot take (longer than its key limit).
    fn key(&self, sku: &str) -> Result<LockKey, Problem> {
        self.keys
            .key(SKU_LOCKS, sku)
            .map_err(|e| Problem::bad_request(format!("the SKU cannot be locked: {e}")))
    }
}

// ---------------------------------------------------------------------------------------------
// Handlers

#[derive(Serialize)]
struct Item {
    sku: String,
    stock: u64,
}

#[derive(Deserialize)]
struct SetStock {
    stock: u64,
}

/// Sets a SKU's stock: an administrative reset, outside any lease, so not fenced.
async fn set_stock(
    State(inventory): State<Inventory>,
    sku: Result<Path<String>, PathRejection>,
    headers: HeaderMap,
    body: Result<Json<SetStock>, JsonRejection>,
) -> Result<Json<Item>, Refusal> {
    let Path(sku) = sku.map_err(|e| Problem::bad_request(e.body_text()))?;
    let key = inventory.key(&sku)?;
    let Json(SetStock { stock: n }) = body.map_err(Problem::bad_json)?;
    let stock = &inventory.stock;
    stock.admit(&sku)?;
    let mut batch = stock
        .data
        .unfenced_batch()
        .set(stock_key(&key), n.to_string());
    if let Some(journal) = &stock.journal {
        let mut entry = stock.entry(&sku, Some(0), n, request_id(&headers));
        entry["reset"] = true.into();
        batch = batch.rpush(&**journal, entry.to_string());
    }
    batch.apply().await?;
    tracing::info!(sku, stock = n, "stock set");
    Ok(Json(Item { sku, stock: n }))
}

/// Reads a SKU's stock under a shared lease on it: with other reads, never while a purchase
/// or an order of it runs. The lease is held `work_ms` before the read (the time a real read
/// would take), so that readers can be seen to overlap, and purchases to wait for them.
async fn get_stock(
    State(inventory): State<Inventory>,
    sku: Result<Path<String>, PathRejection>,
    params: Result<Query<WorkParams>, QueryRejection>,
) -> Result<Json<Item>, Refusal> {
    let Path(sku) = sku.map_err(|e| Problem::bad_request(e.body_text()))?;
    let work = work_of(params)?;
    // A SKU too long to lock was never stocked.
    let key = inventory.key(&sku).map_err(|_| unknown_sku(&sku))?;
    let stock = async {
        tokio::time::sleep(work).await;
        let batch = inventory.stock.data.unfenced_batch();
        read(batch, &[&key]).await
    };
    let found = match inventory.reads {
        Reads::Unlocked => stock.await,
        Reads::Shared => {
            inventory
                .keys
                .acquire(key.clone())
                .shared()?
                .run(stock)
                .await?
        }
        Reads::Exclusive => inventory.keys.acquire(key.clone()).run(stock).await?,
    };
    let n = found
        .map_err(|e| refused_read(e, &[(&sku, &key)], None, None))?
        .remove(0)
        .ok_or_else(|| unknown_sku(&sku))?;
    Ok(Json(Item { sku, stock: n }))
}

/// The `work_ms` query parameter of reads, purchases and orders (default 0).
#[derive(Deserialize)]
struct WorkParams {
    #[serde(default)]
    work_ms: u64,
}

/// `work_ms` as a duration: 400 for one that is not a whole number, or above `MAX_WORK_MS`.
fn work_of(params: Result<Query<WorkParams>, QueryRejection>) -> Result<Duration, Problem> {
    let Query(params) = params.map_err(|e| Problem::bad_request(e.body_text()))?;
    if params.work_ms > MAX_WORK_MS {
        return Err(Problem::bad_request(format!(
            "work_ms must be at most {MAX_WORK_MS}"
        )));
    }
    Ok(Duration::from_millis(params.work_ms))
}

#[derive(Serialize)]
struct Purchased {
    sku: String,
    /// The stock left after this purchase.
    stock: u64,
    /// The lease's fencing token; `null` when the route runs without the lock.
    fencing_token: Option<u64>,
}

/// Sells one item: read, work, write, as three separate steps. Nothing here is atomic; the
/// lock is what keeps two purchases of the same SKU from interleaving, and the fence what
/// keeps a holder that lost its lock meanwhile from writing.
async fn purchase(
    State(inventory): State<Inventory>,
    // `Option<Lease>`: `None` when the route is served without the layer (`LOCK=off`).
    lease: Option<Lease>,
    Path(sku): Path<String>,
    headers: HeaderMap,
    params: Result<Query<WorkParams>, QueryRejection>,
) -> Result<Json<Purchased>, Refusal> {
    let work = work_of(params)?;
    let key = inventory.key(&sku)?;
    let stock = &inventory.stock;
    let lease = lease.as_ref();

    // 1. Read (under the fence: a holder that read before this one cannot write after it).
    let available = read(stock.batch(lease, &[&key]), &[&key])
        .await
        .map_err(|e| refused_read(e, &[(&sku, &key)], lease, request_id(&headers)))?
        .remove(0)
        .ok_or_else(|| unknown_sku(&sku))?;
    if available == 0 {
        return Err(Problem::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "out-of-stock",
            "Out of stock",
            format!("`{sku}` is out of stock"),
        )
        .into());
    }
    // 2. Work (payment, reservation, ...). Without the lock, another purchase reads the same
    //    stock meanwhile.
    tokio::time::sleep(work).await;
    // 3. Write, refused if a newer holder of the SKU read or wrote it meanwhile.
    let left = available - 1;
    let written = [Written {
        key: &key,
        sku: &sku,
        stock: left,
    }];
    stock.write(lease, &written, request_id(&headers)).await?;

    let fencing_token = lease.map(Lease::fencing_token);
    tracing::info!(sku, stock = left, fencing_token, "sold one");
    Ok(Json(Purchased {
        sku,
        stock: left,
        fencing_token,
    }))
}

#[derive(Deserialize)]
struct Order {
    items: Vec<OrderLine>,
}

#[derive(Deserialize)]
struct OrderLine {
    sku: String,
    qty: u64,
}

#[derive(Serialize)]
struct Ordered {
    /// The stock left of each SKU, in the order the body first names them.
    items: Vec<Item>,
    /// Each SKU's fencing token; empty when the route runs without the lock.
    fencing_tokens: BTreeMap<String, u64>,
}

/// Sells every line of an order, or none: read every stock, work, write every stock, as
/// separate steps. Nothing here is atomic; the lease on every SKU of the order is what keeps
/// other orders and purchases of those SKUs from interleaving, and the fences (one per SKU)
/// what keeps a holder that lost its lease from writing.
async fn order(
    State(inventory): State<Inventory>,
    lease: Option<Lease>,
    headers: HeaderMap,
    params: Result<Query<WorkParams>, QueryRejection>,
    body: Result<Json<Order>, JsonRejection>,
) -> Result<Json<Ordered>, Refusal> {
    let work = work_of(params)?;
    let Json(order) = body.map_err(Problem::bad_json)?;
    let lines = order_lines(order)?;
    let keys = lines
        .iter()
        .map(|(sku, _)| inventory.key(sku))
        .collect::<Result<Vec<_>, _>>()?;
    let stock = &inventory.stock;
    let lease = lease.as_ref();

    // 1. Read every stock; refuse the whole order if one SKU falls short.
    let mut available = vec![None; lines.len()];
    for group in stock.groups(&keys) {
        let group_keys: Vec<&LockKey> = group.iter().map(|&i| &keys[i]).collect();
        let skus: Vec<(&str, &LockKey)> = group
            .iter()
            .map(|&i| (lines[i].0.as_str(), &keys[i]))
            .collect();
        let found = read(stock.batch(lease, &group_keys), &group_keys)
            .await
            .map_err(|e| refused_read(e, &skus, lease, request_id(&headers)))?;
        for (i, n) in group.into_iter().zip(found) {
            available[i] = n;
        }
    }
    let available = lines
        .iter()
        .zip(available)
        .map(|((sku, _), n)| n.ok_or_else(|| unknown_sku(sku)))
        .collect::<Result<Vec<u64>, _>>()?;
    let short: Vec<String> = lines
        .iter()
        .zip(&available)
        .filter(|((_, qty), left)| *left < qty)
        .map(|((sku, qty), left)| format!("`{sku}` ({qty} ordered, {left} in stock)"))
        .collect();
    if !short.is_empty() {
        return Err(Problem::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "out-of-stock",
            "Out of stock",
            format!("not enough stock of {}; nothing was sold", short.join(", ")),
        )
        .into());
    }
    // 2. Work.
    tokio::time::sleep(work).await;
    // 3. Write every stock, with a journal entry each, in one step (one per hash slot on a
    //    cluster).
    let written: Vec<Written<'_>> = lines
        .iter()
        .zip(&keys)
        .zip(&available)
        .map(|(((sku, qty), key), available)| Written {
            key,
            sku,
            stock: available - qty,
        })
        .collect();
    stock.write(lease, &written, request_id(&headers)).await?;
    let items = written
        .iter()
        .map(|w| Item {
            sku: w.sku.to_owned(),
            stock: w.stock,
        })
        .collect::<Vec<_>>();

    // Each SKU's token: the lease holds one key per SKU, its value the SKU.
    let fencing_tokens: BTreeMap<String, u64> = lease
        .into_iter()
        .flat_map(Lease::fencing_tokens)
        .filter_map(|(key, token)| Some((String::from_utf8(key.value().to_vec()).ok()?, token)))
        .collect();
    tracing::info!(skus = items.len(), ?fencing_tokens, "order sold");
    Ok(Json(Ordered {
        items,
        fencing_tokens,
    }))
}

/// The order's lines, the same SKU's merged (quantities added), in the order the body first
/// names them; 400 for an order without lines or a quantity below 1.
fn order_lines(order: Order) -> Result<Vec<(String, u64)>, Problem> {
    if order.items.is_empty() {
        return Err(Problem::bad_request("an order needs at least one item"));
    }
    let mut lines: Vec<(String, u64)> = Vec::with_capacity(order.items.len());
    for OrderLine { sku, qty } in order.items {
        if qty < 1 {
            return Err(Problem::bad_request(format!(
                "the quantity of `{sku}` must be at least 1"
            )));
        }
        match lines.iter_mut().find(|(s, _)| *s == sku) {
            Some((_, total)) => {
                *total = total.checked_add(qty).ok_or_else(|| {
                    Problem::bad_request(format!("the quantities of `{sku}` add up to too many"))
                })?;
            }
            None => lines.push((sku, qty)),
        }
    }
    Ok(lines)
}

fn unknown_sku(sku: &str) -> Problem {
    Problem::not_found(format!(
        "no item with SKU `{sku}`; create it with PUT /items/{sku}"
    ))
}

/// The `x-request-id` header, for the journal and the logs.
fn request_id(headers: &HeaderMap) -> Option<&str> {
    headers.get("x-request-id").and_then(|v| v.to_str().ok())
}

// ---------------------------------------------------------------------------------------------
// The stock: read and written through fenced batches (`tower_lock::fence`), in Redis or in
// this process.

#[derive(Clone)]
struct Stock {
    data: FencedData,
    /// `FENCING`: off writes without the token check.
    fencing: bool,
    /// `WRITE_JOURNAL`: the list each accepted write appends an entry to.
    journal: Option<Arc<str>>,
    /// `INSTANCE`.
    instance: Arc<str>,
    /// The data is on a cluster: one batch per hash slot.
    per_slot: bool,
    /// In memory: the SKUs stocked, and how many it may hold (`MAX_SKUS`).
    memory_skus: Option<Arc<(Mutex<HashSet<String>>, usize)>>,
}

/// One SKU's stock as an order or a purchase writes it.
struct Written<'a> {
    key: &'a LockKey,
    sku: &'a str,
    stock: u64,
}

fn stock_key(key: &LockKey) -> Vec<u8> {
    data_key(STOCK, key)
}

/// Reads the stock of each of `keys` with `batch`: `None` for a SKU never stocked.
async fn read(mut batch: Batch, keys: &[&LockKey]) -> Result<Vec<Option<u64>>, FenceError> {
    for key in keys {
        batch = batch.get(stock_key(key));
    }
    let replies = batch.apply().await?;
    Ok((0..keys.len())
        .map(|i| {
            replies
                .data(i)
                .and_then(|v| std::str::from_utf8(v).ok()?.parse().ok())
        })
        .collect())
}

/// A read of `skus` that failed, as the answer: refused (a newer holder was there: 409, logged
/// like a refused write) or failed (503); nothing was written either way.
fn refused_read(
    error: FenceError,
    skus: &[(&str, &LockKey)],
    lease: Option<&Lease>,
    request: Option<&str>,
) -> Refusal {
    match error {
        FenceError::Store(error) => Problem::storage(&error).into(),
        error => {
            for (sku, key) in skus {
                tracing::warn!(
                    target: "inventory",
                    sku,
                    token = lease.and_then(|l| l.fencing_token_of(key)),
                    request,
                    error = &error as &dyn Error,
                    "stock read not accepted; nothing written"
                );
            }
            error.into()
        }
    }
}

impl Stock {
    /// A batch on `keys`: fenced by the lease's tokens for them, unless fencing is off or the
    /// route runs without the lock.
    fn batch(&self, lease: Option<&Lease>, keys: &[&LockKey]) -> Batch {
        match lease {
            Some(lease) if self.fencing => self.data.batch_on(lease, keys.iter().copied()),
            _ => self.data.unfenced_batch(),
        }
    }

    /// The positions of `keys` in groups one batch can take: all of them, or one group per
    /// hash slot on a cluster (the key's hash tag names its slot).
    fn groups(&self, keys: &[LockKey]) -> Vec<Vec<usize>> {
        if !self.per_slot {
            return vec![(0..keys.len()).collect()];
        }
        let tag = |key: &LockKey| {
            let bytes = key.as_bytes();
            let start = bytes.iter().position(|&b| b == b'{').unwrap_or(0);
            let end = bytes.iter().position(|&b| b == b'}').unwrap_or(bytes.len());
            bytes[start..end].to_vec()
        };
        let mut groups: Vec<(Vec<u8>, Vec<usize>)> = Vec::new();
        for (i, key) in keys.iter().enumerate() {
            let tag = tag(key);
            match groups.iter_mut().find(|(t, _)| *t == tag) {
                Some((_, group)) => group.push(i),
                None => groups.push((tag, vec![i])),
            }
        }
        groups.into_iter().map(|(_, group)| group).collect()
    }

    /// A journal entry for a write of `sku`'s stock.
    fn entry(
        &self,
        sku: &str,
        token: Option<u64>,
        stock: u64,
        request: Option<&str>,
    ) -> serde_json::Value {
        serde_json::json!({
            "sku": sku,
            "token": token,
            "stock": stock,
            "instance": &*self.instance,
            "request": request,
        })
    }

    /// Writes each SKU's new stock, with its journal entry, in one step (one per hash slot on
    /// a cluster): refused, and nothing written, if a newer holder of any of them was there.
    async fn write(
        &self,
        lease: Option<&Lease>,
        written: &[Written<'_>],
        request: Option<&str>,
    ) -> Result<(), Refusal> {
        let keys: Vec<LockKey> = written.iter().map(|w| w.key.clone()).collect();
        for group in self.groups(&keys) {
            let group_keys: Vec<&LockKey> = group.iter().map(|&i| &keys[i]).collect();
            let mut batch = self.batch(lease, &group_keys);
            for &i in &group {
                let w = &written[i];
                batch = batch.set(stock_key(w.key), w.stock.to_string());
                if let Some(journal) = &self.journal {
                    let token = lease.and_then(|l| l.fencing_token_of(w.key));
                    let entry = self.entry(w.sku, token, w.stock, request);
                    batch = batch.rpush(&**journal, entry.to_string());
                }
            }
            let fenced = self.fencing && lease.is_some();
            let applied = if fenced {
                batch.apply().await
            } else {
                // Unfenced, a write once started is not called back when its request is
                // stopped (a lost lease aborts it), as a write already sent to a database is
                // not: it lands, and the client was told 503.
                tokio::spawn(batch.apply())
                    .await
                    .unwrap_or_else(|e| Err(FenceError::Invalid(e.to_string().into())))
            };
            if let Err(error) = applied {
                for &i in &group {
                    let w = &written[i];
                    let token = lease.and_then(|l| l.fencing_token_of(w.key));
                    tracing::warn!(
                        target: "inventory",
                        sku = w.sku,
                        token,
                        request,
                        error = &error as &dyn Error,
                        "stock write not accepted"
                    );
                }
                return Err(error.into());
            }
        }
        Ok(())
    }

    /// Makes room for `sku` in the in-memory stock: 507 past `MAX_SKUS`.
    fn admit(&self, sku: &str) -> Result<(), Problem> {
        let Some(memory) = &self.memory_skus else {
            return Ok(());
        };
        let (skus, max) = &**memory;
        let mut skus = skus.lock().unwrap_or_else(PoisonError::into_inner);
        if !skus.contains(sku) {
            if skus.len() >= *max {
                return Err(Problem::new(
                    StatusCode::INSUFFICIENT_STORAGE,
                    "stock-full",
                    "Stock full",
                    format!("the in-memory stock holds at most {max} SKUs"),
                ));
            }
            skus.insert(sku.to_owned());
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// Problem details (RFC 9457), the same shape the lock layer answers with.

impl Problem {
    fn storage(error: &tower_lock::store::StoreError) -> Self {
        tracing::error!(error = error as &dyn Error, "stock storage failed");
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "storage-unavailable",
            "Storage unavailable",
            "the stock could not be read; retry later",
        )
    }
}

// ---------------------------------------------------------------------------------------------
// Settings

struct Settings {
    host: String,
    port: u16,
    ttl: Duration,
    wait: Wait,
    lock: bool,
    fencing: bool,
    stock_url: Option<String>,
    journal: Option<Arc<str>>,
    instance: Arc<str>,
    header_read_timeout: Duration,
    max_skus: usize,
    /// How long a SKU's fence outlives its last write (`FencedData::horizon`).
    fence_horizon: Duration,
}

/// `on` (or unset) or `off`.
fn switch(name: &str) -> Result<bool, String> {
    match env::var(name).as_deref() {
        Err(env::VarError::NotPresent) | Ok("on") => Ok(true),
        Ok("off") => Ok(false),
        Ok(other) => Err(format!("{name}={other:?} is invalid: use `on` or `off`")),
        Err(env::VarError::NotUnicode(_)) => Err(format!("{name} is not valid UTF-8")),
    }
}

impl Settings {
    fn from_env() -> Result<Self, String> {
        let wait_ms: u64 = app::env_or("LOCK_WAIT_MS", 2000)?;
        let port = app::env_or("PORT", 3000)?;
        let set = |name: &str| env::var(name).ok().filter(|v| !v.is_empty());
        Ok(Self {
            host: env::var("HOST").unwrap_or_else(|_| "127.0.0.1".into()),
            port,
            ttl: Duration::from_millis(app::env_or("LOCK_TTL_MS", 10_000)?),
            wait: if wait_ms == 0 {
                Wait::none()
            } else {
                Wait::default().deadline(Duration::from_millis(wait_ms))
            },
            lock: switch("LOCK")?,
            fencing: switch("FENCING")?,
            stock_url: set("STOCK_URL"),
            journal: set("WRITE_JOURNAL").map(Arc::from),
            instance: set("INSTANCE").unwrap_or_else(|| port.to_string()).into(),
            header_read_timeout: app::header_read_timeout()?,
            max_skus: app::env_or("MAX_SKUS", 10_000)?,
            fence_horizon: Duration::from_secs(app::env_or("FENCE_HORIZON_S", 86_400)?),
        })
    }
}
