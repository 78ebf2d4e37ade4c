//! Hand-off signals for [`RedisStore`](super::RedisStore), over pub/sub.
//!
//! With hand-off on, a waiter that finds its key held joins the key's queue in Redis (see
//! `scripts/handoff.lua`), and a release gives the key straight to the head of the queue and
//! publishes that on the head's channel. Every store has a channel of its own, subscribed once
//! on a RESP3 connection of its own (started at `connect`), whose reader task passes each
//! message straight to the one waiter it is for.

use std::{
    collections::HashMap,
    fmt,
    pin::Pin,
    sync::{
        Arc, Mutex, Once, OnceLock,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    task::{Context, Poll},
    time::Duration,
};

use redis::{AsyncConnectionConfig, Client, ProtocolVersion, PushInfo, PushKind, Value};
use tokio::{
    runtime::Handle,
    sync::{Notify, mpsc, oneshot},
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

/// How long a message for a waiter that has not registered (yet) is kept for it.
const PENDING_FOR: Duration = Duration::from_secs(10);

/// At most this many such messages are kept.
const PENDING_MAX: usize = 4096;

/// With this many kept, the expired ones are dropped.
const PENDING_PURGE_AT: usize = 64;

type Waiters = Arc<Mutex<Registry>>;

/// The waiters of one store, by token.
#[derive(Default)]
struct Registry {
    waiters: HashMap<[u8; TOKEN_LEN], mpsc::UnboundedSender<Signal>>,
    /// Messages that arrived before their waiter registered: a waiter registers when its attempt
    /// answers that it was queued, and the hand-off may be faster than that answer. (Also
    /// messages for waiters that left: dropped when they expire.)
    pending: HashMap<[u8; TOKEN_LEN], (Instant, Signal)>,
}

impl Registry {
    fn deliver(&mut self, id: [u8; TOKEN_LEN], signal: Signal, now: Instant) {
        if let Some(tx) = self.waiters.get(&id) {
            let _ = tx.send(signal);
            return;
        }
        // Expired messages go every so often (a lookup per message otherwise).
        if self.pending.len() >= PENDING_PURGE_AT {
            self.pending
                .retain(|_, (at, _)| now.saturating_duration_since(*at) < PENDING_FOR);
        }
        if self.pending.len() < PENDING_MAX {
            // A grant is what matters; a later "next" must not replace it.
            match self.pending.get(&id) {
                Some((_, Signal::Granted { .. })) if !matches!(signal, Signal::Granted { .. }) => {}
                _ => {
                    self.pending.insert(id, (now, signal));
                }
            }
        }
    }
}

pub(crate) struct Handoff {
    client: Client,
    channel: Arc<str>,
    waiters: Waiters,
    /// How many waiters are registered (to skip the lock when none are).
    registered: Arc<AtomicUsize>,
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
            registered: Arc::default(),
            live: Arc::new(AtomicBool::new(false)),
            started: Once::new(),
            stop: Mutex::new(Some(rx)),
            _stop: tx,
        })
    }

    /// Starts the subscriber task, once, on the current Tokio runtime (a no-op outside one).
    ///
    /// Called by [`RedisStore::handoff`](super::RedisStore::handoff), which `connect` calls
    /// inside its runtime. The task lives as long as that runtime: if it shuts down while the
    /// store lives on, the store stops queueing its waiters (they use their timers) and does
    /// not subscribe again.
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

    /// The channel this store's waiters are told on.
    pub(crate) fn channel(&self) -> &str {
        &self.channel
    }

    /// Registers `token`'s waiter, after its attempt answered that it is queued; a message
    /// that arrived before is delivered now.
    ///
    /// With `confirm_first`, a hand-off is reported as [`Signal::Retry`], so that the waiter
    /// confirms the key (with the store's replica acknowledgement) before it runs.
    pub(crate) fn register(&self, token: &Token, confirm_first: bool) -> Option<QueueWatch> {
        let id: [u8; TOKEN_LEN] = token.as_bytes().try_into().ok()?;
        let (tx, rx) = mpsc::unbounded_channel();
        let mut registry = self.waiters.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((_, signal)) = registry.pending.remove(&id) {
            let _ = tx.send(signal);
        }
        registry.waiters.insert(id, tx);
        drop(registry);
        self.registered.fetch_add(1, Ordering::Relaxed);
        let signals = Registration {
            id,
            rx,
            waiters: Arc::clone(&self.waiters),
            registered: Arc::clone(&self.registered),
            confirm_first,
        };
        Some(QueueWatch::new(signals))
    }

    /// Whether `token`'s waiter is registered (so it may be queued already).
    pub(crate) fn is_registered(&self, token: &Token) -> bool {
        if self.registered.load(Ordering::Relaxed) == 0 {
            return false;
        }
        let Ok(id) = <[u8; TOKEN_LEN]>::try_from(token.as_bytes()) else {
            return false;
        };
        let registry = self.waiters.lock().unwrap_or_else(|p| p.into_inner());
        registry.waiters.contains_key(&id)
    }
}

/// A queue entry's stamp for an attempt sent now: microseconds since this process's origin,
/// 16 hex digits. The waiter is queued after this instant, so a hand-off to it is too.
pub(crate) fn stamp() -> [u8; STAMP_LEN] {
    let micros = u64::try_from(base().elapsed().as_micros()).unwrap_or(u64::MAX);
    let mut out = [0u8; STAMP_LEN];
    for (i, byte) in out.iter_mut().enumerate() {
        let nibble = (micros >> (4 * (STAMP_LEN - 1 - i))) & 0xf;
        *byte = b"0123456789abcdef"[nibble as usize];
    }
    out
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
    registered: Arc<AtomicUsize>,
    confirm_first: bool,
}

impl QueueSignals for Registration {
    fn poll_signal(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Signal> {
        match self.rx.poll_recv(cx) {
            Poll::Ready(Some(Signal::Granted { .. })) if self.confirm_first => {
                Poll::Ready(Signal::Retry)
            }
            Poll::Ready(Some(signal)) => Poll::Ready(signal),
            // Unregistered by the store going away: nothing more will come.
            Poll::Ready(None) | Poll::Pending => Poll::Pending,
        }
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        let mut registry = self.waiters.lock().unwrap_or_else(|p| p.into_inner());
        registry.waiters.remove(&self.id);
        registry.pending.remove(&self.id);
        drop(registry);
        self.registered.fetch_sub(1, Ordering::Relaxed);
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

async fn subscribe(
    client: Client,
    channel: Arc<str>,
    waiters: Waiters,
    live: Arc<AtomicBool>,
    mut stop: oneshot::Receiver<()>,
) {
    // Not live once this task is gone (its runtime shut down): waiters then stop queueing.
    struct Live(Arc<AtomicBool>);
    impl Drop for Live {
        fn drop(&mut self) {
            self.0.store(false, Ordering::Release);
        }
    }
    let live = Live(live);
    let live = &live.0;
    let retry_all = || {
        for tx in waiters
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .waiters
            .values()
        {
            let _ = tx.send(Signal::Retry);
        }
    };
    loop {
        let session = async {
            // RESP3, so that messages arrive as pushes, handled right in the connection's
            // reader task: one task wake-up fewer between the release and the waiter.
            let info = client.get_connection_info().clone();
            let settings = info
                .redis_settings()
                .clone()
                .set_protocol(ProtocolVersion::RESP3);
            let resp3 = Client::open(info.set_redis_settings(settings))?;
            let closed = Arc::new(Notify::new());
            let on_push = {
                let (waiters, closed) = (Arc::clone(&waiters), Arc::clone(&closed));
                move |push: PushInfo| -> Result<(), std::convert::Infallible> {
                    match (push.kind, push.data.get(1)) {
                        (PushKind::Message, Some(Value::BulkString(payload))) => {
                            let now = Instant::now();
                            match parse(payload, now) {
                                Some((id, signal)) => waiters
                                    .lock()
                                    .unwrap_or_else(|p| p.into_inner())
                                    .deliver(id, signal, now),
                                None => tracing::debug!("ignoring a malformed hand-off message"),
                            }
                        }
                        (PushKind::Disconnection, _) => closed.notify_one(),
                        _ => {}
                    }
                    Ok(())
                }
            };
            let config = AsyncConnectionConfig::new().set_push_sender(on_push);
            let mut conn = resp3
                .get_multiplexed_async_connection_with_config(&config)
                .await?;
            conn.subscribe(&*channel).await?;
            live.store(true, Ordering::Release);
            // Hand-offs sent while the subscription was down were lost: check again now.
            retry_all();
            tracing::debug!("listening for lock hand-offs");
            closed.notified().await;
            drop(conn);
            Ok::<(), redis::RedisError>(())
        };
        tokio::select! {
            _ = &mut stop => return,
            result = session => {
                live.store(false, Ordering::Release);
                // Hand-offs may have been missed: every waiter checks again now.
                retry_all();
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

    /// A hand-off can reach the process before the attempt's answer does: the waiter registers
    /// after, and still hears it.
    #[tokio::test]
    async fn a_message_before_registration_is_kept_for_the_waiter() {
        let handoff = Handoff::new(Client::open("redis://127.0.0.1:1/").unwrap());
        let token = Token::generate().unwrap();
        let id: [u8; TOKEN_LEN] = token.as_bytes().try_into().unwrap();
        let now = Instant::now();
        let granted = Signal::Granted {
            fencing_token: 7,
            valid_until: now + Duration::from_secs(1),
        };
        {
            let mut registry = handoff.waiters.lock().unwrap();
            registry.deliver(id, granted, now);
            // A later "next" does not replace the grant.
            registry.deliver(
                id,
                Signal::Next {
                    within: Duration::from_secs(1),
                },
                now,
            );
        }
        assert!(!handoff.is_registered(&token));
        let mut watch = handoff.register(&token, false).unwrap();
        assert!(handoff.is_registered(&token));
        assert_eq!(watch.signal().await, granted);
        drop(watch);
        assert!(!handoff.is_registered(&token));
        assert!(handoff.waiters.lock().unwrap().pending.is_empty());
    }

    #[test]
    fn stamps_are_16_hex_digits_and_increase() {
        let a = stamp();
        std::thread::sleep(Duration::from_millis(2));
        let b = stamp();
        assert!(a.iter().all(u8::is_ascii_hexdigit));
        assert!(b > a);
    }

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
