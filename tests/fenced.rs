//! Fenced writes (`tower_lock::fence`) on real servers, on every topology the API claims: one
//! Redis (the data on another server than the locks), Redlock locks with the data on one Redis,
//! a Sentinel master, a Redis Cluster.
//!
//! The interleaving is the one fencing exists for: holder A takes a SKU and reads its stock;
//! A's whole runtime then stops (its thread blocks, as a process does under SIGSTOP or a long
//! pause), past its lease's TTL, so its renewals stop too; B takes the SKU once A's lease has
//! run out, reads and sells; A resumes and writes the stock it computed before the pause.
//! Fenced, A's write is refused and the stock went down by exactly the one sale that was
//! accepted. The negative control runs the same interleaving with unfenced batches: A's write
//! lands, two sales were made and the stock went down by one.

use std::{
    future::Future,
    pin::Pin,
    sync::{Arc, mpsc},
    time::Duration,
};

use tower_lock::{
    Locker, MemoryStore, RedisStore, Wait,
    fence::{FenceError, FencedData, Reply, data_key},
    store::{LockStore, RedlockStore},
};
use tower_lock_testkit::RedisServer;

/// The locks' TTL: A's pause lasts until B has sold, well past it.
const TTL: Duration = Duration::from_millis(400);

/// One side's connections, made on the runtime that uses them.
type Connect =
    Arc<dyn Fn() -> Pin<Box<dyn Future<Output = (Locker, FencedData)> + Send>> + Send + Sync>;

fn connect<L, F, Fut>(locks: L, data: F) -> Connect
where
    L: Fn() -> Pin<Box<dyn Future<Output = Locker> + Send>> + Send + Sync + 'static,
    F: Fn() -> Fut + Send + Sync + 'static,
    Fut: Future<Output = FencedData> + Send + 'static,
{
    let (locks, data) = (Arc::new(locks), Arc::new(data));
    Arc::new(move || {
        let (locks, data) = (Arc::clone(&locks), Arc::clone(&data));
        Box::pin(async move { (locks().await, data().await) })
    })
}

fn locker(store: impl LockStore) -> Locker {
    Locker::new(store)
}

/// The lock side on one topology: each connection a `Locker` over a new store, `connect(at)`.
fn locks_on<A, C, S, Fut>(
    at: A,
    connect: C,
) -> impl Fn() -> Pin<Box<dyn Future<Output = Locker> + Send>> + Send + Sync + 'static
where
    A: Clone + Send + Sync + 'static,
    C: Fn(A) -> Fut + Send + Sync + 'static,
    S: LockStore,
    Fut: Future<Output = Result<S, tower_lock::store::StoreError>> + Send + 'static,
{
    move || {
        let store = connect(at.clone());
        Box::pin(async move { locker(store.await.unwrap()) })
    }
}

/// The data side on the one Redis at `url`: each connection a `FencedData` over a new store.
fn data_on(
    url: String,
) -> impl Fn() -> Pin<Box<dyn Future<Output = FencedData> + Send>> + Send + Sync + 'static {
    move || {
        let url = url.clone();
        Box::pin(async move { FencedData::new(RedisStore::connect(url).await.unwrap()) })
    }
}

/// Locks and data on one topology: each side's connection a new store from `store`.
#[cfg(any(feature = "cluster", feature = "sentinel"))]
fn locks_and_data_on<S, F, Fut>(store: F) -> Connect
where
    S: tower_lock::fence::FencedStore + 'static,
    F: Fn() -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = S> + Send + 'static,
{
    let locks = store.clone();
    connect(
        move || {
            let store = locks();
            Box::pin(async move { locker(store.await) })
        },
        move || {
            let store = store();
            async move { FencedData::new(store.await) }
        },
    )
}

/// A read or a write, fenced by `lease` or not (the negative control).
async fn run(
    data: &FencedData,
    lease: &tower_lock::Lease,
    fenced: bool,
    batch: impl FnOnce(tower_lock::fence::Batch) -> tower_lock::fence::Batch,
) -> Result<tower_lock::fence::Replies, FenceError> {
    let base = if fenced {
        data.batch(lease)
    } else {
        data.unfenced_batch()
    };
    batch(base).apply().await
}

fn stock_of(replies: &tower_lock::fence::Replies) -> u64 {
    let value = replies.data(0).expect("a stock");
    std::str::from_utf8(value).unwrap().parse().unwrap()
}

/// What the interleaving came to.
#[derive(Debug)]
struct Books {
    /// A's write, after its pause.
    stale_write: Result<(), FenceError>,
    /// The sales whose writes were accepted.
    sold: u64,
    /// How far the stock went down.
    decrease: u64,
}

/// A paused past its TTL while B sells, then A's write; with fenced batches or not.
async fn interleave(connect: Connect, fenced: bool, sku: &str) -> Books {
    let (b_locker, b_data) = connect().await;
    let key = b_locker.key("sku", sku).unwrap();
    let stock = data_key("inventory:stock:", &key);
    b_data
        .unfenced_batch()
        .set(&stock, "5")
        .apply()
        .await
        .unwrap();

    let (read_tx, read) = mpsc::channel::<u64>();
    let (resume, resume_rx) = mpsc::channel::<()>();
    let a = {
        let (connect, sku, stock) = (Arc::clone(&connect), sku.to_owned(), stock.clone());
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async move {
                let (locker, data) = connect().await;
                let key = locker.key("sku", &sku).unwrap();
                // Renewals stop at half the TTL, as a pause stops them: they run on the crate's own
                // runtime, which blocking this one no longer stops.
                let lease = locker
                    .acquire(key)
                    .ttl(TTL)
                    .unwrap()
                    .max_hold(TTL / 2)
                    .unwrap()
                    .await
                    .unwrap();
                let read = run(&data, &lease, fenced, |b| b.get(&stock)).await.unwrap();
                let available = stock_of(&read);
                read_tx.send(available).unwrap();
                // The pause: this runtime (its renewals included) stops until B has sold.
                resume_rx.recv().unwrap();
                let left = (available - 1).to_string();
                let written = run(&data, &lease, fenced, |b| b.set(&stock, &left)).await;
                drop(lease);
                written.map(drop)
            })
        })
    };
    let available = tokio::task::spawn_blocking(move || read.recv().unwrap())
        .await
        .unwrap();
    assert_eq!(available, 5);

    // B gets the key only once A's lease has run out.
    let lease = b_locker
        .acquire(key)
        .wait(
            Wait::constant(Duration::from_millis(20))
                .unwrap()
                .deadline(TTL * 10),
        )
        .await
        .expect("B never got the key");
    let read = run(&b_data, &lease, fenced, |b| b.get(&stock))
        .await
        .unwrap();
    let left = (stock_of(&read) - 1).to_string();
    run(&b_data, &lease, fenced, |b| b.set(&stock, &left))
        .await
        .unwrap();
    lease.release().await.unwrap();

    resume.send(()).unwrap();
    let stale_write = tokio::task::spawn_blocking(move || a.join().unwrap())
        .await
        .unwrap();
    let after = b_data.unfenced_batch().get(&stock).apply().await.unwrap();
    Books {
        sold: 1 + u64::from(stale_write.is_ok()),
        decrease: 5 - stock_of(&after),
        stale_write,
    }
}

/// Fenced: the stale write is refused and the books add up. Unfenced: it lands, and an update
/// is lost.
async fn stale_holder_is_refused(connect: Connect) {
    let books = interleave(Arc::clone(&connect), true, "fenced").await;
    assert!(
        matches!(books.stale_write, Err(FenceError::Stale { .. })),
        "{books:?}"
    );
    assert_eq!(books.decrease, books.sold, "{books:?}");

    let control = interleave(connect, false, "control").await;
    assert!(control.stale_write.is_ok(), "{control:?}");
    assert_eq!(control.sold, 2);
    assert_eq!(
        control.decrease, 1,
        "without the fence the same interleaving should lose an update: {control:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_redis_with_the_data_on_another() {
    let (locks, data) = (RedisServer::start(), RedisServer::start());
    let connect = connect(
        locks_on(locks.url(), RedisStore::connect),
        data_on(data.url()),
    );
    stale_holder_is_refused(connect).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlock_locks_with_the_data_on_one_redis() {
    let nodes: Vec<RedisServer> = (0..3).map(|_| RedisServer::start()).collect();
    let data = RedisServer::start();
    let urls: Vec<String> = nodes.iter().map(RedisServer::url).collect();
    let connect = connect(locks_on(urls, RedlockStore::connect), data_on(data.url()));
    stale_holder_is_refused(connect).await;
}

#[cfg(feature = "sentinel")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sentinel_master() {
    use tower_lock::store::SentinelStore;
    use tower_lock_testkit::{SentinelSetup, sentinel::MASTER_NAME};

    let setup =
        tokio::task::block_in_place(|| Arc::new(SentinelSetup::start(Duration::from_secs(5))));
    let store = {
        let setup = Arc::clone(&setup);
        move || {
            let setup = Arc::clone(&setup);
            async move {
                SentinelStore::connect(setup.sentinel_urls(), MASTER_NAME)
                    .await
                    .unwrap()
            }
        }
    };
    let connect = locks_and_data_on(store);
    stale_holder_is_refused(connect).await;
}

#[cfg(feature = "cluster")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_slot() {
    use tower_lock::store::ClusterStore;
    use tower_lock_testkit::RedisCluster;

    let cluster = tokio::task::block_in_place(|| RedisCluster::start(3, 0));
    let urls = cluster.urls();
    let store = move || {
        let urls = urls.clone();
        async move { ClusterStore::connect(urls).await.unwrap() }
    };
    let connect = locks_and_data_on(store);
    stale_holder_is_refused(Arc::clone(&connect)).await;

    // A batch over resources of two slots cannot be one step on a cluster: refused before it is
    // sent, and nothing is written.
    let (locker, data) = connect().await;
    let (a, b) = (
        locker.key("sku", "a").unwrap(),
        locker.key("sku", "b").unwrap(),
    );
    assert_ne!(cluster.slot(a.as_bytes()), cluster.slot(b.as_bytes()));
    let lease = locker.acquire([a.clone(), b.clone()]).await.unwrap();
    let answer = data
        .batch(&lease)
        .set(data_key("stock:", &a), "1")
        .set(data_key("stock:", &b), "1")
        .apply()
        .await;
    assert!(matches!(answer, Err(FenceError::Invalid(_))), "{answer:?}");
    // One slot at a time, each guarded by its own key's token.
    for key in [&a, &b] {
        data.batch_on(&lease, [key])
            .set(data_key("stock:", key), "1")
            .apply()
            .await
            .unwrap();
    }
    lease.release().await.unwrap();
}

/// A batch applies whole or not at all: every operation checked against what its key will hold
/// before anything is written. The same rules in Redis's script and in memory.
async fn whole_or_nothing(locker: Locker, data: FencedData) {
    let key = locker.key("sku", "kiwi").unwrap();
    let lease = locker.acquire(key.clone()).await.unwrap();
    let applied = data
        .batch(&lease)
        .set("s", "1")
        .incr_by("n", 41)
        .incr_by("n", 1)
        .hset("h", "f", "v")
        .hget("h", "f")
        .rpush("l", "a")
        .rpush("l", "b")
        .del("s")
        .get("s")
        .apply()
        .await
        .unwrap();
    let replies: Vec<Reply> = applied.iter().cloned().collect();
    assert_eq!(
        replies,
        [
            Reply::Done,
            Reply::Int(41),
            Reply::Int(42),
            Reply::Int(1),
            Reply::Data("v".into()),
            Reply::Int(1),
            Reply::Int(2),
            Reply::Int(1),
            Reply::Nil,
        ]
    );
    // Counters INCRBY itself would refuse (a sign but '-', a leading zero, '-0', beyond i64):
    // refused before anything is written, not half way through the batch.
    data.unfenced_batch()
        .set("z0", "007")
        .set("z1", "-0")
        .set("z2", "+5")
        .set("z3", "9300000000000000000")
        .apply()
        .await
        .unwrap();
    // The lock's own keys are not data: its lock key (a data key named with the lock keys'
    // prefix), its fence, the fencing counter.
    assert!(key.as_bytes().starts_with(b"tower-lock:{"));
    let lock_key = data_key("tower-lock:", &key);
    assert_eq!(lock_key, key.as_bytes(), "the data key is the lock key");
    let fence_key = {
        let bytes = key.as_bytes();
        let tag_end = bytes.iter().position(|&b| b == b'}').unwrap() + 1;
        [&bytes[..tag_end], b"data-fence:", &bytes[tag_end..]].concat()
    };
    let mut wrong = Vec::new();
    for (i, bad) in [
        data.batch(&lease).set("x", "1").incr_by("z0", 1),
        data.batch(&lease).set("x", "1").incr_by("z1", 1),
        data.batch(&lease).set("x", "1").incr_by("z2", 1),
        data.batch(&lease)
            .set("x", "1")
            .incr_by("z3", -9_000_000_000_000_000_000),
        data.batch(&lease)
            .set("x", "1")
            .set("y", "010")
            .incr_by("y", 1),
        data.batch(&lease).set("x", "1").set(&lock_key, "1"),
        data.batch(&lease).set("x", "1").del(&fence_key),
        data.batch(&lease)
            .set("x", "1")
            .set("tower-lock:fence", "1"),
        data.batch_on(&lease, []).set("x", "1"),
        data.batch(&lease).set("x", "1").hset("l", "f", "v"),
        data.batch(&lease).set("x", "1").incr_by("h", 1),
        data.batch(&lease)
            .set("x", "1")
            .set("y", "a")
            .incr_by("y", 1),
        data.batch(&lease).set("x", "1").incr_by("n", i64::MAX),
        data.batch(&lease).set("x", "1").rpush("h", "v"),
        data.batch(&lease).set("x", "1").get("l"),
    ]
    .into_iter()
    .enumerate()
    {
        let answer = bad.apply().await;
        let x = data.unfenced_batch().get("x").apply().await.unwrap();
        if !matches!(answer, Err(FenceError::Invalid(_))) || x.get(0) != Some(&Reply::Nil) {
            wrong.push(format!("batch {i}: {answer:?}, x = {:?}", x.get(0)));
        }
        data.unfenced_batch().del("x").apply().await.unwrap();
    }
    assert!(
        wrong.is_empty(),
        "batches not refused whole (Invalid, nothing written):\n{}",
        wrong.join("\n")
    );
    // The lease is intact: no batch touched its lock key.
    lease
        .release()
        .await
        .expect("the lock key no longer held the lease's token");
}

#[tokio::test]
async fn whole_or_nothing_in_memory() {
    whole_or_nothing(Locker::new(MemoryStore::new()), FencedData::in_memory()).await;
}

/// The script's own rules, on one Redis: a batch applies whole or not at all, reads fence too,
/// and reading what does not exist leaves nothing behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_scripts_rules() {
    let server = RedisServer::start();
    let store = RedisStore::connect(server.url()).await.unwrap();
    let locker = Locker::new(store.clone());
    let data = FencedData::new(store);
    whole_or_nothing(locker.clone(), data.clone()).await;

    let mut conn = server.client().await;
    let fence_keys = async |conn: &mut redis::aio::MultiplexedConnection| -> Vec<String> {
        redis::cmd("KEYS")
            .arg("*}data-fence:*")
            .query_async(conn)
            .await
            .unwrap()
    };
    assert_eq!(fence_keys(&mut conn).await.len(), 1, "the kiwi's fence");
    // Reading what does not exist, under a lease: no fence is left.
    let fig = locker.key("sku", "fig").unwrap();
    let lease = locker.acquire(fig.clone()).await.unwrap();
    let read = data.batch(&lease).get("nothing").apply().await.unwrap();
    assert_eq!(read.get(0), Some(&Reply::Nil));
    assert_eq!(
        fence_keys(&mut conn).await.len(),
        1,
        "a read of nothing left a fence"
    );
    lease.release().await.unwrap();
    // A newer holder that only reads raises the fence to its token.
    // `<prefix>{<tag>}data-fence:<rest of the lock key>`.
    let fig_fence = {
        let key = fig.as_bytes();
        let tag_end = key.iter().position(|&b| b == b'}').unwrap() + 1;
        [&key[..tag_end], b"data-fence:", &key[tag_end..]].concat()
    };
    let older = locker.acquire(fig.clone()).await.unwrap();
    data.batch(&older).set("fig", "1").apply().await.unwrap();
    let older_token = older.fencing_token();
    drop(older);
    tokio::time::sleep(Duration::from_millis(50)).await;
    let newer = locker.acquire(fig).await.unwrap();
    assert!(newer.fencing_token() > older_token);
    data.batch(&newer).get("fig").apply().await.unwrap();
    let fence: String = redis::cmd("GET")
        .arg(&fig_fence)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(fence, newer.fencing_token().to_string());
}

/// With `wait_for_replicas`, a read that raises a fence waits for the replicas as a write does.
/// A fence raised on the master alone can be lost in a failover; then a stale holder's write is
/// accepted on the new master after a newer holder's read, and the newer one's write lands over
/// it: a lost update, though every batch was fenced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fence_raised_by_a_read_waits_for_the_replicas() {
    let master = RedisServer::start();
    let mut replica = RedisServer::replica_of(&master);
    let store = RedisStore::connect(master.url())
        .await
        .unwrap()
        .wait_for_replicas(1, Duration::from_millis(300))
        .unwrap();
    let locker = Locker::new(store.clone());
    let data = FencedData::new(store);
    let plum = locker.key("sku", "plum").unwrap();
    let stock = data_key("stock:", &plum);

    let older = locker.acquire(plum.clone()).await.unwrap();
    data.batch(&older).set(&stock, "5").apply().await.unwrap();
    older.release().await.unwrap();
    tokio::time::sleep(Duration::from_millis(5)).await;
    let newer = locker.acquire(plum).await.unwrap();
    // From here no replica acknowledges anything.
    replica.kill();
    let read = data.batch(&newer).get(&stock).apply().await;
    assert!(
        matches!(read, Err(FenceError::Store(_))),
        "a read that raised the fence on the master alone answered {read:?}"
    );
}
