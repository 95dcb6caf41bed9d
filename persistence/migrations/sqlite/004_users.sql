-- Users (mirrors migrations/postgres/006_users.sql).
CREATE TABLE users (
    name TEXT PRIMARY KEY,
    salt BLOB NOT NULL,
    password_hash BLOB NOT NULL,
    tags TEXT NOT NULL DEFAULT '[]',
    vhosts TEXT NOT NULL DEFAULT '[]',
    loopback_only INTEGER NOT NULL DEFAULT 0
);
