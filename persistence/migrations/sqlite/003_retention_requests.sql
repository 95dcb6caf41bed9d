-- Retention on a live broker (mirrors migrations/postgres/005_retention_requests.sql).
CREATE TABLE retention_requests (
    vhost TEXT NOT NULL,
    queue TEXT NOT NULL,
    run_id TEXT NOT NULL,
    epoch INTEGER NOT NULL,
    state TEXT NOT NULL DEFAULT 'pending',
    created_at REAL NOT NULL,
    applied_at REAL,
    applied_by TEXT,
    PRIMARY KEY (vhost, queue, run_id)
);

CREATE TABLE retention_watchers (
    node TEXT PRIMARY KEY,
    expires_at REAL NOT NULL
);

CREATE TABLE leases (
    name TEXT PRIMARY KEY,
    holder TEXT NOT NULL,
    expires_at REAL NOT NULL
);
