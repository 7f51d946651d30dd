-- Where a followed project stood when its session was last told of it (its routing
-- table's <term>.<seq>): read at the subscribe, moved on by each notification sent.
-- The session's GET stream compares its first look with it, so a change made between
-- the subscribe's answer and the stream's first read, or while no stream was open, is
-- notified rather than taken for the starting point (src/api/mcp/resources.rs,
-- Baseline). NULL: it could not be read; the stream's first look is where it starts.
ALTER TABLE mcp_subscriptions
    ADD COLUMN seen_term BIGINT,
    ADD COLUMN seen_seq  BIGINT,
    ADD CONSTRAINT mcp_subscriptions_seen_whole CHECK ((seen_term IS NULL) = (seen_seq IS NULL));
