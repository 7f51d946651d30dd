-- The job lifecycle a platform runs on (SPEC §5.1): bounded attempts and deadlines,
-- backoff, cancel, idempotent enqueue, eligibility and term fences. Every rule a row can
-- state is a CHECK here, so no code path can break it.

ALTER TABLE runtime_jobs
    ADD COLUMN max_attempts        INTEGER     NOT NULL DEFAULT 3 CHECK (max_attempts BETWEEN 1 AND 100),
    ADD COLUMN timeout_seconds     INTEGER     NOT NULL DEFAULT 600 CHECK (timeout_seconds BETWEEN 1 AND 86400),
    -- When the current attempt's `timeout_seconds` run out (set by the claim).
    ADD COLUMN deadline_at         TIMESTAMPTZ,
    -- A queued job is not claimed before this (the backoff after a retryable end).
    ADD COLUMN eligible_at         TIMESTAMPTZ NOT NULL DEFAULT now(),
    ADD COLUMN last_error          TEXT CHECK (last_error IS NULL OR length(last_error) BETWEEN 1 AND 1024),
    ADD COLUMN cancel_requested_at TIMESTAMPTZ,
    ADD COLUMN idempotency_key     VARCHAR(128) CHECK (idempotency_key ~ '^[A-Za-z0-9._:-]{1,128}$'),
    -- A term-fenced job: valid only while `fence_term` is its project's master term.
    ADD COLUMN fence_namespace     TEXT CHECK (length(fence_namespace) BETWEEN 1 AND 63),
    ADD COLUMN fence_project_id    VARCHAR(128) CHECK (length(fence_project_id) >= 1),
    ADD COLUMN fence_term          BIGINT CHECK (fence_term >= 1),
    ADD CONSTRAINT fence_is_whole CHECK (
        (fence_namespace IS NULL) = (fence_project_id IS NULL) AND (fence_namespace IS NULL) = (fence_term IS NULL)),
    -- Claimed at most `max_attempts` times: each claim counts one.
    ADD CONSTRAINT attempts_bounded CHECK (attempts <= max_attempts),
    ADD CONSTRAINT in_flight_has_deadline CHECK (state NOT IN ('claimed','running') OR deadline_at IS NOT NULL),
    ADD CONSTRAINT cancel_request_in_flight CHECK (cancel_requested_at IS NULL OR state <> 'queued');
UPDATE runtime_jobs SET deadline_at = visible_at WHERE state IN ('claimed','running');

-- Claims: eligible queued jobs of one target, oldest first (kind filtered on the rows).
DROP INDEX IF EXISTS runtime_jobs_queued_by_target;
CREATE INDEX runtime_jobs_queued_by_target
    ON runtime_jobs (namespace, server_instance_id, component_kind, created_at, id)
    INCLUDE (kind, eligible_at, fence_term)
    WHERE state = 'queued';
-- The reaper: attempts past their deadline.
CREATE INDEX runtime_jobs_in_flight_attempt_deadline
    ON runtime_jobs (deadline_at)
    WHERE state IN ('claimed','running');
-- Cancel requests the Run must hear of, and the grace sweep.
CREATE INDEX runtime_jobs_cancel_requested
    ON runtime_jobs (namespace, server_instance_id, component_kind)
    INCLUDE (cancel_requested_at)
    WHERE cancel_requested_at IS NOT NULL AND state IN ('claimed','running');
-- The list (newest first, keyset) per namespace, and per target.
CREATE INDEX runtime_jobs_listed ON runtime_jobs (namespace, created_at DESC, id DESC);
CREATE INDEX runtime_jobs_listed_by_target
    ON runtime_jobs (namespace, server_instance_id, component_kind, created_at DESC, id DESC);
-- A change of term finds the project's fenced unfinished jobs.
CREATE INDEX runtime_jobs_fenced_unfinished
    ON runtime_jobs (fence_namespace, fence_project_id, fence_term)
    WHERE fence_term IS NOT NULL AND state IN ('queued','claimed','running');

-- Idempotent enqueue: one job per (namespace, address, key) for 24 h. The digest is of
-- the request's own fields, so a retried request matches and a different body does not.
-- The job is inserted after its key in the same transaction: the reference is deferred.
CREATE TABLE runtime_job_idempotency (
    namespace          TEXT         NOT NULL,
    server_instance_id VARCHAR(253) NOT NULL,
    component_kind     VARCHAR(63)  NOT NULL,
    idempotency_key    VARCHAR(128) NOT NULL CHECK (idempotency_key ~ '^[A-Za-z0-9._:-]{1,128}$'),
    job_id             UUID         NOT NULL REFERENCES runtime_jobs (id) ON DELETE CASCADE DEFERRABLE INITIALLY DEFERRED,
    request_digest     CHAR(64)     NOT NULL,
    created_at         TIMESTAMPTZ  NOT NULL DEFAULT now(),
    PRIMARY KEY (namespace, server_instance_id, component_kind, idempotency_key)
);
CREATE INDEX runtime_job_idempotency_created ON runtime_job_idempotency (created_at);

-- Every change of a job's state, written by the database itself: what the fault
-- harness's checker reads (finished at most once, claimed at most max_attempts times, no
-- fenced job claimed after its term passed). `project_term`: for a fenced job's claim,
-- its project's master term at that moment (NULL when the project has no master).
CREATE TABLE runtime_job_events (
    id           BIGSERIAL   PRIMARY KEY,
    job_id       UUID        NOT NULL REFERENCES runtime_jobs (id) ON DELETE CASCADE,
    at           TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp(),
    state        VARCHAR(16) NOT NULL,
    attempts     INTEGER     NOT NULL,
    project_term BIGINT
);
CREATE INDEX runtime_job_events_job ON runtime_job_events (job_id, id);

CREATE FUNCTION runtime_job_events_record() RETURNS trigger LANGUAGE plpgsql AS $$
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
    INSERT INTO runtime_job_events (job_id, state, attempts, project_term)
    VALUES (NEW.id, NEW.state, NEW.attempts, current_term);
    RETURN NULL;
END $$;
CREATE TRIGGER runtime_job_events_record
    AFTER INSERT OR UPDATE OF state ON runtime_jobs
    FOR EACH ROW EXECUTE FUNCTION runtime_job_events_record();

-- A finished job stays finished: no statement of any version of the code can revive it.
CREATE FUNCTION runtime_jobs_finished_stay() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF OLD.state IN ('succeeded','failed','cancelled') AND NEW.state <> OLD.state THEN
        RAISE EXCEPTION 'job % is % and stays so', OLD.id, OLD.state;
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER runtime_jobs_finished_stay
    BEFORE UPDATE OF state ON runtime_jobs
    FOR EACH ROW EXECUTE FUNCTION runtime_jobs_finished_stay();

-- When a project's master term moves on (or its master leaves), its fenced jobs of an
-- older term are done for, in the same transaction as the change: queued ones are
-- cancelled (`stale_term`), those in flight get a cancel request the Run is told of.
CREATE FUNCTION controller_projects_fence_jobs() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    UPDATE runtime_jobs SET
        state = CASE WHEN state = 'queued' THEN 'cancelled' ELSE state END,
        completed_at = CASE WHEN state = 'queued' THEN now() ELSE completed_at END,
        cancel_requested_at = CASE WHEN state = 'queued' THEN NULL ELSE COALESCE(cancel_requested_at, now()) END,
        cancel_reason = COALESCE(cancel_reason, 'stale_term'),
        updated_at = now()
    WHERE fence_namespace = NEW.namespace AND fence_project_id = NEW.project_id
      AND fence_term IS NOT NULL AND state IN ('queued','claimed','running')
      AND (fence_term <> NEW.term OR NEW.master_id IS NULL)
      AND NOT (state <> 'queued' AND cancel_requested_at IS NOT NULL);
    RETURN NULL;
END $$;
CREATE TRIGGER controller_projects_fence_jobs
    AFTER UPDATE OF term, master_id ON controller_projects
    FOR EACH ROW
    WHEN (NEW.term IS DISTINCT FROM OLD.term OR NEW.master_id IS DISTINCT FROM OLD.master_id)
    EXECUTE FUNCTION controller_projects_fence_jobs();
