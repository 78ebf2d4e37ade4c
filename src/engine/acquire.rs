//! The acquire loop: the process-local queue, attempts paced by the wait policy, and the
//! store's hand-off queue; for one key or a set of them.
//!
//! A set is taken the way one key is, with three differences: it takes its turns in the
//! process-local queues one key after the other, in lock order; each attempt takes every key
//! or none (in one step where the store can); and, queued in a store that hands off, a signal
//! that a key was handed to it makes it try again at once (the attempt claims what was kept
//! for it, and the rest if they are free), and it tries again at least every renewal interval
//! meanwhile, which keeps what the queue kept for it. See `docs/DECISIONS.md`, "Sets of keys,
//! and waiting for them".

use std::{sync::Arc, time::Duration};

use tokio::time::Instant;

use super::{local::GaveUp, release::ReleaseOnDrop, state::Engine, terms::Terms};
use crate::{
    background::{bounded, sleep_until},
    config::MAX_DURATION,
    error::{ConfigError, LockError},
    key::{KeyRejection, KeySet, Share},
    lease::{Fences, Lease},
    store::{
        Attempt, Epoch, QueueWatch, ReleaseNotice, SetAttempt, Signal, StoreError, StoreErrorKind,
    },
    telemetry::{self, Chain, Op},
    token::Token,
    wait::Wait,
};

/// A key handed over by a release is run at once only with at least this much of its claim
/// window left; with less, the waiter confirms it (one more round trip) first.
const MIN_HANDED_OVER: Duration = Duration::from_millis(100);

/// Added to a claim window before the next waiter checks again, so that a claim in flight
/// lands first.
const NEXT_SLACK: Duration = Duration::from_millis(50);

/// A lease just acquired: what becomes a [`Hold`](super::hold::Hold).
pub(crate) struct Acquired {
    pub(crate) lease: Lease,
    pub(crate) release: ReleaseOnDrop,
    pub(crate) acquired_at: Instant,
    /// When the first attempt was made.
    pub(crate) requested_at: Instant,
    pub(crate) attempts: u32,
    /// When the first renewal is due, if sooner than usual: a key handed over by a release is
    /// only reserved for the claim window until that renewal confirms it.
    pub(crate) renew_by: Option<Instant>,
}

impl Acquired {
    /// How long the request waited for its lease.
    pub(crate) fn waited(&self) -> Duration {
        self.acquired_at
            .saturating_duration_since(self.requested_at)
    }
}

/// An attempt's answer, for one key or a set.
enum Answer {
    Acquired(Fences),
    /// The key at `blocked` (in lock order) is held elsewhere.
    Contended {
        expires_in: Option<Duration>,
        blocked: usize,
    },
    /// The same, and the caller is queued for it, as of the store's hand-off epoch `since`.
    Queued {
        expires_in: Option<Duration>,
        blocked: usize,
        since: Epoch,
    },
}

impl From<Attempt> for Answer {
    fn from(attempt: Attempt) -> Self {
        match attempt {
            Attempt::Acquired { fencing_token } => Self::Acquired(Fences::One(fencing_token)),
            Attempt::Contended { expires_in } => Self::Contended {
                expires_in,
                blocked: 0,
            },
            Attempt::Queued { expires_in, since } => Self::Queued {
                expires_in,
                blocked: 0,
                since,
            },
        }
    }
}

impl From<SetAttempt> for Answer {
    fn from(attempt: SetAttempt) -> Self {
        match attempt {
            SetAttempt::Acquired { fencing_tokens } => {
                Self::Acquired(Fences::Many(fencing_tokens.into_boxed_slice()))
            }
            SetAttempt::Contended {
                expires_in,
                blocked,
            } => Self::Contended {
                expires_in,
                blocked,
            },
            SetAttempt::Queued {
                expires_in,
                blocked,
                since,
            } => Self::Queued {
                expires_in,
                blocked,
                since,
            },
        }
    }
}

/// The permits of the key a request gave up on (`blocked`, in lock order; `None`: any of the
/// set's), when it asked for some of a key's permits: `None` for a plain key and for a key only
/// readers share (its capacity [`Share::READERS`]), whose contention is the plain kind.
fn permits_of(keys: &KeySet, blocked: Option<usize>) -> Option<u32> {
    let permits = |key: &crate::key::LockKey| {
        key.share()
            .map(|share| share.capacity())
            .filter(|&capacity| capacity != Share::READERS)
    };
    match blocked {
        Some(i) => keys.as_slice().get(i).and_then(permits),
        None => keys.iter().find_map(permits),
    }
}

/// Checks a set before anything is sent: at least one key, at most the config's `max_keys`.
fn check_keys(keys: &KeySet, max_keys: usize) -> Result<(), LockError> {
    if keys.is_empty() {
        return Err(KeyRejection::invalid("there is no lock key to acquire").into());
    }
    if keys.len() > max_keys {
        return Err(KeyRejection::invalid(format!(
            "{} lock keys at once; one lease may hold at most {max_keys}",
            keys.len()
        ))
        .into());
    }
    Ok(())
}

/// Tries until acquired, the wait policy gives up (409), or the store fails (503).
///
/// The release guard is armed whenever an attempt may have taken a key, so dropping this
/// future (or giving up on a timed-out attempt) schedules a token-checked release.
///
/// A [`Waiter`] goes through its steps: its turn in the process-local queue
/// ([`Waiter::local_turn`]), then attempts ([`Waiter::attempt`]), each followed, until one
/// acquires, by a wait ([`Waiter::wait`]) for the next: a hand-off signal, a release notice, or
/// the wait policy's next delay; the deadline ends it.
pub(crate) async fn acquire(
    engine: Arc<Engine>,
    keys: KeySet,
    terms: Terms,
) -> Result<Acquired, LockError> {
    let mut waiter = Waiter::new(&engine, keys, terms)?;
    waiter.local_turn(&engine).await?;
    loop {
        if let Some((fencing_token, valid_until)) = waiter.handed.take() {
            // Handed over: reserved for us until at least `valid_until`. With enough of it
            // left, run now and let the first renewal confirm; otherwise confirm first.
            if valid_until.saturating_duration_since(Instant::now()) >= MIN_HANDED_OVER {
                return Ok(waiter.handed_over(fencing_token, valid_until));
            }
        }
        match waiter.attempt().await? {
            Attempted::Acquired { fences, sent_at } => return Ok(waiter.acquired(fences, sent_at)),
            Attempted::NotYet(not_yet) => waiter.wait(not_yet).await?,
        }
    }
}

/// One acquire between its attempts: what it holds (the release guard, its place in the
/// store's queue) and what it has heard.
struct Waiter {
    terms: Terms,
    wait: Wait,
    /// When the acquire began; its deadline (`None`: waits forever); when a finite schedule of
    /// delays runs out.
    start: Instant,
    deadline: Option<Instant>,
    schedule_end: Option<Instant>,
    /// The least time an attempt is given, however close the deadline.
    floor: Duration,
    /// A lease on several keys.
    set: bool,
    /// The store's hand-off signals for this waiter, once an attempt queued it.
    queue: Option<QueueWatch>,
    /// Whether the last attempt left it queued in the store.
    queued: bool,
    /// A key handed to it by a release: its fencing token, and until when it is kept for it.
    handed: Option<(u64, Instant)>,
    /// The wait policy's delays, from the first wait on.
    delays: Option<Box<dyn Iterator<Item = Duration> + Send>>,
    attempts: u32,
    /// Releases what an attempt may have taken if the acquire ends without a lease. Last, so
    /// that it drops after `queue` (fields drop in order): the waiter leaves the store's
    /// signals before its release runs.
    guard: ReleaseOnDrop,
}

/// An attempt's outcome.
enum Attempted {
    Acquired { fences: Fences, sent_at: Instant },
    NotYet(NotYet),
}

/// An attempt that did not acquire: what the next wait goes by.
struct NotYet {
    /// How long the key (at `blocked`, in lock order) is held for, if known.
    expires_in: Option<Duration>,
    blocked: usize,
    /// The store's refusal, when it asked to be asked again (a slot in migration).
    refused: Option<StoreError>,
    /// The release notice registered before the attempt (stores that announce releases).
    released: Option<ReleaseNotice>,
}

/// The refusal of `setting` (permits, shared leases) on a store that cannot count a key's
/// holders: when a layer is built, or when a call asks for a share.
pub(crate) fn cannot_count(setting: &'static str) -> ConfigError {
    ConfigError::new(
        setting,
        "this store cannot count a key's holders (a RedlockStore, or a store written outside \
         tower-lock): take plain leases on it, or use a RedisStore, ClusterStore, SentinelStore \
         or MemoryStore",
    )
}

impl Waiter {
    /// Checks the keys and the store, and draws the token.
    fn new(engine: &Engine, keys: KeySet, terms: Terms) -> Result<Self, LockError> {
        let config = &engine.config;
        check_keys(&keys, config.max_keys())?;
        if keys.counted() && !engine.store.counts() {
            return Err(cannot_count("permits").into());
        }
        let token = Token::generate()?;
        let start = Instant::now();
        let wait = terms.wait(config).clone();
        let floor = config.store_timeout();
        let set = keys.as_one().is_none();
        Ok(Self {
            guard: ReleaseOnDrop::new(Arc::clone(&engine.store), keys, token, floor),
            // A deadline past what the clock can count (`Duration::MAX`) is none.
            deadline: wait.total().and_then(|d| start.checked_add(d)),
            schedule_end: wait.schedule_len().and_then(|d| start.checked_add(d)),
            wait,
            terms,
            start,
            floor,
            set,
            queue: None,
            queued: false,
            handed: None,
            delays: None,
            attempts: 0,
        })
    }

    /// Requests of this process that want the same key wait here, in order, and only the first
    /// contends in the store; a holder's release wakes the next at once. A set takes its turns
    /// one key after the other, in lock order.
    async fn local_turn(&mut self, engine: &Engine) -> Result<(), LockError> {
        let guard = &mut self.guard;
        match engine
            .local
            .turns(guard.keys(), self.deadline, self.floor)
            .await
        {
            Ok(turns) => {
                guard.set_turns(turns);
                Ok(())
            }
            Err(GaveUp::Held { holder_left }) => {
                let waited = self.start.elapsed();
                tracing::debug!(?waited, "lease contended in this process; giving up");
                telemetry::contended(guard.key().scope(), waited);
                // The holder's remaining lease, as the head of the local queue knows it: its
                // own lease, or the TTL the store reported for another holder. The head may not
                // have heard from the store yet: then the TTL, what it holds if it takes the key.
                Err(LockError::Contended {
                    expires_in: Some(holder_left.unwrap_or(self.terms.ttl)),
                    waited,
                    attempts: 0,
                    permits: permits_of(guard.keys(), None),
                })
            }
            // The turn never came because the store did not answer the request before this
            // one (or failed it): an outage, not contention.
            Err(GaveUp::Unavailable(error)) => {
                tracing::debug!(
                    error = %Chain(&error),
                    "lock store failed the request before this one in this process; giving up"
                );
                telemetry::store_error(guard.key().scope(), Op::Acquire);
                Err(error.into())
            }
        }
    }

    /// One attempt in the store, within what is left of the deadline (at least `floor`). With
    /// a store that hands off, a waiter joins the key's queue and is handed the key by the
    /// release before it; it registers to hear that once its attempt says it is queued.
    async fn attempt(&mut self) -> Result<Attempted, LockError> {
        self.attempts += 1;
        let (ttl, floor) = (self.terms.ttl, self.floor);
        let sent_at = Instant::now();
        let limit = self
            .deadline
            .map_or(floor, |d| d.saturating_duration_since(sent_at).max(floor));
        let guard = &mut self.guard;
        // Registered before the attempt, so a release right after it is not missed.
        let released = match self.queue {
            Some(_) => None,
            None => guard.store().watch_any(guard.keys()),
        };
        guard.arm_until(sent_at + guard.store().validity(ttl));
        guard.asking();
        let (store, token, waits) = (guard.store(), guard.token().clone(), self.wait.waits());
        let answer = match guard.keys().as_one() {
            Some(key) => bounded(limit, store.attempt(key.clone(), token, ttl, waits))
                .await
                .map(Answer::from),
            None => bounded(
                limit,
                store.attempt_set(guard.keys().clone(), token, ttl, waits),
            )
            .await
            .map(Answer::from),
        };
        telemetry::round_trip(Op::Acquire, sent_at.elapsed());
        let mut not_yet = NotYet {
            expires_in: None,
            blocked: 0,
            refused: None,
            released,
        };
        // The store answered (held, or queued), rather than failed.
        let answered = answer.is_ok();
        match answer {
            Ok(Answer::Acquired(fences)) => return Ok(Attempted::Acquired { fences, sent_at }),
            Ok(Answer::Contended {
                expires_in,
                blocked,
            }) => {
                // Not queued this time: the store could not queue it where anyone would hear
                // the hand-off (its subscription is down). Poll on the wait policy until an
                // attempt queues it again; the watch stays registered (the resubscription's
                // retry still wakes it), and so does the guard (an entry may be left).
                self.queued = false;
                (not_yet.expires_in, not_yet.blocked) = (expires_in, blocked);
            }
            Ok(Answer::Queued {
                expires_in,
                blocked,
                since,
            }) => {
                self.queued = true;
                if self.queue.is_none() {
                    // Told to check again at once if the store's signals changed course while
                    // the answer was on its way (a release meanwhile may have found nobody
                    // listening and dropped this entry).
                    self.queue = guard.store().queue_watch(guard.key(), guard.token(), since);
                }
                (not_yet.expires_in, not_yet.blocked) = (expires_in, blocked);
            }
            Err(error) => not_yet.refused = self.failed(error)?,
        }
        if answered {
            self.guard
                .held_elsewhere(not_yet.blocked, not_yet.expires_in);
        }
        // While queued, the key may be handed to us at any moment (and a set keeps what the
        // queue kept for it): stay armed, so that giving up (or being dropped) leaves the queue
        // or passes the keys on.
        self.guard.arm(self.queued || self.queue.is_some());
        Ok(Attempted::NotYet(not_yet))
    }

    /// A store error on an attempt: `Some` refusal to be asked again (waited out on the
    /// schedule, and answered at the deadline), `None` for an error waited out forever, or the
    /// 503 it ends in.
    fn failed(&mut self, error: StoreError) -> Result<Option<StoreError>, LockError> {
        let guard = &mut self.guard;
        telemetry::store_error(guard.key().scope(), Op::Acquire);
        guard.failed(&error);
        if error.kind() == StoreErrorKind::TryAgain {
            // Refused unrun, to be sent again shortly (a Redis Cluster slot in migration):
            // waited out like a held key, within the deadline. Nothing was written, so the
            // token and any place in the store's queue stand.
            tracing::debug!(
                attempts = self.attempts,
                error = %Chain(&error),
                "lock store asked to try again; retrying"
            );
            return Ok(Some(error));
        }
        if self.deadline.is_some() {
            // A bounded wait fails fast on any other store error (503). The armed guard
            // releases in case the command was executed after all (and leaves the queue).
            return Err(error.into());
        }
        // An unbounded one (background work) waits through the outage.
        tracing::warn!(
            attempts = self.attempts,
            error = %Chain(&error),
            "lock store failed while waiting forever; retrying"
        );
        // That release leaves the store's queue, or hands on a key handed to this token
        // meanwhile: go on with a fresh token, so that no message for the old one (a hand-off
        // given away already) can be taken for ours.
        guard.release_and_renew_token(Token::generate()?);
        self.queue = None;
        self.queued = false;
        self.handed = None;
        Ok(None)
    }

    /// Waits for the next attempt: a hand-off signal, a release, or the wait policy's next
    /// delay (a fallback timer for a lost message); or gives up at the deadline, as contended
    /// (409) or, after a refusal, as the refusal (503).
    async fn wait(&mut self, not_yet: NotYet) -> Result<(), LockError> {
        let NotYet {
            expires_in,
            blocked,
            refused,
            released,
        } = not_yet;
        let now = Instant::now();
        let next = self
            .delays
            .get_or_insert_with(|| self.wait.delays())
            .next()
            .map(|delay| now + delay.min(MAX_DURATION));
        let wake = match (next, self.deadline) {
            (Some(next), Some(deadline)) if now < deadline => next.min(deadline),
            (Some(next), None) => next,
            _ => return Err(self.give_up(now, expires_in, blocked, refused)),
        };
        // The timer is only the fallback, for a lost message: when the holder's lease would
        // run out, or at the deadline.
        let fallback = now + expires_in.unwrap_or(self.terms.ttl);
        let mut fallback = self.deadline.map_or(fallback, |d| fallback.min(d));
        if let Some(end) = self.schedule_end {
            // A finite schedule (a fixed list) bounds a queued wait too.
            fallback = fallback.min(end);
        }
        if self.set && self.queued {
            // What the queue keeps for a set lasts a TTL from each attempt: try again (and so
            // keep it) every renewal interval.
            fallback = fallback.min(now + self.terms.interval);
        }
        let attempts = self.attempts;
        match (&mut self.queue, released) {
            // After a refusal, the next attempt is due by the schedule, not at a release.
            _ if refused.is_some() => sleep_until(wake).await,
            (Some(watch), _) => {
                if self.queued {
                    tracing::debug!(attempts, "lease contended; queued for its hand-off");
                } else {
                    // Queued before, not by this attempt: poll on the wait policy meanwhile.
                    tracing::debug!(attempts, "lease contended; not queued, waiting");
                    fallback = fallback.min(wake);
                }
                self.handed = hand_off(watch, self.set, fallback).await;
            }
            // Woken by the release (a store that announces them).
            (_, Some(released)) => {
                tracing::debug!(attempts, "lease contended; waiting for its release");
                tokio::select! {
                    () = released => {}
                    () = sleep_until(fallback) => {}
                }
            }
            _ => {
                tracing::debug!(attempts, "lease contended; waiting");
                sleep_until(wake).await;
            }
        }
        Ok(())
    }

    /// Out of time: contended (409), or after a refusal, the refusal (503).
    fn give_up(
        &self,
        now: Instant,
        expires_in: Option<Duration>,
        blocked: usize,
        refused: Option<StoreError>,
    ) -> LockError {
        let attempts = self.attempts;
        if let Some(error) = refused {
            tracing::debug!(attempts, "lock store still asks to try again; giving up");
            return error.into();
        }
        let waited = now - self.start;
        tracing::debug!(attempts, ?waited, "lease contended; giving up");
        telemetry::contended(self.guard.key().scope(), waited);
        LockError::Contended {
            expires_in,
            waited,
            attempts,
            permits: permits_of(self.guard.keys(), Some(blocked)),
        }
    }

    /// The lease an attempt sent at `sent_at` acquired.
    fn acquired(self, fences: Fences, sent_at: Instant) -> Acquired {
        let waited = sent_at - self.start;
        tracing::debug!(attempts = self.attempts, ?waited, "lease acquired");
        let validity = self.guard.store().validity(self.terms.ttl);
        let lease = Lease::new(self.guard.keys().clone(), fences, sent_at, validity);
        self.into_acquired(lease, sent_at, None)
    }

    /// The lease a release handed to this waiter: held from now, reserved until `valid_until`,
    /// with the first renewal (the claim) due within a third of that.
    fn handed_over(self, fencing_token: u64, valid_until: Instant) -> Acquired {
        let now = Instant::now();
        let left = valid_until.saturating_duration_since(now);
        let waited = now - self.start;
        tracing::debug!(attempts = self.attempts, ?waited, "lease handed over");
        let lease = Lease::new(self.guard.keys().clone(), fencing_token, now, left);
        self.into_acquired(lease, now, Some(now + left / 3))
    }

    /// `lease`, held from `at`: counted, its release guard told, and answered with the guard.
    fn into_acquired(mut self, lease: Lease, at: Instant, renew_by: Option<Instant>) -> Acquired {
        telemetry::acquired(self.guard.key().scope(), at - self.start);
        self.guard.held(at, &lease);
        Acquired {
            lease,
            release: self.guard,
            acquired_at: at,
            requested_at: self.start,
            attempts: self.attempts,
            renew_by,
        }
    }
}

/// Waits on the store's hand-off signals until one calls for an attempt, or `fallback`: the key
/// handed to a lone key's waiter (its fencing token and until when it is kept), or `None` to
/// try again (a set's key handed over, which the attempt claims; any other signal; the timer).
async fn hand_off(
    watch: &mut QueueWatch,
    set: bool,
    mut fallback: Instant,
) -> Option<(u64, Instant)> {
    loop {
        tokio::select! {
            signal = watch.signal() => match signal {
                // A key of the set was handed over: try again now, which claims it (and the
                // rest, if they are free).
                Signal::Granted { .. } if set => return None,
                Signal::Granted { fencing_token, valid_until } => {
                    return Some((fencing_token, valid_until));
                }
                // The waiter before us was just handed the key: if it never claims it (its
                // process died), check again after the window.
                Signal::Next { within } => {
                    fallback = fallback.min(Instant::now() + within + NEXT_SLACK);
                }
                _ => return None,
            },
            () = sleep_until(fallback) => return None,
        }
    }
}
