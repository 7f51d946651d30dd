-- Drain (SPEC §5.1): a RunSession's spec.paused, the platform's cordon, mirrored like the
-- rest of the identity. While it is true the Run's claims hand out no new job; the jobs
-- it already holds finish normally. Not part of the key: changing it is no new epoch.
ALTER TABLE run_identities ADD COLUMN paused BOOLEAN NOT NULL DEFAULT FALSE;
