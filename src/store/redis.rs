use std::{
    collections::HashMap,
    fmt,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use bb8_redis::{RedisConnectionManager, bb8};
use redis::{
    Client, Cmd, ErrorKind, FromRedisValue, IntoConnectionInfo, Pipeline, RedisError, Script,
    ServerErrorKind, Value,
    aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig, MultiplexedConnection},
};
use tokio::{
    runtime::Handle,
    sync::{OnceCell, watch},
};

use super::{
    Acquire, LockStore, QueueWatch, StoreError, StoreErrorKind,
    handoff::{self, Handoff},
};
use crate::{concat::Concat, key::LockKey, token::Token};

/// Name of the fencing counters' keys, after the lock keys' prefix: one counter per hash slot,
/// `<prefix>fence:{<n>}`, in the slot of the lock keys it counts for.
const FENCE_COUNTER: &[u8] = b"fence:";

/// Suffix of a lock key's own counter (`<lock key>:fence`), used instead when the key prefix
/// holds braces (only possible through `LockKey::new`; the config refuses them), which would
/// move `<prefix>fence:{<n>}` to another slot.
const FENCE_SUFFIX: &[u8] = b":fence";

/// Suffix of the hand-off queue's key, next to the lock key (same hash slot).
const QUEUE_SUFFIX: &[u8] = b":queue";

/// How long a key handed to a waiter stays reserved for it unless it confirms (default).
const DEFAULT_CLAIM_WINDOW: Duration = Duration::from_secs(1);

/// Leases held in Redis, shared by every instance that uses the same server.
///
/// # Transports
///
/// | constructor | transport | round trips per uncontended request |
/// |---|---|---|
/// | [`connect`](Self::connect) (default) | one [`ConnectionManager`]: multiplexed, reconnects by itself | 2 |
/// | [`from_connection_manager`](Self::from_connection_manager) | your `ConnectionManager` | 2 |
/// | [`from_multiplexed`](Self::from_multiplexed) | your `MultiplexedConnection` (does not reconnect) | 2 |
/// | [`from_pool`](Self::from_pool) | a bb8-redis pool, one checkout per command | 2, plus a `PING` per checkout if the pool tests on checkout |
///
/// The default is one multiplexed connection because it is both the fastest and the cheapest:
/// measured on a 2-core machine (axum, `wrk -c50`, one `SET NX PX` and one compare-and-delete per
/// request), one shared multiplexed connection served 41.5k req/s, bb8-redis with
/// `test_on_check_out(false)` 18.6k, and bb8-redis with its defaults 12.9k (it sends a `PING` on
/// every checkout, so 4 round trips per request). Redis pipelines the commands of concurrent
/// requests on the one connection. Use a pool when you already have one, and build it with
/// [`pool_builder`](Self::pool_builder), which turns the checkout `PING` off and bounds the
/// connection timeout.
///
/// # Keys and scripts
///
/// A lease is the key [`LockKey::as_bytes`] set to the holder's token with `SET NX PX`; renew and
/// release are Lua compare-and-`PEXPIRE` and compare-and-`DEL`, sent as `EVALSHA` and reloaded
/// by `redis::Script` if the server answers `NOSCRIPT` (after `SCRIPT FLUSH` or a restart).
/// Fencing tokens come from one counter per hash slot, `<prefix>fence:{<n>}` (with `<n>` chosen
/// to hash to the slot: at most 16,384 such keys), kept for
/// [`fence_retention`](Self::fence_retention) (default 24 h) after their last use: a released
/// lock leaves no key behind, however many distinct keys are locked, and every script touches
/// one slot only. Tokens are `max(last + 1, server time in µs)`, so they keep increasing after
/// the counter expires, as long as the Redis server's clock does not step back. With
/// [`handoff`](Self::handoff) on (the default for [`connect`](Self::connect)), waiters queue in
/// `<lock key>:queue` and a release hands the key to the first of them.
///
/// # Replicas
///
/// A master's replicas copy its writes asynchronously: a failover to a replica that had not yet
/// received a lease forgets it. [`wait_for_replicas`](Self::wait_for_replicas) sends
/// `WAIT numreplicas timeout` in the same round trip as each acquire and renewal and treats
/// too few acknowledgements as a failure (the acquired key is released and the layer answers
/// 503). See `docs/TOPOLOGY.md`.
///
/// # Native compare commands
///
/// On servers that have them, renew and release use the server's own compare commands instead
/// of Lua: `SET key token IFEQ token PX ttl` (Valkey 8.1+, Redis 8.4+), `DELIFEQ key token`
/// (Valkey 9+), `DELEX key IFEQ token` (Redis 8.4+). The server is asked once per store
/// (`INFO server`, at the first renew or release); older servers, and any error from a native
/// command, mean Lua. Acquire is always Lua: it also hands out the fencing token.
/// [`native_commands(false)`](Self::native_commands) turns detection off.
#[derive(Clone)]
pub struct RedisStore {
    transport: Transport,
    scripts: Arc<Scripts>,
    fence_retention: Duration,
    replicas: Option<ReplicaAcks>,
    native: Arc<NativeState>,
    /// The hand-off queue's signals, when on (`handoff`).
    handoff: Option<Arc<Handoff>>,
    claim_window: Duration,
    /// The server's address, for the hand-off's own connection (stores made by `connect`).
    client: Option<Client>,
}

#[derive(Clone)]
enum Transport {
    Manager(ConnectionManager),
    Multiplexed(MultiplexedConnection),
    Pool(bb8::Pool<RedisConnectionManager>),
    #[cfg(feature = "cluster")]
    Cluster(redis::cluster_async::ClusterConnection),
}

/// `WAIT numreplicas timeout` after each acquire and renewal.
#[derive(Debug, Clone, Copy)]
struct ReplicaAcks {
    replicas: usize,
    timeout: Duration,
}

/// Which compare commands the server has, asked once.
#[derive(Debug, Default)]
struct NativeState {
    /// `false` when turned off, or after a native command failed.
    enabled: AtomicBool,
    detected: OnceCell<Native>,
}

/// The server's native compare commands, from its `INFO server`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Native {
    /// `SET key value IFEQ value PX ttl`.
    set_ifeq: bool,
    release: Option<NativeRelease>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum NativeRelease {
    /// Valkey 9: `DELIFEQ key value`.
    DelIfEq,
    /// Redis 8.4: `DELEX key IFEQ value`.
    DelEx,
}

impl Native {
    /// Reads `INFO server`: Valkey reports `server_name:valkey` and `valkey_version`, Redis
    /// only `redis_version` (Valkey's `redis_version` is a fixed 7.2.x for compatibility).
    fn from_info(info: &str) -> Self {
        let field = |name: &str| {
            info.lines()
                .find_map(|line| line.trim().strip_prefix(name)?.strip_prefix(':'))
                .map(str::trim)
        };
        let version = |v: &str| -> Option<(u32, u32)> {
            let mut parts = v.split('.').map(|p| p.parse::<u32>().ok());
            Some((parts.next()??, parts.next().flatten().unwrap_or(0)))
        };
        let is_valkey = field("server_name").is_some_and(|n| n.eq_ignore_ascii_case("valkey"));
        if is_valkey {
            let Some(v) = field("valkey_version").and_then(version) else {
                return Self::default();
            };
            Self {
                set_ifeq: v >= (8, 1),
                release: (v >= (9, 0)).then_some(NativeRelease::DelIfEq),
            }
        } else {
            let Some(v) = field("redis_version").and_then(version) else {
                return Self::default();
            };
            let new = v >= (8, 4);
            Self {
                set_ifeq: new,
                release: new.then_some(NativeRelease::DelEx),
            }
        }
    }
}

impl Transport {
    /// See [`RedisStore::query`].
    async fn query(&self, request: Request<'_>) -> Result<Result<Value, RedisError>, StoreError> {
        async fn run(
            request: Request<'_>,
            conn: &mut impl ConnectionLike,
        ) -> Result<Value, RedisError> {
            match request {
                Request::Cmd(cmd) => cmd.query_async(conn).await,
                Request::Pipe(pipe) => pipe.query_async(conn).await,
                Request::Load(script) => script
                    .load_async(conn)
                    .await
                    .map(|sha| Value::BulkString(sha.into_bytes())),
            }
        }
        Ok(match (self, request) {
            // A single command straight to the connection: `query_async` would go through
            // `ConnectionLike`, which boxes every command's future (an allocation above the
            // allocator's per-thread cache, per command).
            (Self::Manager(conn), Request::Cmd(cmd)) => conn
                .clone()
                .send_packed_command(cmd)
                .await
                .and_then(Value::extract_error),
            (Self::Multiplexed(conn), Request::Cmd(cmd)) => conn
                .clone()
                .send_packed_command(cmd)
                .await
                .and_then(Value::extract_error),
            (Self::Manager(conn), request) => run(request, &mut conn.clone()).await,
            (Self::Multiplexed(conn), request) => run(request, &mut conn.clone()).await,
            #[cfg(feature = "cluster")]
            (Self::Cluster(conn), request) => run(request, &mut conn.clone()).await,
            (Self::Pool(pool), request) => {
                let mut conn = pool.get().await.map_err(|e| match e {
                    bb8::RunError::User(e) => redis_error(e),
                    bb8::RunError::TimedOut => StoreError::msg(
                        StoreErrorKind::Timeout,
                        "timed out waiting for a Redis connection from the pool",
                    ),
                })?;
                run(request, &mut *conn).await
            }
        })
    }
}

/// One request on the store's transport.
enum Request<'a> {
    Cmd(&'a Cmd),
    Pipe(&'a Pipeline),
    Load(&'a Script),
}

/// Too few replicas acknowledged a write within the `WAIT` timeout.
#[derive(Debug)]
struct TooFewReplicas {
    wanted: usize,
    acknowledged: i64,
    timeout: Duration,
}

impl fmt::Display for TooFewReplicas {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "WAIT: {} of {} replicas acknowledged within {:?}",
            self.acknowledged, self.wanted, self.timeout
        )
    }
}

impl std::error::Error for TooFewReplicas {}

struct Scripts {
    acquire: Script,
    renew: Script,
    renew_many: Script,
    release: Script,
    /// This store's loads of each script, by hash (see `RedisStore::reload`).
    loads: Mutex<HashMap<String, Load>>,
}

/// This store's loads of one script.
#[derive(Default)]
struct Load {
    /// When the last one finished.
    done_at: Option<Instant>,
    /// The one in flight: its sender is dropped when it finishes.
    running: Option<watch::Receiver<()>>,
}

/// The longest a shared script load may take before the next call that needs it starts another.
const LOAD_TIMEOUT: Duration = Duration::from_secs(2);

/// The fencing token function, first in every script that takes or gives up a lock.
const FENCE_LUA: &str = include_str!("scripts/fence.lua");

/// The hand-off functions, inserted at a lock script's `-- @handoff` line (after its fast path).
const HANDOFF_LUA: &str = include_str!("scripts/handoff.lua");

const ACQUIRE_LUA: &str = include_str!("scripts/acquire.lua");
const RELEASE_LUA: &str = include_str!("scripts/release.lua");
const RENEW_LUA: &str = include_str!("scripts/renew.lua");
const RENEW_MANY_LUA: &str = include_str!("scripts/renew_many.lua");

/// A script that takes or gives up a lock: the fencing function, then `body` with the hand-off
/// functions in place of its `-- @handoff` line.
pub(crate) fn lock_script(body: &str) -> Script {
    Script::new(&lock_script_source(body))
}

/// The text [`lock_script`] loads.
pub(crate) fn lock_script_source(body: &str) -> String {
    debug_assert!(
        body.contains("-- @handoff\n"),
        "a lock script without -- @handoff"
    );
    format!(
        "{FENCE_LUA}{}",
        body.replacen("-- @handoff\n", HANDOFF_LUA, 1)
    )
}

/// The text of one of this store's scripts exactly as it loads it, by name (`acquire`,
/// `release`, `renew`, `renew_many`): for the protocol model in `tests/protocol_model.rs`,
/// which runs the very scripts the store runs.
pub(crate) fn script_source(name: &str) -> Option<String> {
    Some(match name {
        "acquire" => lock_script_source(ACQUIRE_LUA),
        "release" => lock_script_source(RELEASE_LUA),
        "renew" => RENEW_LUA.to_owned(),
        "renew_many" => RENEW_MANY_LUA.to_owned(),
        _ => return None,
    })
}

impl Scripts {
    fn new() -> Arc<Self> {
        Arc::new(Self {
            acquire: lock_script(ACQUIRE_LUA),
            renew: Script::new(RENEW_LUA),
            renew_many: Script::new(RENEW_MANY_LUA),
            release: lock_script(RELEASE_LUA),
            loads: Mutex::default(),
        })
    }
}

impl RedisStore {
    /// Connects to `url` (`redis://host:port/db`) with one auto-reconnecting multiplexed
    /// connection, the recommended transport.
    ///
    /// The connection times out connecting after 1 s and waiting for a reply after 2 s; the
    /// layer bounds each operation more tightly still (its wait deadline and store timeout).
    /// Fails if the server cannot be reached now.
    pub async fn connect<T: IntoConnectionInfo>(url: T) -> Result<Self, StoreError> {
        Ok(Self::connect_plain(url).await?.handoff(true))
    }

    /// Like [`connect`](Self::connect), without hand-off (for Redlock's nodes and Sentinel's
    /// masters, which do not queue).
    pub(crate) async fn connect_plain<T: IntoConnectionInfo>(url: T) -> Result<Self, StoreError> {
        let client = Client::open(url).map_err(redis_error)?;
        let manager = ConnectionManager::new_with_config(client.clone(), manager_config())
            .await
            .map_err(redis_error)?;
        Ok(Self::from_connection_manager(manager).knowing(client))
    }

    /// Like [`connect`](Self::connect), but connects at the first command instead of now, and
    /// without hand-off (for Redlock's nodes, which do not queue).
    pub(crate) fn connect_lazy<T: IntoConnectionInfo>(url: T) -> Result<Self, StoreError> {
        let client = Client::open(url).map_err(redis_error)?;
        let manager = ConnectionManager::new_lazy_with_config(client.clone(), manager_config())
            .map_err(redis_error)?;
        Ok(Self::from_connection_manager(manager).knowing(client))
    }

    /// Uses an existing [`ConnectionManager`] (clones share its one connection).
    pub fn from_connection_manager(manager: ConnectionManager) -> Self {
        Self::with(Transport::Manager(manager))
    }

    /// Uses an existing [`MultiplexedConnection`]. It does not reconnect: prefer a
    /// [`ConnectionManager`] for long-running services.
    pub fn from_multiplexed(connection: MultiplexedConnection) -> Self {
        Self::with(Transport::Multiplexed(connection))
    }

    /// Uses a bb8-redis pool, checking out a connection for each command.
    ///
    /// A pool built with bb8's defaults sends a `PING` on every checkout and may wait 30 s for a
    /// connection; build it with [`pool_builder`](Self::pool_builder) instead. The layer bounds
    /// every checkout by its own deadline either way.
    pub fn from_pool(pool: bb8::Pool<RedisConnectionManager>) -> Self {
        Self::with(Transport::Pool(pool))
    }

    /// A bb8 pool builder with the settings this store needs: no `PING` on checkout, and a
    /// 1 s connection timeout instead of 30 s.
    ///
    /// ```no_run
    /// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
    /// use bb8_redis::RedisConnectionManager;
    /// use tower_lock::RedisStore;
    ///
    /// let manager = RedisConnectionManager::new("redis://127.0.0.1/")?;
    /// let pool = RedisStore::pool_builder().max_size(16).build(manager).await?;
    /// let store = RedisStore::from_pool(pool);
    /// # let _ = store; Ok(()) }
    /// ```
    pub fn pool_builder() -> bb8::Builder<RedisConnectionManager> {
        bb8::Pool::builder()
            .test_on_check_out(false)
            .connection_timeout(Duration::from_secs(1))
    }

    /// How long the fencing counter is kept after its last acquisition (default 24 h).
    ///
    /// Fencing tokens stay increasing without it (they follow the server clock); the counter only
    /// guards against the clock stepping back by less than this.
    #[must_use]
    pub fn fence_retention(mut self, retention: Duration) -> Self {
        self.fence_retention = retention.max(Duration::from_millis(1));
        self
    }

    /// After each acquire and renewal, waits until `replicas` replicas have acknowledged it, for
    /// at most `timeout`, with `WAIT` (sent in the same round trip).
    ///
    /// Fewer acknowledgements make the acquire fail: the key is released and the layer answers
    /// 503 (a [`StoreError`] of kind [`Unavailable`](StoreErrorKind::Unavailable)); a renewal
    /// that is not acknowledged in time is an error, retried while the lease is valid. `WAIT`
    /// holds the connection until it answers, so with one multiplexed connection concurrent
    /// requests queue behind it; keep `timeout` small (the replication round trip, a few ms on
    /// a LAN). `WAIT` makes a lost lease after failover much less likely, not impossible: a
    /// replica that acknowledged may still not be the one promoted.
    ///
    /// ```no_run
    /// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
    /// use std::time::Duration;
    /// use tower_lock::RedisStore;
    ///
    /// let store = RedisStore::connect("redis://127.0.0.1/")
    ///     .await?
    ///     .wait_for_replicas(1, Duration::from_millis(50));
    /// # let _ = store; Ok(()) }
    /// ```
    #[must_use]
    pub fn wait_for_replicas(mut self, replicas: usize, timeout: Duration) -> Self {
        self.replicas = (replicas > 0).then_some(ReplicaAcks {
            replicas,
            timeout: timeout.max(Duration::from_millis(1)),
        });
        self
    }

    /// Whether to use the server's native compare commands for renew and release where it has
    /// them (default `true`); `false` always uses Lua.
    #[must_use]
    pub fn native_commands(self, enabled: bool) -> Self {
        Self {
            native: Arc::new(NativeState {
                enabled: AtomicBool::new(enabled),
                detected: OnceCell::new(),
            }),
            ..self
        }
    }

    /// Hands a released key straight to the next waiter, first come first served (default
    /// `true` for stores made by [`connect`](Self::connect); other constructors do not know
    /// the server's address and cannot turn it on).
    ///
    /// With hand-off, a waiter that finds its key held joins the key's queue in Redis
    /// (`<lock key>:queue`, in the same script as its attempt), and the holder's release gives
    /// the key to the head of the queue instead of freeing it, and tells that waiter on pub/sub
    /// (each store subscribes once, to a channel of its own, on one extra RESP3 connection
    /// opened by `connect`: Redis 6 or later; on older servers waiters use their timers). The
    /// waiter runs at once: the key is reserved for it for the
    /// [`claim_window`](Self::claim_window), and its first renewal, due within a third of that,
    /// confirms it for the full TTL. So under contention every acquisition costs about two
    /// commands (the attempt that queues, the release that hands over), waiters take turns
    /// fairly, and nobody polls: a waiter's timer only backs up a lost message, firing when the
    /// holder's lease would run out. A waiter that gives up leaves the queue with its release;
    /// a waiter whose process died is skipped (nobody hears its message), and one whose
    /// process hangs before claiming delays the next one by the claim window.
    ///
    /// Every instance that shares the locks must agree on this setting: a store without
    /// hand-off takes a free key even when others queue for it, and frees keys on release
    /// instead of handing them on (waiters then fall back to their timers). See
    /// `docs/DECISIONS.md`.
    #[must_use]
    pub fn handoff(mut self, enabled: bool) -> Self {
        self.handoff = match (&self.client, enabled) {
            (Some(client), true) => {
                let handoff = Handoff::new(client.clone());
                handoff.start();
                Some(handoff)
            }
            _ => None,
        };
        self
    }

    /// How long a key handed to a waiter stays reserved for it before it must confirm
    /// (default 1 s). A waiter that was queued for longer than about half of this confirms
    /// before it runs (one more command); a waiter whose process hangs delays the queue by this
    /// long.
    /// Shorter than the TTL; every instance should use the same.
    #[must_use]
    pub fn claim_window(mut self, window: Duration) -> Self {
        self.claim_window = window.max(Duration::from_millis(10));
        self
    }

    fn knowing(mut self, client: Client) -> Self {
        self.client = Some(client);
        self
    }

    /// The keys and arguments a lock script adds for the hand-off queue (none when off): the
    /// fencing counter and the queue; the claim window and the counter's retention.
    pub(crate) fn handoff_keys(&self, key: &LockKey) -> Option<NextTo> {
        self.handoff.as_ref()?;
        Some(NextTo::new(key))
    }

    /// The arguments that go with [`handoff_keys`](Self::handoff_keys).
    pub(crate) fn handoff_args(&self) -> [Ms; 2] {
        [ms(self.claim_window), ms(self.fence_retention)]
    }

    #[cfg(feature = "cluster")]
    pub(crate) fn from_cluster(connection: redis::cluster_async::ClusterConnection) -> Self {
        Self::with(Transport::Cluster(connection))
    }

    fn with(transport: Transport) -> Self {
        Self {
            transport,
            scripts: Scripts::new(),
            fence_retention: Duration::from_secs(24 * 60 * 60),
            replicas: None,
            native: Arc::new(NativeState {
                enabled: AtomicBool::new(true),
                detected: OnceCell::new(),
            }),
            handoff: None,
            claim_window: DEFAULT_CLAIM_WINDOW,
            client: None,
        }
    }

    /// Sends one request. The outer error is the transport's (no pooled connection); the inner
    /// one is Redis's answer.
    async fn query(&self, request: Request<'_>) -> Result<Result<Value, RedisError>, StoreError> {
        self.transport.query(request).await
    }

    /// Runs `script` with `EVALSHA` (loading it on `NOSCRIPT`), followed in the same round trip
    /// by `WAIT` when `replicate` and replica acknowledgement is on; returns the script's answer
    /// and the number of acknowledgements. `pub(crate)` for the idempotency records
    /// (`crate::idempotency`), which run their own scripts on this transport.
    pub(crate) async fn invoke<T: FromRedisValue>(
        &self,
        script: &Script,
        keys: &[&[u8]],
        args: &[&[u8]],
        replicate: bool,
    ) -> Result<(T, Option<i64>), StoreError> {
        let size = 64
            + keys.iter().map(|k| k.len()).sum::<usize>()
            + args.iter().map(|a| a.len()).sum::<usize>();
        let mut eval = Cmd::with_capacity(3 + keys.len() + args.len(), size);
        eval.arg("EVALSHA").arg(script.get_hash()).arg(keys.len());
        for key in keys {
            eval.arg(*key);
        }
        for arg in args {
            eval.arg(*arg);
        }
        let wait = self.replicas.filter(|_| replicate);
        let pipe = wait.map(|acks| {
            let mut pipe = redis::pipe();
            pipe.add_command(eval.clone())
                .cmd("WAIT")
                .arg(acks.replicas)
                .arg(acks.timeout.as_millis().max(1).to_string());
            pipe
        });
        let request = || match &pipe {
            Some(pipe) => Request::Pipe(pipe),
            None => Request::Cmd(&eval),
        };
        let sent_at = Instant::now();
        let mut answer = self.query(request()).await?;
        if is_no_script(&answer) {
            self.reload(script, sent_at).await;
            answer = self.query(request()).await?;
            if is_no_script(&answer) {
                // Flushed again meanwhile, or the shared load failed or reached another server
                // than this call (a pool's connections, a failover): load it ourselves.
                self.query(Request::Load(script))
                    .await?
                    .map_err(redis_error)?;
                answer = self.query(request()).await?;
            }
        }
        let answer = answer.map_err(redis_error)?;
        if pipe.is_some() {
            let (value, acks): (T, i64) =
                redis::from_redis_value(answer).map_err(|e| redis_error(e.into()))?;
            Ok((value, Some(acks)))
        } else {
            let value = redis::from_redis_value(answer).map_err(|e| redis_error(e.into()))?;
            Ok((value, None))
        }
    }

    /// Fails with a [`TooFewReplicas`] source when `WAIT` counted fewer than asked for.
    fn check_acks(&self, acks: Option<i64>) -> Result<(), StoreError> {
        match (self.replicas, acks) {
            (Some(want), Some(got)) if got < i64::try_from(want.replicas).unwrap_or(i64::MAX) => {
                Err(StoreError::new(
                    StoreErrorKind::Unavailable,
                    "too few Redis replicas acknowledged the lease",
                    TooFewReplicas {
                        wanted: want.replicas,
                        acknowledged: got,
                        timeout: want.timeout,
                    },
                ))
            }
            _ => Ok(()),
        }
    }

    /// Has `script` loaded after a call sent at `sent_at` met NOSCRIPT, unless this store
    /// loaded it since. After a restart or `SCRIPT FLUSH` every call in flight meets NOSCRIPT at
    /// once: the first starts a load in a task of its own, the others wait for that same load
    /// (never for each other), then all send their call again, so the server sees one
    /// `SCRIPT LOAD` per script, not one per call. A failed or timed-out load is not reported
    /// here: the caller's second attempt meets NOSCRIPT and loads the script itself.
    async fn reload(&self, script: &Script, sent_at: Instant) {
        let mut running = {
            let mut loads = self.scripts.loads.lock().unwrap_or_else(|p| p.into_inner());
            let load = loads.entry(script.get_hash().to_owned()).or_default();
            // Loaded after our call was sent: our call ran before the load, send it again.
            if load.done_at.is_some_and(|done| done > sent_at) {
                return;
            }
            // A load whose task died with its runtime counts as none.
            let live = load.running.as_ref().filter(|r| r.has_changed().is_ok());
            match live {
                Some(running) => running.clone(),
                None => {
                    let Ok(runtime) = Handle::try_current() else {
                        return;
                    };
                    let (done, running) = watch::channel(());
                    let (transport, script) = (self.transport.clone(), script.clone());
                    let scripts = Arc::downgrade(&self.scripts);
                    runtime.spawn(async move {
                        let loaded = tokio::time::timeout(
                            LOAD_TIMEOUT,
                            transport.query(Request::Load(&script)),
                        )
                        .await;
                        if let Some(scripts) = scripts.upgrade() {
                            let mut loads = scripts.loads.lock().unwrap_or_else(|p| p.into_inner());
                            if let Some(load) = loads.get_mut(script.get_hash()) {
                                load.running = None;
                                if matches!(loaded, Ok(Ok(Ok(_)))) {
                                    load.done_at = Some(Instant::now());
                                }
                            }
                        }
                        drop(done);
                    });
                    load.running = Some(running.clone());
                    running
                }
            }
        };
        // Ends when the load does (its sender is dropped).
        let _ = running.changed().await;
    }

    /// The server's native compare commands, asked once (none when turned off or unknown).
    async fn native(&self) -> Native {
        if !self.native.enabled.load(Ordering::Relaxed) {
            return Native::default();
        }
        let detected = self
            .native
            .detected
            .get_or_try_init(|| async {
                let mut info = redis::cmd("INFO");
                info.arg("server");
                match self.query(Request::Cmd(&info)).await? {
                    Ok(value) => Ok(Native::from_info(&info_text(value))),
                    // A server that refuses INFO (ACLs) gets Lua.
                    Err(e) if e.kind() != ErrorKind::Io && !e.is_timeout() => Ok(Native::default()),
                    Err(e) => Err(redis_error(e)),
                }
            })
            .await;
        // Not reachable now: Lua this time, ask again next time.
        detected.copied().unwrap_or_default()
    }

    /// Runs a native command; `None` (and Lua from now on) if the server rejected it.
    async fn native_query(&self, cmd: &Cmd) -> Result<Option<Value>, StoreError> {
        match self.query(Request::Cmd(cmd)).await? {
            Ok(value) => Ok(Some(value)),
            Err(e) if matches!(e.kind(), ErrorKind::Server(_) | ErrorKind::Extension) => {
                tracing::warn!(
                    error = &e as &dyn std::error::Error,
                    "native compare command rejected; using Lua from now on"
                );
                self.native.enabled.store(false, Ordering::Relaxed);
                Ok(None)
            }
            Err(e) => Err(redis_error(e)),
        }
    }
}

/// `INFO`'s text; a cluster answers with one text per node, joined here.
fn info_text(value: Value) -> String {
    match value {
        Value::BulkString(bytes) => String::from_utf8_lossy(&bytes).into_owned(),
        Value::VerbatimString { text, .. } | Value::SimpleString(text) => text,
        Value::Array(items) | Value::Set(items) => items.into_iter().map(info_text).collect(),
        Value::Map(pairs) => pairs.into_iter().map(|(_, v)| info_text(v)).collect(),
        _ => String::new(),
    }
}

/// Whether Redis answered that it does not have the script (`NOSCRIPT`).
fn is_no_script(answer: &Result<Value, RedisError>) -> bool {
    matches!(answer, Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript))
}

/// The [`RedisStore::connect`] transport's settings.
fn manager_config() -> ConnectionManagerConfig {
    ConnectionManagerConfig::new()
        .set_connection_timeout(Some(Duration::from_secs(1)))
        .set_response_timeout(Some(Duration::from_secs(2)))
        .set_number_of_retries(2)
        .set_max_delay(Duration::from_millis(500))
}

pub(crate) fn redis_error(e: RedisError) -> StoreError {
    let kind = if e.is_timeout() {
        StoreErrorKind::Timeout
    } else if e.is_io_error() || e.is_connection_dropped() || e.is_connection_refusal() {
        StoreErrorKind::Unavailable
    } else {
        StoreErrorKind::Backend
    };
    StoreError::new(kind, "the Redis lock store failed", e)
}

/// A duration in whole milliseconds, as decimal text on the stack (no allocation per command).
pub(crate) struct Ms {
    digits: [u8; 20],
    start: usize,
}

impl std::ops::Deref for Ms {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        &self.digits[self.start..]
    }
}

fn ms(d: Duration) -> Ms {
    // Redis takes whole milliseconds; never round a non-zero duration down to 0.
    let mut n = u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1);
    let mut out = Ms {
        digits: [0; 20],
        start: 20,
    };
    while n > 0 {
        out.start -= 1;
        out.digits[out.start] = b'0' + (n % 10) as u8;
        n /= 10;
    }
    out
}

/// The keys a lock script touches next to a lock key, in one buffer (on the stack for keys of
/// usual length): the fencing counter of the key's hash slot (so that every script stays
/// single-slot, whatever the transport) and the key's hand-off queue.
pub(crate) struct NextTo {
    buf: Concat<NEXT_TO_INLINE>,
    split: usize,
}

/// Room for a prefix, a counter's name and a lock key of about 150 bytes.
const NEXT_TO_INLINE: usize = 224;

impl NextTo {
    fn new(key: &LockKey) -> Self {
        use super::slot;
        let (prefix, key) = (key.prefix(), key.as_bytes());
        let braced = prefix.iter().any(|&b| b == b'{' || b == b'}');
        let fence_len = if braced {
            key.len() + FENCE_SUFFIX.len()
        } else {
            prefix.len() + FENCE_COUNTER.len() + "{16383}".len()
        };
        let mut buf = Concat::with_capacity(fence_len + key.len() + QUEUE_SUFFIX.len());
        let split = if braced {
            buf.push(key);
            buf.push(FENCE_SUFFIX)
        } else {
            let mut digits = [0; 20];
            let tag = u64::from(slot::tag(slot::of(key)));
            buf.push(prefix);
            buf.push(FENCE_COUNTER);
            buf.push(b"{");
            buf.push(crate::key::decimal(tag, &mut digits));
            buf.push(b"}")
        };
        buf.push(key);
        buf.push(QUEUE_SUFFIX);
        Self { buf, split }
    }

    pub(crate) fn fence(&self) -> &[u8] {
        &self.buf.as_bytes()[..self.split]
    }

    pub(crate) fn queue(&self) -> &[u8] {
        &self.buf.as_bytes()[self.split..]
    }
}

impl RedisStore {
    /// One acquire script. With hand-off on, `place` queues the caller (`None`: do not queue).
    async fn attempt(
        &self,
        key: &LockKey,
        token: &Token,
        ttl: Duration,
        place: Option<Place<'_>>,
    ) -> Result<Acquire, StoreError> {
        let next_to = NextTo::new(key);
        let handoff = self.handoff.is_some();
        let all_keys = [key.as_bytes(), next_to.fence(), next_to.queue()];
        let keys = if handoff {
            &all_keys[..]
        } else {
            &all_keys[..2]
        };
        let (ttl_ms, retention, claim) = (ms(ttl), ms(self.fence_retention), ms(self.claim_window));
        let all_args: [&[u8]; 7] = match &place {
            Some(place) => [
                token.as_bytes(),
                &ttl_ms,
                &retention,
                &claim,
                &place.stamp,
                place.channel,
                if place.rescan { b"1" } else { b"0" },
            ],
            None => [
                token.as_bytes(),
                &ttl_ms,
                &retention,
                &claim,
                b"",
                b"",
                b"0",
            ],
        };
        let args = if handoff {
            &all_args[..]
        } else {
            &all_args[..3]
        };
        let ((answer, n), acks): ((i64, i64), _) =
            self.invoke(&self.scripts.acquire, keys, args, true).await?;
        if answer == 1
            && let Err(error) = self.check_acks(acks)
        {
            // Not replicated enough to survive a failover: give it back, report the failure.
            if let Err(release) = self.release(key, token).await {
                tracing::warn!(
                    error = &release as &dyn std::error::Error,
                    "releasing an unreplicated lease failed; it expires with its TTL"
                );
            }
            return Err(error);
        }
        // PTTL is -1 for a key without expiry and -2 for a key that just vanished.
        let expires_in = u64::try_from(n).ok().map(Duration::from_millis);
        Ok(match answer {
            1 => Acquire::Acquired {
                fencing_token: u64::try_from(n).unwrap_or(0),
            },
            2 => Acquire::Queued { expires_in },
            _ => Acquire::Held { expires_in },
        })
    }
}

/// Where a waiter joins a hand-off queue: its entry is its token, `stamp` and `channel`.
struct Place<'a> {
    stamp: [u8; 16],
    channel: &'a [u8],
    /// A later attempt, which may find the waiter queued already.
    rescan: bool,
}

impl LockStore for RedisStore {
    async fn acquire(
        &self,
        key: &LockKey,
        token: &Token,
        ttl: Duration,
    ) -> Result<Acquire, StoreError> {
        self.attempt(key, token, ttl, None).await
    }

    async fn enqueue(
        &self,
        key: &LockKey,
        token: &Token,
        ttl: Duration,
    ) -> Result<Acquire, StoreError> {
        // Queued only while this store listens: otherwise nobody would hear the hand-off.
        let place = self
            .handoff
            .as_ref()
            .filter(|h| h.is_live())
            .map(|h| Place {
                stamp: handoff::stamp(),
                channel: h.channel().as_bytes(),
                rescan: h.is_registered(token),
            });
        self.attempt(key, token, ttl, place).await
    }

    fn queue_watch(&self, _key: &LockKey, token: &Token) -> Option<QueueWatch> {
        // With replica acknowledgement, a handed-over key is confirmed (and acknowledged)
        // before the waiter runs: the release that handed it over did not wait for replicas.
        self.handoff
            .as_ref()?
            .register(token, self.replicas.is_some())
    }

    async fn renew(&self, key: &LockKey, token: &Token, ttl: Duration) -> Result<bool, StoreError> {
        // With WAIT on, renewals stay on Lua: one pipelined round trip either way.
        if self.replicas.is_none() && self.native().await.set_ifeq {
            let mut set = redis::cmd("SET");
            set.arg(key.as_bytes())
                .arg(token.as_bytes())
                .arg("IFEQ")
                .arg(token.as_bytes())
                .arg("PX")
                .arg(&*ms(ttl));
            if let Some(reply) = self.native_query(&set).await? {
                // OK when it matched, nil when it did not.
                return Ok(matches!(reply, Value::Okay | Value::SimpleString(_)));
            }
        }
        let (n, acks): (i64, _) = self
            .invoke(
                &self.scripts.renew,
                &[key.as_bytes()],
                &[token.as_bytes(), &ms(ttl)],
                true,
            )
            .await?;
        if n == 1 {
            self.check_acks(acks)?;
        }
        Ok(n == 1)
    }

    async fn release(&self, key: &LockKey, token: &Token) -> Result<bool, StoreError> {
        // A native delete cannot hand the key on, so with hand-off it is Lua.
        if let Some(native) = self
            .native()
            .await
            .release
            .filter(|_| self.handoff.is_none())
        {
            let mut del = match native {
                NativeRelease::DelIfEq => redis::cmd("DELIFEQ"),
                NativeRelease::DelEx => redis::cmd("DELEX"),
            };
            del.arg(key.as_bytes());
            if native == NativeRelease::DelEx {
                del.arg("IFEQ");
            }
            del.arg(token.as_bytes());
            if let Some(reply) = self.native_query(&del).await? {
                let n: i64 = redis::from_redis_value(reply).map_err(|e| redis_error(e.into()))?;
                return Ok(n == 1);
            }
        }
        let extra = self.handoff_keys(key);
        let args = self.handoff_args();
        let (n, _): (i64, _) = match &extra {
            Some(next_to) => {
                self.invoke(
                    &self.scripts.release,
                    &[key.as_bytes(), next_to.fence(), next_to.queue()],
                    &[token.as_bytes(), &args[0], &args[1]],
                    false,
                )
                .await?
            }
            None => {
                self.invoke(
                    &self.scripts.release,
                    &[key.as_bytes()],
                    &[token.as_bytes()],
                    false,
                )
                .await?
            }
        };
        Ok(n == 1)
    }

    /// One script for the whole batch (and one `WAIT`, with replica acknowledgement on). A
    /// cluster renews key by key: its keys live in different slots.
    async fn renew_many(
        &self,
        leases: &[(LockKey, Token)],
        ttl: Duration,
    ) -> Vec<Result<bool, StoreError>> {
        #[cfg(feature = "cluster")]
        let one_by_one = matches!(self.transport, Transport::Cluster(_));
        #[cfg(not(feature = "cluster"))]
        let one_by_one = false;
        if one_by_one || leases.len() == 1 {
            let renewals = leases
                .iter()
                .map(|(key, token)| self.renew(key, token, ttl));
            return futures_util::future::join_all(renewals).await;
        }
        let keys: Vec<&[u8]> = leases.iter().map(|(key, _)| key.as_bytes()).collect();
        let ttl = ms(ttl);
        let mut args: Vec<&[u8]> = Vec::with_capacity(leases.len() + 1);
        args.push(&ttl);
        args.extend(leases.iter().map(|(_, token)| token.as_bytes()));
        let answer: Result<(Vec<i64>, _), _> = self
            .invoke(&self.scripts.renew_many, &keys, &args, true)
            .await;
        match answer {
            Ok((renewed, acks)) if renewed.len() == leases.len() => {
                let replicated = self.check_acks(acks);
                renewed
                    .into_iter()
                    .map(|n| match n {
                        1 => replicated.clone().map(|()| true),
                        _ => Ok(false),
                    })
                    .collect()
            }
            Ok(_) => {
                let error = StoreError::msg(
                    StoreErrorKind::Backend,
                    "the batch renewal script answered for the wrong number of leases",
                );
                vec![Err(error); leases.len()]
            }
            Err(error) => vec![Err(error); leases.len()],
        }
    }
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let transport = match self.transport {
            Transport::Manager(_) => "ConnectionManager",
            Transport::Multiplexed(_) => "MultiplexedConnection",
            Transport::Pool(_) => "bb8::Pool",
            #[cfg(feature = "cluster")]
            Transport::Cluster(_) => "ClusterConnection",
        };
        f.debug_struct("RedisStore")
            .field("transport", &transport)
            .field("fence_retention", &self.fence_retention)
            .field("replicas", &self.replicas)
            .field("native", &self.native.detected.get())
            .field("handoff", &self.handoff)
            .field("claim_window", &self.claim_window)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use redis::Script;

    use super::{NEXT_TO_INLINE, Native, NativeRelease, NextTo, Scripts, script_source};
    use crate::{key::LockKey, store::slot};

    /// The protocol model (`tests/protocol_model.rs`) runs `script_source`'s text: it must be
    /// what the store loads, byte for byte (same SHA1, so the same `EVALSHA`).
    #[test]
    fn script_sources_are_what_the_store_loads() {
        let scripts = Scripts::new();
        for (name, script) in [
            ("acquire", &scripts.acquire),
            ("release", &scripts.release),
            ("renew", &scripts.renew),
            ("renew_many", &scripts.renew_many),
        ] {
            let source = script_source(name).unwrap();
            assert_eq!(Script::new(&source).get_hash(), script.get_hash(), "{name}");
        }
        let acquire = script_source("acquire").unwrap();
        assert!(acquire.starts_with(include_str!("scripts/fence.lua")));
        assert!(acquire.contains(include_str!("scripts/handoff.lua")));
        assert!(!acquire.contains("-- @handoff\n"));
        assert_eq!(script_source("lookup"), None);
    }

    #[test]
    fn the_fencing_counter_shares_the_lock_keys_slot() {
        // The last one is too long for the stack buffer.
        let long = vec![b'x'; NEXT_TO_INLINE];
        for (prefix, scope, value) in [
            ("tower-lock:", "POST /items/{sku}/purchase", &b"sku-1"[..]),
            ("", "s", b"}{\x00"),
            ("p:", "0123456789", b"v"),
            ("tower-lock:", "s", &long),
        ] {
            let key = LockKey::new(prefix, scope, value, 512).unwrap();
            let next = NextTo::new(&key);
            assert_eq!(slot::of(next.fence()), slot::of(key.as_bytes()));
            assert!(
                next.fence()
                    .starts_with(format!("{prefix}fence:{{").as_bytes())
            );
            assert_eq!(next.queue(), [key.as_bytes(), b":queue"].concat());
        }
        // A prefix with braces (only through `LockKey::new`) falls back to the key's own counter.
        let key = LockKey::new("a{", "s", b"v", 64).unwrap();
        let next = NextTo::new(&key);
        assert_eq!(next.fence(), [key.as_bytes(), b":fence"].concat());
        assert_eq!(slot::of(next.fence()), slot::of(key.as_bytes()));
    }

    #[test]
    fn native_commands_by_server_version() {
        let redis = |v: &str| Native::from_info(&format!("# Server\r\nredis_version:{v}\r\n"));
        assert_eq!(redis("7.0.15"), Native::default());
        assert_eq!(redis("8.2.1"), Native::default());
        let new = Native {
            set_ifeq: true,
            release: Some(NativeRelease::DelEx),
        };
        assert_eq!(redis("8.4.0"), new);
        assert_eq!(redis("10.0.0"), new);
        let valkey = |v: &str| {
            Native::from_info(&format!(
                "redis_version:7.2.4\r\nserver_name:valkey\r\nvalkey_version:{v}\r\n"
            ))
        };
        assert_eq!(valkey("8.0.2"), Native::default());
        assert_eq!(
            valkey("8.1.1"),
            Native {
                set_ifeq: true,
                release: None
            }
        );
        assert_eq!(
            valkey("9.0.0"),
            Native {
                set_ifeq: true,
                release: Some(NativeRelease::DelIfEq)
            }
        );
        assert_eq!(Native::from_info("garbage"), Native::default());
    }
}
