//! The system the checker explores: one Redis (the model in `redis.rs`, running the crate's
//! scripts), and 3 or 4 processes, each with one store (one pub/sub channel, one connection)
//! and one contender for its key (or, for a set process, its two keys) at a time (a process's own requests for a key queue behind
//! each other in `LocalQueues` and only the first contends in Redis, `src/engine/local/mod.rs`
//! `LocalQueues::turns`), which acquires the key up to `acquisitions` times in a row, each time with a
//! fresh token.
//!
//! Every step is atomic: a script run by Redis, a reply or a pub/sub message reaching a process,
//! a client reacting to a signal or a timer, a failure, or one tick of time. The client's steps
//! follow `src/engine/acquire.rs` (`acquire`, `handed_over`, `MIN_HANDED_OVER`, `NEXT_SLACK`),
//! `src/engine/release.rs` (`ReleaseOnDrop`, armed while an attempt is in flight or the waiter
//! is queued), `src/engine/renew.rs` (`Renewer::poll_lost`) and `src/store/redis/handoff/mod.rs`
//! (`Registry::deliver`, `register`, `parse`), by symbol: `scripts/check_docs.py` checks that
//! every file named here exists.
//!
//! Time is discrete and relative: every deadline in a state is a number of ticks from now, and
//! a tick shifts them all by one (clock readings in the past, such as queue entries' stamps,
//! with them). Two states that differ only in when they happen are one state, so a holder that
//! renews, or waiters that check again, do not make the state space grow with the clock.
//! Network delays are bounded: with `delays`, a request, a reply or a message sent is handled
//! before the second tick after it was sent (`aged`), well within the store timeout, so no call
//! times out; without, before time moves on at all (every interleaving at one instant is still
//! explored). With `start_together`, every process sends its first attempt before time moves
//! on; otherwise a process may arrive at any tick.
//!
//! Two keys, X and Y, in that lock order. A process takes X, or Y (`second_key`), or both as one
//! lease (`sets`): then it runs `acquire_set.lua`, the batch script renewing both and
//! `release_set.lua`, and follows `src/engine/acquire.rs` for a set: a grant makes it attempt
//! again at once (the attempt claims what was handed over), and while queued it attempts again
//! at least every renewal interval, which keeps the keys the queue kept for it.
//!
//! With `counts`, key X has a capacity and each process takes its weight of it: the requests
//! go through the `counted` batch script (`A`, `R` and `N` operations, `wire.rs`
//! `counted_args`), the key is a sorted set of its holders' members (`token:weight`, scored by
//! when each lease ends), and the queue entries carry the waiter's weight. The clients are the
//! same: the engine waits for and claims a counted lease as a plain one.

use std::{cell::RefCell, collections::HashMap, fmt::Write as _, rc::Rc};

use super::{
    redis::{Db, Interner, Redis, Reply, Val, show, sort_members},
    seq::Seq,
};

/// Model time, in ticks.
#[derive(Clone, Copy, Debug)]
pub struct Timing {
    /// The lease's time to live.
    pub ttl: i16,
    /// Renewal interval (`ttl / 3` by default).
    pub interval: i16,
    /// The hand-off claim window.
    pub claim: i16,
    /// `MIN_HANDED_OVER` (`src/engine/acquire.rs`): a grant is run at once with this much left.
    pub min_handed_over: i16,
    /// `NEXT_SLACK` (`src/engine/acquire.rs`).
    pub next_slack: i16,
    /// Subtracted from a grant's stamp + claim window (`src/store/redis/handoff/mod.rs` `parse`:
    /// 1 % + 2 ms).
    /// The model's clocks all run at one rate, so 0 is the strictest choice.
    pub allowance: i16,
    /// The wait policy's retry delay, for an attempt answered "held" while not queued.
    pub retry_delay: i16,
}

impl Timing {
    /// The scale the checks run at: a tick is about a network delay, and the ratios keep what
    /// matters: a claim window longer than two round trips, shorter than the TTL.
    pub const DEFAULT: Self = Self {
        ttl: 9,
        interval: 3,
        claim: 4,
        min_handed_over: 1,
        next_slack: 1,
        allowance: 0,
        retry_delay: 2,
    };
}

/// Which failures the checker may inject, and how many in one run.
#[derive(Clone, Copy, Debug)]
pub struct Faults {
    pub budget: u8,
    /// The process dies: its subscription closes, it never acts again.
    pub crash: bool,
    /// The process hangs: still subscribed, never acts again.
    pub hang: bool,
    /// A waiter gives up (its deadline): its armed release guard sends the release.
    pub give_up: bool,
    /// A pub/sub message to a process is lost.
    pub lose: bool,
    /// A process's subscription breaks (its messages in flight are lost, and Redis sees nobody
    /// on its channel) and comes back at any later time; each tells the waiters registered then
    /// to check again (`src/store/redis/handoff/mod.rs` `retry_all`).
    pub resubscribe: bool,
}

/// The scripts the model runs: the crate's, or a deliberately broken variant.
#[derive(Clone, Debug)]
pub struct Sources {
    /// The batch script every single-key lock operation goes through (a model request is a
    /// batch of one).
    pub ops: String,
    /// The same batch script with the functions of keys with a capacity (`counted.lua`), which
    /// the store sends a batch with an operation on such a key as.
    pub counted: String,
    pub acquire_set: String,
    pub release_set: String,
}

/// Leases with counts on key X (`LockKey::with_share`): its capacity, and each process's
/// weight. A permit is 1 of N; a reader 1 of `Share::READERS`, a writer all of it.
#[derive(Clone, Debug)]
pub struct Counts {
    pub capacity: u32,
    /// One per process.
    pub weights: Vec<u32>,
}

impl Sources {
    /// The scripts exactly as the Redis stores load them.
    pub fn crate_scripts() -> Self {
        let get = |name: &str| {
            tower_lock::RedisStore::lua_scripts()
                .find(|(n, _)| *n == name)
                .map(|(_, source)| source.to_owned())
                .unwrap_or_else(|| panic!("the crate has no script {name}"))
        };
        Self {
            ops: get("ops"),
            counted: get("counted"),
            acquire_set: get("acquire_set"),
            release_set: get("release_set"),
        }
    }
}

#[derive(Clone, Debug)]
pub struct Config {
    pub name: String,
    pub processes: u8,
    /// Acquisitions per process, one after the other.
    pub acquisitions: u8,
    /// Renewals per holding; the holder releases by the one after (its handler finishes).
    pub renewals: u8,
    pub faults: Faults,
    pub timing: Timing,
    /// Network delays: a request, reply or message may still be on its way after a tick
    /// (until the next one). Without, everything sent arrives before time moves on.
    pub delays: bool,
    /// Processes start their first acquisition before time moves on (in any order), rather than
    /// at any time.
    pub start_together: bool,
    /// Processes that release with the idempotency layer's `complete.lua` instead.
    pub completes: Vec<u8>,
    /// Processes that take both keys, X and Y, as one lease (a set).
    pub sets: Vec<u8>,
    /// Processes that take key Y alone (the others, but sets, take X).
    pub second_key: Vec<u8>,
    /// Set processes that pass their keys in the other order, Y then X (never the crate's
    /// clients, which take every set in lock order: only to show that the order matters).
    pub reversed: Vec<u8>,
    /// Check that a process that believes it holds the key holds it in Redis (stronger than
    /// exclusion, and so found a step earlier).
    pub key_agrees: bool,
    /// Queued waiters keep `acquire_held`'s fallback timer (`false` only to show that the
    /// no-starvation check can fail).
    pub fallback_timer: bool,
    /// A waiter whose "queued" answer arrives after its subscription broke or came back checks
    /// again when it registers (`Handoff::register`'s epoch): `false` is the client before
    /// that, only to show that the checker finds the registration gap.
    pub registration_epoch: bool,
    /// A waiter answered "held" and not queued (its subscription is down, so nobody would hear
    /// its hand-off) polls on the wait policy's retry delay, though it queued before and is
    /// registered: `false` is the client before that (it waited on its broken subscription as
    /// if queued, until the resubscription), only to show that the checker finds it.
    pub poll_unqueued: bool,
    /// The processes whose subscription may break (`Faults::resubscribe`); empty: every one.
    pub breaks: Vec<u8>,
    /// Calls go through a pool of connections: a release may reach Redis before its
    /// acquisition's own attempt sent before it (`src/store/redis/commit.rs`, a caller that
    /// gave up while its attempt was in flight).
    pub pool: bool,
    /// Key X has a capacity and each process takes a weight of it (every process takes X:
    /// no sets, no `second_key`, no `completes`, as the crate's leases with counts have none
    /// of those through the store's scripts).
    pub counts: Option<Counts>,
    pub sources: Sources,
}

/// Bias of a stamp's 16 hex digits: a stamp is a clock reading, relative like every time here,
/// so mostly negative.
const STAMP_BIAS: i64 = 1 << 20;

/// Bytes of a token, as the crate's (`TOKEN_LEN`).
const TOKEN_LEN: usize = 32;
const STAMP_LEN: usize = 16;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Status {
    #[default]
    Alive,
    /// Still subscribed, never acts: believes it holds the key until `belief` (0: no belief).
    Hung {
        belief: i16,
    },
    Crashed,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Hold {
    pub fence: u32,
    /// The lease is valid (to its holder) until this tick, exclusive.
    pub valid_until: i16,
    pub next_renew: i16,
    /// A renewal in flight, sent at this tick.
    pub renewing: Option<i16>,
    pub renewals: u8,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Phase {
    /// Between acquisitions (the next may start at any time).
    #[default]
    Idle,
    /// An acquire attempt in flight, sent at `sent_at`.
    Attempting {
        sent_at: i16,
    },
    /// Queued, in `acquire_held`'s `select!` over signals and the fallback timer.
    Waiting {
        fallback: i16,
    },
    /// Answered "held" while not queued: sleeping until the next retry.
    Sleeping {
        wake: i16,
    },
    Holding(Hold),
    /// Its release in flight (the process's next request waits for it).
    Releasing,
    Done,
    GaveUp,
}

impl Phase {
    fn waiting(&self) -> bool {
        matches!(
            self,
            Self::Attempting { .. } | Self::Waiting { .. } | Self::Sleeping { .. }
        )
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Signal {
    #[default]
    Retry,
    Granted {
        fence: u32,
        valid_until: i16,
    },
    Next {
        within: i16,
    },
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Op {
    Acquire {
        stamp: i16,
        rescan: bool,
        /// Sent with the process's channel: its subscription was up (`Handoff::ready`).
        listen: bool,
    },
    #[default]
    Renew,
    Release,
}

/// A request on its way to Redis.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Request {
    pub op: Op,
    pub acq: u8,
    pub aged: bool,
    /// The process's subscription broke or came back since it was sent (its epoch moved on).
    pub straddled: bool,
}

/// A reply on its way back.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Answer {
    pub op: Op,
    pub acq: u8,
    /// The script's answer: `{code, n}` for acquire (`{code, n, i}` or `{1, fence X, fence Y}`
    /// for a set), `(n, 0)` otherwise.
    pub reply: (i16, i32, i32),
    pub aged: bool,
    /// The process's subscription broke or came back since the request was sent.
    pub straddled: bool,
}

/// A hand-off message on its way to a process, parsed as `src/store/redis/handoff/mod.rs` `parse`
/// does.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Message {
    /// `Some(fence)` for a grant (`g`), `None` for "next" (`n`).
    pub grant: Option<u32>,
    pub acq: u8,
    pub stamp: i16,
    pub claim: i16,
    pub aged: bool,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Proc {
    pub status: Status,
    /// Acquisitions started; the current token is this one's.
    pub acq: u8,
    pub phase: Phase,
    /// `acquire_held`'s `queued`: an attempt answered "queued".
    pub queued: bool,
    /// The waiter's registration (`queue_watch`) is up.
    pub registered: bool,
    /// The registration's channel of signals, not yet taken by the client.
    pub signals: Seq<Signal, 3>,
    /// `Registry::pending`: a message for the current token before it registered.
    pub pending: Option<Signal>,
    pub outbox: Seq<Request, 3>,
    pub replies: Seq<Answer, 3>,
    pub inbox: Seq<Message, 4>,
    /// A message for this acquisition was lost: it is excused from first-come-first-served,
    /// and may sleep until its fallback timer.
    pub lost_message: bool,
    /// The subscription is down (`Faults::resubscribe`): Redis sees nobody on its channel.
    pub sub_down: bool,
    /// The subscription broke during this acquisition: a release meanwhile may have skipped
    /// it, so it is excused from first-come-first-served (not from being woken).
    pub broken: bool,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct State {
    pub db: Db,
    pub procs: Seq<Proc, 4>,
    /// The highest fencing token a holder of each key started with.
    pub fence_high: [u32; 2],
    /// ... and a holder that excludes every other (a plain lease, or the whole capacity).
    pub writer_high: [u32; 2],
    /// For each key: acquisitions (process, number) in the order their entries first appeared
    /// in its queue, kept while they wait or have an entry in it.
    pub fifo: [Seq<(u8, u8), 8>; 2],
    pub faults: u8,
    /// Time has moved on since the start.
    pub ticked: bool,
}

/// One step, by kind and process: enough to find it again among a state's successors.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Step {
    Tick,
    Start(u8),
    Exec(u8),
    Reply(u8),
    Deliver(u8),
    Signal(u8),
    Timer(u8),
    Release(u8),
    Renew(u8),
    RenewTimeout(u8),
    Crash(u8),
    Hang(u8),
    GiveUp(u8),
    Lose(u8),
    Break(u8),
    Resubscribe(u8),
    /// A release run ahead of its acquisition's earlier attempt (a pool).
    Overtake(u8),
}

pub struct Successor {
    pub step: Step,
    pub state: State,
    /// A process that started holding a key in this step: (process, key, fencing token).
    pub started: Vec<(u8, usize, u32)>,
    /// The acquisitions (process, number) a script gave a key to in this step, with the key.
    pub given: Vec<(usize, (u8, u8))>,
    /// That script was a release handing the key on.
    pub handed_on: bool,
    /// What happened, for traces (only when asked for).
    pub note: String,
}

/// The system: its configuration, the model Redis and the names it uses.
pub struct Model {
    pub config: Config,
    pub interner: Rc<RefCell<Interner>>,
    pub redis: Redis,
    scripts: Scripts,
    pub keys: Keys,
    /// Processes that are interchangeable (same scripts): states that differ only by a
    /// permutation within a group are one state.
    groups: Vec<Vec<u8>>,
    /// Token values, and a counted key's members (`token:weight`), by id: (process,
    /// acquisition).
    owners: HashMap<Val, (u8, u8)>,
    /// Queue entries by id: (process, acquisition, stamp), and back.
    entries: RefCell<HashMap<Val, (u8, u8, i16)>>,
    entry_ids: RefCell<HashMap<(u8, u8, i16), Val>>,
}

struct Scripts {
    ops: usize,
    counted: usize,
    acquire_set: usize,
    release_set: usize,
}

pub struct Keys {
    /// The lock keys X and Y, in lock order.
    pub locks: [Val; 2],
    pub fence: Val,
    /// Their queues.
    pub queues: [Val; 2],
    pub record: Val,
    ttl: Val,
    claim: Val,
    retention: Val,
    record_value: Val,
    zero: Val,
    one: Val,
    /// `''`: the stamp and channel of an attempt that does not queue.
    empty: Val,
    /// The batch script's operation kinds.
    kind_acquire: Val,
    kind_release: Val,
    kind_renew: Val,
    kind_complete: Val,
    /// The operations on a key with a capacity.
    kind_acquire_counted: Val,
    kind_release_counted: Val,
    kind_renew_counted: Val,
    /// `tokens[p][acq]`, `acq` from 1.
    tokens: Vec<Vec<Val>>,
    /// A counted key's member of each token: `members[p][acq]` is `token:weight`.
    pub members: Vec<Vec<Val>>,
    /// Each process's weight and the capacity, as arguments.
    weights: Vec<Val>,
    capacity: Val,
    pub channels: Vec<Val>,
}

/// The weight `p` takes: 1 (of 1, on a plain key) unless the configuration gives another.
fn weight_of(config: &Config, p: u8) -> u32 {
    config
        .counts
        .as_ref()
        .map_or(1, |c| c.weights[usize::from(p)])
}

fn token_text(p: u8, acq: u8) -> String {
    format!("{:.<TOKEN_LEN$}", format!("P{}#{}", p + 1, acq))
}

fn channel_text(p: u8) -> String {
    format!("tower-lock:handoff:P{}", p + 1)
}

fn stamp_text(stamp: i16) -> String {
    format!("{:016x}", STAMP_BIAS + i64::from(stamp))
}

fn parse_stamp(hex: &[u8]) -> i16 {
    let s = std::str::from_utf8(hex).expect("stamp");
    let v = i64::from_str_radix(s, 16).expect("stamp");
    i16::try_from(v - STAMP_BIAS).expect("stamp")
}

impl Model {
    pub fn new(config: Config) -> Self {
        let interner: Rc<RefCell<Interner>> = Rc::default();
        let mut redis = Redis::new(Rc::clone(&interner));
        let s = &config.sources;
        let scripts = Scripts {
            ops: redis.load("ops.lua", &s.ops),
            counted: redis.load("counted.lua", &s.counted),
            acquire_set: redis.load("acquire_set.lua", &s.acquire_set),
            release_set: redis.load("release_set.lua", &s.release_set),
        };
        let keys = {
            let mut i = interner.borrow_mut();
            let mut id = |s: &str| i.id(s.as_bytes());
            Keys {
                locks: [id("tl:{k}"), id("tl:{j}")],
                fence: id("tl:fence:{0}"),
                queues: [id("tl:{k}:queue"), id("tl:{j}:queue")],
                record: id("tl:{k}:record"),
                ttl: id(&config.timing.ttl.to_string()),
                claim: id(&config.timing.claim.to_string()),
                // The fencing counter's and the record's retention: beyond the horizon.
                retention: id("86400000"),
                record_value: id("record"),
                zero: id("0"),
                one: id("1"),
                empty: id(""),
                kind_acquire: id("a"),
                kind_release: id("r"),
                kind_renew: id("n"),
                kind_complete: id("c"),
                kind_acquire_counted: id("A"),
                kind_release_counted: id("R"),
                kind_renew_counted: id("N"),
                tokens: (0..config.processes)
                    .map(|p| {
                        (0..=config.acquisitions)
                            .map(|a| id(&token_text(p, a)))
                            .collect()
                    })
                    .collect(),
                members: (0..config.processes)
                    .map(|p| {
                        (0..=config.acquisitions)
                            .map(|a| id(&format!("{}:{}", token_text(p, a), weight_of(&config, p))))
                            .collect()
                    })
                    .collect(),
                weights: (0..config.processes)
                    .map(|p| id(&weight_of(&config, p).to_string()))
                    .collect(),
                capacity: id(&config.counts.as_ref().map_or(1, |c| c.capacity).to_string()),
                channels: (0..config.processes)
                    .map(|p| id(&channel_text(p)))
                    .collect(),
            }
        };
        if let Some(counts) = &config.counts {
            assert_eq!(
                counts.weights.len(),
                usize::from(config.processes),
                "a weight per process"
            );
            assert!(
                config.sets.is_empty()
                    && config.second_key.is_empty()
                    && config.completes.is_empty(),
                "leases with counts are modelled on key X alone"
            );
        }
        let mut groups: Vec<Vec<u8>> = Vec::new();
        let role = |p: u8| {
            (
                weight_of(&config, p),
                config.completes.contains(&p),
                config.sets.contains(&p),
                config.second_key.contains(&p),
                config.reversed.contains(&p),
                config.breaks.contains(&p),
            )
        };
        for p in 0..config.processes {
            match groups.iter_mut().find(|g| role(g[0]) == role(p)) {
                Some(g) => g.push(p),
                None => groups.push(vec![p]),
            }
        }
        let mut owners = HashMap::new();
        for (p, tokens) in keys.tokens.iter().enumerate() {
            for (a, t) in tokens.iter().enumerate() {
                owners.insert(*t, (p as u8, a as u8));
                owners.insert(keys.members[p][a], (p as u8, a as u8));
            }
        }
        Self {
            config,
            interner,
            redis,
            scripts,
            keys,
            groups,
            owners,
            entries: RefCell::default(),
            entry_ids: RefCell::default(),
        }
    }

    /// A queue entry's owner and stamp.
    fn entry_info(&self, entry: Val) -> (u8, u8, i16) {
        if let Some(&info) = self.entries.borrow().get(&entry) {
            return info;
        }
        let interner = self.interner.borrow();
        let text = interner.get(entry);
        let (p, a) = self.token_of(&interner, &text[..TOKEN_LEN]);
        let stamp = parse_stamp(&text[TOKEN_LEN..TOKEN_LEN + STAMP_LEN]);
        let weight = self.entry_weight(p);
        let tail = &text[TOKEN_LEN + STAMP_LEN..];
        assert_eq!(
            &tail[..weight.len()],
            weight.as_bytes(),
            "a queue entry's weight"
        );
        assert_eq!(&tail[weight.len()..], channel_text(p).as_bytes());
        self.entries.borrow_mut().insert(entry, (p, a, stamp));
        (p, a, stamp)
    }

    /// The weight a queue entry of `p` carries between its stamp and its channel (`counted.lua`:
    /// 8 hex digits): none on a plain key.
    fn entry_weight(&self, p: u8) -> String {
        match self.config.counts {
            Some(_) => format!("{:08x}", weight_of(&self.config, p)),
            None => String::new(),
        }
    }

    /// The queue entry of `p`'s acquisition `a` stamped `stamp`, as acquire.lua writes it:
    /// token, stamp, channel (counted.lua: token, stamp, weight, channel).
    fn entry(&self, p: u8, a: u8, stamp: i16) -> Val {
        if let Some(&id) = self.entry_ids.borrow().get(&(p, a, stamp)) {
            return id;
        }
        let text = format!(
            "{}{}{}{}",
            token_text(p, a),
            stamp_text(stamp),
            self.entry_weight(p),
            channel_text(p)
        );
        let id = self.interner.borrow_mut().id(text.as_bytes());
        self.entry_ids.borrow_mut().insert((p, a, stamp), id);
        id
    }

    /// `s` with the processes of each group in a fixed order (sorted by their state), and the
    /// tokens and channels in Redis and `fifo` renamed to match.
    pub fn canonical(&self, s: State) -> State {
        let mut order: Vec<u8> = (0..self.config.processes).collect();
        for group in &self.groups {
            let mut members = group.clone();
            members.sort_by(|&a, &b| {
                s.procs[usize::from(a)].cmp(&s.procs[b]).then_with(|| {
                    if self.config.counts.is_some() {
                        self.footprint(&s, a).cmp(&self.footprint(&s, b))
                    } else {
                        std::cmp::Ordering::Equal
                    }
                })
            });
            for (&slot, &old) in group.iter().zip(&members) {
                order[usize::from(slot)] = old;
            }
        }
        if order.iter().enumerate().all(|(i, &p)| usize::from(p) == i) {
            return s;
        }
        let mut new_of = vec![0u8; order.len()];
        for (new, &old) in order.iter().enumerate() {
            new_of[usize::from(old)] = new as u8;
        }
        let rename = |(p, a): (u8, u8)| (new_of[usize::from(p)], a);
        let mut db = s.db;
        for (_, v, _) in db.strings.iter_mut() {
            if let Some(&owner) = self.owners.get(v) {
                *v = self.token(rename(owner).0, owner.1);
            }
        }
        for (_, members, _) in db.zsets.iter_mut() {
            for (_, m) in members.iter_mut() {
                let (p, a) = self.owners[m];
                *m = self.keys.members[usize::from(new_of[usize::from(p)])][usize::from(a)];
            }
            sort_members(members);
        }
        for queue in self.keys.queues {
            if let Some(list) = db.list_mut(queue) {
                for entry in list.iter_mut() {
                    let (p, a, stamp) = self.entry_info(*entry);
                    *entry = self.entry(new_of[usize::from(p)], a, stamp);
                }
            }
        }
        State {
            db,
            procs: order.iter().map(|&old| s.procs[old]).collect(),
            fence_high: s.fence_high,
            writer_high: s.writer_high,
            fifo: s.fifo.map(|fifo| fifo.iter().map(|&f| rename(f)).collect()),
            faults: s.faults,
            ticked: s.ticked,
        }
    }

    /// What Redis and the checker's bookkeeping hold of `p`, by acquisition: its member's score,
    /// its place in the queue and in `fifo`. Two processes of a group with equal states differ
    /// only by this; ordering them by it too makes `canonical` pick one order for states that
    /// are renamings of each other (several holders of one key are told apart only here), which
    /// the trace's replay needs.
    fn footprint(&self, s: &State, p: u8) -> Vec<(Option<i32>, Option<usize>, Option<usize>)> {
        let lock = self.keys.locks[0];
        let queue = s.db.list(self.keys.queues[0]).unwrap_or(&[]);
        (0..=self.config.acquisitions)
            .map(|a| {
                let member = self.keys.members[usize::from(p)][usize::from(a)];
                let entry = queue.iter().position(|&e| {
                    let (q, b, _) = self.entry_info(e);
                    (q, b) == (p, a)
                });
                let fifo = s.fifo[0].iter().position(|&f| f == (p, a));
                (s.db.score(lock, member), entry, fifo)
            })
            .collect()
    }

    pub fn token(&self, p: u8, acq: u8) -> Val {
        self.keys.tokens[usize::from(p)][usize::from(acq)]
    }

    /// The lock keys `p` takes: X, Y, or both (a set).
    pub fn keys_of(&self, p: u8) -> &'static [usize] {
        if self.is_set(p) {
            &[0, 1]
        } else if self.config.second_key.contains(&p) {
            &[1]
        } else {
            &[0]
        }
    }

    pub fn is_set(&self, p: u8) -> bool {
        self.config.sets.contains(&p)
    }

    /// The weight `p` takes of the key's capacity (1 of 1 on a plain key).
    pub fn weight(&self, p: u8) -> u32 {
        weight_of(&self.config, p)
    }

    /// The key's capacity: 1 on a plain key.
    pub fn capacity(&self) -> u32 {
        self.config.counts.as_ref().map_or(1, |c| c.capacity)
    }

    /// Whether `p` excludes every other holder: a plain lease, or the whole capacity.
    pub fn is_writer(&self, p: u8) -> bool {
        self.weight(p) == self.capacity()
    }

    /// Whether `p`'s acquisition `acq` holds `key` in Redis: the key's value is its token, or
    /// (a key with a capacity) its member is live.
    pub fn holds_in_redis(&self, db: &Db, p: u8, acq: u8, key: usize) -> bool {
        let lock = self.keys.locks[key];
        if self.config.counts.is_some() {
            let member = self.keys.members[usize::from(p)][usize::from(acq)];
            db.score(lock, member).is_some_and(|score| score > 0)
        } else {
            db.string(lock).map(|(v, _)| v) == Some(self.token(p, acq))
        }
    }

    pub fn initial(&self) -> State {
        State {
            procs: (0..self.config.processes)
                .map(|_| Proc::default())
                .collect(),
            ..State::default()
        }
    }

    /// Every step enabled in `s`, with the state it leads to.
    pub fn successors(&mut self, s: &State, describe: bool) -> Vec<Successor> {
        let mut out = Vec::new();
        let faults = self.config.faults;
        let may_fault = s.faults < faults.budget;
        for p in 0..self.config.processes {
            let proc = &s.procs[p];
            if !proc.outbox.is_empty() {
                out.push(self.exec(s, p, 0, describe));
            }
            if let Some(at) = self.overtaking(proc) {
                out.push(self.exec(s, p, at, describe));
            }
            if proc.status != Status::Alive {
                continue;
            }
            if proc.sub_down {
                // The subscription comes back, at any time (a second later, in the client).
                let mut n = *s;
                change_course(&mut n.procs[p], false);
                let note = describe.then(|| {
                    format!(
                        "P{}'s subscription is back: its registered waiter is told to check again",
                        p + 1
                    )
                });
                out.push(succ(Step::Resubscribe(p), n, Vec::new(), note));
            } else if may_fault
                && faults.resubscribe
                && (self.config.breaks.is_empty() || self.config.breaks.contains(&p))
                // Only where it can matter: before or during an acquisition (a holder is in no
                // queue and expects no message; a break then only delays its next one).
                && (proc.phase.waiting() || proc.phase == Phase::Idle)
            {
                let mut n = *s;
                change_course(&mut n.procs[p], true);
                n.faults += 1;
                let note = describe.then(|| {
                    format!(
                        "FAULT: P{}'s subscription breaks (messages on their way to it are lost; \
                         its registered waiter is told to check again)",
                        p + 1
                    )
                });
                out.push(succ(Step::Break(p), n, Vec::new(), note));
            }
            if !proc.replies.is_empty() {
                out.push(self.reply(s, p, describe));
            }
            if !proc.inbox.is_empty() {
                out.push(self.deliver(s, p, describe));
                if may_fault && faults.lose {
                    let mut n = *s;
                    let q = &mut n.procs[p];
                    let lost = q.inbox.remove(0);
                    q.lost_message = true;
                    n.faults += 1;
                    let note = describe.then(|| {
                        format!(
                            "FAULT: the message {} to P{} is lost",
                            self.msg(p, &lost),
                            p + 1
                        )
                    });
                    out.push(succ(Step::Lose(p), n, Vec::new(), note));
                }
            }
            match proc.phase {
                Phase::Idle
                    if proc.acq < self.config.acquisitions
                        && !(self.config.start_together && proc.acq == 0 && s.ticked) =>
                {
                    let mut n = *s;
                    let q = &mut n.procs[p];
                    q.acq += 1;
                    q.queued = false;
                    q.registered = false;
                    q.signals.clear();
                    q.pending = None;
                    q.lost_message = false;
                    q.broken = false;
                    let note = self.attempt(&mut n, p, describe);
                    let note = describe.then(|| {
                        format!("P{} starts acquisition #{}; {}", p + 1, proc.acq + 1, note)
                    });
                    out.push(succ(Step::Start(p), n, Vec::new(), note));
                }
                Phase::Waiting { fallback } => {
                    if !proc.signals.is_empty() {
                        out.push(self.signal(s, p, describe));
                    }
                    if fallback <= 0 && self.config.fallback_timer {
                        let mut n = *s;
                        let note = self.attempt(&mut n, p, describe);
                        let note = describe
                            .then(|| format!("P{}'s fallback timer fires; {}", p + 1, note));
                        out.push(succ(Step::Timer(p), n, Vec::new(), note));
                    }
                }
                Phase::Sleeping { wake } if wake <= 0 => {
                    let mut n = *s;
                    let note = self.attempt(&mut n, p, describe);
                    let note =
                        describe.then(|| format!("P{}'s retry timer fires; {}", p + 1, note));
                    out.push(succ(Step::Timer(p), n, Vec::new(), note));
                }
                Phase::Holding(h) => {
                    // The handler finishes (any time): the release goes out
                    // (`ReleaseGuard::release_now`, src/locker.rs 466).
                    let mut n = *s;
                    release(&mut n, p);
                    let note = describe.then(|| {
                        format!(
                            "P{} finishes and sends its release (fence {})",
                            p + 1,
                            h.fence
                        )
                    });
                    out.push(succ(Step::Release(p), n, Vec::new(), note));
                    if h.renewing.is_none() && h.next_renew <= 0 {
                        if h.valid_until <= 0 {
                            // src/renew.rs 159-161: nothing left: lost.
                            let mut n = *s;
                            release(&mut n, p);
                            let note = describe.then(|| {
                                format!("P{}'s lease ran out before its renewal: lost; it sends its release", p + 1)
                            });
                            out.push(succ(Step::Renew(p), n, Vec::new(), note));
                        } else if h.renewals < self.config.renewals {
                            // src/renew.rs 163-174.
                            let mut n = *s;
                            let q = &mut n.procs[p];
                            if let Phase::Holding(h) = &mut q.phase {
                                h.renewing = Some(0);
                            }
                            q.outbox.push(Request {
                                op: Op::Renew,
                                acq: q.acq,
                                aged: false,
                                straddled: false,
                            });
                            let note = describe.then(|| format!("P{} sends a renewal", p + 1));
                            out.push(succ(Step::Renew(p), n, Vec::new(), note));
                        }
                    }
                    if h.renewing.is_some() && h.valid_until <= 0 {
                        // src/renew.rs 163: the renewal's timeout is what is left of the lease;
                        // 136-143: then it is lost.
                        let mut n = *s;
                        release(&mut n, p);
                        let note = describe.then(|| {
                            format!("P{}'s renewal is not answered before its lease runs out: lost; it sends its release", p + 1)
                        });
                        out.push(succ(Step::RenewTimeout(p), n, Vec::new(), note));
                    }
                }
                _ => {}
            }
            let active = proc.phase.waiting() || matches!(proc.phase, Phase::Holding(_));
            // A crash, hang or give-up while a reply or message is still unread is the same as
            // one just before it arrived: the process never reads it, and what it sent before
            // reaches Redis all the same, in the same order. So failures strike only a process
            // with nothing unread (the model explores the equivalent earlier one).
            let settled = proc.replies.is_empty() && proc.inbox.is_empty();
            if may_fault && active && settled {
                if faults.crash {
                    let mut n = *s;
                    let q = &mut n.procs[p];
                    q.status = Status::Crashed;
                    quiesce(q);
                    n.faults += 1;
                    let note = describe.then(|| format!("FAULT: P{} crashes", p + 1));
                    out.push(succ(Step::Crash(p), n, Vec::new(), note));
                }
                if faults.hang {
                    let mut n = *s;
                    let q = &mut n.procs[p];
                    let belief = match q.phase {
                        Phase::Holding(h) => h.valid_until.max(0),
                        _ => 0,
                    };
                    q.status = Status::Hung { belief };
                    quiesce(q);
                    n.faults += 1;
                    let note = describe.then(|| format!("FAULT: P{} hangs", p + 1));
                    out.push(succ(Step::Hang(p), n, Vec::new(), note));
                }
            }
            if may_fault && faults.give_up && proc.phase.waiting() && settled {
                // The wait's deadline: `acquire_held`'s future is dropped, and its release
                // guard, armed while an attempt may have taken the key or while queued (src/locker.rs
                // 248, 321), sends the release (534-545): it leaves the queue, or passes on a key
                // handed over meanwhile.
                let mut n = *s;
                let q = &mut n.procs[p];
                let armed = matches!(q.phase, Phase::Attempting { .. }) || q.queued;
                if armed {
                    q.outbox.push(Request {
                        op: Op::Release,
                        acq: q.acq,
                        aged: false,
                        straddled: false,
                    });
                }
                q.phase = Phase::GaveUp;
                q.registered = false;
                q.signals.clear();
                q.pending = None;
                n.faults += 1;
                let note = describe.then(|| {
                    format!(
                        "FAULT: P{} gives up{}",
                        p + 1,
                        if armed { " and sends its release" } else { "" }
                    )
                });
                out.push(succ(Step::GiveUp(p), n, Vec::new(), note));
            }
        }
        if !self.urgent(s) {
            let n = self.tick(s);
            if n != *s {
                out.push(succ(
                    Step::Tick,
                    n,
                    Vec::new(),
                    describe.then(|| "one tick passes".into()),
                ));
            }
        }
        for succ in &mut out {
            self.tidy_fifo(&mut succ.state);
            for &(p, key, fence) in &succ.started {
                succ.state.fence_high[key] = succ.state.fence_high[key].max(fence);
                if self.is_writer(p) {
                    succ.state.writer_high[key] = succ.state.writer_high[key].max(fence);
                }
            }
        }
        out
    }

    /// With a pool of connections: the first release in `q`'s connection that has an attempt
    /// of its own acquisition before it, which it may overtake.
    fn overtaking(&self, q: &Proc) -> Option<usize> {
        if !self.config.pool {
            return None;
        }
        let requests = q.outbox.as_slice();
        let at = requests.iter().position(|r| r.op == Op::Release)?;
        requests[..at]
            .iter()
            .any(|r| r.acq == requests[at].acq && matches!(r.op, Op::Acquire { .. }))
            .then_some(at)
    }

    /// The acquisitions in `fifo` that neither wait nor have an entry in the queue are done
    /// with it.
    fn tidy_fifo(&self, n: &mut State) {
        for key in 0..2 {
            let queued = self.queued(n, key);
            let procs = &n.procs;
            n.fifo[key].retain(|&(p, acq)| {
                let q = &procs[p];
                (q.acq == acq && q.status == Status::Alive && q.phase.waiting())
                    || queued.contains(&(p, acq))
            });
        }
    }

    /// The acquisitions with an entry in `key`'s queue, in its order.
    pub fn queued(&self, n: &State, key: usize) -> Vec<(u8, u8)> {
        n.db.list(self.keys.queues[key])
            .unwrap_or(&[])
            .iter()
            .map(|e| {
                let (p, a, _) = self.entry_info(*e);
                (p, a)
            })
            .collect()
    }

    /// Whether something must happen before time may pass: a request, reply or message sent
    /// before the last tick (the network delay bound), or a live client's timer that is due.
    fn urgent(&self, s: &State) -> bool {
        if self.config.start_together && s.procs.iter().any(|q| q.acq == 0) {
            return true;
        }
        if !self.config.delays
            && s.procs.iter().any(|q| {
                !q.outbox.is_empty()
                    || (q.status == Status::Alive && (!q.replies.is_empty() || !q.inbox.is_empty()))
            })
        {
            return true;
        }
        s.procs.iter().any(|q| {
            q.outbox.iter().any(|r| r.aged)
                || (q.status == Status::Alive
                    && (q.replies.iter().any(|r| r.aged)
                        || q.inbox.iter().any(|m| m.aged)
                        || match q.phase {
                            Phase::Waiting { fallback } => {
                                (fallback <= 0 && self.config.fallback_timer)
                                    || !q.signals.is_empty()
                            }
                            Phase::Sleeping { wake } => wake <= 0,
                            Phase::Holding(h) => match h.renewing {
                                None => h.next_renew <= 0,
                                Some(_) => h.valid_until <= 0,
                            },
                            _ => false,
                        }))
        })
    }

    /// One tick passes: every time in the state comes one closer (readings in the past go one
    /// further back, down to where they make no difference any more).
    fn tick(&mut self, s: &State) -> State {
        let t = self.config.timing;
        // A stamp this old gives a grant that has run out on arrival: older ones are the same.
        let stamp_floor = t.allowance - t.claim;
        let shift_stamp = |x: i16| (x - 1).max(stamp_floor);
        let mut n = *s;
        n.ticked = true;
        n.db.tick();
        for queue in self.keys.queues {
            if let Some(list) = n.db.list_mut(queue) {
                for entry in list.iter_mut() {
                    let (p, a, stamp) = self.entry_info(*entry);
                    *entry = self.entry(p, a, shift_stamp(stamp));
                }
            }
        }
        for q in n.procs.iter_mut() {
            for r in q.outbox.iter_mut() {
                r.aged = true;
                if let Op::Acquire { stamp, .. } = &mut r.op {
                    *stamp = shift_stamp(*stamp);
                }
            }
            for r in q.replies.iter_mut() {
                r.aged = true;
            }
            for m in q.inbox.iter_mut() {
                m.aged = true;
                m.stamp = shift_stamp(m.stamp);
            }
            let shift_signal = |sig: &mut Signal| {
                if let Signal::Granted { valid_until, .. } = sig {
                    *valid_until = (*valid_until - 1).max(0);
                }
            };
            q.signals.iter_mut().for_each(shift_signal);
            q.pending.iter_mut().for_each(shift_signal);
            match &mut q.phase {
                Phase::Attempting { sent_at } => *sent_at -= 1,
                Phase::Waiting { fallback } => *fallback = (*fallback - 1).max(0),
                Phase::Sleeping { wake } => *wake = (*wake - 1).max(0),
                Phase::Holding(h) => {
                    h.valid_until = (h.valid_until - 1).max(0);
                    h.next_renew = (h.next_renew - 1).max(0);
                    if let Some(sent) = &mut h.renewing {
                        *sent -= 1;
                    }
                }
                _ => {}
            }
            if let Status::Hung { belief } = &mut q.status {
                *belief = (*belief - 1).max(0);
            }
        }
        n
    }

    /// `acquire_held`'s loop body up to the attempt (src/locker.rs 240-258): the attempt goes
    /// out with a stamp read now and `rescan` when registered (`RedisStore::enqueue`), with the
    /// process's channel only while its subscription is up (`Handoff::ready`).
    fn attempt(&self, n: &mut State, p: u8, describe: bool) -> String {
        let q = &mut n.procs[p];
        let rescan = q.registered;
        let listen = !q.sub_down;
        q.outbox.push(Request {
            op: Op::Acquire {
                stamp: 0,
                rescan,
                listen,
            },
            acq: q.acq,
            aged: false,
            straddled: false,
        });
        q.phase = Phase::Attempting { sent_at: 0 };
        if describe {
            format!("it sends an acquire attempt as P{}#{}", p + 1, q.acq)
        } else {
            String::new()
        }
    }

    /// Redis runs the request at `at` in `p`'s connection (the head, but for a release that
    /// overtakes on a pool).
    fn exec(&mut self, s: &State, p: u8, at: usize, describe: bool) -> Successor {
        let mut n = *s;
        let req = n.procs[p].outbox.remove(at);
        let k = &self.keys;
        let t = self.config.timing;
        let token = k.tokens[usize::from(p)][usize::from(req.acq)];
        let channel = k.channels[usize::from(p)];
        let set = self.is_set(p);
        let key = self.keys_of(p)[0];
        let (lock, queue) = (k.locks[key], k.queues[key]);
        // A set's keys, each with the fencing counter and its queue, as `RedisStore` passes them
        // (`src/store/redis/set.rs` `set_script`, `release_keys`).
        let mut set_keys = vec![
            k.locks[0],
            k.fence,
            k.queues[0],
            k.locks[1],
            k.fence,
            k.queues[1],
        ];
        if self.config.reversed.contains(&p) {
            set_keys.rotate_left(3);
        }
        // The batch script's arguments: hand-off on, the claim window, the counters' retention,
        // then its operations (see `ops.lua`).
        let mut batch = vec![k.one, k.claim, k.retention];
        let counted = self.config.counts.is_some();
        let weight = k.weights[usize::from(p)];
        let (script, keys) = match req.op {
            // `wire.rs` `counted_args`: the same operations with a share, in the `counted`
            // script.
            Op::Acquire {
                stamp,
                rescan,
                listen,
            } if counted => {
                let (stamp, channel, rescan) = self.place(stamp, rescan, listen, channel);
                batch.extend([
                    k.kind_acquire_counted,
                    token,
                    weight,
                    k.capacity,
                    k.ttl,
                    stamp,
                    channel,
                    rescan,
                ]);
                (self.scripts.counted, vec![lock, k.fence, queue])
            }
            Op::Renew if counted => {
                batch.extend([k.kind_renew_counted, token, weight, k.ttl]);
                (self.scripts.counted, vec![lock])
            }
            Op::Release if counted => {
                batch.extend([k.kind_release_counted, token, weight, k.capacity]);
                (self.scripts.counted, vec![lock, k.fence, queue])
            }
            Op::Acquire {
                stamp,
                rescan,
                listen,
            } if set => {
                // `src/store/redis/set.rs` `set_script`: no place, no stamp nor channel.
                let (stamp, channel, rescan) = self.place(stamp, rescan, listen, channel);
                batch = vec![token, k.ttl, k.retention, k.claim, stamp, channel, rescan];
                (self.scripts.acquire_set, set_keys)
            }
            // A set's keys renew together, in one batch (`src/engine/renew.rs` `renew_keys`).
            Op::Renew if set => {
                batch.extend([k.kind_renew, token, k.ttl, k.kind_renew, token, k.ttl]);
                (self.scripts.ops, vec![k.locks[0], k.locks[1]])
            }
            Op::Release if set => {
                batch = vec![token, k.claim, k.retention];
                (self.scripts.release_set, set_keys)
            }
            Op::Acquire {
                stamp,
                rescan,
                listen,
            } => {
                let (stamp, channel, rescan) = self.place(stamp, rescan, listen, channel);
                batch.extend([k.kind_acquire, token, k.ttl, stamp, channel, rescan]);
                (self.scripts.ops, vec![lock, k.fence, queue])
            }
            Op::Renew => {
                batch.extend([k.kind_renew, token, k.ttl]);
                (self.scripts.ops, vec![lock])
            }
            Op::Release if self.config.completes.contains(&p) => {
                batch.extend([k.kind_complete, token, k.record_value, k.retention]);
                (self.scripts.ops, vec![lock, k.record, k.fence, queue])
            }
            Op::Release => {
                batch.extend([k.kind_release, token]);
                (self.scripts.ops, vec![lock, k.fence, queue])
            }
        };
        let args = batch;
        let subscribed: Vec<Val> = s
            .procs
            .iter()
            .zip(&k.channels)
            .filter(|(q, _)| q.status != Status::Crashed && !q.sub_down)
            .map(|(_, c)| *c)
            .collect();
        let outcome = self.redis.run(script, &keys, &args, &s.db, &subscribed);
        n.db = outcome.db;
        let mut told = Vec::new();
        for &(ch, payload) in &outcome.published {
            let q = k
                .channels
                .iter()
                .position(|c| *c == ch)
                .expect("a process's channel");
            let msg = self.parse(q as u8, payload);
            told.push(format!("{} to P{}", self.msg(q as u8, &msg), q + 1));
            let target = &mut n.procs[q];
            // A message its process can never read (for an earlier token, or for a waiter that
            // is no longer waiting) is dropped now rather than carried: only a waiter reads
            // messages, and only for its current token (`deliver`).
            let readable = msg.acq == target.acq && (target.registered || target.phase.waiting());
            if target.status == Status::Alive && !target.sub_down && readable {
                target.inbox.push(msg);
            }
        }
        let reply = match (&req.op, &outcome.reply) {
            (Op::Acquire { .. }, Reply::Array(v)) if v.len() == 2 && !set => (
                v[0].int().expect("acquire code"),
                v[1].int().expect("acquire value"),
                0,
            ),
            // `{1, fence X, fence Y}` or `{code, ms, i}`.
            (Op::Acquire { .. }, Reply::Array(v)) if v.len() == 3 && set => (
                v[0].int().expect("acquire code"),
                v[1].int().expect("acquire value"),
                v[2].int().expect("acquire value"),
            ),
            // Two numbers per operation; renewed only if every key was (`renew_keys`).
            (Op::Renew, Reply::Array(v)) if v.len() == 2 * (usize::from(set) + 1) => {
                (i64::from(v.chunks(2).all(|r| r[0].int() == Some(1))), 0, 0)
            }
            (_, Reply::Array(v)) if v.len() == 2 => (v[0].int().expect("an answer"), 0, 0),
            (_, Reply::Int(n)) => (*n, 0, 0),
            (op, other) => panic!("unexpected answer {} to {op:?}", show(other)),
        };
        let reply = (
            i16::try_from(reply.0).expect("a small answer"),
            i32::try_from(reply.1).expect("a small answer"),
            i32::try_from(reply.2).expect("a small answer"),
        );
        let q = &mut n.procs[p];
        if q.status == Status::Alive {
            q.replies.push(Answer {
                op: req.op,
                acq: req.acq,
                reply,
                aged: false,
                straddled: req.straddled,
            });
        }
        let mut given = Vec::new();
        for key in 0..2 {
            for entry in self.queued(&n, key) {
                if !n.fifo[key].contains(&entry) {
                    n.fifo[key].push(entry);
                }
            }
            if let Some(after) = n.db.zset(k.locks[key]) {
                // A key with a capacity is given to each live member that was not live before.
                for &(score, m) in after {
                    if score > 0 && s.db.score(k.locks[key], m).is_none_or(|b| b <= 0) {
                        given.push((key, self.owners[&m]));
                    }
                }
                continue;
            }
            let before = s.db.string(k.locks[key]).map(|(v, _)| v);
            let after = n.db.string(k.locks[key]).map(|(v, _)| v);
            if let Some(v) = after
                && before != after
            {
                let interner = self.interner.borrow();
                given.push((key, self.token_of(&interner, interner.get(v))));
            }
        }
        let note = if describe {
            let mut note = format!(
                "Redis runs {} for P{}#{} -> {}\n{}",
                self.redis.script_name(script),
                p + 1,
                req.acq,
                show(&outcome.reply),
                self.pretty(&outcome.log)
            );
            for t in told {
                let _ = writeln!(note, "      published {t}");
            }
            let _ = write!(note, "      now {}", self.show_db(&n.db));
            let _ = t;
            note
        } else {
            String::new()
        };
        let step = if at == 0 {
            Step::Exec(p)
        } else {
            Step::Overtake(p)
        };
        let mut succ = succ(step, n, Vec::new(), describe.then_some(note));
        succ.handed_on = !given.is_empty() && req.op == Op::Release;
        succ.given = given;
        succ
    }

    /// An attempt's place in the queue, as arguments: stamp, channel, rescan; without one (its
    /// subscription down), `'' '' 0`, as `wire.rs` sends it.
    fn place(&self, stamp: i16, rescan: bool, listen: bool, channel: Val) -> (Val, Val, Val) {
        let k = &self.keys;
        if listen {
            let stamp = self.interner.borrow_mut().id(stamp_text(stamp).as_bytes());
            (stamp, channel, if rescan { k.one } else { k.zero })
        } else {
            (k.empty, k.empty, k.zero)
        }
    }

    fn token_of(&self, interner: &Interner, token: &[u8]) -> (u8, u8) {
        for (p, tokens) in self.keys.tokens.iter().enumerate() {
            for (a, t) in tokens.iter().enumerate() {
                if interner.get(*t) == token {
                    return (p as u8, a as u8);
                }
            }
        }
        panic!("unknown token {:?}", String::from_utf8_lossy(token))
    }

    /// `src/store/redis/handoff/mod.rs` `parse`: `g<token><stamp><claim>:<fence>` or
    /// `n<token><stamp><claim>`.
    fn parse(&self, to: u8, payload: Val) -> Message {
        let text = self.interner.borrow().get(payload).to_vec();
        let (&kind, rest) = text.split_first().expect("empty message");
        let (p, acq) = self.token_of(&self.interner.borrow(), &rest[..TOKEN_LEN]);
        assert_eq!(p, to, "a message for P{} on P{}'s channel", p + 1, to + 1);
        let stamp = parse_stamp(&rest[TOKEN_LEN..TOKEN_LEN + STAMP_LEN]);
        let tail = std::str::from_utf8(&rest[TOKEN_LEN + STAMP_LEN..]).expect("message");
        let (claim, grant) = match kind {
            b'g' => {
                let (claim, fence) = tail.split_once(':').expect("grant");
                (claim, Some(fence.parse().expect("fence")))
            }
            b'n' => (tail, None),
            _ => panic!("unknown message {:?}", String::from_utf8_lossy(&text)),
        };
        Message {
            grant,
            acq,
            stamp,
            claim: claim.parse().expect("claim"),
            aged: false,
        }
    }

    /// The reply at the head of `p`'s connection reaches its client.
    fn reply(&mut self, s: &State, p: u8, describe: bool) -> Successor {
        let t = self.config.timing;
        let mut n = *s;
        let q = &mut n.procs[p];
        let answer = q.replies.remove(0);
        let mut started = Vec::new();
        let current = answer.acq == q.acq;
        let set = self.config.sets.contains(&p);
        let single_key = self.keys_of(p)[0];
        let note = match (answer.op, q.phase) {
            (Op::Acquire { .. }, Phase::Attempting { sent_at }) if current && set => {
                // src/engine/acquire.rs, for a set: the same, with a fencing token per key, and
                // a queued set checks again at least every renewal interval (which keeps what
                // the queue kept for it).
                let (code, value, third) = answer.reply;
                let expires_in = (value >= 0).then_some(value as i16);
                let reversed = self.config.reversed.contains(&p);
                // Fences (and the blocked key) in the order the keys were passed.
                let (value, third) = match (code, reversed) {
                    (1, true) => (third, value),
                    (_, true) => (value, 3 - third),
                    _ => (value, third),
                };
                match code {
                    1 => {
                        q.phase = Phase::Holding(Hold {
                            fence: value as u32,
                            valid_until: sent_at + t.ttl,
                            next_renew: sent_at + t.interval,
                            renewing: None,
                            renewals: 0,
                        });
                        unregister(q);
                        started = vec![(p, 0, value as u32), (p, 1, third as u32)];
                        format!(
                            "P{} hears: acquired both keys, fences {value} and {third}, valid for {} more ticks",
                            p + 1,
                            sent_at + t.ttl
                        )
                    }
                    2 => {
                        q.queued = true;
                        let note = register(q, answer.straddled && self.config.registration_epoch);
                        let fallback = expires_in.unwrap_or(t.ttl).min(t.interval);
                        q.phase = Phase::Waiting { fallback };
                        format!(
                            "P{} hears: queued for key {}, check again in {fallback}{note}",
                            p + 1,
                            if third == 1 { "X" } else { "Y" }
                        )
                    }
                    _ => {
                        if q.queued && q.registered {
                            let mut fallback = expires_in.unwrap_or(t.ttl).min(t.interval);
                            if self.config.poll_unqueued {
                                fallback = fallback.min(t.retry_delay);
                            }
                            q.phase = Phase::Waiting { fallback };
                        } else {
                            q.phase = Phase::Sleeping {
                                wake: t.retry_delay,
                            };
                        }
                        format!("P{} hears: a key is held by another", p + 1)
                    }
                }
            }
            (Op::Acquire { .. }, Phase::Attempting { sent_at }) if current => {
                let (code, value, _) = answer.reply;
                // src/store/redis.rs `attempt`: PTTL is -1 or -2 for no expiry / no key.
                let expires_in = (value >= 0).then_some(value as i16);
                match code {
                    // src/locker.rs 264-281: held from when the attempt was sent, for the TTL
                    // (`validity(ttl)` is the TTL for Redis); the queue watch is dropped.
                    1 => {
                        q.phase = Phase::Holding(Hold {
                            fence: value as u32,
                            valid_until: sent_at + t.ttl,
                            next_renew: sent_at + t.interval,
                            renewing: None,
                            renewals: 0,
                        });
                        unregister(q);
                        started = vec![(p, single_key, value as u32)];
                        format!(
                            "P{} hears: acquired, fence {}, valid for {} more ticks",
                            p + 1,
                            value,
                            sent_at + t.ttl
                        )
                    }
                    // 284-290, 321-350: queued (registering, which delivers a message that
                    // came first), then waits for a signal or the fallback: when the holder's
                    // lease would run out.
                    2 => {
                        q.queued = true;
                        let note = register(q, answer.straddled && self.config.registration_epoch);
                        let fallback = expires_in.unwrap_or(t.ttl);
                        q.phase = Phase::Waiting { fallback };
                        format!("P{} hears: queued, check again in {fallback}{note}", p + 1)
                    }
                    // src/engine/acquire.rs: held, and not queued by this attempt. Registered
                    // (queued before), it waits for a signal (the resubscription's "check
                    // again") or the retry delay, whichever comes first; else it sleeps until
                    // the retry.
                    _ => {
                        if q.queued && q.registered {
                            let mut fallback = expires_in.unwrap_or(t.ttl);
                            if self.config.poll_unqueued {
                                fallback = fallback.min(t.retry_delay);
                            }
                            q.phase = Phase::Waiting { fallback };
                        } else {
                            q.phase = Phase::Sleeping {
                                wake: t.retry_delay,
                            };
                        }
                        format!("P{} hears: held by another", p + 1)
                    }
                }
            }
            (Op::Renew, Phase::Holding(mut h)) if current && h.renewing.is_some() => {
                let sent = h.renewing.take().expect("renewal in flight");
                if answer.reply.0 == 1 {
                    // src/renew.rs 125-131: valid from when it was sent.
                    h.valid_until = sent + t.ttl;
                    h.next_renew = sent + t.interval;
                    h.renewals += 1;
                    q.phase = Phase::Holding(h);
                    format!(
                        "P{} hears: renewed, valid for {} more ticks",
                        p + 1,
                        h.valid_until
                    )
                } else {
                    // 133: not ours any more: lost (and released, by the armed guard).
                    release(&mut n, p);
                    format!(
                        "P{} hears: renewal refused: lease lost; it sends its release",
                        p + 1
                    )
                }
            }
            (Op::Release, Phase::Releasing) if current => {
                // The process's next request for the key may go now (src/locker.rs 508).
                q.phase = if q.acq < self.config.acquisitions {
                    Phase::Idle
                } else {
                    Phase::Done
                };
                format!("P{} hears: release answered {}", p + 1, answer.reply.0)
            }
            _ => format!("P{} ignores a stale answer to {:?}", p + 1, answer.op),
        };
        succ(Step::Reply(p), n, started, describe.then_some(note))
    }

    /// The pub/sub message at the head of `p`'s subscription arrives: `Registry::deliver`.
    fn deliver(&mut self, s: &State, p: u8, describe: bool) -> Successor {
        let t = self.config.timing;
        let mut n = *s;
        let q = &mut n.procs[p];
        let m = q.inbox.remove(0);
        let signal = match m.grant {
            // handoff.rs 263-269: ours at least until stamp + claim, less the allowance.
            Some(fence) => Signal::Granted {
                fence,
                valid_until: (m.stamp + m.claim - t.allowance).max(0),
            },
            None => Signal::Next { within: m.claim },
        };
        let what = if m.acq != q.acq {
            "for an earlier token: kept as pending, never read"
        } else if q.registered {
            q.signals.push(signal);
            "to its waiter"
        } else if q.phase.waiting() {
            // Before the waiter registered: kept for it; a grant is not replaced by a "next".
            match (q.pending, signal) {
                (Some(Signal::Granted { .. }), Signal::Next { .. }) => {}
                _ => q.pending = Some(signal),
            }
            "kept until its waiter registers"
        } else {
            "for a waiter that left: kept as pending, never read"
        };
        let note = format!("P{} receives {} ({what})", p + 1, self.msg(p, &m));
        let q = &n.procs[p];
        if matches!(q.phase, Phase::Waiting { .. }) && q.signals.len() == 1 {
            // The waiter in its `select!` takes it at once: nothing but steps that commute with
            // that can come in between (and no tick: a waiter with a signal is urgent).
            let mut then = self.signal(&n, p, describe);
            then.step = Step::Deliver(p);
            then.note = format!("{note}; {}", then.note);
            return then;
        }
        succ(Step::Deliver(p), n, Vec::new(), describe.then_some(note))
    }

    /// The waiter takes the next signal in its `select!` (src/locker.rs 352-369).
    fn signal(&mut self, s: &State, p: u8, describe: bool) -> Successor {
        let t = self.config.timing;
        let mut n = *s;
        let q = &mut n.procs[p];
        let sig = q.signals.remove(0);
        let Phase::Waiting { fallback } = q.phase else {
            unreachable!()
        };
        let mut started = Vec::new();
        let key = self.keys_of(p)[0];
        let note = match sig {
            // src/engine/acquire.rs: a key handed to a set makes it attempt again at once; the
            // attempt claims it (and the other key, if it is free).
            Signal::Granted { .. } if self.config.sets.contains(&p) => {
                let note = self.attempt(&mut n, p, describe);
                format!(
                    "P{} is granted a key of its set: attempts again; {note}",
                    p + 1
                )
            }
            Signal::Granted { fence, valid_until } => {
                // 227-238: with at least MIN_HANDED_OVER left, run at once (`handed_over`,
                // 389-411: valid for what is left, first renewal within a third of it);
                // otherwise confirm with another attempt.
                let left = valid_until.max(0);
                if left >= t.min_handed_over {
                    q.phase = Phase::Holding(Hold {
                        fence,
                        valid_until: left,
                        next_renew: t.interval.min(left / 3),
                        renewing: None,
                        renewals: 0,
                    });
                    unregister(q);
                    started = vec![(p, key, fence)];
                    format!(
                        "P{} is granted the key: runs at once, fence {fence}, valid for {left} more ticks",
                        p + 1
                    )
                } else {
                    let note = self.attempt(&mut n, p, describe);
                    format!(
                        "P{} is granted the key with {left} left: confirms first; {note}",
                        p + 1
                    )
                }
            }
            // The subscription broke or came back, or the waiter registered after it did:
            // check again now.
            Signal::Retry => {
                let note = self.attempt(&mut n, p, describe);
                format!("P{} is told to check again; {note}", p + 1)
            }
            Signal::Next { within } => {
                let by = within + t.next_slack;
                q.phase = Phase::Waiting {
                    fallback: fallback.min(by),
                };
                format!(
                    "P{} is told it is next: checks again within {}",
                    p + 1,
                    fallback.min(by)
                )
            }
        };
        succ(Step::Signal(p), n, started, describe.then_some(note))
    }

    fn msg(&self, p: u8, m: &Message) -> String {
        match m.grant {
            Some(fence) => format!("\"granted P{}#{} fence {fence}\"", p + 1, m.acq),
            None => format!("\"P{}#{} is next\"", p + 1, m.acq),
        }
    }

    /// Tokens and channels by their short names.
    pub fn pretty(&self, text: &str) -> String {
        let mut out = text.to_owned();
        for p in 0..self.config.processes {
            for a in 0..=self.config.acquisitions {
                out = out.replace(&token_text(p, a), &format!("P{}#{}", p + 1, a));
            }
            out = out.replace(&channel_text(p), &format!("chan:P{}", p + 1));
        }
        out
    }

    pub fn show_db(&self, db: &Db) -> String {
        let interner = self.interner.borrow();
        let mut parts = Vec::new();
        for (k, v, e) in &db.strings {
            let e = e.map_or(String::new(), |e| format!(" (expires in {e})"));
            parts.push(format!("{}={}{e}", interner.text(*k), interner.text(*v)));
        }
        for (k, l, e) in &db.lists {
            let items: Vec<String> = l
                .iter()
                .map(|v| interner.text(*v)[..TOKEN_LEN].to_owned())
                .collect();
            let e = e.map_or(String::new(), |e| format!(" (expires in {e})"));
            parts.push(format!("{}=[{}]{e}", interner.text(*k), items.join(", ")));
        }
        for (k, members, e) in &db.zsets {
            let items: Vec<String> = members
                .iter()
                .map(|(score, m)| format!("{} until {score}", interner.text(*m)))
                .collect();
            let e = e.map_or(String::new(), |e| format!(" (expires in {e})"));
            parts.push(format!("{}={{{}}}{e}", interner.text(*k), items.join(", ")));
        }
        self.pretty(&format!("{{{}}}", parts.join(", ")))
    }

    /// The state in a few lines, for traces.
    pub fn show_state(&self, s: &State) -> String {
        let mut out = format!("      Redis {}\n", self.show_db(&s.db));
        for (p, q) in s.procs.iter().enumerate() {
            let _ = writeln!(
                out,
                "      P{}: {:?}{} #{} {:?} signals {:?} in flight: {} requests, {} replies, {} messages",
                p + 1,
                q.status,
                if q.sub_down {
                    " (subscription down)"
                } else {
                    ""
                },
                q.acq,
                q.phase,
                q.signals,
                q.outbox.len(),
                q.replies.len(),
                q.inbox.len()
            );
        }
        out
    }
}

fn succ(
    step: Step,
    state: State,
    started: Vec<(u8, usize, u32)>,
    note: Option<String>,
) -> Successor {
    Successor {
        step,
        state,
        started,
        given: Vec::new(),
        handed_on: false,
        note: note.unwrap_or_default(),
    }
}

/// The holder lets go: its belief ends now, the release goes out, and the process's next
/// request waits for its answer.
fn release(n: &mut State, p: u8) {
    let q = &mut n.procs[p];
    q.outbox.push(Request {
        op: Op::Release,
        acq: q.acq,
        aged: false,
        straddled: false,
    });
    q.phase = Phase::Releasing;
}

/// `p`'s subscription breaks (`down`) or comes back: Redis sees nobody on its channel while it
/// is down, and messages on their way to it are lost; either way the registered waiter is told
/// to check again (`retry_all`), and the epoch moves on, which the acquire attempts on their
/// way will show when they register. A waiter harmed by a break is excused from first come,
/// first served (a release may have skipped it), not from being woken.
fn change_course(q: &mut Proc, down: bool) {
    q.sub_down = down;
    if down {
        q.inbox.clear();
        q.broken |= q.phase.waiting();
    }
    if q.registered {
        retry(q);
    }
    for r in q.outbox.iter_mut() {
        r.straddled |= matches!(r.op, Op::Acquire { .. });
    }
    for a in q.replies.iter_mut() {
        a.straddled |= matches!(a.op, Op::Acquire { .. });
    }
}

/// The registered waiter is told to check again, unless a "check again" it has not read yet
/// will make it do so anyway (it checks after now either way: one is enough).
fn retry(q: &mut Proc) {
    if !q.signals.contains(&Signal::Retry) {
        q.signals.push(Signal::Retry);
    }
}

/// The waiter registers (`queue_watch`), unless it is registered already: a message that came
/// first is delivered, and with `retry` (its answer straddled a change of its subscription's
/// course) it is told to check again (`Handoff::register`).
fn register(q: &mut Proc, retry: bool) -> String {
    if q.registered {
        return String::new();
    }
    q.registered = true;
    let mut note = String::new();
    if let Some(sig) = q.pending.take() {
        q.signals.push(sig);
        note.push_str(" (a message that came first is delivered)");
    }
    if retry {
        self::retry(q);
        note.push_str(" (its subscription changed course since it sent the attempt: it is told to check again)");
    }
    note
}

/// The queue watch is dropped (`Registration::drop`): unregistered, pending message gone.
fn unregister(q: &mut Proc) {
    q.registered = false;
    q.signals.clear();
    q.pending = None;
}

/// A crashed or hung process does nothing more: what it would have read is gone, what it sent
/// is on the wire and still reaches Redis.
fn quiesce(q: &mut Proc) {
    q.phase = Phase::Done;
    unregister(q);
    q.replies.clear();
    q.inbox.clear();
}
