//! [`SharedCall`](super::shared::SharedCall) under stress: callers on threads and runtimes, with
//! random timing. Its model check is `tests/shared_call_model.rs`.

use std::{
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    task::{Context, Poll, Wake, Waker},
};

use super::{
    shared::SharedCall,
    wire::{Answer, Answers},
};
use crate::store::StoreError;

async fn poll_once(call: &mut SharedCall<Answers>) -> Poll<()> {
    std::future::poll_fn(|cx| Poll::Ready(call.poll_end(cx))).await
}

fn answer(code: i64) -> Result<Answer, StoreError> {
    Ok(Answer {
        code,
        n: 0,
        acks: None,
    })
}

#[tokio::test]
async fn every_clone_gets_the_answers_of_one_run() {
    let runs = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&runs);
    let call = SharedCall::new(async move {
        counted.fetch_add(1, Ordering::SeqCst);
        tokio::task::yield_now().await;
        Answers::from_fn(3, |i| answer(i as i64))
    });
    let (mut a, mut b) = (call.clone(), call.clone());
    drop(call);
    let (_, _) = tokio::join!(&mut a, &mut b);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    for call in [&a, &b] {
        let codes: Vec<i64> = (0..3)
            .map(|i| call.answers().unwrap().get(i).as_ref().unwrap().code)
            .collect();
        assert_eq!(codes, [0, 1, 2]);
    }
    assert!(a.answers().unwrap().get(3).is_err(), "no fourth answer");
}

#[tokio::test]
async fn dropped_by_every_caller_it_is_abandoned() {
    struct Dropped(Arc<AtomicBool>);
    impl Drop for Dropped {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }
    let dropped = Arc::new(AtomicBool::new(false));
    let guard = Dropped(Arc::clone(&dropped));
    let mut call = SharedCall::new(async move {
        let _guard = guard;
        std::future::pending::<()>().await;
        Answers::every(1, answer(0))
    });
    let weak = call.downgrade();
    assert!(poll_once(&mut call).await.is_pending());
    let other = weak.upgrade().expect("alive while a caller has it");
    drop(call);
    assert!(!dropped.load(Ordering::SeqCst));
    drop(other);
    assert!(dropped.load(Ordering::SeqCst), "the call was dropped");
    assert!(weak.upgrade().is_none());
}

/// A caller that is never polled again does not hold up another: the call's wake-ups reach
/// every caller waiting, and the one polled drives it to its end.
#[tokio::test]
async fn a_caller_left_unpolled_holds_up_nobody() {
    let (send, receive) = tokio::sync::oneshot::channel::<()>();
    let mut first = SharedCall::new(async move {
        let _ = receive.await;
        Answers::every(1, answer(7))
    });
    let mut second = first.clone();
    assert!(poll_once(&mut first).await.is_pending());
    assert!(poll_once(&mut second).await.is_pending());
    send.send(()).unwrap();
    // `first` is never polled again.
    tokio::time::timeout(std::time::Duration::from_secs(5), &mut second)
        .await
        .expect("driven by the caller polled");
    assert_eq!(second.answers().unwrap().get(0).as_ref().unwrap().code, 7);
    drop(first);
}

/// Callers that wait through a fresh clone at every poll (as queued callers do) reuse the
/// slots of the clones they dropped: the list stays as long as the callers waiting at once.
#[tokio::test]
async fn waker_slots_are_reused() {
    let (send, receive) = tokio::sync::oneshot::channel::<()>();
    let call = SharedCall::new(async move {
        let _ = receive.await;
        Answers::every(1, answer(0))
    });
    for _ in 0..1000 {
        let mut clones: Vec<SharedCall<Answers>> = (0..5).map(|_| call.clone()).collect();
        for clone in &mut clones {
            assert!(poll_once(clone).await.is_pending());
        }
    }
    let slots = call.waker_slots();
    assert!(slots <= 5, "{slots} slots for 5 callers at once");
    send.send(()).unwrap();
    let mut call = call;
    (&mut call).await;
    assert!(call.answers().is_some());
}

/// Two threads polling the same call at once, many times over: each ends with the answers
/// (a caller passed over while the other polls is woken when that poll ends).
#[test]
fn callers_on_two_threads_all_end() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        for _ in 0..2000 {
            let call = SharedCall::new(async {
                for _ in 0..3 {
                    tokio::task::yield_now().await;
                }
                Answers::every(2, answer(1))
            });
            let tasks: Vec<_> = (0..4)
                .map(|_| {
                    let mut call = call.clone();
                    tokio::spawn(async move {
                        (&mut call).await;
                        call.answers().unwrap().get(1).as_ref().unwrap().code
                    })
                })
                .collect();
            drop(call);
            for task in tasks {
                let code = tokio::time::timeout(std::time::Duration::from_secs(5), task)
                    .await
                    .expect("every caller ends")
                    .unwrap();
                assert_eq!(code, 1);
            }
        }
    });
}

fn xorshift(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

struct Flag(AtomicBool);

impl Wake for Flag {
    fn wake(self: Arc<Self>) {
        self.0.store(true, Ordering::SeqCst);
    }
}

/// The race of a caller passed over with the poller's end: caller A polls a call that is
/// woken during that poll (a reply arriving then) and is never polled again; caller B
/// polls at a random moment around it, on another thread. Whenever B ends `Pending` with
/// the call due for a poll, B must have been woken. (Before the second try and the fences,
/// B was stranded in about 1 iteration in 10,000.)
#[test]
fn a_caller_passed_over_is_never_stranded() {
    const ITERATIONS: usize = 40_000;
    let barrier = Arc::new(std::sync::Barrier::new(2));
    let shared: Arc<Mutex<Option<SharedCall<Answers>>>> = Arc::new(Mutex::new(None));
    let a_thread = {
        let (barrier, shared) = (Arc::clone(&barrier), Arc::clone(&shared));
        std::thread::spawn(move || {
            let mut rng = 0x9e37_79b9_7f4a_7c15u64;
            for _ in 0..ITERATIONS {
                barrier.wait();
                let mut a = shared.lock().unwrap().take().unwrap();
                for _ in 0..(xorshift(&mut rng) % 64) {
                    std::hint::spin_loop();
                }
                let _ = a.poll_end(&mut Context::from_waker(Waker::noop()));
                barrier.wait();
                // Kept, never polled again, until B's check is done.
                barrier.wait();
                drop(a);
            }
        })
    };
    let mut rng = 0x2545_f491_4f6c_dd1du64;
    let mut stranded = 0;
    for _ in 0..ITERATIONS {
        // 0: not polled; 1: polled once and woken (a poll is due); 2: done.
        let state = Arc::new(AtomicUsize::new(0));
        let spin = xorshift(&mut rng) % 256;
        let inner = Arc::clone(&state);
        let call = SharedCall::new(std::future::poll_fn(move |cx| {
            if inner.load(Ordering::SeqCst) == 0 {
                inner.store(1, Ordering::SeqCst);
                cx.waker().wake_by_ref();
                for _ in 0..spin {
                    std::hint::spin_loop();
                }
                Poll::Pending
            } else {
                inner.store(2, Ordering::SeqCst);
                Poll::Ready(Answers::every(1, answer(1)))
            }
        }));
        *shared.lock().unwrap() = Some(call.clone());
        let mut b = call;
        barrier.wait();
        for _ in 0..(xorshift(&mut rng) % 96) {
            std::hint::spin_loop();
        }
        let flag = Arc::new(Flag(AtomicBool::new(false)));
        let waker = Waker::from(Arc::clone(&flag));
        let polled = b.poll_end(&mut Context::from_waker(&waker));
        barrier.wait();
        if polled.is_pending()
            && state.load(Ordering::SeqCst) == 1
            && !flag.0.load(Ordering::SeqCst)
        {
            stranded += 1;
        }
        barrier.wait();
        drop(b);
    }
    a_thread.join().unwrap();
    assert_eq!(stranded, 0, "callers left unwoken with the call due");
}

/// A call that panics while one caller polls it: that caller's task has the panic, and the
/// other callers are woken and answered with an error (not left waiting, not panicking).
#[tokio::test]
async fn a_call_that_panics_answers_its_other_callers() {
    let polls = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&polls);
    let call = SharedCall::new(std::future::poll_fn(move |_| {
        if counted.fetch_add(1, Ordering::SeqCst) == 0 {
            Poll::<Answers>::Pending
        } else {
            panic!("the call panics")
        }
    }));
    let mut b = call.clone();
    let mut a = call;
    let b_task = tokio::spawn(async move {
        (&mut b).await;
        b.answers().map(|answers| answers.get(0).is_err())
    });
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    let panicked = tokio::spawn(async move {
        let _ = poll_once(&mut a).await;
    })
    .await;
    assert!(panicked.is_err(), "the poller's task has the panic");
    let answered = tokio::time::timeout(std::time::Duration::from_secs(5), b_task)
        .await
        .expect("the other caller is woken")
        .expect("and does not panic");
    assert_eq!(answered, Some(true), "answered with an error");
}
