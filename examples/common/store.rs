//! The lock store and the data connection, chosen from the environment; shared by the examples
//! (`#[path = "common/store.rs"] mod store;`).
//!
//! | variable | default | meaning |
//! |---|---|---|
//! | `LOCK_STORE` | `redis` when `REDIS_URL` or `REDIS_URLS` is set, else `memory` | `memory`: one process; `redis`: one Redis (`REDIS_URL`, or the first of `REDIS_URLS`); `redlock`: a quorum of the independent masters in `REDIS_URLS`; `cluster`: the Redis Cluster reached through the seed nodes in `REDIS_URLS` (needs `--features cluster`) |
//! | `REDIS_URL` | unset | the one Redis for `LOCK_STORE=redis` |
//! | `REDIS_URLS` | unset | comma-separated URLs: Redlock masters, or cluster seed nodes |
//! | `LOCK_WAIT_REPLICAS` | `0` | with `redis`: `WAIT` for this many replicas after each acquire and renewal (503 when fewer acknowledge) |
//! | `LOCK_WAIT_REPLICAS_MS` | `100` | how long `WAIT` may take |
//!
//! The examples' own data (stock, payments) stays on one Redis: `REDIS_URL`, else the first of
//! `REDIS_URLS`; with `cluster`, in the cluster.
#![allow(dead_code)]

use std::{env, error::Error, time::Duration};

use redis::{
    Cmd, Pipeline, RedisFuture, Value,
    aio::{ConnectionLike, ConnectionManager},
};
use tower_lock::{KeySource, LockConfig, LockLayer, Locker, MemoryStore, RedisStore, RedlockStore};

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
    Cluster(tower_lock::ClusterStore),
}

/// What [`from_env`] chose.
pub struct Chosen {
    pub store: Store,
    /// `None` with [`Store::Memory`]: keep the data in the process.
    pub data: Option<DataConnection>,
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
        }
    }

    /// A [`LockLayer`] for `key` on the chosen store, with a locker of its own.
    pub fn lock_layer(&self, key: impl KeySource, config: LockConfig) -> LockLayer {
        LockLayer::from_locker(self.locker(config), key)
    }
}

/// Connects to the lock store the environment names, and to the example's data.
pub async fn from_env() -> Result<Chosen, Box<dyn Error>> {
    let url = env::var("REDIS_URL").ok().filter(|u| !u.is_empty());
    let urls: Vec<String> = env::var("REDIS_URLS")
        .unwrap_or_default()
        .split(',')
        .map(str::trim)
        .filter(|u| !u.is_empty())
        .map(str::to_owned)
        .collect();
    let default = if url.is_some() || !urls.is_empty() {
        "redis"
    } else {
        "memory"
    };
    let kind = env::var("LOCK_STORE").unwrap_or_else(|_| default.to_owned());
    let first = url.clone().or_else(|| urls.first().cloned());
    let replicas: usize = parse_env("LOCK_WAIT_REPLICAS", 0)?;
    let replica_timeout = Duration::from_millis(parse_env("LOCK_WAIT_REPLICAS_MS", 100)?);
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
            let mut store = RedisStore::connect(url.as_str())
                .await
                .map_err(|e| format!("cannot connect to {url}: {e}"))?;
            let mut description = format!("locks and data in Redis at {url}");
            if replicas > 0 {
                store = store.wait_for_replicas(replicas, replica_timeout);
                description += &format!(", each lease acknowledged by {replicas} replica(s)");
            }
            Ok(Chosen {
                store: Store::Redis(store),
                data: Some(single(&url).await?),
                description,
            })
        }
        "redlock" => {
            if urls.is_empty() {
                return Err("LOCK_STORE=redlock needs REDIS_URLS (comma-separated masters)".into());
            }
            let store = RedlockStore::connect(urls.iter().map(String::as_str))
                .await
                .map_err(|e| format!("cannot reach a quorum of REDIS_URLS: {e}"))?;
            let data_url = first.expect("REDIS_URLS is not empty");
            Ok(Chosen {
                description: format!(
                    "locks on a Redlock quorum of {} of {} masters; data in Redis at {data_url}",
                    store.quorum(),
                    urls.len()
                ),
                store: Store::Redlock(store),
                data: Some(single(&data_url).await?),
            })
        }
        "cluster" => cluster(urls).await,
        other => Err(format!(
            "LOCK_STORE={other:?} is invalid: use memory, redis, redlock or cluster"
        )
        .into()),
    }
}

async fn single(url: &str) -> Result<DataConnection, Box<dyn Error>> {
    let conn = redis::Client::open(url)?.get_connection_manager().await?;
    Ok(DataConnection::Single(conn))
}

#[cfg(feature = "cluster")]
async fn cluster(urls: Vec<String>) -> Result<Chosen, Box<dyn Error>> {
    if urls.is_empty() {
        return Err("LOCK_STORE=cluster needs REDIS_URLS (comma-separated seed nodes)".into());
    }
    let client = redis::cluster::ClusterClient::new(urls.iter().map(String::as_str))?;
    let conn = client.get_async_connection().await?;
    Ok(Chosen {
        store: Store::Cluster(tower_lock::ClusterStore::from_connection(conn.clone())),
        data: Some(DataConnection::Cluster(conn)),
        description: format!(
            "locks and data in the Redis Cluster seeded by {}",
            urls.join(",")
        ),
    })
}

#[cfg(not(feature = "cluster"))]
async fn cluster(_urls: Vec<String>) -> Result<Chosen, Box<dyn Error>> {
    Err("LOCK_STORE=cluster needs the `cluster` feature: cargo run --features cluster ...".into())
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
