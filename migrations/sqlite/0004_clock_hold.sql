-- A step of the wall clock that holds pruning and idempotency keys' expiry
-- back (src/db/clock.rs), kept so that a process started during the hold
-- (a restart) holds too, rather than taking the stepped clock for the real
-- one. Times in microseconds since the epoch: the reading that showed the
-- step, where the clock would have been without it, and when the hold
-- ends by the stepped clock (a hold ended early, the clock set right,
-- ends at the reading that saw it).
CREATE TABLE clock_hold (
    id            INTEGER NOT NULL PRIMARY KEY CHECK (id = 1),
    stepped_to_us INTEGER NOT NULL,
    expected_us   INTEGER NOT NULL,
    until_us      INTEGER NOT NULL
) STRICT;
