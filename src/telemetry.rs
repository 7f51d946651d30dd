//! Logging setup. The filter comes from RUST_LOG; JSON output with `--log-format json`.

use tracing_subscriber::{EnvFilter, fmt, prelude::*};

use crate::config::LogFormat;

pub fn init(format: LogFormat) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let registry = tracing_subscriber::registry().with(filter);
    // A second init (tests) is harmless: keep the first subscriber.
    let _ = match format {
        LogFormat::Json => registry.with(fmt::layer().json().with_current_span(false)).try_init(),
        LogFormat::Text => registry.with(fmt::layer().with_target(true)).try_init(),
    };
}

use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ControllerLabels {
    pub controller: String,
}

/// Prometheus metrics, served as text on /metrics.
pub struct Metrics {
    registry: Registry,
    reconciles: Family<ControllerLabels, Counter>,
    reconcile_errors: Family<ControllerLabels, Counter>,
    reconcile_seconds: Family<ControllerLabels, Histogram>,
    pub heartbeats: Counter,
    pub heartbeat_flushes: Counter,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("prism");
        let reconciles = Family::<ControllerLabels, Counter>::default();
        let reconcile_errors = Family::<ControllerLabels, Counter>::default();
        let reconcile_seconds = Family::<ControllerLabels, Histogram>::new_with_constructor(|| {
            Histogram::new(exponential_buckets(0.001, 2.0, 14))
        });
        let heartbeats = Counter::default();
        let heartbeat_flushes = Counter::default();
        registry.register("reconciles", "Reconciliations per controller", reconciles.clone());
        registry.register("reconcile_errors", "Failed reconciliations per controller", reconcile_errors.clone());
        registry.register("reconcile_duration_seconds", "Reconciliation duration", reconcile_seconds.clone());
        registry.register("controller_heartbeats", "Agent heartbeats received", heartbeats.clone());
        registry.register(
            "controller_heartbeat_flushes",
            "Batched heartbeat UPDATEs written",
            heartbeat_flushes.clone(),
        );
        Self { registry, reconciles, reconcile_errors, reconcile_seconds, heartbeats, heartbeat_flushes }
    }
}

impl Metrics {
    pub fn reconciled(&self, controller: &str, took: Duration, failed: bool) {
        let labels = ControllerLabels { controller: controller.to_string() };
        self.reconciles.get_or_create(&labels).inc();
        self.reconcile_seconds.get_or_create(&labels).observe(took.as_secs_f64());
        if failed {
            self.reconcile_errors.get_or_create(&labels).inc();
        }
    }

    /// The OpenMetrics text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        if prometheus_client::encoding::text::encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }
}
