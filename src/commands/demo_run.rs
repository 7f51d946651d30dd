//! `prism-operator demo-run`: a minimal Run (hello with a key file, heartbeat, claim jobs)
//! for trying the runtime registry by hand.

use std::time::Duration;

use tokio::time::Instant;

use tracing::{info, warn};

use crate::config::DemoRunArgs;
use crate::run_client::{self, ClientError, RunClient};

/// How long demo-run keeps saying hello while the operator answers "not now" (429 or 503
/// with `Retry-After`) before it gives up.
const HELLO_PATIENCE: Duration = Duration::from_secs(600);
/// How soon a failed heartbeat is tried again.
const HEARTBEAT_RETRY: Duration = Duration::from_secs(1);

pub async fn run(args: DemoRunArgs) -> anyhow::Result<()> {
    let key = run_client::read_key(&args.key_file)?;
    let http = run_client::http_client(args.ca_cert.as_deref())?;
    let mut client =
        RunClient::new(&args.api, &args.server_instance_id, &args.component_kind, args.generation, key).with_http(http);
    let mut granted = client.hello_patiently(HELLO_PATIENCE).await?;
    info!(server = %args.server_instance_id, component = %args.component_kind, lease = granted.lease_ttl_seconds, "session started");
    let every = |granted: &run_client::Granted| Duration::from_secs(granted.heartbeat_interval_seconds.max(1));
    let mut next_beat = Instant::now() + every(&granted);
    loop {
        // Long poll until the next heartbeat is due (SPEC §11): a job queued for this Run,
        // or a cancel of one it holds, answers the claim at once.
        let wait = next_beat.saturating_duration_since(Instant::now()).as_secs().min(60);
        let claimed = tokio::select! {
            _ = tokio::signal::ctrl_c() => { info!("stopping; the lease expires on its own"); return Ok(()); }
            claimed = client.claim_waiting(10, wait) => claimed,
        };
        let mut stop: Vec<uuid::Uuid> = Vec::new();
        match claimed {
            Ok(claimed) => {
                stop.extend(claimed.cancel);
                for job in claimed.jobs {
                    info!(job = %job.id, kind = %job.kind, "claimed");
                    let acked = match client.step(&job.id, "ack", None).await {
                        Ok(acked) => acked,
                        Err(e) => {
                            warn!(job = %job.id, error = %e, "ack failed; the job returns to the queue at its visibility timeout");
                            continue;
                        }
                    };
                    if acked.cancel_requested {
                        stop.push(job.id);
                    } else if args.complete_jobs {
                        let result = serde_json::json!({"outcome": "succeeded", "result": {"handled_by": "prism-operator demo-run"}});
                        if let Err(e) = client.step(&job.id, "complete", Some(result)).await {
                            warn!(job = %job.id, error = %e, "complete failed");
                        }
                    }
                }
            }
            Err(e) if matches!(e.code(), Some("session_superseded" | "session_expired")) => {
                warn!(error = %e, "session lost; saying hello again");
                granted = client.hello_patiently(HELLO_PATIENCE).await?;
                next_beat = Instant::now() + every(&granted);
                continue;
            }
            Err(ClientError::Refused { code, .. }) if code == "runtime_registry_unavailable" => {
                warn!("runtime registry unavailable; no jobs assigned");
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            Err(e) => {
                warn!(error = %e, "claim failed; retrying");
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
        if Instant::now() >= next_beat {
            next_beat = Instant::now() + every(&granted);
            match client.heartbeat().await {
                Ok(answer) => match serde_json::from_value::<Vec<uuid::Uuid>>(answer["cancel"].clone()) {
                    Ok(ids) => stop.extend(ids),
                    Err(e) => {
                        warn!(error = %e, "the heartbeat's cancel list could not be read; the claim answer repeats it")
                    }
                },
                Err(e) => match e.code() {
                    Some("session_superseded" | "session_expired") => {
                        warn!(error = %e, "session lost; saying hello again");
                        granted = client.hello_patiently(HELLO_PATIENCE).await?;
                        next_beat = Instant::now() + every(&granted);
                        continue;
                    }
                    // Soon, not an interval on: two failures an interval apart (the two
                    // replicas of a rolling update going, each refused for a moment) would
                    // leave the lease unrenewed for three intervals, its whole length.
                    _ => {
                        warn!(error = %e, "heartbeat failed; retrying");
                        next_beat = Instant::now() + HEARTBEAT_RETRY;
                    }
                },
            }
        }
        // Honour cancels: the job stops here and is completed as cancelled.
        stop.sort();
        stop.dedup();
        for id in stop {
            let body = serde_json::json!({"outcome": "cancelled", "result": {"stopped_by": "prism-operator demo-run"}});
            match client.step(&id, "complete", Some(body)).await {
                Ok(_) => info!(job = %id, "cancelled as asked"),
                Err(e) => warn!(job = %id, error = %e, "could not report the cancel"),
            }
        }
    }
}
