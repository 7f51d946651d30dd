-- Run identities and durable jobs (SPEC §5). Live sessions are never here: they exist
-- only as Redis TTL leases.

-- The RunSession resources' identities, mirrored so that any replica can check a hello
-- without the Kubernetes API.
CREATE TABLE run_identities (
    -- The RunSession's metadata.uid.
    id                 UUID        PRIMARY KEY,
    namespace          TEXT        NOT NULL,
    name               TEXT        NOT NULL,
    server_instance_id VARCHAR(253) NOT NULL CHECK (length(server_instance_id) >= 1),
    component_kind     VARCHAR(63) NOT NULL CHECK (component_kind ~ '^[a-z0-9]([-a-z0-9]*[a-z0-9])?$'),
    -- Standard base64 of the 32-byte Ed25519 public key.
    public_key         VARCHAR(44) NOT NULL CHECK (public_key ~ '^[A-Za-z0-9+/]{43}=$'),
    key_generation     BIGINT      NOT NULL CHECK (key_generation >= 1),
    lease_seconds      INTEGER     CHECK (lease_seconds BETWEEN 5 AND 3600),
    created_at         TIMESTAMPTZ NOT NULL DEFAULT now(),
    updated_at         TIMESTAMPTZ NOT NULL DEFAULT now(),
    -- Set when the resource is deleted: the identity stops authenticating.
    revoked_at         TIMESTAMPTZ
);
-- (server_instance_id, component_kind) names one live Run in the whole cluster.
CREATE UNIQUE INDEX run_identities_one_live_identity
    ON run_identities (server_instance_id, component_kind)
    WHERE revoked_at IS NULL;

CREATE TABLE runtime_jobs (
    id                 UUID        PRIMARY KEY DEFAULT gen_random_uuid(),
    -- Addressed to a server/component, never to a run endpoint or session.
    server_instance_id VARCHAR(253) NOT NULL,
    component_kind     VARCHAR(63) NOT NULL,
    kind               VARCHAR(32) NOT NULL
        CHECK (kind IN ('lifecycle','config','file','log','protected_request')),
    payload            JSONB       NOT NULL DEFAULT '{}'::jsonb,
    state              VARCHAR(16) NOT NULL DEFAULT 'queued'
        CHECK (state IN ('queued','claimed','running','succeeded','failed','cancelled')),
    attempts           INTEGER     NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    created_at         TIMESTAMPTZ NOT NULL DEFAULT now(),
    updated_at         TIMESTAMPTZ NOT NULL DEFAULT now(),
    claimed_at         TIMESTAMPTZ,
    -- A claimed job not progressed by then returns to queued (job-level timeout).
    visible_at         TIMESTAMPTZ,
    -- Opaque id of the session that claimed it (not its token).
    claimed_by_session UUID,
    completed_at       TIMESTAMPTZ,
    progress           JSONB,
    result             JSONB,
    CONSTRAINT claimed_has_deadline CHECK (state NOT IN ('claimed','running') OR visible_at IS NOT NULL),
    CONSTRAINT finished_has_time CHECK (state NOT IN ('succeeded','failed','cancelled') OR completed_at IS NOT NULL)
);
-- Claim: oldest queued job of one target.
CREATE INDEX runtime_jobs_queued_by_target
    ON runtime_jobs (server_instance_id, component_kind, created_at)
    WHERE state = 'queued';
-- Reaper: claimed jobs past their visibility timeout.
CREATE INDEX runtime_jobs_in_flight_deadline
    ON runtime_jobs (visible_at)
    WHERE state IN ('claimed','running');
