-- The namespace quota of live registrations (SPEC §12) read from a kept count instead of
-- counting the rows.
--
-- The quota counted the namespace's live registrations (up to the quota, 10,000 by
-- default) whenever its 2-second cache had expired, and every registration arriving at
-- that moment counted them again: the election bench measured 129-256 index entries or
-- rows read per registration, a registration's cost growing with how many were live.
-- A row trigger keeps the count per namespace in 64 shards by project (registrations of
-- one project already wait for each other on the project's lock; those of different
-- projects rarely meet on a shard row), so a count is at most 64 rows by primary key.
--
-- The trigger names its columns (INSERT, DELETE, UPDATE OF released_at): a heartbeat
-- never fires it. Expand only: the previous release's writers fire it too and count the
-- old way (which stays right).

CREATE TABLE controller_registration_counts (
    namespace TEXT     NOT NULL,
    shard     SMALLINT NOT NULL CHECK (shard BETWEEN 0 AND 63),
    live      BIGINT   NOT NULL,
    PRIMARY KEY (namespace, shard)
);

CREATE FUNCTION controller_registrations_count_live() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    delta BIGINT := 0;
    reg   controller_registrations;
BEGIN
    IF TG_OP = 'INSERT' THEN
        reg := NEW;
        IF NEW.released_at IS NULL THEN delta := 1; END IF;
    ELSIF TG_OP = 'DELETE' THEN
        reg := OLD;
        IF OLD.released_at IS NULL THEN delta := -1; END IF;
    ELSE
        reg := NEW;
        IF OLD.released_at IS NULL AND NEW.released_at IS NOT NULL THEN
            delta := -1;
        ELSIF OLD.released_at IS NOT NULL AND NEW.released_at IS NULL THEN
            delta := 1;
        END IF;
    END IF;
    IF delta <> 0 THEN
        INSERT INTO controller_registration_counts AS c (namespace, shard, live)
        VALUES (reg.namespace, hashtext(reg.project_id) & 63, delta)
        ON CONFLICT (namespace, shard) DO UPDATE SET live = c.live + EXCLUDED.live;
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER controller_registrations_count_live
    AFTER INSERT OR DELETE OR UPDATE OF released_at ON controller_registrations
    FOR EACH ROW EXECUTE FUNCTION controller_registrations_count_live();

-- The registrations live now, counted once while no one registers or releases.
LOCK TABLE controller_registrations IN SHARE ROW EXCLUSIVE MODE;
INSERT INTO controller_registration_counts (namespace, shard, live)
SELECT namespace, hashtext(project_id) & 63, count(*)
FROM controller_registrations WHERE released_at IS NULL
GROUP BY 1, 2;
