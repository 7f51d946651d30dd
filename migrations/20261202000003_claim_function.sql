-- The eligibility claim (SPEC §5.1) as one round trip: with slots, the address's turn
-- (a transaction lock), then the count of what is in flight (a statement of its own, so
-- its snapshot comes after the turn and sees every claim that went before), then the
-- claim: kinds advertised, past the backoff, a fenced job only while its term is its
-- project's master term, oldest first, SKIP LOCKED. A change of term cancels queued
-- fenced jobs in its own transaction (controller_projects_fence_jobs), so a claim racing
-- it either locks the row first (the change then asks the Run to stop it) or meets the
-- row cancelled when the lock's recheck reads it again.
CREATE FUNCTION runtime_jobs_claim(
    p_namespace TEXT, p_server TEXT, p_component TEXT, p_session UUID, p_max BIGINT,
    p_visibility_seconds FLOAT8, p_kinds TEXT[], p_slots BIGINT)
RETURNS SETOF runtime_jobs LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    take BIGINT := p_max;
    held BIGINT;
BEGIN
    IF p_slots IS NOT NULL THEN
        PERFORM pg_advisory_xact_lock(hashtextextended('prism-claim/' || p_namespace || '/' || p_server || '/' || p_component, 0));
        SELECT count(*) INTO held FROM runtime_jobs
        WHERE namespace = p_namespace AND server_instance_id = p_server AND component_kind = p_component
          AND state IN ('claimed','running');
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
