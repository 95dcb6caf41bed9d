-- Retention on a live broker (docs/RETENTION.md, "Live brokers").
-- A job run marks rows state = 'retained-removed' and asks the owner of each
-- queue, through a row here (and NOTIFY leveret_retention), to drop them from
-- memory; the owner sets state = 'applied' once its removal is committed.
CREATE TABLE retention_requests (
    vhost text NOT NULL,
    queue text NOT NULL,
    run_id text NOT NULL,
    epoch bigint NOT NULL,
    state text NOT NULL DEFAULT 'pending' CHECK (state IN ('pending', 'applied')),
    created_at double precision NOT NULL,
    applied_at double precision NULL,
    applied_by text NULL,
    PRIMARY KEY (vhost, queue, run_id)
);

-- Nodes that apply retention requests, each refreshing its row; a job that
-- finds none alive deletes directly (the epoch fence covers a node starting meanwhile).
CREATE TABLE retention_watchers (
    node text PRIMARY KEY,
    expires_at double precision NOT NULL
);

-- Named leases (one retention run at a time, cluster-wide): taken and renewed
-- with a conditional UPDATE (free, expired, or already ours).
CREATE TABLE leases (
    name text PRIMARY KEY,
    holder text NOT NULL,
    expires_at double precision NOT NULL
);
