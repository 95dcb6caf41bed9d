-- Policies as RabbitMQ defines them (mirrors migrations/postgres/020_policies.sql).
-- One notion of policy: the node applies them to live queues (core/engine/policy.py)
-- and the retention job reads the same rows (spark/policies.py). The retention
-- policies of migration 002 become policies of vhost '/' that apply to queues.
-- Numbered 020 so it never collides with migrations other branches add meanwhile.
CREATE TABLE policies (
    vhost TEXT NOT NULL,
    name TEXT NOT NULL,
    operator INTEGER NOT NULL DEFAULT 0,
    pattern TEXT NOT NULL,
    apply_to TEXT NOT NULL DEFAULT 'all',
    priority INTEGER NOT NULL DEFAULT 0,
    definition TEXT NOT NULL,
    updated_at REAL NOT NULL DEFAULT 0,
    PRIMARY KEY (vhost, operator, name)
);
INSERT INTO policies (vhost, name, operator, pattern, apply_to, priority, definition, updated_at)
SELECT '/', name, 0, pattern, 'queues', 0,
       json_patch('{}', json_object(
           'max-age', CASE WHEN max_age_seconds IS NULL THEN NULL
                           ELSE CAST(max(1, round(max_age_seconds)) AS INTEGER) || 's' END,
           'max-length-bytes', max_bytes,
           'max-length', max_length,
           'archive', json(CASE WHEN archive THEN 'true' ELSE 'false' END))),
       created_at
FROM retention_policies;
DROP TABLE retention_policies;
