//! `MemoryStore`'s idempotency records.

use crate::MemoryStore;

/// `complete` on `MemoryStore`: only the holder writes the record, which appears exactly as the
/// lock goes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn complete_is_one_step_for_the_holder() {
    super::complete_is_one_step_for_the_holder(MemoryStore::new()).await;
}
