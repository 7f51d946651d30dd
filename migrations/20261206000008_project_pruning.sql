-- controller_projects is pruned (SPEC §12: nothing grows without bound). Every project id
-- anyone ever registered kept its row for good: a tenant registering and wrapping
-- made-up project ids grew the table without limit.
--
-- A project is pruned once nothing refers to it — no registration left (live or
-- released: retention prunes released ones first), no master, no unfinished fenced job —
-- and it has not changed for PRISM_HISTORY_RETENTION_DAYS. Its term must not die with it
-- (SPEC §6: a term is issued to at most one master, ever; a demoted master's old term
-- must never be current again): the namespace's term floor keeps the largest term of its
-- pruned projects, and a project row made afterwards starts there (a trigger, so the
-- previous release's inserts start there too). One row per namespace, not per project.
--
-- The prune takes each project's election lock (the advisory lock a registration takes
-- before it reads or makes the row) with a try: a project being registered to is left
-- for the next round, and a registration arriving after the prune makes the row anew.
-- Expand only.

CREATE TABLE controller_term_floors (
    namespace  TEXT   PRIMARY KEY,
    term_floor BIGINT NOT NULL CHECK (term_floor >= 0)
);

CREATE FUNCTION controller_projects_start_at_floor() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    NEW.term := GREATEST(NEW.term,
        COALESCE((SELECT term_floor FROM controller_term_floors WHERE namespace = NEW.namespace), 0));
    RETURN NEW;
END $$;
CREATE TRIGGER controller_projects_start_at_floor
    BEFORE INSERT ON controller_projects
    FOR EACH ROW EXECUTE FUNCTION controller_projects_start_at_floor();

-- The prune's candidates: unchanged the longest first, masterless only.
CREATE INDEX controller_projects_idle ON controller_projects (updated_at) WHERE master_id IS NULL;
