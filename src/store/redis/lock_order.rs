//! The group commit's lock order ([`super::commit`]), asserted in debug builds.
//!
//! A store's committer has three kinds of locks: its lanes (`Committer::lanes`, one lock for
//! every lane), its map of unsettled acquires (`Committer::unsettled`), and each queued
//! caller's ticket (`Ticket::state`). The order is:
//!
//! 1. **the lanes first**;
//! 2. under them (or alone), **at most one inner lock**: the unsettled map *or* one ticket.
//!
//! Never the lanes while an inner lock is held, never two inner locks at once: then no two
//! threads can each hold what the other waits for. [`outer`] is called before the lanes are
//! locked and [`inner`] wraps an inner lock's guard; in debug builds each asserts the order
//! on the calling thread (the suite runs in debug), in release builds both are free.
//!
//! Outside this order, in `shared.rs`: a call's own lock (`SharedCall`'s `call`), held while
//! the call is polled, may be held above all of these (a call that ends drops its flight,
//! which takes the lanes), and is only ever taken with `try_lock`, so never waited for; its
//! wakers' lock is a leaf (nothing is taken under it; the wakers it wakes only schedule). Its
//! interleavings are model-checked by `tests/shared_call_model.rs`.

use std::{
    ops::{Deref, DerefMut},
    sync::MutexGuard,
};

#[cfg(debug_assertions)]
thread_local! {
    /// Whether this thread holds an inner lock.
    static INNER_HELD: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Before the lanes are locked: no inner lock may be held.
pub(super) fn outer() {
    #[cfg(debug_assertions)]
    assert!(
        !INNER_HELD.with(std::cell::Cell::get),
        "lock order: the lanes are taken before the unsettled map or a ticket, never under them"
    );
}

/// An inner lock's guard (the unsettled map's, or a ticket's), counted while it lives.
pub(super) struct Inner<'a, T>(MutexGuard<'a, T>);

/// `guard`, an inner lock just taken: it must be the only inner lock this thread holds. (The
/// check runs after the lock is taken, which cannot deadlock with one thread: a second inner
/// lock is either the same mutex, a deadlock the assertion would not reach, or another one.)
pub(super) fn inner<T>(guard: MutexGuard<'_, T>) -> Inner<'_, T> {
    #[cfg(debug_assertions)]
    INNER_HELD.with(|held| {
        assert!(
            !held.replace(true),
            "lock order: at most one of the unsettled map and a ticket is held at once"
        );
    });
    Inner(guard)
}

impl<T> Deref for Inner<'_, T> {
    type Target = T;

    fn deref(&self) -> &T {
        &self.0
    }
}

impl<T> DerefMut for Inner<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        &mut self.0
    }
}

impl<T> Drop for Inner<'_, T> {
    fn drop(&mut self) {
        #[cfg(debug_assertions)]
        INNER_HELD.with(|held| held.set(false));
    }
}

#[cfg(all(test, debug_assertions))]
mod tests {
    use std::sync::Mutex;

    use super::*;

    #[test]
    fn one_inner_lock_at_a_time_then_the_lanes_again() {
        let (a, b) = (Mutex::new(1), Mutex::new(2));
        outer();
        drop(inner(a.lock().unwrap()));
        let held = inner(b.lock().unwrap());
        assert_eq!(*held, 2);
        drop(held);
        outer();
    }

    #[test]
    #[should_panic(expected = "lock order: the lanes are taken before")]
    fn the_lanes_under_an_inner_lock_are_refused() {
        let ticket = Mutex::new(());
        let _held = inner(ticket.lock().unwrap());
        outer();
    }

    #[test]
    #[should_panic(expected = "lock order: at most one of")]
    fn two_inner_locks_are_refused() {
        let (unsettled, ticket) = (Mutex::new(()), Mutex::new(()));
        let _map = inner(unsettled.lock().unwrap());
        let _ticket = inner(ticket.lock().unwrap());
    }
}
