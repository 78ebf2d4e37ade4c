//! [`SharedCall`]: one call to Redis in flight, driven by whichever of the callers that wait for
//! it is polled, and its [`Answers`], one per operation, read by each of them.
//!
//! What `futures::future::Shared` does for group commit, in three allocations per call rather
//! than five: the answers are kept in the call's cell (a lone operation's inline, no list), and
//! the wakers of the first two callers to wait are too (a lone call has one or two: its caller,
//! and a release that waits for the acquire it carries). Two things more: a caller that finds
//! the call being polled by another returns `Pending`, and a wake-up that reached the call while
//! that other polled it went only to the callers waiting then; so the one polling wakes the
//! callers passed over meanwhile once its poll ends, and no caller depends on another's being
//! polled again (see [`SharedCall::poll_end`]). And a call that panics while polled wakes its
//! other callers, which are answered with an error.

use std::{
    future::Future,
    pin::Pin,
    sync::{
        Arc, Mutex, MutexGuard, OnceLock, PoisonError, TryLockError, Weak,
        atomic::{AtomicBool, Ordering, fence},
    },
    task::{Context, Poll, Wake, Waker},
};

use super::wire::Answer;
use crate::store::StoreError;

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

type Call = Pin<Box<dyn Future<Output = Answers> + Send>>;

/// A call in flight, shared: every clone drives it when polled, and completes with it.
pub(super) struct SharedCall {
    cell: Arc<Cell>,
    /// This clone's waker slot, once it has waited.
    slot: Option<usize>,
}

/// A [`SharedCall`] that does not keep it alive: a call whose callers all left is dropped.
#[derive(Clone)]
pub(super) struct WeakCall(Weak<Cell>);

struct Cell {
    /// The call, until it is answered; locked by whoever polls it.
    call: Mutex<Option<Call>>,
    answers: OnceLock<Answers>,
    /// Apart from the cell: the call keeps this waker, which must not keep the call alive.
    notifier: Arc<Notifier>,
}

/// Wakes the callers waiting for a call when it makes progress.
struct Notifier {
    wakers: Mutex<Wakers>,
    /// A caller found the call being polled by another, after registering its waker.
    passed_over: AtomicBool,
}

/// Waker slots, the first two inline. A slot given up by a caller that left before the call
/// ended is given to the next caller that waits (queued callers wait through a fresh clone at
/// each poll: without reuse, a long call would grow the list at every wake-up).
#[derive(Default)]
struct Wakers {
    first: [Option<Waker>; 2],
    more: Vec<Option<Waker>>,
    used: usize,
    free: Vec<usize>,
    /// The slots of the callers passed over while another polled the call.
    passed: Vec<usize>,
}

impl Wakers {
    fn take_slot(&mut self) -> usize {
        self.free.pop().unwrap_or_else(|| {
            self.used += 1;
            self.used - 1
        })
    }

    /// Wakes the callers passed over (not `except`, the poller).
    fn wake_passed(&mut self, except: usize) {
        let mut passed = std::mem::take(&mut self.passed);
        for slot in passed.drain(..) {
            if slot != except
                && let Some(waker) = self.slot(slot).take()
            {
                waker.wake();
            }
        }
        // Its room, for the next time.
        self.passed = passed;
    }

    fn give_back(&mut self, slot: usize) {
        *self.slot(slot) = None;
        self.free.push(slot);
    }

    fn slot(&mut self, i: usize) -> &mut Option<Waker> {
        match i {
            0 | 1 => &mut self.first[i],
            _ => {
                let i = i - 2;
                if self.more.len() <= i {
                    self.more.resize_with(i + 1, || None);
                }
                &mut self.more[i]
            }
        }
    }

    /// Wakes every waiting caller but the one in slot `except`, each once (it registers again
    /// when it is polled).
    fn wake(&mut self, except: Option<usize>) {
        let (first, more) = (&mut self.first, &mut self.more);
        for (i, waker) in first.iter_mut().chain(more.iter_mut()).enumerate() {
            if Some(i) != except
                && let Some(waker) = waker.take()
            {
                waker.wake();
            }
        }
    }
}

impl Notifier {
    fn wakers(&self) -> MutexGuard<'_, Wakers> {
        self.wakers.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Wake for Notifier {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.wakers().wake(None);
    }
}

impl SharedCall {
    pub(super) fn new(call: impl Future<Output = Answers> + Send + 'static) -> Self {
        Self {
            cell: Arc::new(Cell {
                call: Mutex::new(Some(Box::pin(call))),
                answers: OnceLock::new(),
                notifier: Arc::new(Notifier {
                    wakers: Mutex::default(),
                    passed_over: AtomicBool::new(false),
                }),
            }),
            slot: None,
        }
    }

    pub(super) fn downgrade(&self) -> WeakCall {
        WeakCall(Arc::downgrade(&self.cell))
    }

    /// Its answers, once it has ended.
    pub(super) fn answers(&self) -> Option<&Answers> {
        self.cell.answers.get()
    }

    /// Drives the call; ready once it has ended ([`answers`](Self::answers) then has them).
    ///
    /// A caller that finds the call being polled by another registers its waker, notes that it
    /// was passed over, and tries once more; the poller, once its poll ends `Pending` and it
    /// has let go of the call, wakes the callers passed over meanwhile. Between them, one
    /// of three holds for every caller that returns `Pending`: it polled the call itself, a
    /// poll of the call started after it registered (so the call's next wake-up reaches it), or
    /// the poller wakes it (the fences keep the two sides from both missing the other's write).
    pub(super) fn poll_end(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        if self.cell.answers.get().is_some() {
            return Poll::Ready(());
        }
        let notifier = &self.cell.notifier;
        let slot = {
            let mut wakers = notifier.wakers();
            let slot = *self.slot.get_or_insert_with(|| wakers.take_slot());
            let waker = wakers.slot(slot);
            if !waker.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
                *waker = Some(cx.waker().clone());
            }
            slot
        };
        // Should the call panic while this caller polls it, the other callers are woken to be
        // answered (the panic goes on in this caller's task). Made before the lock is taken, so
        // that it wakes them after the lock is let go (poisoned).
        let mut unwinding = WakeOthers {
            notifier,
            slot,
            armed: false,
        };
        let mut call = match self.cell.call.try_lock() {
            Ok(call) => call,
            Err(TryLockError::WouldBlock) => {
                notifier.wakers().passed.push(slot);
                notifier.passed_over.store(true, Ordering::SeqCst);
                fence(Ordering::SeqCst);
                match self.cell.call.try_lock() {
                    Ok(call) => call,
                    // Polled by another, which wakes this one when its poll ends.
                    Err(TryLockError::WouldBlock) => return Poll::Pending,
                    Err(TryLockError::Poisoned(poisoned)) => {
                        return self.answer_panicked(poisoned.into_inner(), slot);
                    }
                }
            }
            Err(TryLockError::Poisoned(poisoned)) => {
                return self.answer_panicked(poisoned.into_inner(), slot);
            }
        };
        // Answered while this caller registered.
        let Some(future) = call.as_mut() else {
            return Poll::Ready(());
        };
        let waker = Waker::from(Arc::clone(notifier));
        unwinding.armed = true;
        let answers = future.as_mut().poll(&mut Context::from_waker(&waker));
        unwinding.armed = false;
        match answers {
            Poll::Ready(answers) => {
                *call = None;
                let _ = self.cell.answers.set(answers);
                drop(call);
                notifier.wakers().wake(Some(slot));
                Poll::Ready(())
            }
            Poll::Pending => {
                drop(call);
                fence(Ordering::SeqCst);
                if notifier.passed_over.swap(false, Ordering::SeqCst) {
                    // A wake-up during this poll may have missed the callers passed over then.
                    notifier.wakers().wake_passed(slot);
                }
                Poll::Pending
            }
        }
    }

    /// The call panicked in a poll (its poller's task had the panic): polling it again would
    /// panic too. Its callers are answered with an error ("ended without an answer").
    fn answer_panicked(&self, mut call: MutexGuard<'_, Option<Call>>, slot: usize) -> Poll<()> {
        *call = None;
        let _ = self.cell.answers.set(Answers::Many(Vec::new()));
        drop(call);
        self.cell.notifier.wakers().wake(Some(slot));
        Poll::Ready(())
    }
}

/// Wakes every caller of a call but its poller if the call panics while polled.
struct WakeOthers<'a> {
    notifier: &'a Notifier,
    slot: usize,
    armed: bool,
}

impl Drop for WakeOthers<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.notifier.wakers().wake(Some(self.slot));
        }
    }
}

impl Clone for SharedCall {
    fn clone(&self) -> Self {
        Self {
            cell: Arc::clone(&self.cell),
            slot: None,
        }
    }
}

impl Drop for SharedCall {
    fn drop(&mut self) {
        // Once the call has ended nobody waits any more: nothing to give back.
        if let Some(slot) = self.slot
            && self.cell.answers.get().is_none()
        {
            self.cell.notifier.wakers().give_back(slot);
        }
    }
}

/// Completes when the call has ended (a release waiting for the call that carries its acquire).
impl Future for SharedCall {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        self.get_mut().poll_end(cx)
    }
}

impl WeakCall {
    pub(super) fn upgrade(&self) -> Option<SharedCall> {
        self.0.upgrade().map(|cell| SharedCall { cell, slot: None })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    async fn poll_once(call: &mut SharedCall) -> Poll<()> {
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
            let mut clones: Vec<SharedCall> = (0..5).map(|_| call.clone()).collect();
            for clone in &mut clones {
                assert!(poll_once(clone).await.is_pending());
            }
        }
        {
            let wakers = call.cell.notifier.wakers();
            assert!(
                wakers.used <= 5,
                "{} slots for 5 callers at once",
                wakers.used
            );
        }
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
        let shared: Arc<Mutex<Option<SharedCall>>> = Arc::new(Mutex::new(None));
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
                Poll::Pending
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
}
