//! The server's native compare commands (Valkey 8.1+, Redis 8.4+), used for renew and release
//! where the server has them.

use std::sync::atomic::{AtomicBool, Ordering};

use std::time::Duration;

use redis::{Cmd, ErrorKind, Value};
use tokio::sync::OnceCell;

use super::keys::ms;
use super::{
    RedisStore,
    connection::{Request, redis_error},
};
use crate::{key::LockKey, store::StoreError, token::Token};

/// Which compare commands the server has, asked once.
#[derive(Debug, Default)]
pub(super) struct NativeState {
    /// `false` when turned off, or after a native command failed.
    pub(super) enabled: AtomicBool,
    pub(super) detected: OnceCell<Native>,
}

/// The server's native compare commands, from its `INFO server`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Native {
    /// `SET key value IFEQ value PX ttl`.
    pub(super) set_ifeq: bool,
    pub(super) release: Option<NativeRelease>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum NativeRelease {
    /// Valkey 9: `DELIFEQ key value`.
    DelIfEq,
    /// Redis 8.4: `DELEX key IFEQ value`.
    DelEx,
}

impl Native {
    /// Reads `INFO server`: Valkey reports `server_name:valkey` and `valkey_version`, Redis
    /// only `redis_version` (Valkey's `redis_version` is a fixed 7.2.x for compatibility).
    pub(super) fn from_info(info: &str) -> Self {
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

impl RedisStore {
    /// The server's native compare commands, asked once (none when turned off or unknown).
    pub(super) async fn native(&self) -> Native {
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

    /// Asks the server for its native commands now, as a store connects, so that the first
    /// renewal or release does not wait for the answer; gives up after a second (then the
    /// first renew or release asks).
    pub(crate) async fn check_native(&self) {
        let _ = crate::background::timeout(super::EVICTION_CHECK_TIMEOUT, self.native()).await;
    }

    /// Runs a native command; `None` (and Lua from now on) if the server rejected it.
    pub(super) async fn native_query(&self, cmd: &Cmd) -> Result<Option<Value>, StoreError> {
        match self.query(Request::Cmd(cmd)).await? {
            Ok(value) => Ok(Some(value)),
            // A cluster's redirection or "try again" is about the slot, not the command.
            Err(e)
                if matches!(e.kind(), ErrorKind::Server(_) | ErrorKind::Extension)
                    && !e.is_cluster_error() =>
            {
                tracing::warn!(
                    error = &e as &dyn std::error::Error,
                    "native compare command rejected; using Lua from now on"
                );
                self.native.enabled.store(false, Ordering::Relaxed);
                Ok(None)
            }
            Err(e) => Err(self.store_error(e)),
        }
    }
}

/// `INFO`'s text; a cluster answers with one text per node, joined here.
impl RedisStore {
    /// A renewal with `SET key token IFEQ token PX ttl`, where the server has it and replicas
    /// need not acknowledge (with `WAIT`, renewals stay on the script: one round trip either
    /// way); `None`: use the script.
    pub(super) async fn native_renew(
        &self,
        key: &LockKey,
        token: &Token,
        ttl: Duration,
    ) -> Result<Option<bool>, StoreError> {
        if self.replicas.is_some() || !self.native().await.set_ifeq {
            return Ok(None);
        }
        let mut set = redis::cmd("SET");
        set.arg(key.as_bytes())
            .arg(token.as_bytes())
            .arg("IFEQ")
            .arg(token.as_bytes())
            .arg("PX")
            .arg(&*ms(ttl));
        // OK when it matched, nil when it did not.
        Ok(self
            .native_query(&set)
            .await?
            .map(|reply| matches!(reply, Value::Okay | Value::SimpleString(_))))
    }

    /// A release with `DELIFEQ` or `DELEX … IFEQ`, where the server has one and there is no
    /// hand-off (a native delete cannot hand the key on); `None`: use the script.
    pub(super) async fn native_release(
        &self,
        key: &LockKey,
        token: &Token,
    ) -> Result<Option<bool>, StoreError> {
        let Some(native) = self
            .native()
            .await
            .release
            .filter(|_| self.handoff.is_none())
        else {
            return Ok(None);
        };
        let mut del = match native {
            NativeRelease::DelIfEq => redis::cmd("DELIFEQ"),
            NativeRelease::DelEx => redis::cmd("DELEX"),
        };
        del.arg(key.as_bytes());
        if native == NativeRelease::DelEx {
            del.arg("IFEQ");
        }
        del.arg(token.as_bytes());
        match self.native_query(&del).await? {
            Some(reply) => {
                let n: i64 = redis::from_redis_value(reply).map_err(|e| redis_error(e.into()))?;
                Ok(Some(n == 1))
            }
            None => Ok(None),
        }
    }
}

pub(super) fn info_text(value: Value) -> String {
    match value {
        Value::BulkString(bytes) => String::from_utf8_lossy(&bytes).into_owned(),
        Value::VerbatimString { text, .. } | Value::SimpleString(text) => text,
        Value::Array(items) | Value::Set(items) => items.into_iter().map(info_text).collect(),
        Value::Map(pairs) => pairs.into_iter().map(|(_, v)| info_text(v)).collect(),
        _ => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
