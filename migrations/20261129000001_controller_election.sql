-- Controller registration and election (SPEC §4). Postgres is authoritative: the
-- single-master and one-live-registration-per-session rules are enforced here by
-- partial unique indexes, not by code.

CREATE TABLE controller_projects (
    namespace        TEXT        NOT NULL,
    project_id       VARCHAR(128) NOT NULL,
    -- Election epoch: rises on every change of master; a master's term is its fencing token.
    term             BIGINT      NOT NULL DEFAULT 0 CHECK (term >= 0),
    master_id        UUID,
    updated_at       TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (namespace, project_id)
);

CREATE TABLE controller_registrations (
    -- The ControllerRegistration's metadata.uid.
    id               UUID        PRIMARY KEY,
    namespace        TEXT        NOT NULL CHECK (length(namespace) BETWEEN 1 AND 63),
    name             TEXT        NOT NULL CHECK (length(name) BETWEEN 1 AND 253),
    project_id       VARCHAR(128) NOT NULL CHECK (length(project_id) >= 1),
    session_id       VARCHAR(256) NOT NULL CHECK (length(session_id) >= 1),
    agent_surface    VARCHAR(32) NOT NULL
        CHECK (agent_surface IN ('claude_desktop','claude_code','codex','cursor','other')),
    is_master        BOOLEAN     NOT NULL DEFAULT FALSE,
    -- The project term in which this registration became master (NULL: never master).
    master_term      BIGINT,
    registered_at    TIMESTAMPTZ NOT NULL DEFAULT now(),
    last_heartbeat   TIMESTAMPTZ NOT NULL DEFAULT now(),
    released_at      TIMESTAMPTZ,
    release_reason   VARCHAR(32)
        CHECK (release_reason IN ('wrapped','context_switch','stale_heartbeat_incident')),
    -- "you_were_preempted": a master demoted by a desktop registration.
    preempted        BOOLEAN     NOT NULL DEFAULT FALSE,
    preempted_by     UUID REFERENCES controller_registrations (id),
    preempted_at     TIMESTAMPTZ,
    -- A released registration has a reason, and is never master.
    CONSTRAINT released_has_reason CHECK ((released_at IS NULL) = (release_reason IS NULL)),
    CONSTRAINT released_is_not_master CHECK (NOT (is_master AND released_at IS NOT NULL)),
    CONSTRAINT master_has_term CHECK (NOT is_master OR master_term IS NOT NULL),
    FOREIGN KEY (namespace, project_id) REFERENCES controller_projects (namespace, project_id)
);

-- Exactly one live master per project, enforced by the database.
CREATE UNIQUE INDEX controller_registrations_one_master
    ON controller_registrations (namespace, project_id)
    WHERE is_master AND released_at IS NULL;

-- One live registration per session (a session on a new project leaves the old one first).
CREATE UNIQUE INDEX controller_registrations_one_live_per_session
    ON controller_registrations (namespace, session_id)
    WHERE released_at IS NULL;

-- The election reads a project's live candidates.
CREATE INDEX controller_registrations_live_by_project
    ON controller_registrations (namespace, project_id, registered_at)
    WHERE released_at IS NULL;

-- The stale sweep scans live rows by heartbeat age.
CREATE INDEX controller_registrations_live_heartbeat
    ON controller_registrations (last_heartbeat)
    WHERE released_at IS NULL;

ALTER TABLE controller_projects
    ADD CONSTRAINT controller_projects_master_fk
    FOREIGN KEY (master_id) REFERENCES controller_registrations (id);

-- Append-only history of every change of master.
CREATE TABLE controller_election_events (
    id               BIGSERIAL   PRIMARY KEY,
    namespace        TEXT        NOT NULL,
    project_id       VARCHAR(128) NOT NULL,
    term             BIGINT      NOT NULL,
    -- NULL: the project was left without a master (no live candidate).
    master_id        UUID,
    previous_master_id UUID,
    cause            VARCHAR(32) NOT NULL
        CHECK (cause IN ('elected','preempted','wrapped','context_switch','stale_heartbeat_incident')),
    created_at       TIMESTAMPTZ NOT NULL DEFAULT now()
);
CREATE INDEX controller_election_events_by_project
    ON controller_election_events (namespace, project_id, id);

CREATE OR REPLACE FUNCTION controller_election_events_append_only() RETURNS trigger
    LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'controller_election_events is append-only';
END $$;
CREATE TRIGGER controller_election_events_no_update
    BEFORE UPDATE OR DELETE ON controller_election_events
    FOR EACH ROW EXECUTE FUNCTION controller_election_events_append_only();

-- SPEC-029's minimal slice: messages to agent sessions (context switch writes wrap_session).
CREATE TABLE nudges (
    id               UUID        PRIMARY KEY DEFAULT gen_random_uuid(),
    namespace        TEXT        NOT NULL,
    session_id       VARCHAR(256) NOT NULL,
    project_id       VARCHAR(128) NOT NULL,
    kind             VARCHAR(64) NOT NULL CHECK (length(kind) >= 1),
    payload          JSONB       NOT NULL DEFAULT '{}'::jsonb,
    created_at       TIMESTAMPTZ NOT NULL DEFAULT now(),
    delivered_at     TIMESTAMPTZ
);
CREATE INDEX nudges_undelivered_by_session
    ON nudges (namespace, session_id, created_at)
    WHERE delivered_at IS NULL;
