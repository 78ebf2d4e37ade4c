//! The smallest useful service: one purchase per SKU at a time, across every instance that
//! shares the Redis at `REDIS_URL` (or, without it, within this process).
//! `cargo run --example minimal`, then `curl -X POST localhost:3000/items/apple/purchase`.

use axum::{Router, extract::Path, routing::post};
use tower_lock::{Key, Lease, LockLayer, MemoryStore, RedisStore};

async fn purchase(lease: Lease, Path(sku): Path<String>) -> String {
    // Only one request per SKU gets here at a time; pass the fencing token to your writes.
    format!("sold {sku} under fencing token {}\n", lease.fencing_token())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let lock = match std::env::var("REDIS_URL") {
        Ok(url) => LockLayer::new(RedisStore::connect(url).await?, Key::path_param("sku")),
        Err(_) => LockLayer::new(MemoryStore::new(), Key::path_param("sku")),
    };
    let app = Router::new()
        .route("/items/{sku}/purchase", post(purchase))
        .route_layer(lock);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await?;
    axum::serve(listener, app).await?;
    Ok(())
}
