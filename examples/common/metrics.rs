//! `GET /metrics` in the Prometheus text format, when the examples are built with
//! `--features metrics`; nothing otherwise. Shared by the inventory and payments examples.

use axum::Router;

/// A router serving `GET /metrics`, after installing the Prometheus recorder that the crate's
/// `metrics` calls report to.
#[cfg(feature = "metrics")]
pub fn router<S: Clone + Send + Sync + 'static>() -> Result<Router<S>, String> {
    let handle = metrics_exporter_prometheus::PrometheusBuilder::new()
        .install_recorder()
        .map_err(|e| format!("cannot install the Prometheus recorder: {e}"))?;
    println!("serving Prometheus metrics on GET /metrics");
    Ok(Router::new().route(
        "/metrics",
        axum::routing::get(move || {
            let handle = handle.clone();
            async move { handle.render() }
        }),
    ))
}

/// Without the `metrics` feature there is nothing to serve.
#[cfg(not(feature = "metrics"))]
pub fn router<S: Clone + Send + Sync + 'static>() -> Result<Router<S>, String> {
    Ok(Router::new())
}
