//! `prism-operator credential new` and `prism-operator run-agent`.

use std::io::Write;
use std::path::Path;
use std::time::Duration;

use tracing::{info, warn};

use crate::config::RunAgentArgs;
use crate::runclient::{self, ClientError, RunClient};

/// Writes the private key with mode 0600 (created that way, never widened) and prints the
/// `spec.credential` block.
pub fn credential_new(key_file: &Path, generation: i64, force: bool) -> anyhow::Result<()> {
    let (key, public) = runclient::new_key()?;
    let mut opts = std::fs::OpenOptions::new();
    opts.write(true);
    if force {
        opts.create(true).truncate(true);
    } else {
        opts.create_new(true);
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        opts.mode(0o600);
    }
    let mut file = opts.open(key_file).map_err(|e| match e.kind() {
        std::io::ErrorKind::AlreadyExists => {
            anyhow::anyhow!("{} exists; use --force to replace it", key_file.display())
        }
        _ => anyhow::anyhow!("cannot write {}: {e}", key_file.display()),
    })?;
    file.write_all(runclient::key_to_file_text(&key).as_bytes())?;
    eprintln!("private key written to {} (mode 0600); keep it on the Run's machine only", key_file.display());
    println!("credential:\n  publicKey: {public}\n  generation: {generation}");
    Ok(())
}

pub async fn run_agent(args: RunAgentArgs) -> anyhow::Result<()> {
    let key = runclient::read_key(&args.key_file)?;
    let mut client = RunClient::new(&args.api, &args.server_instance_id, &args.component_kind, args.generation, key);
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
                    let _ = client.step(&job.id, "ack", None).await;
                    if args.complete_jobs {
                        let result = serde_json::json!({"outcome": "succeeded", "result": {"handled_by": "prism-operator run-agent"}});
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
