-- A step of the server's clock that holds pruning and idempotency keys'
-- expiry back (src/db/clock.rs), kept so that a process started during
-- the hold (a restart, a new replica) holds too, rather than taking the
-- stepped clock for the real one and pruning and forgetting by it for
-- all. Times in microseconds since the epoch: the reading that showed the
-- step, where the clock would have been without it, and when the hold
-- ends by the stepped clock (a hold ended early, the clock set right,
-- ends at the reading that saw it).
CREATE TABLE clock_hold (
    id            INTEGER NOT NULL PRIMARY KEY CHECK (id = 1),
    stepped_to_us BIGINT  NOT NULL,
    expected_us   BIGINT  NOT NULL,
    until_us      BIGINT  NOT NULL
);
