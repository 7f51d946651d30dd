//! `prism-operator demo-run`: a minimal Run (hello with a key file, heartbeat, claim jobs)
//! for trying the runtime registry by hand.

use std::time::Duration;

use tracing::{info, warn};

use crate::config::DemoRunArgs;
use crate::run_client::{self, ClientError, RunClient};

pub async fn run(args: DemoRunArgs) -> anyhow::Result<()> {
    let key = run_client::read_key(&args.key_file)?;
    let http = run_client::http_client(args.ca_cert.as_deref())?;
    let mut client =
        RunClient::new(&args.api, &args.server_instance_id, &args.component_kind, args.generation, key).with_http(http);
    let mut granted = client.hello().await?;
    info!(server = %args.server_instance_id, component = %args.component_kind, lease = granted.lease_ttl_seconds, "session started");
    loop {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => { info!("stopping; the lease expires on its own"); return Ok(()); }
            _ = tokio::time::sleep(Duration::from_secs(granted.heartbeat_interval_seconds.max(1))) => {}
        }
        let beat = client.heartbeat().await;
        if let Err(e) = beat {
            match e.code() {
                Some("session_superseded" | "session_expired") => {
                    warn!(error = %e, "session lost; saying hello again");
                    granted = client.hello().await?;
                    continue;
                }
                _ => {
                    warn!(error = %e, "heartbeat failed; retrying");
                    continue;
                }
            }
        }
        match client.claim(10).await {
            Ok(jobs) => {
                for job in jobs {
                    info!(job = %job.id, kind = %job.kind, "claimed");
                    if let Err(e) = client.step(&job.id, "ack", None).await {
                        warn!(job = %job.id, error = %e, "ack failed; the job returns to the queue at its visibility timeout");
                        continue;
                    }
                    if args.complete_jobs {
                        let result = serde_json::json!({"outcome": "succeeded", "result": {"handled_by": "prism-operator demo-run"}});
                        if let Err(e) = client.step(&job.id, "complete", Some(result)).await {
                            warn!(job = %job.id, error = %e, "complete failed");
                        }
                    }
                }
            }
            Err(ClientError::Refused { code, .. }) if code == "runtime_registry_unavailable" => {
                warn!("runtime registry unavailable; no jobs assigned")
            }
            Err(e) => warn!(error = %e, "claim failed"),
        }
    }
}
