//! Leases on the master that Redis Sentinel names, following failovers.

use std::{
    error::Error as StdError,
    fmt,
    future::Future,
    sync::{
        Arc, Mutex, PoisonError, RwLock,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use tokio::sync::{mpsc, oneshot};

use redis::{
    Client, ErrorKind, IntoConnectionInfo, RedisError, ServerErrorKind,
    sentinel::{SentinelClient, SentinelNodeConnectionInfo, SentinelServerType},
};
#[cfg(feature = "tls")]
use redis::{
    ConnectionAddr, ConnectionInfo, RedisConnectionInfo, TlsMode, sentinel::SentinelClientBuilder,
};

use super::{
    Acquire, BoxFuture, Capabilities, Eviction, LockStore, RedisStore, Route, StoreError,
    StoreErrorKind,
    redis::{Handoff, TLS_MARK, connect_error, redis_error, refuse_insecure, server_name},
};
use crate::{key::LockKey, token::Token};

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
/// use tower_lock::{Key, LockLayer, SentinelStore};
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

/// A lookup for the follower thread: after a call to `failed` went wrong with `error`, or a
/// background poll (`error` and `reply` `None`).
struct Follow {
    failed: Arc<Master>,
    error: Option<StoreError>,
    reply: Option<oneshot::Sender<Option<Arc<Master>>>>,
}

struct Lookup {
    client: SentinelClient,
    last: Option<Instant>,
    /// How messages name the sentinels (their addresses, never their URLs).
    target: String,
}

impl Lookup {
    /// Asks the sentinels for the master now.
    async fn master(&mut self) -> Result<Client, StoreError> {
        self.last = Some(Instant::now());
        match tokio::time::timeout(LOOKUP_TIMEOUT, self.client.async_get_client()).await {
            Ok(found) => found.map_err(|e| connect_error(&self.target, e)),
            Err(_) => Err(StoreError::msg(
                StoreErrorKind::Timeout,
                format!("the Redis sentinels did not name a master within {LOOKUP_TIMEOUT:?}"),
            )),
        }
    }
}

/// The master the sentinels named, and a store connected to it.
pub(crate) struct Master {
    store: RedisStore,
    /// The store's capabilities, resolved once.
    caps: Capabilities,
    addr: String,
    /// How to reach it: for the hand-off subscription.
    client: Client,
}

impl Master {
    /// Connects to the master `client` reaches; its store has the default settings.
    async fn connect(client: &Client) -> Result<Self, StoreError> {
        let info = client.get_connection_info();
        let store = tokio::time::timeout(LOOKUP_TIMEOUT, RedisStore::connect_plain(info.clone()))
            .await
            .map_err(|_| {
                StoreError::msg(
                    StoreErrorKind::Timeout,
                    format!(
                        "could not connect to the Redis master, {}, within {LOOKUP_TIMEOUT:?}",
                        server_name(info)
                    ),
                )
            })??;
        Ok(Self::new(store, info.addr().to_string(), client.clone()))
    }

    fn new(store: RedisStore, addr: String, client: Client) -> Self {
        Self {
            caps: store.capabilities(),
            store,
            addr,
            client,
        }
    }

    /// This master with `settings` applied to its store.
    fn with(&self, settings: &Settings) -> Self {
        Self::new(
            settings.apply(self.store.clone()),
            self.addr.clone(),
            self.client.clone(),
        )
    }
}

/// The [`RedisStore`] settings, applied again to the store of every new master.
#[derive(Debug, Clone)]
struct Settings {
    fence_retention: Option<Duration>,
    native_commands: bool,
    replicas: Option<(usize, Duration)>,
    claim_window: Option<Duration>,
    /// The store's hand-off (one channel, one subscription, one registry of waiters), given to
    /// the store of every master it follows; `None` when off.
    handoff: Option<Arc<Handoff>>,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            fence_retention: None,
            native_commands: true,
            replicas: None,
            claim_window: None,
            handoff: None,
        }
    }
}

impl Settings {
    fn apply(&self, mut store: RedisStore) -> RedisStore {
        if let Some(retention) = self.fence_retention {
            store = store.fence_retention(retention);
        }
        if let Some(window) = self.claim_window {
            store = store.claim_window(window);
        }
        let (replicas, timeout) = self.replicas.unwrap_or((0, Duration::ZERO));
        store
            .native_commands(self.native_commands)
            .wait_for_replicas(replicas, timeout)
            .attach_handoff(self.handoff.clone())
    }
}

impl SentinelStore {
    /// Asks `sentinels` (any of the sentinels that monitor it) for the master named
    /// `master_name` and connects to it, with the timeouts of [`RedisStore::connect`]. Fails if
    /// no sentinel names a reachable master now.
    ///
    /// The sentinels' URLs carry what it takes to reach them (`redis://user:password@host:port/`);
    /// for a master that needs a password, a database other than 0 or TLS, use
    /// [`connect_with`](Self::connect_with).
    pub async fn connect<T: IntoConnectionInfo>(
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
    /// use tower_lock::{
    ///     SentinelStore,
    ///     redis::{RedisConnectionInfo, sentinel::SentinelNodeConnectionInfo},
    /// };
    ///
    /// let master = SentinelNodeConnectionInfo::default()
    ///     .set_redis_connection_info(RedisConnectionInfo::default().set_password("secret"));
    /// let store =
    ///     SentinelStore::connect_with(["redis://10.0.0.1:26379/"], "mymaster", master).await?;
    /// # let _ = store; Ok(()) }
    /// ```
    pub async fn connect_with<T: IntoConnectionInfo>(
        sentinels: impl IntoIterator<Item = T>,
        master_name: &str,
        master: SentinelNodeConnectionInfo,
    ) -> Result<Self, StoreError> {
        let sentinels = sentinels
            .into_iter()
            .map(|url| url.into_connection_info().map_err(redis_error))
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
    /// (those of the first URL; URLs that differ are a [`Config`](StoreErrorKind::Config)
    /// error).
    ///
    /// ```no_run
    /// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
    /// use tower_lock::{SentinelStore, redis::RedisConnectionInfo, store::TlsConfig};
    ///
    /// let tls = TlsConfig::new().ca_cert_file("/etc/redis/tls/ca.pem");
    /// let master = RedisConnectionInfo::default().set_password("secret");
    /// let store =
    ///     SentinelStore::connect_with_tls(["rediss://10.0.0.1:26380/"], "mymaster", master, &tls)
    ///         .await?;
    /// # let _ = store; Ok(()) }
    /// ```
    #[cfg(feature = "tls")]
    pub async fn connect_with_tls<T: IntoConnectionInfo>(
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
                StoreErrorKind::Config,
                "a Sentinel store needs at least one sentinel URL",
            ));
        };
        if sentinels.iter().any(|s| {
            s.redis_settings().username() != first.username()
                || s.redis_settings().password() != first.password()
        }) {
            return Err(StoreError::msg(
                StoreErrorKind::Config,
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
    #[must_use]
    pub fn fence_retention(self, retention: Duration) -> Self {
        self.configure(|s, _| s.fence_retention = Some(retention))
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
    #[must_use]
    pub fn wait_for_replicas(self, replicas: usize, timeout: Duration) -> Self {
        self.configure(|s, _| s.replicas = (replicas > 0).then_some((replicas, timeout)))
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
    #[must_use]
    pub fn claim_window(self, window: Duration) -> Self {
        self.configure(|s, _| s.claim_window = Some(window))
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

    /// Runs `op` on the current master; after a failure that a failover explains, asks the
    /// sentinels again and, if they name another master, runs it there once more.
    async fn run<T, F, Fut>(&self, op: F) -> Result<T, StoreError>
    where
        F: Fn(Arc<Master>) -> Fut,
        Fut: Future<Output = Result<T, StoreError>>,
    {
        self.poll_if_due();
        let master = self.current();
        let error = match op(Arc::clone(&master)).await {
            Err(error) if after_failover(&error) => error,
            answer => return answer,
        };
        match self.follow(&master, Some(&error)).await {
            Some(next) => op(next).await,
            None => Err(error),
        }
    }

    /// Starts a background lookup when one is due and none is running.
    fn poll_if_due(&self) {
        let inner = &self.inner;
        let now = millis(inner.created.elapsed());
        if now < inner.next_poll.load(Ordering::Relaxed)
            || inner.polling.swap(true, Ordering::AcqRel)
        {
            return;
        }
        inner
            .next_poll
            .store(now + millis(POLL_INTERVAL), Ordering::Relaxed);
        let poll = Follow {
            failed: self.current(),
            error: None,
            reply: None,
        };
        if !self.send_follower(poll) {
            inner.polling.store(false, Ordering::Release);
        }
    }

    /// Asks the sentinels for the master, after a call to `failed` went wrong with `error`; the
    /// new master, if there is one. The lookup runs on the follower thread.
    async fn follow(
        &self,
        failed: &Arc<Master>,
        error: Option<&StoreError>,
    ) -> Option<Arc<Master>> {
        let (reply, answer) = oneshot::channel();
        let request = Follow {
            failed: Arc::clone(failed),
            error: error.cloned(),
            reply: Some(reply),
        };
        if !self.send_follower(request) {
            return None;
        }
        // The lookup and the connection are bounded each; this bounds a queue of them.
        tokio::time::timeout(FOLLOW_WAIT, answer)
            .await
            .ok()
            .and_then(Result::ok)
            .flatten()
    }

    /// Hands `request` to the follower thread, started if it is not running (the first time,
    /// or after it failed). Whether it took it.
    fn send_follower(&self, request: Follow) -> bool {
        let mut follower = self
            .inner
            .follower
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let request = match follower.as_ref() {
            Some(tx) => match tx.send(request) {
                Ok(()) => return true,
                // The thread ended (it could not build its runtime): another one.
                Err(mpsc::error::SendError(request)) => request,
            },
            None => request,
        };
        let (tx, rx) = mpsc::unbounded_channel();
        let _ = tx.send(request);
        let inner = Arc::downgrade(&self.inner);
        let started = std::thread::Builder::new()
            .name("tower-lock-sentinel".to_owned())
            .spawn(move || follower_thread(inner, rx));
        match started {
            Ok(_) => {
                *follower = Some(tx);
                true
            }
            Err(error) => {
                tracing::warn!(
                    error = &error as &dyn StdError,
                    "cannot start the Sentinel store's lookup thread; failovers are not followed"
                );
                false
            }
        }
    }

    /// Asks the sentinels for the master, after a call to `failed` went wrong with `error` or
    /// for a background poll (`None`); the new master, if there is one. Runs on the follower
    /// thread only.
    async fn follow_now(
        &self,
        failed: &Arc<Master>,
        error: Option<&StoreError>,
    ) -> Option<Arc<Master>> {
        let mut lookup = self.inner.lookup.lock().await;
        let current = self.current();
        if !Arc::ptr_eq(&current, failed) {
            // Another call has moved on while this one waited.
            return Some(current);
        }
        if lookup
            .last
            .is_some_and(|last| last.elapsed() < MIN_LOOKUP_INTERVAL)
        {
            return None;
        }
        let found = match lookup.master().await {
            Ok(client) => client,
            Err(lookup_error) => {
                tracing::debug!(
                    master_name = %self.inner.master_name,
                    error = &lookup_error as &dyn StdError,
                    "the Redis sentinels did not name a reachable master"
                );
                return None;
            }
        };
        if found.get_connection_info().addr().to_string() == current.addr {
            return None;
        }
        let next = match Master::connect(&found).await {
            Ok(next) => next,
            Err(connect_error) => {
                tracing::debug!(
                    master_name = %self.inner.master_name,
                    error = &connect_error as &dyn StdError,
                    "cannot connect to the master the Redis sentinels named"
                );
                return None;
            }
        };
        tracing::warn!(
            master_name = %self.inner.master_name,
            from = %current.addr,
            to = %next.addr,
            error = error.map(|e| e as &(dyn StdError + 'static)),
            "Redis Sentinel failover: the lock store follows the new master"
        );
        // The settings as they are now (locked until the new master is current, so that a
        // change made meanwhile is not lost).
        let settings = self
            .inner
            .settings
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let next = Arc::new(next.with(&settings));
        if let Some(handoff) = &settings.handoff {
            // Before the new master is current: from now until the subscription is up there,
            // waiters do not queue; then every waiter checks again on the new master.
            handoff.retarget(next.client.clone());
        }
        *self
            .inner
            .current
            .write()
            .unwrap_or_else(PoisonError::into_inner) = Arc::clone(&next);
        drop(settings);
        Some(next)
    }
}

/// The follower thread: looks the master up and connects to it, one request after the other,
/// on a current-thread runtime of its own, so that the lookups (and the connection to each new
/// master) never depend on a runtime that uses the store, which may shut down or no longer be
/// driven (a lookup left on such a runtime would hold the sentinels' client, and with it every
/// later failover, for good). Ends with the store.
fn follower_thread(inner: std::sync::Weak<Inner>, mut requests: mpsc::UnboundedReceiver<Follow>) {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            tracing::warn!(
                error = &error as &dyn StdError,
                "cannot start the Sentinel store's lookup runtime; failovers are not followed"
            );
            return;
        }
    };
    runtime.block_on(async move {
        while let Some(request) = requests.recv().await {
            let Some(inner) = inner.upgrade() else {
                return;
            };
            let store = SentinelStore { inner };
            let next = store
                .follow_now(&request.failed, request.error.as_ref())
                .await;
            match request.reply {
                Some(reply) => {
                    let _ = reply.send(next);
                }
                None => store.inner.polling.store(false, Ordering::Release),
            }
        }
    });
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

/// Whether `error` is what a call to a master that failed or was demoted gets.
fn after_failover(error: &StoreError) -> bool {
    match error.kind() {
        StoreErrorKind::Unavailable | StoreErrorKind::Timeout => true,
        StoreErrorKind::Backend => StdError::source(error)
            .and_then(|source| source.downcast_ref::<RedisError>())
            .is_some_and(|e| {
                matches!(
                    e.kind(),
                    ErrorKind::Server(ServerErrorKind::ReadOnly | ServerErrorKind::MasterDown)
                ) || {
                    // A write refused inside a script may come back as a script error.
                    let text = e.to_string();
                    text.contains("READONLY") || text.contains("MASTERDOWN")
                }
            }),
        _ => false,
    }
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
        Capabilities::routed(Arc::new(self.clone()))
    }
}

/// Calls go to the current master; after an error that a failover explains, once more to the
/// master the sentinels name then.
impl Route for SentinelStore {
    type Target = Arc<Master>;

    fn current(&self) -> Arc<Master> {
        self.poll_if_due();
        SentinelStore::current(self)
    }

    fn capabilities(master: &Arc<Master>) -> &Capabilities {
        &master.caps
    }

    fn after(&self, failed: &Arc<Master>, error: &StoreError) -> BoxFuture<Option<Arc<Master>>> {
        if !after_failover(error) {
            return Box::pin(std::future::ready(None));
        }
        let (this, failed, error) = (self.clone(), Arc::clone(failed), error.clone());
        Box::pin(async move { this.follow(&failed, Some(&error)).await })
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
