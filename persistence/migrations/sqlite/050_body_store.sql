-- Large bodies live in segment files under <data-dir>/bodies (persistence/bodystore.py);
-- their rows keep body = x'' and a reference: segment, position, crc32 (the length is size).
ALTER TABLE messages ADD COLUMN body_segment INTEGER;
ALTER TABLE messages ADD COLUMN body_position INTEGER;
ALTER TABLE messages ADD COLUMN body_crc INTEGER;

-- What each segment still holds (count and bytes, by an index-only scan of the referenced rows
-- alone), and compaction's reads in file order. Counting this way rather than by a delete
-- trigger: an AFTER DELETE trigger, even one whose WHEN is false, made 256 B removals 3.5x
-- as expensive (22 vs 6 us of CPU per append+removal, 2,000 per commit).
CREATE INDEX messages_body_segment ON messages (body_segment, body_position, size) WHERE body_segment IS NOT NULL;

-- One row per segment file holding committed bodies: its committed end (bytes past it are a
-- torn or uncommitted write, cut on open) and how far it is known fsynced (the bodies of the
-- last commit, from synced_end on, are verified on open: their fsync ran beside that commit).
CREATE TABLE body_segments (
    segment INTEGER PRIMARY KEY,
    end_position INTEGER NOT NULL,
    synced_end INTEGER NOT NULL
);
