//! Release notifications: how a waiter learns that a key may be free, instead of waiting for its
//! retry timer.

use std::{fmt, future::Future, pin::Pin, task};

use bytes::Bytes;
use tokio::sync::broadcast;

use crate::key::LockKey;

/// A registration for the next release of one key, returned by
/// [`LockStore::watch`](super::LockStore::watch).
///
/// It is registered when created, so a release between the registration and the first poll is
/// not missed. It completes when the key may have been released; a waiter then retries at once.
/// It may complete spuriously (a retry finds the key still held), and it may never complete
/// (a lost message): waiters always keep a fallback timer.
pub struct ReleaseWatch(Pin<Box<dyn Future<Output = ()> + Send>>);

impl ReleaseWatch {
    /// Wraps a future that completes when the key may have been released. It must already be
    /// registered for the release (for example, hold a `broadcast::Receiver` made before).
    pub fn new(future: impl Future<Output = ()> + Send + 'static) -> Self {
        Self(Box::pin(future))
    }
}

impl Future for ReleaseWatch {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut task::Context<'_>) -> task::Poll<()> {
        self.0.as_mut().poll(cx)
    }
}

impl fmt::Debug for ReleaseWatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ReleaseWatch")
    }
}

/// Fans released keys out to the watchers in this process.
#[derive(Debug, Clone)]
pub(crate) struct Releases {
    tx: broadcast::Sender<Bytes>,
}

impl Default for Releases {
    fn default() -> Self {
        Self {
            tx: broadcast::channel(1024).0,
        }
    }
}

impl Releases {
    /// Registers for the next release of `key`.
    pub(crate) fn watch(&self, key: &LockKey) -> ReleaseWatch {
        let mut rx = self.tx.subscribe();
        let key = Bytes::copy_from_slice(key.as_bytes());
        ReleaseWatch::new(async move {
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
