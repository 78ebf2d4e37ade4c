//! The crate's lock protocol as the "same scripts" baseline of scenario a sends it by hand: the
//! crate's own batch script (`ops`), exactly as `RedisStore` assembles and sends it
//! (`RedisStore::lua_scripts()`), with the keys and arguments the layer sends for a lone acquire
//! and a lone release, one call per operation, as the layer sends them when requests come one
//! at a time. (Under load the layer sends several operations per call; the baseline does not.)
//!
//! The arguments' values are stand-ins for what the layer sends with its default config (the
//! crate does not expose its claim window, stamps or channel names). Before scenario a runs,
//! `http::check_same_scripts` records one request through the layer and one through the
//! baseline with MONITOR, and [`compare`] stops the benchmark if they no longer send the same
//! scripts with the same arguments: a stand-in that drifted would make the baseline measure
//! something else than the layer without anyone noticing.

use redis::{RedisResult, Script, aio::MultiplexedConnection};
use tower_lock::{RedisStore, store::Token};

use crate::common::TTL_MS;

/// The baseline's fencing counter: one for all its keys (as the crate's `tower-lock:fence` on a
/// server that does not hash keys to slots).
const FENCE_COUNTER: &str = "bench:fence";
/// Fencing counter retention: must match the layer's (`RedisStore::fence_retention`, default
/// 24 h).
const FENCE_RETENTION_MS: u64 = 24 * 60 * 60 * 1000;
/// The hand-off's claim window: must match the layer's (`RedisStore::claim_window`, default
/// 1 s), in ms.
const CLAIM_MS: u64 = 1000;
/// A waiter's stamp: must be as long as the layer's (16 hex digits).
const STAMP: &str = "0000000000000000";
/// The channel of a waiter's process: must be as long as the layer's, and of its shape
/// (`tower-lock:handoff:<32 characters>`).
const CHANNEL: &str = "tower-lock:handoff:0123456789abcdef0123456789abcdef";
/// What every hand-off channel name starts with.
const CHANNEL_PREFIX: &str = "tower-lock:handoff:";
/// The role of a lock key's hand-off queue: `<prefix>{<tag>}queue:<rest of the lock key>`.
const QUEUE_ROLE: &str = "queue:";

/// The hand-off queue of the lock key `key`.
fn queue_key(key: &str) -> String {
    match key.find('}') {
        Some(end) => format!("{}{QUEUE_ROLE}{}", &key[..=end], &key[end + 1..]),
        None => format!("{QUEUE_ROLE}{key}"),
    }
}

/// The crate's script named `name`, as `RedisStore` sends it.
fn crate_script(name: &str) -> Script {
    let (_, source) = RedisStore::lua_scripts()
        .find(|(n, _)| *n == name)
        .unwrap_or_else(|| panic!("RedisStore::lua_scripts() has no {name:?} script"));
    Script::new(source)
}

/// The "same scripts" baseline's acquire and release: the crate's batch script, one operation
/// per call.
pub(crate) struct CrateScripts {
    ops: Script,
}

impl CrateScripts {
    pub(crate) fn new() -> Self {
        Self {
            ops: crate_script("ops"),
        }
    }

    /// The layer's acquire of `key` (a waiter that would queue, not yet queued): whether the
    /// key was taken.
    pub(crate) async fn acquire(
        &self,
        conn: &mut MultiplexedConnection,
        key: &str,
        token: &Token,
    ) -> RedisResult<bool> {
        self.ops
            .key(key)
            .key(FENCE_COUNTER)
            .key(queue_key(key))
            .arg("1")
            .arg(CLAIM_MS)
            .arg(FENCE_RETENTION_MS)
            .arg("a")
            .arg(token.as_bytes())
            .arg(TTL_MS)
            .arg(STAMP)
            .arg(CHANNEL)
            .arg("0")
            .invoke_async::<(i64, i64)>(conn)
            .await
            .map(|(acquired, _)| acquired == 1)
    }

    /// The layer's release of `key`.
    pub(crate) async fn release(
        &self,
        conn: &mut MultiplexedConnection,
        key: &str,
        token: &Token,
    ) -> RedisResult<i64> {
        self.ops
            .key(key)
            .key(FENCE_COUNTER)
            .key(queue_key(key))
            .arg("1")
            .arg(CLAIM_MS)
            .arg(FENCE_RETENTION_MS)
            .arg("r")
            .arg(token.as_bytes())
            .invoke_async::<(i64, i64)>(conn)
            .await
            .map(|(released, _)| released)
    }
}

/// The batch script's arguments before its operations.
const BATCH: [(&str, bool); 3] = [
    ("hand-off flag", false),
    ("claim window, ms", false),
    ("fence retention, ms", false),
];

/// What each argument of a lone acquire and a lone release is, after [`BATCH`], and whether it
/// differs per call (then only its length must match).
const ARGUMENTS: [(&str, &[(&str, bool)]); 2] = [
    (
        "acquire",
        &[
            ("operation kind", false),
            ("token", true),
            ("TTL, ms", false),
            ("waiter's stamp", true),
            ("hand-off channel", true),
            ("rescan flag", false),
        ],
    ),
    ("release", &[("operation kind", false), ("token", true)]),
];

/// Compares the scripts one uncontended request sent through the layer (`layer`) and through
/// the baseline (`baseline`), each the client commands MONITOR recorded: the same two scripts
/// (acquire, then release), the same number of keys, the queue key next to the lock key, and
/// the same arguments (by length where they differ per call). `Err` says what drifted.
pub(crate) fn compare(layer: &[Vec<String>], baseline: &[Vec<String>]) -> Result<(), String> {
    let scripts = |sent: &[Vec<String>]| -> Vec<Vec<String>> {
        sent.iter()
            .filter(|c| c.first().is_some_and(|n| n.eq_ignore_ascii_case("evalsha")))
            .cloned()
            .collect()
    };
    let (layer_scripts, baseline_scripts) = (scripts(layer), scripts(baseline));
    if layer_scripts.len() != ARGUMENTS.len() || baseline_scripts.len() != ARGUMENTS.len() {
        return Err(format!(
            "expected one EVALSHA acquire and one EVALSHA release from each side; the layer sent \
             {layer:?}, the baseline {baseline:?}"
        ));
    }
    let sha = crate_script("ops").get_hash().to_owned();
    for (((name, arguments), l), b) in ARGUMENTS.iter().zip(&layer_scripts).zip(&baseline_scripts) {
        let arguments: Vec<(&str, bool)> = BATCH.iter().chain(arguments.iter()).copied().collect();
        for (who, sent) in [("layer", l), ("baseline", b)] {
            if sent.get(1) != Some(&sha) {
                return Err(format!(
                    "the {who}'s {name} is not the crate's batch script ({sha}): {sent:?}"
                ));
            }
            // `EVALSHA <sha> 3 <lock> <fence> <queue> <arguments>...`
            if sent.get(2).map(String::as_str) != Some("3") {
                return Err(format!("the {who}'s {name} does not send 3 keys: {sent:?}"));
            }
            if sent.len() < 6 || sent[5] != queue_key(&sent[3]) {
                return Err(format!(
                    "the {who}'s {name} does not send the lock key's queue as its third key: \
                     {sent:?}"
                ));
            }
        }
        let (l_args, b_args) = (&l[6..], &b[6..]);
        if l_args.len() != arguments.len() || b_args.len() != arguments.len() {
            return Err(format!(
                "{name}: the layer sends {} arguments, the baseline {}, this check knows {}: \
                 {l:?} / {b:?}",
                l_args.len(),
                b_args.len(),
                arguments.len()
            ));
        }
        for (i, ((what, varies), (l_arg, b_arg))) in
            arguments.iter().zip(l_args.iter().zip(b_args)).enumerate()
        {
            let same = if *varies {
                l_arg.len() == b_arg.len()
                    && (l_arg.starts_with(CHANNEL_PREFIX) == b_arg.starts_with(CHANNEL_PREFIX))
            } else {
                l_arg == b_arg
            };
            if !same {
                return Err(format!(
                    "{name} argument {} ({what}): the layer sends {l_arg:?}, the baseline \
                     {b_arg:?}",
                    i + 1
                ));
            }
        }
    }
    Ok(())
}
