//! Tests of the parent module.

use super::*;
use std::time::Duration;

/// The store timeout the waiters are given.
const T: Duration = Duration::from_secs(1);

fn holder_left(gave_up: GaveUp) -> Option<Duration> {
    match gave_up {
        GaveUp::Held { holder_left } => holder_left,
        GaveUp::Unavailable(error) => panic!("an outage: {error}"),
    }
}

fn key(v: &str) -> LockKey {
    LockKey::new("p:", "s", v.as_bytes(), 64).unwrap()
}

#[tokio::test(start_paused = true)]
async fn first_come_first_served_and_cleaned_up() {
    let queues = Arc::new(LocalQueues::default());
    let first = queues.turn(&key("k"), None, T).await.unwrap();
    let order = Arc::new(Mutex::new(Vec::new()));
    let mut waiters = Vec::new();
    for i in 0..5 {
        let (queues, order) = (Arc::clone(&queues), Arc::clone(&order));
        waiters.push(tokio::spawn(async move {
            let _turn = queues.turn(&key("k"), None, T).await.unwrap();
            order.lock().unwrap().push(i);
            tokio::time::sleep(Duration::from_millis(1)).await;
        }));
        tokio::task::yield_now().await;
    }
    // A waiter that gives up leaves the queue without blocking the rest.
    let deadline = Instant::now() + Duration::from_millis(5);
    assert!(queues.turn(&key("k"), Some(deadline), T).await.is_err());
    assert!(queues.turn(&key("other"), Some(deadline), T).await.is_ok());
    drop(first);
    for waiter in waiters {
        waiter.await.unwrap();
    }
    assert_eq!(*order.lock().unwrap(), [0, 1, 2, 3, 4]);
    assert_eq!(queues.len(), 0, "entries left behind");
}

#[tokio::test]
async fn a_burst_of_keys_gives_its_memory_back() {
    let queues = Arc::new(LocalQueues::default());
    let mut turns = Vec::new();
    for i in 0..5000 {
        turns.push(queues.turn(&key(&i.to_string()), None, T).await.unwrap());
    }
    assert!(queues.capacity() >= 5000);
    drop(turns);
    assert_eq!(queues.len(), 0);
    assert!(
        queues.capacity() <= 2 * SHRINK_ABOVE,
        "kept {} entries' room",
        queues.capacity()
    );
}

#[tokio::test(start_paused = true)]
async fn a_waiter_dropped_while_queued_leaves_no_entry() {
    let queues = Arc::new(LocalQueues::default());
    let holder = queues.turn(&key("k"), None, T).await.unwrap();
    let waiter = tokio::spawn({
        let queues = Arc::clone(&queues);
        async move { queues.turn(&key("k"), None, T).await.map(drop) }
    });
    tokio::task::yield_now().await;
    waiter.abort();
    let _ = waiter.await;
    drop(holder);
    assert_eq!(queues.len(), 0, "the dropped waiter's entry stayed behind");
}

#[tokio::test(start_paused = true)]
async fn sets_take_their_turns_in_lock_order_and_never_wait_in_a_cycle() {
    let queues = Arc::new(LocalQueues::default());
    let (a, b, c) = (key("a"), key("b"), key("c"));
    let ab = KeySet::from([a.clone(), b.clone()]);
    let bc = KeySet::from([c.clone(), b.clone()]);
    let ba = KeySet::from([b.clone(), a.clone()]);
    // Many sets over overlapping keys, each named in its own order, and single keys: all
    // are served, however they interleave.
    let served = Arc::new(Mutex::new(0));
    let mut tasks = Vec::new();
    for i in 0..30 {
        let keys = [ab.clone(), bc.clone(), ba.clone(), KeySet::from(b.clone())][i % 4].clone();
        let (queues, served) = (Arc::clone(&queues), Arc::clone(&served));
        tasks.push(tokio::spawn(async move {
            let turns = queues.turns(&keys, None, T).await.unwrap();
            tokio::time::sleep(Duration::from_millis(1)).await;
            drop(turns);
            *served.lock().unwrap() += 1;
        }));
    }
    for task in tasks {
        tokio::time::timeout(Duration::from_secs(60), task)
            .await
            .expect("a cycle of waits")
            .unwrap();
    }
    assert_eq!(*served.lock().unwrap(), 30);
    assert_eq!(queues.len(), 0, "entries left behind");

    // A set waiting behind a holder of one key keeps its place there: single-key
    // requests that come after it wait behind it.
    let holder = queues.turn(&b, None, T).await.unwrap();
    let order = Arc::new(Mutex::new(Vec::new()));
    let set = tokio::spawn({
        let (queues, order, ab) = (Arc::clone(&queues), Arc::clone(&order), ab.clone());
        async move {
            let _turns = queues.turns(&ab, None, T).await.unwrap();
            order.lock().unwrap().push("set");
        }
    });
    tokio::task::yield_now().await;
    let single = tokio::spawn({
        let (queues, order, b) = (Arc::clone(&queues), Arc::clone(&order), b.clone());
        async move {
            let _turn = queues.turn(&b, None, T).await.unwrap();
            order.lock().unwrap().push("single");
        }
    });
    tokio::task::yield_now().await;
    drop(holder);
    set.await.unwrap();
    single.await.unwrap();
    assert_eq!(*order.lock().unwrap(), ["set", "single"]);

    // A set that gives up passes on the turns it had.
    let holder = queues.turn(&b, None, T).await.unwrap();
    let soon = Some(Instant::now() + Duration::from_millis(5));
    let gave_up = queues.turns(&ab, soon, T).await;
    assert!(gave_up.is_err());
    assert!(
        queues.turn(&a, soon, T).await.is_ok(),
        "the set kept its turn at a"
    );
    drop(holder);
    assert_eq!(queues.len(), 0, "entries left behind");
}

#[tokio::test(start_paused = true)]
async fn a_waiter_that_gives_up_hears_the_holders_time_left() {
    let queues = Arc::new(LocalQueues::default());
    let soon = || Some(Instant::now() + Duration::from_millis(5));
    let head = queues.turn(&key("k"), None, T).await.unwrap();
    // The head has not heard from the store yet.
    let gave_up = queues.turn(&key("k"), soon(), T).await.unwrap_err();
    assert_eq!(holder_left(gave_up), None);
    // The store told the head that another process holds the key for 4 s more.
    head.held_elsewhere(Some(Duration::from_secs(4)));
    tokio::time::advance(Duration::from_secs(1)).await;
    let gave_up = queues.turn(&key("k"), soon(), T).await.unwrap_err();
    assert_eq!(
        holder_left(gave_up),
        Some(Duration::from_secs(3) - Duration::from_millis(5))
    );
    // An answer without a TTL keeps what the head knew.
    head.held_elsewhere(None);
    let gave_up = queues.turn(&key("k"), soon(), T).await.unwrap_err();
    assert!(holder_left(gave_up).is_some());
    // The head acquired: its own lease, renewals included.
    let lease = Lease::new(key("k"), 1, Instant::now(), Duration::from_secs(10));
    head.acquired(&lease);
    tokio::time::advance(Duration::from_secs(2)).await;
    lease.renewed(Instant::now(), Duration::from_secs(10));
    let gave_up = queues.turn(&key("k"), soon(), T).await.unwrap_err();
    assert_eq!(
        holder_left(gave_up),
        Some(Duration::from_secs(10) - Duration::from_millis(5))
    );
    // The next head starts from nothing.
    drop(head);
    let next = queues.turn(&key("k"), None, T).await.unwrap();
    let gave_up = queues.turn(&key("k"), soon(), T).await.unwrap_err();
    assert_eq!(holder_left(gave_up), None);
    drop(next);
    assert_eq!(queues.len(), 0, "entries left behind");
}

/// A waiter whose deadline passes while the head's call to the store is on its way waits
/// for its answer: a failure (or no answer within the store timeout) is what it gives up
/// with (503), not contention; an answer that the key is held, contention (409). A failure
/// stands for the next head's waiters until that head asks the store itself.
#[tokio::test(start_paused = true)]
async fn a_waiter_behind_a_failing_head_gives_up_with_the_failure() {
    let queues = Arc::new(LocalQueues::default());
    let soon = || Some(Instant::now() + Duration::from_millis(5));
    let head = queues.turn(&key("k"), None, T).await.unwrap();
    // The head asks; the store fails it 300 ms later.
    head.asking();
    let started = Instant::now();
    let waiter = tokio::spawn({
        let queues = Arc::clone(&queues);
        async move { queues.turn(&key("k"), soon(), T).await.map(drop) }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let down = StoreError::msg(crate::store::StoreErrorKind::Unavailable, "down");
    head.failed(&down);
    let Err(GaveUp::Unavailable(error)) = waiter.await.unwrap() else {
        panic!("gave up as if the key were held")
    };
    assert_eq!(error.to_string(), "down");
    assert_eq!(started.elapsed(), Duration::from_millis(300));
    // The failure stands for the next head's waiters, until it asks.
    let next = tokio::spawn({
        let queues = Arc::clone(&queues);
        async move { queues.turn(&key("k"), None, T).await.unwrap() }
    });
    tokio::task::yield_now().await;
    drop(head);
    let next = next.await.unwrap();
    let gave_up = queues.turn(&key("k"), soon(), T).await.unwrap_err();
    assert!(matches!(gave_up, GaveUp::Unavailable(_)), "{gave_up:?}");
    // It asks, and hears nothing: a waiter gives up at the store timeout.
    next.asking();
    let started = Instant::now();
    let gave_up = queues.turn(&key("k"), soon(), T).await.unwrap_err();
    assert_eq!(started.elapsed(), T);
    let GaveUp::Unavailable(error) = gave_up else {
        panic!("gave up as if the key were held")
    };
    assert_eq!(error.kind(), crate::store::StoreErrorKind::Timeout);
    // It asks again and hears that the key is held: contention.
    next.asking();
    next.held_elsewhere(Some(Duration::from_secs(4)));
    let gave_up = queues.turn(&key("k"), soon(), T).await.unwrap_err();
    assert!(holder_left(gave_up).is_some());
    drop(next);
    assert_eq!(queues.len(), 0, "entries left behind");
}

/// A set holds its turn at its first key while it waits in this process for its second,
/// behind a head whose call to the store is on its way: a waiter at the first key that
/// gives up answers as one at the second would. A store that does not answer: 503, not
/// contention; a holder elsewhere: its time left. Before, it heard nothing from the set and
/// answered as if the key were held (409 with the TTL).
#[tokio::test(start_paused = true)]
async fn a_waiter_behind_a_set_waiting_behind_a_failing_head_gives_up_with_the_failure() {
    let queues = Arc::new(LocalQueues::default());
    let soon = || Some(Instant::now() + Duration::from_millis(5));
    let set = KeySet::from([key("a"), key("b")]);
    let mut order = set.iter().cloned();
    let (first, second) = (order.next().unwrap(), order.next().unwrap());
    let head = queues.turn(&second, None, T).await.unwrap();
    head.asking();
    let started = Instant::now();
    let waiting = tokio::spawn({
        let queues = Arc::clone(&queues);
        async move { queues.turns(&set, None, T).await.unwrap() }
    });
    tokio::task::yield_now().await;
    // The store does not answer the head: the waiter gives up at its timeout.
    let gave_up = queues.turn(&first, soon(), T).await.unwrap_err();
    let GaveUp::Unavailable(error) = gave_up else {
        panic!("gave up as if the key were held: {gave_up:?}")
    };
    assert_eq!(error.kind(), crate::store::StoreErrorKind::Timeout);
    assert_eq!(started.elapsed(), T);
    // The head's call times out, and it asks again; the store fails that call 300 ms after
    // it was sent: the waiter hears it then.
    head.failed(&StoreError::timeout(T));
    head.asking();
    let started = Instant::now();
    let waiter = tokio::spawn({
        let queues = Arc::clone(&queues);
        let first = first.clone();
        async move { queues.turn(&first, soon(), T).await.map(drop) }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let down = StoreError::msg(crate::store::StoreErrorKind::Unavailable, "down");
    head.failed(&down);
    let Err(GaveUp::Unavailable(error)) = waiter.await.unwrap() else {
        panic!("gave up as if the key were held")
    };
    assert_eq!(error.to_string(), "down");
    assert_eq!(started.elapsed(), Duration::from_millis(300));
    // The store answers that another process holds the second key: contention, with its
    // time left.
    head.asking();
    head.held_elsewhere(Some(Duration::from_secs(4)));
    let gave_up = queues.turn(&first, soon(), T).await.unwrap_err();
    assert_eq!(
        holder_left(gave_up),
        Some(Duration::from_secs(4) - Duration::from_millis(5))
    );
    // The set gets its turn at the second key too, asks, and hears it is held.
    drop(head);
    let turns = waiting.await.unwrap();
    turns.asking();
    turns.held_elsewhere(1, Some(Duration::from_secs(2)));
    let gave_up = queues.turn(&second, soon(), T).await.unwrap_err();
    assert!(holder_left(gave_up).is_some());
    drop(turns);
    assert_eq!(queues.len(), 0, "entries left behind");
}
