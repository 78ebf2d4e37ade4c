//! `examples/sql.rs`: fenced writes in SQLite, run as a program. Fenced, the paused holder's
//! write touches no row and the books add up; with `FENCING=off` (the negative control) the
//! same interleaving loses an update. Locks in memory, and in a real Redis.

use crate::instances;

use std::{process::Command, time::Duration};

use instances::example_binary;
use tower_lock_testkit::{RedisServer, process::Process};

fn run(env: &[(&str, &str)]) -> String {
    let mut command = Command::new(example_binary("sql"));
    command.env_clear().envs(env.iter().copied());
    let finished = Process::run(command, "the sql example", Duration::from_secs(60));
    assert_eq!(
        finished.status.map(|s| s.code()),
        Some(Some(0)),
        "{}",
        finished.output
    );
    finished.output
}

#[test]
fn a_stale_write_touches_no_row() {
    let redis = RedisServer::start();
    for env in [vec![], vec![("REDIS_URL", redis.url())]] {
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let output = run(&env);
        assert!(output.contains("was refused: a newer holder"), "{output}");
        assert!(output.contains("no update lost"), "{output}");
        assert!(output.contains("refused (UNIQUE)"), "{output}");
    }
}

#[test]
fn without_the_fence_an_update_is_lost() {
    let output = run(&[("FENCING", "off")]);
    assert!(output.contains("A: resumed; wrote stock 4"), "{output}");
    assert!(output.contains("1 update(s) lost"), "{output}");
}
