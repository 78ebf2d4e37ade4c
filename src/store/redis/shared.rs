//! [`SharedCall`]: one call to Redis in flight, driven by whichever of the callers that wait for
//! it is polled, and its [`Answers`], one per operation, read by each of them.
//!
//! What `futures::future::Shared` does for group commit, in three allocations per call rather
//! than five: the answers are kept in the call's cell (a lone operation's inline, no list), and
//! the wakers of the first two callers to wait are too (a lone call has one or two: its caller,
//! and a release that waits for the acquire it carries). One thing more: a caller that finds the
//! call being polled by another returns `Pending`, and a wake-up that reached the call while
//! that other polled it went only to the callers waiting then; so the one polling wakes the
//! callers that came meanwhile once its poll ends, and no caller depends on another's being
//! polled again.

use std::{
    future::Future,
    pin::Pin,
    sync::{
        Arc, Mutex, MutexGuard, OnceLock, PoisonError, TryLockError, Weak,
        atomic::{AtomicBool, Ordering},
    },
    task::{Context, Poll, Wake, Waker},
};

use super::commit::Answer;
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
}

impl Wakers {
    fn take_slot(&mut self) -> usize {
        self.free.pop().unwrap_or_else(|| {
            self.used += 1;
            self.used - 1
        })
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
        let mut call = match self.cell.call.try_lock() {
            Ok(call) => call,
            Err(TryLockError::WouldBlock) => {
                // Another caller polls it: it wakes this one when its poll ends.
                notifier.passed_over.store(true, Ordering::Release);
                return Poll::Pending;
            }
            // The call panicked in a poll (its poller's task had the panic): polling it again
            // would panic too. Its callers are answered with an error.
            Err(TryLockError::Poisoned(poisoned)) => {
                let mut call = poisoned.into_inner();
                *call = None;
                let _ = self.cell.answers.set(Answers::Many(Vec::new()));
                drop(call);
                notifier.wakers().wake(Some(slot));
                return Poll::Ready(());
            }
        };
        // Answered while this caller registered.
        let Some(future) = call.as_mut() else {
            return Poll::Ready(());
        };
        notifier.passed_over.store(false, Ordering::Release);
        let waker = Waker::from(Arc::clone(notifier));
        let answers = future.as_mut().poll(&mut Context::from_waker(&waker));
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
                if notifier.passed_over.swap(false, Ordering::AcqRel) {
                    // A wake-up during this poll may have missed the callers that came then.
                    notifier.wakers().wake(Some(slot));
                }
                Poll::Pending
            }
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
}
