//! The engine without HTTP and without Redis: the acquire loop, renewal timing, batching, the
//! local queue and the background renewal, on paused time, so a lifecycle bug shows up in
//! milliseconds. (Redis behaviour is tested against a real `redis-server`, in `tests/`.)

use std::{
    pin::Pin,
    sync::{Arc, Mutex},
    task::{Context, Poll},
    time::Duration,
};

use tokio::{
    sync::mpsc,
    time::{Instant, advance, sleep},
};
use tracing::Span;

use super::Locker;
use crate::{
    config::LockConfig,
    error::{LockError, LostReason},
    key::LockKey,
    store::{
        Acquire, Attempt, BoxFuture, Capabilities, Epoch, HandOff, LockStore, QueueSignals,
        QueueWatch, Signal, StoreError, StoreErrorKind,
    },
    testing::{Call, Scripted},
    token::Token,
    wait::Wait,
};

const MS: Duration = Duration::from_millis(1);

fn locker(store: &Scripted, config: LockConfig) -> Locker {
    Locker::with_config(store.clone(), config)
}

fn config(ttl: Duration, wait: Wait) -> LockConfig {
    LockConfig::builder().ttl(ttl).wait(wait).build().unwrap()
}

fn is_acquire(c: &Call) -> bool {
    *c == Call::Acquire
}

fn is_renew(c: &Call) -> bool {
    *c == Call::Renew
}

fn is_release(c: &Call) -> bool {
    *c == Call::Release
}

#[tokio::test(start_paused = true)]
async fn a_held_key_is_retried_by_the_policy_until_the_deadline() {
    let store = Scripted::new();
    let holder = locker(&store, config(60_000 * MS, Wait::none()));
    let _held = holder.acquire(holder.key("t", "k").unwrap()).await.unwrap();
    let waiter = locker(
        &store,
        config(
            60_000 * MS,
            Wait::constant(100 * MS).unwrap().deadline(1000 * MS),
        ),
    );
    let started = Instant::now();
    let error = waiter
        .acquire(waiter.key("t", "k").unwrap())
        .await
        .unwrap_err();
    let LockError::Contended {
        expires_in,
        waited,
        attempts,
        ..
    } = error
    else {
        panic!("{error:?}")
    };
    assert_eq!(waited, 1000 * MS, "gave up at the deadline");
    assert_eq!(started.elapsed(), 1000 * MS);
    // Attempts at 0, 100, ..., 1000 ms; the one at the deadline is the last.
    assert_eq!(attempts, 11);
    assert!(expires_in.unwrap() > 58_000 * MS, "{expires_in:?}");
    let times: Vec<_> = store
        .calls()
        .into_iter()
        .filter(|(_, c)| is_acquire(c))
        .skip(1)
        .map(|(at, _)| at - started)
        .collect();
    assert_eq!(times, (0..=10).map(|i| i * 100 * MS).collect::<Vec<_>>());
}

#[tokio::test(start_paused = true)]
async fn a_store_error_answers_at_once_and_releases_what_it_may_have_taken() {
    let store = Scripted::new();
    store.set_down(true);
    let locker = locker(&store, config(10_000 * MS, Wait::default()));
    let started = Instant::now();
    let error = locker
        .acquire(locker.key("t", "k").unwrap())
        .await
        .unwrap_err();
    assert!(matches!(error, LockError::Store(_)), "{error:?}");
    assert_eq!(
        started.elapsed(),
        Duration::ZERO,
        "waited out a store error"
    );
    // The attempt may have run after all: a token-checked release is spawned.
    tokio::task::yield_now().await;
    assert_eq!(store.count(is_release), 1);
}

#[tokio::test(start_paused = true)]
async fn renewals_are_due_every_third_of_the_ttl_from_when_they_were_sent() {
    let store = Scripted::new();
    let locker = locker(&store, config(3000 * MS, Wait::none()));
    let started = Instant::now();
    let guard = locker.acquire(locker.key("t", "k").unwrap()).await.unwrap();
    sleep(3500 * MS).await;
    let renewals: Vec<_> = store
        .calls()
        .into_iter()
        .filter(|(_, c)| is_renew(c))
        .map(|(at, _)| at - started)
        .collect();
    assert_eq!(renewals.len(), 3, "{renewals:?}");
    // Each due a third of the TTL after the last was sent, moved at most one tick (8 ms) earlier
    // onto the grid that lets leases falling due together renew in one call.
    let mut sent = Duration::ZERO;
    for (i, at) in renewals.iter().enumerate() {
        let due = sent + 1000 * MS;
        assert!(
            *at <= due && *at + 8 * MS >= due,
            "renewal {i} at {at:?}, due {due:?}"
        );
        sent = *at;
    }
    assert_eq!(guard.renewals(), 3);
    assert!(guard.time_left() > 2000 * MS);
    guard.release().await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_failing_store_is_retried_until_the_lease_expires_then_it_is_lost() {
    let store = Scripted::new();
    let locker = locker(&store, config(3000 * MS, Wait::none()));
    let started = Instant::now();
    let guard = locker.acquire(locker.key("t", "k").unwrap()).await.unwrap();
    store.set_down(true);
    let reason = guard.lost().await;
    assert_eq!(reason, LostReason::Expired);
    let lost_after = started.elapsed();
    assert!(
        lost_after >= 3000 * MS && lost_after <= 3100 * MS,
        "lost at {lost_after:?}"
    );
    // Retried every quarter interval (250 ms) after the first failure at 1 s.
    let tries = store.count(is_renew);
    assert!((8..=10).contains(&tries), "{tries} renewal attempts");
    drop(guard);
}

#[tokio::test(start_paused = true)]
async fn a_lease_the_store_no_longer_holds_is_lost_at_the_next_renewal() {
    let store = Scripted::new();
    let locker = locker(&store, config(3000 * MS, Wait::none()));
    let started = Instant::now();
    let guard = locker.acquire(locker.key("t", "k").unwrap()).await.unwrap();
    store.set_forget(true);
    assert_eq!(guard.lost().await, LostReason::NotHeld);
    let at = started.elapsed();
    assert!(at >= 992 * MS && at <= 1003 * MS, "lost at {at:?}");
    assert!(guard.is_lost());
    assert_eq!(guard.time_left(), Duration::ZERO);
}

/// A release that finds the lease gone is an error the caller sees, not an `Ok(false)` that a
/// `?` passes over: with the reason the lease was lost for.
#[tokio::test(start_paused = true)]
async fn a_release_that_finds_the_lease_gone_is_an_error() {
    let store = Scripted::new();
    let locker = locker(&store, config(300 * MS, Wait::none()));
    // Deleted behind its holder.
    let guard = locker.acquire(locker.key("t", "a").unwrap()).await.unwrap();
    store.set_forget(true);
    assert_eq!(guard.lost().await, LostReason::NotHeld);
    store.set_forget(false);
    assert!(matches!(
        guard.release().await,
        Err(LockError::LeaseLost(LostReason::NotHeld))
    ));
    // Expired while the store could not be reached to renew it.
    let guard = locker.acquire(locker.key("t", "b").unwrap()).await.unwrap();
    store.set_down(true);
    assert_eq!(guard.lost().await, LostReason::Expired);
    store.set_down(false);
    assert!(matches!(
        guard.release().await,
        Err(LockError::LeaseLost(LostReason::Expired))
    ));
    // Held to the end: released.
    let guard = locker.acquire(locker.key("t", "c").unwrap()).await.unwrap();
    sleep(1000 * MS).await;
    guard.release().await.unwrap();
    assert_eq!(store.inner.held(), 0);
}

#[tokio::test(start_paused = true)]
async fn a_released_background_lease_stops_renewing() {
    let store = Scripted::new();
    let locker = locker(&store, config(3000 * MS, Wait::none()));
    let guard = locker.acquire(locker.key("t", "k").unwrap()).await.unwrap();
    sleep(1500 * MS).await;
    assert_eq!(store.count(is_renew), 1);
    guard.release().await.unwrap();
    sleep(10_000 * MS).await;
    assert_eq!(store.count(is_renew), 1, "renewed after its release");
    // A dropped guard too, with its release spawned.
    let guard = locker.acquire(locker.key("t", "k").unwrap()).await.unwrap();
    drop(guard);
    tokio::task::yield_now().await;
    assert_eq!(store.count(is_release), 2);
    sleep(10_000 * MS).await;
    assert_eq!(store.count(is_renew), 1, "a dropped lease renewed");
    assert_eq!(store.inner.held(), 0);
}

#[tokio::test(start_paused = true)]
async fn many_background_leases_share_one_task() {
    let store = Scripted::new();
    let locker = locker(&store, config(3000 * MS, Wait::none()));
    let before = tokio::runtime::Handle::current()
        .metrics()
        .num_alive_tasks();
    let mut guards = Vec::new();
    for i in 0..100 {
        guards.push(
            locker
                .acquire(locker.key("t", i.to_string()).unwrap())
                .await
                .unwrap(),
        );
    }
    let during = tokio::runtime::Handle::current()
        .metrics()
        .num_alive_tasks();
    // The background renewal task and the renewal batcher, whatever the number of leases.
    assert!(
        during - before <= 2,
        "{} tasks for 100 leases",
        during - before
    );
    sleep(3500 * MS).await;
    assert!(guards.iter().all(|g| !g.is_lost() && g.renewals() == 3));
}

#[tokio::test(start_paused = true)]
async fn the_local_queue_sends_one_contender_per_key_in_arrival_order() {
    let store = Scripted::new();
    let locker = locker(
        &store,
        config(
            10_000 * MS,
            Wait::constant(10 * MS).unwrap().deadline(60_000 * MS),
        ),
    );
    let order = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for i in 0..5 {
        let (locker, order) = (locker.clone(), order.clone());
        tasks.push(tokio::spawn(async move {
            let guard = locker.acquire(locker.key("t", "k").unwrap()).await.unwrap();
            order.lock().unwrap().push(i);
            sleep(100 * MS).await;
            guard.release().await.unwrap();
        }));
        tokio::task::yield_now().await;
    }
    for task in tasks {
        task.await.unwrap();
    }
    assert_eq!(*order.lock().unwrap(), [0, 1, 2, 3, 4]);
    // Each waiter went to the store once, when its turn came: no polling in the store.
    assert_eq!(store.count(is_acquire), 5);
}

#[tokio::test(start_paused = true)]
async fn a_waiter_that_gives_up_in_the_local_queue_hears_the_holders_lease() {
    let store = Scripted::new();
    let locker = locker(&store, config(10_000 * MS, Wait::none()));
    let held = locker.acquire(locker.key("t", "k").unwrap()).await.unwrap();
    advance(3000 * MS).await;
    let error = locker
        .acquire(locker.key("t", "k").unwrap())
        .await
        .unwrap_err();
    let LockError::Contended {
        expires_in,
        attempts,
        ..
    } = error
    else {
        panic!("{error:?}")
    };
    assert_eq!(attempts, 0, "asked the store");
    assert_eq!(expires_in, Some(held.time_left()));
    assert_eq!(store.count(is_acquire), 1);
}

#[tokio::test(start_paused = true)]
async fn a_request_hold_is_lost_at_its_max_hold() {
    let store = Scripted::new();
    let locker = locker(&store, config(3000 * MS, Wait::none()));
    let started = Instant::now();
    let mut hold = locker
        .hold(
            locker.key("t", "k").unwrap().into(),
            Span::none(),
            locker.terms(Some(2500 * MS)),
        )
        .await
        .unwrap();
    let reason = std::future::poll_fn(|cx| hold.poll_lost(cx)).await;
    assert_eq!(reason, LostReason::MaxHold);
    assert_eq!(started.elapsed(), 2500 * MS);
    // Still ours: released before the holder answers.
    let release = hold.abort(reason).expect("a max-hold loss releases first");
    assert!(release.await.unwrap());
    assert_eq!(store.inner.held(), 0);
}

// ---- Sets of keys, and the locker's calls. ----

fn keys(locker: &Locker, values: &[&str]) -> crate::key::KeySet {
    values.iter().map(|v| locker.key("t", v).unwrap()).collect()
}

#[tokio::test(start_paused = true)]
async fn a_set_on_a_plain_store_goes_key_by_key_and_gives_back_what_it_took() {
    // `Scripted` has no key sets of its own: the engine's default, in lock order.
    let store = Scripted::new();
    let holder = locker(&store, config(60_000 * MS, Wait::none()));
    let set = keys(&holder, &["a", "b", "c"]);
    let middle = set.as_slice()[1].clone();
    let held = holder.acquire(middle.clone()).await.unwrap();
    let waiter = locker(&store, config(60_000 * MS, Wait::none()));
    let before = store.count(is_acquire);
    let error = waiter.acquire(set.clone()).await.unwrap_err();
    assert!(matches!(error, LockError::Contended { .. }), "{error:?}");
    // The first key was taken, the second refused, the first given back; the third never tried.
    assert_eq!(store.count(is_acquire) - before, 2);
    assert_eq!(store.inner.held(), 1, "a key of the set stayed taken");
    held.release().await.unwrap();

    let guard = waiter.acquire(set.clone()).await.unwrap();
    assert_eq!(guard.keys(), &set);
    let tokens: Vec<u64> = guard.fencing_tokens().map(|(_, t)| t).collect();
    assert_eq!(tokens.len(), 3);
    assert!(tokens.iter().all(|t| *t > 0));
    assert_eq!(guard.fencing_token(), tokens[0]);
    assert_eq!(guard.fencing_token_of(&middle), Some(tokens[1]));
    assert_eq!(store.inner.held(), 3);
    // Renewed together: every key, every interval.
    let renewals = store.count(is_renew);
    // (The renewals of one round go out together, after the batcher's few milliseconds.)
    sleep(20_010 * MS).await;
    assert_eq!(store.count(is_renew) - renewals, 3);
    assert!(!guard.is_lost());
    guard.release().await.unwrap();
    assert_eq!(store.inner.held(), 0);
}

#[tokio::test(start_paused = true)]
async fn a_set_is_lost_when_any_of_its_keys_is_and_released_whole_on_drop() {
    let store = Scripted::new();
    let locker = locker(&store, config(3000 * MS, Wait::none()));
    let guard = locker.acquire(keys(&locker, &["a", "b"])).await.unwrap();
    store.set_forget(true);
    let reason = tokio::time::timeout(2000 * MS, guard.lost()).await.unwrap();
    assert_eq!(reason, LostReason::NotHeld);
    store.set_forget(false);
    let guard = locker.acquire(keys(&locker, &["c", "d"])).await.unwrap();
    drop(guard);
    sleep(MS).await;
    assert_eq!(store.inner.held(), 0, "a dropped set left keys behind");
}

#[tokio::test(start_paused = true)]
async fn an_empty_set_or_one_above_max_keys_is_refused_before_the_store_is_asked() {
    let store = Scripted::new();
    let config = LockConfig::builder().max_keys(2).build().unwrap();
    let locker = locker(&store, config);
    let error = locker
        .acquire(crate::key::KeySet::new([]))
        .await
        .unwrap_err();
    assert!(
        matches!(&error, LockError::Key(r) if r.is_client_error()),
        "{error:?}"
    );
    let error = locker
        .acquire(keys(&locker, &["a", "b", "c"]))
        .await
        .unwrap_err();
    assert!(
        matches!(&error, LockError::Key(r) if r.detail().contains("at most 2")),
        "{error:?}"
    );
    assert_eq!(store.calls().len(), 0);
}

#[tokio::test(start_paused = true)]
async fn try_acquire_does_not_wait() {
    let store = Scripted::new();
    let patient = config(
        60_000 * MS,
        Wait::constant(10 * MS).unwrap().deadline(60_000 * MS),
    );
    let holder = locker(&store, patient.clone());
    let held = holder.acquire(holder.key("t", "k").unwrap()).await.unwrap();
    let other = locker(&store, patient);
    let started = Instant::now();
    let both = keys(&other, &["k", "free"]);
    assert!(other.try_acquire(both.clone()).await.unwrap().is_none());
    assert_eq!(started.elapsed(), Duration::ZERO, "it waited");
    assert_eq!(
        store.inner.held(),
        1,
        "the free key of the set stayed taken"
    );
    held.release().await.unwrap();
    let guard = other.try_acquire(both).await.unwrap().expect("free now");
    assert_eq!(guard.keys().len(), 2);
}

#[tokio::test(start_paused = true)]
async fn a_call_sets_its_own_wait_ttl_and_max_hold() {
    let store = Scripted::new();
    // The locker: a 60 s lease, no waiting.
    let locker = locker(&store, config(60_000 * MS, Wait::none()));
    let held = locker.acquire(locker.key("t", "k").unwrap()).await.unwrap();
    tokio::spawn(async move {
        sleep(500 * MS).await;
        drop(held);
    });
    // This call waits (up to 2 s), for a 300 ms lease held at most 1 s.
    let started = Instant::now();
    let guard = locker
        .acquire(locker.key("t", "k").unwrap())
        .wait(Wait::constant(50 * MS).unwrap().deadline(2000 * MS))
        .ttl(300 * MS)
        .unwrap()
        .max_hold(1000 * MS)
        .unwrap()
        .await
        .unwrap();
    let acquired = started.elapsed();
    assert!(acquired >= 500 * MS && acquired < 600 * MS, "{acquired:?}");
    assert!(guard.time_left() <= 300 * MS, "{:?}", guard.time_left());
    let renewals = store.count(is_renew);
    sleep(350 * MS).await;
    // Renewed every 100 ms (a third of its own TTL), not every 20 s.
    assert!(store.count(is_renew) - renewals >= 3);
    let reason = guard.lost().await;
    assert_eq!(reason, LostReason::MaxHold);
    assert_eq!(started.elapsed() - acquired, 1000 * MS);
}

#[tokio::test(start_paused = true)]
async fn run_returns_the_work_and_releases() {
    let store = Scripted::new();
    let locker = locker(&store, config(3000 * MS, Wait::none()));
    let set = keys(&locker, &["a", "b"]);
    let answer = locker
        .run(set.clone(), async {
            sleep(10_000 * MS).await;
            7
        })
        .await
        .unwrap();
    assert_eq!(answer, 7);
    // Renewed while the work ran, released at its end.
    assert!(store.count(is_renew) >= 2 * 3);
    assert_eq!(store.inner.held(), 0);
    // Contended: the work never runs.
    let held = locker.acquire(set.as_slice()[0].clone()).await.unwrap();
    let ran = std::sync::atomic::AtomicBool::new(false);
    let error = locker
        .run(set, async {
            ran.store(true, std::sync::atomic::Ordering::SeqCst)
        })
        .await
        .unwrap_err();
    assert!(matches!(error, LockError::Contended { .. }), "{error:?}");
    assert!(!ran.load(std::sync::atomic::Ordering::SeqCst));
    drop(held);
}

#[tokio::test(start_paused = true)]
async fn run_cancels_its_work_when_the_lease_is_lost() {
    struct Flag(std::sync::Arc<std::sync::atomic::AtomicBool>);
    impl Drop for Flag {
        fn drop(&mut self) {
            self.0.store(true, std::sync::atomic::Ordering::SeqCst);
        }
    }
    let store = Scripted::new();
    let locker = locker(&store, config(3000 * MS, Wait::none()));
    let dropped = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = Flag(std::sync::Arc::clone(&dropped));
    store.set_forget(true);
    let started = Instant::now();
    let error = locker
        .run(locker.key("t", "k").unwrap(), async move {
            let _flag = flag;
            sleep(60_000 * MS).await;
        })
        .await
        .unwrap_err();
    assert!(
        matches!(error, LockError::LeaseLost(LostReason::NotHeld)),
        "{error:?}"
    );
    // At the first renewal (a third of the TTL, up to one renewal tick, 8 ms, earlier),
    // whatever the config's loss policy.
    assert!(started.elapsed() >= 992 * MS && started.elapsed() < 1100 * MS);
    assert!(
        dropped.load(std::sync::atomic::Ordering::SeqCst),
        "the work ran on"
    );

    // At its max hold: the work is cancelled, and the keys released before the answer.
    store.set_forget(false);
    let error = locker
        .acquire(keys(&locker, &["a", "b"]))
        .max_hold(1500 * MS)
        .unwrap()
        .run(sleep(60_000 * MS))
        .await
        .unwrap_err();
    assert!(
        matches!(error, LockError::LeaseLost(LostReason::MaxHold)),
        "{error:?}"
    );
    assert_eq!(store.inner.held(), 0);
}

/// A store scripted by hand, for the locker's side of a hand-off: the first attempt queues, the
/// second fails, the third acquires; the first token's watch holds a stale hand-off.
#[derive(Clone, Default)]
struct Queueing {
    enqueued: Arc<Mutex<Vec<Vec<u8>>>>,
    released: Arc<Mutex<Vec<Vec<u8>>>>,
}

/// The scripted watch's signals.
struct Signals(mpsc::UnboundedReceiver<Signal>);

impl QueueSignals for Signals {
    fn poll_signal(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Signal> {
        match self.0.poll_recv(cx) {
            Poll::Ready(Some(signal)) => Poll::Ready(signal),
            _ => Poll::Pending,
        }
    }
}

impl LockStore for Queueing {
    async fn acquire(
        &self,
        _key: &LockKey,
        _token: &Token,
        _ttl: Duration,
    ) -> Result<Acquire, StoreError> {
        unreachable!("a waiting locker enqueues")
    }

    async fn renew(
        &self,
        _key: &LockKey,
        _token: &Token,
        _ttl: Duration,
    ) -> Result<bool, StoreError> {
        Ok(true)
    }

    async fn release(&self, _key: &LockKey, token: &Token) -> Result<bool, StoreError> {
        self.released
            .lock()
            .unwrap()
            .push(token.as_bytes().to_vec());
        Ok(false)
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            hand_off: Some(Arc::new(self.clone())),
            ..Capabilities::none()
        }
    }
}

impl HandOff for Queueing {
    fn enqueue(
        self: Arc<Self>,
        _key: LockKey,
        token: Token,
        _ttl: Duration,
    ) -> BoxFuture<Result<Attempt, StoreError>> {
        let mut enqueued = self.enqueued.lock().unwrap();
        enqueued.push(token.as_bytes().to_vec());
        let answer = match enqueued.len() {
            1 => Ok(Attempt::Queued {
                expires_in: Some(5000 * MS),
                since: Epoch::default(),
            }),
            2 => Err(StoreError::msg(StoreErrorKind::Unavailable, "down")),
            _ => Ok(Attempt::Acquired { fencing_token: 42 }),
        };
        Box::pin(std::future::ready(answer))
    }

    fn queue_watch(&self, _key: &LockKey, _token: &Token, _since: Epoch) -> Option<QueueWatch> {
        let (tx, rx) = mpsc::unbounded_channel();
        // Check again now (the second attempt fails), then: a hand-off that the release sent
        // after that failure has already passed on.
        tx.send(Signal::Retry).unwrap();
        tx.send(Signal::Granted {
            fencing_token: 9,
            valid_until: Instant::now() + 10_000 * MS,
        })
        .unwrap();
        Some(QueueWatch::new(Signals(rx)))
    }
}

/// After a store error while queued (waiting forever), the waiter's release leaves the queue or
/// passes on a key handed to it meanwhile; the waiter goes on with a fresh token, so a stale
/// hand-off message for the old token is never taken for its own (two holders at once).
#[tokio::test(start_paused = true)]
async fn after_a_store_error_a_stale_handoff_is_not_taken() {
    let store = Queueing::default();
    let locker = Locker::with_config(
        store.clone(),
        LockConfig::builder()
            .wait(Wait::constant(10 * MS).unwrap().forever())
            .build()
            .unwrap(),
    );
    let guard = locker
        .acquire(locker.key("handoff", "scripted").unwrap())
        .await
        .unwrap();
    assert_eq!(guard.fencing_token(), 42, "took the stale hand-off");
    let enqueued = store.enqueued.lock().unwrap().clone();
    assert_eq!(enqueued.len(), 3);
    assert_eq!(enqueued[0], enqueued[1]);
    assert_ne!(enqueued[1], enqueued[2], "went on with the old token");
    // The failed attempt's token was released (leaving the queue).
    let started = Instant::now();
    while !store.released.lock().unwrap().contains(&enqueued[0]) {
        assert!(started.elapsed() < 2000 * MS, "never released");
        sleep(5 * MS).await;
    }
    // The scripted store keeps no lease: its release answers "not held".
    assert!(matches!(
        guard.release().await,
        Err(LockError::LeaseLost(LostReason::NotHeld))
    ));
}

/// A release that fails answers at once, and is sent again in a spawned task, 50 ms after the
/// first send and then twice as long each time up to 500 ms, for as long as the lease is
/// valid: it frees the key once the store answers again. One that fails until the lease's end
/// is given up then (the key expires).
#[tokio::test(start_paused = true)]
async fn a_failed_release_is_sent_again_while_the_lease_is_valid() {
    let store = Scripted::new();
    let locker = locker(&store, config(2_000 * MS, Wait::none()));
    let k = locker.key("t", "k").unwrap();
    let guard = locker.acquire(k.clone()).await.unwrap();
    store.set_down(true);
    let started = Instant::now();
    assert!(matches!(guard.release().await, Err(LockError::Store(_))));
    assert_eq!(started.elapsed(), Duration::ZERO, "the caller waited");
    tokio::time::sleep(300 * MS).await;
    store.set_down(false);
    tokio::time::sleep(100 * MS).await;
    // Sent at 0, 50, 150 and 350 ms: the last answered.
    assert_eq!(store.count(is_release), 4);
    let free = locker.try_acquire(k.clone()).await.unwrap();
    free.expect("not freed").release().await.unwrap();

    let before = store.count(is_release);
    let guard = locker.acquire(k.clone()).await.unwrap();
    store.set_down(true);
    assert!(matches!(guard.release().await, Err(LockError::Store(_))));
    tokio::time::sleep(5_000 * MS).await;
    // 0, 50, 150, 350, 750, 1250, 1750 ms: the next would come after the lease's end (2 s).
    assert_eq!(store.count(is_release) - before, 7);
}
