//! `GET /metrics` in the Prometheus text format, when the examples are built with
//! `--features metrics`; nothing otherwise. Shared by the inventory and payments examples.

use axum::Router;

/// A router serving `GET /metrics`, after installing the Prometheus recorder that the crate's
/// `metrics` calls report to. Its times (`*_seconds`) are histograms with buckets from 0.5 ms to
/// a minute, which the dashboard and alerts in `ops/` read (`histogram_quantile` over `_bucket`);
/// without buckets the exporter writes summaries, which cannot be added up across instances.
#[cfg(feature = "metrics")]
pub fn router<S: Clone + Send + Sync + 'static>() -> Result<Router<S>, String> {
    use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
    const SECONDS: [f64; 16] = [
        0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
        60.0,
    ];
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Suffix("_seconds".to_owned()), &SECONDS)
        .map_err(|e| format!("cannot set the histogram buckets: {e}"))?
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
