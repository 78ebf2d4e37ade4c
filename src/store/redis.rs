use std::{fmt, sync::Arc, time::Duration};

use bb8_redis::{RedisConnectionManager, bb8};
use redis::{
    Client, FromRedisValue, IntoConnectionInfo, RedisError, Script,
    aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig, MultiplexedConnection},
};

use super::{Acquire, LockStore, StoreError, StoreErrorKind};
use crate::{key::LockKey, token::Token};

/// Suffix of the fencing counter's key, next to the lock key (same hash slot).
const FENCE_SUFFIX: &[u8] = b":fence";

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
/// by `redis::Script` if the server answers `NOSCRIPT` (after `SCRIPT FLUSH` or a restart). Next
/// to each lock key lives its fencing counter, `<lock key>:fence`, kept for
/// [`fence_retention`](Self::fence_retention) (default 24 h) after the last acquisition. Fencing
/// tokens are `max(last + 1, server time in µs)`, so they keep increasing after the counter
/// expires, as long as the Redis server's clock does not step back.
#[derive(Clone)]
pub struct RedisStore {
    transport: Transport,
    scripts: Arc<Scripts>,
    fence_retention: Duration,
}

#[derive(Clone)]
enum Transport {
    Manager(ConnectionManager),
    Multiplexed(MultiplexedConnection),
    Pool(bb8::Pool<RedisConnectionManager>),
}

struct Scripts {
    acquire: Script,
    renew: Script,
    release: Script,
}

impl Scripts {
    fn new() -> Arc<Self> {
        Arc::new(Self {
            acquire: Script::new(include_str!("scripts/acquire.lua")),
            renew: Script::new(include_str!("scripts/renew.lua")),
            release: Script::new(include_str!("scripts/release.lua")),
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
        let client = Client::open(url).map_err(redis_error)?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(Duration::from_secs(1)))
            .set_response_timeout(Some(Duration::from_secs(2)))
            .set_number_of_retries(2)
            .set_max_delay(Duration::from_millis(500));
        let manager = ConnectionManager::new_with_config(client, config)
            .await
            .map_err(redis_error)?;
        Ok(Self::from_connection_manager(manager))
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

    /// How long a key's fencing counter is kept after its last acquisition (default 24 h).
    ///
    /// Fencing tokens stay increasing without it (they follow the server clock); the counter only
    /// guards against the clock stepping back by less than this.
    #[must_use]
    pub fn fence_retention(mut self, retention: Duration) -> Self {
        self.fence_retention = retention.max(Duration::from_millis(1));
        self
    }

    fn with(transport: Transport) -> Self {
        Self {
            transport,
            scripts: Scripts::new(),
            fence_retention: Duration::from_secs(24 * 60 * 60),
        }
    }

    async fn invoke<T: FromRedisValue>(
        &self,
        script: &Script,
        keys: &[&[u8]],
        args: &[&[u8]],
    ) -> Result<T, StoreError> {
        let mut invocation = script.prepare_invoke();
        for key in keys {
            invocation.key(*key);
        }
        for arg in args {
            invocation.arg(*arg);
        }
        async fn run<T: FromRedisValue>(
            invocation: &redis::ScriptInvocation<'_>,
            conn: &mut impl ConnectionLike,
        ) -> Result<T, StoreError> {
            invocation.invoke_async(conn).await.map_err(redis_error)
        }
        match &self.transport {
            Transport::Manager(conn) => run(&invocation, &mut conn.clone()).await,
            Transport::Multiplexed(conn) => run(&invocation, &mut conn.clone()).await,
            Transport::Pool(pool) => {
                let mut conn = pool.get().await.map_err(|e| match e {
                    bb8::RunError::User(e) => redis_error(e),
                    bb8::RunError::TimedOut => StoreError::msg(
                        StoreErrorKind::Timeout,
                        "timed out waiting for a Redis connection from the pool",
                    ),
                })?;
                run(&invocation, &mut *conn).await
            }
        }
    }
}

fn redis_error(e: RedisError) -> StoreError {
    let kind = if e.is_timeout() {
        StoreErrorKind::Timeout
    } else if e.is_io_error() || e.is_connection_dropped() || e.is_connection_refusal() {
        StoreErrorKind::Unavailable
    } else {
        StoreErrorKind::Backend
    };
    StoreError::new(kind, "the Redis lock store failed", e)
}

fn ms(d: Duration) -> Vec<u8> {
    // Redis takes whole milliseconds; never round a non-zero duration down to 0.
    d.as_millis().max(1).to_string().into_bytes()
}

impl LockStore for RedisStore {
    async fn acquire(
        &self,
        key: &LockKey,
        token: &Token,
        ttl: Duration,
    ) -> Result<Acquire, StoreError> {
        let mut fence_key = Vec::with_capacity(key.as_bytes().len() + FENCE_SUFFIX.len());
        fence_key.extend_from_slice(key.as_bytes());
        fence_key.extend_from_slice(FENCE_SUFFIX);
        let (acquired, n): (i64, i64) = self
            .invoke(
                &self.scripts.acquire,
                &[key.as_bytes(), &fence_key],
                &[token.as_bytes(), &ms(ttl), &ms(self.fence_retention)],
            )
            .await?;
        Ok(match acquired {
            1 => Acquire::Acquired {
                fencing_token: u64::try_from(n).unwrap_or(0),
            },
            _ => Acquire::Held {
                // PTTL is -1 for a key without expiry and -2 for a key that just vanished.
                expires_in: u64::try_from(n).ok().map(Duration::from_millis),
            },
        })
    }

    async fn renew(&self, key: &LockKey, token: &Token, ttl: Duration) -> Result<bool, StoreError> {
        let n: i64 = self
            .invoke(
                &self.scripts.renew,
                &[key.as_bytes()],
                &[token.as_bytes(), &ms(ttl)],
            )
            .await?;
        Ok(n == 1)
    }

    async fn release(&self, key: &LockKey, token: &Token) -> Result<bool, StoreError> {
        let n: i64 = self
            .invoke(
                &self.scripts.release,
                &[key.as_bytes()],
                &[token.as_bytes()],
            )
            .await?;
        Ok(n == 1)
    }
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let transport = match self.transport {
            Transport::Manager(_) => "ConnectionManager",
            Transport::Multiplexed(_) => "MultiplexedConnection",
            Transport::Pool(_) => "bb8::Pool",
        };
        f.debug_struct("RedisStore")
            .field("transport", &transport)
            .field("fence_retention", &self.fence_retention)
            .finish()
    }
}
