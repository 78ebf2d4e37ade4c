//! What [`LockConfig`] is built from and offers besides itself: its builder,
//! and the settings whose values are types of their own.

pub(crate) mod settings;

pub use settings::{KeyDisplay, LockConfigBuilder, OnLeaseLost};
pub(crate) use settings::{LockConfig, MAX_DURATION, at_most_a_year, check_ttl};
