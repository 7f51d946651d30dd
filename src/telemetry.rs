//! Logs, traces and metrics. The log filter comes from RUST_LOG; JSON output with
//! `--log-format json`. Traces go over OTLP/HTTP when OTEL_EXPORTER_OTLP_ENDPOINT (or
//! OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) is set, with their own filter (PRISM_TRACE_FILTER),
//! so the store calls' debug spans can be exported without debug logs.

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_subscriber::filter::Targets;
use tracing_subscriber::{EnvFilter, Layer as _, fmt, prelude::*};

use crate::config::LogFormat;

/// What traces are exported when OTLP is on: every request (info) and every store call
/// (debug) of the operator, and only warnings of the libraries.
pub const DEFAULT_TRACE_FILTER: &str = "warn,prism_operator=debug,prism_api=debug,prism_kube=debug,prism_store=debug";

/// Keeps the trace exporter; dropping it sends what is buffered (on shutdown).
pub struct Telemetry {
    traces: Option<SdkTracerProvider>,
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        if let Some(provider) = self.traces.take()
            && let Err(error) = provider.shutdown()
        {
            eprintln!("warning: could not send the last traces: {error}");
        }
    }
}

/// Whether the environment asks for traces over OTLP.
fn otlp_wanted() -> bool {
    ["OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"]
        .iter()
        .any(|v| std::env::var(v).is_ok_and(|e| !e.trim().is_empty()))
}

/// The OTLP trace pipeline: a batch of spans at a time, on the SDK's own thread.
fn otlp_provider() -> anyhow::Result<SdkTracerProvider> {
    use anyhow::Context as _;
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .build()
        .context("OTEL_EXPORTER_OTLP_ENDPOINT: cannot build the OTLP trace exporter")?;
    let mut resource = opentelemetry_sdk::Resource::builder();
    if std::env::var("OTEL_SERVICE_NAME").is_err() {
        resource = resource.with_service_name("prism-operator");
    }
    Ok(SdkTracerProvider::builder().with_batch_exporter(exporter).with_resource(resource.build()).build())
}

/// Logs of the operator, and its traces when OTLP is asked for. An OTLP setting that
/// cannot be used is an error (a one-line message, no silent loss of traces).
pub fn init(format: LogFormat) -> anyhow::Result<Telemetry> {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let logs = match format {
        LogFormat::Json => fmt::layer().json().with_current_span(false).with_filter(filter).boxed(),
        LogFormat::Text => fmt::layer().with_target(true).with_filter(filter).boxed(),
    };
    let traces = if otlp_wanted() { Some(otlp_provider()?) } else { None };
    let exported = match &traces {
        Some(provider) => {
            let wanted = std::env::var("PRISM_TRACE_FILTER").unwrap_or_else(|_| DEFAULT_TRACE_FILTER.to_string());
            let targets: Targets = wanted.parse().map_err(|e| anyhow::anyhow!("PRISM_TRACE_FILTER {wanted:?}: {e}"))?;
            // Asked at every span and event, never cached per callsite. Two per-layer
            // filters that disagree on a callsite leave a thread's filter state set when
            // a library only asks whether it is enabled (`enabled!`, `log_enabled!`) and
            // emits nothing; a callsite both filters enable "always" is then not asked
            // again and inherits that state: a request span went missing from the
            // exported traces on some requests (tests/traces.rs saw it in 1 of 3 runs).
            // A filter that is always asked sets both layers' state afresh each time.
            let filter = tracing_subscriber::filter::dynamic_filter_fn(move |meta, _| {
                targets.would_enable(meta.target(), meta.level())
            });
            let layer = tracing_opentelemetry::layer().with_tracer(provider.tracer("prism-operator"));
            Some(layer.with_filter(filter))
        }
        None => None,
    };
    // A second init (tests) is harmless: keep the first subscriber.
    let _ = tracing_subscriber::registry().with(logs).with(exported).try_init();
    Ok(Telemetry { traces })
}

/// Logging of a client command (`jobs`): its stdout is its answer (`-o json | jq`) and its
/// own one-line error says what failed, so libraries' logs (rustls naming a certificate it
/// refused, say) go to stderr and only when RUST_LOG asks for them.
pub fn init_client(format: LogFormat) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("off"));
    let registry = tracing_subscriber::registry().with(filter);
    let _ = match format {
        LogFormat::Json => {
            registry.with(fmt::layer().json().with_current_span(false).with_writer(std::io::stderr)).try_init()
        }
        LogFormat::Text => registry.with(fmt::layer().with_target(true).with_writer(std::io::stderr)).try_init(),
    };
}
