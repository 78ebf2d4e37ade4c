//! How a locked request or lease ended: the span's `outcome` field, one vocabulary for
//! `LockLayer`, `IdempotencyLayer` and `Locker`.

use crate::error::LockError;

/// The `outcome` a `lock` span closes with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// The handler finished under its lease.
    Completed,
    /// The handler finished, but the lease was lost while it ran (`OnLeaseLost::Continue`).
    CompletedLeaseLost,
    /// The inner service returned an error.
    Failed,
    /// The lease was lost and the request aborted.
    LeaseLost,
    /// The request or guard was dropped while it held (or was acquiring) the lease.
    Dropped,
    /// A background lease released by its holder.
    Released,
    /// The wait ran out while someone else held the key.
    Contended,
    /// The store failed or did not answer.
    StoreError,
    /// The key could not be derived from the request.
    BadKey,
    /// The request could not be read (its body).
    BadRequest,
    /// The handler ran and its response was recorded for replay.
    Stored,
    /// The handler ran and its response was not recorded (a retry runs it again).
    NotStored,
    /// A recorded response was replayed.
    Replayed,
    /// The key was reused for a different request (422).
    KeyReused,
}

impl Outcome {
    /// The outcome of a request that did not get its lease, or lost it.
    pub(crate) fn of(error: &LockError) -> Self {
        match error {
            LockError::Contended { .. } => Self::Contended,
            LockError::Store(_) => Self::StoreError,
            LockError::LeaseLost(_) => Self::LeaseLost,
            LockError::Key(_) | LockError::Config(_) => Self::BadKey,
        }
    }

    /// The span field's value.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::Completed => "completed",
            Self::CompletedLeaseLost => "completed_lease_lost",
            Self::Failed => "failed",
            Self::LeaseLost => "lease_lost",
            Self::Dropped => "dropped",
            Self::Released => "released",
            Self::Contended => "contended",
            Self::StoreError => "store_error",
            Self::BadKey => "bad_key",
            Self::BadRequest => "bad_request",
            Self::Stored => "stored",
            Self::NotStored => "not_stored",
            Self::Replayed => "replayed",
            Self::KeyReused => "key_reused",
        }
    }
}

/// `docs/OBSERVABILITY.md`'s table of outcomes, read for the tests that keep it true.
#[cfg(test)]
pub(crate) mod documented {
    /// Who records an outcome: the table's columns.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub(crate) enum Recorder {
        LockLayer = 0,
        IdempotencyLayer = 1,
        Locker = 2,
    }

    /// Each outcome of the table, and whether each [`Recorder`] records it.
    pub(crate) fn outcomes() -> Vec<(String, [bool; 3])> {
        let doc = include_str!("../../docs/OBSERVABILITY.md");
        let header = "| outcome | `LockLayer` | `IdempotencyLayer` | `Locker` | meaning |";
        let table = doc
            .split_once(header)
            .expect("docs/OBSERVABILITY.md has the table of outcomes")
            .1;
        table
            .lines()
            .skip(2) // the rest of the header line, and the separator
            .take_while(|line| line.starts_with('|'))
            .map(|row| {
                let cells: Vec<&str> = row.split('|').map(str::trim).collect();
                let name = cells[1].trim_matches('`');
                let mark = |i: usize| match cells[i] {
                    "yes" => true,
                    "" => false,
                    other => panic!("{name}: {other:?} is neither `yes` nor empty"),
                };
                (name.to_owned(), [mark(2), mark(3), mark(4)])
            })
            .collect()
    }

    /// Whether the table says `recorder` records `outcome`.
    pub(crate) fn records(recorder: Recorder, outcome: &str) -> bool {
        outcomes()
            .iter()
            .any(|(name, marks)| name == outcome && marks[recorder as usize])
    }
}

#[cfg(test)]
mod tests {
    use super::{Outcome, documented};

    const ALL: [Outcome; 14] = [
        Outcome::Completed,
        Outcome::CompletedLeaseLost,
        Outcome::Failed,
        Outcome::LeaseLost,
        Outcome::Dropped,
        Outcome::Released,
        Outcome::Contended,
        Outcome::StoreError,
        Outcome::BadKey,
        Outcome::BadRequest,
        Outcome::Stored,
        Outcome::NotStored,
        Outcome::Replayed,
        Outcome::KeyReused,
    ];

    /// `ALL`'s index of `outcome`: does not compile when a variant is added and not listed.
    fn index(outcome: Outcome) -> usize {
        match outcome {
            Outcome::Completed => 0,
            Outcome::CompletedLeaseLost => 1,
            Outcome::Failed => 2,
            Outcome::LeaseLost => 3,
            Outcome::Dropped => 4,
            Outcome::Released => 5,
            Outcome::Contended => 6,
            Outcome::StoreError => 7,
            Outcome::BadKey => 8,
            Outcome::BadRequest => 9,
            Outcome::Stored => 10,
            Outcome::NotStored => 11,
            Outcome::Replayed => 12,
            Outcome::KeyReused => 13,
        }
    }

    #[test]
    fn the_documented_outcomes_are_the_recorded_ones() {
        assert!(ALL.iter().enumerate().all(|(i, &o)| index(o) == i));
        let mut code: Vec<&str> = ALL.iter().map(|o| o.as_str()).collect();
        code.sort_unstable();
        let documented = documented::outcomes();
        let mut docs: Vec<&str> = documented.iter().map(|(name, _)| name.as_str()).collect();
        docs.sort_unstable();
        assert_eq!(
            docs, code,
            "docs/OBSERVABILITY.md's outcomes differ from `Outcome::as_str`"
        );
        for (name, marks) in &documented {
            assert!(marks.contains(&true), "{name} is recorded by nobody");
        }
    }
}
