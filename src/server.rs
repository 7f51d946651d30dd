//! `prism-operator run`: wires configuration, stores, the Kubernetes client and the HTTP
//! API together, and shuts down cleanly on SIGTERM.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use tracing::{info, warn};

use crate::api::{self, AppState};
use crate::config::{RunArgs, redact_url};
use crate::db;
use crate::runtime::RedisStore;

pub async fn run(args: RunArgs) -> anyhow::Result<()> {
    args.validate()?;
    let database_url = args.database.url()?;
    let pool = connect_with_retry(database_url).await?;
    db::migrate(&pool).await?;
    info!(database = %redact_url(database_url), "migrations applied");

    let redis_url = args.redis_url()?;
    let redis = RedisStore::new(redis_url, &args.redis_prefix)
        .with_context(|| format!("REDIS_URL {} is malformed", redact_url(redis_url)))?;
    if let Err(e) = redis.ping().await {
        warn!(redis = %redact_url(redis_url), error = %e, "Redis is unreachable; the runtime registry is unavailable until it returns");
    }

    let kube = kube::Client::try_default().await.context(
        "cannot build a Kubernetes client (in cluster: service account; outside: KUBECONFIG)",
    )?;

    let state = Arc::new(AppState {
        db: pool,
        redis,
        kube,
    });
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("cannot listen on {} (PRISM_LISTEN)", args.listen))?;
    info!(listen = %args.listen, "HTTP API serving");
    axum::serve(listener, api::router(state))
        .with_graceful_shutdown(shutdown_signal())
        .await
        .context("HTTP server failed")?;
    info!("stopped");
    Ok(())
}

/// Postgres may start after the operator (a Helm install starts both at once): retry for
/// a while, saying so, then give up with the cause.
async fn connect_with_retry(url: &str) -> anyhow::Result<sqlx::PgPool> {
    let mut last = None;
    for attempt in 1..=15 {
        match db::connect(url).await {
            Ok(pool) => return Ok(pool),
            Err(e) => {
                warn!(attempt, error = %e, "PostgreSQL not reachable yet");
                last = Some(e);
                tokio::time::sleep(Duration::from_secs(2)).await;
            }
        }
    }
    Err(last
        .map(anyhow::Error::from)
        .unwrap_or_else(|| anyhow::anyhow!("PostgreSQL not reachable")))
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! { _ = ctrl_c => {}, _ = term => {} }
    info!("shutdown signal received");
}
