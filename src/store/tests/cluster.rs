//! `ClusterStore`'s batched renewal on a real Redis Cluster on loopback.

use std::{collections::HashSet, time::Duration};

use tower_lock_testkit::{RedisCluster, calls_of, key_slot};

use super::{Ops, acquired};
use crate::{
    key::LockKey,
    store::{ClusterStore, LockStore},
    token::Token,
};

/// The route the layer would lock on the SKU.
const ROUTE: &str = "/items/{sku}";

/// The lock key the layer builds for `sku` on [`ROUTE`].
fn route_key(sku: &str) -> LockKey {
    LockKey::new("tower-lock:", ROUTE, sku.as_bytes(), 64).unwrap()
}

/// Values on [`ROUTE`] whose keys share a hash slot with `first`'s: `n` of them, `first` included.
fn skus_in_one_slot(first: &str, n: usize) -> Vec<String> {
    let slot = key_slot(route_key(first).as_bytes());
    let mut skus = vec![first.to_owned()];
    let mut i = 0u64;
    while skus.len() < n {
        let sku = format!("{first}-{i}");
        if key_slot(route_key(&sku).as_bytes()) == slot {
            skus.push(sku);
        }
        i += 1;
    }
    skus
}

/// Scripts the cluster's masters ran so far (`EVALSHA` calls).
async fn scripts_run(cluster: &RedisCluster) -> u64 {
    let mut n = 0;
    for master in cluster.masters() {
        n += calls_of(master, "evalsha").await;
    }
    n
}

/// A cluster commits a group of renewals one script per hash slot, each on its slot's master: leases that
/// share a slot share a script, and every lease gets its own answer, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batched_renewals_go_one_script_per_slot() {
    let cluster = RedisCluster::start(3, 0);
    let store = ClusterStore::connect(cluster.urls())
        .await
        .expect("connect to the test cluster")
        .native_commands(false);
    let ttl = Duration::from_secs(30);
    // Three slots with four leases each, and ten leases of slots of their own.
    let mut skus = Vec::new();
    for first in ["a", "b", "c"] {
        skus.extend(skus_in_one_slot(first, 4));
    }
    skus.extend((0..10).map(|i| format!("single-{i}")));
    let slots: HashSet<u16> = skus
        .iter()
        .map(|s| key_slot(route_key(s).as_bytes()))
        .collect();
    let mut leases = Vec::new();
    for sku in &skus {
        let (key, token) = (route_key(sku), Token::generate().unwrap());
        acquired(store.acquire(&key, &token, ttl).await.unwrap());
        leases.push((key, token));
    }
    // Once, so that every master has the scripts loaded (a first EVALSHA meets NOSCRIPT).
    for answer in store.renew_many(&leases, ttl).await {
        assert!(answer.unwrap());
    }
    // One lease is not ours (any more): its own answer says so.
    leases[5].1 = Token::generate().unwrap();
    let before = scripts_run(&cluster).await;
    // The masters hold scripts for a moment, so that the first renewal is still in flight when
    // the others are polled, however slowly this process runs: they queue behind it.
    for master in cluster.masters() {
        master.cli(&["CLIENT", "PAUSE", "300", "WRITE"]);
    }
    let renewed = store.renew_many(&leases, Duration::from_secs(60)).await;
    let after = scripts_run(&cluster).await;
    for (i, answer) in renewed.iter().enumerate() {
        assert_eq!(
            answer.as_ref().ok(),
            Some(&(i != 5)),
            "lease {i}: {answer:?}"
        );
    }
    // The renewals queue while the first call is in flight and go together, one script per
    // slot (the first may go alone, should the store's driver take it before the others came,
    // and the second too, should the pause have ended before it was sent).
    let scripts = after - before;
    let per_slot = slots.len() as u64;
    assert!(
        (per_slot..=per_slot + 2).contains(&scripts),
        "{scripts} scripts, not one per slot: {} leases in {} slots",
        leases.len(),
        slots.len()
    );
    let pttl = |key: &LockKey| {
        let node = cluster.master_of(key_slot(key.as_bytes()));
        node.cli(&["PTTL", std::str::from_utf8(key.as_bytes()).unwrap()])
            .trim()
            .parse::<i64>()
            .unwrap()
    };
    assert!(pttl(&leases[0].0) > 40_000, "not renewed");
    assert!(pttl(&leases[5].0) <= 30_000, "renewed with another's token");
}
