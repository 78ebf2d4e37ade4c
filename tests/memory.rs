//! The behaviour suite on `MemoryStore` (one process; the layer's own behaviour).

use crate::suite;
use crate::support;

use support::Memory;
use tower_lock::config::OnLeaseLost;

suite::single_key_tests!(Memory::new());
suite::set_tests!(Memory::new());

suite::controls!(
    without_the_lock_updates_are_lost,
    without_the_lock_sets_lose_updates
);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_hold_under_continue_lets_the_handler_finish() {
    use std::time::Duration;
    use tower_lock::{Key, LockConfig, LockLayer, MemoryStore};
    let config = LockConfig::builder()
        .ttl(Duration::from_millis(100))
        .max_hold(Duration::from_millis(150))
        .build()
        .unwrap();
    let layer = LockLayer::with_config(MemoryStore::new(), Key::path_param("sku"), config)
        .on_lease_lost(OnLeaseLost::Continue);
    let app = support::counter_app(support::Counter::new(), Some(layer));
    let response = support::send(&app, support::purchase("k", 400)).await;
    assert_eq!(response.status(), 200);
    assert_eq!(support::body_json(response).await["lost"], true);
}
