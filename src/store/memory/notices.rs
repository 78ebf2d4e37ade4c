//! Release notices: a release wakes the waiters of this process at once, rather than at
//! their retry timers.

use bytes::Bytes;
use tokio::sync::broadcast;

use super::MemoryStore;
use crate::{
    key::LockKey,
    store::{ReleaseNotice, ReleaseNotices},
};

/// Fans released keys out to the watchers in this process.
#[derive(Debug, Clone)]
pub(crate) struct ReleaseAnnouncer {
    tx: broadcast::Sender<Bytes>,
}

impl Default for ReleaseAnnouncer {
    fn default() -> Self {
        Self {
            tx: broadcast::channel(1024).0,
        }
    }
}

impl ReleaseAnnouncer {
    /// Registers for the next release of `key`.
    pub(crate) fn watch(&self, key: &LockKey) -> ReleaseNotice {
        let mut rx = self.tx.subscribe();
        let key = Bytes::copy_from_slice(key.as_bytes());
        ReleaseNotice::new(async move {
            loop {
                match rx.recv().await {
                    // An empty key wakes every watcher (the announcements may have been missed).
                    Ok(released) if released.is_empty() || released == key => return,
                    Ok(_) => {}
                    // Missed some: one of them may have been ours.
                    Err(broadcast::error::RecvError::Lagged(_)) => return,
                    Err(broadcast::error::RecvError::Closed) => std::future::pending().await,
                }
            }
        })
    }

    /// Announces that `key` was released (a no-op when nobody watches).
    pub(crate) fn released(&self, key: Bytes) {
        if self.tx.receiver_count() > 0 {
            let _ = self.tx.send(key);
        }
    }
}

impl ReleaseNotices for MemoryStore {
    fn watch(&self, key: &LockKey) -> ReleaseNotice {
        self.inner.releases.watch(key)
    }
}
