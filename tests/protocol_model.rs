//! The Redis hand-off protocol under a model checker.
//!
//! The model (`model/`, the package `tower-lock-model`) runs the crate's own Lua scripts, exactly as `RedisStore` loads
//! them (`tower_lock::RedisStore::lua_scripts`), in an embedded Lua 5.1 against a model Redis,
//! each script call one atomic step; the clients around them follow `src/engine/acquire.rs`,
//! `src/engine/renew.rs` and `src/store/redis/handoff/mod.rs` (by symbol: see `model/src/system.rs`). The checker explores every reachable state of 3
//! or 4 processes contending for one key, with network delays, processes that crash, hang, give
//! up or lose a message, subscriptions that break and come back, a pool on which a release
//! overtakes its attempt, and leases that run out, and checks:
//!
//! - **exclusion**: never two processes that each believe they hold a valid lease (a belief
//!   lasts until the acquire's or renewal's send time + TTL, or a grant's stamp + claim window
//!   less the allowance), and a process that believes it holds one holds the key in Redis;
//! - **fencing order**: each holder's fencing token is above every earlier holder's;
//! - **first come, first served**: when a script gives the key to a token, no live, unharmed
//!   waiter whose queue entry appeared before that token's still waits;
//! - **no starvation**: every run ends (the state graph has no cycle), and ends with every
//!   process that neither crashed nor hung having acquired, run and released (or given up);
//! - **woken**: a live waiter asleep on its fallback timer has something else that will wake
//!   it (a signal or message on its way, a queue entry, a resubscription to come), unless a
//!   message of its was lost.
//!
//! On a key with a capacity (leases with counts, the `counted` script: permits, readers and a
//! writer, weights of one key's capacity), the same runs and failures, and:
//!
//! - **capacity**: the processes that believe they hold a valid lease take at most the
//!   capacity between them, and a process that believes it holds one has a live member in the
//!   key's sorted set;
//! - **writer alone**: never a process that takes the whole capacity together with anyone;
//! - **first come, first served**: as above, a waiter served in the same script run as the
//!   ones behind it passing; so a queued head is not overtaken by lighter requests behind it,
//!   and a reader does not pass a queued writer;
//! - **fencing order**: holders that share a key may start in another order than their grants,
//!   so each holder's token is above every earlier writer's, and a writer's above every
//!   earlier holder's;
//! - **no starvation**, as above.
//!
//! And it can fail: the same checker on deliberately broken scripts (and broken clients)
//! finds each break, one per property, and prints the run that shows it. The model's Redis is
//! checked against a real `redis-server` by replaying its script runs. See
//! `docs/RELIABILITY.md`, "The hand-off protocol under a model checker", for what is modelled,
//! what is left out, and the figures.

use tower_lock_model::{
    self as model, Config, Counts, Faults, Model, Property, Report, Sources, Timing, check,
    check_model,
};
use tower_lock_testkit::{Flavor, RedisServer};

fn faults(budget: u8) -> Faults {
    Faults {
        budget,
        crash: true,
        hang: true,
        give_up: true,
        lose: true,
        resubscribe: false,
    }
}

/// One failure: a subscription that breaks (and comes back).
fn only_breaks() -> Faults {
    Faults {
        budget: 1,
        crash: false,
        hang: false,
        give_up: false,
        lose: false,
        resubscribe: true,
    }
}

fn config(name: &str, processes: u8, faults: Faults) -> Config {
    Config {
        name: name.into(),
        processes,
        acquisitions: 1,
        renewals: 1,
        faults,
        timing: Timing::DEFAULT,
        delays: true,
        start_together: false,
        completes: vec![],
        sets: vec![],
        second_key: vec![],
        reversed: vec![],
        key_agrees: true,
        fallback_timer: true,
        registration_epoch: true,
        poll_unqueued: true,
        breaks: vec![],
        pool: false,
        counts: None,
        sources: Sources::crate_scripts(),
    }
}

/// `TOWER_LOCK_MODEL_EXTENDED=1` runs four of the checks below on larger configurations (a few
/// minutes and a few GB in all; see `docs/RELIABILITY.md`).
fn extended() -> bool {
    std::env::var_os("TOWER_LOCK_MODEL_EXTENDED").is_some()
}

/// Runs the checker and fails with the counterexample, if any.
fn holds(config: Config) -> Report {
    let report = check(config);
    println!("{report}");
    assert!(report.violation.is_none(), "{report}");
    assert!(report.holders > 0 && report.hand_overs > 0, "{report}");
    report
}

/// `source` with `from` (which must occur exactly once) replaced by `to`.
fn broken(source: &str, from: &str, to: &str) -> String {
    assert_eq!(
        source.matches(from).count(),
        1,
        "the script no longer contains {from:?} once: update this deliberate break"
    );
    source.replacen(from, to, 1)
}

/// Runs the checker on a broken model and returns the violation's property, after printing
/// the counterexample.
fn fails(config: Config) -> (Property, String) {
    let report = check(config);
    println!("{report}");
    let violation = report
        .violation
        .unwrap_or_else(|| panic!("the broken script passed the checker: {}", report.name));
    assert!(
        violation.trace.lines().count() > 2,
        "no trace: {}",
        violation.trace
    );
    (violation.property, violation.trace)
}

// ---- The protocol as the crate has it. ----

/// Three processes that each arrive at any time, with network delays, no failures.
#[test]
fn three_processes_arriving_at_any_time() {
    holds(config("3 processes, any arrival, delays", 3, faults(0)));
}

/// Three processes arriving at any time, and one failure of any kind at any point: a holder
/// that crashes or hangs (its lease runs out while others wait, and a newcomer may arrive just
/// then), a waiter that crashes, hangs, gives up or loses its message. Extended: with delays.
#[test]
fn three_processes_arriving_at_any_time_with_a_failure() {
    let mut c = config("3 processes, any arrival, 1 failure", 3, faults(1));
    c.delays = extended();
    holds(c);
}

/// Three processes contending from the start, network delays, one failure.
#[test]
fn three_processes_with_delays_and_a_failure() {
    let mut c = config("3 processes, together, delays, 1 failure", 3, faults(1));
    c.start_together = true;
    holds(c);
}

/// Three processes contending from the start, any two failures.
#[test]
fn three_processes_with_two_failures() {
    let mut c = config("3 processes, together, 2 failures", 3, faults(2));
    c.start_together = true;
    c.delays = false;
    holds(c);
}

/// Three processes that each acquire twice (a fresh token each time), any arrival for the
/// second: messages for a process's earlier token, a process's release handing the key on
/// while its next request queues. Extended: with one failure.
#[test]
fn three_processes_acquiring_twice() {
    let budget = u8::from(extended());
    let mut c = config("3 processes, 2 acquisitions each", 3, faults(budget));
    c.acquisitions = 2;
    c.start_together = true;
    c.delays = false;
    holds(c);
}

/// Four processes contending from the start, with network delays. Extended: arriving at any
/// time.
#[test]
fn four_processes_with_delays() {
    let mut c = config("4 processes, delays", 4, faults(0));
    c.start_together = !extended();
    holds(c);
}

/// Four processes, one failure of any kind. Extended: two.
#[test]
fn four_processes_with_a_failure() {
    let budget = 1 + u8::from(extended());
    let mut c = config("4 processes, together, failures", 4, faults(budget));
    c.start_together = true;
    c.delays = false;
    holds(c);
}

/// Four processes, two of which may hang: two hung waiters in a row before a live one.
#[test]
fn four_processes_with_two_hung() {
    let mut c = config("4 processes, together, 2 hung", 4, faults(2));
    c.faults.crash = false;
    c.faults.give_up = false;
    c.faults.lose = false;
    c.start_together = true;
    c.delays = false;
    holds(c);
}

/// The idempotency layer's release (`complete`: the record and the release in one operation)
/// in place of the plain release.
#[test]
fn idempotency_release() {
    let mut c = config("3 processes, complete", 3, faults(1));
    c.start_together = true;
    c.completes = vec![0, 1, 2];
    holds(c);
}

/// Only one failure: a subscription that breaks (messages on their way to that process are
/// lost, and a release finds nobody on its channel) and comes back at any later moment, each
/// time telling the waiters registered then to check again, with any answer on its way across
/// it. Three processes contending from the start, with network delays: the registration gap
/// (a "queued" answer read after the subscription came back) is closed, and every waiter is
/// woken by something other than its fallback timer. Extended: arriving at any time.
#[test]
fn a_subscription_that_breaks_and_comes_back() {
    let mut c = config(
        "3 processes, delays, a subscription break",
        3,
        only_breaks(),
    );
    c.start_together = !extended();
    holds(c);
}

/// The same with a second failure, a waiter that gives up (of any kind when extended),
/// contending from the start, without delays.
#[test]
fn a_subscription_that_breaks_and_a_waiter_that_gives_up() {
    let mut f = faults(2);
    f.resubscribe = true;
    f.crash = extended();
    f.hang = extended();
    f.lose = extended();
    let mut c = config("3 processes, together, a break and a give-up", 3, f);
    c.start_together = true;
    c.delays = false;
    holds(c);
}

/// Calls through a pool of connections: a waiter that gives up while its attempt is on its
/// way sends its release, which may reach Redis first (`src/store/redis/commit.rs`). The late
/// attempt then takes the key for a holder that is gone, or queues it: the key stays held until
/// its TTL or a claim window runs out, and every property still holds.
#[test]
fn a_release_that_overtakes_its_attempt_on_a_pool() {
    let mut f = faults(1);
    f.crash = false;
    f.hang = false;
    f.lose = false;
    let mut c = config("3 processes, together, delays, a pool, 1 give-up", 3, f);
    c.start_together = true;
    c.pool = true;
    let report = holds(c);
    assert!(
        report.overtaken > 0,
        "no release overtook its attempt: {report}"
    );
}

// ---- Sets of keys: a process that takes both keys as one lease. ----

/// A set of both keys and a process on each of them, arriving at any time, with network
/// delays: exclusion, key agreement and fencing order on each key, first come first served on
/// each key's queue (no single-key waiter passes a set queued before it, nor the set one queued
/// before it), and every run ends with everyone served.
#[test]
fn a_set_and_a_process_on_each_of_its_keys() {
    let mut c = config("set + X + Y, any arrival, delays", 3, faults(0));
    c.sets = vec![0];
    c.second_key = vec![2];
    holds(c);
}

/// The same, contending from the start, with one failure of any kind: a set that crashes,
/// hangs or gives up while it waits keeping a key, or loses the grant of one.
#[test]
fn a_set_and_a_process_on_each_of_its_keys_with_a_failure() {
    let mut c = config("set + X + Y, together, 1 failure", 3, faults(1));
    c.sets = vec![0];
    c.second_key = vec![2];
    c.start_together = true;
    c.delays = false;
    holds(c);
}

/// A set behind a stream: two processes that each take X twice, one after the other, and a
/// set: the set is served in its turn, not passed by the stream.
#[test]
fn a_set_in_a_stream_of_single_keys() {
    let mut c = config("set + X + X, 2 acquisitions each", 3, faults(0));
    c.sets = vec![0];
    c.acquisitions = 2;
    c.start_together = true;
    c.delays = false;
    holds(c);
}

/// Two sets of the same two keys and a process on X, arriving at any time: never a cycle of
/// waits (every run ends, everyone served). Extended: with one failure.
#[test]
fn two_sets_and_a_single_key() {
    let budget = u8::from(extended());
    let mut c = config("set + set + X, any arrival", 3, faults(budget));
    c.sets = vec![0, 1];
    c.delays = extended();
    holds(c);
}

/// A set and a process on each of its keys, contending from the start, with a subscription
/// that breaks and comes back. Extended: with delays.
#[test]
fn a_set_and_a_subscription_that_breaks() {
    let mut c = config(
        "set + X + Y, together, a subscription break",
        3,
        only_breaks(),
    );
    c.sets = vec![0];
    c.second_key = vec![2];
    c.start_together = true;
    c.delays = extended();
    holds(c);
}

/// Four processes: a set, two on X, one on Y, contending from the start. Extended: arriving
/// at any time.
#[test]
fn a_set_and_three_single_keys() {
    let mut c = config("set + X + X + Y", 4, faults(0));
    c.sets = vec![0];
    c.second_key = vec![3];
    c.start_together = !extended();
    c.delays = false;
    holds(c);
}

// ---- Keys with a capacity: permits, readers and writers (`counted.lua`). ----

/// The capacity of a key only readers and writers share (`Share::READERS`).
const READERS: u32 = u32::MAX;

/// `config(name, weights.len(), faults)` on a key with `capacity`, each process taking its
/// weight of it.
fn counted(name: &str, capacity: u32, weights: &[u32], faults: Faults) -> Config {
    let mut c = config(name, weights.len() as u8, faults);
    c.counts = Some(Counts {
        capacity,
        weights: weights.to_vec(),
    });
    c
}

/// Runs the checker on a key with a capacity: as [`holds`], and some steps served more than
/// one holder at once.
fn holds_counted(config: Config) -> Report {
    let report = holds(config);
    assert!(report.overlaps > 0, "no two holders at once: {report}");
    report
}

/// A counted configuration (`counted`), its processes started together without delays, its
/// `counted` script broken by replacing `from` with `to`: the property the checker finds broken,
/// and the trace.
fn counted_broken(
    name: &str,
    capacity: u32,
    weights: &[u32],
    from: &str,
    to: &str,
) -> (Property, String) {
    let mut c = counted(name, capacity, weights, faults(0));
    c.start_together = true;
    c.delays = false;
    c.sources.counted = broken(&c.sources.counted, from, to);
    fails(c)
}

/// Three processes taking one of two permits, arriving at any time, with network delays: at
/// most two hold at once, first come first served, everyone served.
#[test]
fn three_processes_on_two_permits() {
    holds_counted(counted(
        "3 on 2 permits, any arrival, delays",
        2,
        &[1, 1, 1],
        faults(0),
    ));
}

/// The same, contending from the start, with one failure of any kind: a holder that crashes
/// or hangs keeps its permit until its lease runs out; a waiter that crashes, hangs, gives up
/// or loses its grant.
#[test]
fn three_processes_on_two_permits_with_a_failure() {
    let mut c = counted(
        "3 on 2 permits, together, 1 failure",
        2,
        &[1, 1, 1],
        faults(1),
    );
    c.start_together = true;
    c.delays = false;
    holds_counted(c);
}

/// Four processes taking one of two permits, contending from the start: two waiters queued
/// when a holder lets go, of whom the release must serve one only.
#[test]
fn four_processes_on_two_permits() {
    let mut c = counted("4 on 2 permits, together", 2, &[1, 1, 1, 1], faults(0));
    c.start_together = true;
    c.delays = false;
    holds_counted(c);
}

/// Four processes taking one of three permits, contending from the start.
#[test]
fn four_processes_on_three_permits() {
    let mut c = counted("4 on 3 permits, together", 3, &[1, 1, 1, 1], faults(0));
    c.start_together = true;
    c.delays = false;
    holds_counted(c);
}

/// Two readers and a writer contending from the start, with network delays: never the writer
/// with anyone; a writer queued behind a reader is not passed by the other reader.
#[test]
fn two_readers_and_a_writer() {
    let mut c = counted(
        "2 readers + writer, together, delays",
        READERS,
        &[1, 1, READERS],
        faults(0),
    );
    c.start_together = true;
    holds_counted(c);
}

/// Two readers and a writer contending from the start, with one failure of any kind.
#[test]
fn two_readers_and_a_writer_with_a_failure() {
    let mut c = counted(
        "2 readers + writer, together, 1 failure",
        READERS,
        &[1, 1, READERS],
        faults(1),
    );
    c.start_together = true;
    c.delays = false;
    holds_counted(c);
}

/// Two readers and two writers contending from the start.
#[test]
fn two_readers_and_two_writers() {
    let mut c = counted(
        "2 readers + 2 writers, together",
        READERS,
        &[1, 1, READERS, READERS],
        faults(0),
    );
    c.start_together = true;
    c.delays = false;
    holds_counted(c);
}

/// Permits of different weights on a key of 3: one of 1, one of 2, and one that takes all
/// 3, arriving at any time: a heavy request is not overtaken by lighter ones behind it.
#[test]
fn weights_of_one_two_and_three() {
    let mut c = counted(
        "weights 1, 2, 3 of 3, any arrival",
        3,
        &[1, 2, 3],
        faults(0),
    );
    c.delays = false;
    holds_counted(c);
}

/// A subscription that breaks and comes back, on three processes taking one of two permits,
/// contending from the start: a waiter skipped while its subscription was down checks again.
#[test]
fn permits_with_a_subscription_that_breaks() {
    let mut c = counted(
        "3 on 2 permits, together, a subscription break",
        2,
        &[1, 1, 1],
        only_breaks(),
    );
    c.start_together = true;
    c.delays = false;
    holds_counted(c);
}

/// Calls through a pool: a waiter on permits that gives up while its attempt is on its way
/// sends its release, which may reach Redis first; the late attempt takes a permit for a holder
/// that is gone, until its lease runs out.
#[test]
fn permits_with_a_release_that_overtakes_its_attempt_on_a_pool() {
    let mut f = faults(1);
    f.crash = false;
    f.hang = false;
    f.lose = false;
    let mut c = counted(
        "3 on 2 permits, together, delays, a pool, 1 give-up",
        2,
        &[1, 1, 1],
        f,
    );
    c.start_together = true;
    c.pool = true;
    let report = holds_counted(c);
    assert!(
        report.overtaken > 0,
        "no release overtook its attempt: {report}"
    );
}

// ---- Deliberately broken scripts: each must produce a counterexample. ----

/// Two sets that take their keys in opposite orders (a client change: the crate's clients take
/// every set in lock order) and a process on each key: each set keeps the key it got first
/// while it waits for the other's, and neither run ever ends.
#[test]
fn sets_in_opposite_orders_wait_for_each_other_forever() {
    let mut c = config("broken: two sets in opposite orders", 4, faults(0));
    c.sets = vec![0, 1];
    c.reversed = vec![1];
    c.second_key = vec![3];
    c.start_together = true;
    c.delays = false;
    let (property, trace) = fails(c);
    assert_eq!(property, Property::NoStarvation, "{trace}");
    assert!(trace.contains("queued for key Y"), "{trace}");
}

/// A set that takes free keys without looking at their queues: it barges past a waiter when
/// a hung holder's lease runs out.
#[test]
fn a_set_that_ignores_the_queues_barges() {
    let mut c = config("broken: acquire_set ignores the queues", 3, faults(1));
    c.sets = vec![0];
    c.faults.crash = false;
    c.faults.give_up = false;
    c.faults.lose = false;
    c.delays = false;
    c.sources.acquire_set = broken(
        &c.sources.acquire_set,
        "if (holder and holder ~= token) or (handoff and redis.call('LLEN', queue_of(i)) > 0) then",
        "if holder and holder ~= token then",
    );
    assert_eq!(fails(c).0, Property::Fifo);
}

/// A set release that does not check the token: a set that gives up releases a key another
/// process holds.
#[test]
fn a_set_release_without_its_token_check_breaks_exclusion() {
    let mut c = config("broken: release_set without token check", 3, faults(1));
    c.sets = vec![0];
    c.second_key = vec![2];
    c.faults.crash = false;
    c.faults.hang = false;
    c.faults.lose = false;
    c.start_together = true;
    c.delays = false;
    c.sources.release_set = broken(
        &c.sources.release_set,
        "  if redis.call('GET', lock) == token then\n    let_go",
        "  if redis.call('GET', lock) then\n    let_go",
    );
    let (property, trace) = fails(c);
    assert_eq!(property, Property::KeyAgrees, "{trace}");
}

/// A release that does not check the token: a waiter that gives up sends its release while
/// another process holds the key, and the release hands the holder's key to the next waiter.
#[test]
fn a_release_without_its_token_check_breaks_exclusion() {
    let mut c = config("broken: release without token check", 3, faults(1));
    c.faults.crash = false;
    c.faults.hang = false;
    c.faults.lose = false;
    c.start_together = true;
    c.delays = false;
    c.sources.ops = broken(
        &c.sources.ops,
        "local held = redis.call('GET', lock) == token",
        "local held = redis.call('GET', lock) ~= false",
    );
    // With the stronger invariant (a believer holds the key in Redis) off, the run goes on to
    // the moment two processes both believe they hold the key.
    c.key_agrees = false;
    let (property, trace) = fails(c.clone());
    assert_eq!(property, Property::Exclusion, "{trace}");
    assert!(trace.contains("gives up and sends its release"), "{trace}");
    // With it on, the checker stops at the step that gives the holder's key away.
    c.key_agrees = true;
    assert_eq!(fails(c).0, Property::KeyAgrees);
}

/// A hand-over that gives the key to the second live waiter instead of the first.
#[test]
fn a_hand_over_past_the_head_breaks_first_come_first_served() {
    let mut c = config("broken: hand over past the head", 3, faults(0));
    c.start_together = true;
    c.delays = false;
    let skip_head = "local head = redis.call('LPOP', queue)\n    \
        if head and redis.call('LLEN', queue) > 0 then\n      \
        redis.call('RPUSH', queue, head)\n      head = redis.call('LPOP', queue)\n    end";
    c.sources.ops = broken(
        &c.sources.ops,
        "local head = redis.call('LPOP', queue)",
        skip_head,
    );
    assert_eq!(fails(c).0, Property::Fifo);
}

/// An acquire that takes a free key without looking at the queue: a newcomer barges past the
/// waiters when a hung holder's lease runs out.
#[test]
fn an_acquire_that_ignores_the_queue_lets_newcomers_barge() {
    let mut c = config("broken: acquire ignores the queue", 3, faults(1));
    c.faults.crash = false;
    c.faults.give_up = false;
    c.faults.lose = false;
    c.delays = false;
    c.sources.ops = broken(
        &c.sources.ops,
        "if took and (not queue or redis.call('LLEN', queue) == 0) then",
        "if took then",
    );
    assert_eq!(fails(c).0, Property::Fifo);
}

/// A fencing token function that does not count up: two holders in a row get the same token.
#[test]
fn a_fencing_counter_that_does_not_count_breaks_fencing_order() {
    let mut c = config("broken: fencing counter does not count", 3, faults(0));
    c.start_together = true;
    c.delays = false;
    let from = "local fence = math.max(last + 1, fence_now)";
    let to = "local fence = math.max(last, fence_now, 1)";
    c.sources.ops = broken(&c.sources.ops, from, to);
    assert_eq!(fails(c).0, Property::FencingOrder);
}

/// The no-starvation check can fail too: without `acquire_held`'s fallback timer (a client
/// change, not a script's), a waiter whose grant is lost waits forever.
#[test]
fn without_the_fallback_timer_a_lost_grant_starves_its_waiter() {
    let mut c = config("broken: no fallback timer", 3, faults(1));
    c.faults.crash = false;
    c.faults.hang = false;
    c.faults.give_up = false;
    c.start_together = true;
    c.delays = false;
    c.fallback_timer = false;
    let (property, trace) = fails(c);
    assert_eq!(property, Property::NoStarvation, "{trace}");
    assert!(trace.contains("is lost"), "{trace}");
}

/// The client before registration compared the store's epoch: a waiter whose "queued" answer
/// arrives after its subscription broke and came back registers with nothing to wake it. The
/// release in between found nobody on its channel and dropped its entry; the resubscription
/// told only the waiters registered then. It sleeps until its fallback timer while the key is
/// free. The checker finds it as soon as the waiter waits on its broken subscription with
/// nothing to tell it to check again (*Polls*), before the release (*Woken*, which it broke
/// when that was the first check to see it).
#[test]
fn without_the_epoch_a_late_queued_answer_leaves_its_waiter_asleep() {
    let mut c = config("broken: no epoch at registration", 3, only_breaks());
    c.start_together = true;
    c.delays = false;
    c.registration_epoch = false;
    let (property, trace) = fails(c);
    assert!(
        matches!(property, Property::Polls | Property::Woken),
        "{trace}"
    );
    assert!(trace.contains("subscription breaks"), "{trace}");
    assert!(trace.contains("P2 hears: queued"), "{trace}");
}

/// The same gap for a set (whose subscription is the one that breaks).
#[test]
fn without_the_epoch_a_set_with_a_late_queued_answer_sleeps() {
    let mut c = config("broken: no epoch at registration, a set", 3, only_breaks());
    c.sets = vec![0];
    c.second_key = vec![2];
    c.breaks = vec![0];
    c.start_together = true;
    c.delays = false;
    c.registration_epoch = false;
    let (property, trace) = fails(c);
    assert!(
        matches!(property, Property::Polls | Property::Woken),
        "{trace}"
    );
    assert!(trace.contains("P1 hears: queued for key"), "{trace}");
}

/// The client before a waiter answered "held" and not queued polled: queued once (and so
/// registered), it went on waiting on its subscription after the break, as if still queued,
/// though nothing could reach it there until the resubscription.
#[test]
fn without_polling_a_waiter_waits_on_its_broken_subscription() {
    let mut c = config("broken: waits on a broken subscription", 3, only_breaks());
    c.start_together = true;
    c.delays = false;
    c.poll_unqueued = false;
    let (property, trace) = fails(c);
    assert_eq!(property, Property::Polls, "{trace}");
    assert!(trace.contains("subscription breaks"), "{trace}");
    assert!(trace.contains("held by another"), "{trace}");
}

/// A hand-over that does not ask whether the waiter's process is alive (no `PUBSUB NUMSUB`):
/// a crashed waiter is handed the key and the queue waits out its claim window. Slower, not
/// wrong, so the checker must pass it: it checks correctness, not cost (and a checker that
/// fails whatever changes would fail here).
#[test]
fn a_hand_over_that_skips_dead_waiters_without_asking_still_holds() {
    let mut c = config("hand over without NUMSUB", 3, faults(1));
    c.faults.hang = false;
    c.faults.give_up = false;
    c.faults.lose = false;
    c.start_together = true;
    c.delays = false;
    c.sources.ops = broken(
        &c.sources.ops,
        "if redis.call('PUBSUB', 'NUMSUB', channel)[2] > 0 then",
        "if true then",
    );
    holds(c);
}

/// A release that gives its holder's weight back twice (it counts what is left after taking its
/// own member out, then takes its weight off again): a writer is let in beside a reader still
/// holding its permit.
#[test]
fn a_release_that_frees_its_weight_twice_lets_too_many_in() {
    let (property, trace) = counted_broken(
        "broken: a release frees its weight twice",
        2,
        &[1, 1, 2],
        "    local used = counted_used(lock, now, cap, false)\n",
        "    local used = counted_used(lock, now, cap, false) - tonumber(weight)\n",
    );
    assert!(
        matches!(
            property,
            Property::Capacity | Property::WriterAlone | Property::KeyAgrees
        ),
        "{trace}"
    );
}

/// The same on permits alone: two holders of one permit each, two waiters; each release lets
/// two in for the one it gives back.
#[test]
fn a_release_that_frees_its_weight_twice_exceeds_the_permits() {
    let (property, trace) = counted_broken(
        "broken: a release frees its weight twice, permits",
        2,
        &[1, 1, 1, 1],
        "    local used = counted_used(lock, now, cap, false)\n",
        "    local used = counted_used(lock, now, cap, false) - tonumber(weight)\n",
    );
    assert_eq!(property, Property::Capacity, "{trace}");
}

/// A hold that adds nothing to the key's running sum (the sum key beside the sorted set, which
/// an acquire reads instead of every member): the sum stays below what the live holders take,
/// and waiters are let in beyond the permits. (A sum that is missing, or that `HINCRBY` finds
/// missing, is counted again from the members, so the break adds nothing and never recounts.)
#[test]
fn a_sum_that_forgets_a_holder_exceeds_the_permits() {
    let (property, trace) = counted_broken(
        "broken: a hold adds nothing to the sum",
        2,
        &[1, 1, 1, 1],
        "if redis.call('HINCRBY', sum_key, 'u', weight) == weight then",
        "if redis.call('HINCRBY', sum_key, 'u', 0) == -1 then",
    );
    assert_eq!(property, Property::Capacity, "{trace}");
}

/// A hand-off that does not count the waiters it serves: it lets in everyone queued whose own
/// weight fits beside the holders that were there before.
#[test]
fn a_hand_off_that_does_not_count_whom_it_serves_exceeds_the_permits() {
    let (property, trace) = counted_broken(
        "broken: serve does not count",
        2,
        &[1, 1, 1, 1],
        "      used = used + weight\n",
        "",
    );
    assert_eq!(property, Property::Capacity, "{trace}");
}

/// An attempt that takes room without looking at the queue: a reader that arrives while a
/// writer waits behind another reader barges past the writer.
#[test]
fn a_reader_that_ignores_the_queue_barges_past_a_queued_writer() {
    let (property, trace) = counted_broken(
        "broken: a reader barges",
        READERS,
        &[1, 1, READERS],
        "if (not queue or redis.call('LLEN', queue) == 0) and used + weight <= cap then",
        "if used + weight <= cap then",
    );
    assert_eq!(property, Property::Fifo, "{trace}");
    assert!(trace.contains("RPUSH tl:{k}:queue P3#1"), "{trace}");
}

// ---- The model's Redis is Redis. ----

/// Every distinct script run of a checked configuration, replayed on a real `redis-server` and
/// a real `valkey-server`, answers the same, leaves the same keys and publishes the same
/// messages. (One exploration, replayed on both: the exploration is the test's cost.)
#[tokio::test]
async fn the_model_redis_answers_as_redis_server_does() {
    let mut c = config("3 processes, together, 2 failures (replayed)", 3, faults(2));
    c.start_together = true;
    c.delays = false;
    c.completes = vec![0, 1, 2];
    let mut model = Model::new(c);
    let report = check_model(&mut model);
    assert!(report.violation.is_none(), "{report}");
    let mut c = config("3 processes, together, 1 failure (replayed)", 3, faults(1));
    c.start_together = true;
    let mut other = Model::new(c);
    assert!(check_model(&mut other).violation.is_none());
    let mut c = config("set + X + Y, together, 1 failure (replayed)", 3, faults(1));
    c.sets = vec![0];
    c.second_key = vec![2];
    c.start_together = true;
    c.delays = false;
    let mut sets = Model::new(c);
    assert!(check_model(&mut sets).violation.is_none());
    for flavor in [Flavor::Redis, Flavor::Valkey] {
        let server = RedisServer::options().flavor(flavor).start();
        let a = model::differential::replay(&model, &server.url(), 1500).await;
        let b = model::differential::replay(&other, &server.url(), 1500).await;
        let c = model::differential::replay(&sets, &server.url(), 1500).await;
        println!(
            "{a} + {b} + {c} script runs agree with {}",
            flavor.program()
        );
        assert!(a > 500 && b > 500 && c > 500, "{a} + {b} + {c}");
    }
}

/// The same for the counted script: every distinct run of two checked configurations of keys
/// with a capacity (permits, and readers with a writer, each with a failure), replayed on a
/// real `redis-server` and `valkey-server`, with the holders' sorted set set up and read back
/// on the server's clock.
#[tokio::test]
async fn the_model_redis_answers_as_redis_server_does_on_keys_with_a_capacity() {
    let mut c = counted(
        "3 on 2 permits, together, 1 failure (replayed)",
        2,
        &[1, 1, 1],
        faults(1),
    );
    c.start_together = true;
    c.delays = false;
    let mut permits = Model::new(c);
    let report = check_model(&mut permits);
    assert!(report.violation.is_none(), "{report}");
    let mut c = counted(
        "2 readers + writer, together, 1 failure (replayed)",
        READERS,
        &[1, 1, READERS],
        faults(1),
    );
    c.start_together = true;
    c.delays = false;
    let mut readers = Model::new(c);
    assert!(check_model(&mut readers).violation.is_none());
    for flavor in [Flavor::Redis, Flavor::Valkey] {
        let server = RedisServer::options().flavor(flavor).start();
        let a = model::differential::replay(&permits, &server.url(), 700).await;
        let b = model::differential::replay(&readers, &server.url(), 700).await;
        println!(
            "{a} + {b} counted script runs agree with {}",
            flavor.program()
        );
        assert!(a > 300 && b > 300, "{a} + {b}");
    }
}
