//! What [`LockConfig`] is built from and offers besides itself: its builder,
//! and the settings whose values are types of their own.

pub(crate) mod settings;

pub(crate) use settings::LockConfig;
pub use settings::{KeyDisplay, LockConfigBuilder, OnLeaseLost};
