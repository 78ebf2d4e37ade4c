//! Release announcements for [`RedisStore`](super::RedisStore), over pub/sub.
//!
//! The release script publishes a key on one channel when a waiter left its marker (see
//! `scripts/acquire.lua`). Each store subscribes once, on a connection of its own started at the
//! first wait, and wakes the waiters of this process for that key.

use std::{
    fmt,
    sync::{
        Arc, Mutex, Once,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use bytes::Bytes;
use futures_util::StreamExt;
use redis::Client;
use tokio::{runtime::Handle, sync::oneshot};

use super::{ReleaseWatch, Releases};
use crate::{key::LockKey, telemetry::Chain};

/// The default channel releases are announced on.
pub(crate) const DEFAULT_CHANNEL: &str = "tower-lock:released";

/// How long to wait before subscribing again after the connection broke.
const RESUBSCRIBE_AFTER: Duration = Duration::from_secs(1);

pub(crate) struct Notifier {
    client: Client,
    channel: Arc<str>,
    releases: Releases,
    /// Subscribed now: only then do waiters rely on announcements (and ask for them).
    live: Arc<AtomicBool>,
    started: Once,
    /// Dropped with the last clone of the store, which stops the subscriber task.
    stop: Mutex<Option<oneshot::Receiver<()>>>,
    _stop: oneshot::Sender<()>,
}

impl Notifier {
    pub(crate) fn new(client: Client, channel: Arc<str>) -> Arc<Self> {
        let (tx, rx) = oneshot::channel();
        Arc::new(Self {
            client,
            channel,
            releases: Releases::default(),
            live: Arc::new(AtomicBool::new(false)),
            started: Once::new(),
            stop: Mutex::new(Some(rx)),
            _stop: tx,
        })
    }

    pub(crate) fn channel(&self) -> &str {
        &self.channel
    }

    /// Whether the subscription is up, so that releases will be announced to this process.
    pub(crate) fn is_live(&self) -> bool {
        self.live.load(Ordering::Acquire)
    }

    /// Registers for the release of `key`; `None` until the subscription is up (then waiters use
    /// their retry timer). Starts the subscriber at the first call.
    pub(crate) fn watch(&self, key: &LockKey) -> Option<ReleaseWatch> {
        self.started.call_once(|| {
            let Ok(handle) = Handle::try_current() else {
                return;
            };
            let stop = self.stop.lock().unwrap_or_else(|p| p.into_inner()).take();
            if let Some(stop) = stop {
                handle.spawn(subscribe(
                    self.client.clone(),
                    Arc::clone(&self.channel),
                    self.releases.clone(),
                    Arc::clone(&self.live),
                    stop,
                ));
            }
        });
        self.is_live().then(|| self.releases.watch(key))
    }
}

impl fmt::Debug for Notifier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Notifier")
            .field("channel", &self.channel)
            .field("live", &self.is_live())
            .finish()
    }
}

async fn subscribe(
    client: Client,
    channel: Arc<str>,
    releases: Releases,
    live: Arc<AtomicBool>,
    mut stop: oneshot::Receiver<()>,
) {
    loop {
        let session = async {
            let mut pubsub = client.get_async_pubsub().await?;
            pubsub.subscribe(&*channel).await?;
            live.store(true, Ordering::Release);
            tracing::debug!(channel = &*channel, "listening for lock releases");
            let mut messages = pubsub.on_message();
            while let Some(message) = messages.next().await {
                releases.released(Bytes::copy_from_slice(message.get_payload_bytes()));
            }
            Ok::<(), redis::RedisError>(())
        };
        tokio::select! {
            _ = &mut stop => return,
            result = session => {
                live.store(false, Ordering::Release);
                // Waiters registered now may miss their announcement; they fall back to the
                // holder's TTL. Wake them all instead, to retry at once.
                releases.released(Bytes::new());
                match result {
                    Ok(()) => tracing::debug!("release subscription closed; subscribing again"),
                    Err(error) => tracing::debug!(
                        error = %Chain(&error),
                        "release subscription failed; waiters use their timers meanwhile"
                    ),
                }
            }
        }
        tokio::select! {
            _ = &mut stop => return,
            () = tokio::time::sleep(RESUBSCRIBE_AFTER) => {}
        }
    }
}
