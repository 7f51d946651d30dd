//! `prism-operator selftest`: what `helm test` runs (SPEC §15) — an agent's round trip
//! through a running operator, from outside: `/readyz` (over TLS when the API serves it),
//! register a session of a project of its own, read the project's status, fence with the
//! term it got and with the one before, wrap. A line per step; the first failure ends
//! it with the step's name and the API's refusal.

use std::path::Path;

use serde::Deserialize;

use super::api_client::{Api, api_url};
use crate::config::SelftestArgs;

/// What the steps read of the API's answers (SPEC §6).
#[derive(Deserialize)]
struct Registered {
    registration: Entry,
    is_master: bool,
    term: i64,
}

#[derive(Deserialize)]
struct Entry {
    id: uuid::Uuid,
    session_id: String,
}

#[derive(Deserialize)]
struct Routing {
    term: i64,
    master: Option<Entry>,
}

pub async fn run(args: SelftestArgs) -> anyhow::Result<()> {
    let token = std::fs::read_to_string(&args.token_file)
        .map_err(|e| anyhow::anyhow!("reading the token file {}: {e}", args.token_file.display()))?;
    // The chart's own Secret may lack ca.crt (a Secret of yours): the system's roots then.
    let ca = args.ca_cert.as_deref().filter(|p| Path::new(p).exists());
    if let Some(missing) = args.ca_cert.as_deref().filter(|_| ca.is_none()) {
        println!("note: no CA file at {}; trusting the system's roots", missing.display());
    }
    let api = Api::with_token(&args.api, &token, ca)?;
    let ns = args.namespace.as_str();
    // A project and session of this run's own: nothing of anyone else's is touched.
    let suffix = uuid::Uuid::new_v4().simple().to_string();
    let project = format!("prism-selftest-{}", &suffix[..12]);
    let session = format!("selftest-{}", &suffix[..12]);

    let ready = api.http.get(api_url(&api.base, &["readyz"])?).send().await;
    let ready = ready.map_err(|e| anyhow::anyhow!("step readyz: cannot reach {}: {e}", api.base))?;
    anyhow::ensure!(ready.status().is_success(), "step readyz: {} answered {}", api.base, ready.status());
    println!("ok  readyz: {} ready", api.base);

    let url = api_url(&api.base, &["api", "v1", "controller", "register"])?;
    let body =
        serde_json::json!({"namespace": ns, "project_id": project, "session_id": session, "agent_surface": "other"});
    let (_, answer) = api.send(api.http.post(url).json(&body)).await.map_err(|e| step("register", e))?;
    let registered: Registered =
        super::api_client::decode(&answer, "a registration").map_err(|e| step("register", e))?;
    anyhow::ensure!(registered.is_master, "step register: the first session of {project} is not its master");
    let (id, term) = (registered.registration.id, registered.term);
    println!("ok  register: {session} is master of {project} in {ns}, term {term}");

    let result = async {
        let mut url = api_url(&api.base, &["api", "v1", "controller", &project, "status"])?;
        url.query_pairs_mut().append_pair("namespace", ns);
        let routing: Routing = api.get(url, "a routing table").await.map_err(|e| step("status", e))?;
        let master = routing.master.as_ref().map(|m| m.session_id.as_str());
        anyhow::ensure!(
            master == Some(session.as_str()) && routing.term == term,
            "step status: the routing table names {master:?} at term {} (expected {session} at {term})",
            routing.term
        );
        println!("ok  status: the routing table names it master at term {term}");

        let api = &api;
        let fence = |t: i64| {
            let url = api_url(&api.base, &["api", "v1", "controller", "fence"]);
            let body = serde_json::json!({"namespace": ns, "project_id": project, "term": t});
            async move { api.send(api.http.post(url?).json(&body)).await }
        };
        fence(term).await.map_err(|e| step("fence", e))?;
        match fence(term - 1).await {
            Err(e) if e.downcast_ref::<super::api_client::ApiError>().is_some_and(|a| a.code == "stale_term") => {}
            Err(e) => return Err(step("fence", e)),
            Ok(_) => anyhow::bail!("step fence: term {} was accepted; the current term is {term}", term - 1),
        }
        println!("ok  fence: term {term} accepted, term {} refused stale_term", term - 1);
        Ok(())
    }
    .await;

    // Wrapped whatever happened above: a failed run leaves nothing registered.
    let mut url = api_url(&api.base, &["api", "v1", "controller", &id.to_string(), "release"])?;
    url.query_pairs_mut().append_pair("namespace", ns);
    let wrapped = api.send(api.http.post(url)).await.map_err(|e| step("wrap", e));
    result?;
    wrapped?;
    println!("ok  wrap: {session} released, its resource deleted");
    Ok(())
}

fn step(name: &str, e: anyhow::Error) -> anyhow::Error {
    anyhow::anyhow!("step {name}: {e:#}")
}
