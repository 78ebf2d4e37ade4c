//! [`SharedCall`]: one call to Redis in flight, driven by whichever of the callers that wait for
//! it is polled, and what it ends with (for group commit, the call's answers, one per
//! operation), read by each of them.
//!
//! What `futures::future::Shared` does for group commit, in three allocations per call rather
//! than five: the answers are kept in the call's cell (a lone operation's inline, no list), and
//! the wakers of the first two callers to wait are too (a lone call has one or two: its caller,
//! and a release that waits for the acquire it carries). Two things more: a caller that finds
//! the call being polled by another returns `Pending`, and a wake-up that reached the call while
//! that other polled it went only to the callers waiting then; so the one polling wakes the
//! callers passed over meanwhile once its poll ends, and no caller depends on another's being
//! polled again (see [`SharedCall::poll_end`]). And a call that panics while polled wakes its
//! other callers, which read `T::default()` (no answers: an error for each operation).
//!
//! Loom checks its interleavings (`tests/shared_call_model.rs` compiles this file against
//! loom's locks and atomics, and explores every interleaving of callers, the poller and the
//! call's wake-up), beside the stress tests (`shared_tests.rs`); the file depends on nothing of
//! the crate for that reason. Loom does not model the memory order the two `SeqCst` fences of
//! [`SharedCall::poll_end`] give (its mutexes are not weak-memory locations): that part rests on
//! the argument written there, and the stress tests.

use std::{
    future::Future,
    pin::Pin,
    sync::{Arc, OnceLock, PoisonError, TryLockError, Weak, atomic::Ordering},
    task::{Context, Poll, Wake, Waker},
};

// std's locks and atomics here; loom's where the model check (`tests/shared_call_model.rs`)
// compiles this file.
use super::sync::{AtomicBool, Mutex, MutexGuard, fence};

/// The model check's negative control: a poller that does not wake the callers passed over
/// (the model must then find a caller stranded).
#[cfg(test)]
pub(super) static SKIP_PASSED_WAKE: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

type Call<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// A call in flight, shared: every clone drives it when polled, and completes with it.
pub(super) struct SharedCall<T> {
    cell: Arc<Cell<T>>,
    /// This clone's waker slot, once it has waited.
    slot: Option<usize>,
}

/// A [`SharedCall`] that does not keep it alive: a call whose callers all left is dropped.
pub(super) struct WeakCall<T>(Weak<Cell<T>>);

struct Cell<T> {
    /// The call, until it is answered; locked by whoever polls it.
    call: Mutex<Option<Call<T>>>,
    /// What it ended with; `T::default()` if it panicked.
    answers: OnceLock<T>,
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

impl<T: Default> SharedCall<T> {
    pub(super) fn new(call: impl Future<Output = T> + Send + 'static) -> Self {
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

    pub(super) fn downgrade(&self) -> WeakCall<T> {
        WeakCall(Arc::downgrade(&self.cell))
    }

    /// How many waker slots it has made (a test's check that they are reused).
    #[cfg(test)]
    pub(super) fn waker_slots(&self) -> usize {
        self.cell.notifier.wakers().used
    }

    /// Its answers, once it has ended.
    pub(super) fn answers(&self) -> Option<&T> {
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
                #[cfg(test)]
                if SKIP_PASSED_WAKE.load(Ordering::Relaxed) {
                    return Poll::Pending;
                }
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
    fn answer_panicked(&self, mut call: MutexGuard<'_, Option<Call<T>>>, slot: usize) -> Poll<()> {
        *call = None;
        let _ = self.cell.answers.set(T::default());
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

impl<T> Clone for SharedCall<T> {
    fn clone(&self) -> Self {
        Self {
            cell: Arc::clone(&self.cell),
            slot: None,
        }
    }
}

impl<T> Drop for SharedCall<T> {
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
impl<T: Default> Future for SharedCall<T> {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        self.get_mut().poll_end(cx)
    }
}

impl<T> Clone for WeakCall<T> {
    fn clone(&self) -> Self {
        Self(Weak::clone(&self.0))
    }
}

impl<T> WeakCall<T> {
    pub(super) fn upgrade(&self) -> Option<SharedCall<T>> {
        self.0.upgrade().map(|cell| SharedCall { cell, slot: None })
    }
}
