//! A periodic job that runs on exactly one of several instances, with failover.
//!
//! Every instance loops: acquire the lock `jobs/report` (waiting as long as it takes), run the
//! job every `JOB_EVERY_MS` while holding it, and go back to waiting if the lease is lost. The
//! [`LeaseGuard`] renews the lease in the background every third of the TTL; if the holder dies
//! (even by `kill -9`, which releases nothing) its lease expires after one TTL and a waiting
//! instance takes over. Each run prints the lease's fencing token, which grows with every new
//! holder: a job that writes somewhere should send it along so the storage can refuse a stale
//! holder's writes.
//!
//! On Ctrl-C or SIGTERM the holder stops the job and releases its lease at once, so another
//! instance takes over without waiting for the TTL.
//!
//! # Environment
//!
//! | variable | default | meaning |
//! |---|---|---|
//! | `REDIS_URL` | unset | unset: one process runs 3 instances as tasks over a `MemoryStore`, which only coordinates tasks in that process; set: this process is one instance, coordinating with every other one that uses the same Redis |
//! | `REDIS_CA_CERT`, `REDIS_CLIENT_CERT`, `REDIS_CLIENT_KEY` | unset | for a `rediss://` URL (with `--features tls`): a CA bundle to trust instead of the system's, and a client certificate and key (mutual TLS); see `examples/common/store.rs` |
//! | `INSTANCE_ID` | the process id | name printed with each run |
//! | `JOB_EVERY_MS` | `1000` | period of the job |
//! | `LOCK_TTL_MS` | `3000` | lease time to live: how long a dead holder keeps the job |
//! | `STEP_DOWN_AFTER` | `5` without Redis, `0` with it | the holder releases the lock after this many runs, to show the hand-over; `0` never |
//! | `RUST_LOG` | `info` | log filter |
//!
//! # Try it
//!
//! In one process (three instances as tasks, the holder stepping down every 5 runs):
//!
//! ```sh
//! cargo run --example singleton
//! ```
//!
//! Across processes, with Redis (`redis-server --port 6380 --save '' --appendonly no`):
//!
//! ```sh
//! cargo build --example singleton
//! REDIS_URL=redis://127.0.0.1:6380/ INSTANCE_ID=a ./target/debug/examples/singleton &
//! REDIS_URL=redis://127.0.0.1:6380/ INSTANCE_ID=b ./target/debug/examples/singleton &
//! # One of them prints "instance a ran job #n under fencing token t" every second.
//! kill -9 <pid of the instance running the job>   # each instance prints its pid at start
//! # Within about LOCK_TTL_MS the other one takes over, with a higher fencing token.
//! ```

#[path = "common/app.rs"]
mod app;
#[path = "common/store.rs"]
mod store;

use std::{env, error::Error, process::ExitCode, time::Duration};

use tokio::{
    sync::watch,
    task::JoinSet,
    time::{MissedTickBehavior, interval, sleep},
};
use tower_lock::{Lease, LeaseGuard, LockConfig, LockError, Locker, MemoryStore, Wait};

/// How many instances the in-memory demo runs.
const MEMORY_INSTANCES: usize = 3;

type BoxError = Box<dyn Error + Send + Sync>;

#[tokio::main]
async fn main() -> ExitCode {
    app::init_logging();
    app::exit_code(run().await)
}

async fn run() -> Result<(), BoxError> {
    let settings = Settings::from_env()?;

    // Waiting instances poll every fifth of the TTL (with jitter), forever: a holder that dies
    // is replaced within about TTL + TTL / 5.
    let config = LockConfig::builder()
        .ttl(settings.ttl)
        .wait(Wait::constant(settings.poll())?.jitter(true).forever())
        .build()?;

    // Flips to `true` on Ctrl-C or SIGTERM; every instance watches it.
    let (stop_tx, stop_rx) = watch::channel(false);
    tokio::spawn(async move {
        app::shutdown_signal().await;
        // No receiver left means every instance has returned already.
        let _ = stop_tx.send(true);
    });

    match &settings.redis_url {
        None => {
            println!(
                "REDIS_URL is not set: the in-memory lock store only coordinates tasks in this \
                 one process, so this demo runs {MEMORY_INSTANCES} instances as tasks; set \
                 REDIS_URL to coordinate processes"
            );
            let locker = Locker::with_config(MemoryStore::new(), config);
            let mut instances = JoinSet::new();
            for n in 1..=MEMORY_INSTANCES {
                let id = format!("{}-{n}", settings.instance_id);
                instances.spawn(instance(
                    id,
                    locker.clone(),
                    settings.clone(),
                    stop_rx.clone(),
                ));
            }
            while let Some(done) = instances.join_next().await {
                done??;
            }
        }
        Some(url) => {
            let redis_store = store::Tls::from_env()?
                .redis_store(url)
                .await
                .map_err(|e| format!("REDIS_URL {}: {}", store::redacted(url), store::chain(&e)))?;
            let locker = Locker::with_config(redis_store, config);
            println!(
                "instance {} (pid {}) coordinates through Redis at {}",
                settings.instance_id,
                std::process::id(),
                store::redacted(url)
            );
            instance(settings.instance_id.clone(), locker, settings, stop_rx).await?;
        }
    }
    println!("stopped");
    Ok(())
}

/// Why an instance stopped running the job.
enum Outcome {
    Lost(tower_lock::lease::LostReason),
    SteppedDown,
    Stop,
}

/// One instance: wait for the lock, run the job while holding it, repeat until told to stop.
async fn instance(
    id: String,
    locker: Locker,
    settings: Settings,
    mut stop: watch::Receiver<bool>,
) -> Result<(), BoxError> {
    // `<prefix>{<len>:jobs:report}` in the store; every instance must build the same key.
    let key = locker.key("jobs", "report")?;
    let mut runs = 0;
    loop {
        let acquired = tokio::select! {
            acquired = locker.acquire(key.clone()) => acquired,
            () = stopped(&mut stop) => return Ok(()),
        };
        let guard: LeaseGuard = match acquired {
            Ok(guard) => guard,
            Err(error) => {
                // With a wait that never gives up, only a store failure ends up here.
                tracing::warn!(instance = id, %error, "cannot acquire the job lock; retrying");
                tokio::select! {
                    () = sleep(settings.poll()) => continue,
                    () = stopped(&mut stop) => return Ok(()),
                }
            }
        };
        println!(
            "instance {id} holds the job lock (fencing token {})",
            guard.fencing_token()
        );

        // The job runs only while the lease holds: `lost()` completes the moment a renewal
        // finds it gone, and dropping the job's future stops it there.
        let outcome = tokio::select! {
            reason = guard.lost() => Outcome::Lost(reason),
            () = run_jobs(&id, &guard, &settings, &mut runs) => Outcome::SteppedDown,
            () = stopped(&mut stop) => Outcome::Stop,
        };

        match outcome {
            Outcome::Lost(reason) => {
                println!("instance {id} lost the job lock ({reason}); stopping and waiting again");
                // Nothing to release: the lease is not ours any more.
                drop(guard);
            }
            Outcome::SteppedDown => {
                release(&id, guard).await;
                // Let a waiting instance (polling every `poll`, plus jitter) take it.
                tokio::select! {
                    () = sleep(settings.poll() * 3) => {}
                    () = stopped(&mut stop) => return Ok(()),
                }
            }
            Outcome::Stop => {
                release(&id, guard).await;
                return Ok(());
            }
        }
    }
}

/// Runs the job every `JOB_EVERY_MS` until `STEP_DOWN_AFTER` runs (forever if 0).
async fn run_jobs(id: &str, lease: &Lease, settings: &Settings, runs: &mut u64) {
    let mut ticker = interval(settings.every);
    ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut this_term = 0;
    loop {
        ticker.tick().await;
        *runs += 1;
        this_term += 1;
        // The job itself. A real one would pass the fencing token with its writes.
        println!(
            "instance {id} ran job #{runs} under fencing token {}",
            lease.fencing_token()
        );
        if this_term == settings.step_down_after {
            println!("instance {id} steps down after {this_term} runs");
            return;
        }
    }
}

/// Releases the lease now, so the next instance need not wait for the TTL.
async fn release(id: &str, guard: LeaseGuard) {
    match guard.release().await {
        Ok(()) => println!("instance {id} released the job lock"),
        Err(LockError::LeaseLost(reason)) => {
            println!("instance {id} no longer held the job lock: {reason}")
        }
        Err(error) => {
            tracing::warn!(instance = id, %error, "release failed; the lock frees itself after its TTL");
        }
    }
}

/// Completes once a stop was requested (or the signal task is gone).
async fn stopped(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|stop| *stop).await;
}

// ---------------------------------------------------------------------------------------------
// Settings and shutdown

#[derive(Clone)]
struct Settings {
    redis_url: Option<String>,
    instance_id: String,
    every: Duration,
    ttl: Duration,
    step_down_after: u64,
}

impl Settings {
    fn from_env() -> Result<Self, String> {
        let redis_url = env::var("REDIS_URL").ok().filter(|url| !url.is_empty());
        let every = app::env_or("JOB_EVERY_MS", 1000)?;
        if every == 0 {
            return Err("JOB_EVERY_MS must be above 0".into());
        }
        let instance_id = match env::var("INSTANCE_ID") {
            Ok(id) if !id.is_empty() => id,
            Ok(_) => return Err("INSTANCE_ID must not be empty".into()),
            Err(env::VarError::NotPresent) => std::process::id().to_string(),
            Err(env::VarError::NotUnicode(_)) => {
                return Err("INSTANCE_ID is not valid UTF-8".into());
            }
        };
        Ok(Self {
            step_down_after: app::env_or(
                "STEP_DOWN_AFTER",
                if redis_url.is_none() { 5 } else { 0 },
            )?,
            redis_url,
            instance_id,
            every: Duration::from_millis(every),
            ttl: Duration::from_millis(app::env_or("LOCK_TTL_MS", 3000)?),
        })
    }

    /// How often a waiting instance tries the lock.
    fn poll(&self) -> Duration {
        (self.ttl / 5).max(Duration::from_millis(1))
    }
}
