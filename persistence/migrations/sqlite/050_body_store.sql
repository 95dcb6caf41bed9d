-- Large bodies live in segment files under <data-dir>/bodies (persistence/bodystore.py);
-- their rows keep body = x'' and a reference: segment, position, crc32 (the length is size).
ALTER TABLE messages ADD COLUMN body_segment INTEGER;
ALTER TABLE messages ADD COLUMN body_position INTEGER;
ALTER TABLE messages ADD COLUMN body_crc INTEGER;

-- Compaction reads a segment's live bodies in file order.
CREATE INDEX messages_body_segment ON messages (body_segment, body_position) WHERE body_segment IS NOT NULL;

-- One row per segment file holding committed bodies: its committed end (bytes past it are
-- a torn or uncommitted write, cut on open), how far it is known fsynced (the bodies of the
-- last commit, from synced_end on, are verified on open: their fsync ran beside that commit)
-- and what of it is still referenced.
CREATE TABLE body_segments (
    segment INTEGER PRIMARY KEY,
    end_position INTEGER NOT NULL,
    synced_end INTEGER NOT NULL,
    live_count INTEGER NOT NULL,
    live_bytes INTEGER NOT NULL
);

-- Every way a row goes (acks, purges, queue and vhost deletion, stream truncation, the
-- retention jobs' own connection, INSERT OR REPLACE with recursive_triggers on) keeps the
-- counts right, in the transaction that deletes it.
CREATE TRIGGER messages_body_gone AFTER DELETE ON messages WHEN old.body_segment IS NOT NULL
BEGIN
    UPDATE body_segments SET live_count = live_count - 1, live_bytes = live_bytes - old.size
    WHERE segment = old.body_segment;
END;
