//! Many Runs at once: a RunSession each (default lease), then a hello each, through one
//! shared HTTP client, 32 at a time.

use std::time::{Duration, Instant};

use futures::StreamExt;
use kube::Api;
use prism_operator::crd::RunSession;
use prism_operator::run_client::RunClient;

use crate::support;

/// Creates `names.len()` RunSessions (server id = name, component `run`) and has a Run
/// say hello for each; `then(i, run)` gets each Run as soon as its hello passed (a bench
/// that must keep early Runs alive starts them there) and returns the ones to keep, by
/// index.
pub async fn said_hello<F>(
    api: &Api<RunSession>,
    base: &str,
    http: &reqwest::Client,
    names: &[String],
    then: F,
) -> Vec<RunClient>
where
    F: Fn(usize, RunClient) -> Option<RunClient>,
{
    let keys: Vec<(usize, ed25519_dalek::SigningKey)> = futures::stream::iter(names.iter().enumerate())
        .map(|(i, name)| async move { (i, support::create_run_session(api, name, name, None).await) })
        .buffer_unordered(32)
        .collect()
        .await;
    let mut kept: Vec<(usize, RunClient)> = futures::stream::iter(keys)
        .map(|(i, key)| {
            let then = &then;
            async move {
                let name = &names[i];
                let mut run = RunClient::new(base, name, "run", 1, key).with_http(http.clone());
                // The identity is mirrored by the reconciler: retry until it is known.
                let deadline = Instant::now() + Duration::from_secs(300);
                while let Err(e) = run.hello().await {
                    assert!(Instant::now() < deadline, "hello of {name} never succeeded: {e}");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
                then(i, run).map(|run| (i, run))
            }
        })
        .buffer_unordered(32)
        .filter_map(std::future::ready)
        .collect()
        .await;
    kept.sort_by_key(|(i, _)| *i);
    kept.into_iter().map(|(_, r)| r).collect()
}
