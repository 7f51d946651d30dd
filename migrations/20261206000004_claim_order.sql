-- A claim's cost no longer grows with the backlog (SPEC §12, "Jobs are bounded").
--
-- The claim orders a target's queued jobs by (created_at, id). Two indexes gave that
-- order: the partial index of queued jobs and runtime_jobs_listed_by_target (every state,
-- created_at DESC, id DESC), read backwards. When the planner's statistics said "most
-- jobs are queued" (after a bulk enqueue, until autovacuum's next ANALYZE) it chose the
-- second, and every claim then read past all of the target's claimed and finished jobs
-- older than its oldest queued one: 400-950 index entries per claim in the runtime bench,
-- growing with every job claimed.
--
-- The order is now asked for NULLS FIRST, which only the index below gives (created_at
-- and id are NOT NULL, so the order itself is the same): the listing index read
-- backwards yields NULLS LAST and would need a sort of the target's every job, so the
-- plan is pinned by the index and the query's shape, whatever the statistics say
-- (tests/jobs_plan.rs checks it with EXPLAIN over a 100,000-job backlog). The outer
-- UPDATE takes the ids as an array: a primary-key lookup per claimed job, never a join
-- planned from the LIMIT's generic estimate.
--
-- Expand only: the previous release calls the same function with the same arguments.
-- Its old index goes (nothing else reads it; the one below serves every query it served).

CREATE INDEX runtime_jobs_claim_order
    ON runtime_jobs (namespace, server_instance_id, component_kind, created_at NULLS FIRST, id NULLS FIRST)
    INCLUDE (kind, eligible_at, fence_term)
    WHERE state = 'queued';
DROP INDEX runtime_jobs_queued_by_target;

CREATE OR REPLACE FUNCTION runtime_jobs_claim(
    p_namespace TEXT, p_server TEXT, p_component TEXT, p_session UUID, p_max BIGINT,
    p_visibility_seconds FLOAT8, p_kinds TEXT[], p_slots BIGINT)
RETURNS SETOF runtime_jobs LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    take BIGINT := p_max;
    held BIGINT;
BEGIN
    IF p_slots IS NOT NULL THEN
        PERFORM pg_advisory_xact_lock(hashtextextended('prism-claim/' || p_namespace || '/' || p_server || '/' || p_component, 0));
        SELECT count(*) INTO held FROM (
            SELECT 1 FROM runtime_jobs
            WHERE namespace = p_namespace AND server_instance_id = p_server AND component_kind = p_component
              AND state IN ('claimed','running')
            LIMIT p_slots) AS in_flight;
        take := least(p_max, p_slots - held);
    END IF;
    IF take <= 0 THEN
        RETURN;
    END IF;
    RETURN QUERY
    UPDATE runtime_jobs SET state = 'claimed', claimed_at = now(), updated_at = now(),
        visible_at = now() + make_interval(secs => p_visibility_seconds),
        deadline_at = now() + make_interval(secs => timeout_seconds),
        attempts = attempts + 1, claimed_by_session = p_session
    WHERE id = ANY(ARRAY(
        SELECT j.id FROM runtime_jobs j
        WHERE j.namespace = p_namespace AND j.server_instance_id = p_server AND j.component_kind = p_component
          AND j.state = 'queued' AND j.eligible_at <= now()
          AND (p_kinds IS NULL OR j.kind = ANY(p_kinds))
          AND (j.fence_term IS NULL OR EXISTS (
              SELECT 1 FROM controller_projects p
              WHERE p.namespace = j.fence_namespace AND p.project_id = j.fence_project_id
                AND p.term = j.fence_term AND p.master_id IS NOT NULL))
        ORDER BY j.created_at NULLS FIRST, j.id NULLS FIRST
        LIMIT take
        FOR UPDATE SKIP LOCKED))
    RETURNING runtime_jobs.*;
END $$;
