-- Session ownership (SPEC §6): the Kubernetes identity (TokenReview username) that
-- registered a session through the API (HTTP or MCP). NULL for a registration created
-- with kubectl: any authorized caller may act on that one.
ALTER TABLE controller_registrations
    ADD COLUMN owner TEXT CHECK (owner IS NULL OR length(owner) BETWEEN 1 AND 1024);

-- The key that signs MCP session ids (SPEC §9), shared by every replica so that any of
-- them verifies a session another one issued. Used when PRISM_MCP_SESSION_KEY is not set;
-- the first replica to start writes it, the others read it.
CREATE TABLE mcp_session_key (
    id         BOOLEAN     PRIMARY KEY DEFAULT TRUE CHECK (id),
    key        BYTEA       NOT NULL CHECK (length(key) >= 32),
    created_at TIMESTAMPTZ NOT NULL DEFAULT now()
);
