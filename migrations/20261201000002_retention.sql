-- Retention (SPEC §12): released registrations' resources are deleted after
-- PRISM_RELEASED_RETENTION_HOURS, and released rows, election history, nudges, finished
-- jobs and revoked identities after PRISM_HISTORY_RETENTION_DAYS. Nothing grows without
-- bound.

-- Whether a registration's resource is gone (its finalizer ran, or retention deleted
-- it). A row is pruned only then: a row pruned under a resource that still exists would
-- have that resource registered again, a released session brought back to life.
ALTER TABLE controller_registrations ADD COLUMN resource_gone BOOLEAN NOT NULL DEFAULT FALSE;
CREATE INDEX controller_registrations_released
    ON controller_registrations (released_at)
    WHERE released_at IS NOT NULL;

-- A pruned preemptor leaves its victims' preempted_by empty rather than blocking the prune.
ALTER TABLE controller_registrations DROP CONSTRAINT controller_registrations_preempted_by_fkey;
ALTER TABLE controller_registrations
    ADD CONSTRAINT controller_registrations_preempted_by_fkey
    FOREIGN KEY (preempted_by) REFERENCES controller_registrations (id) ON DELETE SET NULL;
ALTER TABLE controller_projects DROP CONSTRAINT controller_projects_master_fk;
ALTER TABLE controller_projects
    ADD CONSTRAINT controller_projects_master_fk
    FOREIGN KEY (master_id) REFERENCES controller_registrations (id) ON DELETE SET NULL;

-- The history stays append-only for everything but retention: a DELETE passes only in a
-- transaction that says it prunes (SET LOCAL prism.pruning = 'on').
CREATE OR REPLACE FUNCTION controller_election_events_append_only() RETURNS trigger
    LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'DELETE' AND current_setting('prism.pruning', true) = 'on' THEN
        RETURN OLD;
    END IF;
    RAISE EXCEPTION 'controller_election_events is append-only';
END $$;
CREATE INDEX controller_election_events_created ON controller_election_events (created_at);

CREATE INDEX nudges_created ON nudges (created_at);
CREATE INDEX runtime_jobs_finished
    ON runtime_jobs (completed_at)
    WHERE state IN ('succeeded','failed','cancelled');
CREATE INDEX run_identities_revoked
    ON run_identities (revoked_at)
    WHERE revoked_at IS NOT NULL;
