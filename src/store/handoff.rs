//! Hand-off signals for [`RedisStore`](super::RedisStore), over pub/sub.
//!
//! With hand-off on, a waiter that finds its key held joins the key's queue in Redis (see
//! `scripts/handoff.lua`), and a release gives the key straight to the head of the queue and
//! publishes that on the head's channel. Every store has a channel of its own, subscribed once
//! on a connection of its own (started at `connect`), and passes each message to the one waiter
//! it is for.

use std::{
    collections::HashMap,
    fmt,
    pin::Pin,
    sync::{
        Arc, Mutex, Once, OnceLock,
        atomic::{AtomicBool, Ordering},
    },
    task::{Context, Poll},
    time::Duration,
};

use futures_util::StreamExt;
use redis::Client;
use tokio::{
    runtime::Handle,
    sync::{mpsc, oneshot},
    time::Instant,
};

use super::{QueueSignals, QueueWatch, Signal};
use crate::{telemetry::Chain, token::Token};

/// How long to wait before subscribing again after the connection broke.
const RESUBSCRIBE_AFTER: Duration = Duration::from_secs(1);

/// Hex digits of a queue entry's stamp.
const STAMP_LEN: usize = 16;

/// Token bytes in a queue entry (hex, see [`Token`]).
const TOKEN_LEN: usize = 32;

/// The origin of queue entries' stamps: microseconds since the first use in this process.
fn base() -> Instant {
    static BASE: OnceLock<Instant> = OnceLock::new();
    *BASE.get_or_init(Instant::now)
}

type Waiters = Arc<Mutex<HashMap<[u8; TOKEN_LEN], Slot>>>;

/// A registered waiter: where its signals go, and its queue entry.
struct Slot {
    tx: mpsc::UnboundedSender<Signal>,
    entry: Arc<[u8]>,
}

pub(crate) struct Handoff {
    client: Client,
    channel: Arc<str>,
    waiters: Waiters,
    /// Subscribed now: only then do waiters join queues (and rely on being told).
    live: Arc<AtomicBool>,
    started: Once,
    /// Dropped with the last clone of the store, which stops the subscriber task.
    stop: Mutex<Option<oneshot::Receiver<()>>>,
    _stop: oneshot::Sender<()>,
}

impl Handoff {
    /// A hand-off receiver on a fresh channel, `tower-lock:handoff:<random>`.
    pub(crate) fn new(client: Client) -> Arc<Self> {
        let id = Token::generate().map_or_else(
            // Without randomness, still unique within the process (lock tokens would fail
            // anyway, so no lease is ever queued under this name).
            |_| format!("pid-{}", std::process::id()),
            |t| String::from_utf8_lossy(t.as_bytes()).into_owned(),
        );
        let (tx, rx) = oneshot::channel();
        Arc::new(Self {
            client,
            channel: Arc::from(format!("tower-lock:handoff:{id}")),
            waiters: Arc::default(),
            live: Arc::new(AtomicBool::new(false)),
            started: Once::new(),
            stop: Mutex::new(Some(rx)),
            _stop: tx,
        })
    }

    /// Starts the subscriber task, once (a no-op outside a Tokio runtime; retried later).
    pub(crate) fn start(&self) {
        let Ok(handle) = Handle::try_current() else {
            return;
        };
        self.started.call_once(|| {
            let stop = self.stop.lock().unwrap_or_else(|p| p.into_inner()).take();
            if let Some(stop) = stop {
                handle.spawn(subscribe(
                    self.client.clone(),
                    Arc::clone(&self.channel),
                    Arc::clone(&self.waiters),
                    Arc::clone(&self.live),
                    stop,
                ));
            }
        });
    }

    /// Whether the subscription is up, so that hand-offs will reach this process.
    pub(crate) fn is_live(&self) -> bool {
        self.live.load(Ordering::Acquire)
    }

    /// Registers `token`'s waiter; `None` until the subscription is up (then waiters pace
    /// their checks by their wait policy, without joining queues).
    pub(crate) fn register(&self, token: &Token) -> Option<QueueWatch> {
        self.start();
        if !self.is_live() {
            return None;
        }
        let id: [u8; TOKEN_LEN] = token.as_bytes().try_into().ok()?;
        let stamp = u64::try_from(base().elapsed().as_micros()).unwrap_or(u64::MAX);
        let mut entry = Vec::with_capacity(TOKEN_LEN + STAMP_LEN + self.channel.len());
        entry.extend_from_slice(&id);
        entry.extend_from_slice(format!("{stamp:016x}").as_bytes());
        entry.extend_from_slice(self.channel.as_bytes());
        let (tx, rx) = mpsc::unbounded_channel();
        let slot = Slot {
            tx,
            entry: Arc::from(entry),
        };
        self.waiters
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id, slot);
        let signals = Registration {
            id,
            rx,
            waiters: Arc::clone(&self.waiters),
        };
        Some(QueueWatch::new(signals))
    }

    /// The queue entry of `token`'s registered waiter: token, stamp, channel.
    pub(crate) fn entry(&self, token: &Token) -> Option<Arc<[u8]>> {
        let id: [u8; TOKEN_LEN] = token.as_bytes().try_into().ok()?;
        let waiters = self.waiters.lock().unwrap_or_else(|p| p.into_inner());
        waiters.get(&id).map(|slot| Arc::clone(&slot.entry))
    }
}

impl fmt::Debug for Handoff {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Handoff")
            .field("channel", &self.channel)
            .field("live", &self.is_live())
            .finish()
    }
}

/// One waiter's registration: its signals, unregistered on drop.
struct Registration {
    id: [u8; TOKEN_LEN],
    rx: mpsc::UnboundedReceiver<Signal>,
    waiters: Waiters,
}

impl QueueSignals for Registration {
    fn poll_signal(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Signal> {
        match self.rx.poll_recv(cx) {
            Poll::Ready(Some(signal)) => Poll::Ready(signal),
            // Unregistered by the store going away: nothing more will come.
            Poll::Ready(None) | Poll::Pending => Poll::Pending,
        }
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.waiters
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.id);
    }
}

/// Parses a hand-off message: `g<token><stamp><claim ms>:<fence>` (handed over) or
/// `n<token><stamp><claim ms>` (next in line). `None` for anything else.
fn parse(payload: &[u8], received: Instant) -> Option<([u8; TOKEN_LEN], Signal)> {
    let (&kind, rest) = payload.split_first()?;
    let id: [u8; TOKEN_LEN] = rest.get(..TOKEN_LEN)?.try_into().ok()?;
    let stamp = std::str::from_utf8(rest.get(TOKEN_LEN..TOKEN_LEN + STAMP_LEN)?).ok()?;
    let stamp = Duration::from_micros(u64::from_str_radix(stamp, 16).ok()?);
    let tail = std::str::from_utf8(rest.get(TOKEN_LEN + STAMP_LEN..)?).ok()?;
    match kind {
        b'g' => {
            let (claim, fence) = tail.split_once(':')?;
            let claim = Duration::from_millis(claim.parse().ok()?);
            // The key was handed over after the waiter registered (at `stamp`), for `claim`:
            // it is ours at least until stamp + claim, less an allowance for the server's clock
            // running faster than ours (1% + 2 ms, as for Redlock).
            let allowance = claim / 100 + Duration::from_millis(2);
            let valid_until = (base() + stamp + claim)
                .checked_sub(allowance)
                .unwrap_or(received);
            Some((
                id,
                Signal::Granted {
                    fencing_token: fence.parse().ok()?,
                    valid_until,
                },
            ))
        }
        b'n' => Some((
            id,
            Signal::Next {
                within: Duration::from_millis(tail.parse().ok()?),
            },
        )),
        _ => None,
    }
}

fn deliver(waiters: &Waiters, id: &[u8; TOKEN_LEN], signal: Signal) {
    // A waiter that left already is no longer registered: its release took it out of the queue
    // (or hands the key on), so nothing is lost by dropping the message.
    if let Some(slot) = waiters.lock().unwrap_or_else(|p| p.into_inner()).get(id) {
        let _ = slot.tx.send(signal);
    }
}

async fn subscribe(
    client: Client,
    channel: Arc<str>,
    waiters: Waiters,
    live: Arc<AtomicBool>,
    mut stop: oneshot::Receiver<()>,
) {
    loop {
        let session = async {
            let mut pubsub = client.get_async_pubsub().await?;
            pubsub.subscribe(&*channel).await?;
            live.store(true, Ordering::Release);
            tracing::debug!("listening for lock hand-offs");
            let mut messages = pubsub.on_message();
            while let Some(message) = messages.next().await {
                match parse(message.get_payload_bytes(), Instant::now()) {
                    Some((id, signal)) => deliver(&waiters, &id, signal),
                    None => tracing::debug!("ignoring a malformed hand-off message"),
                }
            }
            Ok::<(), redis::RedisError>(())
        };
        tokio::select! {
            _ = &mut stop => return,
            result = session => {
                live.store(false, Ordering::Release);
                // Hand-offs may have been missed: every waiter checks again now.
                for slot in waiters.lock().unwrap_or_else(|p| p.into_inner()).values() {
                    let _ = slot.tx.send(Signal::Retry);
                }
                match result {
                    Ok(()) => tracing::debug!("hand-off subscription closed; subscribing again"),
                    Err(error) => tracing::debug!(
                        error = %Chain(&error),
                        "hand-off subscription failed; waiters use their timers meanwhile"
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_hand_off_messages() {
        let now = Instant::now();
        let token = "0123456789abcdef0123456789abcdef";
        let g = format!("g{token}{:016x}1000:1234567", 5_000_000u64);
        let (id, signal) = parse(g.as_bytes(), now).unwrap();
        assert_eq!(&id, token.as_bytes());
        let Signal::Granted {
            fencing_token,
            valid_until,
        } = signal
        else {
            panic!("{signal:?}")
        };
        assert_eq!(fencing_token, 1_234_567);
        assert_eq!(
            valid_until,
            base() + Duration::from_millis(5000 + 1000 - 10 - 2)
        );
        let n = format!("n{token}{:016x}250", 7u64);
        assert_eq!(
            parse(n.as_bytes(), now).unwrap().1,
            Signal::Next {
                within: Duration::from_millis(250)
            }
        );
        for bad in [
            "",
            "g",
            "x0123",
            &format!("g{token}zz"),
            &format!("n{token}{:016x}x", 1),
        ] {
            assert!(parse(bad.as_bytes(), now).is_none(), "{bad:?}");
        }
    }
}
