//! The lock store and the data connection, chosen from the environment; shared by the examples
//! (`#[path = "common/store.rs"] mod store;`).
//!
//! | variable | default | meaning |
//! |---|---|---|
//! | `LOCK_STORE` | `redis` when `REDIS_URL` or `REDIS_URLS` is set, else `memory` | `memory`: one process; `redis`: one Redis (`REDIS_URL`, or the first of `REDIS_URLS`); `redlock`: a quorum of the independent masters in `REDIS_URLS`; `cluster`: the Redis Cluster reached through the seed nodes in `REDIS_URLS` (needs `--features cluster`); `sentinel`: the master that the sentinels in `SENTINEL_URLS` name `SENTINEL_MASTER`, following failovers (needs `--features sentinel`) |
//! | `REDIS_URL` | unset | the one Redis for `LOCK_STORE=redis`; with `sentinel`, the Redis that keeps the example's data |
//! | `REDIS_URLS` | unset | comma-separated URLs: Redlock masters, or cluster seed nodes |
//! | `SENTINEL_URLS` | unset | with `sentinel`: comma-separated URLs of the sentinels (any of those that monitor the master) |
//! | `SENTINEL_MASTER` | `mymaster` | with `sentinel`: the name the sentinels monitor the master under |
//! | `LOCK_WAIT_REPLICAS` | `0` | with `redis`: `WAIT` for this many replicas after each acquire and renewal (503 when fewer acknowledge) |
//! | `LOCK_WAIT_REPLICAS_MS` | `100` | how long `WAIT` may take |
//! | `REDIS_CA_CERT` | unset | a PEM file of the CA(s) to trust for `rediss://` URLs instead of the system's (needs `--features tls`) |
//! | `REDIS_CLIENT_CERT`, `REDIS_CLIENT_KEY` | unset | PEM files of a client certificate and its key, for servers that require one (`tls-auth-clients yes`: mutual TLS; needs `--features tls`) |
//!
//! The examples' own data (stock, payments) stays on one Redis: `REDIS_URL`, else the first of
//! `REDIS_URLS`; with `cluster`, in the cluster; with `sentinel`, on `REDIS_URL` (required: a
//! Redis of its own, since the sentinels' master changes with each failover and a connection
//! to it would not follow). TLS (a `rediss://` URL, with the `tls` feature) applies to the data
//! connection too, and with `sentinel` (`rediss://` sentinel URLs) to the sentinels and every
//! master they name. The data is written through fenced writes ([`Data::fenced`],
//! `tower_lock::fence`), on a connection of its own (on a cluster, the lock store's).
//!
//! A URL is never printed with its password: banners and errors show
//! `redis://user:***@host:port/` ([`redacted`]). A connection that fails at start-up is an
//! error that names its cause (credentials, TLS certificate, an address that does not answer),
//! and the example exits with status 1.
#![allow(dead_code)]

use std::{env, error::Error, time::Duration};

use redis::{
    Cmd, Pipeline, RedisFuture, Value,
    aio::{ConnectionLike, ConnectionManager},
};
#[cfg(feature = "tls")]
use tower_lock::store::TlsConfig;
use tower_lock::{
    LockConfig, LockLayer, Locker, MemoryStore, RedisStore,
    fence::FencedData,
    key::IntoKeys,
    store::{RedlockStore, StoreError},
};

/// A connection for the example's own data: one Redis, or the cluster.
#[derive(Clone)]
pub enum DataConnection {
    Single(ConnectionManager),
    #[cfg(feature = "cluster")]
    Cluster(redis::cluster_async::ClusterConnection),
}

impl ConnectionLike for DataConnection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Self::Single(conn) => conn.req_packed_command(cmd),
            #[cfg(feature = "cluster")]
            Self::Cluster(conn) => conn.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Self::Single(conn) => conn.req_packed_commands(pipeline, offset, count),
            #[cfg(feature = "cluster")]
            Self::Cluster(conn) => conn.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Self::Single(conn) => conn.get_db(),
            #[cfg(feature = "cluster")]
            Self::Cluster(conn) => conn.get_db(),
        }
    }
}

/// The lock store [`from_env`] chose.
// Built once at start-up and moved into the layer: the size of the variants does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug)]
pub enum Store {
    /// One process: the caller uses a `MemoryStore` (and keeps its data in the process too).
    Memory,
    Redis(RedisStore),
    Redlock(RedlockStore),
    #[cfg(feature = "cluster")]
    Cluster(tower_lock::store::ClusterStore),
    #[cfg(feature = "sentinel")]
    Sentinel(tower_lock::store::SentinelStore),
}

/// Where an example keeps its own data, in Redis.
#[derive(Clone)]
pub struct Data {
    /// For plain reads (a listing).
    pub conn: DataConnection,
    /// For every write of data a lock protects: fenced by the lease's tokens.
    pub fenced: FencedData,
    /// Whether the server hashes keys to slots (a cluster): a fenced batch then touches one
    /// slot.
    pub per_slot: bool,
}

/// What [`from_env`] chose.
pub struct Chosen {
    pub store: Store,
    /// `None` with [`Store::Memory`]: keep the data in the process.
    pub data: Option<Data>,
    /// One line for the start-up banner.
    pub description: String,
}

impl Chosen {
    /// A [`Locker`] on the chosen store, for layers that must share it (their locks, and their
    /// turns in this process): with [`Store::Memory`], each call makes a store of its own.
    pub fn locker(&self, config: LockConfig) -> Locker {
        match &self.store {
            Store::Memory => Locker::with_config(MemoryStore::new(), config),
            Store::Redis(store) => Locker::with_config(store.clone(), config),
            Store::Redlock(store) => Locker::with_config(store.clone(), config),
            #[cfg(feature = "cluster")]
            Store::Cluster(store) => Locker::with_config(store.clone(), config),
            #[cfg(feature = "sentinel")]
            Store::Sentinel(store) => Locker::with_config(store.clone(), config),
        }
    }

    /// A [`LockLayer`] for `key` on the chosen store, with a locker of its own.
    pub fn lock_layer(&self, key: impl IntoKeys, config: LockConfig) -> LockLayer {
        LockLayer::from_locker(self.locker(config), key)
    }
}

/// Connects to the lock store the environment names, and to the example's data.
pub async fn from_env() -> Result<Chosen, Box<dyn Error>> {
    let url = env::var("REDIS_URL").ok().filter(|u| !u.is_empty());
    let urls = env_list("REDIS_URLS");
    let default = if url.is_some() || !urls.is_empty() {
        "redis"
    } else {
        "memory"
    };
    let kind = env::var("LOCK_STORE").unwrap_or_else(|_| default.to_owned());
    let first = url.clone().or_else(|| urls.first().cloned());
    let replicas: usize = parse_env("LOCK_WAIT_REPLICAS", 0)?;
    let replica_timeout = Duration::from_millis(parse_env("LOCK_WAIT_REPLICAS_MS", 100)?);
    let tls = Tls::from_env()?;
    if replicas > 0 && kind != "redis" {
        return Err(format!("LOCK_WAIT_REPLICAS applies to LOCK_STORE=redis, not {kind}").into());
    }
    match kind.as_str() {
        "memory" => Ok(Chosen {
            store: Store::Memory,
            data: None,
            description: "locks and data live in this process (LOCK_STORE=memory)".into(),
        }),
        "redis" => {
            let url = first.ok_or("LOCK_STORE=redis needs REDIS_URL (or REDIS_URLS)")?;
            let mut store = tls
                .redis_store(&url)
                .await
                .map_err(|e| format!("REDIS_URL {}: {}", redacted(&url), chain(&e)))?;
            let mut description = format!("locks and data in Redis at {}", redacted(&url));
            if replicas > 0 {
                store = store
                    .wait_for_replicas(replicas, replica_timeout)
                    .map_err(|e| format!("LOCK_WAIT_REPLICAS, LOCK_WAIT_REPLICAS_MS: {e}"))?;
                description += &format!(", each lease acknowledged by {replicas} replica(s)");
            }
            Ok(Chosen {
                store: Store::Redis(store),
                data: Some(tls.data(&url).await?),
                description,
            })
        }
        "redlock" => {
            if urls.is_empty() {
                return Err("LOCK_STORE=redlock needs REDIS_URLS (comma-separated masters)".into());
            }
            let store = tls
                .redlock_store(&urls)
                .await
                .map_err(|e| format!("REDIS_URLS: {}", chain(&e)))?;
            let data_url = first.expect("REDIS_URLS is not empty");
            Ok(Chosen {
                description: format!(
                    "locks on a Redlock quorum of {} of {} masters; data in Redis at {}",
                    store.quorum(),
                    urls.len(),
                    redacted(&data_url)
                ),
                store: Store::Redlock(store),
                data: Some(tls.data(&data_url).await?),
            })
        }
        "cluster" => cluster(urls, &tls).await,
        "sentinel" => sentinel(url, &tls).await,
        other => Err(format!(
            "LOCK_STORE={other:?} is invalid: use memory, redis, redlock, cluster or sentinel"
        )
        .into()),
    }
}

/// The TLS settings from `REDIS_CA_CERT`, `REDIS_CLIENT_CERT` and `REDIS_CLIENT_KEY`, and the
/// connections made with them.
pub struct Tls {
    #[cfg(feature = "tls")]
    config: TlsConfig,
}

impl Tls {
    /// Reads the variables; without the `tls` feature, any of them set is an error.
    pub fn from_env() -> Result<Self, String> {
        let var = |name: &str| env::var(name).ok().filter(|v| !v.is_empty());
        let (ca, cert, key) = (
            var("REDIS_CA_CERT"),
            var("REDIS_CLIENT_CERT"),
            var("REDIS_CLIENT_KEY"),
        );
        #[cfg(feature = "tls")]
        {
            let mut config = TlsConfig::new();
            if let Some(ca) = ca {
                config = config.ca_cert_file(ca);
            }
            config = match (cert, key) {
                (Some(cert), Some(key)) => config.client_cert_files(cert, key),
                (None, None) => config,
                _ => return Err("REDIS_CLIENT_CERT and REDIS_CLIENT_KEY go together".into()),
            };
            Ok(Self { config })
        }
        #[cfg(not(feature = "tls"))]
        {
            if ca.is_some() || cert.is_some() || key.is_some() {
                return Err(
                    "REDIS_CA_CERT, REDIS_CLIENT_CERT and REDIS_CLIENT_KEY need the `tls` \
                            feature: cargo run --features tls ..."
                        .into(),
                );
            }
            Ok(Self {})
        }
    }

    /// `RedisStore::connect`, with the TLS settings.
    pub async fn redis_store(&self, url: &str) -> Result<RedisStore, StoreError> {
        #[cfg(feature = "tls")]
        return RedisStore::connect_with_tls(url, &self.config).await;
        #[cfg(not(feature = "tls"))]
        return RedisStore::connect(url).await;
    }

    /// `RedlockStore::connect`, with the TLS settings.
    pub async fn redlock_store(&self, urls: &[String]) -> Result<RedlockStore, StoreError> {
        let urls = urls.iter().map(String::as_str);
        #[cfg(feature = "tls")]
        return RedlockStore::connect_with_tls(urls, &self.config).await;
        #[cfg(not(feature = "tls"))]
        return RedlockStore::connect(urls).await;
    }

    /// `ClusterStore::connect`, with the TLS settings.
    #[cfg(feature = "cluster")]
    pub async fn cluster_store(
        &self,
        urls: &[String],
    ) -> Result<tower_lock::store::ClusterStore, StoreError> {
        let urls = urls.iter().map(String::as_str);
        #[cfg(feature = "tls")]
        return tower_lock::store::ClusterStore::connect_with_tls(urls, &self.config).await;
        #[cfg(not(feature = "tls"))]
        return tower_lock::store::ClusterStore::connect(urls).await;
    }

    /// `SentinelStore::connect`, or over TLS (to the sentinels and every master they name)
    /// with the TLS settings when the sentinels' URLs are `rediss://` URLs.
    #[cfg(feature = "sentinel")]
    pub async fn sentinel_store(
        &self,
        sentinels: &[String],
        master: &str,
    ) -> Result<tower_lock::store::SentinelStore, StoreError> {
        #[cfg(feature = "tls")]
        if sentinels.iter().any(|url| url.starts_with("rediss://")) {
            return tower_lock::store::SentinelStore::connect_with_tls(
                sentinels.iter().map(String::as_str),
                master,
                redis::RedisConnectionInfo::default(),
                &self.config,
            )
            .await;
        }
        tower_lock::store::SentinelStore::connect(sentinels.iter().map(String::as_str), master)
            .await
    }

    /// The address and settings of `url`, with the TLS settings.
    pub fn connection_info(&self, url: &str) -> Result<redis::ConnectionInfo, String> {
        #[cfg(feature = "tls")]
        let info = self.config.connection_info(url).map_err(|e| chain(&e));
        #[cfg(not(feature = "tls"))]
        let info = redis::IntoConnectionInfo::into_connection_info(url).map_err(|e| chain(&e));
        info.map_err(|e| format!("{}: {e}", redacted(url)))
    }

    /// A connection for the example's data, to `url`: one Redis server.
    pub async fn data(&self, url: &str) -> Result<Data, Box<dyn Error>> {
        let conn = redis::Client::open(self.connection_info(url)?)?
            .get_connection_manager()
            .await
            .map_err(|e| format!("the data connection to {}: {}", redacted(url), chain(&e)))?;
        Ok(Data {
            fenced: FencedData::new(RedisStore::from_connection_manager(conn.clone())),
            conn: DataConnection::Single(conn),
            per_slot: false,
        })
    }
}

#[cfg(feature = "cluster")]
async fn cluster(urls: Vec<String>, tls: &Tls) -> Result<Chosen, Box<dyn Error>> {
    if urls.is_empty() {
        return Err("LOCK_STORE=cluster needs REDIS_URLS (comma-separated seed nodes)".into());
    }
    let store = tls
        .cluster_store(&urls)
        .await
        .map_err(|e| format!("REDIS_URLS: {}", chain(&e)))?;
    // The data: a cluster connection of its own, with the same settings.
    let seeds = urls
        .iter()
        .map(|url| tls.connection_info(url))
        .collect::<Result<Vec<_>, _>>()?;
    #[allow(unused_mut)]
    let mut builder = redis::cluster::ClusterClient::builder(seeds);
    #[cfg(feature = "tls")]
    if urls.iter().any(|url| url.starts_with("rediss://")) {
        builder = builder.certs(tls.config.certificates().map_err(|e| chain(&e))?);
    }
    let described = urls.iter().map(|u| redacted(u)).collect::<Vec<_>>();
    let conn = builder.build()?.get_async_connection().await.map_err(|e| {
        format!(
            "the data connection to the Redis Cluster at {}: {}",
            described.join(","),
            chain(&e)
        )
    })?;
    Ok(Chosen {
        data: Some(Data {
            conn: DataConnection::Cluster(conn),
            // The store's own connection: a batch goes to the master of its slot.
            fenced: FencedData::new(store.clone()),
            per_slot: true,
        }),
        store: Store::Cluster(store),
        description: format!(
            "locks and data in the Redis Cluster seeded by {}",
            described.join(",")
        ),
    })
}

#[cfg(feature = "sentinel")]
async fn sentinel(data_url: Option<String>, tls: &Tls) -> Result<Chosen, Box<dyn Error>> {
    let sentinels = env_list("SENTINEL_URLS");
    if sentinels.is_empty() {
        return Err("LOCK_STORE=sentinel needs SENTINEL_URLS (comma-separated sentinels)".into());
    }
    let data_url = data_url.ok_or(
        "LOCK_STORE=sentinel keeps the data on REDIS_URL: set it to a Redis of its own (the \
         sentinels' master changes with each failover)",
    )?;
    let master = env::var("SENTINEL_MASTER").unwrap_or_else(|_| "mymaster".to_owned());
    let store = tls
        .sentinel_store(&sentinels, &master)
        .await
        .map_err(|e| format!("SENTINEL_URLS: {}", chain(&e)))?;
    let described = sentinels.iter().map(|u| redacted(u)).collect::<Vec<_>>();
    Ok(Chosen {
        store: Store::Sentinel(store),
        data: Some(tls.data(&data_url).await?),
        description: format!(
            "locks on the master the sentinels {} name `{master}`; data in Redis at {}",
            described.join(","),
            redacted(&data_url)
        ),
    })
}

#[cfg(not(feature = "sentinel"))]
async fn sentinel(_data_url: Option<String>, _tls: &Tls) -> Result<Chosen, Box<dyn Error>> {
    Err(
        "LOCK_STORE=sentinel needs the `sentinel` feature: cargo run --features sentinel ..."
            .into(),
    )
}

#[cfg(not(feature = "cluster"))]
async fn cluster(_urls: Vec<String>, _tls: &Tls) -> Result<Chosen, Box<dyn Error>> {
    Err("LOCK_STORE=cluster needs the `cluster` feature: cargo run --features cluster ...".into())
}

/// `url` with its password, if any, shown as `***`: `redis://user:***@host:port/db`.
pub fn redacted(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return "(a URL that does not parse)".to_owned();
    };
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(authority_end);
    match authority.rsplit_once('@') {
        Some((userinfo, host)) => {
            let user = userinfo.split_once(':').map_or(userinfo, |(user, _)| user);
            let hidden = if userinfo.contains(':') { ":***" } else { "" };
            format!("{scheme}://{user}{hidden}@{host}{tail}")
        }
        None => url.to_owned(),
    }
}

/// An error and its sources, one after the other: `a: b: c`.
pub fn chain(error: &dyn Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(e) = source {
        text += &format!(": {e}");
        source = e.source();
    }
    text
}

/// The comma-separated values of the variable `name`, trimmed, empty ones left out.
fn env_list(name: &str) -> Vec<String> {
    env::var(name)
        .unwrap_or_default()
        .split(',')
        .map(str::trim)
        .filter(|u| !u.is_empty())
        .map(str::to_owned)
        .collect()
}

fn parse_env<T: std::str::FromStr>(name: &str, default: T) -> Result<T, String>
where
    T::Err: std::fmt::Display,
{
    match env::var(name) {
        Err(_) => Ok(default),
        Ok(value) => value
            .parse()
            .map_err(|e| format!("{name}={value:?} is invalid: {e}")),
    }
}
