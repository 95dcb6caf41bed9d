-- Named retention policies (mirrors migrations/postgres/002_retention.sql).
CREATE TABLE retention_policies (
    name TEXT PRIMARY KEY,
    pattern TEXT NOT NULL,
    max_age_seconds REAL,
    max_bytes INTEGER,
    max_length INTEGER,
    archive INTEGER NOT NULL DEFAULT 0,
    created_at REAL NOT NULL
);
