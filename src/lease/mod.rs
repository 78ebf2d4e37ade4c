//! What a lease is made of besides [`Lease`] and
//! [`LeaseGuard`](crate::LeaseGuard): the builder [`Locker::acquire`](crate::Locker::acquire)
//! returns and the future it turns into, and why a lease was lost.

pub(crate) mod handle;

pub use crate::engine::{AcquireFuture, Acquiring};
pub use crate::error::LostReason;
pub(crate) use handle::*;
