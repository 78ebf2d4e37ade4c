//! How long and how often to retry a contended lock.

use std::time::Duration;

use backon::{BackoffBuilder, ConstantBuilder, ExponentialBuilder};

use crate::error::ConfigError;

/// The wait policy: the delays between acquire attempts, and the total time to keep trying.
///
/// The delay schedules come from [`backon`]'s builders (constant and exponential, with its
/// jitter), the de-facto standard retry crate; a fixed list of delays is a plain iterator. The
/// deadline is enforced by the locker against the clock, round trips included, so a slow store
/// cannot stretch it.
///
/// | constructor | attempts |
/// |---|---|
/// | [`Wait::none`] | one; fail fast |
/// | [`Wait::constant`] | every `delay` until the deadline |
/// | [`Wait::exponential`] (the default) | `initial`, x`factor` each time up to `max`, plus jitter, until the deadline |
/// | [`Wait::fixed`] | after each listed delay in turn, then give up |
///
/// The default is `Wait::exponential(10 ms, 200 ms)` with jitter and a 2 s deadline.
///
/// ```
/// use std::time::Duration;
/// use tower_lock::Wait;
///
/// # fn main() -> Result<(), tower_lock::ConfigError> {
/// let fail_fast = Wait::none();
/// let patient = Wait::exponential(Duration::from_millis(5), Duration::from_millis(100))?
///     .deadline(Duration::from_secs(5));
/// let scripted = Wait::fixed([10, 50, 250].map(Duration::from_millis))?.jitter(true);
/// let singleton = Wait::constant(Duration::from_secs(1))?.forever();
/// # let _ = (fail_fast, patient, scripted, singleton);
/// # Ok(()) }
/// ```
///
/// A policy is checked when made: a delay of 0 (a busy loop), one over 365 days, a largest
/// delay below the first or a factor under 1 is a [`ConfigError`], so that every `Wait` a
/// layer, a call or a config is given can run.
///
/// With the `serde` feature a policy reads as `{ policy = "exponential", initial_ms = 10,
/// max_ms = 200, factor = 2.0, jitter = true, deadline_ms = 2000 }` (or `"none"`, `"constant"`
/// with `delay_ms`, `"fixed"` with `delays_ms`). An omitted `deadline_ms` is the policy's default
/// (0 for `none`, 2000 otherwise); `forever = true` never gives up.
#[derive(Debug, Clone, PartialEq)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Deserialize, serde::Serialize),
    serde(try_from = "WaitRepr", into = "WaitRepr")
)]
pub struct Wait {
    backoff: Backoff,
    /// `None`: retry forever.
    deadline: Option<Duration>,
}

#[cfg(feature = "serde")]
#[derive(serde::Deserialize, serde::Serialize)]
struct WaitRepr {
    #[serde(flatten)]
    backoff: Backoff,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    deadline_ms: Option<u64>,
    #[serde(default)]
    forever: bool,
}

/// A policy read from a file is checked as the constructors check one.
#[cfg(feature = "serde")]
impl TryFrom<WaitRepr> for Wait {
    type Error = ConfigError;

    fn try_from(repr: WaitRepr) -> Result<Self, ConfigError> {
        let default = match repr.backoff {
            Backoff::None => Duration::ZERO,
            _ => DEFAULT_DEADLINE,
        };
        Self {
            backoff: repr.backoff,
            deadline: (!repr.forever)
                .then(|| repr.deadline_ms.map_or(default, Duration::from_millis)),
        }
        .checked()
    }
}

#[cfg(feature = "serde")]
impl From<Wait> for WaitRepr {
    fn from(wait: Wait) -> Self {
        Self {
            backoff: wait.backoff,
            deadline_ms: wait
                .deadline
                .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
            forever: wait.deadline.is_none(),
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Deserialize, serde::Serialize),
    serde(tag = "policy", rename_all = "snake_case")
)]
enum Backoff {
    None,
    Constant {
        #[cfg_attr(
            feature = "serde",
            serde(rename = "delay_ms", with = "crate::serde_ms::ms")
        )]
        delay: Duration,
        #[cfg_attr(feature = "serde", serde(default))]
        jitter: bool,
    },
    Exponential {
        #[cfg_attr(
            feature = "serde",
            serde(rename = "initial_ms", with = "crate::serde_ms::ms")
        )]
        initial: Duration,
        #[cfg_attr(
            feature = "serde",
            serde(rename = "max_ms", with = "crate::serde_ms::ms")
        )]
        max: Duration,
        #[cfg_attr(feature = "serde", serde(default = "two"))]
        factor: f32,
        #[cfg_attr(feature = "serde", serde(default = "yes"))]
        jitter: bool,
    },
    Fixed {
        #[cfg_attr(
            feature = "serde",
            serde(rename = "delays_ms", with = "crate::serde_ms::ms_list")
        )]
        delays: Vec<Duration>,
        #[cfg_attr(feature = "serde", serde(default))]
        jitter: bool,
    },
}

#[cfg(feature = "serde")]
fn two() -> f32 {
    2.0
}

#[cfg(feature = "serde")]
fn yes() -> bool {
    true
}

const DEFAULT_DEADLINE: Duration = Duration::from_secs(2);

impl Default for Wait {
    fn default() -> Self {
        Self {
            backoff: Backoff::Exponential {
                initial: Duration::from_millis(10),
                max: Duration::from_millis(200),
                factor: 2.0,
                jitter: true,
            },
            deadline: Some(DEFAULT_DEADLINE),
        }
    }
}

impl Wait {
    /// One attempt; a held key answers 409 at once.
    pub fn none() -> Self {
        Self {
            backoff: Backoff::None,
            deadline: Some(Duration::ZERO),
        }
    }

    /// Retry every `delay` (no jitter unless [`jitter`](Self::jitter) is set), for 2 s.
    ///
    /// # Errors
    ///
    /// A [`ConfigError`] (setting `wait.delay`) for 0 (a busy loop: [`none`](Self::none) fails
    /// fast) or over 365 days.
    pub fn constant(delay: Duration) -> Result<Self, ConfigError> {
        Self {
            backoff: Backoff::Constant {
                delay,
                jitter: false,
            },
            deadline: Some(DEFAULT_DEADLINE),
        }
        .checked()
    }

    /// Retry after `initial`, doubling up to `max`, with jitter (a random extra of up to the
    /// delay itself, so contenders spread out), for 2 s.
    ///
    /// # Errors
    ///
    /// A [`ConfigError`] (setting `wait.initial` or `wait.max`) for an `initial` of 0, a `max`
    /// below it, or either over 365 days.
    pub fn exponential(initial: Duration, max: Duration) -> Result<Self, ConfigError> {
        Self {
            backoff: Backoff::Exponential {
                initial,
                max,
                factor: 2.0,
                jitter: true,
            },
            deadline: Some(DEFAULT_DEADLINE),
        }
        .checked()
    }

    /// Retry after each of `delays` in turn, then give up (or at the deadline, 2 s by default,
    /// whichever comes first).
    ///
    /// # Errors
    ///
    /// A [`ConfigError`] (setting `wait.delays`) for a delay of 0 or over 365 days.
    pub fn fixed(delays: impl IntoIterator<Item = Duration>) -> Result<Self, ConfigError> {
        Self {
            backoff: Backoff::Fixed {
                delays: delays.into_iter().collect(),
                jitter: false,
            },
            deadline: Some(DEFAULT_DEADLINE),
        }
        .checked()
    }

    /// `self` if it can run, else what is wrong with it.
    fn checked(self) -> Result<Self, ConfigError> {
        self.validate().map(|()| self)
    }

    /// Gives up once this much time has passed since the first attempt.
    #[must_use]
    pub fn deadline(mut self, deadline: Duration) -> Self {
        self.deadline = Some(deadline);
        self
    }

    /// Never gives up: for background work such as a singleton job, not for requests.
    #[must_use]
    pub fn forever(mut self) -> Self {
        self.deadline = None;
        self
    }

    /// The growth factor of an exponential policy (default 2).
    ///
    /// # Errors
    ///
    /// A [`ConfigError`] (setting `wait.factor`) for a factor under 1 or not finite, or on a
    /// policy that is not exponential (which has no factor to set).
    pub fn factor(mut self, new: f32) -> Result<Self, ConfigError> {
        match &mut self.backoff {
            Backoff::Exponential { factor, .. } => *factor = new,
            _ => {
                return Err(ConfigError::new(
                    "wait.factor",
                    "only an exponential policy has a growth factor",
                ));
            }
        }
        self.checked()
    }

    /// Adds a random extra of up to 100% to each delay (on for exponential by default).
    #[must_use]
    pub fn jitter(mut self, on: bool) -> Self {
        match &mut self.backoff {
            Backoff::None => {}
            Backoff::Constant { jitter, .. }
            | Backoff::Exponential { jitter, .. }
            | Backoff::Fixed { jitter, .. } => *jitter = on,
        }
        self
    }

    /// Whether a contended attempt is ever retried (false for [`none`](Self::none) and a
    /// deadline of zero).
    pub(crate) fn waits(&self) -> bool {
        !matches!(self.backoff, Backoff::None) && self.deadline != Some(Duration::ZERO)
    }

    /// How long the retry schedule itself lasts, when it runs out (a fixed list: the sum of its
    /// delays, doubled with jitter; `none`: zero); `None` for a schedule that never ends.
    /// A waiter queued for a hand-off waits no longer than this (or the deadline).
    pub(crate) fn schedule_len(&self) -> Option<Duration> {
        match &self.backoff {
            Backoff::None => Some(Duration::ZERO),
            Backoff::Fixed { delays, jitter } => {
                let sum = delays
                    .iter()
                    .fold(Duration::ZERO, |sum, d| sum.saturating_add(*d));
                Some(if *jitter { sum.saturating_mul(2) } else { sum })
            }
            _ => None,
        }
    }

    /// The total time to keep trying, `None` for forever.
    pub fn total(&self) -> Option<Duration> {
        self.deadline
    }

    /// Whether the policy can run (the constructors' checks, for a policy read with serde).
    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        let over_a_year = |field, delay| crate::config::at_most_a_year(field, delay);
        match &self.backoff {
            Backoff::None => Ok(()),
            Backoff::Constant { delay, .. } if delay.is_zero() => Err(ConfigError::new(
                "wait.delay",
                "a constant delay of 0 would retry in a busy loop; use Wait::none() to fail fast",
            )),
            Backoff::Constant { delay, .. } => over_a_year("wait.delay", *delay),
            Backoff::Exponential {
                initial,
                max,
                factor,
                ..
            } => {
                if initial.is_zero() {
                    Err(ConfigError::new(
                        "wait.initial",
                        "the first delay must be above 0",
                    ))
                } else if max < initial {
                    Err(ConfigError::new(
                        "wait.max",
                        "the largest delay is below the first",
                    ))
                } else if !factor.is_finite() || *factor < 1.0 {
                    Err(ConfigError::new(
                        "wait.factor",
                        "the factor must be a number >= 1",
                    ))
                } else {
                    over_a_year("wait.max", *max)
                }
            }
            Backoff::Fixed { delays, .. } if delays.iter().any(Duration::is_zero) => Err(
                ConfigError::new("wait.delays", "a delay of 0 would retry in a busy loop"),
            ),
            Backoff::Fixed { delays, .. } => delays
                .iter()
                .try_for_each(|delay| over_a_year("wait.delays", *delay)),
        }
    }

    /// The delays between attempts, drawn lazily (only contended requests pay for this).
    pub(crate) fn delays(&self) -> Box<dyn Iterator<Item = Duration> + Send> {
        match &self.backoff {
            Backoff::None => Box::new(std::iter::empty()),
            Backoff::Constant { delay, jitter } => {
                let builder = ConstantBuilder::new()
                    .with_delay(*delay)
                    .without_max_times();
                let builder = if *jitter {
                    builder.with_jitter()
                } else {
                    builder
                };
                Box::new(builder.build())
            }
            Backoff::Exponential {
                initial,
                max,
                factor,
                jitter,
            } => {
                let builder = ExponentialBuilder::new()
                    .with_min_delay(*initial)
                    .with_max_delay(*max)
                    .with_factor(*factor)
                    .without_max_times();
                let builder = if *jitter {
                    builder.with_jitter()
                } else {
                    builder
                };
                Box::new(builder.build())
            }
            Backoff::Fixed { delays, jitter } => {
                let jitter = *jitter;
                Box::new(delays.clone().into_iter().map(move |d| {
                    if jitter {
                        d.saturating_add(d.mul_f64(fastrand::f64()))
                    } else {
                        d
                    }
                }))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn schedules() {
        assert_eq!(Wait::none().delays().count(), 0);
        let c: Vec<_> = Wait::constant(5 * MS).unwrap().delays().take(3).collect();
        assert_eq!(c, [5 * MS; 3]);
        let e: Vec<_> = Wait::exponential(10 * MS, 40 * MS)
            .unwrap()
            .jitter(false)
            .delays()
            .take(5)
            .collect();
        // backon multiplies by an f32 factor; allow it a microsecond.
        for (got, want) in e.iter().zip([10 * MS, 20 * MS, 40 * MS, 40 * MS, 40 * MS]) {
            assert!(got.abs_diff(want) < Duration::from_micros(1), "{e:?}");
        }
        let f: Vec<_> = Wait::fixed([MS, 3 * MS]).unwrap().delays().collect();
        assert_eq!(f, [MS, 3 * MS]);
        for d in Wait::fixed([10 * MS; 50]).unwrap().jitter(true).delays() {
            assert!(d >= 10 * MS && d <= 20 * MS, "{d:?}");
        }
        for (i, d) in Wait::exponential(10 * MS, 40 * MS)
            .unwrap()
            .delays()
            .take(50)
            .enumerate()
        {
            let base = [10 * MS, 20 * MS, 40 * MS]
                .get(i)
                .copied()
                .unwrap_or(40 * MS);
            let slack = Duration::from_micros(1);
            assert!(d + slack >= base && d <= 2 * base + slack, "{d:?}");
        }
    }

    #[test]
    fn deadlines() {
        assert_eq!(Wait::none().total(), Some(Duration::ZERO));
        assert_eq!(Wait::default().total(), Some(Duration::from_secs(2)));
        assert_eq!(Wait::constant(MS).unwrap().forever().total(), None);
    }

    /// Refused when made: busy loops, delays that overflow the clock's arithmetic (a jittered
    /// `Duration::MAX` panicked in the first contended acquire), factors that shrink or are not
    /// numbers, a factor on a policy that has none.
    #[test]
    fn invalid_policies_are_refused_when_made() {
        let field = |made: Result<Wait, ConfigError>| made.unwrap_err().field();
        assert_eq!(field(Wait::constant(Duration::ZERO)), "wait.delay");
        assert_eq!(field(Wait::constant(Duration::MAX)), "wait.delay");
        assert_eq!(field(Wait::exponential(Duration::ZERO, MS)), "wait.initial");
        assert_eq!(field(Wait::exponential(2 * MS, MS)), "wait.max");
        assert_eq!(field(Wait::exponential(MS, Duration::MAX)), "wait.max");
        let exponential = || Wait::exponential(MS, MS).unwrap();
        assert_eq!(field(exponential().factor(0.5)), "wait.factor");
        assert_eq!(field(exponential().factor(f32::NAN)), "wait.factor");
        assert_eq!(
            field(Wait::constant(MS).unwrap().factor(3.0)),
            "wait.factor"
        );
        assert_eq!(field(Wait::fixed([MS, Duration::ZERO])), "wait.delays");
        assert_eq!(field(Wait::fixed([MS, Duration::MAX])), "wait.delays");
        assert!(Wait::default().validate().is_ok());
        assert!(exponential().factor(1.5).is_ok());
    }
}
