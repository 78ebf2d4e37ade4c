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

use tokio::time::{Instant, sleep_until, timeout};

use super::{local::GaveUp, release::ReleaseOnDrop, state::Engine, terms::Terms};
use crate::{
    error::{ConfigError, LockError},
    key::{KeyRejection, KeySet, Share},
    lease::{Fences, Lease},
    store::{Attempt, Epoch, SetAttempt, Signal, StoreError, StoreErrorKind},
    telemetry::{self, Chain, Op},
    token::Token,
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
pub(crate) async fn acquire(
    engine: Arc<Engine>,
    keys: KeySet,
    terms: Terms,
) -> Result<Acquired, LockError> {
    let config = &engine.config;
    check_keys(&keys, config.max_keys())?;
    if keys.counted() && !engine.store.counts() {
        return Err(ConfigError::new(
            "permits",
            "this store cannot count a key's holders (a RedlockStore, or a store written outside \
             tower-lock): take plain leases on it, or use a RedisStore, ClusterStore, \
             SentinelStore or MemoryStore",
        )
        .into());
    }
    let token = Token::generate()?;
    let start = Instant::now();
    let wait = terms.wait(config);
    let deadline = wait.total().map(|d| start + d);
    let ttl = terms.ttl;
    let floor = config.store_timeout();
    let set = keys.as_one().is_none();
    let mut guard = ReleaseOnDrop::new(Arc::clone(&engine.store), keys, token, floor);
    // Requests of this process that want the same key wait here, in order, and only the first
    // contends in the store; a holder's release wakes the next at once. A set takes its turns
    // one key after the other, in lock order.
    match engine.local.turns(guard.keys(), deadline, floor).await {
        Ok(turns) => guard.set_turns(turns),
        Err(GaveUp::Held { holder_left }) => {
            let waited = start.elapsed();
            tracing::debug!(?waited, "lease contended in this process; giving up");
            telemetry::contended(&guard.key().scope_label(), waited);
            // The holder's remaining lease, as the head of the local queue knows it: its own
            // lease, or the TTL the store reported for another holder. The head may not have
            // heard from the store yet: then the TTL, what it holds if it takes the key.
            return Err(LockError::Contended {
                expires_in: Some(holder_left.unwrap_or(ttl)),
                waited,
                attempts: 0,
                permits: permits_of(guard.keys(), None),
            });
        }
        // The turn never came because the store did not answer the request before this one
        // (or failed it): an outage, not contention.
        Err(GaveUp::Unavailable(error)) => {
            tracing::debug!(
                error = %Chain(&error),
                "lock store failed the request before this one in this process; giving up"
            );
            telemetry::store_error(&guard.key().scope_label(), Op::Acquire);
            return Err(error.into());
        }
    }
    // With a store that hands off, a waiter joins the key's queue and is handed the key by the
    // release before it; it registers to hear that once its attempt says it is queued.
    let waits = wait.waits();
    let schedule_end = wait.schedule_len().map(|d| start + d);
    let mut queue = None;
    let mut queued = false;
    let mut handed: Option<(u64, Instant)> = None;
    let mut delays = None;
    let mut attempts = 0u32;
    loop {
        if let Some((fencing_token, valid_until)) = handed.take() {
            // Handed over: reserved for us until at least `valid_until`. With enough of it
            // left, run now and let the first renewal confirm; otherwise confirm first.
            if valid_until.saturating_duration_since(Instant::now()) >= MIN_HANDED_OVER {
                return Ok(handed_over(
                    guard,
                    fencing_token,
                    valid_until,
                    start,
                    attempts,
                ));
            }
        }
        attempts += 1;
        let sent_at = Instant::now();
        let limit = deadline.map_or(floor, |d| d.saturating_duration_since(sent_at).max(floor));
        // Registered before the attempt, so a release right after it is not missed.
        let released = match queue {
            Some(_) => None,
            None => guard.store().watch_any(guard.keys()),
        };
        guard.arm_until(sent_at + guard.store().validity(ttl));
        guard.asking();
        let (store, token) = (guard.store(), guard.token().clone());
        let answer = match guard.keys().as_one() {
            Some(key) => timeout(limit, store.attempt(key.clone(), token, ttl, waits))
                .await
                .map(|answer| answer.map(Answer::from)),
            None => timeout(
                limit,
                store.attempt_set(guard.keys().clone(), token, ttl, waits),
            )
            .await
            .map(|answer| answer.map(Answer::from)),
        }
        .unwrap_or_else(|_| Err(StoreError::timeout(limit)));
        telemetry::round_trip(Op::Acquire, sent_at.elapsed());
        // The store's refusal of this attempt, when it asked to be asked again.
        let mut refused = None;
        let mut blocked = 0;
        // The store answered (held, or queued), rather than failed.
        let answered = answer.is_ok();
        let expires_in = match answer {
            Ok(Answer::Acquired(fences)) => {
                let waited = sent_at - start;
                tracing::debug!(attempts, ?waited, "lease acquired");
                telemetry::acquired(&guard.key().scope_label(), waited);
                let lease = Lease::new(
                    guard.keys().clone(),
                    fences,
                    sent_at,
                    guard.store().validity(ttl),
                );
                guard.held(sent_at, &lease);
                return Ok(Acquired {
                    lease,
                    release: guard,
                    acquired_at: sent_at,
                    requested_at: start,
                    attempts,
                    renew_by: None,
                });
            }
            Ok(Answer::Contended {
                expires_in,
                blocked: at,
            }) => {
                blocked = at;
                // Not queued this time: the store could not queue it where anyone would hear
                // the hand-off (its subscription is down). Poll on the wait policy until an
                // attempt queues it again; the watch stays registered (the resubscription's
                // retry still wakes it), and so does the guard (an entry may be left).
                queued = false;
                expires_in
            }
            Ok(Answer::Queued {
                expires_in,
                blocked: at,
                since,
            }) => {
                blocked = at;
                queued = true;
                if queue.is_none() {
                    // Told to check again at once if the store's signals changed course while
                    // the answer was on its way (a release meanwhile may have found nobody
                    // listening and dropped this entry).
                    queue = guard.store().queue_watch(guard.key(), guard.token(), since);
                }
                expires_in
            }
            // Refused unrun, to be sent again shortly (a Redis Cluster slot in migration):
            // waited out like a held key, within the deadline. Nothing was written, so the
            // token and any place in the store's queue stand.
            Err(error) if error.kind() == StoreErrorKind::TryAgain => {
                telemetry::store_error(&guard.key().scope_label(), Op::Acquire);
                tracing::debug!(
                    attempts,
                    error = %Chain(&error),
                    "lock store asked to try again; retrying"
                );
                guard.failed(&error);
                refused = Some(error);
                None
            }
            // A bounded wait fails fast on any other store error (503). The armed guard
            // releases in case the command was executed after all (and leaves the queue).
            Err(error) if deadline.is_some() => {
                telemetry::store_error(&guard.key().scope_label(), Op::Acquire);
                guard.failed(&error);
                return Err(error.into());
            }
            // An unbounded one (background work) waits through the outage.
            Err(error) => {
                telemetry::store_error(&guard.key().scope_label(), Op::Acquire);
                tracing::warn!(
                    attempts,
                    error = %Chain(&error),
                    "lock store failed while waiting forever; retrying"
                );
                // That release leaves the store's queue, or hands on a key handed to this
                // token meanwhile: go on with a fresh token, so that no message for the old one
                // (a hand-off given away already) can be taken for ours.
                guard.failed(&error);
                guard.release_and_renew_token(Token::generate()?);
                queue = None;
                queued = false;
                handed = None;
                None
            }
        };
        if answered {
            guard.held_elsewhere(blocked, expires_in);
        }
        // While queued, the key may be handed to us at any moment (and a set keeps what the
        // queue kept for it): stay armed, so that giving up (or being dropped) leaves the queue
        // or passes the keys on.
        guard.arm(queued || queue.is_some());
        let now = Instant::now();
        let next = delays
            .get_or_insert_with(|| wait.delays())
            .next()
            .map(|delay| now + delay);
        let wake = match (next, deadline) {
            (Some(next), Some(deadline)) if now < deadline => next.min(deadline),
            (Some(next), None) => next,
            _ => {
                // Out of time after a refusal: answer as the refusal would (503).
                if let Some(error) = refused {
                    tracing::debug!(attempts, "lock store still asks to try again; giving up");
                    return Err(error.into());
                }
                let waited = now - start;
                tracing::debug!(attempts, ?waited, "lease contended; giving up");
                telemetry::contended(&guard.key().scope_label(), waited);
                return Err(LockError::Contended {
                    expires_in,
                    waited,
                    attempts,
                    permits: permits_of(guard.keys(), Some(blocked)),
                });
            }
        };
        // The timer is only the fallback, for a lost message: when the holder's lease would
        // run out, or at the deadline.
        let fallback = now + expires_in.unwrap_or(ttl);
        let mut fallback = deadline.map_or(fallback, |d| fallback.min(d));
        if let Some(end) = schedule_end {
            // A finite schedule (a fixed list) bounds a queued wait too.
            fallback = fallback.min(end);
        }
        if set && queued {
            // What the queue keeps for a set lasts a TTL from each attempt: try again (and so
            // keep it) every renewal interval.
            fallback = fallback.min(now + terms.interval);
        }
        match (&mut queue, released) {
            // After a refusal, the next attempt is due by the schedule, not at a release.
            _ if refused.is_some() => sleep_until(wake).await,
            (Some(watch), _) => {
                if queued {
                    tracing::debug!(attempts, "lease contended; queued for its hand-off");
                } else {
                    // Queued before, not by this attempt: poll on the wait policy meanwhile.
                    tracing::debug!(attempts, "lease contended; not queued, waiting");
                    fallback = fallback.min(wake);
                }
                loop {
                    tokio::select! {
                        signal = watch.signal() => match signal {
                            // A key of the set was handed over: try again now, which claims it
                            // (and the rest, if they are free).
                            Signal::Granted { .. } if set => break,
                            Signal::Granted { fencing_token, valid_until } => {
                                handed = Some((fencing_token, valid_until));
                                break;
                            }
                            // The waiter before us was just handed the key: if it never claims
                            // it (its process died), check again after the window.
                            Signal::Next { within } => {
                                let by = Instant::now() + within + NEXT_SLACK;
                                fallback = fallback.min(by);
                            }
                            _ => break,
                        },
                        () = sleep_until(fallback) => break,
                    }
                }
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
    }
}

/// The lease a release handed to this waiter: held from now, reserved until `valid_until`, with
/// the first renewal (the claim) due within a third of that.
fn handed_over(
    mut guard: ReleaseOnDrop,
    fencing_token: u64,
    valid_until: Instant,
    requested_at: Instant,
    attempts: u32,
) -> Acquired {
    let now = Instant::now();
    let left = valid_until.saturating_duration_since(now);
    let waited = now - requested_at;
    tracing::debug!(attempts, ?waited, "lease handed over");
    telemetry::acquired(&guard.key().scope_label(), waited);
    let lease = Lease::new(guard.keys().clone(), fencing_token, now, left);
    guard.held(now, &lease);
    Acquired {
        lease,
        release: guard,
        acquired_at: now,
        requested_at,
        attempts,
        renew_by: Some(now + left / 3),
    }
}
