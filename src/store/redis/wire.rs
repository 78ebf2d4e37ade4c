//! The batch script's wire format: the operations a call carries ([`Op`]), the `EVALSHA` that
//! sends them (`RedisStore::batch_cmd`: keys, then per operation its kind and arguments, as
//! `scripts/ops.lua`'s table gives them), and the reply read back ([`answer_of`]: a code and a
//! number per operation, or Redis's refusal of that operation alone).

use std::{
    sync::{Arc, OnceLock, atomic::Ordering},
    time::Duration,
};

use bytes::Bytes;
use redis::{Cmd, ErrorKind, RedisError, Script, ServerErrorKind, Value};

use super::{
    RedisStore,
    keys::{CompanionKeys, ms, record_key},
};
use crate::{
    key::LockKey,
    store::{StoreError, StoreErrorKind},
    token::Token,
};

/// One lock operation.
pub(super) enum Op {
    Acquire {
        key: LockKey,
        token: Token,
        ttl: Duration,
        /// With hand-off: where the caller joins the queue, `None` to not queue.
        place: Option<Place>,
    },
    Release {
        key: LockKey,
        token: Token,
    },
    Renew {
        key: LockKey,
        token: Token,
        ttl: Duration,
    },
    Complete {
        key: LockKey,
        token: Token,
        record: Bytes,
        keep: Duration,
    },
}

/// Where a waiter joins a hand-off queue: its entry is its token, `stamp` and `channel`.
pub(super) struct Place {
    pub(super) stamp: [u8; 16],
    pub(super) channel: Arc<str>,
    /// A later attempt, which may find the waiter queued already.
    pub(super) rescan: bool,
}

impl Op {
    pub(super) fn key(&self) -> &LockKey {
        match self {
            Self::Acquire { key, .. }
            | Self::Release { key, .. }
            | Self::Renew { key, .. }
            | Self::Complete { key, .. } => key,
        }
    }

    /// Whether replicas must acknowledge it (`WAIT`).
    pub(super) fn replicates(&self) -> bool {
        matches!(self, Self::Acquire { .. } | Self::Renew { .. })
    }
}

/// What the script answered for one operation: its code and number. An acquire's codes are
/// named in `acquire.rs`, a completion's in `records.rs`; a renewal's and a release's are
/// [`DONE`] and [`NOT_HELD`] ([`Answer::done`]). `acks`: the replicas that acknowledged the
/// batch, when `WAIT` was sent.
#[derive(Debug, Clone, Copy)]
pub(super) struct Answer {
    pub(super) code: i64,
    pub(super) n: i64,
    pub(super) acks: Option<i64>,
}

/// A renewal or release done: the key was held with the token (`renew` in
/// `scripts/renew.lua`, `release` in `scripts/release.lua`, and their counted forms in
/// `scripts/counted.lua`; the native compare commands' 1).
pub(super) const DONE: i64 = 1;
/// A renewal or release not done: the key was not held with the token.
pub(super) const NOT_HELD: i64 = 0;

impl Answer {
    /// A renewal's or a release's answer: whether it was done. A code no version of the
    /// `what` script answers is an error, never read as either.
    pub(super) fn done(&self, what: &str) -> Result<bool, StoreError> {
        match self.code {
            DONE => Ok(true),
            NOT_HELD => Ok(false),
            code => Err(StoreError::msg(
                StoreErrorKind::Backend,
                format!("the {what} script answered {code}, which no version of it does"),
            )),
        }
    }
}

impl RedisStore {
    /// The `EVALSHA` of `script` (the batch script) for the operations `sent`, written
    /// straight into the command: one pass counts the keys (their count goes first), another
    /// writes them, each operation's companions made on the stack as it is reached.
    pub(super) fn batch_cmd<'a>(
        &self,
        script: &Script,
        sent: impl Iterator<Item = &'a Op> + Clone,
    ) -> Cmd {
        let ops = || sent.clone();
        let handoff = self.handoff.is_some();
        // One fencing counter for the whole server unless it hashes keys to slots: a batch of
        // acquires then reads and writes one counter (per prefix), not one per slot.
        let slot_bound = self.slot_bound.load(Ordering::Relaxed);
        // An operation's keys: its lock key; a completion's record; an acquire's fencing
        // counter, and with hand-off, a release's or completion's too; and with hand-off, the
        // key's queue after its counter.
        let companions = |op: &Op| match op {
            Op::Acquire { .. } => true,
            Op::Release { .. } | Op::Complete { .. } => handoff,
            Op::Renew { .. } => false,
        };
        let (mut keys, mut size) = (0, 96);
        for op in ops() {
            let mut n = 1;
            if let Op::Complete { record, .. } = op {
                n += 1;
                size += record.len();
            }
            if companions(op) {
                n += 1 + usize::from(handoff);
            }
            keys += n;
            size += n * (op.key().as_bytes().len() + 16) + 96;
        }
        let mut eval = Cmd::with_capacity(6 + keys + ops().count() * 6, size);
        eval.arg("EVALSHA").arg(script.get_hash()).arg(keys);
        for op in ops() {
            eval.arg(op.key().as_bytes());
            if let Op::Complete { key, .. } = op {
                eval.arg(&record_key(key)[..]);
            }
            if companions(op) {
                let companions = CompanionKeys::new(op.key(), slot_bound);
                eval.arg(companions.fence());
                if handoff {
                    eval.arg(companions.queue());
                }
            }
        }
        eval.arg(if handoff { "1" } else { "0" })
            .arg(&*ms(self.claim_window))
            .arg(&*ms(self.fence_retention));
        for op in ops() {
            if let Some(share) = op.key().share()
                && !matches!(op, Op::Complete { .. })
            {
                counted_args(&mut eval, op, share);
                continue;
            }
            match op {
                Op::Acquire {
                    token, ttl, place, ..
                } => {
                    eval.arg("a").arg(token.as_bytes()).arg(&*ms(*ttl));
                    place_args(&mut eval, place.as_ref());
                }
                Op::Release { token, .. } => {
                    eval.arg("r").arg(token.as_bytes());
                }
                Op::Renew { token, ttl, .. } => {
                    eval.arg("n").arg(token.as_bytes()).arg(&*ms(*ttl));
                }
                Op::Complete {
                    token,
                    record,
                    keep,
                    ..
                } => {
                    eval.arg("c")
                        .arg(token.as_bytes())
                        .arg(&record[..])
                        .arg(&*ms(*keep));
                }
            }
        }
        eval
    }
}

/// An acquire's place in the hand-off queue: stamp, channel, rescan (empty: not queued).
fn place_args(eval: &mut Cmd, place: Option<&Place>) {
    match place {
        Some(place) => eval
            .arg(&place.stamp[..])
            .arg(place.channel.as_bytes())
            .arg(if place.rescan { "1" } else { "0" }),
        None => eval.arg("").arg("").arg("0"),
    };
}

/// The arguments of an operation on a key with a capacity (`scripts/ops.lua`'s `A`, `R`, `N`).
fn counted_args(eval: &mut Cmd, op: &Op, share: crate::key::Share) {
    let (weight, capacity) = (share.weight().to_string(), share.capacity().to_string());
    match op {
        Op::Acquire {
            token, ttl, place, ..
        } => {
            eval.arg("A")
                .arg(token.as_bytes())
                .arg(&weight)
                .arg(&capacity)
                .arg(&*ms(*ttl));
            place_args(eval, place.as_ref());
        }
        Op::Release { token, .. } => {
            eval.arg("R")
                .arg(token.as_bytes())
                .arg(&weight)
                .arg(&capacity);
        }
        Op::Renew { token, ttl, .. } => {
            eval.arg("N")
                .arg(token.as_bytes())
                .arg(&weight)
                .arg(&*ms(*ttl));
        }
        // Idempotency records are for plain keys only (the caller sends none).
        Op::Complete { .. } => {}
    }
}

/// One operation's answer in the batch script's reply: its code and number, or (code -1)
/// Redis's refusal of that operation alone.
pub(super) fn answer_of(code: &Value, n: &Value, acks: Option<i64>) -> Result<Answer, StoreError> {
    let code = match code {
        Value::Int(code) => *code,
        _ => return Err(StoreError::msg(StoreErrorKind::Backend, UNREADABLE)),
    };
    match n {
        Value::Int(n) if code >= 0 => Ok(Answer { code, n: *n, acks }),
        Value::BulkString(message) if code == -1 => {
            let message = String::from_utf8_lossy(message);
            // A plain script on a key that leases with a share hold (a sorted set), or on a
            // value that is no lock: say which mistake it may be.
            // Refused by the scripts themselves (`WRONGTYPE tower-lock: …`) or by Redis
            // (`WRONGTYPE Operation …`): the key holds another kind of lease, or no lock.
            let kind = match message.starts_with("WRONGTYPE") {
                true => StoreErrorKind::Misused,
                false => StoreErrorKind::Backend,
            };
            let hint = if message.starts_with("WRONGTYPE Operation") {
                " (the key holds no plain lease: a lease with a share (permits, shared or \
                 exclusive), which every user of the key must then take, or a value that is no \
                 lock)"
            } else {
                ""
            };
            Err(StoreError::msg(
                kind,
                format!("Redis refused the lock operation: {message}{hint}"),
            ))
        }
        _ => Err(StoreError::msg(StoreErrorKind::Backend, UNREADABLE)),
    }
}

pub(super) const UNREADABLE: &str = "the lock script's answer could not be read";

/// Whether `error` is Redis refusing a script over keys of several hash slots.
pub(super) fn is_cross_slot(error: &StoreError) -> bool {
    std::error::Error::source(error)
        .and_then(|source| source.downcast_ref::<RedisError>())
        .is_some_and(|e| e.kind() == ErrorKind::Server(ServerErrorKind::CrossSlot))
}

/// The answers of one call, one per operation, in order.
pub(super) enum Answers {
    /// A lone operation's (the common case: no list to allocate).
    One(Result<Answer, StoreError>),
    Many(Vec<Result<Answer, StoreError>>),
}

impl Answers {
    /// `n` answers, the `i`th made by `answer(i)`.
    pub(super) fn from_fn(
        n: usize,
        mut answer: impl FnMut(usize) -> Result<Answer, StoreError>,
    ) -> Self {
        match n {
            1 => Self::One(answer(0)),
            _ => Self::Many((0..n).map(answer).collect()),
        }
    }

    /// `n` times the same answer.
    pub(super) fn every(n: usize, answer: Result<Answer, StoreError>) -> Self {
        Self::from_fn(n, |_| answer.clone())
    }

    /// The `i`th operation's answer (an error if there is none: a bug, never a panic).
    pub(super) fn get(&self, i: usize) -> &Result<Answer, StoreError> {
        static MISSING: OnceLock<Result<Answer, StoreError>> = OnceLock::new();
        let found = match self {
            Self::One(answer) => (i == 0).then_some(answer),
            Self::Many(answers) => answers.get(i),
        };
        found.unwrap_or_else(|| {
            MISSING.get_or_init(|| {
                Err(StoreError::msg(
                    crate::store::StoreErrorKind::Backend,
                    "the lock call ended without an answer for this operation",
                ))
            })
        })
    }

    pub(super) fn iter(&self) -> impl Iterator<Item = &Result<Answer, StoreError>> {
        let (one, many) = match self {
            Self::One(answer) => (Some(answer), &[][..]),
            Self::Many(answers) => (None, &answers[..]),
        };
        one.into_iter().chain(many)
    }
}

/// A call that ended without answers (it panicked): an error for each operation.
impl Default for Answers {
    fn default() -> Self {
        Self::Many(Vec::new())
    }
}

#[cfg(test)]
mod tests {
    //! The one table of the batch's operations, `scripts/ops.lua`'s header, against the
    //! script that reads the batch (its `k = k + …` and `a = a + …` for each kind) and against
    //! what [`RedisStore::batch_cmd`] writes for each kind, with hand-off on and off.

    use std::{collections::BTreeMap, time::Duration};

    use bytes::Bytes;
    use tower_lock_testkit::RedisServer;

    use super::{Op, Place};
    use crate::{
        RedisStore,
        key::{LockKey, Share},
        token::Token,
    };

    const OPS_LUA: &str = include_str!("scripts/ops.lua");

    /// Keys without hand-off, keys with it, and arguments after the kind, per kind.
    type Table = BTreeMap<char, (usize, usize, usize)>;

    fn items(text: &str) -> usize {
        text.split(',')
            .filter(|item| !item.trim().is_empty())
            .count()
    }

    /// The header's table: `| `a` acquire | lock, fencing counter (, queue) | token, … |`.
    fn header() -> Table {
        let mut table = Table::new();
        for line in OPS_LUA.lines().filter_map(|l| l.strip_prefix("-- | `")) {
            let cells: Vec<&str> = line.split('|').map(str::trim).collect();
            let kind = cells[0].chars().next().unwrap();
            let (plain, handoff) = match cells[1].split_once('(') {
                Some((plain, more)) => (
                    items(plain),
                    items(plain) + items(more.trim_end_matches(')')),
                ),
                None => (items(cells[1]), items(cells[1])),
            };
            table.insert(kind, (plain, handoff, items(cells[2])));
        }
        table
    }

    /// The reader's steps: in each `kind == 'x'` branch, how far it moves `k` (with hand-off
    /// first where it moves it two ways) and `a` (the kind and its arguments).
    fn reader() -> Table {
        let mut table = Table::new();
        let body = &OPS_LUA[OPS_LUA.find("while a <= #ARGV do").unwrap()..];
        for branch in body.split("kind == '").skip(1) {
            let kind = branch.chars().next().unwrap();
            let step = |var: &str| -> Vec<usize> {
                let prefix = format!("{var} = {var} + ");
                branch
                    .lines()
                    .filter_map(|l| l.trim().strip_prefix(prefix.as_str()))
                    .map(|n| n.parse().unwrap())
                    .collect()
            };
            let (k, a) = (step("k"), step("a"));
            let (handoff, plain) = (k[0], *k.last().unwrap());
            table.insert(kind, (plain, handoff, a[0] - 1));
        }
        table
    }

    #[test]
    fn the_header_is_the_table_the_reader_reads() {
        let header = header();
        assert_eq!(header.len(), 7, "{header:?}");
        assert_eq!(header, reader());
    }

    /// What `batch_cmd` writes for `op` alone: its keys, its kind and its arguments.
    fn written(store: &RedisStore, op: &Op) -> (char, usize, usize) {
        let script = match op.key().share() {
            Some(_) => &store.scripts.counted,
            None => &store.scripts.ops,
        };
        let args: Vec<Vec<u8>> = store
            .batch_cmd(script, std::iter::once(op))
            .args_iter()
            .map(|arg| match arg {
                redis::Arg::Simple(bytes) => bytes.to_vec(),
                _ => Vec::new(),
            })
            .collect();
        // EVALSHA, the hash, the number of keys, the keys, hand-off, claim, retention, the op.
        let keys: usize = std::str::from_utf8(&args[2]).unwrap().parse().unwrap();
        let op = &args[3 + keys + 3..];
        (char::from(op[0][0]), keys, op.len() - 1)
    }

    #[tokio::test]
    async fn the_client_writes_the_table() {
        let server = RedisServer::start();
        let with = RedisStore::connect(server.url()).await.unwrap();
        let without = with.clone().handoff(false).unwrap();
        let plain = LockKey::new("tower-lock:", "s", b"k", 64).unwrap();
        let counted = plain.clone().with_share(Share::permit(2).unwrap());
        let token = || Token::generate().unwrap();
        let ttl = Duration::from_secs(1);
        let place = || Place {
            stamp: [b'0'; 16],
            channel: "channel".into(),
            rescan: false,
        };
        let table = header();
        let mut seen = Vec::new();
        for key in [plain, counted] {
            let ops = [
                Op::Acquire {
                    key: key.clone(),
                    token: token(),
                    ttl,
                    place: Some(place()),
                },
                Op::Release {
                    key: key.clone(),
                    token: token(),
                },
                Op::Renew {
                    key: key.clone(),
                    token: token(),
                    ttl,
                },
                Op::Complete {
                    key: key.clone(),
                    token: token(),
                    record: Bytes::from_static(b"r"),
                    keep: ttl,
                },
            ];
            for op in &ops {
                let (kind, keys, args) = written(&without, op);
                let (_, handoff_keys, handoff_args) = written(&with, op);
                let expected = table[&kind];
                assert_eq!((keys, handoff_keys, args), expected, "kind {kind}");
                assert_eq!(args, handoff_args, "kind {kind}: arguments with hand-off");
                seen.push(kind);
            }
        }
        seen.sort_unstable();
        seen.dedup();
        assert_eq!(
            seen,
            table.keys().copied().collect::<Vec<_>>(),
            "every kind written"
        );
    }
}
