-- Stream consumer groups (mirrors migrations/postgres/004_stream_offsets.sql).
CREATE TABLE stream_offsets (
    vhost TEXT NOT NULL,
    queue TEXT NOT NULL,
    grp TEXT NOT NULL,
    "offset" INTEGER NOT NULL,
    PRIMARY KEY (vhost, queue, grp)
);
