-- Each replica hears of every identity's new epoch (SPEC §12: revocations are
-- level-triggered), so that a heartbeat refuses a session of an older epoch even while
-- Redis does not know it: the fence write that ends such a session failed, or a Redis
-- failover or restore lost it. Claims and steps already check the epoch in Postgres; the
-- heartbeat reads only Redis, and a revoked Run kept heartbeating (showing Online)
-- until the next reconcile's fence got through.
--
-- A new identity, a rotated key and a revocation each take a new epoch from the sequence
-- (20261201000001): the payload is the address and the new epoch. Expand only: the
-- previous release's writers fire it too, and it ignores the channel.
CREATE FUNCTION run_identities_epoch_signal() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('prism_identity_epochs', json_build_object(
        'server_instance_id', NEW.server_instance_id,
        'component_kind', NEW.component_kind,
        'epoch', NEW.epoch)::text);
    RETURN NULL;
END $$;

CREATE TRIGGER run_identities_epoch_signal_insert
    AFTER INSERT ON run_identities
    FOR EACH ROW EXECUTE FUNCTION run_identities_epoch_signal();
CREATE TRIGGER run_identities_epoch_signal_update
    AFTER UPDATE OF epoch ON run_identities
    FOR EACH ROW WHEN (OLD.epoch IS DISTINCT FROM NEW.epoch)
    EXECUTE FUNCTION run_identities_epoch_signal();
