//! Logging setup. The filter comes from RUST_LOG; JSON output with `--log-format json`.

use tracing_subscriber::{EnvFilter, fmt, prelude::*};

use crate::config::LogFormat;

pub fn init(format: LogFormat) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let registry = tracing_subscriber::registry().with(filter);
    // A second init (tests) is harmless: keep the first subscriber.
    let _ = match format {
        LogFormat::Json => registry
            .with(fmt::layer().json().with_current_span(false))
            .try_init(),
        LogFormat::Text => registry.with(fmt::layer().with_target(true)).try_init(),
    };
}
