-- A job in flight whose cancel was just requested (by the API, or by the fence of a new
-- master term) is announced on channel prism_job_cancels with its address, so that every
-- replica knows which Runs to tell at their next heartbeat without asking Postgres on
-- every heartbeat (src/run_registry/pending_cancels.rs). Delivered at commit, never for
-- a rolled-back change.
CREATE FUNCTION runtime_jobs_cancel_signal() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('prism_job_cancels', json_build_object(
        'server_instance_id', NEW.server_instance_id,
        'component_kind', NEW.component_kind)::text);
    RETURN NULL;
END $$;

CREATE TRIGGER runtime_jobs_cancel_signal
    AFTER UPDATE ON runtime_jobs
    FOR EACH ROW
    WHEN (NEW.cancel_requested_at IS NOT NULL AND NEW.state IN ('claimed','running')
          AND (OLD.cancel_requested_at IS NULL OR OLD.state NOT IN ('claimed','running')))
    EXECUTE FUNCTION runtime_jobs_cancel_signal();
