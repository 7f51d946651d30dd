-- A claim that long-polls (SPEC §11) waits on its address in memory; this wakes it, on
-- every replica, when something there may now be claimable: a job queued (new, retried,
-- requeued by the reaper; `eligible_at` says from when, if later) or a job leaving its
-- attempt (a slot freed). Channel prism_job_wakes; src/signals.rs.
-- Delivered at commit, never for a rolled-back change.
CREATE FUNCTION runtime_jobs_wake() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('prism_job_wakes', json_build_object(
        'server_instance_id', NEW.server_instance_id,
        'component_kind', NEW.component_kind,
        'eligible_at', CASE WHEN NEW.state = 'queued' AND NEW.eligible_at > now()
                            THEN extract(epoch FROM NEW.eligible_at) END)::text);
    RETURN NULL;
END $$;

CREATE TRIGGER runtime_jobs_wake_on_enqueue
    AFTER INSERT ON runtime_jobs
    FOR EACH ROW
    WHEN (NEW.state = 'queued')
    EXECUTE FUNCTION runtime_jobs_wake();

CREATE TRIGGER runtime_jobs_wake_on_change
    AFTER UPDATE OF state ON runtime_jobs
    FOR EACH ROW
    WHEN ((NEW.state = 'queued' AND OLD.state <> 'queued')
          OR (OLD.state IN ('claimed','running') AND NEW.state NOT IN ('claimed','running')))
    EXECUTE FUNCTION runtime_jobs_wake();
