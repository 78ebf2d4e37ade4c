//! [`Engine`]: what every lease of one locker shares.

use std::sync::Arc;

use super::{local::LocalQueues, renew::Background};
use crate::{config::LockConfig, store::Backend};

/// What every lease of one locker shares: the store, the settings, the process-local queues,
/// and the background renewal task.
pub(crate) struct Engine {
    pub(crate) store: Arc<Backend>,
    pub(crate) config: LockConfig,
    pub(crate) local: Arc<LocalQueues>,
    pub(crate) background: Background,
}

impl Engine {
    pub(crate) fn new(store: Backend, config: LockConfig) -> Self {
        // The key layout's table of hash tags, built now rather than by the first request.
        crate::slot::warm();
        let store = Arc::new(store);
        Self {
            store,
            config,
            local: Arc::default(),
            background: Background::default(),
        }
    }
}
