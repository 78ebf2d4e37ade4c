//! The Lua scripts: put together once, sent as `EVALSHA`, loaded again (once for every call in
//! flight) after `NOSCRIPT`, and followed by `WAIT` when replicas must acknowledge.

use std::{
    collections::HashMap,
    sync::{Arc, LazyLock, Mutex},
    time::{Duration, Instant},
};

use redis::{Cmd, ErrorKind, FromRedisValue, RedisError, Script, ServerErrorKind, Value};
use tokio::sync::watch;

use super::{
    RedisStore,
    connection::{Request, redis_error},
};
use crate::store::StoreError;

pub(super) struct Scripts {
    /// A batch of acquires, releases, renewals and idempotent completions.
    pub(super) ops: Script,
    /// The same, able to run the operations of keys with a capacity too (`counted.lua`): for a
    /// batch that has one, so that the plain script defines none of their functions.
    pub(super) counted: Script,
    /// A lease on several keys, taken at once (all or none).
    pub(super) acquire_set: Script,
    /// A lease on several keys, given up at once.
    pub(super) release_set: Script,
    /// The same two for a set with a key with a capacity (`counted.lua`), so that the plain
    /// set scripts define none of its functions.
    pub(super) acquire_set_counted: Script,
    pub(super) release_set_counted: Script,
    /// This store's loads of each script, by hash (see `RedisStore::reload`).
    loads: Mutex<HashMap<String, Load>>,
}

/// This store's loads of one script.
#[derive(Default)]
struct Load {
    /// When the last one finished.
    done_at: Option<Instant>,
    /// The one in flight, in a task on the crate's runtime: when it started, and a receiver
    /// whose sender that task drops when it ends.
    running: Option<(Instant, watch::Receiver<()>)>,
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

/// The batch script with the functions of keys with a capacity, before its reader.
fn counted_script() -> String {
    let (functions, reader) = OPS_PARTS.split_at(OPS_PARTS.len() - 1);
    format!("{}{}{}", functions.concat(), COUNTED, reader[0])
}

/// A script over a set of keys: the fencing and hand-off functions, `functions` (those of keys
/// with a capacity, or none), then `body` (its `-- @handoff` line marks where its hand-off path
/// starts) run as a function, then the fencing counters it used saved once, whatever it
/// answered.
fn set_script(functions: &str, body: &str) -> String {
    format!(
        "{}{}{}local function run_set()\n{}\nend\nlocal answer = run_set()\nsave_fences()\nreturn answer\n",
        OPS_PARTS[0], OPS_PARTS[1], functions, body
    )
}

const COUNTED: &str = include_str!("scripts/counted.lua");

/// Every script a [`RedisStore`] runs, by name, put together once per process.
pub(super) static LUA: LazyLock<[(&str, String); 8]> = LazyLock::new(|| {
    [
        ("ops", OPS_PARTS.concat()),
        ("counted", counted_script()),
        (
            "record_lookup",
            include_str!("scripts/record_lookup.lua").to_owned(),
        ),
        (
            "acquire_set",
            set_script("", include_str!("scripts/acquire_set.lua")),
        ),
        (
            "release_set",
            set_script("", include_str!("scripts/release_set.lua")),
        ),
        (
            "acquire_set_counted",
            set_script(COUNTED, include_str!("scripts/acquire_set_counted.lua")),
        ),
        (
            "release_set_counted",
            set_script(COUNTED, include_str!("scripts/release_set_counted.lua")),
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
            counted: Script::new(lua("counted")),
            acquire_set: Script::new(lua("acquire_set")),
            release_set: Script::new(lua("release_set")),
            acquire_set_counted: Script::new(lua("acquire_set_counted")),
            release_set_counted: Script::new(lua("release_set_counted")),
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
        self.invoke_cmd_again(script, eval, Some, replicate)
            .await
            .map(|answer| answer.expect("the same call is always sent again"))
    }

    /// [`invoke_cmd`](Self::invoke_cmd), where the call to send again after `NOSCRIPT` is
    /// `again(the call sent)`, made when it is sent again (after the load, which may take a
    /// while): `None` sends nothing and answers `None`. So a batch leaves out the operations
    /// whose callers left meanwhile, whose releases may have run already.
    pub(super) async fn invoke_cmd_again<T: FromRedisValue>(
        &self,
        script: &Script,
        eval: Cmd,
        mut again: impl FnMut(Cmd) -> Option<Cmd>,
        replicate: bool,
    ) -> Result<Option<(T, Option<i64>)>, StoreError> {
        let wait = self.replicas.filter(|_| replicate);
        let with_wait = |eval: &Cmd| {
            wait.map(|acks| {
                let mut pipe = redis::pipe();
                pipe.add_command(eval.clone())
                    .cmd("WAIT")
                    .arg(acks.replicas)
                    .arg(acks.timeout.as_millis().max(1).to_string());
                pipe
            })
        };
        fn request<'a>(eval: &'a Cmd, pipe: Option<&'a redis::Pipeline>) -> Request<'a> {
            match pipe {
                Some(pipe) => Request::Pipe(pipe),
                None => Request::Cmd(eval),
            }
        }
        let mut eval = eval;
        let mut pipe = with_wait(&eval);
        let sent_at = Instant::now();
        let mut answer = self.query(request(&eval, pipe.as_ref())).await?;
        if is_no_script(&answer) {
            self.reload(script, sent_at).await;
            let Some(next) = again(eval) else {
                return Ok(None);
            };
            eval = next;
            pipe = with_wait(&eval);
            answer = self.query(request(&eval, pipe.as_ref())).await?;
            if is_no_script(&answer) {
                // Flushed again meanwhile, or the shared load failed or reached another server
                // than this call (a pool's connections, a failover): load it ourselves.
                self.query(Request::Load(script))
                    .await?
                    .map_err(redis_error)?;
                let Some(next) = again(eval) else {
                    return Ok(None);
                };
                eval = next;
                pipe = with_wait(&eval);
                answer = self.query(request(&eval, pipe.as_ref())).await?;
            }
        }
        let answer = answer.map_err(|e| self.store_error(e))?;
        if pipe.is_some() {
            let (value, acks): (T, i64) =
                redis::from_redis_value(answer).map_err(|e| redis_error(e.into()))?;
            Ok(Some((value, Some(acks))))
        } else {
            let value = redis::from_redis_value(answer).map_err(|e| redis_error(e.into()))?;
            Ok(Some((value, None)))
        }
    }

    /// Has `script` loaded after a call sent at `sent_at` met NOSCRIPT, unless this store
    /// loaded it since. After a restart or `SCRIPT FLUSH` every call in flight meets NOSCRIPT at
    /// once: the first starts a load and all wait for that one load (never for each other, and
    /// never longer than [`LOAD_TIMEOUT`] after it started), then send their call again, so the
    /// server sees one `SCRIPT LOAD` per script, not one per call. The load runs on the crate's
    /// runtime: it ends, and frees the others, whether or not the runtime of the caller that
    /// started it is still driven (a `block_on` that returned). A failed or timed-out load is
    /// not reported here: the caller's second attempt meets NOSCRIPT and loads the script
    /// itself.
    async fn reload(&self, script: &Script, sent_at: Instant) {
        let (mut running, started) = {
            let mut loads = self.scripts.loads.lock().unwrap_or_else(|p| p.into_inner());
            let load = loads.entry(script.get_hash().to_owned()).or_default();
            // Loaded after our call was sent: our call ran before the load, send it again.
            if load.done_at.is_some_and(|done| done > sent_at) {
                return;
            }
            // A load that ended without loading, or that has run for longer than it may,
            // counts as none.
            let live = load.running.as_ref().filter(|(started, running)| {
                running.has_changed().is_ok() && started.elapsed() < LOAD_TIMEOUT
            });
            match live {
                Some((started, running)) => (running.clone(), *started),
                None => {
                    let (done, running) = watch::channel(());
                    let started = Instant::now();
                    load.running = Some((started, running.clone()));
                    let (store, script) = (self.clone(), script.clone());
                    // Without any runtime to run it on, nothing to wait for.
                    if !crate::background::spawn(async move { store.load(&script, done).await }) {
                        return;
                    }
                    (running, started)
                }
            }
        };
        // Ends when the load does (its sender is dropped), or when it has had its time.
        let left = LOAD_TIMEOUT.saturating_sub(started.elapsed());
        // Made where timers can be: a caller outside any runtime may be here.
        let _ = crate::background::timeout(left, running.changed()).await;
    }

    /// The shared load of `script` that [`reload`](Self::reload) started; `done` is dropped
    /// when it ends, which frees the calls waiting for it.
    async fn load(&self, script: &Script, done: watch::Sender<()>) {
        let loaded =
            crate::background::timeout(LOAD_TIMEOUT, self.query(Request::Load(script))).await;
        let mut loads = self.scripts.loads.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(load) = loads.get_mut(script.get_hash()) {
            if load
                .running
                .as_ref()
                .is_some_and(|(_, running)| running.same_channel(&done.subscribe()))
            {
                load.running = None;
            }
            if matches!(loaded, Ok(Ok(Ok(_)))) {
                load.done_at = Some(Instant::now());
            }
        }
        drop(loads);
        drop(done);
    }
}

/// Whether Redis answered that it does not have the script (`NOSCRIPT`).
fn is_no_script(answer: &Result<Value, RedisError>) -> bool {
    matches!(answer, Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript))
}

#[cfg(test)]
mod tests {
    use std::{future::Future, task::Poll};

    use tower_lock_testkit::RedisServer;

    use super::*;
    use crate::{
        key::LockKey,
        store::{Acquire, LockStore},
        token::Token,
    };

    /// A script load left on a runtime that is no longer driven (its `block_on` returned) does
    /// not hold up the calls of other runtimes that meet `NOSCRIPT` later: they wait for it at
    /// most its time, then load the script themselves. (In the crate's unit tests background
    /// work runs on the current runtime, so the load's task is the idle runtime's here; with the
    /// crate's own runtime it ends at once: `tests/runtimes.rs`.)
    #[test]
    fn a_load_left_on_an_idle_runtime_does_not_hold_up_the_others() {
        let server = RedisServer::start();
        let main = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let store = main.block_on(RedisStore::connect(server.url())).unwrap();
        let idle = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        // Polled once on `idle`, then left: its load is under way, and nothing drives it.
        let mut stuck = Box::pin(store.reload(&store.scripts.ops, Instant::now()));
        idle.block_on(std::future::poll_fn(|cx| {
            let _ = stuck.as_mut().poll(cx);
            Poll::Ready(())
        }));
        assert!(server.cli(&["SCRIPT", "FLUSH"]).contains("OK"));
        let key = LockKey::new("tower-lock:", "reload", b"k", 64).unwrap();
        let token = Token::generate().unwrap();
        let answer = main.block_on(async {
            tokio::time::timeout(
                Duration::from_secs(8),
                store.acquire(&key, &token, Duration::from_secs(10)),
            )
            .await
        });
        let answer = answer.expect("the call waited for the idle runtime's load");
        assert!(matches!(answer, Ok(Acquire::Acquired { .. })), "{answer:?}");
        drop(stuck);
        drop(idle);
    }
}
