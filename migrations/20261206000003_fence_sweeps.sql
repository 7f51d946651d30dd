-- A change of a project's master term cancels its fenced jobs (SPEC §5.1), but no longer
-- all of them inside the election's own transaction (SPEC §12, "Jobs are bounded"): with
-- 100,000 fenced jobs queued the election waited on every one. Now the transaction cancels
-- the first 1,000 queued ones, asks the Runs to stop the jobs in flight (bounded by their
-- slots), and leaves a sweep request for the rest, which the job reaper cancels after the
-- commit in batches of 1,000 (and asks the Runs of any stale job claimed meanwhile). Nothing is handed out meanwhile: a claim takes a
-- fenced job only while its term is its project's master term. Expand only: the
-- previous release's writers fire the same trigger.

-- A fenced job's term is the one current at its enqueue, and terms only rise: the stale
-- ones are those below the new term (a range of the index below, never the current
-- term's backlog), or all of them when the project has no master.

-- Projects whose stale-term queued jobs are still to be cancelled.
CREATE TABLE runtime_job_fence_sweeps (
    namespace    TEXT         NOT NULL,
    project_id   VARCHAR(128) NOT NULL,
    requested_at TIMESTAMPTZ  NOT NULL DEFAULT now(),
    PRIMARY KEY (namespace, project_id)
);

-- The fenced jobs of a project, in flight and queued apart: the change asks the Runs of
-- the first, and cancels a batch of the second, without reading the other.
CREATE INDEX runtime_jobs_fenced_in_flight
    ON runtime_jobs (fence_namespace, fence_project_id)
    WHERE fence_term IS NOT NULL AND state IN ('claimed','running');
CREATE INDEX runtime_jobs_fenced_queued
    ON runtime_jobs (fence_namespace, fence_project_id, fence_term)
    WHERE fence_term IS NOT NULL AND state = 'queued';

CREATE OR REPLACE FUNCTION controller_projects_fence_jobs() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    UPDATE runtime_jobs SET
        state = 'cancelled', completed_at = now(),
        cancel_reason = COALESCE(cancel_reason, 'stale_term'),
        cancel_cause = COALESCE(cancel_cause, 'stale_term'),
        updated_at = now()
    WHERE id IN (
        SELECT id FROM runtime_jobs
        WHERE fence_namespace = NEW.namespace AND fence_project_id = NEW.project_id
          AND fence_term IS NOT NULL AND state = 'queued'
          AND (fence_term < NEW.term OR NEW.master_id IS NULL)
        LIMIT 1000);
    -- After the queued batch: a claim that took one of them first has committed by now
    -- (the batch waited on its lock), and this statement's snapshot sees it in flight.
    UPDATE runtime_jobs SET
        cancel_requested_at = now(),
        cancel_reason = COALESCE(cancel_reason, 'stale_term'),
        cancel_cause = COALESCE(cancel_cause, 'stale_term'),
        updated_at = now()
    WHERE fence_namespace = NEW.namespace AND fence_project_id = NEW.project_id
      AND fence_term IS NOT NULL AND state IN ('claimed','running') AND cancel_requested_at IS NULL
      AND (fence_term < NEW.term OR NEW.master_id IS NULL);
    -- More left than one batch (or some the batch met claimed): the rest after the commit.
    IF EXISTS (
        SELECT 1 FROM runtime_jobs
        WHERE fence_namespace = NEW.namespace AND fence_project_id = NEW.project_id
          AND fence_term IS NOT NULL AND state = 'queued'
          AND (fence_term < NEW.term OR NEW.master_id IS NULL)) THEN
        INSERT INTO runtime_job_fence_sweeps (namespace, project_id) VALUES (NEW.namespace, NEW.project_id)
        ON CONFLICT (namespace, project_id) DO UPDATE SET requested_at = now();
    END IF;
    RETURN NULL;
END $$;
