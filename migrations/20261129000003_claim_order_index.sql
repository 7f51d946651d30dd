-- Claims take the oldest queued jobs in (created_at, id) order. Jobs enqueued in one
-- transaction share created_at, so the index must carry id too, or every claim sorts
-- the whole tie group.
DROP INDEX IF EXISTS runtime_jobs_queued_by_target;
CREATE INDEX runtime_jobs_queued_by_target
    ON runtime_jobs (server_instance_id, component_kind, created_at, id)
    WHERE state = 'queued';
