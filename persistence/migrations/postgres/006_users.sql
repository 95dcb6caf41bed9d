-- Users (leveret users add|delete|list), restored by a node at start. tags and
-- vhosts (the vhosts the user may open) are JSON arrays of strings; the
-- password is kept as the broker hashes it (core.broker.User: salt, hash).
CREATE TABLE users (
    name text PRIMARY KEY,
    salt bytea NOT NULL,
    password_hash bytea NOT NULL,
    tags text NOT NULL DEFAULT '[]',
    vhosts text NOT NULL DEFAULT '[]',
    loopback_only boolean NOT NULL DEFAULT false
);
