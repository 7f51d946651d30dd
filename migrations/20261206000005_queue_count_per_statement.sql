-- The per-namespace count of queued jobs (runtime_job_queue_counts, 20261206000002) is
-- kept per statement instead of per row.
--
-- A row trigger updated the same shard row once per job; within one transaction every
-- update of that row leaves a version the next one must step over (none can be pruned
-- before the commit), so a statement touching N jobs of one address cost O(N²): 100,000
-- jobs enqueued in one INSERT took 97 s instead of 2, the election's cancel of 1,000
-- stale fenced jobs and the reaper's batches paid it too. Now each statement adds its net
-- change once per shard, from its transition tables: O(N), one update per shard touched.
--
-- An UPDATE trigger with transition tables cannot name its columns, so it fires for every
-- UPDATE statement of runtime_jobs; an update that changes no state adds nothing (the net
-- change per shard is zero and writes no row). Shards are written in key order, so two
-- statements touching the same shards wait for each other instead of deadlocking.
--
-- Expand only: the previous release's writers fire the same triggers, and the counts the
-- row trigger kept stay correct (nothing is recounted).

CREATE FUNCTION runtime_jobs_count_queued_rows() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        INSERT INTO runtime_job_queue_counts AS c (namespace, shard, queued)
        SELECT namespace, hashtext(server_instance_id || '/' || component_kind) & 15, count(*)
        FROM new_rows WHERE state = 'queued'
        GROUP BY 1, 2 ORDER BY 1, 2
        ON CONFLICT (namespace, shard) DO UPDATE SET queued = c.queued + EXCLUDED.queued;
    ELSIF TG_OP = 'DELETE' THEN
        INSERT INTO runtime_job_queue_counts AS c (namespace, shard, queued)
        SELECT namespace, hashtext(server_instance_id || '/' || component_kind) & 15, -count(*)
        FROM old_rows WHERE state = 'queued'
        GROUP BY 1, 2 ORDER BY 1, 2
        ON CONFLICT (namespace, shard) DO UPDATE SET queued = c.queued + EXCLUDED.queued;
    ELSE
        INSERT INTO runtime_job_queue_counts AS c (namespace, shard, queued)
        SELECT namespace, shard, sum(delta)
        FROM (SELECT namespace, hashtext(server_instance_id || '/' || component_kind) & 15 AS shard, 1 AS delta
              FROM new_rows WHERE state = 'queued'
              UNION ALL
              SELECT namespace, hashtext(server_instance_id || '/' || component_kind) & 15, -1
              FROM old_rows WHERE state = 'queued') AS changes
        GROUP BY 1, 2 HAVING sum(delta) <> 0 ORDER BY 1, 2
        ON CONFLICT (namespace, shard) DO UPDATE SET queued = c.queued + EXCLUDED.queued;
    END IF;
    RETURN NULL;
END $$;

DROP TRIGGER runtime_jobs_count_queued ON runtime_jobs;
CREATE TRIGGER runtime_jobs_count_queued_inserts
    AFTER INSERT ON runtime_jobs REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION runtime_jobs_count_queued_rows();
CREATE TRIGGER runtime_jobs_count_queued_updates
    AFTER UPDATE ON runtime_jobs REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION runtime_jobs_count_queued_rows();
CREATE TRIGGER runtime_jobs_count_queued_deletes
    AFTER DELETE ON runtime_jobs REFERENCING OLD TABLE AS old_rows
    FOR EACH STATEMENT EXECUTE FUNCTION runtime_jobs_count_queued_rows();
