//! The group commit's shared call under a model checker: `src/store/redis/shared.rs`, compiled
//! here against loom's locks and atomics instead of std's, with every interleaving of its
//! callers, the caller polling it and the call's wake-up explored (loom's `model`). A caller
//! that returns `Pending` and is never woken again is a deadlock to loom, which fails the test.
//!
//! The stress tests of the same file (`src/store/redis/shared_tests.rs`) run it on real threads
//! with random timing; this one shows the interleavings they may miss cannot strand a caller,
//! and its negative control shows that the poller's wake-up of the callers it passed over is
//! what keeps them from being stranded.

use std::{
    future::poll_fn,
    sync::{Arc, MutexGuard, PoisonError},
    task::{Context, Poll, Waker},
};

use loom::sync::atomic::{AtomicBool, Ordering};

/// What `shared.rs` imports as its locks and atomics (std's in the crate).
mod sync {
    pub(super) use loom::sync::{
        Mutex, MutexGuard,
        atomic::{AtomicBool, fence},
    };
}

#[path = "../src/store/redis/shared.rs"]
#[allow(dead_code)]
mod shared;

use shared::SharedCall;

/// Every interleaving with at most `preemptions` threads switched away from while they could
/// have gone on (loom's bound; unbounded, the space grows past what a suite can wait for). Two
/// preemptions find the strand of the negative control; three are checked here.
fn model(preemptions: usize, f: impl Fn() + Sync + Send + 'static) {
    let mut builder = loom::model::Builder::new();
    builder.preemption_bound = Some(preemptions);
    builder.check(f);
}

/// The negative control flips a flag of `shared.rs` that every test reads: one test at a time.
fn one_at_a_time() -> MutexGuard<'static, ()> {
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());
    SERIAL.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The reply a call waits for: set by another thread, which then wakes the call (as the
/// connection's reader does).
#[derive(Clone, Default)]
struct Reply {
    arrived: Arc<AtomicBool>,
    waker: Arc<loom::sync::Mutex<Option<Waker>>>,
}

impl Reply {
    /// A call that ends with 7 once the reply has arrived (0 is what a panicked call reads).
    fn call(&self) -> SharedCall<u32> {
        let reply = self.clone();
        SharedCall::new(poll_fn(move |cx| {
            // The waker first, then the check: a reply that arrives in between wakes it.
            *reply.waker.lock().unwrap() = Some(cx.waker().clone());
            if reply.arrived.load(Ordering::SeqCst) {
                Poll::Ready(7)
            } else {
                Poll::Pending
            }
        }))
    }

    /// On another thread: the reply arrives and wakes the call.
    fn arrive(&self) -> loom::thread::JoinHandle<()> {
        let reply = self.clone();
        loom::thread::spawn(move || {
            reply.arrived.store(true, Ordering::SeqCst);
            let waker = reply.waker.lock().unwrap().take();
            if let Some(waker) = waker {
                waker.wake();
            }
        })
    }
}

/// Waits for `call` to end, and reads what it ended with.
fn wait(mut call: SharedCall<u32>) -> u32 {
    loom::future::block_on(poll_fn(|cx| call.poll_end(cx)));
    *call.answers().expect("ended")
}

/// Caller A polls the call once (the reply may arrive during that poll) and is never polled
/// again; caller B waits for the end. B must be woken whatever the interleaving: by the call's
/// wake-up if it registered before it, else by A once A's poll ends.
fn a_caller_passed_over_then_the_poller_leaves() {
    let reply = Reply::default();
    let call = reply.call();
    let mut a = call.clone();
    let a = loom::thread::spawn(move || {
        let _ = a.poll_end(&mut Context::from_waker(Waker::noop()));
        // Gone: a caller whose request was cancelled.
    });
    let arrived = reply.arrive();
    assert_eq!(wait(call), 7);
    a.join().unwrap();
    arrived.join().unwrap();
}

#[test]
fn a_caller_passed_over_is_woken_when_the_poll_ends() {
    let _serial = one_at_a_time();
    model(3, a_caller_passed_over_then_the_poller_leaves);
}

/// Two callers on two threads wait for the end of one call whose reply arrives on a third:
/// both end, with the same answer, in every interleaving.
#[test]
fn callers_on_two_threads_both_end() {
    let _serial = one_at_a_time();
    model(3, || {
        let reply = Reply::default();
        let call = reply.call();
        let other = call.clone();
        let other = loom::thread::spawn(move || wait(other));
        let arrived = reply.arrive();
        assert_eq!(wait(call), 7);
        assert_eq!(other.join().unwrap(), 7);
        arrived.join().unwrap();
    });
}

/// The negative control: with the poller's wake-up of the callers it passed over left out
/// (`shared::SKIP_PASSED_WAKE`), the model finds the interleaving that strands B.
#[test]
fn without_the_pollers_wake_up_a_caller_is_stranded() {
    let _serial = one_at_a_time();
    shared::SKIP_PASSED_WAKE.store(true, std::sync::atomic::Ordering::Relaxed);
    let found = std::panic::catch_unwind(|| model(3, a_caller_passed_over_then_the_poller_leaves));
    shared::SKIP_PASSED_WAKE.store(false, std::sync::atomic::Ordering::Relaxed);
    let message = found.expect_err(
        "the model found no stranded caller without the wake-up: it does not test what it claims",
    );
    let message = message
        .downcast_ref::<String>()
        .map(String::as_str)
        .or_else(|| message.downcast_ref::<&str>().copied())
        .unwrap_or_default();
    // Loom's words for a thread blocked forever with nothing left to wake it.
    assert!(message.contains("deadlock"), "another failure: {message}");
}
