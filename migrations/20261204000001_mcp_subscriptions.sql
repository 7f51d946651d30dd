-- resources/subscribe of the session-based MCP revisions (SPEC §11): which routing
-- tables an MCP session follows, kept here rather than in one replica's memory so that
-- the session's GET stream, on whichever replica it reaches, knows what to notify.
-- A session is named by a digest of its signed Mcp-Session-Id, its owner by the digest
-- the id carries (src/api/mcp/session.rs); nothing here is a credential.
-- Bounded: at most 32 rows per session and 256 per owner (the insert checks), and rows
-- not renewed for a day (a subscribe, or the session's stream open) are deleted.
-- Each change NOTIFYs channel prism_mcp_subscriptions with the session digest
-- (src/api/mcp/subscriptions.rs; src/signals.rs fans it out to the session's streams).
CREATE TABLE mcp_subscriptions (
    session_digest TEXT         NOT NULL CHECK (length(session_digest) BETWEEN 16 AND 64),
    owner_digest   TEXT         NOT NULL CHECK (length(owner_digest) BETWEEN 16 AND 64),
    uri            TEXT         NOT NULL CHECK (length(uri) BETWEEN 1 AND 1024),
    namespace      TEXT         NOT NULL CHECK (length(namespace) BETWEEN 1 AND 63),
    project_id     VARCHAR(128) NOT NULL CHECK (length(project_id) >= 1),
    renewed_at     TIMESTAMPTZ  NOT NULL DEFAULT now(),
    PRIMARY KEY (session_digest, uri)
);
CREATE INDEX mcp_subscriptions_by_owner ON mcp_subscriptions (owner_digest);
CREATE INDEX mcp_subscriptions_by_age ON mcp_subscriptions (renewed_at);
