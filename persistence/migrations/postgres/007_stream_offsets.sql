-- Stream consumer groups: the last offset each group has processed (core/stream.py).
-- Written by the group committer in the same fenced transaction as the stream's messages.
CREATE TABLE stream_offsets (
    vhost text NOT NULL,
    queue text NOT NULL,
    grp text NOT NULL,
    "offset" bigint NOT NULL,
    PRIMARY KEY (vhost, queue, grp)
);
