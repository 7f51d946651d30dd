//! Enqueue: what a caller asks of a new job, and the one transaction that takes its
//! idempotency key, checks its fence's term and its namespace's quota, and inserts it.

use serde_json::Value;
use sha2::{Digest, Sha256};
use uuid::Uuid;

use super::{COLUMNS, Job, JobFence, JobKind, JobRow, JobStore};
use crate::db::Step as _;
use crate::run_registry::{RegistryError, RunAddress};

/// What an enqueue asks for, checked by the API (SPEC §5.1).
#[derive(Clone, Debug, PartialEq)]
pub struct NewJob {
    pub kind: JobKind,
    pub payload: Value,
    pub max_attempts: Option<i32>,
    pub timeout_seconds: Option<i32>,
    pub idempotency_key: Option<String>,
    pub fence: Option<JobFence>,
}

impl NewJob {
    /// The digest an idempotency key remembers: the request's own fields (defaults not
    /// filled in), keys sorted, so the same request retried matches and any other does not.
    pub fn digest(&self) -> String {
        let fields = serde_json::json!({
            "kind": self.kind,
            "payload": canonical(&self.payload),
            "max_attempts": self.max_attempts,
            "timeout_seconds": self.timeout_seconds,
            "fence": self.fence,
        });
        Sha256::digest(canonical(&fields).to_string().as_bytes()).iter().map(|b| format!("{b:02x}")).collect()
    }
}

/// `v` with every object's keys in order, whatever order the map type keeps.
fn canonical(v: &Value) -> Value {
    match v {
        Value::Object(map) => {
            let mut keys: Vec<&String> = map.keys().collect();
            keys.sort();
            let mut out = serde_json::Map::new();
            for k in keys {
                out.insert(k.clone(), canonical(&map[k]));
            }
            Value::Object(out)
        }
        Value::Array(items) => Value::Array(items.iter().map(canonical).collect()),
        other => other.clone(),
    }
}

/// What an enqueue did.
#[derive(Clone, Debug, PartialEq)]
pub enum Enqueued {
    Created(Job),
    /// The same idempotency key and request within 24 h: the first job, as it is now.
    Existing(Job),
    /// The same key with another request.
    IdempotencyConflict,
    /// The fence's term is not its project's current master term.
    StaleTerm,
    /// The namespace holds its quota of queued jobs already.
    QuotaExceeded {
        limit: i64,
    },
}

impl JobStore {
    /// A job for `a`, owned by `namespace` (the namespace of the RunSession it is for).
    /// With an idempotency key, the first job of that key (24 h) answers a repeat; with a
    /// fence, only while its term is the project's master term. One transaction: 20
    /// concurrent identical requests make one job.
    #[tracing::instrument(level = "debug", skip_all, fields(store = "jobs"))]
    pub async fn enqueue(&self, namespace: &str, a: &RunAddress, new: &NewJob) -> Result<Enqueued, RegistryError> {
        for _ in 0..3 {
            if let Some(done) = self.try_enqueue(namespace, a, new).await? {
                return Ok(done);
            }
        }
        Err(RegistryError::Unavailable("enqueue: the idempotency key kept changing hands; retry".into()))
    }

    /// One try of `enqueue`; `None` when the key expired and was pruned between its two
    /// reads (try again).
    async fn try_enqueue(
        &self,
        namespace: &str,
        a: &RunAddress,
        new: &NewJob,
    ) -> Result<Option<Enqueued>, RegistryError> {
        let mut tx = crate::db::begin(&self.pool).await.step("enqueue: begin")?;
        let id = Uuid::new_v4();
        if let Some(key) = &new.idempotency_key {
            let digest = new.digest();
            // Waits on a concurrent insert of the same key, then sees it. An expired key
            // (over 24 h) is taken over by this request.
            let taken: Option<Uuid> = sqlx::query_scalar(
                "INSERT INTO runtime_job_idempotency
                     (namespace, server_instance_id, component_kind, idempotency_key, job_id, request_digest)
                 VALUES ($1, $2, $3, $4, $5, $6)
                 ON CONFLICT (namespace, server_instance_id, component_kind, idempotency_key) DO UPDATE
                     SET job_id = EXCLUDED.job_id, request_digest = EXCLUDED.request_digest, created_at = now()
                     WHERE runtime_job_idempotency.created_at < now() - interval '24 hours'
                 RETURNING job_id",
            )
            .bind(namespace)
            .bind(&a.server_instance_id)
            .bind(&a.component_kind)
            .bind(key)
            .bind(id)
            .bind(&digest)
            .fetch_optional(&mut *tx)
            .await
            .step("enqueue: take the idempotency key")?;
            if taken.is_none() {
                let first: Option<(Uuid, String)> = sqlx::query_as(
                    "SELECT job_id, request_digest FROM runtime_job_idempotency
                     WHERE namespace = $1 AND server_instance_id = $2 AND component_kind = $3 AND idempotency_key = $4",
                )
                .bind(namespace)
                .bind(&a.server_instance_id)
                .bind(&a.component_kind)
                .bind(key)
                .fetch_optional(&mut *tx)
                .await
                .step("enqueue: read the idempotency key")?;
                let Some((job_id, first_digest)) = first else {
                    return Ok(None);
                };
                if first_digest != digest {
                    return Ok(Some(Enqueued::IdempotencyConflict));
                }
                let job = self.get_in(&mut tx, namespace, job_id).await?;
                tx.commit().await.step("enqueue: commit")?;
                return Ok(job.map(Enqueued::Existing));
            }
        }
        if let Some(f) = &new.fence {
            // FOR SHARE: a change of master holds the project row until it commits, so a
            // fenced job is never inserted after its term moved on (that change's trigger
            // would not see it).
            let current: Option<(i64, bool)> = sqlx::query_as(
                "SELECT term, master_id IS NOT NULL FROM controller_projects
                 WHERE namespace = $1 AND project_id = $2 FOR SHARE",
            )
            .bind(&f.namespace)
            .bind(&f.project_id)
            .fetch_optional(&mut *tx)
            .await
            .step("enqueue: check the fence's term")?;
            if current != Some((f.term, true)) {
                return Ok(Some(Enqueued::StaleTerm));
            }
        }
        // The namespace's queued jobs, from the trigger-kept count (16 rows at most, whatever
        // the backlog). Concurrent enqueues may pass the quota by as many as race here: a
        // bound, not an exact count.
        let queued: i64 = sqlx::query_scalar(
            "SELECT COALESCE(sum(queued), 0)::int8 FROM runtime_job_queue_counts WHERE namespace = $1",
        )
        .bind(namespace)
        .fetch_one(&mut *tx)
        .await
        .step("enqueue: count the namespace's queued jobs")?;
        if queued >= self.settings.max_queued_per_namespace {
            return Ok(Some(Enqueued::QuotaExceeded { limit: self.settings.max_queued_per_namespace }));
        }
        let sql = format!(
            "INSERT INTO runtime_jobs (id, namespace, server_instance_id, component_kind, kind, payload, max_attempts,
                 timeout_seconds, idempotency_key, fence_namespace, fence_project_id, fence_term)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12) RETURNING {COLUMNS}"
        );
        let row: JobRow = sqlx::query_as(sqlx::AssertSqlSafe(sql))
            .bind(id)
            .bind(namespace)
            .bind(&a.server_instance_id)
            .bind(&a.component_kind)
            .bind(new.kind)
            .bind(&new.payload)
            .bind(new.max_attempts.unwrap_or(self.settings.default_max_attempts))
            .bind(new.timeout_seconds.unwrap_or(self.settings.default_timeout_seconds))
            .bind(&new.idempotency_key)
            .bind(new.fence.as_ref().map(|f| &f.namespace))
            .bind(new.fence.as_ref().map(|f| &f.project_id))
            .bind(new.fence.as_ref().map(|f| f.term))
            .fetch_one(&mut *tx)
            .await
            .step("enqueue: insert job")?;
        tx.commit().await.step("enqueue: commit")?;
        Ok(Some(Enqueued::Created(row.into())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn new_job(payload: Value) -> NewJob {
        NewJob {
            kind: JobKind::Config,
            payload,
            max_attempts: None,
            timeout_seconds: None,
            idempotency_key: Some("k".into()),
            fence: None,
        }
    }

    #[test]
    fn the_digest_is_the_request_not_its_key_order() {
        let a = new_job(json!({"a": 1, "b": {"c": [1, 2], "d": null}}));
        let b = new_job(serde_json::from_str(r#"{"b": {"d": null, "c": [1, 2]}, "a": 1}"#).expect("json"));
        assert_eq!(a.digest(), b.digest());
        assert_ne!(a.digest(), new_job(json!({"a": 2})).digest());
        let mut c = a.clone();
        c.max_attempts = Some(3);
        assert_ne!(a.digest(), c.digest(), "an explicit default is another request");
        let mut d = a.clone();
        d.idempotency_key = Some("other".into());
        assert_eq!(a.digest(), d.digest(), "the key itself is not part of the request");
    }
}
