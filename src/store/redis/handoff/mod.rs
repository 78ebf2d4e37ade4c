//! Hand-off signals for [`RedisStore`](super::RedisStore) and
//! [`SentinelStore`](super::SentinelStore), over pub/sub.
//!
//! With hand-off on, a waiter that finds its key held joins the key's queue in Redis (see
//! `scripts/handoff.lua`), and a release gives the key straight to the head of the queue and
//! publishes that on the head's channel. Every store has a channel of its own, subscribed on a
//! RESP3 connection of its own, whose reader task passes each message straight to the one
//! waiter it is for.
//!
//! The subscription follows the store: it is on the server the store's calls go to (its
//! *target*), and a `SentinelStore` that follows a failover moves it to the new master
//! ([`Handoff::retarget`]). It runs on a thread of its own (one per store, with its clones),
//! never as a task of a runtime that uses the store: such a runtime may shut down, or stop being
//! driven, while the store lives on.

use std::{
    collections::HashMap,
    fmt,
    pin::Pin,
    sync::{
        Arc, Mutex, OnceLock,
        atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering},
    },
    task::{Context, Poll},
    time::Duration,
};

use redis::{AsyncConnectionConfig, Client, ProtocolVersion, PushInfo, PushKind, Value};
use tokio::{
    sync::{Notify, mpsc, watch},
    time::Instant,
};

use crate::store::{Epoch, QueueSignals, QueueWatch, Signal};
use crate::{telemetry::Chain, token::Token};

/// How long to wait before subscribing again after the connection broke; also the least time
/// between two resubscriptions asked for by [`Handoff::resubscribe`].
const RESUBSCRIBE_AFTER: Duration = Duration::from_secs(1);

/// How long a waiter's attempt waits for a subscription that is being made (just started, or
/// moved to a new master) before it goes on without queueing.
const SUBSCRIBE_WAIT: Duration = Duration::from_millis(250);

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
    /// How many times every registered waiter was told to check again (the subscription broke,
    /// came back, or moved): bumped under this lock, read without it before an attempt.
    epoch: Arc<AtomicU64>,
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

    /// Has every waiter check again now (hand-offs may have been missed, or their queue entries
    /// may be on a server the store no longer uses), and starts a new epoch, so that a waiter
    /// whose attempt was on its way meanwhile checks again when it registers.
    fn retry_all(&self) {
        self.epoch.fetch_add(1, Ordering::AcqRel);
        for tx in self.waiters.values() {
            let _ = tx.send(Signal::Retry);
        }
    }
}

/// Where the subscription goes: the server the store's calls go to now.
#[derive(Clone)]
struct Target {
    client: Client,
    /// Counts the subscriptions asked for: bumped by every start of the subscriber task and
    /// every [`retarget`](Handoff::retarget) or [`resubscribe`](Handoff::resubscribe).
    generation: u64,
}

/// What the stores and the subscriber task share about the subscription.
#[derive(Default)]
struct State {
    /// The [`Target`]'s generation, readable without the channel's lock.
    generation: AtomicU64,
    /// The generation the subscription is up for (0: none). Only a subscription up for the
    /// current generation counts: one to a server the store has left does not.
    live: AtomicU64,
    /// Whether a subscriber runs (cleared when it ends, however: also when its thread
    /// shuts down).
    running: AtomicBool,
    /// When a resubscription was last asked for.
    last_resubscribe: Mutex<Option<Instant>>,
}

pub(crate) struct Handoff {
    /// The subscription's target. The subscriber task watches it, and stops when it is dropped
    /// (with the last clone of the store).
    target: watch::Sender<Target>,
    /// The latest generation whose first subscription attempt has ended, up or not.
    settled: watch::Sender<u64>,
    channel: Arc<str>,
    waiters: Waiters,
    /// The registry's epoch, read without its lock.
    epoch: Arc<AtomicU64>,
    /// How many waiters are registered (to skip the lock when none are).
    registered: Arc<AtomicUsize>,
    state: Arc<State>,
}

impl Handoff {
    /// A hand-off receiver on a fresh channel, `tower-lock:handoff:<random>`, that will
    /// subscribe on `client`'s server. Nothing runs until [`ensure_running`](Self::ensure_running).
    pub(crate) fn new(client: Client) -> Arc<Self> {
        let id = Token::generate().map_or_else(
            // Without randomness, still unique within the process (lock tokens would fail
            // anyway, so no lease is ever queued under this name).
            |_| format!("pid-{}", std::process::id()),
            |t| String::from_utf8_lossy(t.as_bytes()).into_owned(),
        );
        let epoch = Arc::new(AtomicU64::new(0));
        let registry = Registry {
            epoch: Arc::clone(&epoch),
            ..Registry::default()
        };
        Arc::new(Self {
            target: watch::Sender::new(Target {
                client,
                generation: 0,
            }),
            settled: watch::Sender::new(0),
            channel: Arc::from(format!("tower-lock:handoff:{id}")),
            waiters: Arc::new(Mutex::new(registry)),
            epoch,
            registered: Arc::default(),
            state: Arc::default(),
        })
    }

    /// Starts the subscriber, unless it runs already: a thread of its own, with a
    /// current-thread Tokio runtime that runs the subscription and its connection, so that
    /// hand-offs reach this process's waiters whatever becomes of the runtimes that use the
    /// store (one may shut down, or no longer be driven: a current-thread runtime whose
    /// `block_on` returned). The thread ends with the store (its last clone).
    pub(crate) fn ensure_running(&self) {
        if self.state.running.load(Ordering::Acquire)
            || self.state.running.swap(true, Ordering::AcqRel)
        {
            return;
        }
        self.bump(None);
        // Made before the thread, so that the flag is cleared however it ends (the thread
        // could not start, the runtime could not be built, the subscriber panicked).
        let running = Running {
            state: Arc::clone(&self.state),
            waiters: Arc::clone(&self.waiters),
        };
        let subscriber = subscribe(
            self.target.subscribe(),
            self.settled.clone(),
            Arc::clone(&self.channel),
            Arc::clone(&self.waiters),
            Arc::clone(&self.state),
            running,
        );
        let started = std::thread::Builder::new()
            .name("tower-lock-handoff".to_owned())
            .spawn(move || {
                match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(runtime) => runtime.block_on(subscriber),
                    Err(error) => tracing::warn!(
                        error = %Chain(&error),
                        "cannot start the lock hand-off's runtime; waiters use their timers"
                    ),
                }
            });
        if let Err(error) = started {
            tracing::warn!(
                error = %Chain(&error),
                "cannot start the lock hand-off's thread; waiters use their timers"
            );
        }
    }

    /// Moves the subscription to `client`'s server (the master a `SentinelStore` follows now):
    /// from now on waiters do not queue until it is up there, and then every waiter checks
    /// again (its queue entry may not have reached the new master).
    #[cfg(feature = "sentinel")]
    pub(crate) fn retarget(&self, client: Client) {
        self.bump(Some(client));
    }

    /// Subscribes again, to the same address, after an attempt found that the subscription is
    /// not on the server the store's calls reach (an address that moved to another server);
    /// at most once per [`RESUBSCRIBE_AFTER`]. Whether it did.
    pub(crate) fn resubscribe(&self) -> bool {
        {
            let mut last = self
                .state
                .last_resubscribe
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            let now = Instant::now();
            if last.is_some_and(|at| now.saturating_duration_since(at) < RESUBSCRIBE_AFTER) {
                return false;
            }
            *last = Some(now);
        }
        tracing::debug!(
            "the hand-off subscription is not on the store's server; subscribing again"
        );
        self.bump(None);
        true
    }

    /// A new generation of the target (with `client`, if given): the subscription up now no
    /// longer counts, and the subscriber task (if any) makes a new one.
    fn bump(&self, client: Option<Client>) {
        self.target.send_modify(|target| {
            if let Some(client) = client {
                target.client = client;
            }
            target.generation += 1;
            self.state
                .generation
                .store(target.generation, Ordering::Release);
        });
    }

    /// Whether the subscription is up on the store's server, so that hand-offs will reach this
    /// process.
    pub(crate) fn is_live(&self) -> bool {
        let live = self.state.live.load(Ordering::Acquire);
        live != 0 && live == self.state.generation.load(Ordering::Acquire)
    }

    /// Whether waiters may queue now: starts the subscriber again if it is not running (its
    /// thread ended), and when a subscription is being made (just started, or moved to a new
    /// master), waits for it, at most [`SUBSCRIBE_WAIT`].
    pub(crate) async fn ready(&self) -> bool {
        self.ensure_running();
        if self.is_live() {
            return true;
        }
        if !self.state.running.load(Ordering::Acquire) {
            return false;
        }
        let generation = self.state.generation.load(Ordering::Acquire);
        let mut settled = self.settled.subscribe();
        let _ = crate::background::timeout(SUBSCRIBE_WAIT, settled.wait_for(|&g| g >= generation))
            .await;
        self.is_live()
    }

    /// The epoch now: read before an attempt that may queue, and passed to
    /// [`register`](Self::register) with its answer.
    pub(crate) fn epoch(&self) -> Epoch {
        Epoch(self.epoch.load(Ordering::Acquire))
    }

    /// The channel this store's waiters are told on, shared (no copy), for a queue entry.
    pub(crate) fn channel_arc(&self) -> Arc<str> {
        Arc::clone(&self.channel)
    }

    /// Registers `token`'s waiter, after its attempt, sent in epoch `since`, answered that it
    /// is queued; a message that arrived before is delivered now.
    ///
    /// If every waiter was told to check again since (the subscription broke, came back or
    /// moved while the answer was on its way), this one is told too: a release in between may
    /// have found nobody listening on the channel and dropped its entry as a dead waiter's, and
    /// nothing else would wake it before its fallback timer.
    ///
    /// With `confirm_first`, a hand-off is reported as [`Signal::Retry`], so that the waiter
    /// confirms the key (with the store's replica acknowledgement) before it runs.
    pub(crate) fn register(
        &self,
        token: &Token,
        since: Epoch,
        confirm_first: bool,
    ) -> Option<QueueWatch> {
        let id: [u8; TOKEN_LEN] = token.as_bytes().try_into().ok()?;
        let (tx, rx) = mpsc::unbounded_channel();
        let mut registry = self.waiters.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((_, signal)) = registry.pending.remove(&id) {
            let _ = tx.send(signal);
        }
        // Compared under the lock that every `retry_all` holds: exact.
        if registry.epoch.load(Ordering::Acquire) != since.0 {
            let _ = tx.send(Signal::Retry);
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

    /// Whether `token`'s waiter is registered, so that it may be queued already: its attempts
    /// then look for its entry before adding one. Registrations outlive a move to another
    /// master (one `Handoff` serves every master a `SentinelStore` follows), so a waiter whose
    /// entry did not reach the new master is queued there again, once.
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

/// Held by the subscriber: when it ends (the store went away, or its thread failed), the
/// subscription is down and the next caller may start another.
struct Running {
    state: Arc<State>,
    waiters: Waiters,
}

impl Drop for Running {
    fn drop(&mut self) {
        self.state.live.store(0, Ordering::Release);
        self.state.running.store(false, Ordering::Release);
        // Waiters would hear nothing more: they check again, and their attempt starts a new
        // subscriber.
        self.waiters
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retry_all();
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

/// The subscriber task: subscribes on the target's server, again when the connection breaks
/// (after [`RESUBSCRIBE_AFTER`]) and at once when the target changes; ends when the `Handoff`
/// is dropped (with the last clone of its store).
/// What the subscription's connection does with each push, right in its reader task: a
/// hand-off message delivered to its waiter, a disconnection notified to `closed`.
fn on_push(
    waiters: Waiters,
    closed: Arc<Notify>,
) -> impl Fn(PushInfo) -> Result<(), std::convert::Infallible> + Send + Sync + 'static {
    move |push: PushInfo| {
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
}

async fn subscribe(
    mut target: watch::Receiver<Target>,
    settled: watch::Sender<u64>,
    channel: Arc<str>,
    waiters: Waiters,
    state: Arc<State>,
    _running: Running,
) {
    let retry_all = || {
        waiters
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retry_all();
    };
    // The first attempt for `generation` has ended: callers waiting for it go on.
    let settle = |generation: u64| {
        settled.send_if_modified(|g| {
            let newer = *g < generation;
            if newer {
                *g = generation;
            }
            newer
        });
    };
    loop {
        let Target { client, generation } = target.borrow_and_update().clone();
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
            let on_push = on_push(Arc::clone(&waiters), Arc::clone(&closed));
            let config = AsyncConnectionConfig::new().set_push_sender(on_push);
            let mut conn = resp3
                .get_multiplexed_async_connection_with_config(&config)
                .await?;
            conn.subscribe(&*channel).await?;
            state.live.store(generation, Ordering::Release);
            settle(generation);
            // Hand-offs sent while the subscription was down were lost, and after a move to
            // a new master the waiters' queue entries may not be there: check again now.
            retry_all();
            tracing::debug!("listening for lock hand-offs");
            closed.notified().await;
            drop(conn);
            Ok::<(), redis::RedisError>(())
        };
        let moved = tokio::select! {
            changed = target.changed() => {
                if changed.is_err() {
                    // The store is gone.
                    return;
                }
                true
            }
            result = session => {
                match result {
                    Ok(()) => tracing::debug!("hand-off subscription closed; subscribing again"),
                    Err(error) => tracing::debug!(
                        error = %Chain(&error),
                        "hand-off subscription failed; waiters use their timers meanwhile"
                    ),
                }
                false
            }
        };
        // Down, unless a newer subscription counts already.
        let _ = state
            .live
            .compare_exchange(generation, 0, Ordering::AcqRel, Ordering::Acquire);
        settle(generation);
        if moved {
            // The new target's subscription has every waiter check again once it is up (or
            // once it failed).
            tracing::debug!("hand-off subscription moving to the store's new server");
            continue;
        }
        // Hand-offs may have been missed: every waiter checks again now.
        retry_all();
        tokio::select! {
            changed = target.changed() => {
                if changed.is_err() {
                    return;
                }
            }
            () = tokio::time::sleep(RESUBSCRIBE_AFTER) => {}
        }
    }
}

#[cfg(test)]
mod tests;
