//! The fence's rules, on the in-memory data (the Redis script is held to the same rules by
//! `tests/fenced.rs`, on real servers, which runs the whole-or-nothing rules on both).

use std::time::Duration;

use tokio::time::Instant;

use super::*;
use crate::{Lease, key::LockKey, lease::Fences};

fn key(value: &str) -> LockKey {
    LockKey::new("t:", "sku", value.as_bytes(), 64).unwrap()
}

/// A lease on `keys`, with these fencing tokens.
fn lease(keys: &[&str], tokens: &[u64]) -> Lease {
    let keys: crate::key::KeySet = keys.iter().map(|k| key(k)).collect();
    let fences = match tokens {
        [one] => Fences::One(*one),
        many => Fences::Many(many.into()),
    };
    Lease::new(keys, fences, Instant::now(), Duration::from_secs(10))
}

fn text(replies: &Replies, i: usize) -> Option<String> {
    replies
        .data(i)
        .map(|d| String::from_utf8(d.to_vec()).unwrap())
}

#[tokio::test]
async fn a_stale_holder_is_refused_after_a_newer_one_wrote() {
    let data = FencedData::in_memory();
    let (old, new) = (lease(&["apple"], &[10]), lease(&["apple"], &[11]));
    let stock = data_key("stock:", &key("apple"));
    data.unfenced_batch()
        .set(&stock, "5")
        .apply()
        .await
        .unwrap();
    // The old holder reads, the newer one reads and writes, the old one writes.
    let read = data.batch(&old).get(&stock).apply().await.unwrap();
    assert_eq!(text(&read, 0).as_deref(), Some("5"));
    assert!(
        !old.has_fenced_writes(),
        "a read marks the lease as written"
    );
    data.batch(&new).get(&stock).apply().await.unwrap();
    data.batch(&new).set(&stock, "4").apply().await.unwrap();
    let refused = data
        .batch(&old)
        .set(&stock, "4")
        .rpush("journal", "old")
        .apply()
        .await
        .unwrap_err();
    assert!(old.has_fenced_writes());
    match &refused {
        FenceError::Stale {
            resource,
            fencing_token,
            fence,
        } => {
            assert_eq!(resource, &key("apple"));
            assert_eq!((*fencing_token, *fence), (10, 11));
        }
        other => panic!("not stale: {other:?}"),
    }
    assert!(refused.nothing_applied());
    let after = data.unfenced_batch().get(&stock).apply().await.unwrap();
    assert_eq!(text(&after, 0).as_deref(), Some("4"));
    let journal = data
        .unfenced_batch()
        .rpush("journal", "x")
        .apply()
        .await
        .unwrap();
    assert_eq!(
        journal.int(0),
        Some(1),
        "the refused batch appended to the journal"
    );
}

#[tokio::test]
async fn a_read_fences_an_older_holders_later_write() {
    let data = FencedData::in_memory();
    let (old, new) = (lease(&["pear"], &[3]), lease(&["pear"], &[4]));
    data.unfenced_batch().set("p", "1").apply().await.unwrap();
    data.batch(&old).get("p").apply().await.unwrap();
    // The newer holder only reads: that is enough to refuse the older one's write.
    data.batch(&new).get("p").apply().await.unwrap();
    let refused = data.batch(&old).set("p", "0").apply().await;
    assert!(
        matches!(refused, Err(FenceError::Stale { .. })),
        "{refused:?}"
    );
}

#[tokio::test]
async fn reading_what_does_not_exist_leaves_no_fence() {
    let data = FencedData::in_memory();
    let (old, new) = (lease(&["fig"], &[3]), lease(&["fig"], &[4]));
    let read = data.batch(&new).get("nothing").apply().await.unwrap();
    assert_eq!(read.get(0), Some(&Reply::Nil));
    // No fence was left, so the older token still writes (and fences it from now on).
    data.batch(&old).set("nothing", "1").apply().await.unwrap();
    let refused = data
        .batch(&lease(&["fig"], &[2]))
        .get("nothing")
        .apply()
        .await;
    assert!(matches!(refused, Err(FenceError::Stale { fence: 3, .. })));
}

#[tokio::test]
async fn each_key_of_a_set_is_guarded_by_its_own_token() {
    let data = FencedData::in_memory();
    let order = lease(&["a", "b"], &[20, 30]);
    data.batch(&order)
        .set("a", "1")
        .set("b", "1")
        .apply()
        .await
        .unwrap();
    // A newer holder of `b` alone (token 31) makes the order stale on `b` only.
    data.batch(&lease(&["b"], &[31]))
        .set("b", "2")
        .apply()
        .await
        .unwrap();
    let refused = data.batch(&order).set("a", "3").apply().await;
    assert!(
        matches!(&refused, Err(FenceError::Stale { resource, .. }) if resource == &key("b")),
        "{refused:?}"
    );
    // A batch on `a` alone is still the newest there.
    data.batch_on(&order, [&key("a")])
        .set("a", "3")
        .apply()
        .await
        .unwrap();
    // A key the lease does not hold is a bug, refused before anything is sent.
    let answer = data
        .batch_on(&order, [&key("c")])
        .set("a", "4")
        .apply()
        .await;
    assert!(matches!(answer, Err(FenceError::Invalid(_))), "{answer:?}");
}

#[test]
fn data_keys_share_their_resources_slot() {
    let resource = LockKey::new("tower-lock:", "sku", b"apple", 64).unwrap();
    let stock = data_key("inventory:stock:", &resource);
    assert_eq!(crate::slot::of(&stock), resource.slot());
    assert_eq!(crate::slot::of(&fence_key(&resource)), resource.slot());
    assert!(stock.starts_with(b"inventory:stock:{"));
}
