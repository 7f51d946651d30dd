-- Jobs are bounded (SPEC §12): a quota of queued jobs per namespace, an expiry for jobs
-- left queued, and cancellations counted by fixed causes only. Expand only: the previous
-- release keeps working on this schema (it never reads the new column or table; the
-- triggers below keep them right whichever release writes the jobs).

-- Why a job was cancelled, as one of the fixed causes metrics may name. The canceller's
-- free text stays in `cancel_reason` (stored and answered, never a metric label: one
-- tenant's words on a page every scraper reads, and a series per distinct text).
-- NULL on rows cancelled by an earlier release: the census maps their reason.
ALTER TABLE runtime_jobs
    ADD COLUMN cancel_cause TEXT CHECK (
        cancel_cause IN ('requested','stale_term','identity_deleted','expired','grace','run_cancelled'));

-- The fence trigger (20261202000001) now also says why.
CREATE OR REPLACE FUNCTION controller_projects_fence_jobs() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    UPDATE runtime_jobs SET
        state = CASE WHEN state = 'queued' THEN 'cancelled' ELSE state END,
        completed_at = CASE WHEN state = 'queued' THEN now() ELSE completed_at END,
        cancel_requested_at = CASE WHEN state = 'queued' THEN NULL ELSE COALESCE(cancel_requested_at, now()) END,
        cancel_reason = COALESCE(cancel_reason, 'stale_term'),
        cancel_cause = COALESCE(cancel_cause, 'stale_term'),
        updated_at = now()
    WHERE fence_namespace = NEW.namespace AND fence_project_id = NEW.project_id
      AND fence_term IS NOT NULL AND state IN ('queued','claimed','running')
      AND (fence_term <> NEW.term OR NEW.master_id IS NULL)
      AND NOT (state <> 'queued' AND cancel_requested_at IS NOT NULL);
    RETURN NULL;
END $$;

-- Queued jobs per namespace, held as a count the enqueue reads in O(1) whatever the
-- backlog (counting the rows would read up to the quota's 100,000 index entries per
-- enqueue). Kept by a trigger, so every writer of any release keeps it right. Sixteen
-- shards per namespace, a shard per address (server, component): a claim or a Run's
-- deletion touches one shard, so concurrent claims of one namespace neither wait on one
-- row nor lock two in opposite orders.
CREATE TABLE runtime_job_queue_counts (
    namespace TEXT     NOT NULL,
    shard     SMALLINT NOT NULL CHECK (shard BETWEEN 0 AND 15),
    queued    BIGINT   NOT NULL,
    PRIMARY KEY (namespace, shard)
);

CREATE FUNCTION runtime_jobs_count_queued() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    delta BIGINT := 0;
    job   runtime_jobs;
BEGIN
    IF TG_OP = 'INSERT' THEN
        job := NEW;
        IF NEW.state = 'queued' THEN delta := 1; END IF;
    ELSIF TG_OP = 'DELETE' THEN
        job := OLD;
        IF OLD.state = 'queued' THEN delta := -1; END IF;
    ELSE
        job := NEW;
        IF OLD.state = 'queued' AND NEW.state <> 'queued' THEN
            delta := -1;
        ELSIF OLD.state <> 'queued' AND NEW.state = 'queued' THEN
            delta := 1;
        END IF;
    END IF;
    IF delta <> 0 THEN
        INSERT INTO runtime_job_queue_counts AS c (namespace, shard, queued)
        VALUES (job.namespace, hashtext(job.server_instance_id || '/' || job.component_kind) & 15, delta)
        ON CONFLICT (namespace, shard) DO UPDATE SET queued = c.queued + EXCLUDED.queued;
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER runtime_jobs_count_queued
    AFTER INSERT OR DELETE OR UPDATE OF state ON runtime_jobs
    FOR EACH ROW EXECUTE FUNCTION runtime_jobs_count_queued();

-- The count of the jobs already queued (the lock makes the count and the trigger's first
-- increments of a concurrent enqueue one after the other).
LOCK TABLE runtime_jobs IN SHARE ROW EXCLUSIVE MODE;
INSERT INTO runtime_job_queue_counts (namespace, shard, queued)
SELECT namespace, hashtext(server_instance_id || '/' || component_kind) & 15, count(*)
FROM runtime_jobs WHERE state = 'queued'
GROUP BY 1, 2;

-- The expiry of jobs left queued (`PRISM_JOB_QUEUED_TTL_HOURS`): oldest first.
CREATE INDEX runtime_jobs_queued_since ON runtime_jobs (created_at) WHERE state = 'queued';

-- A step names its attempt (SPEC §12). The step statement tells the attempt it named
-- through a setting local to its transaction; the history row of the change it made
-- keeps it, so the fault harness's checker can see that no step of a finished or
-- superseded attempt ever changed a job (NULL: not a step, or one that named none).
ALTER TABLE runtime_job_events ADD COLUMN step_attempt INTEGER;
CREATE OR REPLACE FUNCTION runtime_job_events_record() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    current_term BIGINT;
BEGIN
    IF TG_OP = 'UPDATE' AND OLD.state = NEW.state THEN
        RETURN NULL;
    END IF;
    IF NEW.state = 'claimed' AND NEW.fence_term IS NOT NULL THEN
        SELECT CASE WHEN master_id IS NULL THEN NULL ELSE term END INTO current_term
        FROM controller_projects WHERE namespace = NEW.fence_namespace AND project_id = NEW.fence_project_id;
    END IF;
    INSERT INTO runtime_job_events (job_id, state, attempts, project_term, step_attempt)
    VALUES (NEW.id, NEW.state, NEW.attempts, current_term,
            NULLIF(current_setting('prism.step_attempt', true), '')::integer);
    RETURN NULL;
END $$;
