-- Tenants (SPEC §12): what a hostile tenant must not be able to reach or grow.

-- Per-owner quota of live registrations: counted on every registration of an owner.
CREATE INDEX controller_registrations_live_by_owner
    ON controller_registrations (owner)
    WHERE released_at IS NULL AND owner IS NOT NULL;

-- Jobs belong to the namespace of the RunSession they were enqueued for (SPEC §5): only
-- that namespace's sessions claim or step them, even after the address changes hands.
-- Existing jobs take the namespace of their address's identity (the live one, else the
-- latest); a job whose address never had an identity cannot belong to anybody and is
-- cancelled if it was not finished.
ALTER TABLE runtime_jobs
    ADD COLUMN namespace TEXT,
    ADD COLUMN cancel_reason TEXT CHECK (cancel_reason IS NULL OR length(cancel_reason) BETWEEN 1 AND 256);
UPDATE runtime_jobs j SET namespace = (
    SELECT i.namespace FROM run_identities i
    WHERE i.server_instance_id = j.server_instance_id AND i.component_kind = j.component_kind
    ORDER BY (i.revoked_at IS NULL) DESC, i.created_at DESC
    LIMIT 1);
UPDATE runtime_jobs
    SET state = 'cancelled', cancel_reason = 'identity_deleted', completed_at = now(), visible_at = NULL,
        claimed_by_session = NULL, updated_at = now()
    WHERE namespace IS NULL AND state NOT IN ('succeeded','failed','cancelled');
UPDATE runtime_jobs SET namespace = '' WHERE namespace IS NULL;
ALTER TABLE runtime_jobs
    ALTER COLUMN namespace SET NOT NULL,
    ADD CONSTRAINT runtime_jobs_namespace_check
        CHECK (length(namespace) BETWEEN 1 AND 63 OR (namespace = '' AND state = 'cancelled'));
DROP INDEX IF EXISTS runtime_jobs_queued_by_target;
CREATE INDEX runtime_jobs_queued_by_target
    ON runtime_jobs (namespace, server_instance_id, component_kind, created_at, id)
    WHERE state = 'queued';
-- Deleting a RunSession cancels its unfinished jobs.
CREATE INDEX runtime_jobs_unfinished_by_target
    ON runtime_jobs (namespace, server_instance_id, component_kind)
    WHERE state IN ('queued','claimed','running');

-- Revocation that sticks (SPEC §12): every identity row carries an epoch, a number from
-- one sequence taken anew whenever the identity's key changes or it is revoked. A
-- session remembers the epoch it was opened in, Redis keeps each address's current one
-- (written by every reconcile, so a failed write is retried), and a session whose epoch
-- is not the current one authorizes nothing.
CREATE SEQUENCE run_identity_epochs;
ALTER TABLE run_identities
    ADD COLUMN epoch BIGINT NOT NULL DEFAULT nextval('run_identity_epochs'),
    -- The hello high-water mark (SPEC §12): the largest hello timestamp accepted, and the
    -- nonces accepted at that very second. A hello at or below it, but for a new nonce
    -- of that second, is refused however much Redis forgot.
    ADD COLUMN hello_mark BIGINT,
    ADD COLUMN hello_nonces TEXT[] NOT NULL DEFAULT '{}';
