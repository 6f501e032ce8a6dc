-- Idempotency keys: what a keyed write answered, so that a retry with the
-- same key gets the same answer instead of applying the write again.
CREATE TABLE idempotency_keys (
    key         TEXT    NOT NULL PRIMARY KEY,
    -- The command the key was first used for; another command with the
    -- same key is refused.
    fingerprint TEXT    NOT NULL,
    -- The committed result, as JSON.
    result      TEXT    NOT NULL,
    -- Unix seconds; keys are kept for a day.
    created_at  INTEGER NOT NULL
) STRICT, WITHOUT ROWID;

CREATE INDEX idempotency_keys_by_age ON idempotency_keys (created_at);
