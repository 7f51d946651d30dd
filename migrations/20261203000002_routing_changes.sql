-- A watch of a project's routing table (SPEC §11) names each change `<term>.<seq>`:
-- `routing_seq` counts the election's writes to the project (each one a change of its
-- table), bumped in the transaction that makes the change, which also NOTIFYs channel
-- prism_projects (election::store::write_decision; src/signals.rs fans it out). A watch
-- that resumes with the id it last saw is up to date when the id is still current.
ALTER TABLE controller_projects
    ADD COLUMN routing_seq BIGINT NOT NULL DEFAULT 0 CHECK (routing_seq >= 0);
