//! `prism-operator jobs list|get|cancel` (SPEC §5.1 "Read" and "Cancel"; also `kubectl
//! prism jobs …`): a client of the operator's HTTP API, not of Kubernetes. It decodes the
//! wire format of SPEC §8 into types of its own (it is one of the API's clients, like a
//! platform's dispatcher), so fields it does not know yet pass through `-o json|yaml`.

use std::collections::BTreeMap;
use std::io::Write as _;

use anyhow::Context as _;
use chrono::{DateTime, Utc};
use reqwest::{StatusCode, Url};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use uuid::Uuid;

use super::api_client::{Api, one_line};
pub use super::api_client::{ApiError, api_error, api_url};
use crate::config::{JobsCancelArgs, JobsCommand, JobsGetArgs, JobsListArgs, OutputFormat};
use crate::time::age;

/// A job as the API answers it (SPEC §8). Fields beyond these are kept in `extra` and
/// printed again by `-o json|yaml`; the optional ones are optional so that an older or
/// newer operator's answer still reads.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
pub struct Job {
    pub id: Uuid,
    pub namespace: String,
    pub server_instance_id: String,
    pub component_kind: String,
    pub kind: String,
    #[serde(default)]
    pub payload: Value,
    pub state: String,
    pub attempts: i64,
    #[serde(default)]
    pub max_attempts: Option<i64>,
    #[serde(default)]
    pub timeout_seconds: Option<i64>,
    #[serde(default)]
    pub idempotency_key: Option<String>,
    #[serde(default)]
    pub fence: Option<Fence>,
    pub created_at: DateTime<Utc>,
    #[serde(default)]
    pub claimed_at: Option<DateTime<Utc>>,
    #[serde(default)]
    pub completed_at: Option<DateTime<Utc>>,
    #[serde(default)]
    pub progress: Option<Value>,
    #[serde(default)]
    pub result: Option<Value>,
    #[serde(default)]
    pub last_error: Option<String>,
    #[serde(default)]
    pub cancel_requested: Option<bool>,
    #[serde(default)]
    pub cancel_reason: Option<String>,
    #[serde(flatten)]
    pub extra: BTreeMap<String, Value>,
}

/// The election term a job was fenced with (SPEC §5.1 "Term-fenced jobs").
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
pub struct Fence {
    pub namespace: String,
    pub project_id: String,
    pub term: i64,
    #[serde(flatten)]
    pub extra: BTreeMap<String, Value>,
}

/// One page of `GET /api/v1/runtime/jobs` (or, with `--all`, every page in one).
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
pub struct JobPage {
    pub jobs: Vec<Job>,
    #[serde(default)]
    pub next_cursor: Option<String>,
}

/// What `jobs list` asks for: the query of `GET /api/v1/runtime/jobs`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ListQuery {
    pub namespace: String,
    pub server_instance_id: Option<String>,
    pub component_kind: Option<String>,
    pub state: Option<String>,
    pub limit: Option<u32>,
    pub after: Option<String>,
}

impl ListQuery {
    pub fn from_args(args: &JobsListArgs) -> ListQuery {
        ListQuery {
            namespace: args.namespace.clone(),
            server_instance_id: args.server_instance_id.clone(),
            component_kind: args.component_kind.clone(),
            state: args.state.map(|s| s.as_str().to_string()),
            limit: args.limit,
            after: args.after.clone(),
        }
    }

    /// The page's URL; absent filters are left out of the query.
    pub fn url(&self, api: &str) -> anyhow::Result<Url> {
        let mut url = api_url(api, &["api", "v1", "runtime", "jobs"])?;
        {
            let mut q = url.query_pairs_mut();
            q.append_pair("namespace", &self.namespace);
            let limit = self.limit.map(|l| l.to_string());
            let optional = [
                ("server_instance_id", self.server_instance_id.as_deref()),
                ("component_kind", self.component_kind.as_deref()),
                ("state", self.state.as_deref()),
                ("limit", limit.as_deref()),
                ("after", self.after.as_deref()),
            ];
            for (name, value) in optional {
                if let Some(value) = value {
                    q.append_pair(name, value);
                }
            }
        }
        Ok(url)
    }
}

/// `GET /api/v1/runtime/jobs/{id}?namespace=`, or with `action` (`cancel`) its POST.
pub fn job_url(api: &str, id: Uuid, namespace: &str, action: Option<&str>) -> anyhow::Result<Url> {
    let id = id.to_string();
    let mut segments = vec!["api", "v1", "runtime", "jobs", id.as_str()];
    segments.extend(action);
    let mut url = api_url(api, &segments)?;
    url.query_pairs_mut().append_pair("namespace", namespace);
    Ok(url)
}

/// The STATE column: the state, and what is pending or why it ended when that matters.
pub fn state_text(job: &Job) -> String {
    let finished = matches!(job.state.as_str(), "succeeded" | "failed" | "cancelled");
    if job.cancel_requested == Some(true) && !finished {
        return format!("{} (cancel requested)", job.state);
    }
    match (job.state.as_str(), job.cancel_reason.as_deref().map(one_line)) {
        ("cancelled", Some(reason)) if !reason.is_empty() => format!("cancelled ({})", truncate(&reason, 32)),
        _ => job.state.clone(),
    }
}

fn truncate(s: &str, max: usize) -> String {
    if s.chars().count() <= max {
        return s.to_string();
    }
    let mut cut: String = s.chars().take(max.saturating_sub(1)).collect();
    cut.push('…');
    cut
}

/// The ATTEMPTS column: attempts made / attempts allowed.
pub fn attempts_text(job: &Job) -> String {
    match job.max_attempts {
        Some(max) => format!("{}/{max}", job.attempts),
        None => job.attempts.to_string(),
    }
}

/// The jobs as `kubectl get` prints a table: a header, one line per job, columns padded
/// to their widest cell and three spaces apart.
pub fn render_table(jobs: &[Job], now: DateTime<Utc>) -> String {
    let header = ["ID", "SERVER", "COMPONENT", "KIND", "STATE", "ATTEMPTS", "AGE", "LAST ERROR"];
    let mut rows: Vec<Vec<String>> = vec![header.iter().map(|h| h.to_string()).collect()];
    for job in jobs {
        rows.push(vec![
            job.id.to_string(),
            one_line(&job.server_instance_id),
            one_line(&job.component_kind),
            one_line(&job.kind),
            one_line(&state_text(job)),
            attempts_text(job),
            age(job.created_at, now),
            job.last_error.as_deref().map(one_line).filter(|e| !e.is_empty()).unwrap_or_else(|| "<none>".into()),
        ]);
    }
    let widths: Vec<usize> =
        (0..header.len()).map(|i| rows.iter().map(|r| r[i].chars().count()).max().unwrap_or(0)).collect();
    let mut out = String::new();
    for row in rows {
        let cells: Vec<String> = row.iter().zip(&widths).map(|(c, w)| format!("{c:<w$}")).collect();
        out.push_str(cells.join("   ").trim_end());
        out.push('\n');
    }
    out
}

/// The line `jobs cancel` prints for the API's success status.
pub fn cancel_message(id: Uuid, status: StatusCode) -> String {
    match status {
        StatusCode::OK => format!("job {id} cancelled"),
        StatusCode::ACCEPTED => {
            format!("job {id}: cancel requested, the Run is told (cancelled anyway when its grace period ends)")
        }
        other => format!("job {id}: cancel accepted (HTTP {})", other.as_u16()),
    }
}

/// `value` as `-o json` prints it.
fn json<T: Serialize>(value: &T) -> anyhow::Result<String> {
    Ok(format!("{}\n", serde_json::to_string_pretty(value)?))
}

/// `value` as `-o yaml` prints it.
fn yaml<T: Serialize>(value: &T) -> anyhow::Result<String> {
    Ok(serde_yaml::to_string(value)?)
}

/// Writes to stdout; a reader that went away (`jobs list | head`) is no error.
fn emit(text: &str) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(e).context("cannot write to stdout"),
        _ => Ok(()),
    }
}

pub async fn run(command: JobsCommand) -> anyhow::Result<()> {
    match command {
        JobsCommand::List(args) => list(args).await,
        JobsCommand::Get(args) => get(args).await,
        JobsCommand::Cancel(args) => cancel(args).await,
    }
}

async fn list(args: JobsListArgs) -> anyhow::Result<()> {
    let api = Api::new(&args.api)?;
    let mut query = ListQuery::from_args(&args);
    let mut page: JobPage = api.get(query.url(&api.base)?, "a page of jobs").await?;
    if args.all {
        let mut jobs = std::mem::take(&mut page.jobs);
        while let Some(cursor) = page.next_cursor.take() {
            // A cursor that does not move on would page forever.
            anyhow::ensure!(
                query.after.as_deref() != Some(cursor.as_str()),
                "the API answered the same next_cursor twice; stopped paging"
            );
            query.after = Some(cursor);
            page = api.get(query.url(&api.base)?, "a page of jobs").await?;
            jobs.append(&mut page.jobs);
        }
        page = JobPage { jobs, next_cursor: None };
    }
    match args.output {
        OutputFormat::Table if page.jobs.is_empty() => {
            eprintln!("No jobs found in namespace {}.", args.namespace);
        }
        OutputFormat::Table => {
            emit(&render_table(&page.jobs, Utc::now()))?;
            if let Some(cursor) = &page.next_cursor {
                eprintln!("more jobs: --all for every page, or --after {cursor} for the next");
            }
        }
        OutputFormat::Json => emit(&json(&page)?)?,
        OutputFormat::Yaml => emit(&yaml(&page)?)?,
    }
    Ok(())
}

async fn get(args: JobsGetArgs) -> anyhow::Result<()> {
    let api = Api::new(&args.api)?;
    let job: Job = api.get(job_url(&api.base, args.id, &args.namespace, None)?, "a job").await?;
    match args.output {
        OutputFormat::Table => emit(&render_table(std::slice::from_ref(&job), Utc::now())),
        OutputFormat::Json => emit(&json(&job)?),
        OutputFormat::Yaml => emit(&yaml(&job)?),
    }
}

async fn cancel(args: JobsCancelArgs) -> anyhow::Result<()> {
    let api = Api::new(&args.api)?;
    let mut request = api.http.post(job_url(&api.base, args.id, &args.namespace, Some("cancel"))?);
    if let Some(reason) = &args.reason {
        request = request.json(&serde_json::json!({"reason": reason}));
    }
    let (status, _) = api.send(request).await?;
    emit(&format!("{}\n", cancel_message(args.id, status)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::commands::api_client::decode;
    use serde_json::json;

    fn wire_job(id: u128, state: &str) -> Value {
        json!({
            "id": Uuid::from_u128(id), "namespace": "runtime", "server_instance_id": "srv-eu1-7",
            "component_kind": "run", "kind": "config", "payload": {"n": 1}, "state": state,
            "attempts": 1, "max_attempts": 3, "timeout_seconds": 600, "idempotency_key": null,
            "fence": {"namespace": "agents", "project_id": "PID-1", "term": 4},
            "created_at": "2026-12-01T14:00:00Z", "claimed_at": "2026-12-01T14:00:01.500Z",
            "completed_at": null, "progress": null, "result": null, "last_error": null,
            "cancel_requested": false, "cancel_reason": null,
        })
    }

    fn job(id: u128, state: &str) -> Job {
        serde_json::from_value(wire_job(id, state)).expect("a job")
    }

    #[test]
    fn the_wire_format_reads_and_unknown_fields_pass_through() {
        let mut wire = wire_job(1, "running");
        wire["cancel_requested_at"] = json!("2026-12-01T14:00:02Z");
        wire["something_new"] = json!({"x": [1, 2]});
        let job: Job = serde_json::from_value(wire.clone()).expect("a job");
        assert_eq!(job.fence.as_ref().map(|f| (f.project_id.as_str(), f.term)), Some(("PID-1", 4)));
        assert_eq!(job.claimed_at.map(|t| t.timestamp_millis() % 1000), Some(500));
        assert_eq!(job.extra.len(), 2);
        // -o json prints what the API said, the fields this CLI does not know included.
        let back = serde_json::to_value(&job).expect("json");
        assert_eq!(back, wire);

        // The fields the CLI cannot do without are required; the others may be absent.
        let minimal = json!({"id": Uuid::nil(), "namespace": "n", "server_instance_id": "s",
            "component_kind": "run", "kind": "log", "state": "queued", "attempts": 0,
            "created_at": "2026-12-01T14:00:00Z"});
        let job: Job = serde_json::from_value(minimal).expect("a minimal job");
        assert_eq!((attempts_text(&job), state_text(&job)), ("0".into(), "queued".into()));
        let page: JobPage = decode(br#"{"jobs": []}"#, "a page").expect("a page without next_cursor");
        assert_eq!(page.next_cursor, None);
        let e = decode::<JobPage>(br#"{"jobs": [{"id": "nope"}]}"#, "a page of jobs").unwrap_err().to_string();
        assert!(e.starts_with("the API's answer is not a page of jobs: jobs[0].id"), "{e}");
    }

    #[test]
    fn api_errors_are_one_line_with_their_code() {
        let body = br#"{"error": {"code": "job_finished", "message": "job 1 is\nsucceeded \u001b[31m"}}"#;
        let e = api_error(StatusCode::CONFLICT, body);
        assert_eq!(e.to_string(), "job_finished: job 1 is succeeded  [31m");
        assert_eq!(e.status, 409);
        for body in [&b"<html>bad gateway</html>"[..], b"", br#"{"error": {"code": ""}}"#, br#"{"error": 1}"#] {
            let e = api_error(StatusCode::BAD_GATEWAY, body);
            assert_eq!(e.to_string(), "http_502: Bad Gateway (the answer is not the operator API's)");
        }
    }

    #[test]
    fn urls_keep_a_path_prefix_and_encode_every_value() {
        let q = ListQuery { namespace: "runtime".into(), ..Default::default() };
        assert_eq!(
            q.url("http://127.0.0.1:8080").unwrap().as_str(),
            "http://127.0.0.1:8080/api/v1/runtime/jobs?namespace=runtime"
        );
        assert_eq!(
            q.url("https://gw.example/prism/?x=1#f").unwrap().as_str(),
            "https://gw.example/prism/api/v1/runtime/jobs?namespace=runtime"
        );
        let q = ListQuery {
            namespace: "runtime".into(),
            server_instance_id: Some("srv a&b".into()),
            component_kind: Some("run".into()),
            state: Some("queued".into()),
            limit: Some(1),
            after: Some("c+/=".into()),
        };
        assert_eq!(
            q.url("http://h").unwrap().query(),
            Some(
                "namespace=runtime&server_instance_id=srv+a%26b&component_kind=run&state=queued&limit=1&after=c%2B%2F%3D"
            )
        );
        let id = Uuid::from_u128(7);
        assert_eq!(
            job_url("http://h:1/", id, "a b", Some("cancel")).unwrap().as_str(),
            format!("http://h:1/api/v1/runtime/jobs/{id}/cancel?namespace=a+b")
        );
        assert_eq!(job_url("http://h", id, "n", None).unwrap().path(), format!("/api/v1/runtime/jobs/{id}"));
        for bad in ["127.0.0.1:8080", "ftp://h", "mailto:x@y", "http://", ""] {
            let e = api_url(bad, &[]).unwrap_err().to_string();
            assert!(e.starts_with("--api / PRISM_API") && e.contains("http:// or https://"), "{bad}: {e}");
        }
    }

    #[test]
    fn the_table_reads_like_kubectl_get() {
        let now = DateTime::parse_from_rfc3339("2026-12-01T14:03:05Z").unwrap().with_timezone(&Utc);
        let mut running = job(1, "running");
        running.cancel_requested = Some(true);
        let mut failed = job(2, "failed");
        failed.attempts = 3;
        failed.last_error = Some("deadline_exceeded\n\x1b[2J".into());
        failed.created_at = now - chrono::Duration::days(4);
        let mut cancelled = job(3, "cancelled");
        cancelled.cancel_requested = Some(true);
        cancelled.cancel_reason = Some("identity_deleted".into());
        cancelled.created_at = now - chrono::Duration::seconds(45);
        let mut queued = job(4, "queued");
        queued.max_attempts = None;
        queued.kind = "protected_request".into();
        let table = render_table(&[running, failed, cancelled, queued], now);
        let expected = [
            "ID                                     SERVER      COMPONENT   KIND                STATE                          ATTEMPTS   AGE    LAST ERROR",
            "00000000-0000-0000-0000-000000000001   srv-eu1-7   run         config              running (cancel requested)     1/3        3m5s   <none>",
            "00000000-0000-0000-0000-000000000002   srv-eu1-7   run         config              failed                         3/3        4d     deadline_exceeded  [2J",
            "00000000-0000-0000-0000-000000000003   srv-eu1-7   run         config              cancelled (identity_deleted)   1/3        45s    <none>",
            "00000000-0000-0000-0000-000000000004   srv-eu1-7   run         protected_request   queued                         1          3m5s   <none>",
        ]
        .map(|l| format!("{l}\n"))
        .concat();
        assert_eq!(table, expected);
        assert_eq!(render_table(&[], now), "ID   SERVER   COMPONENT   KIND   STATE   ATTEMPTS   AGE   LAST ERROR\n");
    }

    #[test]
    fn state_and_attempts_columns() {
        let mut j = job(1, "queued");
        assert_eq!(state_text(&j), "queued");
        j.cancel_reason = Some("x".repeat(40));
        j.state = "cancelled".into();
        assert_eq!(state_text(&j), format!("cancelled ({}…)", "x".repeat(31)));
        j.state = "succeeded".into();
        j.cancel_requested = Some(true);
        assert_eq!(state_text(&j), "succeeded", "a finished job has no pending cancel");
        j.state = "claimed".into();
        assert_eq!(state_text(&j), "claimed (cancel requested)");
        assert_eq!(attempts_text(&j), "1/3");
    }

    #[test]
    fn cancel_says_which_of_its_answers_it_got() {
        let id = Uuid::from_u128(9);
        assert_eq!(cancel_message(id, StatusCode::OK), format!("job {id} cancelled"));
        assert!(
            cancel_message(id, StatusCode::ACCEPTED)
                .starts_with(&format!("job {id}: cancel requested, the Run is told"))
        );
    }
}
