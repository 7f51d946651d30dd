-- A restore never reissues a term (SPEC §15).
--
-- Postgres restored from a backup forgets the terms it issued after the backup, and would
-- issue them again to other masters. The operator keeps a mark outside Postgres (a
-- ConfigMap of its namespace): how far the election history's sequence had gone
-- (`controller_election_events_id_seq`: every term change appends one event, and a
-- sequence never goes back but by a restore) and the highest term. At start, a database
-- whose history is behind the mark was restored (or replaced): every project's term is
-- raised above everything seen outside (the mark, the registrations' status.term), the
-- projects made afterwards start there too (`controller_term_guard.term_floor`), and each
-- raise is a row of `controller_term_restores`.
--
-- Expand only: the previous release reads none of it; its new projects start at the
-- floor through the trigger below, like this release's.

CREATE TABLE controller_term_guard (
    singleton  BOOLEAN PRIMARY KEY DEFAULT TRUE CHECK (singleton),
    term_floor BIGINT  NOT NULL DEFAULT 0 CHECK (term_floor >= 0)
);
INSERT INTO controller_term_guard DEFAULT VALUES;

CREATE OR REPLACE FUNCTION controller_projects_start_at_floor() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    NEW.term := GREATEST(NEW.term,
        COALESCE((SELECT term_floor FROM controller_term_floors WHERE namespace = NEW.namespace), 0),
        COALESCE((SELECT term_floor FROM controller_term_guard), 0));
    RETURN NEW;
END $$;

-- One row per project a detected restore raised: the election's record of the restore
-- (a table of its own: the previous release decodes every election event's cause).
CREATE TABLE controller_term_restores (
    id          BIGSERIAL    PRIMARY KEY,
    at          TIMESTAMPTZ  NOT NULL DEFAULT now(),
    namespace   TEXT         NOT NULL,
    project_id  VARCHAR(128) NOT NULL,
    term_before BIGINT       NOT NULL,
    term_after  BIGINT       NOT NULL
);
CREATE INDEX controller_term_restores_project ON controller_term_restores (namespace, project_id, id);
