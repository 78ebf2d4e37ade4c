//! Leases in a Redis Cluster, over the redis crate's async cluster client.

use std::{fmt, time::Duration};

use redis::{
    IntoConnectionInfo,
    cluster::{ClusterClient, ClusterClientBuilder},
    cluster_async::ClusterConnection,
};

use super::{
    Acquire, Capabilities, Eviction, LockStore, RedisStore, StoreError, StoreErrorKind,
    redis::{connect_error, redis_error, refuse_insecure, server_name},
};
use crate::{key::LockKey, token::Token};

/// How long the cluster client waits between retries of a command refused for now (`TRYAGAIN`,
/// `CLUSTERDOWN`, ...), in ms: at least the start, at most the end.
const RETRY_WAIT_MS: std::ops::Range<u64> = 10..50;

/// Leases in a Redis Cluster (the `cluster` feature).
///
/// The same scripts as [`RedisStore`], sent over the redis crate's
/// [`ClusterConnection`], which routes each command to the master of its key's hash slot and
/// follows `MOVED` and `ASK` redirections by itself (slot migrations, failovers). A lock key
/// starts with a hash tag naming the slot of its whole scoped value
/// (`tower-lock:{<tag>}<scope length>:<scope>:<digest>`, see [`crate::key`]), so the keys of one
/// route spread over every slot and master, and the key, its hand-off queue and idempotency
/// record (`tower-lock:{<tag>}queue:…`, `tower-lock:{<tag>}record:…`) and its slot's fencing
/// counter (`tower-lock:fence:{<tag>}`, or `tower-lock:fence` in its own slot) share a slot:
/// every script stays single-slot. A batch of renewals goes one script per slot.
///
/// While a slot migrates, an acquire of a free key in it is refused with `TRYAGAIN` until the
/// migration ends; the client retries it briefly (see [`connect`](Self::connect)), then the
/// acquire retries it within its wait deadline (a [`StoreErrorKind::TryAgain`](super::StoreErrorKind::TryAgain)).
///
/// ```no_run
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// use tower_lock::{store::ClusterStore, Key, LockLayer};
///
/// // Seed nodes: any few of the cluster's nodes; the client discovers the rest.
/// let store = ClusterStore::connect(["redis://10.0.0.1:7000/", "redis://10.0.0.2:7000/"]).await?;
/// let layer = LockLayer::new(store, Key::path_param("sku"));
/// # let _ = layer; Ok(()) }
/// ```
///
/// # Failover
///
/// Each slot has one master, and its replicas copy it asynchronously: when a master fails and
/// a replica is promoted, the leases it had not yet received are lost, as with a single master
/// and its replicas. A lease lost that way is noticed by its holder at the next renewal (the
/// renewal finds the key gone); in between, a second client can take the key. Requests keep
/// being served once the cluster has promoted the replica (typically a little more than the
/// cluster's `cluster-node-timeout`); until then, calls for the failed master's slots fail or
/// time out (503). `WAIT` is not offered here: see `docs/TOPOLOGY.md`.
#[derive(Clone)]
pub struct ClusterStore {
    inner: RedisStore,
}

impl ClusterStore {
    /// Connects to the cluster through `seeds` (any of its nodes), with a 1 s connection timeout
    /// and a 2 s response timeout per command. Fails if no seed can be reached now.
    ///
    /// The client retries a command that meets `TRYAGAIN` (its slot is being migrated),
    /// `CLUSTERDOWN`, `MASTERDOWN` or `LOADING` by itself, waiting 10 to 50 ms between tries,
    /// and follows `MOVED` and `ASK`, up to 16 times in all; the redis crate's default waits at
    /// least 1.28 s, longer than most requests wait for a lock, so an acquire in a slot whose
    /// migration took milliseconds would wait over a second. When the client gives up during
    /// a migration (on `TRYAGAIN`, `MOVED` or `ASK`), the acquire retries on its own schedule
    /// until its wait deadline (see `docs/TOPOLOGY.md`).
    ///
    /// Once connected, it asks every master for its eviction policy and logs a warning for each
    /// that may evict lock keys (see [`eviction`](Self::eviction)).
    pub async fn connect<T: AsRef<str>>(
        seeds: impl IntoIterator<Item = T>,
    ) -> Result<Self, StoreError> {
        let seeds = seeds
            .into_iter()
            .map(|seed| seed.as_ref().into_connection_info().map_err(redis_error))
            .collect::<Result<Vec<_>, _>>()?;
        Self::connect_seeds(seeds, Ok).await
    }

    /// Like [`connect`](Self::connect), over TLS with `tls`'s CA bundle and client certificate
    /// for the seeds and every node the client finds (the `tls` feature, and nodes started with
    /// `tls-cluster yes`); the seeds are `rediss://` URLs.
    #[cfg(feature = "tls")]
    pub async fn connect_with_tls<T: AsRef<str>>(
        seeds: impl IntoIterator<Item = T>,
        tls: &super::TlsConfig,
    ) -> Result<Self, StoreError> {
        let seeds = seeds
            .into_iter()
            .map(|seed| tls.connection_info(seed))
            .collect::<Result<Vec<_>, _>>()?;
        let tls_seeds = seeds
            .iter()
            .any(|seed| matches!(seed.addr(), redis::ConnectionAddr::TcpTls { .. }));
        Self::connect_seeds(seeds, |builder| {
            // The cluster's nodes are reached with the client's settings, not the seeds'.
            Ok(if tls_seeds {
                builder.certs(tls.certificates()?)
            } else {
                builder
            })
        })
        .await
    }

    async fn connect_seeds(
        seeds: Vec<redis::ConnectionInfo>,
        configure: impl FnOnce(ClusterClientBuilder) -> Result<ClusterClientBuilder, StoreError>,
    ) -> Result<Self, StoreError> {
        let target = match seeds.as_slice() {
            [] => {
                return Err(StoreError::msg(
                    StoreErrorKind::Config,
                    "a cluster store needs at least one seed URL",
                ));
            }
            [one] => format!("the Redis Cluster through {}", server_name(one)),
            [first, ..] => format!(
                "the Redis Cluster through {} and {} other seed(s)",
                server_name(first),
                seeds.len() - 1
            ),
        };
        for seed in &seeds {
            refuse_insecure(seed)?;
            #[cfg(feature = "tls")]
            super::prepare_tls(seed);
        }
        let builder = ClusterClient::builder(seeds)
            .connection_timeout(Duration::from_secs(1))
            .response_timeout(Duration::from_secs(2))
            .min_retry_wait(RETRY_WAIT_MS.start)
            .max_retry_wait(RETRY_WAIT_MS.end);
        let client = configure(builder)?
            .build()
            .map_err(|e| connect_error(&target, e))?;
        // Opened on the crate's runtime, which runs the connection's I/O task from now on.
        let connection = crate::background::OnRuntime::new(client.get_async_connection())
            .await
            .map_err(|e| connect_error(&target, e))?;
        let store = Self::from_connection(connection);
        store
            .inner
            .check_eviction()
            .await
            .map_err(|e| e.while_connecting(&target))?;
        store.inner.check_native().await;
        Ok(store)
    }

    /// Asks every master now for its eviction policy (`INFO memory`): each master's address
    /// (as the cluster announces it) and whether it may evict held leases and idempotency
    /// records; see [`RedisStore::eviction`]. A master that refuses `INFO` answers
    /// [`Eviction::Unknown`].
    pub async fn eviction(&self) -> Result<Vec<(String, Eviction)>, StoreError> {
        let servers = self.inner.evictions().await?;
        Ok(servers
            .into_iter()
            .map(|s| (s.addr.unwrap_or_default(), s.eviction))
            .collect())
    }

    /// Uses an existing cluster connection (clones share it). Its client's retry settings
    /// apply: consider [`connect`](Self::connect)'s (`min_retry_wait(10)`,
    /// `max_retry_wait(50)` on the `ClusterClientBuilder`).
    pub fn from_connection(connection: ClusterConnection) -> Self {
        Self {
            inner: RedisStore::from_cluster(connection),
        }
    }

    /// How long a key's fencing counter is kept after its last acquisition (default 24 h); see
    /// [`RedisStore::fence_retention`].
    ///
    /// # Errors
    ///
    /// A [`ConfigError`](crate::ConfigError) (field `fence_retention`) for less than 1 ms or
    /// more than 365 days.
    pub fn fence_retention(self, retention: Duration) -> Result<Self, crate::ConfigError> {
        Ok(Self {
            inner: self.inner.fence_retention(retention)?,
        })
    }

    /// Whether to use native compare commands where the servers have them (default `true`);
    /// see [`RedisStore::native_commands`].
    #[must_use]
    pub fn native_commands(self, enabled: bool) -> Self {
        Self {
            inner: self.inner.native_commands(enabled),
        }
    }
}

impl LockStore for ClusterStore {
    async fn acquire(
        &self,
        key: &LockKey,
        token: &Token,
        ttl: Duration,
    ) -> Result<Acquire, StoreError> {
        self.inner.acquire(key, token, ttl).await
    }

    async fn renew(&self, key: &LockKey, token: &Token, ttl: Duration) -> Result<bool, StoreError> {
        self.inner.renew(key, token, ttl).await
    }

    async fn release(&self, key: &LockKey, token: &Token) -> Result<bool, StoreError> {
        self.inner.release(key, token).await
    }

    /// Those of the [`RedisStore`] it is built on: group commit (one script per hash slot,
    /// each sent to its slot's master, all at once) and idempotency records (next to the lock
    /// keys, in the same slot, so the records' scripts work on a cluster unchanged). Hand-off
    /// is not offered on a cluster (see `docs/TOPOLOGY.md`).
    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }
}

impl fmt::Debug for ClusterStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClusterStore")
            .field("inner", &self.inner)
            .finish()
    }
}
