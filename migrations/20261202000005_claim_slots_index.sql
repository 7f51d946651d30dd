-- The slots count of the eligibility claim read every job in flight of every address
-- (through runtime_jobs_in_flight_attempt_deadline, filtering by address on the heap):
-- with many Runs busy, a claim cost grew with the whole fleet's work. It reads only the
-- address's own jobs in flight now, and no more of them than the slots it checks.
CREATE INDEX runtime_jobs_in_flight_by_address
    ON runtime_jobs (namespace, server_instance_id, component_kind)
    WHERE state IN ('claimed','running');

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
    WHERE id IN (
        SELECT j.id FROM runtime_jobs j
        WHERE j.namespace = p_namespace AND j.server_instance_id = p_server AND j.component_kind = p_component
          AND j.state = 'queued' AND j.eligible_at <= now()
          AND (p_kinds IS NULL OR j.kind = ANY(p_kinds))
          AND (j.fence_term IS NULL OR EXISTS (
              SELECT 1 FROM controller_projects p
              WHERE p.namespace = j.fence_namespace AND p.project_id = j.fence_project_id
                AND p.term = j.fence_term AND p.master_id IS NOT NULL))
        ORDER BY j.created_at, j.id
        LIMIT take
        FOR UPDATE SKIP LOCKED)
    RETURNING runtime_jobs.*;
END $$;
