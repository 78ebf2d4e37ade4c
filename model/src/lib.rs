//! An explicit-state model checker for the Redis hand-off protocol (see `tests/protocol_model.rs`
//! for what is checked and `docs/RELIABILITY.md` for what is modelled).
//!
//! Breadth-first over every reachable state, with a visited set of states (plain data, compared
//! whole) and a parent pointer per state, so that the first violation found has a shortest
//! trace. Safety properties are checked on each state and each step; no starvation on the whole
//! graph once it is built: it must have no cycle (so every run is finite), and in every state
//! without a successor every process that is neither crashed nor hung must have finished what it
//! set out to do.

pub mod differential;
pub mod redis;
mod seq;
pub mod system;

use std::{
    collections::HashMap,
    fmt::{self, Write as _},
    hash::{Hash, Hasher},
    time::{Duration, Instant},
};

pub use system::Model;
pub use system::{Config, Counts, Faults, Sources, Timing};
use system::{Phase, State, Status, Step};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Property {
    /// Never two processes that each believe they hold a valid lease.
    Exclusion,
    /// On a key with a capacity: the processes that believe they hold a valid lease take at
    /// most the capacity between them.
    Capacity,
    /// On a key with a capacity: never a process that takes all of it (a writer) while another
    /// believes it holds a valid lease.
    WriterAlone,
    /// A process that believes it holds a valid lease holds the key in Redis.
    KeyAgrees,
    /// Each holder's fencing token is higher than every earlier holder's.
    FencingOrder,
    /// A live waiter queued before another gets the key first.
    Fifo,
    /// A live waiter asleep on its fallback timer (no lost message excusing it) has something
    /// that will wake it sooner: a signal or message on its way, an entry in a queue of its
    /// keys, or a resubscription to come that tells it to check again.
    Woken,
    /// A live waiter whose subscription is down, which no hand-off can reach, checks again
    /// within the wait policy's retry delay (or has a "check again" waiting for it).
    Polls,
    /// Every run ends, and ends with every live process done.
    NoStarvation,
}

pub struct Violation {
    pub property: Property,
    pub message: String,
    pub trace: String,
}

pub struct Report {
    pub name: String,
    pub states: usize,
    pub transitions: usize,
    pub terminal: usize,
    pub script_runs: u64,
    /// Steps in which a process started holding the key.
    pub holders: usize,
    /// ... of which a grant run at once, without a confirming attempt.
    pub grants_run: usize,
    /// Steps in which a release handed the key to a waiter.
    pub hand_overs: usize,
    /// Steps in which a release ran before its acquisition's attempt (a pool).
    pub overtaken: usize,
    /// States in which two or more processes believe they hold one key (a key with a capacity).
    pub overlaps: usize,
    pub elapsed: Duration,
    pub violation: Option<Violation>,
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: {} states, {} transitions, {} final states, {} distinct script runs; \
             {} steps start a holder ({} run a grant at once), {} hand the key on; {:.2?}",
            self.name,
            self.states,
            self.transitions,
            self.terminal,
            self.script_runs,
            self.holders,
            self.grants_run,
            self.hand_overs,
            self.elapsed
        )?;
        if self.overlaps > 0 {
            write!(
                f,
                "; {} states with holders that share a key",
                self.overlaps
            )?;
        }
        if self.overtaken > 0 {
            write!(
                f,
                "; {} steps run a release before its own attempt",
                self.overtaken
            )?;
        }
        match &self.violation {
            None => write!(f, "; all properties hold"),
            Some(v) => write!(
                f,
                "\nVIOLATION of {:?}: {}\ntrace:\n{}",
                v.property, v.message, v.trace
            ),
        }
    }
}

/// A multiply-rotate hasher (as rustc's FxHash): states hash often, and the standard hasher
/// is slow in a debug build.
struct Fx(u64);

impl Fx {
    fn add(&mut self, word: u64) {
        self.0 = (self.0.rotate_left(5) ^ word).wrapping_mul(0x517c_c1b7_2722_0a95);
    }
}

impl Hasher for Fx {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.add(u64::from_le_bytes(word));
        }
    }

    fn write_u8(&mut self, n: u8) {
        self.add(u64::from(n));
    }

    fn write_u32(&mut self, n: u32) {
        self.add(u64::from(n));
    }

    fn write_u64(&mut self, n: u64) {
        self.add(n);
    }

    fn write_i32(&mut self, n: i32) {
        self.add(n as u64);
    }

    fn write_usize(&mut self, n: usize) {
        self.add(n as u64);
    }
}

fn hash(s: &State) -> u64 {
    let mut h = Fx(0);
    s.hash(&mut h);
    h.finish()
}

/// The visited set: states by index, found by hash.
struct Visited {
    states: Vec<State>,
    by_hash: HashMap<u64, u32>,
    /// The rare states whose hash another state has already.
    collisions: HashMap<u64, Vec<u32>>,
}

impl Visited {
    fn find_or_insert(&mut self, s: State) -> (u32, bool) {
        let h = hash(&s);
        match self.by_hash.get(&h) {
            None => {
                let i = self.push(s);
                self.by_hash.insert(h, i);
                (i, true)
            }
            Some(&i) if self.states[i as usize] == s => (i, false),
            Some(_) => {
                if let Some(list) = self.collisions.get(&h) {
                    for &i in list {
                        if self.states[i as usize] == s {
                            return (i, false);
                        }
                    }
                }
                let i = self.push(s);
                self.collisions.entry(h).or_default().push(i);
                (i, true)
            }
        }
    }

    fn push(&mut self, s: State) -> u32 {
        self.states.push(s);
        u32::try_from(self.states.len() - 1).expect("too many states")
    }
}

/// Explores every state reachable under `config` and checks the properties; stops at the first
/// violation, with its trace.
pub fn check(config: Config) -> Report {
    check_model(&mut Model::new(config))
}

/// [`check`], on a model the caller keeps (to look at its script runs after).
pub fn check_model(model: &mut Model) -> Report {
    let started = Instant::now();
    let name = model.config.name.clone();
    let mut visited = Visited {
        states: Vec::new(),
        by_hash: HashMap::new(),
        collisions: HashMap::new(),
    };
    let mut parents: Vec<u32> = vec![u32::MAX];
    let (root, _) = visited.find_or_insert(model.initial());
    // The graph, for the no-starvation check: state i's successors are
    // edges[offsets[i]..offsets[i + 1]].
    let mut offsets: Vec<usize> = vec![0];
    let mut edges: Vec<u32> = Vec::new();
    let (mut terminal, mut holders, mut grants_run, mut hand_overs) = (0, 0, 0, 0);
    let (mut overtaken, mut overlaps) = (0, 0);
    let mut violation = None;
    let mut i = root as usize;
    'explore: while i < visited.states.len() {
        let state = visited.states[i];
        let successors = model.successors(&state, false);
        if successors.is_empty() {
            terminal += 1;
            if let Some(message) = starved(&state) {
                violation = Some((Property::NoStarvation, message, i as u32, false));
                break 'explore;
            }
        }
        for succ in successors {
            if !succ.started.is_empty() {
                holders += 1;
                grants_run += usize::from(matches!(succ.step, Step::Signal(_) | Step::Deliver(_)));
            }
            hand_overs += usize::from(succ.handed_on);
            overtaken += usize::from(matches!(succ.step, Step::Overtake(_)));
            let found = step_violation(model, &state, &succ);
            if let Some((property, message)) = found {
                violation = Some((property, message, i as u32, true));
                break 'explore;
            }
            let (j, new) = visited.find_or_insert(model.canonical(succ.state));
            edges.push(j);
            if new {
                parents.push(i as u32);
                if model.config.counts.is_some() {
                    overlaps += usize::from(shared(model, &visited.states[j as usize]));
                }
                if let Some((property, message)) = invariant(model, &visited.states[j as usize]) {
                    violation = Some((property, message, j, false));
                    break 'explore;
                }
            }
        }
        offsets.push(edges.len());
        i += 1;
    }
    let mut cycle_found = false;
    if violation.is_none()
        && let Some(cycle) = find_cycle(&offsets, &edges)
    {
        cycle_found = true;
        let message = format!(
            "a run that never ends: a cycle of {} states (no progress is certain)",
            cycle.len()
        );
        violation = Some((Property::NoStarvation, message, cycle[0], false));
    }
    let violation = violation.map(|(property, message, at, then)| {
        let (trace, named) = trace(model, &visited.states, &parents, at, then);
        Violation {
            property,
            // The graph's states have their processes in canonical order: the message is
            // worked out again on the trace's own states, whose names the trace uses (but for
            // a cycle, which no state shows by itself).
            message: if cycle_found {
                message
            } else {
                named.unwrap_or(message)
            },
            trace,
        }
    });
    Report {
        name,
        states: visited.states.len(),
        transitions: edges.len(),
        terminal,
        script_runs: model.redis.runs,
        holders,
        grants_run,
        hand_overs,
        overtaken,
        overlaps,
        elapsed: started.elapsed(),
        violation,
    }
}

/// A property a step breaks: a holder that starts with a fencing token not above an earlier
/// holder's of the same key, or a key given past a waiter queued before.
fn step_violation(
    model: &Model,
    before: &State,
    succ: &system::Successor,
) -> Option<(Property, String)> {
    succ.started
        .iter()
        .find_map(|&(p, key, fence)| on_start(model, before, p, key, fence))
        .or_else(|| {
            succ.given
                .iter()
                .find_map(|&(key, x)| on_given(model, before, &succ.state, key, x))
        })
}

/// Whether a process believes it holds a valid lease, and until when.
fn belief(s: &State, p: usize) -> Option<i16> {
    let q = &s.procs[p];
    match (q.status, q.phase) {
        (Status::Alive, Phase::Holding(h)) if h.valid_until > 0 => Some(h.valid_until),
        (Status::Hung { belief }, _) if belief > 0 => Some(belief),
        _ => None,
    }
}

/// The processes that believe they hold a valid lease on `key`.
fn believers(model: &Model, s: &State, key: usize) -> Vec<usize> {
    (0..s.procs.len())
        .filter(|&p| belief(s, p).is_some() && model.keys_of(p as u8).contains(&key))
        .collect()
}

/// Whether two processes or more believe they hold one key.
fn shared(model: &Model, s: &State) -> bool {
    (0..2).any(|key| believers(model, s, key).len() > 1)
}

fn invariant(model: &Model, s: &State) -> Option<(Property, String)> {
    for key in 0..2 {
        let believers = believers(model, s, key);
        if model.config.counts.is_some() {
            if let Some(found) = over_capacity(model, &believers, key) {
                return Some(found);
            }
        } else if believers.len() > 1 {
            let names: Vec<String> = believers.iter().map(|p| format!("P{}", p + 1)).collect();
            return Some((
                Property::Exclusion,
                format!(
                    "{} both believe they hold a valid lease on key {}",
                    names.join(" and "),
                    key_name(key)
                ),
            ));
        }
        if !model.config.key_agrees {
            continue;
        }
        for p in believers {
            if !model.holds_in_redis(&s.db, p as u8, s.procs[p].acq, key) {
                return Some((
                    Property::KeyAgrees,
                    format!(
                        "P{} believes it holds a valid lease on key {}, but Redis has {}",
                        p + 1,
                        key_name(key),
                        model.show_db(&s.db)
                    ),
                ));
            }
        }
    }
    forgotten(model, s).or_else(|| unpolled(model, s))
}

/// On a key with a capacity, `believers` (processes that believe they hold a valid lease on
/// it) that take more than the capacity between them: a writer with anyone, or more permits
/// than there are.
fn over_capacity(model: &Model, believers: &[usize], key: usize) -> Option<(Property, String)> {
    let taken: u64 = believers
        .iter()
        .map(|&p| u64::from(model.weight(p as u8)))
        .sum();
    let capacity = model.capacity();
    if taken <= u64::from(capacity) {
        return None;
    }
    let names = |ps: &[usize]| {
        ps.iter()
            .map(|p| format!("P{}", p + 1))
            .collect::<Vec<_>>()
            .join(" and ")
    };
    let writer = believers.iter().find(|&&p| model.is_writer(p as u8));
    Some(match writer {
        Some(&w) => {
            let others: Vec<usize> = believers.iter().copied().filter(|&p| p != w).collect();
            (
                Property::WriterAlone,
                format!(
                    "P{}, which takes all of key {}, believes it holds a valid lease while {} \
                     {} so too",
                    w + 1,
                    key_name(key),
                    names(&others),
                    if others.len() == 1 {
                        "believes"
                    } else {
                        "believe"
                    }
                ),
            )
        }
        None => (
            Property::Capacity,
            format!(
                "{} believe they hold valid leases on key {} taking {taken} of its {capacity}",
                names(believers),
                key_name(key)
            ),
        ),
    })
}

/// A live waiter that only its fallback timer will wake, though no message of its was lost:
/// its entry is gone from the queue (a release took it for a dead waiter's while its
/// subscription was down), and nothing on its way or to come will tell it.
fn forgotten(model: &Model, s: &State) -> Option<(Property, String)> {
    s.procs.iter().enumerate().find_map(|(p, q)| {
        let asleep = q.status == Status::Alive
            && matches!(q.phase, Phase::Waiting { .. })
            && !q.lost_message;
        if !asleep || !q.signals.is_empty() || !q.inbox.is_empty() || (q.registered && q.sub_down) {
            return None;
        }
        let queued = model
            .keys_of(p as u8)
            .iter()
            .any(|&key| model.queued(s, key).contains(&(p as u8, q.acq)));
        (!queued).then(|| {
            (
                Property::Woken,
                format!(
                    "P{}#{} is in no queue and will hear nothing: only its fallback timer wakes \
                     it ({:?})",
                    p + 1,
                    q.acq,
                    q.phase
                ),
            )
        })
    })
}

/// A live waiter that waits on its broken subscription: nothing can tell it of a hand-off, nor
/// has it been told to check again, yet it checks again only at a fallback timer later than the
/// wait policy's retry delay.
fn unpolled(model: &Model, s: &State) -> Option<(Property, String)> {
    let delay = model.config.timing.retry_delay;
    s.procs.iter().enumerate().find_map(|(p, q)| {
        let Phase::Waiting { fallback } = q.phase else {
            return None;
        };
        let waits = q.status == Status::Alive && q.sub_down && q.signals.is_empty();
        (waits && fallback > delay).then(|| {
            (
                Property::Polls,
                format!(
                    "P{}#{} waits on its broken subscription for {fallback} ticks, not polling \
                     every {delay}",
                    p + 1,
                    q.acq
                ),
            )
        })
    })
}

fn key_name(key: usize) -> &'static str {
    ["X", "Y"][key]
}

/// Checks a process that starts holding `key` (`p`, with `fence`) in a step from `before`:
/// its fencing token must be above every earlier holder's. On a key with a capacity, holders
/// that share it take their tokens in the order they are granted but may start in another
/// order, so a token must be above every earlier writer's (a holder that excluded all others),
/// and a writer's above every earlier holder's.
fn on_start(
    model: &Model,
    before: &State,
    p: u8,
    key: usize,
    fence: u32,
) -> Option<(Property, String)> {
    let above = if model.is_writer(p) {
        before.fence_high[key]
    } else {
        before.writer_high[key]
    };
    (fence <= above).then(|| {
        (
            Property::FencingOrder,
            format!(
                "P{} starts holding key {} with fencing token {fence}, not above the {above} a holder had before",
                p + 1,
                key_name(key),
            ),
        )
    })
}

/// Checks a script that gave `key` to acquisition `x` in the step from `before` to `after`:
/// every waiter whose entry appeared in the key's queue before `x`'s (all of them, if `x`
/// never queued for it) must have had its turn (on a key with a capacity: holds it in Redis
/// after the step, so a waiter served with the ones behind it in one run passes), unless it is
/// no longer live and unharmed.
fn on_given(
    model: &Model,
    before: &State,
    after: &State,
    key: usize,
    x: (u8, u8),
) -> Option<(Property, String)> {
    let fifo = &before.fifo[key];
    let ahead = fifo.iter().position(|&f| f == x).unwrap_or(fifo.len());
    fifo.as_slice()[..ahead].iter().find_map(|&(p, acq)| {
        let w = &after.procs[p];
        let waits = w.acq == acq
            && !model.holds_in_redis(&after.db, p, acq, key)
            && w.status == Status::Alive
            && !w.lost_message
            && !w.broken
            && matches!(
                w.phase,
                Phase::Attempting { .. } | Phase::Waiting { .. } | Phase::Sleeping { .. }
            );
        waits.then(|| {
            (
                Property::Fifo,
                format!(
                    "key {} goes to P{}#{} while P{}#{}, live and queued before it, still waits",
                    key_name(key),
                    x.0 + 1,
                    x.1,
                    p + 1,
                    acq
                ),
            )
        })
    })
}

/// In a state where nothing more can happen: a live process that has not finished.
fn starved(s: &State) -> Option<String> {
    s.procs.iter().enumerate().find_map(|(p, q)| {
        (q.status == Status::Alive && !matches!(q.phase, Phase::Done | Phase::GaveUp)).then(|| {
            format!(
                "nothing more can happen, and P{} (live) is stuck in {:?}",
                p + 1,
                q.phase
            )
        })
    })
}

/// A cycle in the graph (as state indexes), if there is one: Kahn's algorithm removes every
/// state not on or before a cycle; from what remains, a walk must come back to itself.
fn find_cycle(offsets: &[usize], edges: &[u32]) -> Option<Vec<u32>> {
    let n = offsets.len() - 1;
    let mut out_left: Vec<u32> = (0..n)
        .map(|i| (offsets[i + 1] - offsets[i]) as u32)
        .collect();
    // Reverse edges, to remove states whose successors are all removed (sinks first).
    let mut rev_offsets = vec![0usize; n + 1];
    for &j in edges {
        rev_offsets[j as usize + 1] += 1;
    }
    for i in 0..n {
        rev_offsets[i + 1] += rev_offsets[i];
    }
    let mut fill = rev_offsets.clone();
    let mut rev = vec![0u32; edges.len()];
    for i in 0..n {
        for &j in &edges[offsets[i]..offsets[i + 1]] {
            rev[fill[j as usize]] = i as u32;
            fill[j as usize] += 1;
        }
    }
    let mut stack: Vec<u32> = (0..n as u32)
        .filter(|&i| out_left[i as usize] == 0)
        .collect();
    let mut removed = vec![false; n];
    while let Some(j) = stack.pop() {
        removed[j as usize] = true;
        for &i in &rev[rev_offsets[j as usize]..rev_offsets[j as usize + 1]] {
            out_left[i as usize] -= 1;
            if out_left[i as usize] == 0 {
                stack.push(i);
            }
        }
    }
    let start = (0..n).find(|&i| !removed[i])?;
    // Every remaining state has a remaining successor: walk until a state repeats.
    let mut seen = HashMap::new();
    let mut path = Vec::new();
    let mut at = start as u32;
    loop {
        if let Some(&k) = seen.get(&at) {
            return Some(path[k..].to_vec());
        }
        seen.insert(at, path.len());
        path.push(at);
        at = *edges[offsets[at as usize]..offsets[at as usize + 1]]
            .iter()
            .find(|&&j| !removed[j as usize])
            .expect("a state on a cycle has a successor on it");
    }
}

/// The steps from the initial state to state `at` (then a step that violates a property of
/// steps, with `then`), replayed with their descriptions. States in the graph have their
/// processes in canonical order; the replay follows the same states without reordering, so
/// that every process keeps its name.
fn trace(
    model: &mut Model,
    states: &[State],
    parents: &[u32],
    at: u32,
    then: bool,
) -> (String, Option<String>) {
    let mut path = vec![at];
    while parents[*path.last().expect("path") as usize] != u32::MAX {
        path.push(parents[*path.last().expect("path") as usize]);
    }
    path.reverse();
    let mut out = String::new();
    let mut state = states[path[0] as usize];
    let mut now = 0;
    let mut message = None;
    let steps = path.len() - 1 + usize::from(then);
    for n in 0..steps {
        let successors = model.successors(&state, true);
        let succ = match path.get(n + 1) {
            Some(&next) => successors
                .into_iter()
                .find(|s| model.canonical(s.state) == states[next as usize]),
            None => successors
                .into_iter()
                .find(|s| step_violation(model, &state, s).is_some()),
        }
        .expect("a step of the trace is enabled");
        if n + 1 == steps && then {
            message = step_violation(model, &state, &succ).map(|(_, m)| m);
        }
        if succ.step == Step::Tick {
            now += 1;
            let _ = writeln!(out, "{:>4}  t={now:<3} tick", n + 1);
        } else {
            let _ = writeln!(out, "{:>4}  t={now:<3} {}", n + 1, succ.note);
        }
        state = succ.state;
    }
    let _ = write!(
        out,
        "      final state (t={now}):\n{}",
        model.show_state(&state)
    );
    if !then {
        message = invariant(model, &state)
            .map(|(_, m)| m)
            .or_else(|| starved(&state));
    }
    (out, message)
}
