//! The behaviour suite on `MemoryStore` (one process; the layer's own behaviour).

mod suite;
mod support;

use support::Memory;
use tower_lock::config::OnLeaseLost;

suite::tests!(
    Memory::new();
    exclusion,
    renewal_keeps_long_handlers_exclusive,
    without_renewal_the_lease_expires,
    release_on_completion,
    release_on_drop,
    release_on_panic,
    contended_is_409_problem,
    max_hold_bounds_a_request,
    singleton_guard,
    own_token_acquires_again,
    sets_exclude_each_other_and_single_keys,
    sets_in_opposite_orders_never_deadlock,
    a_set_takes_all_its_keys_or_none,
    a_set_makes_a_single_key_wait,
    a_set_is_not_starved_by_single_keys,
    a_set_is_released_on_drop_and_panic,
);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_lock_updates_are_lost() {
    suite::without_the_lock_updates_are_lost().await;
}

/// The negative control for the set exclusion test.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_lock_sets_lose_updates() {
    suite::without_the_lock_sets_lose_updates().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_hold_under_continue_lets_the_handler_finish() {
    use std::time::Duration;
    use tower_lock::{Key, LockConfig, LockLayer, MemoryStore};
    let config = LockConfig::builder()
        .ttl(Duration::from_millis(100))
        .max_hold(Duration::from_millis(150))
        .on_lease_lost(OnLeaseLost::Continue)
        .build()
        .unwrap();
    let layer = LockLayer::with_config(MemoryStore::new(), Key::path_param("sku"), config);
    let app = support::counter_app(support::Counter::new(), Some(layer));
    let response = support::send(&app, support::purchase("k", 400)).await;
    assert_eq!(response.status(), 200);
    assert_eq!(support::body_json(response).await["lost"], true);
}
