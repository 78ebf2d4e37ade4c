//! [`RedisStore`]: leases in one Redis server (or a cluster, through `ClusterStore`).
//!
//! The type, its constructors and settings, and its four operations are here; each concern
//! of its own file: the transport (`connection`), the Lua scripts and their loading
//! (`scripts`, `scripts/*.lua`), the acquire script and the hand-off queue it keeps
//! (`acquire`), the hand-off's pub/sub subscription (`handoff`), group commit (`commit`: the
//! operations of many requests in one script call), idempotency records (`records`), native compare commands (`native`), replica
//! acknowledgement (`replicas`), and the names of the keys next to a lock key (`keys`).

mod acquire;
mod commit;
mod connection;
mod fenced;
mod handoff;
mod keys;
mod native;
mod probe;
mod records;
mod replicas;
mod scripts;
mod set;
mod wire;

use std::{
    fmt,
    sync::{Arc, atomic::AtomicBool},
    time::Duration,
};

#[cfg(feature = "bb8")]
use bb8_redis::{RedisConnectionManager, bb8};
use redis::{
    Client, IntoConnectionInfo,
    aio::{ConnectionManager, MultiplexedConnection},
};
use tokio::sync::OnceCell;

use self::{
    commit::Committer,
    connection::{Request, Transport, manager_config},
    native::{NativeState, info_text},
    replicas::ReplicaAcks,
    scripts::{LUA, Scripts},
    wire::Op,
};
pub(crate) use self::{
    connection::{TLS_MARK, connect_error, redis_error},
    handoff::Handoff,
};
use super::{Acquire, Capabilities, LockStore, StoreError};
use crate::{
    background::OnRuntime, config::MAX_DURATION, error::ConfigError, key::LockKey, store::StoreId,
    token::Token,
};

/// The shortest claim window a store takes.
const MIN_CLAIM_WINDOW: Duration = Duration::from_millis(10);
/// The shortest fence retention, and `WAIT` timeout, a store takes.
const MIN_MILLISECOND: Duration = Duration::from_millis(1);
/// The most replicas `wait_for_replicas` may ask for (Redis's `WAIT` counts to `i64::MAX`; no
/// deployment has this many).
const MAX_REPLICAS: usize = 1_000;

/// A claim window, checked (for every store that takes one).
pub(crate) fn check_claim_window(window: Duration) -> Result<(), ConfigError> {
    check_duration("claim_window", window, MIN_CLAIM_WINDOW)
}

/// A fence retention, checked (for every store that takes one).
pub(crate) fn check_fence_retention(retention: Duration) -> Result<(), ConfigError> {
    check_duration("fence_retention", retention, MIN_MILLISECOND)
}

/// `value` as the store setting `field`: at least `least`, at most 365 days.
fn check_duration(
    field: &'static str,
    value: Duration,
    least: Duration,
) -> Result<(), ConfigError> {
    if value < least {
        return Err(ConfigError::new(
            field,
            format!("must be at least {} ms", least.as_millis()),
        ));
    }
    // Not `at_most_a_year`, whose advice (leave it unset for no limit) is a config's.
    match value <= MAX_DURATION {
        true => Ok(()),
        false => Err(ConfigError::new(field, "must be at most 365 days")),
    }
}

/// The arguments of `wait_for_replicas`, checked.
pub(crate) fn check_replicas(replicas: usize, timeout: Duration) -> Result<(), ConfigError> {
    if replicas > MAX_REPLICAS {
        return Err(ConfigError::new(
            "wait_for_replicas",
            "asks for more than 1,000 replicas",
        ));
    }
    match replicas {
        // Off: the timeout is not used.
        0 => Ok(()),
        _ => check_duration("wait_for_replicas", timeout, MIN_MILLISECOND),
    }
}

/// How long connecting waits for the server's eviction policy (and the other probes) before it
/// goes on without it.
const EVICTION_CHECK_TIMEOUT: Duration = Duration::from_secs(1);

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
/// | `from_pool` (feature `bb8`) | a bb8-redis pool, one checkout per command | 2, plus a `PING` per checkout if the pool tests on checkout |
///
/// The default is one multiplexed connection because it is both the fastest and the cheapest:
/// measured on a 2-core machine (axum, `wrk -c50`, one `SET NX PX` and one compare-and-delete per
/// request), one shared multiplexed connection served 41.5k req/s, bb8-redis with
/// `test_on_check_out(false)` 18.6k, and bb8-redis with its defaults 12.9k (it sends a `PING` on
/// every checkout, so 4 round trips per request). Redis pipelines the commands of concurrent
/// requests on the one connection. Use a pool when you already have one, and build it with
/// `pool_builder` (feature `bb8`), which turns the checkout `PING` off and bounds the
/// connection timeout.
///
/// # Keys and scripts
///
/// A lease is the key [`LockKey::as_bytes`] set to the holder's token with `SET NX PX`; renew and
/// release are Lua compare-and-`PEXPIRE` and compare-and-`DEL`, sent as `EVALSHA` and reloaded
/// by `redis::Script` if the server answers `NOSCRIPT` (after `SCRIPT FLUSH` or a restart).
/// Fencing tokens come from one counter per prefix, `<prefix>fence`, on a server that does not
/// hash keys to slots; where it does (a cluster, or a cluster-mode server), from one per hash
/// slot, `<prefix>fence:{<tag>}` (with the hash tag of the lock keys of that slot, see
/// [`crate::key`]: at most 16,384 such keys), but for the keys of `<prefix>fence`'s own slot,
/// which keep that one: so a key's tokens come from one counter whichever constructor made the
/// store and whenever it learns how the server hashes keys. Counters are kept for
/// [`fence_retention`](Self::fence_retention) (default 24 h) after their last use: a released
/// lock leaves no key behind, however many distinct keys are locked, and every script touches
/// one slot only. Tokens are `max(last + 1, server time in µs)`, so they keep increasing after
/// the counter expires, as long as the Redis server's clock does not step back. With
/// [`handoff`](Self::handoff) on (the default for [`connect`](Self::connect)), waiters queue in
/// the lock key's queue, `<prefix>{<tag>}queue:<scope length>:<scope>:<digest>`, and a release
/// hands the key to the first of them; an idempotency record is
/// `<prefix>{<tag>}record:<scope length>:<scope>:<digest>`. No lock key can be one of these (see
/// `docs/DECISIONS.md`, "Companion keys: a role after the hash tag").
///
/// # Runtimes
///
/// A store and its clones may be used from several Tokio runtimes at once, and outlive some of
/// them: no operation waits for a task or future of a runtime of yours. The connection's I/O
/// task runs on the crate's own runtime (one thread for the process, started at first use),
/// whichever runtime connected or reconnects it, so a store made on a runtime that is then
/// dropped or left undriven (a current-thread runtime whose `block_on` returned) serves every
/// other: a runtime per request or per thread (a `block_on` bridge) works. Every operation is
/// sent by the store's group-commit driver, a task on the crate's runtime, so a caller only
/// awaits its answer: a release awaited on a runtime that then stalls is sent all the same.
/// Background renewals, releases on drop and the retries of failed releases run on the crate's
/// runtime too; the hand-off subscription on a thread of its own. A connection you build yourself
/// ([`from_multiplexed`](Self::from_multiplexed),
/// [`from_connection_manager`](Self::from_connection_manager), a pool) runs its I/O where you
/// created it: keep that runtime driven (its reconnections are made on the crate's runtime).
///
/// That one thread sends every store operation, polls the renewals and releases nobody else
/// polls, and runs the `tracing` subscribers and `metrics` recorders they call: none of them
/// may block. A subscriber or recorder that blocks (a synchronous write to a slow sink, a
/// contended lock) delays every lock operation, renewal and release of the process, and leases
/// may expire.
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
/// of Lua: `SET key token IFEQ token PX ttl` (Valkey 8.1+, Redis 8.4+) for a renewal,
/// `DELIFEQ key token` (Valkey 9+) or `DELEX key IFEQ token` (Redis 8.4+) for a release without
/// hand-off (a release with hand-off must pass the key on, which only the script does). They are
/// used for an operation sent alone; operations that arrive together share one script call
/// (group commit) whatever the server. The server is asked once per store (`INFO server`):
/// when [`connect`](Self::connect) connects, else at the first renew or release (stores built
/// from your own connection, manager or pool). Older servers, and any error from a native
/// command, mean Lua. Acquire is always Lua: it also hands out the fencing token.
/// [`native_commands(false)`](Self::native_commands) turns them off. The suite runs on Redis
/// 7.0 (Lua) and Valkey 9 (native), see `docs/TOPOLOGY.md`.
#[derive(Clone)]
pub struct RedisStore {
    transport: Transport,
    scripts: Arc<Scripts>,
    fence_retention: Duration,
    replicas: Option<ReplicaAcks>,
    native: Arc<NativeState>,
    /// Whether the server hashes keys to slots (a cluster, or a cluster-mode server behind a
    /// plain connection, which refuses a script over keys of several slots with `CROSSSLOT`):
    /// batches are then sent one script per slot, each with its slot's fencing counter. Asked
    /// at connect (`INFO cluster`), or learnt from the first refusal.
    slot_bound: Arc<AtomicBool>,
    /// The hand-off queue's signals, when on (`handoff`).
    handoff: Option<Arc<Handoff>>,
    claim_window: Duration,
    /// The server's address, for the hand-off's own connection (stores made by `connect`);
    /// shared, since every call clones the store (its strings would be copied each time).
    client: Option<Arc<Client>>,
    /// Group commit: the operations waiting for the call in flight. Shared by clones; a copy
    /// with other settings (the setters below) gets a queue of its own, since a batch is sent
    /// with one store's settings.
    committer: Arc<Committer>,
}

impl RedisStore {
    /// Connects to `url` (`redis://host:port/db`) with one auto-reconnecting multiplexed
    /// connection, the recommended transport.
    ///
    /// The connection times out connecting after 1 s and waiting for a reply after 2 s; the
    /// layer bounds each operation more tightly still (its wait deadline and store timeout).
    /// Fails if the server cannot be reached now, with a [`StoreError`] whose kind and message
    /// name the cause: [`Authentication`](super::StoreErrorKind::Authentication) (a wrong
    /// password or user), [`Tls`](super::StoreErrorKind::Tls) (an untrusted certificate, one
    /// for another host, a refused client certificate),
    /// [`Unavailable`](super::StoreErrorKind::Unavailable) or
    /// [`Timeout`](super::StoreErrorKind::Timeout) (nothing answers),
    /// [`Config`](super::StoreErrorKind::Config) (a URL that does not parse). The message
    /// shows the server's address, never the URL's password.
    ///
    /// A `rediss://` URL connects over TLS (the `tls` feature), trusting the operating
    /// system's CA store; for a private CA or a client certificate, see
    #[cfg_attr(feature = "tls", doc = "[`connect_with_tls`](Self::connect_with_tls).")]
    #[cfg_attr(not(feature = "tls"), doc = "`connect_with_tls`.")]
    ///
    /// Once connected, it asks the server for its eviction policy (`INFO memory`) and logs a
    /// warning if the server may evict lock keys (any `maxmemory-policy` but `noeviction`; see
    /// [`eviction`](Self::eviction)). A server that refuses `INFO` connects all the same.
    pub async fn connect<T: AsRef<str>>(url: T) -> Result<Self, StoreError> {
        Self::connect_info(url.as_ref()).await
    }

    /// [`connect`](Self::connect) to a parsed URL.
    async fn connect_info<T: IntoConnectionInfo>(info: T) -> Result<Self, StoreError> {
        let store = Self::connect_plain(info).await?;
        Ok(store.enable_handoff())
    }

    /// Like [`connect`](Self::connect), over TLS with `tls`'s CA bundle and client certificate
    /// (the `tls` feature). `url` is a `rediss://` URL; the hand-off's own connection uses the
    /// same settings.
    ///
    /// ```no_run
    /// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
    /// use tower_lock::{RedisStore, store::TlsConfig};
    ///
    /// let tls = TlsConfig::new().ca_cert_file("/etc/redis/tls/ca.pem");
    /// let store = RedisStore::connect_with_tls("rediss://:secret@10.0.0.1:6380/", &tls).await?;
    /// # let _ = store; Ok(()) }
    /// ```
    #[cfg(feature = "tls")]
    pub async fn connect_with_tls<T: AsRef<str>>(
        url: T,
        tls: &super::TlsConfig,
    ) -> Result<Self, StoreError> {
        Self::connect_info(tls.connection_info(url)?).await
    }

    /// Like [`connect`](Self::connect), without hand-off (for Redlock's nodes and Sentinel's
    /// masters, which do not queue).
    pub(crate) async fn connect_plain<T: IntoConnectionInfo>(url: T) -> Result<Self, StoreError> {
        let (client, target) = open(url)?;
        // Opened on the crate's runtime, which runs the connection's I/O task from now on.
        let manager = OnRuntime::new(ConnectionManager::new_with_config(
            client.clone(),
            manager_config(),
        ))
        .await
        .map_err(|e| connect_error(&target, e))?;
        let store = Self::from_connection_manager(manager).with_client(client);
        store
            .check_eviction()
            .await
            .map_err(|e| e.while_connecting(&target))?;
        store.check_slots().await;
        store.check_native().await;
        Ok(store)
    }

    /// Like [`connect`](Self::connect), but connects at the first command instead of now, and
    /// without hand-off (for Redlock's nodes, which do not queue).
    pub(crate) fn connect_lazy<T: IntoConnectionInfo>(url: T) -> Result<Self, StoreError> {
        let (client, target) = open(url)?;
        // Its helper task on the crate's runtime (the connection opens there at the first call).
        let _entered = crate::background::handle().map(tokio::runtime::Handle::enter);
        let manager = ConnectionManager::new_lazy_with_config(client.clone(), manager_config())
            .map_err(|e| connect_error(&target, e))?;
        Ok(Self::from_connection_manager(manager).with_client(client))
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
    #[cfg(feature = "bb8")]
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
    #[cfg(feature = "bb8")]
    pub fn pool_builder() -> bb8::Builder<RedisConnectionManager> {
        bb8::Pool::builder()
            .test_on_check_out(false)
            .connection_timeout(Duration::from_secs(1))
    }

    /// The Lua scripts this store runs, by name, exactly as it sends them: `ops` (a batch of
    /// acquires, releases, renewals and idempotent completions, see
    /// `src/store/redis/scripts/ops.lua` for its arguments), `counted` (the same batch, for
    /// keys with a capacity: leases with counts), `record_lookup`, and for leases on
    /// several keys `acquire_set` and `release_set` (and `acquire_set_counted` and
    /// `release_set_counted`, for a set with a key with a capacity). For a security
    /// review, an ACL audit (see `docs/TOPOLOGY.md`), or a tool that sends them by hand.
    ///
    /// ```
    /// use tower_lock::RedisStore;
    ///
    /// let (name, source) = RedisStore::lua_scripts().next().unwrap();
    /// assert_eq!(name, "ops");
    /// assert!(source.contains("'SET', lock, token, 'NX', 'PX', ttl"));
    /// ```
    pub fn lua_scripts() -> impl Iterator<Item = (&'static str, &'static str)> {
        LUA.iter().map(|(name, source)| (*name, source.as_str()))
    }

    /// How long the fencing counter is kept after its last acquisition (default 24 h).
    ///
    /// Fencing tokens stay increasing without it (they follow the server clock); the counter only
    /// guards against the clock stepping back by less than this.
    ///
    /// # Errors
    ///
    /// A [`ConfigError`] (field `fence_retention`) for less than 1 ms or more than 365 days.
    pub fn fence_retention(self, retention: Duration) -> Result<Self, ConfigError> {
        check_fence_retention(retention)?;
        Ok(self.with_fence_retention(retention))
    }

    /// [`fence_retention`](Self::fence_retention), checked already.
    pub(crate) fn with_fence_retention(mut self, retention: Duration) -> Self {
        self.fence_retention = retention;
        self.own_queue()
    }

    /// After each acquire and renewal, waits until `replicas` replicas have acknowledged it, for
    /// at most `timeout`, with `WAIT` (sent in the same round trip).
    ///
    /// Fewer acknowledgements make the acquire fail: the key is released and the layer answers
    /// 503 (a [`StoreError`] of kind [`Unavailable`](super::StoreErrorKind::Unavailable)); a renewal
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
    ///     .wait_for_replicas(1, Duration::from_millis(50))?;
    /// # let _ = store; Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// A [`ConfigError`] (field `wait_for_replicas`) for more than 1,000 replicas, or a timeout
    /// under 1 ms (`WAIT` with 0 would wait for ever) or over 365 days. `replicas` 0 turns the
    /// wait off.
    pub fn wait_for_replicas(
        self,
        replicas: usize,
        timeout: Duration,
    ) -> Result<Self, ConfigError> {
        check_replicas(replicas, timeout)?;
        Ok(self.with_replicas(replicas, timeout))
    }

    /// [`wait_for_replicas`](Self::wait_for_replicas), checked already.
    pub(crate) fn with_replicas(mut self, replicas: usize, timeout: Duration) -> Self {
        self.replicas = (replicas > 0).then_some(ReplicaAcks { replicas, timeout });
        self.own_queue()
    }

    /// Whether to use the server's native compare commands for renew and release where it has
    /// them (default `true`); `false` always uses Lua.
    #[must_use]
    pub fn native_commands(self, enabled: bool) -> Self {
        Self {
            native: Arc::new(NativeState {
                enabled: AtomicBool::new(enabled),
                // What the server has does not change with the setting: asked at connect, kept.
                detected: OnceCell::new_with(self.native.detected.get().copied()),
            }),
            ..self
        }
        .own_queue()
    }

    /// Hands a released key straight to the next waiter, first come first served (default
    /// `true` for stores made by [`connect`](Self::connect); other constructors do not know
    /// the server's address and cannot turn it on).
    ///
    /// With hand-off, a waiter that finds its key held joins the key's queue in Redis
    /// (its queue key, in the same script as its attempt), and the holder's release gives
    /// the key to the head of the queue instead of freeing it, and tells that waiter on pub/sub
    /// (each store subscribes to a channel of its own, on one extra RESP3 connection: Redis 6
    /// or later; on older servers waiters use their timers). The waiter runs at once: the key
    /// is reserved for it for the [`claim_window`](Self::claim_window), and its first renewal,
    /// due within a third of that, confirms it for the full TTL. So under contention every
    /// acquisition costs about two commands (the attempt that queues, the release that hands
    /// over), waiters take turns fairly, and nobody polls: a waiter's timer only backs up a
    /// lost message, firing when the holder's lease would run out. A waiter that gives up
    /// leaves the queue with its release; a waiter whose process died is skipped (nobody hears
    /// its message), and one whose process hangs before claiming delays the next one by the
    /// claim window.
    ///
    /// The subscription runs on a thread of its own, started here, with its own connection: it
    /// does not depend on any runtime that uses the store, and ends with the store's last
    /// clone. A waiter is queued only on a server where its store's subscription is (the attempt
    /// checks): if the address now reaches another server than the subscription does (a
    /// virtual IP or DNS name that moved in a failover, while the subscription's connection
    /// stayed open), the store subscribes again, through the address, and the waiter queues
    /// once that is up.
    ///
    /// Every instance that shares the locks must agree on this setting: a store without
    /// hand-off takes a free key even when others queue for it, and frees keys on release
    /// instead of handing them on (waiters then fall back to their timers). See
    /// `docs/DECISIONS.md`.
    ///
    /// # Errors
    ///
    /// A [`ConfigError`] (field `handoff`) for `true` on a store made from a connection, a
    /// connection manager or a pool ([`from_multiplexed`](Self::from_multiplexed),
    /// [`from_connection_manager`](Self::from_connection_manager), `from_pool` with the `bb8`
    /// feature): hand-off subscribes with a connection of its own, which only a store made by
    /// [`connect`](Self::connect) can open.
    pub fn handoff(mut self, enabled: bool) -> Result<Self, ConfigError> {
        match (enabled, self.client.is_some()) {
            // Already on (as `connect` leaves it): the same store, not a second subscription.
            (true, true) if self.handoff.is_some() => Ok(self),
            (true, true) => Ok(self.enable_handoff()),
            (true, false) => Err(ConfigError::new(
                "handoff",
                "needs a store made by `connect` (hand-off subscribes with a connection of its \
                 own); a store made from a connection, manager or pool has none",
            )),
            (false, _) => {
                self.handoff = None;
                Ok(self.own_queue())
            }
        }
    }

    /// Hand-off on a store that has its client (one made by `connect`).
    fn enable_handoff(mut self) -> Self {
        if let Some(client) = &self.client {
            let handoff = Handoff::new(Client::clone(client));
            handoff.ensure_running();
            self.handoff = Some(handoff);
        }
        self.own_queue()
    }

    /// Uses `handoff` (or none) for this store's waiters: a
    /// [`SentinelStore`](super::SentinelStore) gives the stores of every master it follows the
    /// same one (one channel, one subscription that it moves to each new master, one registry
    /// of waiters).
    #[cfg(feature = "sentinel")]
    pub(crate) fn attach_handoff(mut self, handoff: Option<Arc<Handoff>>) -> Self {
        self.handoff = handoff;
        self.own_queue()
    }

    /// How long a key handed to a waiter stays reserved for it before it must confirm
    /// (default 1 s). A waiter that was queued for longer than about half of this confirms
    /// before it runs (one more command); a waiter whose process hangs delays the queue by this
    /// long.
    /// Shorter than the TTL; every instance should use the same.
    ///
    /// # Errors
    ///
    /// A [`ConfigError`] (field `claim_window`) for less than 10 ms or more than 365 days.
    pub fn claim_window(self, window: Duration) -> Result<Self, ConfigError> {
        check_claim_window(window)?;
        Ok(self.with_claim_window(window))
    }

    /// [`claim_window`](Self::claim_window), checked already.
    pub(crate) fn with_claim_window(mut self, window: Duration) -> Self {
        self.claim_window = window;
        self.own_queue()
    }

    /// `SET key token PX ttl`: puts a lease that a Redlock quorum has just renewed back on a
    /// node that lost it (restarted empty while the lease was held elsewhere), over whatever
    /// another client's failed attempt left there (while the quorum holds the lease, no other
    /// key on this node can be part of one: see `RedlockStore::renew`). Touches no fencing
    /// counter.
    pub(crate) async fn put_back(
        &self,
        key: &LockKey,
        token: &Token,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        let mut set = redis::cmd("SET");
        set.arg(key.as_bytes())
            .arg(token.as_bytes())
            .arg("PX")
            .arg(u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX).max(1));
        match self.query(Request::Cmd(&set)).await? {
            Ok(_) => Ok(()),
            Err(e) => Err(self.store_error(e)),
        }
    }

    /// A group-commit queue of its own, for a copy with other settings: every setter calls it,
    /// since a queue's driver sends its calls with the settings of the store that started it.
    fn own_queue(mut self) -> Self {
        self.committer = Arc::new(Committer::new(self.committer.window()));
        self
    }

    fn with_client(mut self, client: Client) -> Self {
        self.client = Some(Arc::new(client));
        self
    }

    #[cfg(feature = "cluster")]
    pub(crate) fn from_cluster(connection: redis::cluster_async::ClusterConnection) -> Self {
        let store = Self::with(Transport::Cluster(connection));
        store
            .slot_bound
            .store(true, std::sync::atomic::Ordering::Relaxed);
        store
    }

    fn with(transport: Transport) -> Self {
        let window = match transport {
            #[cfg(feature = "bb8")]
            Transport::Pool(_) => Committer::POOL_WINDOW,
            _ => 1,
        };
        Self {
            transport,
            scripts: Scripts::new(),
            fence_retention: Duration::from_secs(24 * 60 * 60),
            replicas: None,
            native: Arc::new(NativeState {
                enabled: AtomicBool::new(true),
                detected: OnceCell::new(),
            }),
            slot_bound: Arc::default(),
            handoff: None,
            claim_window: DEFAULT_CLAIM_WINDOW,
            client: None,
            committer: Arc::new(Committer::new(window)),
        }
    }
}

/// A client for `url`, and how messages name its server ("the Redis server at host:port",
/// never the URL, which may hold a password). Installs the TLS crypto provider for a
/// `rediss://` URL.
fn open<T: IntoConnectionInfo>(url: T) -> Result<(Client, String), StoreError> {
    let info = url.into_connection_info().map_err(redis_error)?;
    refuse_insecure(&info)?;
    #[cfg(feature = "tls")]
    super::prepare_tls(&info);
    let target = server_name(&info);
    let client = Client::open(info).map_err(|e| connect_error(&target, e))?;
    Ok((client, target))
}

/// Refuses a TLS address whose certificate would not be verified (`rediss://...#insecure`):
/// anyone on the path could then read the password and forge the locks' answers.
pub(crate) fn refuse_insecure(info: &redis::ConnectionInfo) -> Result<(), StoreError> {
    match info.addr() {
        redis::ConnectionAddr::TcpTls { insecure: true, .. } => Err(StoreError::msg(
            super::StoreErrorKind::Config,
            format!(
                "{} is given with `#insecure`: the lock store does not connect without \
                 verifying the server's certificate (give its CA bundle instead)",
                server_name(info)
            ),
        )),
        _ => Ok(()),
    }
}

/// "the Redis server at host:port", for messages.
pub(crate) fn server_name(info: &redis::ConnectionInfo) -> String {
    let tls = match info.addr() {
        redis::ConnectionAddr::TcpTls { .. } => TLS_MARK,
        _ => "",
    };
    format!("the Redis server at {}{tls}", info.addr())
}

impl LockStore for RedisStore {
    async fn acquire(
        &self,
        key: &LockKey,
        token: &Token,
        ttl: Duration,
    ) -> Result<Acquire, StoreError> {
        let since = super::Epoch::default();
        Ok(self
            .attempt(key, token, ttl, None, since)
            .await?
            .into_acquire())
    }

    async fn renew(&self, key: &LockKey, token: &Token, ttl: Duration) -> Result<bool, StoreError> {
        let op = Op::Renew {
            key: key.clone(),
            token: token.clone(),
            ttl,
        };
        let answer = self.submit(op).await?;
        let renewed = answer.done("renewal")?;
        if renewed {
            self.check_acks(answer.acks)?;
        }
        Ok(renewed)
    }

    async fn release(&self, key: &LockKey, token: &Token) -> Result<bool, StoreError> {
        let op = Op::Release {
            key: key.clone(),
            token: token.clone(),
        };
        self.submit(op).await?.done("release")
    }

    /// Group commit; hand-off (stores made by [`connect`](Self::connect), unless turned off);
    /// idempotency records; key sets (one script; one per hash slot, slot by slot, where the
    /// server hashes keys to slots).
    fn capabilities(&self) -> Capabilities {
        let this = Arc::new(self.clone());
        Capabilities {
            group_commit: true,
            counts: true,
            hand_off: self.handoff.is_some().then(|| this.clone() as _),
            records: Some(this.clone()),
            fenced: Some(this.clone()),
            key_sets: Some(this),
            identity: Some(StoreId::of(&self.committer)),
            ..Capabilities::none()
        }
    }
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let transport = match self.transport {
            Transport::Manager(_) => "ConnectionManager",
            Transport::Multiplexed(_) => "MultiplexedConnection",
            #[cfg(feature = "bb8")]
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
