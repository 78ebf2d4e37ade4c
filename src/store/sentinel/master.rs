//! A master the sentinels named, and the settings every new master's store gets.

use std::{sync::Arc, time::Duration};

use redis::Client;

use super::LOOKUP_TIMEOUT;
use crate::store::{
    Capabilities, LockStore, RedisStore, StoreError, StoreErrorKind,
    redis::{Handoff, server_name},
};

/// The master the sentinels named, and a store connected to it.
pub(crate) struct Master {
    pub(super) store: RedisStore,
    /// The store's capabilities, resolved once.
    pub(super) caps: Capabilities,
    pub(super) addr: String,
    /// How to reach it: for the hand-off subscription.
    pub(super) client: Client,
}

impl Master {
    /// Connects to the master `client` reaches; its store has the default settings.
    pub(super) async fn connect(client: &Client) -> Result<Self, StoreError> {
        let info = client.get_connection_info();
        let store = tokio::time::timeout(LOOKUP_TIMEOUT, RedisStore::connect_plain(info.clone()))
            .await
            .map_err(|_| {
                StoreError::msg(
                    StoreErrorKind::Timeout,
                    format!(
                        "could not connect to the Redis master, {}, within {LOOKUP_TIMEOUT:?}",
                        server_name(info)
                    ),
                )
            })??;
        Ok(Self::new(store, info.addr().to_string(), client.clone()))
    }

    pub(super) fn new(store: RedisStore, addr: String, client: Client) -> Self {
        Self {
            caps: store.capabilities(),
            store,
            addr,
            client,
        }
    }

    /// This master with `settings` applied to its store.
    pub(super) fn with(&self, settings: &Settings) -> Self {
        Self::new(
            settings.apply(self.store.clone()),
            self.addr.clone(),
            self.client.clone(),
        )
    }
}

/// The [`RedisStore`] settings, applied again to the store of every new master.
#[derive(Debug, Clone)]
pub(super) struct Settings {
    pub(super) fence_retention: Option<Duration>,
    pub(super) native_commands: bool,
    pub(super) replicas: Option<(usize, Duration)>,
    pub(super) claim_window: Option<Duration>,
    /// The store's hand-off (one channel, one subscription, one registry of waiters), given to
    /// the store of every master it follows; `None` when off.
    pub(super) handoff: Option<Arc<Handoff>>,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            fence_retention: None,
            native_commands: true,
            replicas: None,
            claim_window: None,
            handoff: None,
        }
    }
}

impl Settings {
    pub(super) fn apply(&self, mut store: RedisStore) -> RedisStore {
        // Checked by the `SentinelStore` setters that stored them.
        if let Some(retention) = self.fence_retention {
            store = store.with_fence_retention(retention);
        }
        if let Some(window) = self.claim_window {
            store = store.with_claim_window(window);
        }
        let (replicas, timeout) = self.replicas.unwrap_or((0, Duration::ZERO));
        store
            .native_commands(self.native_commands)
            .with_replicas(replicas, timeout)
            .attach_handoff(self.handoff.clone())
    }
}
