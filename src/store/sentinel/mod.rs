//! Leases on the master that Redis Sentinel names, following failovers.
//!
//! The store and its settings are here; [`master`] is a master the sentinels named and the
//! settings every new master gets; [`follow`] is how the store follows failovers (the lookups,
//! their thread, and which errors a failover explains).

use std::{
    fmt,
    sync::{
        Arc, Mutex, PoisonError, RwLock,
        atomic::{AtomicBool, AtomicU64},
    },
    time::{Duration, Instant},
};

#[cfg(feature = "tls")]
use redis::{
    ConnectionAddr, ConnectionInfo, RedisConnectionInfo, TlsMode, sentinel::SentinelClientBuilder,
};
use redis::{
    IntoConnectionInfo,
    sentinel::{SentinelClient, SentinelNodeConnectionInfo, SentinelServerType},
};
use tokio::sync::mpsc;

#[cfg(doc)]
use super::RedisStore;
use super::{
    Acquire, Capabilities, Eviction, LockStore, StoreError,
    redis::{
        Handoff, TLS_MARK, check_claim_window, check_fence_retention, check_replicas,
        connect_error, redis_error, refuse_insecure,
    },
};
use crate::{error::ConfigError, key::LockKey, store::StoreId, token::Token};

mod follow;
mod master;

use follow::{Follow, Lookup};
pub(crate) use master::Master;
use master::Settings;

/// The sentinels are asked again at most this often, however many calls fail at once.
const MIN_LOOKUP_INTERVAL: Duration = Duration::from_millis(200);

/// While the store is in use, the sentinels are asked in the background this often, to follow a
/// failover that left the old master running (and so produced no error).
const POLL_INTERVAL: Duration = Duration::from_secs(1);

/// How long one lookup (sentinels, then `ROLE` on the master they name) may take, and so may
/// connecting to the master.
const LOOKUP_TIMEOUT: Duration = Duration::from_secs(2);

/// How long a call that failed waits for the follower thread's lookup (it may wait behind
/// another): a lookup and a connection, and some.
const FOLLOW_WAIT: Duration = Duration::from_secs(5);

/// Leases on a master monitored by Redis Sentinel (the `sentinel` feature).
///
/// The sentinels name the current master of `master_name` (the redis crate's
/// [`SentinelClient`], which also checks with `ROLE` that the server it names is a master), and
/// a [`RedisStore`] connected to it runs the same scripts as everywhere else. When a call fails
/// the way a failover makes calls fail (the connection is refused, breaks or times out, or the
/// server answers `READONLY` or `MASTERDOWN` because it is a replica now), the store asks the
/// sentinels again (at most every 200 ms); if they name another master, it connects to it, sends
/// later calls there, and retries the failed call on it once. Until the sentinels have promoted
/// a replica, calls fail (503). While the store is in use it also asks the sentinels in the
/// background once a second, so that a failover that leaves the old master up (`SENTINEL
/// FAILOVER`, a partition) is followed within about a second of the sentinels' switch, not only
/// once the old master is demoted (which Sentinel does some seconds later). Lookups, and the
/// connection to each master found after the first, run on a thread of the store's own (one
/// per store, started at its first lookup, ended with its last clone), never as a task of a
/// runtime that uses the store: such a runtime may shut down or stop being driven, and a
/// lookup left there would stop the store following failovers.
///
/// ```no_run
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// use tower_lock::{Key, LockLayer, store::SentinelStore};
///
/// // Any of the sentinels that monitor the master named `mymaster`.
/// let store = SentinelStore::connect(
///     ["redis://10.0.0.1:26379/", "redis://10.0.0.2:26379/", "redis://10.0.0.3:26379/"],
///     "mymaster",
/// )
/// .await?;
/// let layer = LockLayer::new(store, Key::path_param("sku"));
/// # let _ = layer; Ok(()) }
/// ```
///
/// # Failover
///
/// The guarantees are those of a master and its replicas: replication is asynchronous, so a
/// replica promoted before it received a lease forgets it, and a second client can take the key
/// until the first holder's next renewal finds it gone.
/// [`wait_for_replicas`](Self::wait_for_replicas) makes that much less likely, at the cost of a
/// replica acknowledgement per acquire and renewal. Between a promotion and the moment the store
/// follows it (about a second, or the next failing call), leases granted by the old master, if
/// it is still up, are lost with it; a process that reaches the old master but not the
/// sentinels keeps using it until it is demoted (configure `min-replicas-to-write` on the
/// servers to bound that). See `docs/TOPOLOGY.md`.
///
/// # Hand-off and group commit
///
/// As with [`RedisStore::connect`], a released key is handed straight to the next waiter
/// ([`handoff`](Self::handoff), on by default), and the operations that reach the master
/// together go in one script call (group commit, see [`Capabilities`]; an operation that fails
/// the way a failover makes calls fail is sent once more to the new master, like every other
/// call). The store has one
/// hand-off channel and one subscription, on the current master: when the store follows a
/// failover it moves the subscription to the new master; until that is up, waiters do not
/// queue, and then every queued waiter checks again. Queue entries live on the master, so a
/// waiter whose entry the promoted replica had not received is queued again there, at the
/// back, when it checks; the others keep their places. With
/// [`wait_for_replicas`](Self::wait_for_replicas), a waiter handed the key confirms it (with
/// the replicas' acknowledgement) before it runs, as on [`RedisStore`].
#[derive(Clone)]
pub struct SentinelStore {
    inner: Arc<Inner>,
}

struct Inner {
    master_name: Arc<str>,
    /// The sentinels, asked by one call at a time.
    lookup: tokio::sync::Mutex<Lookup>,
    /// The master every call goes to.
    current: RwLock<Arc<Master>>,
    settings: Mutex<Settings>,
    /// Background polling: the time base, when the next poll is due (ms since `created`), and
    /// whether one runs now.
    created: Instant,
    next_poll: AtomicU64,
    polling: AtomicBool,
    /// The thread that looks the master up and connects to it (see [`follower_thread`]),
    /// started at the first lookup after connecting.
    follower: Mutex<Option<mpsc::UnboundedSender<Follow>>>,
}

impl SentinelStore {
    /// Asks `sentinels` (any of the sentinels that monitor it) for the master named
    /// `master_name` and connects to it, with the timeouts of [`RedisStore::connect`]. Fails if
    /// no sentinel names a reachable master now.
    ///
    /// The sentinels' URLs carry what it takes to reach them (`redis://user:password@host:port/`);
    /// for a master that needs a password, a database other than 0 or TLS, use
    /// [`connect_with`](Self::connect_with).
    pub async fn connect<T: AsRef<str>>(
        sentinels: impl IntoIterator<Item = T>,
        master_name: &str,
    ) -> Result<Self, StoreError> {
        Self::connect_with(
            sentinels,
            master_name,
            SentinelNodeConnectionInfo::default(),
        )
        .await
    }

    /// Like [`connect`](Self::connect), connecting to the master (this one and every later
    /// one) with `master`'s credentials, database and TLS mode.
    ///
    /// ```no_run
    /// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
    /// // The redis crate of the version tower-lock uses (1.x).
    /// use redis::{RedisConnectionInfo, sentinel::SentinelNodeConnectionInfo};
    /// use tower_lock::store::SentinelStore;
    ///
    /// let master = SentinelNodeConnectionInfo::default()
    ///     .set_redis_connection_info(RedisConnectionInfo::default().set_password("secret"));
    /// let store =
    ///     SentinelStore::connect_with(["redis://10.0.0.1:26379/"], "mymaster", master).await?;
    /// # let _ = store; Ok(()) }
    /// ```
    pub async fn connect_with<T: AsRef<str>>(
        sentinels: impl IntoIterator<Item = T>,
        master_name: &str,
        master: SentinelNodeConnectionInfo,
    ) -> Result<Self, StoreError> {
        let sentinels = sentinels
            .into_iter()
            .map(|url| url.as_ref().into_connection_info().map_err(redis_error))
            .collect::<Result<Vec<_>, _>>()?;
        let target = sentinels_name(&sentinels, master_name);
        for sentinel in &sentinels {
            refuse_insecure(sentinel)?;
            #[cfg(feature = "tls")]
            super::prepare_tls(sentinel);
        }
        // A `String`: the redis crate takes one, or `impl AsRef<str>` with its `tls-rustls`
        // feature on (which another crate in the build may turn on).
        #[allow(clippy::unnecessary_to_owned)]
        let client = SentinelClient::build(
            sentinels,
            master_name.to_owned(),
            Some(master),
            SentinelServerType::Master,
        )
        .map_err(|e| connect_error(&target, e))?;
        Self::from_client(client, master_name, target).await
    }

    /// Like [`connect_with`](Self::connect_with), over TLS to the master (this one and every
    /// later one) with `master`'s credentials and database, and to the sentinels (whose URLs
    /// are then `rediss://` URLs), with `tls`'s CA bundle and client certificate for both (the
    /// `tls` feature). The servers run with `tls-replication yes`, so that the sentinels know
    /// their TLS ports.
    ///
    /// The master's settings are a [`RedisConnectionInfo`], not a
    /// [`SentinelNodeConnectionInfo`] (which keeps its settings to itself, so that they could
    /// not be carried over to the TLS client); every sentinel has the same user and password
    /// (those of the first URL; URLs that differ are a [`Config`](super::StoreErrorKind::Config)
    /// error).
    ///
    /// ```no_run
    /// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
    /// use redis::RedisConnectionInfo; // the redis crate of the version tower-lock uses (1.x)
    /// use tower_lock::{store::{SentinelStore, TlsConfig}};
    ///
    /// let tls = TlsConfig::new().ca_cert_file("/etc/redis/tls/ca.pem");
    /// let master = RedisConnectionInfo::default().set_password("secret");
    /// let store =
    ///     SentinelStore::connect_with_tls(["rediss://10.0.0.1:26380/"], "mymaster", master, &tls)
    ///         .await?;
    /// # let _ = store; Ok(()) }
    /// ```
    #[cfg(feature = "tls")]
    pub async fn connect_with_tls<T: AsRef<str>>(
        sentinels: impl IntoIterator<Item = T>,
        master_name: &str,
        master: RedisConnectionInfo,
        tls: &super::TlsConfig,
    ) -> Result<Self, StoreError> {
        let sentinels: Vec<ConnectionInfo> = sentinels
            .into_iter()
            .map(|url| tls.connection_info(url))
            .collect::<Result<_, _>>()?;
        let target = sentinels_name(&sentinels, master_name);
        let Some(first) = sentinels.first().map(|s| s.redis_settings().clone()) else {
            return Err(StoreError::msg(
                super::StoreErrorKind::Config,
                "a Sentinel store needs at least one sentinel URL",
            ));
        };
        if sentinels.iter().any(|s| {
            s.redis_settings().username() != first.username()
                || s.redis_settings().password() != first.password()
        }) {
            return Err(StoreError::msg(
                super::StoreErrorKind::Config,
                "the sentinel URLs have different users or passwords: with TLS, every sentinel \
                 is reached with the same ones",
            ));
        }
        let tls_sentinels = sentinels
            .iter()
            .any(|s| matches!(s.addr(), ConnectionAddr::TcpTls { .. }));
        let certificates = tls.certificates()?;
        let mut builder = SentinelClientBuilder::new(
            sentinels.into_iter().map(|s| s.addr().clone()),
            master_name,
            SentinelServerType::Master,
        )
        .map_err(|e| connect_error(&target, e))?
        .set_client_to_redis_tls_mode(TlsMode::Secure)
        .set_client_to_redis_certificates(certificates.clone())
        .set_client_to_redis_db(master.db())
        .set_client_to_redis_protocol(master.protocol());
        if let Some(username) = master.username() {
            builder = builder.set_client_to_redis_username(username);
        }
        if let Some(password) = master.password() {
            builder = builder.set_client_to_redis_password(password);
        }
        if tls_sentinels {
            builder = builder.set_client_to_sentinel_certificates(certificates);
        }
        if let Some(username) = first.username() {
            builder = builder.set_client_to_sentinel_username(username);
        }
        if let Some(password) = first.password() {
            builder = builder.set_client_to_sentinel_password(password);
        }
        let client = builder.build().map_err(|e| connect_error(&target, e))?;
        Self::from_client(client, master_name, target).await
    }

    /// Asks the sentinels `client` reaches for the master and connects to it.
    async fn from_client(
        client: SentinelClient,
        master_name: &str,
        target: String,
    ) -> Result<Self, StoreError> {
        let mut lookup = Lookup {
            client,
            last: None,
            target,
        };
        let master = Master::connect(&lookup.master().await?).await?;
        // Hand-off is on, as for `RedisStore::connect`: subscribed on this master now, and on
        // each master the store follows later.
        let handoff = Handoff::new(master.client.clone());
        handoff.ensure_running();
        let settings = Settings {
            handoff: Some(handoff),
            ..Settings::default()
        };
        let master = master.with(&settings);
        Ok(Self {
            inner: Arc::new(Inner {
                master_name: Arc::from(master_name),
                lookup: tokio::sync::Mutex::new(lookup),
                current: RwLock::new(Arc::new(master)),
                settings: Mutex::new(settings),
                created: Instant::now(),
                next_poll: AtomicU64::new(millis(POLL_INTERVAL)),
                polling: AtomicBool::new(false),
                follower: Mutex::new(None),
            }),
        })
    }

    /// How long a key's fencing counter is kept after its last acquisition (default 24 h); see
    /// [`RedisStore::fence_retention`].
    ///
    /// # Errors
    ///
    /// A [`ConfigError`] (field `fence_retention`) for less than 1 ms or more than 365 days.
    pub fn fence_retention(self, retention: Duration) -> Result<Self, ConfigError> {
        check_fence_retention(retention)?;
        Ok(self.configure(|s, _| s.fence_retention = Some(retention)))
    }

    /// Whether to use native compare commands where the master has them (default `true`); see
    /// [`RedisStore::native_commands`]. A new master is asked again.
    #[must_use]
    pub fn native_commands(self, enabled: bool) -> Self {
        self.configure(|s, _| s.native_commands = enabled)
    }

    /// Sends `WAIT replicas timeout` after each acquire and renewal, and treats fewer
    /// acknowledgements as a failure; see [`RedisStore::wait_for_replicas`]. It applies to
    /// every master the store follows: after a failover that left the new master with fewer
    /// than `replicas` replicas, acquires fail (503) until enough replicas are back.
    ///
    /// # Errors
    ///
    /// As [`RedisStore::wait_for_replicas`]'s.
    pub fn wait_for_replicas(
        self,
        replicas: usize,
        timeout: Duration,
    ) -> Result<Self, ConfigError> {
        check_replicas(replicas, timeout)?;
        Ok(self.configure(|s, _| s.replicas = (replicas > 0).then_some((replicas, timeout))))
    }

    /// Hands a released key straight to the next waiter, first come first served, on whichever
    /// master is current (default `true`); see [`RedisStore::handoff`].
    ///
    /// The store subscribes once, to a channel of its own, on the current master, and moves
    /// that subscription when it follows a failover: waiters queue on the new master once it
    /// is up there, and every waiter checks again then (re-queueing if its place did not
    /// reach the new master). Every instance that shares the locks must agree on this setting.
    #[must_use]
    pub fn handoff(self, enabled: bool) -> Self {
        self.configure(|settings, master| {
            settings.handoff = match settings.handoff.take() {
                Some(handoff) if enabled => Some(handoff),
                None if enabled => {
                    let handoff = Handoff::new(master.client.clone());
                    handoff.ensure_running();
                    Some(handoff)
                }
                _ => None,
            };
        })
    }

    /// How long a key handed to a waiter stays reserved for it before it must confirm
    /// (default 1 s); see [`RedisStore::claim_window`].
    ///
    /// # Errors
    ///
    /// A [`ConfigError`] (field `claim_window`) for less than 10 ms or more than 365 days.
    pub fn claim_window(self, window: Duration) -> Result<Self, ConfigError> {
        check_claim_window(window)?;
        Ok(self.configure(|s, _| s.claim_window = Some(window)))
    }

    /// Asks the current master now for its eviction policy (`INFO memory`); see
    /// [`RedisStore::eviction`]. The store also reads it from every master it connects to, the
    /// first and each one after a failover, and logs a warning for one that may evict lock
    /// keys: replicas are promoted with their own configuration, so give them all
    /// `maxmemory-policy noeviction`.
    pub async fn eviction(&self) -> Result<Eviction, StoreError> {
        self.run(|m| async move { m.store.eviction().await }).await
    }

    /// The address of the master calls go to now (`host:port`).
    pub fn master_addr(&self) -> String {
        self.current().addr.clone()
    }

    /// Changes the settings, for the current master and every later one (clones share them).
    /// `change` also sees the current master.
    fn configure(self, change: impl FnOnce(&mut Settings, &Master)) -> Self {
        // The settings stay locked until the current master has them: a failover followed
        // meanwhile applies them to its new master only after this (see `follow`).
        let mut settings = self
            .inner
            .settings
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let mut current = self
            .inner
            .current
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        change(&mut settings, &current);
        *current = Arc::new(current.with(&settings));
        drop(current);
        drop(settings);
        self
    }

    fn current(&self) -> Arc<Master> {
        Arc::clone(
            &self
                .inner
                .current
                .read()
                .unwrap_or_else(PoisonError::into_inner),
        )
    }
}

/// "the master <name> through the sentinels at a:1, b:2", for messages.
fn sentinels_name(sentinels: &[redis::ConnectionInfo], master_name: &str) -> String {
    let addrs: Vec<String> = sentinels.iter().map(|s| s.addr().to_string()).collect();
    let tls = sentinels
        .iter()
        .any(|s| matches!(s.addr(), redis::ConnectionAddr::TcpTls { .. }));
    format!(
        "the master {master_name:?} through the Redis sentinels at {}{}",
        addrs.join(", "),
        if tls { TLS_MARK } else { "" }
    )
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

impl LockStore for SentinelStore {
    async fn acquire(
        &self,
        key: &LockKey,
        token: &Token,
        ttl: Duration,
    ) -> Result<Acquire, StoreError> {
        self.run(|m| async move { m.store.acquire(key, token, ttl).await })
            .await
    }

    async fn renew(&self, key: &LockKey, token: &Token, ttl: Duration) -> Result<bool, StoreError> {
        self.run(|m| async move { m.store.renew(key, token, ttl).await })
            .await
    }

    async fn release(&self, key: &LockKey, token: &Token) -> Result<bool, StoreError> {
        self.run(|m| async move { m.store.release(key, token).await })
            .await
    }

    fn validity(&self, ttl: Duration) -> Duration {
        self.current().store.validity(ttl)
    }

    /// Those of the master's [`RedisStore`], each call sent to the current master and once
    /// more to the new one after a failover: group commit, hand-off (with one subscription
    /// that follows the master, so a waiter registered before a failover still hears its
    /// hand-off from the new master), and idempotency records (next to the lock keys on the same
    /// master, as with [`RedisStore`]).
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            identity: Some(StoreId::of(&self.inner)),
            ..Capabilities::routed(Arc::new(self.clone()))
        }
    }
}

impl fmt::Debug for SentinelStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let current = self.current();
        f.debug_struct("SentinelStore")
            .field("master_name", &self.inner.master_name)
            .field("master", &current.addr)
            .field("inner", &current.store)
            .finish()
    }
}
