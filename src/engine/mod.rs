//! The engine: everything between a lock key and the end of its lease, shared by both layers and
//! by background work.
//!
//! - [`Locker`] (public) holds the store, the settings and what the leases share;
//!   [`Acquiring`] (public) is one call's acquire, with its own wait, TTL or longest hold
//!   (`terms`), a builder that becomes an [`AcquireFuture`] (public) when awaited.
//! - `acquire`: the acquire loop (process-local queue, wait policy, the store's hand-off queue).
//! - `hold`: the one lifecycle of a held lease (renewal, max hold, loss policy, release on
//!   completion or drop, the outcome).
//! - `renew`: the renewal tick, driven inline or by one background task per locker. (Renewals
//!   that fall due together reach a Redis store together and go in one call: its group commit.)
//! - `release`: releasing now or on drop. `local`: the process-local queues. `state`: what
//!   every lease of one locker shares.
//! - [`LeaseGuard`] (public): a lease held by background work.
//! - `reentry`: what the current task holds (a task-local), so that a nested acquire of a held
//!   key returns at once with a lease on the same hold.

mod acquire;
mod acquiring;
mod guard;
mod hold;
mod local;
mod locker;
mod reentry;
mod release;
mod renew;
mod state;
mod terms;
#[cfg(test)]
mod tests;

pub(crate) use self::{
    acquire::cannot_count,
    hold::{Guarded, Hold, poll_guarded},
    reentry::Held,
    release::{LetGo, Release},
};
pub use self::{
    acquiring::{AcquireFuture, Acquiring},
    guard::LeaseGuard,
    locker::Locker,
};
