//! The Lua scripts: put together once, sent as `EVALSHA`, loaded again (once for every call in
//! flight) after `NOSCRIPT`, and followed by `WAIT` when replicas must acknowledge.

use std::{
    collections::HashMap,
    sync::{Arc, LazyLock, Mutex},
    time::{Duration, Instant},
};

use redis::{Cmd, ErrorKind, FromRedisValue, RedisError, Script, ServerErrorKind, Value};
use tokio::{runtime::Handle, sync::watch};

use super::{
    RedisStore,
    connection::{Request, redis_error},
};
use crate::store::StoreError;

pub(super) struct Scripts {
    /// A batch of acquires, releases, renewals and idempotent completions.
    pub(super) ops: Script,
    /// A lease on several keys, taken at once (all or none).
    pub(super) acquire_set: Script,
    /// A lease on several keys, given up at once.
    pub(super) release_set: Script,
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

/// The functions of the batch script, then its reader, in the order they are defined.
const OPS_PARTS: [&str; 7] = [
    include_str!("scripts/fence.lua"),
    include_str!("scripts/handoff.lua"),
    include_str!("scripts/acquire.lua"),
    include_str!("scripts/release.lua"),
    include_str!("scripts/renew.lua"),
    include_str!("scripts/record_complete.lua"),
    include_str!("scripts/ops.lua"),
];

/// A script over a set of keys: the fencing and hand-off functions, then `body` (its
/// `-- @handoff` line marks where its hand-off path starts) run as a function, then the fencing
/// counters it used saved once, whatever it answered.
fn set_script(body: &str) -> String {
    format!(
        "{}{}local function run_set()\n{}\nend\nlocal answer = run_set()\nsave_fences()\nreturn answer\n",
        OPS_PARTS[0], OPS_PARTS[1], body
    )
}

/// Every script a [`RedisStore`] runs, by name, put together once per process.
pub(super) static LUA: LazyLock<[(&str, String); 5]> = LazyLock::new(|| {
    [
        ("ops", OPS_PARTS.concat()),
        (
            "record_lookup",
            include_str!("scripts/record_lookup.lua").to_owned(),
        ),
        (
            "acquire_set",
            set_script(include_str!("scripts/acquire_set.lua")),
        ),
        (
            "release_set",
            set_script(include_str!("scripts/release_set.lua")),
        ),
        ("fenced", include_str!("scripts/fenced.lua").to_owned()),
    ]
});

/// The source of the script named `name` (one of [`RedisStore::lua_scripts`]').
pub(crate) fn lua(name: &str) -> &'static str {
    LUA.iter()
        .find(|(n, _)| *n == name)
        .map(|(_, source)| source.as_str())
        .expect("a script of the store")
}

impl Scripts {
    pub(super) fn new() -> Arc<Self> {
        Arc::new(Self {
            ops: Script::new(lua("ops")),
            acquire_set: Script::new(lua("acquire_set")),
            release_set: Script::new(lua("release_set")),
            loads: Mutex::default(),
        })
    }
}

impl RedisStore {
    /// Runs `script` with `EVALSHA` (loading it on `NOSCRIPT`), followed in the same round trip
    /// by `WAIT` when `replicate` and replica acknowledgement is on; returns the script's answer
    /// and the number of acknowledgements. `pub(crate)` for the idempotency records
    /// (`crate::idempotency`), which run their own scripts on this transport.
    pub(super) async fn invoke<T: FromRedisValue>(
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
        self.invoke_cmd(script, eval, replicate).await
    }

    /// [`invoke`](Self::invoke) for an `EVALSHA` of `script` the caller put together.
    pub(super) async fn invoke_cmd<T: FromRedisValue>(
        &self,
        script: &Script,
        eval: Cmd,
        replicate: bool,
    ) -> Result<(T, Option<i64>), StoreError> {
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
        let answer = answer.map_err(|e| self.store_error(e))?;
        if pipe.is_some() {
            let (value, acks): (T, i64) =
                redis::from_redis_value(answer).map_err(|e| redis_error(e.into()))?;
            Ok((value, Some(acks)))
        } else {
            let value = redis::from_redis_value(answer).map_err(|e| redis_error(e.into()))?;
            Ok((value, None))
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
}

/// Whether Redis answered that it does not have the script (`NOSCRIPT`).
fn is_no_script(answer: &Result<Value, RedisError>) -> bool {
    matches!(answer, Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript))
}
