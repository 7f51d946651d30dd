-- A registration in fewer round trips (issue 43, item 10: the election bench's store /
-- raw SQL ratio fell from 1.0 to 0.7 as the tenant limits came in).
--
-- A registration took the project's lock, then read the project's term and master: two
-- round trips, the second only after the first came back. They cannot be one statement
-- (a statement's snapshot is taken before the lock inside it is granted, so it could
-- miss what the previous holder committed), but one VOLATILE function can: each of its
-- queries takes a new snapshot, after the lock. The lock's key is named once here, for
-- the store and this function alike.
--
-- The master is looked up by its primary key, and the function's queries are planned at
-- each call: a plan cached while the table was small (a fresh install, the first
-- registrations of a connection) scanned every live registration for the master, each
-- registration reading more as more were live (the election bench: 116 index entries per
-- registration after a few hundred, where the registration before it read 6). Planned
-- with the table's size at the call, the primary key is taken once the table is larger
-- than a page or two.
--
-- Expand only: the previous release takes the same lock by the same expression and never
-- calls these.

CREATE FUNCTION controller_project_lock_key(p_namespace TEXT, p_project_id TEXT) RETURNS BIGINT
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT hashtextextended(p_namespace || '/' || p_project_id, 0) $$;

-- Takes the project's election lock (held until the transaction ends), then reads the
-- project's term, the time the lock was granted and its live master (all NULL without
-- one). No row: the project has no row yet.
CREATE FUNCTION controller_lock_project_head(p_namespace TEXT, p_project_id TEXT)
RETURNS TABLE (term BIGINT, now TIMESTAMPTZ, master_id UUID, master_name TEXT, master_surface TEXT,
               master_registered_at TIMESTAMPTZ)
LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_custom_plan
AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(controller_project_lock_key(p_namespace, p_project_id));
    RETURN QUERY
        SELECT p.term, clock_timestamp(), m.id, m.name::text, m.agent_surface::text, m.registered_at
        FROM controller_projects p
        LEFT JOIN LATERAL (
            SELECT r.id, r.name, r.agent_surface, r.registered_at FROM controller_registrations r
            WHERE r.id = p.master_id AND r.is_master AND r.released_at IS NULL) m ON TRUE
        WHERE p.namespace = p_namespace AND p.project_id = p_project_id;
END $$;
