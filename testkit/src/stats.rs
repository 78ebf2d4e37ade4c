//! What a server this kit started counted, from `INFO`: commands run (`commandstats`) and errors
//! answered (`errorstats`).
//!
//! `commandstats` counts a command whoever runs it, a client or a script (Redis 7 counts the
//! `SET` a Lua script runs as a `SET`); to count only what clients send, see [`crate::monitor`].

use crate::server::RedisServer;

/// How many times `command` ran on `server`, by clients or inside scripts (`INFO
/// commandstats`; `command` as Redis names it there, e.g. `evalsha`, `wait`).
pub async fn calls_of(server: &RedisServer, command: &str) -> u64 {
    let mut conn = server.client().await;
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(&mut conn)
        .await
        .unwrap();
    let prefix = format!("cmdstat_{command}:calls=");
    info.lines()
        .find_map(|l| l.strip_prefix(prefix.as_str()))
        .and_then(|rest| rest.split(',').next()?.parse().ok())
        .unwrap_or(0)
}

/// How many errors starting with `code` (`TRYAGAIN`, `CROSSSLOT`) `server` answered, from
/// `INFO errorstats`.
pub fn errors_of(server: &RedisServer, code: &str) -> u64 {
    let prefix = format!("errorstat_{code}:count=");
    server
        .cli(&["INFO", "errorstats"])
        .lines()
        .find_map(|l| l.trim().strip_prefix(prefix.as_str())?.parse().ok())
        .unwrap_or(0)
}
