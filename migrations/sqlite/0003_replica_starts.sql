-- When this database was last started under Litestream. tally writes the
-- row at each such start, before it waits for the replica to catch up: a
-- database already level with its replica (a restart in place) would need
-- no upload, so the wait would prove nothing about an object store that
-- refuses writes. With the row, it waits for one upload.
CREATE TABLE replica_starts (
    id         INTEGER NOT NULL PRIMARY KEY CHECK (id = 1),
    started_at TEXT    NOT NULL
) STRICT;
